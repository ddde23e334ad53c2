"""The slot task: the one owner of a slot's attach, detach, quarantine, ad registration and shutdown.

Callers (:class:`~kvagent.agent.slot.SlotAgent`, the ad keeper) hand it commands over a bounded memory
channel; it runs them one at a time, in order, each to completion.  A caller's cancellation only stops the
caller waiting:

- a command not yet begun is skipped (nothing happened);
- a command begun runs on in the slot task, which finishes it or, if a step fails, rolls it back: an attach
  whose listener could not start is aborted (no barrier), one whose ad could not be registered, or whose
  listener ended meanwhile, is detached again (final barrier) and its ad withdrawn.

So after any call, cancelled or not, the slot is fully attached (coordinator attachment, listener, ad while
ready), fully quarantined, or fully not attached.  Every step is bounded by a cancel scope
(``lifecycle_step_timeout``); the detach's required ad withdrawal retries until discovery answers (7.4),
and only the shutdown interrupts it.

The shutdown (docs/spec/agent-semantics.md 7.8, steps 1-3) runs when the ladder stops this task: queued commands are
refused, the command in progress finishes, then the current attachment is quarantined, its ad withdrawn
and its listener stopped.  Stopping the coordinator, joining the supervisor and withdrawing the source ad
are the outer rungs' (:mod:`kvagent.agent.slot`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Generic, TypeVar

import attrs
import structlog
import trio
import zmq

from kvagent.agent.advertising import AttachmentAdKeeper
from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.agent.durable import DurableSlot
from kvagent.agent.staleness import run_then_cancel, watch_silence
from kvagent.coordinator.machine import SHUTDOWN_QUARANTINE
from kvagent.coordinator.signals import LISTENER_TERMINATED
from kvagent.coordinator.task import CoordinatorHandle, StatusCell
from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.discovery.withdrawal import AttachmentRecordHolder, unregister_required
from kvagent.model.errors import KvAgentError
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC
from kvagent.model.ids import KvStateAgentIdentity, attachment_record_id
from kvagent.model.status import Attachment, AttachmentStatus
from kvagent.vllm.listener import ListenerCounters, run_listener

__all__ = ["COMMAND_CAPACITY", "LISTENER_JOIN_TIMEOUT", "LifecycleStatistics", "SlotLifecycle"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

COMMAND_CAPACITY = 16  # lifecycle calls waiting for the slot task; more callers wait for room
LISTENER_JOIN_TIMEOUT = 2.0
SHUTTING_DOWN = "state-agent is shutting down"


@attrs.frozen(slots=True)
class LifecycleStatistics:
    """The slot task's counters at one instant (never reset).

    Attributes:
      commands: commands the slot task ran (lifecycle calls and ad registrations).
      skipped: commands whose caller left before they began (nothing was done).
      unheard: commands that ran on after their caller left.
      rollbacks: attaches rolled back (a step failed, or the shutdown interrupted them).
      queued: commands waiting now.
    """

    commands: int
    skipped: int
    unheard: int
    rollbacks: int
    queued: int


class _Command(Generic[T]):
    """One lifecycle command and its one-shot reply (see the module doc for abandonment)."""

    __slots__ = ("_abandoned", "_done", "_error", "_result", "name", "step")

    def __init__(self, name: str, step: Callable[[], Awaitable[T]]) -> None:
        self.name = name
        self.step = step
        self._abandoned = False
        self._done = trio.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

    def abandoned(self) -> bool:
        """The caller stopped waiting (before the reply)."""
        return self._abandoned

    def finish(self, result: T | None = None, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self._result, self._error = result, error
            self._done.set()

    async def wait(self) -> T:
        try:
            await self._done.wait()
        except trio.Cancelled:
            self._abandoned = not self._done.is_set()  # replied already: nothing is left unheard
            raise
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set whenever no error was recorded


@attrs.define
class _ListenerTask:
    generation: int
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    finished: trio.Event = attrs.field(factory=trio.Event)
    counters: ListenerCounters = attrs.field(factory=ListenerCounters)
    running: bool = False  # set once the listener reported itself started (SUB connected)


@attrs.define
class _AttachAttempt:
    """How far an attach got, so a failure or a cancellation rolls back exactly that much."""

    generation: int
    listener_started: bool = False
    record: DiscoveryRecord | None = None  # an ad whose registration was attempted


class _StepTimedOut(KvAgentError):
    """A step of a lifecycle call did not complete within ``lifecycle_step_timeout``."""


class _ListenerTerminated(Exception):
    """The attachment left open while the attach was advertising it."""


class SlotLifecycle:
    """The slot task (module doc): ``run`` is the task, the ``attach``/``detach``/``quarantine`` coroutines
    submit commands to it, ``stop`` begins its shutdown; ``run_ad_keeper`` is the ad registration task."""

    def __init__(
        self,
        *,
        config: SlotAgentConfig,
        identity: KvStateAgentIdentity,
        coordinator: CoordinatorHandle,
        status: StatusCell,
        discovery: Discovery,
        holder: AttachmentRecordHolder,
        request_withdrawal: Callable[[int], None],
        durable: DurableSlot | None,
        zmq_context: zmq.Context[Any],
    ) -> None:
        self._config = config
        self._identity = identity
        self._coordinator = coordinator
        self._status = status
        self._discovery = discovery
        self._holder = holder
        self._request_withdrawal = request_withdrawal
        self._durable = durable
        self._zmq_context = zmq_context
        self._step_timeout = config.lifecycle_step_timeout
        self._commands_tx, self._commands_rx = trio.open_memory_channel[_Command[Any]](COMMAND_CAPACITY)
        self._closing = False
        self._commands_run = 0
        self._skipped = 0
        self._unheard = 0
        self._rollbacks = 0
        self._listeners: trio.Nursery | None = None
        self._attachment: Attachment | None = None
        self._listener: _ListenerTask | None = None
        self.latest_listener_counters: ListenerCounters | None = None
        self.ad_keeper = AttachmentAdKeeper(
            identity=identity,
            kv_state_endpoint=config.kv_state_endpoint,
            recovery_url=config.recovery_url,
            discovery=discovery,
            holder=holder,
            status=status,
            request_withdrawal=request_withdrawal,
            attached=lambda: self._attachment,
        )

    @property
    def current_attachment(self) -> Attachment | None:
        """The attachment the slot attached and has not detached (kept while quarantined)."""
        return self._attachment

    def statistics(self) -> LifecycleStatistics:
        return LifecycleStatistics(
            commands=self._commands_run,
            skipped=self._skipped,
            unheard=self._unheard,
            rollbacks=self._rollbacks,
            queued=self._commands_rx.statistics().current_buffer_used,
        )

    @property
    def listener_generation(self) -> int | None:
        """The generation whose listener is running (None: no listener runs)."""
        task = self._listener
        return None if task is None or task.finished.is_set() else task.generation

    # --- the callers' side ---------------------------------------------------------------------
    async def attach(self, config: AttachmentConfig) -> AttachmentStatus:
        return await self._call("attach", partial(self._attach, config))

    async def detach(self, generation: int) -> int:
        return await self._call("detach", partial(self._detach, generation))

    async def quarantine(self, generation: int, reason: str) -> bool:
        return await self._call("quarantine", partial(self._quarantine, generation, reason))

    async def _call(self, name: str, step: Callable[[], Awaitable[T]]) -> T:
        # A lifecycle call never waits behind a registration that discovery keeps waiting: the keeper
        # registers again afterwards if the ad is still due.
        self.ad_keeper.interrupt()
        return await self._submit(_Command(name, step))

    async def _submit(self, command: _Command[T]) -> T:
        if self._closing:
            raise KvAgentError(SHUTTING_DOWN, code="not_ready")
        try:
            await self._commands_tx.send(command)  # cancelled here: never queued
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise KvAgentError(SHUTTING_DOWN, code="not_ready") from None
        return await command.wait()

    async def stop(self) -> None:
        """Begin the shutdown: later and queued commands are refused; ``run`` then shuts the slot down."""
        self._closing = True
        self.ad_keeper.close()
        self._commands_tx.close()

    # --- the slot task -------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as listeners:
            self._listeners = listeners
            task_status.started()
            try:
                async for command in self._commands_rx:
                    await self._execute(command)
            finally:
                self._closing = True
                self.ad_keeper.close()
                self._refuse_queued()
                with trio.move_on_after(3 * self._config.shutdown_step_timeout, shield=True):
                    await self._shutdown_attachment()
                listeners.cancel_scope.cancel()

    async def run_ad_keeper(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The ad registration task: waits until the ad is due and has the slot task register it."""
        await self.ad_keeper.run(self._submit_registration, task_status=task_status)

    async def _submit_registration(self) -> bool | None:
        return await self._submit(_Command("ad registration", self.ad_keeper.register_due))

    async def _execute(self, command: _Command[Any]) -> None:
        if self._closing:
            command.finish(error=KvAgentError(SHUTTING_DOWN, code="not_ready"))
            return
        if command.abandoned():
            self._skipped += 1
            return  # its caller left before it began: nothing happened, nothing to do
        self._commands_run += 1
        try:
            result = await command.step()
        except Exception as exc:
            if command.abandoned():
                log.warning("lifecycle_call_failed_unheard", call=command.name, error=str(exc))
            command.finish(error=exc)
        except BaseException:  # the ladder's deadline cancelled the slot task mid-step
            command.finish(error=KvAgentError(SHUTTING_DOWN, code="not_ready"))
            raise
        else:
            command.finish(result)
        if command.abandoned():
            self._unheard += 1

    def _refuse_queued(self) -> None:
        while True:
            try:
                command = self._commands_rx.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            command.finish(error=KvAgentError(SHUTTING_DOWN, code="not_ready"))
        self._commands_rx.close()

    async def _bounded(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """One step of a lifecycle call, bounded by ``lifecycle_step_timeout``."""
        with trio.move_on_after(self._step_timeout):
            return await call()
        raise _StepTimedOut(f"{what} did not complete within {self._step_timeout} s", code="internal")

    # --- attach (docs/spec/agent-semantics.md 7.2) ----------------------------------------------------------
    def _check_attachable(self, config: AttachmentConfig) -> None:
        if config.dp_rank != self._config.dp_rank:
            raise KvAgentError(
                "attachment DP rank does not match the stable state-agent slot", code="bad_request"
            )
        if config.ingress_protocol is not self._config.ingress_protocol:
            raise KvAgentError(
                "raw KV protocol mode is immutable for one state-agent publisher", code="bad_request"
            )
        if self._attachment is not None or self._holder.record is not None or self._listener is not None:
            raise KvAgentError("previous engine attachment has not fully detached", code="conflict")

    async def _attach(self, config: AttachmentConfig) -> AttachmentStatus:
        """Barrier, listener, then the advertisement (if ready: else the keeper advertises it once ready)."""
        self._check_attachable(config)
        resume = None if self._durable is None else self._durable.take_resume_point(config)
        to_attach = config.to_attachment()
        try:
            attached = await self._bounded(
                "attach barrier", partial(self._coordinator.attach, to_attach, resume=resume)
            )
        except _StepTimedOut:
            # Skipped if it had not run; had it run just as the wait ended, abort it (as when a listener fails).
            orphan = self._status.get().attachment
            if orphan is not None:
                with trio.move_on_after(self._config.shutdown_step_timeout, shield=True):
                    await self._coordinator.abort_attach(orphan.generation)
            raise
        attempt = _AttachAttempt(attached.generation)
        try:
            await self._bounded("listener start", partial(self._start_listener, attached, resume))
            attempt.listener_started = True
            await self._advertise(attached, attempt)
        except _ListenerTerminated:
            await self._roll_back(attempt, "listener terminated")
            raise KvAgentError(
                "raw KV listener terminated before attachment advertisement completed", code="not_ready"
            ) from None
        except Exception as exc:
            await self._roll_back(attempt, str(exc))
            if attempt.listener_started:
                raise KvAgentError(
                    "failed to advertise reattached engine attachment", code="internal"
                ) from exc
            raise KvAgentError("failed to start the attached raw KV listener", code="internal") from exc
        except BaseException:  # the shutdown interrupted it: leave nothing half-done behind
            await self._roll_back(attempt, "interrupted by the shutdown")
            raise
        self._attachment = attached
        self.ad_keeper.wake()
        log.info(
            "slot_attached",
            slot=self._config.name,
            generation=attached.generation,
            worker_id=config.worker_id,
            endpoint=config.endpoint,
            replay_endpoint=config.replay_endpoint,
            resumed=resume is not None,
        )
        status = self._status.get().attachment
        if status is not None and status.generation == attached.generation:
            return status
        return attached.status()

    async def _advertise(self, attached: Attachment, attempt: _AttachAttempt) -> None:
        """Register the attachment ad if it is ready; the attachment must still be open afterwards."""
        generation = attached.generation
        status = self._status.get().attachment
        if status is not None and status.generation == generation and status.ready:
            record = self.ad_keeper.record(attached, status.ready_at_outbound_cursor)
            attempt.record = record
            await self._bounded("attachment advertisement", partial(self._discovery.register, record))
            self.ad_keeper.note_registered(record, attached)
        if not self._status.get().is_open_generation(generation):
            raise _ListenerTerminated

    async def _roll_back(self, attempt: _AttachAttempt, reason: str) -> None:
        """Undo a started attach (7.2 steps 5-7, 7.3): withdraw its ad, then abort or detach it."""
        self._rollbacks += 1
        log.warning(
            "attach_rolled_back",
            generation=attempt.generation,
            listener_started=attempt.listener_started,
            reason=reason,
        )
        with trio.CancelScope(shield=True):  # every step below is bounded
            await self._roll_back_steps(attempt)

    async def _roll_back_steps(self, attempt: _AttachAttempt) -> None:
        generation = attempt.generation
        step = self._config.shutdown_step_timeout
        if attempt.record is not None:
            await self._withdraw_once(attempt.record, "attach_rollback_withdrawal_failed", generation)
        try:
            if not attempt.listener_started:
                with trio.fail_after(step):
                    await self._coordinator.abort_attach(generation)
                await self._stop_listener()
                return
            try:
                with trio.fail_after(step):
                    await self._coordinator.begin_detach(generation)
            finally:
                await self._stop_listener()
            with trio.fail_after(step):
                await self._coordinator.complete_detach(generation)
        except Exception as exc:
            log.error("attach_rollback_failed", generation=generation, error=str(exc))

    async def _withdraw_once(self, record: DiscoveryRecord, failure_event: str, generation: int) -> None:
        """Unregister ``record`` once (bounded); on failure the withdrawal supervisor retries it."""
        self._holder.set(record)  # whatever happens next, every withdrawal targets it
        with trio.move_on_after(self._config.shutdown_step_timeout) as bounded:
            try:
                await self._discovery.unregister(record.topic, record.record_id)
                self._holder.forget_if(record)
                return
            except Exception as exc:
                log.warning(failure_event, generation=generation, record_id=record.record_id, error=str(exc))
        if bounded.cancelled_caught:
            log.warning(failure_event, generation=generation, record_id=record.record_id, error="timed out")
        self._request_withdrawal(generation)

    # --- detach (7.4) and quarantine (7.7) -----------------------------------------------------
    async def _detach(self, generation: int) -> int:
        await self._bounded("detach", partial(self._coordinator.begin_detach, generation))
        # From here the detach finishes: the required withdrawal retries until discovery answers (only the
        # shutdown interrupts it, and then quarantines the attachment instead).
        await self._withdraw_attachment_ad(generation)
        await self._stop_listener()
        cursor = await self._bounded(
            "detach completion", partial(self._coordinator.complete_detach, generation)
        )
        self._attachment = None
        self.ad_keeper.wake()
        log.info("slot_detached", slot=self._config.name, generation=generation, outbound_cursor=cursor)
        return cursor

    async def _withdraw_attachment_ad(self, generation: int) -> None:
        record = self._holder.record
        expected_id = attachment_record_id(self._identity.publisher_id, generation)
        if record is None or record.record_id != expected_id or record.topic != KV_STATE_ATTACHMENTS_TOPIC:
            return
        try:
            await unregister_required(self._discovery, self._holder, record)
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise KvAgentError(
                "state-agent lease ended before attachment advertisement was withdrawn", code="internal"
            ) from exc

    async def _quarantine(self, generation: int, reason: str) -> bool:
        """Quarantine ``generation`` if it is the current attachment (True); an older one changes nothing.

        Returns without waiting for discovery: the coordinator hands the ad withdrawal to the withdrawal
        supervisor, which retries it until discovery answers.
        """
        affected = await self._bounded(
            "quarantine", partial(self._coordinator.quarantine, generation, reason)
        )
        if self._listener is not None and self._listener.generation == generation:
            await self._stop_listener()
        self.ad_keeper.wake()
        if affected:
            log.info("slot_quarantined", slot=self._config.name, generation=generation, reason=reason)
        return affected

    # --- shutdown (7.8 steps 1-3) --------------------------------------------------------------
    async def _shutdown_attachment(self) -> None:
        """Quarantine the current attachment, withdraw its ad (once), stop its listener."""
        step = self._config.shutdown_step_timeout
        current = self._status.get().attachment
        if current is not None:
            with trio.move_on_after(step):
                try:
                    await self._coordinator.quarantine(current.generation, SHUTDOWN_QUARANTINE)
                except Exception as exc:
                    log.warning("shutdown_quarantine_failed", generation=current.generation, error=str(exc))
        record = self._holder.record
        if record is not None:
            with trio.move_on_after(step) as bounded:
                try:
                    await self._discovery.unregister(record.topic, record.record_id)
                    self._holder.forget_if(record)
                except Exception as exc:
                    log.warning("attachment_ad_withdrawal_failed", record_id=record.record_id, error=str(exc))
            if bounded.cancelled_caught:
                log.warning("attachment_ad_withdrawal_failed", record_id=record.record_id, error="timed out")
        await self._stop_listener()

    # --- listeners -----------------------------------------------------------------------------
    async def _start_listener(self, attachment: Attachment, resume: tuple[int, int] | None) -> None:
        assert self._listeners is not None, "the slot task runs every lifecycle step"
        task = _ListenerTask(attachment.generation)
        self.latest_listener_counters = task.counters
        self._listener = task  # before it runs: a cancelled start still stops it
        await self._listeners.start(self._run_listener_task, attachment, task, resume)

    async def _run_listener_task(
        self,
        attachment: Attachment,
        task: _ListenerTask,
        resume: tuple[int, int] | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One generation's listener. A failure to start reaches ``attach``; a later crash quarantines."""
        # Every log line of this listener task carries its slot and generation (structlog contextvars; each
        # Trio task has its own context, so the binding stays in this task).
        structlog.contextvars.bind_contextvars(slot=self._config.name, generation=attachment.generation)
        listen = partial(
            run_listener,
            attachment=attachment,
            kv_block_size=self._config.kv_block_size,
            coordinator=self._coordinator,
            status=self._status,
            options=self._config.listener,
            zmq_context=self._zmq_context,
            stats=task.counters,
            resume=resume,
        )
        try:
            with task.scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(run_then_cancel, listen, nursery.cancel_scope)
                    task.running = True
                    if (reader := task.counters.reader) is not None:
                        watch = partial(
                            watch_silence, reader, slot=self._config.name, generation=task.generation
                        )
                        nursery.start_soon(partial(watch, silence_warning=self._config.silence_warning))
                    task_status.started()
        except* Exception:
            if not task.running:
                raise
            # The listener reports its own failures by quarantining; anything escaping is a bug that
            # must not take the whole slot down.
            log.exception("listener_crashed", generation=attachment.generation)
            with trio.move_on_after(self._config.shutdown_step_timeout, shield=True):
                await self._coordinator.quarantine(attachment.generation, LISTENER_TERMINATED)
        finally:
            task.finished.set()

    async def _stop_listener(self) -> None:
        task, self._listener = self._listener, None
        if task is None:
            return
        task.scope.cancel()
        with trio.move_on_after(LISTENER_JOIN_TIMEOUT) as join:
            await task.finished.wait()
        if join.cancelled_caught:
            log.warning("listener_join_timed_out", generation=task.generation)
