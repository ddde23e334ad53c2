"""The outbound id lease of a persisted slot (sans-IO; issue #17).

Ids are leased in blocks persisted before use, so a restarted agent never stamps an id a crashed run may
have published: the coordinator never stamps an id at or above ``lease_end``.  The Trio shell checks
:meth:`OutboundIdLease.ids_available` against :meth:`OutboundIdLease.ids_needed` before it hands work over,
and waits for :meth:`OutboundIdLease.set_lease_end` when the work could cross the lease.
"""

from __future__ import annotations

import attrs

from kvagent.model.events import U64_MAX, IngressChunk, SourceSignal

__all__ = ["OutboundIdLease"]


@attrs.define
class OutboundIdLease:
    """The next outbound id and the bound it may not reach; owned by one SlotCoordinator.

    ``id_limit`` is the lease end, or U64_MAX (never an id) without a lease: :meth:`take`'s single bound.
    """

    next_id: int
    lease_end: int | None = None
    id_limit: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.next_id < U64_MAX:
            raise ValueError(f"first_outbound_id must be in [1, U64_MAX), got {self.next_id}")
        self.id_limit = U64_MAX if self.lease_end is None else min(self.lease_end, U64_MAX)

    @property
    def last_taken(self) -> int:
        """The last id stamped (the outbound cursor), 0 before any."""
        return self.next_id - 1

    def set_lease_end(self, lease_end: int) -> None:
        """The persisted lease now reaches ``lease_end`` (it never moves back)."""
        if self.lease_end is None or lease_end > self.lease_end:
            self.lease_end = lease_end
            self.id_limit = min(lease_end, U64_MAX)

    def ids_available(self) -> int | None:
        """Ids that may still be stamped under the lease (None: no lease)."""
        return None if self.lease_end is None else max(0, self.id_limit - self.next_id)

    @staticmethod
    def ids_needed(item: IngressChunk | SourceSignal) -> int:
        """The most outbound ids handling ``item`` can take (an event each, plus a restart barrier)."""
        if type(item) is IngressChunk:
            return len(item.events) + 1
        return 1 if isinstance(item, SourceSignal) and item.reset else 0

    def take(self) -> int | None:
        """The next id (strictly increasing, never reused, never U64_MAX), or None at ``id_limit``."""
        event_id = self.next_id
        if event_id >= self.id_limit:
            return None
        self.next_id = event_id + 1
        return event_id

    def exhausted_for_good(self) -> bool:
        """The id space itself is used up (no lease extension can help)."""
        return self.next_id >= U64_MAX
