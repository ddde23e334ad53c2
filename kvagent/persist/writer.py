"""The persistence task of one slot: trails the outbound stream into its :class:`SlotStore`, off the event loop.

Pull model (docs/durability.md): the task wakes when the coordinator publishes a status (once per ingress
drain), takes in ONE synchronous step the ring's events after the last persisted id and the coordinator's
source progress, and hands both to a worker thread as one transaction.  Publishing never waits for it; while
a write runs further drains accumulate and go into the next transaction, so a slow disk makes bigger
transactions, not a slower stream.

When the ring has already evicted events the task never persisted (it fell behind) or the suffix outgrew
the resident state, the task writes a compacted snapshot instead: the index's ``dump_snapshot()`` is a
consistent copy taken on the loop, turned into events in the worker thread.

Outbound ids are leased: the store holds ``lease_end`` and the coordinator never stamps an id at or above
it.  The task extends the lease (durably, then tells the coordinator) once half of it is used.

An I/O error (disk full, a read-only file system) never stops the slot: the task marks itself failed, keeps
retrying with back-off and, once a write succeeds again, starts over with a fresh snapshot.
"""

from __future__ import annotations

import enum
import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Protocol

import attrs
import structlog
import trio

from kvagent._util.gcutil import gc_paused
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.index.ring import RingRange
from kvagent.model.events import RouterEvent
from kvagent.model.status import PersistenceStatus
from kvagent.persist.columns import encode_ring_batch
from kvagent.persist.store import LEASE_BLOCK, AttachmentProgress, MirrorRow, SlotStore, StoreWriteError

__all__ = [
    "IO_ERRORS",
    "LEASE_BLOCK",
    "LeaseHolder",
    "PersistenceOptions",
    "PersistenceState",
    "PersistenceStatistics",
    "PersistenceWriter",
    "RepublishMirror",
]

log = structlog.get_logger(__name__)


