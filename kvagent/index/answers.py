"""What the recovery index answers: range answers (docs/spec/agent-semantics.md 4.4) and the dump snapshot (4.5)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

import attrs

from kvagent.index.store import StoreColumns
from kvagent.model.events import RESET_ALL, ResetScope, ResidencyDomain, RouterEvent, StorageTier
from kvagent.model.ids import CacheOwnerId

__all__ = [
    "DumpGroup",
    "DumpSnapshot",
    "EventsAnswer",
    "InvalidRangeAnswer",
    "RangeAnswer",
    "TooNewAnswer",
    "TreeDumpAnswer",
    "TreeDumpFailedAnswer",
]


# --- answers to a range query (4.4) -----------------------------------------------------------------


@attrs.frozen(slots=True)
class EventsAnswer:
    """The buffered events from the requested start through the newest.

    From the index, ``events`` is a :class:`~kvagent.index.ring.RingEvents`: the ring's columns, decoded
    into RouterEvents only when read; encoders take its ``ring_range`` instead.
    """

    events: Sequence[RouterEvent]
    last_event_id: int


@attrs.frozen(slots=True)
class TreeDumpAnswer:
    """Every resident block as a one-block Stored event (ids from 0), parents first."""

    events: tuple[RouterEvent, ...]
    last_event_id: int
    reset_scope: ResetScope = RESET_ALL


@attrs.frozen(slots=True)
class TooNewAnswer:
    """The requested start lies after the newest buffered event (the requester is ahead of this index)."""

    requested_start: int | None
    requested_end: int | None
    newest_available: int


@attrs.frozen(slots=True)
class InvalidRangeAnswer:
    """The requested end lies before the requested start."""

    start_id: int
    end_id: int


@attrs.frozen(slots=True)
class TreeDumpFailedAnswer:
    """A dump that could not be built (4.5): reported as such, never as an empty dump."""

    last_event_id: int
    message: str


RangeAnswer: TypeAlias = (
    EventsAnswer | TreeDumpAnswer | TooNewAnswer | InvalidRangeAnswer | TreeDumpFailedAnswer
)


class DumpGroup(NamedTuple):
    """One (owner, tier) of a dump: the fields every one of its events shares, and its block columns."""

    worker_id: int
    tier: StorageTier
    domain: ResidencyDomain
    dp_rank: int
    source: CacheOwnerId | None
    columns: StoreColumns


class DumpSnapshot(NamedTuple):
    """A consistent copy of the resident state: what a tree dump answer carries, before any encoding.

    The n-th live row over ``groups`` (in order) is the dump's event n; ``last_event_id`` is the newest
    applied id at the moment of the copy.
    """

    groups: tuple[DumpGroup, ...]
    last_event_id: int
    events: int
