"""In-process discovery for tests and single-process deployments, with fault injection."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import trio

from kvagent._util.sync import Changed, checkpoint
from kvagent.discovery.base import DiscoveryRecord, check_topic
from kvagent.discovery.ownership import SlotClaim, SlotHolder, ownership_refused
from kvagent.model.errors import DiscoveryConflict, DiscoveryError

__all__ = ["InjectedFailure", "MemoryDiscovery", "OperationAttempt"]

OPERATIONS = frozenset({"register", "unregister", "list"})


class InjectedFailure(DiscoveryError):
    """Raised by an operation that a test asked to fail."""


@attrs.frozen(slots=True)
class OperationAttempt:
    """One call into the backend, with the Trio clock time it started (lets tests check backoff)."""

    operation: str
    topic: str | None
    record_id: int | None
    at: float
    failed: bool


class MemoryDiscovery:
    """Records kept in a dict; every call is recorded in :attr:`attempts`.

    Fault injection: :meth:`fail_next` fails the next *n* calls of the chosen operations, and
    :meth:`set_failing` fails every call of them until switched off.  :meth:`wait_for` (a condition on
    the record set) and :meth:`wait_for_attempts` (a number of calls) wait without sleeping.
    """

    def __init__(self) -> None:
        self._records: dict[tuple[str, int], DiscoveryRecord] = {}
        self._changed = Changed()
        self._fail_remaining = 0
        self._fail_on: frozenset[str] = frozenset()
        self._failing_on: frozenset[str] = frozenset()
        self._closed = False
        self._owners: dict[str, SlotHolder] = {}
        self.attempts: list[OperationAttempt] = []

    # -- fault injection -------------------------------------------------------------------------

    def fail_next(self, n: int, on: Iterable[str] = ("register", "unregister")) -> None:
        operations = self._operations(on)
        if n < 0:
            raise ValueError("fail_next needs n >= 0")
        self._fail_remaining = n
        self._fail_on = operations

    def set_failing(self, failing: bool, on: Iterable[str] = ("register", "unregister")) -> None:
        self._failing_on = self._operations(on) if failing else frozenset()

    @staticmethod
    def _operations(on: Iterable[str]) -> frozenset[str]:
        operations = frozenset([on] if isinstance(on, str) else on)
        unknown = operations - OPERATIONS
        if unknown:
            raise ValueError(f"unknown discovery operations {sorted(unknown)}")
        return operations

    def _enter(self, operation: str, topic: str | None, record_id: int | None) -> None:
        if self._closed:
            raise DiscoveryError("memory discovery is closed")
        failed = operation in self._failing_on
        if not failed and operation in self._fail_on and self._fail_remaining > 0:
            self._fail_remaining -= 1
            failed = True
        self.attempts.append(OperationAttempt(operation, topic, record_id, trio.current_time(), failed))
        self._notify()
        if failed:
            raise InjectedFailure(f"injected {operation} failure")

    def attempt_times(self, operation: str) -> list[float]:
        return [attempt.at for attempt in self.attempts if attempt.operation == operation]

    # -- observation -----------------------------------------------------------------------------

    @property
    def records(self) -> dict[tuple[str, int], DiscoveryRecord]:
        """A snapshot of the current records keyed by (topic, record_id)."""
        return dict(self._records)

    @property
    def owners(self) -> dict[str, SlotHolder]:
        """A snapshot of the held slot claims keyed by CacheOwnerId text."""
        return dict(self._owners)

    async def wait_for(
        self, predicate: Callable[[dict[tuple[str, int], DiscoveryRecord]], bool]
    ) -> dict[tuple[str, int], DiscoveryRecord]:
        """Wait until ``predicate(records)`` holds and return that snapshot."""
        await self._changed.wait_for(lambda: predicate(self.records))
        return self.records

    async def wait_for_attempts(self, count: int, operation: str | None = None) -> list[OperationAttempt]:
        """Wait until at least ``count`` calls (of ``operation``, if given) were made; return them."""

        def made() -> list[OperationAttempt]:
            return [a for a in self.attempts if operation is None or a.operation == operation]

        await self._changed.wait_for(lambda: len(made()) >= count)
        return made()

    def _notify(self) -> None:
        self._changed.notify()

    # -- Discovery -------------------------------------------------------------------------------

    async def register(self, record: DiscoveryRecord) -> None:
        await checkpoint()
        self._enter("register", record.topic, record.record_id)
        existing = self._records.get(record.key)
        if existing is not None:
            if existing == record:
                return
            raise DiscoveryConflict(
                f"record {record.record_id} on topic {record.topic!r} is already registered with a different payload"
            )
        self._records[record.key] = record
        self._notify()

    async def unregister(self, topic: str, record_id: int) -> None:
        await checkpoint()
        check_topic(topic)
        self._enter("unregister", topic, record_id)
        if self._records.pop((topic, record_id), None) is not None:
            self._notify()

    async def list(self, topic: str | None = None) -> list[DiscoveryRecord]:
        await checkpoint()
        if topic is not None:
            check_topic(topic)
        self._enter("list", topic, None)
        return [record for key, record in sorted(self._records.items()) if topic is None or key[0] == topic]

    async def aclose(self) -> None:
        await checkpoint()
        self._closed = True

    # -- SlotOwnership (not recorded in attempts: those count the Discovery calls) ------------------

    async def claim_slot(self, holder: SlotHolder) -> SlotClaim:
        await checkpoint()
        if self._closed:
            raise DiscoveryError("memory discovery is closed")
        existing = self._owners.get(holder.cache_owner_id)
        if existing is not None:
            raise ownership_refused(holder, existing, hint=" (in this process)")
        self._owners[holder.cache_owner_id] = holder
        self._notify()
        return _MemoryClaim(self, holder)

    def _release(self, holder: SlotHolder) -> None:
        if self._owners.get(holder.cache_owner_id) is holder:
            del self._owners[holder.cache_owner_id]
            self._notify()


class _MemoryClaim:
    def __init__(self, discovery: MemoryDiscovery, holder: SlotHolder) -> None:
        self._discovery = discovery
        self._holder = holder

    async def release(self) -> None:
        await checkpoint()
        self._discovery._release(self._holder)