class PersistenceState(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    OFF = "off"


class LeaseHolder(Protocol):
    """The coordinator side of the outbound id lease."""

    def set_lease_end(self, lease_end: int) -> None: ...

    @property
    def lease_blocked(self) -> bool: ...


class MirrorSnapshot(Protocol):
    """The republish mirror frozen as of now: iterate it anywhere, close it on the event loop."""

    def __iter__(self) -> Iterator[MirrorRow]: ...

    def close(self) -> None: ...


class RepublishMirror(Protocol):
    """The republished stream's persisted part: its last seq and its Worker mirror (with tokens)."""

    def last_seq(self) -> int | None: ...

    def open_mirror(self) -> MirrorSnapshot | None:
        """The mirror frozen now, or None while it lags the published batches (try again shortly)."""
        ...


@attrs.frozen(slots=True)
class PersistenceOptions:
    lease_block: int = LEASE_BLOCK
    # Compaction: a snapshot once the suffix holds more than max(min, factor x resident blocks) events.
    compact_min_events: int = 4096
    compact_factor: int = 2
    # The shortest time between two appends: more events a transaction, fewer commits and thread hops.
    min_interval: float = 0.02
    # Events held for the next write beyond which a snapshot is written instead (a very slow disk).
    max_held_events: int = 1 << 20
    retry_initial: float = 1.0
    retry_max: float = 30.0


@attrs.frozen(slots=True)
class PersistenceStatistics:
    """The writer at one instant; ``lag_events`` = applied ids not yet persisted."""

    state: PersistenceState
    persisted_id: int
    appends: int
    snapshots: int
    disk_bytes: int
    failures: int
    lag_events: int
    lease_end: int

    def status(self) -> PersistenceStatus:
        return PersistenceStatus(self.state.value, self.persisted_id, self.lag_events, self.disk_bytes)


MIRROR_RETRY = 0.05

# Errors of the disk, not of our logic: the slot keeps serving from memory and the writer retries.
IO_ERRORS = (StoreWriteError, OSError, sqlite3.Error)


class PersistenceWriter:
    """One slot's persistence task (:meth:`run`) and its clean-stop step (:meth:`close_clean`)."""

    def __init__(
        self,
        store: SlotStore,
        *,
        index: RecoveryIndex,
        wait_until: Callable[[Callable[[], bool]], Awaitable[object]],
        progress: Callable[[], AttachmentProgress | None],
        lease: LeaseHolder,
        persisted_id: int,
        first_id: int,
        lease_end: int,
        republish_lease_end: int = 1,
        republish_first_seq: int = 0,
        suffix_length: int = 0,
        republish: RepublishMirror | None = None,
        options: PersistenceOptions = PersistenceOptions(),
    ) -> None:
        self._store = store
        self._index = index
        self._wait_until = wait_until
        self._progress = progress
        self._lease = lease
        self._republish = republish
        self._options = options
        self._persisted_id = persisted_id
        self._first_id = first_id  # the first outbound id this run may stamp
        self._persisted_progress: AttachmentProgress | None = None
        self._lease_end = lease_end
        self._republish_lease_end = republish_lease_end
        self._republish_first_seq = republish_first_seq
        self._suffix = suffix_length
        self._state = PersistenceState.OK
        self._needs_snapshot = False
        self._appends = 0
        self._snapshots = 0
        self._failures = 0
        self._disk_bytes = 0
        self._lock = trio.Lock()  # one thread at a time on the slot's connection
        # How the events applied since the last write are collected. Without a republisher (tokens are not
        # persisted) the index's ring keeps its evicted segments until they are written (the ring of 1024
        # events alone is far too short at burst rates) and the append is encoded from those columns: no
        # per-event callback, no RouterEvent kept (issue #34). A republishing slot persists the tokens,
        # which the ring does not hold: it collects the events by an index subscription.
        self._from_ring = republish is None
        self._following = False
        self._events: list[RouterEvent] = []
        self._unsubscribe: Callable[[], None] | None = None

    # --- read side ---------------------------------------------------------------------------------

    @property
    def state(self) -> PersistenceState:
        return self._state

    def statistics(self) -> PersistenceStatistics:
        return PersistenceStatistics(
            state=self._state,
            persisted_id=self._persisted_id,
            appends=self._appends,
            snapshots=self._snapshots,
            disk_bytes=self._disk_bytes,
            failures=self._failures,
            lag_events=max(0, self._index.current_event_id() - self._persisted_id),
            lease_end=self._lease_end,
        )

    def _has_work(self) -> bool:
        return (
            self._needs_snapshot
            or self._index.current_event_id() > self._persisted_id
            or self._progress() != self._persisted_progress
            or self._lease_due()
        )

    def _lease_due(self) -> bool:
        if self._lease.lease_blocked:
            return True
        half = self._options.lease_block // 2
        if self._index.current_event_id() + half >= self._lease_end:
            return True
        if self._republish is None:
            return False
        seq = self._republish.last_seq()
        return seq is not None and seq + half >= self._republish_lease_end

    # --- the task ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Persist until cancelled; never raises for a disk error (it retries with back-off)."""
        self._follow()
        if self._index.current_event_id() != self._persisted_id:
            self._needs_snapshot = True  # applied before we followed: only a snapshot holds those
        self._disk_bytes = await trio.to_thread.run_sync(self._store.disk_bytes)
        task_status.started()
        await self._loop()

    def _follow(self) -> None:
        """Collect every event the index applies from now on (retained ring segments, or a subscription)."""
        self._stop_following()
        self._following = True
        if self._from_ring:
            self._index.retain_applied(True)
        else:
            self._unsubscribe = self._index.subscribe(self._events.append)

    def _stop_following(self) -> None:
        self._following = False
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._from_ring:
            self._index.retain_applied(False)
        self._events.clear()

    def _held_events(self) -> int:
        return self._index.retained_applied_events() if self._from_ring else len(self._events)

    async def _loop(self) -> None:
        delay = self._options.retry_initial
        while True:
            await self._wait_until(self._has_work)
            try:
                await self.flush()
            except Exception as exc:
                if not isinstance(exc, IO_ERRORS):  # a bug of ours: still never worth stopping the slot
                    log.exception("persistence_write_failed")
                self._fail(exc, delay)
                await trio.sleep(delay)  # back-off between retries of a failing disk, not synchronisation
                delay = min(delay * 2, self._options.retry_max)
                continue
            if self._state is PersistenceState.FAILED:
                log.info("persistence_recovered", persisted_id=self._persisted_id)
            self._state = PersistenceState.OK
            delay = self._options.retry_initial
            await trio.sleep(self._options.min_interval)  # batching: let a few drains accumulate

    def _fail(self, exc: BaseException, delay: float) -> None:
        self._failures += 1
        # What failed may have been only half applied on our side: start over from a snapshot, and hold no
        # events meanwhile (a disk that fails for minutes must not grow our memory).
        self._needs_snapshot = True
        self._stop_following()
        if self._state is not PersistenceState.FAILED:
            log.error("persistence_failed", error=str(exc), retry_in=delay)
        self._state = PersistenceState.FAILED

    async def flush(self) -> None:
        """Persist everything applied so far (and extend the lease if due) in one transaction each."""
        async with self._lock:
            if self._lease_due():
                await self._extend_lease()
            current = self._index.current_event_id()
            progress = self._progress()
            if self._snapshot_due(current):
                if not await self._write_snapshot(progress):
                    self._needs_snapshot = True
                    await trio.sleep(MIRROR_RETRY)  # a republish snapshot stream holds the mirror back
                    return
            elif current > self._persisted_id or progress != self._persisted_progress:
                if self._from_ring:
                    # Every event after the persisted id, as column pieces taken in this synchronous step
                    # (later applies never change them); encoded and written in the worker thread.
                    applied = self._index.applied_after(self._persisted_id)
                    await trio.to_thread.run_sync(self._append_columns, applied, progress)
                    self._index.release_applied_through(current)
                    count = applied.length
                else:
                    tail = self._events[:]  # every event after the persisted id, in this same synchronous step
                    self._events.clear()
                    # Tokens only for a slot that republishes (the mirror reads them back); they are most of
                    # a store's bytes (issue #17's bench: the write competes with ingest).
                    await trio.to_thread.run_sync(partial(self._store.append, tail, progress, tokens=True))
                    count = len(tail)
                self._appends += 1
                self._suffix += count
            self._persisted_id = max(self._persisted_id, current)
            self._persisted_progress = progress
            self._disk_bytes = await trio.to_thread.run_sync(self._store.disk_bytes)

    def _snapshot_due(self, current: int) -> bool:
        if self._needs_snapshot:
            return True
        if not self._following or self._held_events() > self._options.max_held_events:
            return True  # not following (after a failure), or far behind: a snapshot is cheaper
        if current <= self._persisted_id:
            return False
        options = self._options
        bound = max(options.compact_min_events, options.compact_factor * self._index.resident_block_count)
        return self._suffix + (current - self._persisted_id) > bound

    async def _write_snapshot(self, progress: AttachmentProgress | None) -> bool:
        """Write a snapshot (False: the republish mirror lags just now; the caller tries again)."""
        mirror: MirrorSnapshot | None = None
        if self._republish is not None:
            mirror = self._republish.open_mirror()
            if mirror is None:
                return False
        snapshot = self._index.dump_snapshot()
        if not self._following:
            self._follow()  # in the same synchronous step as the copy: the next events follow it
        elif self._from_ring:
            self._index.release_applied_through(snapshot.last_event_id)
        else:
            self._events.clear()
        try:
            await trio.to_thread.run_sync(
                self._store.write_snapshot,
                snapshot.last_event_id,
                snapshot,  # a consistent copy: encoded in the worker thread
                () if mirror is None else mirror,
                progress,
            )
        finally:
            if mirror is not None:
                mirror.close()
        self._snapshots += 1
        self._suffix = 0
        self._needs_snapshot = False
        log.debug("persistence_snapshot", at_id=snapshot.last_event_id, events=snapshot.events)
        return True

    async def _extend_lease(self) -> None:
        block = self._options.lease_block
        lease_end = self._index.current_event_id() + block
        republish_end: int | None = None
        if self._republish is not None:
            seq = self._republish.last_seq()
            republish_end = max(self._republish_lease_end, (seq or 0) + block)
        await trio.to_thread.run_sync(self._store.extend_lease, lease_end, republish_end)
        self._lease_end = lease_end
        if republish_end is not None:
            self._republish_lease_end = republish_end
        self._lease.set_lease_end(lease_end)

    def _append_columns(self, applied: RingRange, progress: AttachmentProgress | None) -> None:
        """The worker thread's append of ring columns (``encode_batch`` bytes, tokens left out)."""
        # The rows are acyclic lists: collections their allocation triggers would re-walk the whole heap
        # (measured: 1.9 -> 1.1 us per event encoded, 2,000-event appends).
        with gc_paused():
            body, ids = encode_ring_batch(applied) if applied.length else (b"", ())
        self._store.append_encoded(ids, body, progress)

    async def close_clean(self) -> None:
        """The clean stop: persist the rest and record ``lease_end = last id + 1`` (no id jump on restart).

        Call it once nothing applies any more (the coordinator has stopped).
        """
        await self.flush()
        last = self._index.current_event_id()
        stamped = last if last >= self._first_id else None  # None: this run stamped no id
        republish_seq = None if self._republish is None else self._republish.last_seq()
        if republish_seq is not None and republish_seq < self._republish_first_seq:
            republish_seq = None
        async with self._lock:
            await trio.to_thread.run_sync(
                partial(self._store.mark_clean, stamped, last_republish_seq=republish_seq)
            )
        self._stop_following()
