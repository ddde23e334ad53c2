"""The outbound id lease of a persisted slot (sans-IO; issue #17).

Ids are leased in blocks persisted before use, so a restarted agent never stamps an id a crashed run may
have published: the coordinator never stamps an id at or above ``lease_end``.  The Trio shell checks
:meth:`OutboundIdLease.ids_available` against :meth:`OutboundIdLease.ids_needed` before it hands work over,
and waits for :meth:`OutboundIdLease.set_lease_end` when the work could cross the lease.
"""

from __future__ import annotations

from kvagent.model.events import U64_MAX, IngressChunk, SourceSignal

__all__ = ["OutboundIdLease"]


class OutboundIdLease:
    """The lease half of SlotCoordinator (which sets these attributes in its constructor)."""

    _next_outbound_id: int
    _lease_end: int | None
    _id_limit: int  # the lease end, or U64_MAX (never an id) without a lease: _take_outbound_id's one bound

    @property
    def lease_end(self) -> int | None:
        return self._lease_end

    def set_lease_end(self, lease_end: int) -> None:
        """The persisted lease now reaches ``lease_end`` (it never moves back)."""
        if self._lease_end is None or lease_end > self._lease_end:
            self._lease_end = lease_end
            self._id_limit = min(lease_end, U64_MAX)

    def ids_available(self) -> int | None:
        """Ids that may still be stamped under the lease (None: no lease)."""
        return None if self._lease_end is None else max(0, self._id_limit - self._next_outbound_id)

    @staticmethod
    def ids_needed(item: IngressChunk | SourceSignal) -> int:
        """The most outbound ids handling ``item`` can take (an event each, plus a restart barrier)."""
        if type(item) is IngressChunk:
            return len(item.events) + 1
        return 1 if isinstance(item, SourceSignal) and item.reset else 0
