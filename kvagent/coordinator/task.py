"""The Trio shell around :class:`~kvagent.coordinator.machine.SlotCoordinator` (docs/spec/agent-semantics.md 3.2).

``open_coordinator(core)`` returns a :class:`CoordinatorHandle` (what the agent and the listener hold) and
``run(*, task_status)`` (the coordinator task).  One :class:`~kvagent._util.sync.ControlFirstInbox` feeds
the task, with two queues:

- **control**, bounded at 16: lifecycle commands, each a :class:`~kvagent._util.sync.Request` with its own
  one-shot reply;
- **ingress**, unbounded: the listener's chunks and its :class:`~kvagent.model.events.SourceSignal` verdicts,
  in one order, admitted with ``put_nowait`` so that admission never waits on coordinator progress (3.10:
  Stored/Removed are lossy, not flow-controlled). The listener bounds it in bytes instead: it waits on
  :meth:`CoordinatorHandle.wait_ingress_bytes_at_most` before decoding more.

Priority is exact: before every command and every drain of ingress (at most :data:`DRAIN_CHUNKS` chunks,
handled inside ``SlotCoordinator.ingress_batch``) the task tries control first, so a queued command is
always handled before any queued ingress.  Work runs in slices of about :data:`SLICE_SECONDS` between
checkpoints; when both queues are empty the task sleeps until the inbox receives something or closes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import structlog
import trio

from kvagent._util.sync import Changed, ControlFirstInbox, Request, checkpoint, checkpoint_if_cancelled
from kvagent.coordinator.machine import CoordinatorStatistics, SlotCoordinator, SourceProgress
from kvagent.model.errors import CoordinatorClosed, CoordinatorError
from kvagent.model.events import IngressChunk, SourceSignal
from kvagent.model.status import AgentStatus, Attachment

__all__ = [
    "CONTROL_CAPACITY",
    "CoordinatorHandle",
    "IngressItem",
    "IngressMeter",
    "StatusCell",
    "admit_ingress",
    "open_coordinator",
]

log = structlog.get_logger(__name__)

CONTROL_CAPACITY = 16
# Work runs in slices of about a millisecond: long enough that checkpoints cost little throughput, short
# enough that recovery requests and other tasks on the same event loop wait at most about that long.
SLICE_SECONDS = 0.001
DRAIN_CHUNKS = 8  # chunks taken per drain: at ~15 us per event, about a slice
INGRESS_CLOSED = "state-agent ingress coordinator is closed"

T = TypeVar("T")
IngressItem = IngressChunk | SourceSignal
_Invoke = Callable[[SlotCoordinator, Iterable[IngressItem]], T]


class _Command(Request[T]):
    """One control command and its one-shot reply.

    A caller that stops waiting before the task has run the command abandons it: the task skips it, so
    a call cancelled before it ran has done nothing (never "ran after its waiter left", issue #28 item 4).
    A command that ran stays done, even if its caller is cancelled before it reads the reply (the slot
    task rolls back whatever a cancelled step had begun).
    """

    __slots__ = ("dropped_message", "invoke", "stops")

    def __init__(self, invoke: _Invoke[T], dropped_message: str, *, stops: bool = False) -> None:
        super().__init__()
        self.invoke = invoke
        self.dropped_message = dropped_message
        self.stops = stops

    def execute(self, core: SlotCoordinator, queued: Iterable[IngressItem]) -> bool:
        """Run the command unless its caller abandoned it; True if it ran."""
        if self.abandoned():
            return False
        try:
            result = self.invoke(core, queued)
        except Exception as error:
            self.fail(error)
        else:
            self.reply(result)
        return True

    def drop(self) -> None:
        self.fail(CoordinatorClosed(self.dropped_message))


_Inbox = ControlFirstInbox[_Command[Any], IngressItem]


def _open_inbox() -> _Inbox:
    # Ingress is unbounded on purpose: the listener must never wait on the coordinator (3.10, 7.5). Memory
    # is bounded in bytes by the listener (IngressMeter); the coordinator drains in batches.
    return ControlFirstInbox[_Command[Any], IngressItem](CONTROL_CAPACITY)


class _LeaseGate:
    """Where the task waits for the persisted outbound id lease to cover its next work (issue #17)."""

    def __init__(self) -> None:
        self._extended = Changed()
        self.waiting = False  # the task is blocked on the lease (the persistence writer extends it at once)

    def extended(self) -> None:
        self._extended.notify()

    async def wait_for_room(self, core: SlotCoordinator, needed: int) -> None:
        available = core.ids_available()
        if available is None or available >= needed:
            return
        log.warning("outbound_id_lease_wait", needed=needed, available=available, lease_end=core.lease_end)
        self.waiting = True
        try:
            await self._extended.wait_for(lambda: _has_room(core, needed))
        finally:
            self.waiting = False


def _has_room(core: SlotCoordinator, needed: int) -> bool:
    available = core.ids_available()
    return available is None or available >= needed


class StatusCell:
    """Holds the current :class:`AgentStatus`; readers never see a partial update.

    The coordinator's ``on_status`` callback is :meth:`set`. ``wait_for`` lets tests and lifecycle code
    wait on a condition without polling or sleeping.
    """

    def __init__(self, initial: AgentStatus) -> None:
        self._status = initial
        self._changed = Changed()
        # Notified at each change of the attachment's status, not at mere cursor advances: the advertiser
        # and the stream writer read its version, look at the status, then wait past that version.
        self.attachment_changed = Changed()

    def get(self) -> AgentStatus:
        return self._status

    def set(self, status: AgentStatus) -> None:
        previous, self._status = self._status, status
        self._changed.notify()
        if status.attachment != previous.attachment:
            self.attachment_changed.notify()

    async def wait_for(self, predicate: Callable[[AgentStatus], bool]) -> AgentStatus:
        """Wait until ``predicate(status)`` is true and return that status."""
        await self._changed.wait_for(lambda: predicate(self._status))
        return self._status


def admit_ingress(inbox: ControlFirstInbox[Any, IngressItem], item: IngressItem) -> None:
    """Queue one chunk or signal without waiting; fails only when the coordinator is gone."""
    try:
        inbox.put_nowait(item)
    except trio.ClosedResourceError:
        raise CoordinatorClosed(INGRESS_CLOSED) from None


class IngressMeter:
    """Raw payload bytes of the chunks admitted and not yet handled, with a wait for it to fall (no polling).

    The handle adds at admission, the coordinator task subtracts once a chunk is handled; a waiter is woken
    by the first subtraction after it started waiting and checks again.
    """

    __slots__ = ("_drained", "bytes", "ids")

    def __init__(self) -> None:
        self.bytes = 0
        self.ids = 0  # the most outbound ids the queued items can take (the lease check before a command)
        self._drained = Changed()  # an increment per subtraction while nobody waits

    def add(self, nbytes: int, ids: int = 0) -> None:
        self.bytes += nbytes
        self.ids += ids

    def sub(self, nbytes: int, ids: int = 0) -> None:
        self.bytes -= nbytes
        self.ids -= ids
        self._drained.notify()

    def clear(self) -> None:
        """The queue is gone (the coordinator stopped): nothing is held any more."""
        self.sub(self.bytes, self.ids)

    async def wait_at_most(self, limit: int) -> None:
        await self._drained.wait_for(lambda: self.bytes <= limit)
        await checkpoint_if_cancelled()


class CoordinatorHandle:
    """The caller side of a running coordinator: async lifecycle commands and non-blocking admission."""

    def __init__(
        self,
        inbox: _Inbox,
        core: SlotCoordinator,
        meter: IngressMeter,
        lease: _LeaseGate | None = None,
        progress: Changed | None = None,
    ) -> None:
        self._inbox = inbox
        self._core = core
        self._meter = meter
        self._lease = lease if lease is not None else _LeaseGate()
        self._progress = progress if progress is not None else Changed()

    def admit_nowait(self, item: IngressChunk | SourceSignal) -> None:
        """Queue one ingress chunk or source signal without waiting, in order with everything admitted
        before it; raises CoordinatorClosed once the task is gone."""
        admit_ingress(self._inbox, item)
        self._meter.add(item.raw_bytes if type(item) is IngressChunk else 0, SlotCoordinator.ids_needed(item))

    # -- persistence hooks (issue #17): synchronous reads, consistent with everything handled so far ---

    @property
    def outbound_cursor(self) -> int:
        """The last outbound id stamped (0: none)."""
        return self._core.outbound_cursor

    def source_progress(self) -> SourceProgress | None:
        """(generation, engine seq, digest) of the last batch applied with complete history (see the core)."""
        return self._core.source_progress()

    def set_lease_end(self, lease_end: int) -> None:
        """The outbound id lease is persisted up to ``lease_end``: ids below it may be stamped."""
        self._core.set_lease_end(lease_end)
        self._lease.extended()

    @property
    def lease_blocked(self) -> bool:
        """The task is waiting for :meth:`set_lease_end` (the lease would be crossed)."""
        return self._lease.waiting

    async def wait_progress(self) -> None:
        """Return after the task next handles a drain of ingress or a command (or blocks on the lease)."""
        await self._progress.wait(self._progress.version)

    def statistics(self) -> CoordinatorStatistics:
        """The coordinator's counters, with the real ingress queue depth and bytes."""
        return self._core.counters.statistics(
            ingress_queue_depth=self.ingress_backlog, ingress_bytes=self._meter.bytes
        )

    @property
    def ingress_backlog(self) -> int:
        """Chunks and signals admitted but not yet taken by the coordinator."""
        return self._inbox.items_queued

    @property
    def ingress_bytes(self) -> int:
        """The ``raw_bytes`` of the chunks admitted and not yet handled."""
        return self._meter.bytes

    async def wait_ingress_bytes_at_most(self, limit: int) -> None:
        """Return once :attr:`ingress_bytes` is at most ``limit`` (woken by the coordinator, no polling)."""
        await self._meter.wait_at_most(limit)

    async def attach(self, attachment: Attachment, *, resume: tuple[int, int] | None = None) -> Attachment:
        """Attach (``resume``: a restarted agent's resumed attach, see SlotCoordinator.attach)."""
        return await self._call(
            lambda core, _: core.attach(attachment, resume=resume), "state-agent attach was dropped"
        )

    async def begin_detach(self, generation: int) -> None:
        await self._call(
            lambda core, _: core.begin_detach(generation), "state-agent detach begin was dropped"
        )

    async def complete_detach(self, generation: int) -> int:
        return await self._call(
            lambda core, queued: core.complete_detach(generation, queued),
            "state-agent detach completion was dropped",
        )

    async def quarantine(self, generation: int, reason: str) -> bool:
        """True when ``generation`` was the current attachment; a stale generation changes nothing."""
        return await self._call(
            lambda core, _: core.quarantine(generation, reason),
            "state-agent quarantine acknowledgement was dropped",
        )

    async def abort_attach(self, generation: int) -> None:
        await self._call(
            lambda core, _: core.abort_attach(generation), "state-agent abort attach was dropped"
        )

    async def report_source_loss(self, generation: int, lost_batches: int) -> None:
        await self._call(
            lambda core, _: core.report_source_loss(generation, lost_batches),
            "state-agent source loss report was dropped",
        )

    async def shutdown(self) -> None:
        """Stop the coordinator after everything queued before it; a no-op when it is already gone."""
        try:
            await self._call(lambda core, _: None, "state-agent shutdown was dropped", stops=True)
        except CoordinatorClosed:
            return

    def close(self) -> None:
        """Close the inbox: the task runs the commands already queued, then stops (dropping queued ingress)."""
        self._inbox.close()

    async def _call(self, invoke: _Invoke[T], dropped_message: str, *, stops: bool = False) -> T:
        command = _Command(invoke, dropped_message, stops=stops)
        try:
            try:
                self._inbox.send_control_nowait(command)
            except trio.WouldBlock:
                await self._inbox.send_control(command)
        except trio.ClosedResourceError:
            raise CoordinatorClosed() from None
        return await command.wait()


class _CoordinatorTask:
    def __init__(
        self,
        core: SlotCoordinator,
        inbox: _Inbox,
        meter: IngressMeter,
        lease: _LeaseGate,
        progress: Changed,
    ) -> None:
        self._core = core
        self._inbox = inbox
        self._meter = meter
        self._lease = lease
        self._progress = progress
        self._started = False
        self._newest_opened = 0  # the newest generation whose ingress was ever open (see _ingest)
        self._note_open_generation()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._started:
            raise RuntimeError("a coordinator task can only run once")
        self._started = True
        try:
            task_status.started()
            await self._loop()
        finally:
            self._close()

    async def _loop(self) -> None:
        clock = time.perf_counter
        inbox = self._inbox
        slice_end = clock() + SLICE_SECONDS
        while True:
            command = inbox.take_control_nowait()
            if command is None and inbox.closed:
                return  # closed and every queued command handled: the queued ingress is dropped
            if command is not None:
                if not command.stops and not command.abandoned():
                    # A command may publish a barrier and drain what is queued (CompleteDetach).
                    await self._await_lease(self._meter.ids + 1)
                if command.execute(self._core, self._queued()) and command.stops:
                    return
                self._note_open_generation()
            else:
                # No other task runs while this drain is handled, so no command can arrive meanwhile: taking
                # several chunks at once keeps the priority of control exact.
                items = inbox.take_items_nowait(DRAIN_CHUNKS)
                if not items:
                    await inbox.wait()
                    slice_end = clock() + SLICE_SECONDS
                    continue
                await self._await_lease(sum(map(SlotCoordinator.ids_needed, items)))
                with self._core.ingress_batch():
                    for item in items:
                        self._ingest(item)
            self._progress.notify()
            if clock() >= slice_end:
                await checkpoint()
                slice_end = clock() + SLICE_SECONDS

    async def _await_lease(self, needed: int) -> None:
        available = self._core.ids_available()
        if available is None or available >= needed:
            return  # no lease, or room: the common case costs one call
        self._progress.notify()  # whoever extends the lease hears about it now
        await self._lease.wait_for_room(self._core, needed)

    def _note_open_generation(self) -> None:
        open_generation = self._core.ingress_generation
        if open_generation is not None and open_generation > self._newest_opened:
            self._newest_opened = open_generation

    def _queued(self) -> Iterator[IngressItem]:
        """Everything already queued, taken without waiting (the CompleteDetach drain)."""
        while taken := self._inbox.take_items_nowait(1):
            item = taken[0]
            self._meter.sub(
                item.raw_bytes if type(item) is IngressChunk else 0, SlotCoordinator.ids_needed(item)
            )
            yield item

    def _ingest(self, item: IngressItem) -> None:
        open_generation = self._core.ingress_generation  # before: handling a fault closes it
        try:
            if isinstance(item, SourceSignal):
                try:
                    self._core.handle_signal(item)
                finally:
                    self._meter.sub(0, SlotCoordinator.ids_needed(item))
            else:
                try:
                    self._core.handle_ingress(item)
                finally:
                    self._meter.sub(item.raw_bytes, len(item.events) + 1)
        except CoordinatorError as error:
            generation = item.generation
            if generation <= self._newest_opened and generation != open_generation:
                # Admitted before its generation's ingress closed (a quarantine, a detach, the shutdown's
                # quarantine): expected, not an error; that attachment no longer claims to be ready.
                log.debug("late_ingress_discarded", generation=generation, error=str(error))
            else:
                log.error("ingress_failed", error=str(error), code=error.code)
        except Exception:
            log.exception("ingress_failed")

    def _close(self) -> None:
        # Close first, so later sends and admissions fail with CoordinatorClosed (and senders waiting for
        # room are refused); then answer every command still queued so no caller waits forever, and let go
        # of the queued ingress.
        inbox = self._inbox
        inbox.close()
        while (command := inbox.take_control_nowait()) is not None:
            command.drop()
        inbox.take_items_nowait()
        self._meter.clear()


def open_coordinator(
    core: SlotCoordinator,
) -> tuple[CoordinatorHandle, Callable[..., Awaitable[None]]]:
    """The handle and the ``run(*, task_status=trio.TASK_STATUS_IGNORED)`` coroutine function of one core."""
    inbox = _open_inbox()
    meter = IngressMeter()
    lease = _LeaseGate()
    progress = Changed()
    task = _CoordinatorTask(core, inbox, meter, lease, progress)
    handle = CoordinatorHandle(inbox, core, meter, lease, progress)
    return handle, task.run
