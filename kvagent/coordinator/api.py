"""What the slot coordinator shares with its callers: its errors, its counters and the index it drives."""

from __future__ import annotations

from typing import Protocol

import attrs

from kvagent.model.errors import CoordinatorClosed, CoordinatorError
from kvagent.model.events import RouterEvent

__all__ = ["CoordinatorClosed", "CoordinatorCounters", "CoordinatorError", "LocalIndex"]


class LocalIndex(Protocol):
    """What the coordinator needs of :class:`kvagent.index.recovery_index.RecoveryIndex`."""

    def apply(self, event: RouterEvent) -> None: ...

    def current_event_id(self) -> int: ...


@attrs.define(slots=True)
class CoordinatorCounters:
    """Plain counters, read by the metrics endpoint at scrape time (never reset)."""

    events_in: int = 0
    events_published: int = 0
    events_out_ids: int = 0
    filtered: dict[str, int] = attrs.Factory(dict)
    dropped_events: int = 0  # engines_dropped_events: raw batches lost to cursor gaps
    quarantines: dict[str, int] = attrs.Factory(dict)
    attachments: int = 0
    restarts: int = 0
    publications: int = 0
    publication_failures: int = 0
    source_losses: int = 0
    ingress_chunks: int = 0

    def count_filtered(self, reason: str, n: int = 1) -> None:
        if n:
            self.filtered[reason] = self.filtered.get(reason, 0) + n
