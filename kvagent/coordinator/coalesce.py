"""Coalescing of one ingress chunk's placement events (docs/spec/agent-semantics.md 3.8 step 1, Dynamo batching.rs).

Adjacent events merge when they share the coalescing key and their data is compatible; the result keeps
stream order. The key is ``(exact residency owner, the agent's CacheOwnerId, tier)``; inside one chunk the
attached worker and the agent's owner are fixed, so the exact owner is implied by the domain and the key
reduces to ``(domain, tier)``, plus ``dp_rank`` and ``session_id`` which must also be equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import cast

import attrs

from kvagent.model.events import (
    MAX_COALESCED_BLOCKS,
    Cleared,
    MmExtraInfo,
    PlacementEvent,
    Removed,
    Stored,
)

__all__ = ["coalesce"]


def coalesce(
    events: Sequence[PlacementEvent], *, max_blocks: int = MAX_COALESCED_BLOCKS
) -> list[PlacementEvent]:
    """Merge chain-continuing stores and adjacent removes; a Cleared is a barrier and stands alone.

    A merged event is flushed once it holds ``max_blocks`` blocks or more. Mergeable events are gathered
    into a run and joined once when the run ends (pairwise merging would copy the growing tuples and token
    bytes at every step); a run of one is the event itself, unchanged.
    """
    output: list[PlacementEvent] = []
    append = output.append
    run: list[PlacementEvent] = []
    blocks = 0
    for event in events:
        data = event.data
        if type(data) is Cleared:
            if run:
                append(_joined(run))
                run = []
            append(event)
            continue
        assert isinstance(data, Stored | Removed)
        if run and not _continues(run, event):
            append(_joined(run))
            run = []
        if not run:
            blocks = 0
        run.append(event)
        blocks += len(data.block_hashes)
        if blocks >= max_blocks:
            append(_joined(run))
            run = []
    if run:
        append(_joined(run))
    return output


def _continues(run: list[PlacementEvent], event: PlacementEvent) -> bool:
    """Whether ``event`` merges into the run (same key; a remove, or a store continuing the run's chain)."""
    pending = run[-1]
    new = event.data
    cls = type(new)
    if (
        type(pending.data) is not cls
        or pending.domain is not event.domain
        or pending.tier is not event.tier
        or pending.dp_rank != event.dp_rank
        or pending.session_id != event.session_id
    ):
        return False
    if cls is Removed:
        return True
    assert isinstance(new, Stored)
    # Only a continuation of the run's chain merges: the new event's parent is the run's last block.
    for part in reversed(run):
        hashes = part.data.block_hashes
        if hashes:
            return new.parent_hash == hashes[-1]
    return False


def _joined(run: list[PlacementEvent]) -> PlacementEvent:
    first = run[0]
    if len(run) == 1:
        return first
    parts = [event.data for event in run]
    if type(first.data) is Removed:
        return attrs.evolve(first, data=Removed(tuple(chain.from_iterable(p.block_hashes for p in parts))))
    stores = cast(list[Stored], parts)
    return attrs.evolve(first, data=_joined_stored(stores))


def _joined_stored(parts: list[Stored]) -> Stored:
    first = parts[0]
    mm_infos: tuple[MmExtraInfo | None, ...] | None = None
    if any(part.mm_extra_infos is not None for part in parts):
        mm_infos = tuple(chain.from_iterable(_mm_or_blank(part) for part in parts))
    token_parts = [part.token_bytes for part in parts]
    return Stored(
        parent_hash=first.parent_hash,
        block_hashes=tuple(chain.from_iterable(part.block_hashes for part in parts)),
        tokens_hashes=tuple(chain.from_iterable(part.tokens_hashes for part in parts)),
        mm_extra_infos=mm_infos,
        start_position=first.start_position,
        # Tokens are republished only when every merged block has them (a partial list would misalign).
        token_bytes=None if None in token_parts else b"".join(cast(list[bytes], token_parts)),
    )


def _mm_or_blank(data: Stored) -> tuple[MmExtraInfo | None, ...]:
    if data.mm_extra_infos is not None:
        return data.mm_extra_infos
    return (None,) * len(data.block_hashes)
