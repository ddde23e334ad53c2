"""The slot task: the one owner of a slot's attach, detach, quarantine and shutdown.

Callers (:class:`~kvagent.agent.slot.SlotAgent`) hand it commands over a bounded memory
channel; it runs them one at a time, in order, each to completion.  A caller's cancellation only stops the
caller waiting:

- a command not yet begun is skipped (nothing happened);
- a command begun runs on in the slot task, which finishes it or, if a step fails, rolls it back: an attach
  whose listener could not start is aborted (no barrier), one whose ad could not be registered, or whose
  listener ended meanwhile, is detached again (final barrier) and its ad withdrawn.

So after any call, cancelled or not, the slot is fully attached (coordinator attachment, listener, ad while
ready), fully quarantined, or fully not attached.  Every step is bounded by a cancel scope
(``lifecycle_step_timeout``); the detach's wait for its ad's withdrawal lasts until discovery answers (7.4),
and only the shutdown interrupts it.  The ad itself belongs to the
:class:`~kvagent.agent.advertising.AttachmentAdvertiser`: this task opens a generation (attach) and closes it
(detach, quarantine, rollback, shutdown), and waits for its registration or withdrawal where the seed orders
it.

The shutdown (docs/spec/agent-semantics.md 7.8, steps 1-3) runs when the ladder stops this task: queued commands are
refused, the command in progress finishes, then the current attachment is quarantined, its ad withdrawn
and its listener stopped.  Stopping the coordinator, joining the advertiser and withdrawing the source ad
are the outer rungs' (:mod:`kvagent.agent.slot`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import attrs
import structlog
import trio
import zmq

from kvagent._util.sync import Request
from kvagent.agent.advertising import AttachmentAdvertiser
from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.agent.deadlines import StopDeadlines
from kvagent.agent.durable import DurableSlot
from kvagent.agent.staleness import run_then_cancel, watch_silence
from kvagent.coordinator.machine import SHUTDOWN_QUARANTINE
from kvagent.coordinator.signals import LISTENER_TERMINATED
from kvagent.coordinator.task import CoordinatorHandle, StatusCell
from kvagent.model.errors import KvAgentError
from kvagent.model.status import Attachment, AttachmentStatus
from kvagent.vllm.listener import ListenerCounters, run_listener

__all__ = ["COMMAND_CAPACITY", "LifecycleStatistics", "SlotLifecycle"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

COMMAND_CAPACITY = 16  # lifecycle calls waiting for the slot task; more callers wait for room
SHUTTING_DOWN = "state-agent is shutting down"


@attrs.frozen(slots=True)
class LifecycleStatistics:
    """The slot task's counters at one instant (never reset).

    Attributes:
      commands: commands the slot task ran.
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


class _Command(Request[T]):
    """One lifecycle command: its step and its one-shot reply (see the module doc for abandonment)."""

    __slots__ = ("name", "step")

    def __init__(self, name: str, step: Callable[[], Awaitable[T]]) -> None:
        super().__init__()
        self.name = name
        self.step = step


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


class _StepTimedOut(KvAgentError):
    """A step of a lifecycle call did not complete within ``lifecycle_step_timeout``."""


class _ListenerTerminated(Exception):
    """The attachment left open while the attach was advertising it."""


class SlotLifecycle:
    """The slot task (module doc): ``run`` is the task, the ``attach``/``detach``/``quarantine`` coroutines
    submit commands to it, ``stop`` begins its shutdown."""

    def __init__(
        self,
        *,
        config: SlotAgentConfig,
        coordinator: CoordinatorHandle,
        status: StatusCell,
        advertiser: AttachmentAdvertiser,
        durable: DurableSlot | None,
        zmq_context: zmq.Context[Any],
    ) -> None:
        self._config = config
        self._coordinator = coordinator
        self._status = status
        self._advertiser = advertiser
        self._durable = durable
        self._zmq_context = zmq_context
        self._step_timeout = config.lifecycle_step_timeout
        self._deadlines = StopDeadlines(config.shutdown_step_timeout)
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
        command = _Command(name, step)
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
                self._refuse_queued()
                with trio.move_on_after(self._deadlines.slot_task_shutdown, shield=True):
                    await self._shutdown_attachment()
                listeners.cancel_scope.cancel()

    async def _execute(self, command: _Command[Any]) -> None:
        if self._closing:
            command.fail(KvAgentError(SHUTTING_DOWN, code="not_ready"))
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
            command.fail(exc)
        except BaseException:  # the ladder's deadline cancelled the slot task mid-step
            command.fail(KvAgentError(SHUTTING_DOWN, code="not_ready"))
            raise
        else:
            command.reply(result)
        if command.abandoned():
            self._unheard += 1

    def _refuse_queued(self) -> None:
        while True:
            try:
                command = self._commands_rx.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            command.fail(KvAgentError(SHUTTING_DOWN, code="not_ready"))
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
        if self._attachment is not None or self._advertiser.record is not None or self._listener is not None:
            raise KvAgentError("previous engine attachment has not fully detached", code="conflict")

    async def _attach(self, config: AttachmentConfig) -> AttachmentStatus:
        """Barrier, listener, then the advertisement (if ready: else the advertiser registers it once ready)."""
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
                with trio.move_on_after(self._deadlines.step, shield=True):
                    await self._coordinator.abort_attach(orphan.generation)
            raise
        attempt = _AttachAttempt(attached.generation)
        try:
            await self._bounded("listener start", partial(self._start_listener, attached, resume))
            attempt.listener_started = True
            await self._advertise(attached)
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

    async def _advertise(self, attached: Attachment) -> None:
        """Open the attachment's ad and, if it is ready, wait for its registration; the attachment must still
        be open afterwards (a degraded attachment is advertised by the advertiser once ready)."""
        generation = attached.generation
        self._advertiser.open(attached)
        await self._bounded(
            "attachment advertisement", partial(self._advertiser.wait_registration, generation)
        )
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
        step = self._deadlines.step
        await self._withdraw_ad(generation, "attach_rollback_withdrawal_timed_out")
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

    async def _withdraw_ad(self, generation: int, timed_out_event: str) -> None:
        """Close ``generation``'s ad and wait (one step) for its withdrawal; past that the advertiser retries
        on its own."""
        self._advertiser.close(generation)
        with trio.move_on_after(self._deadlines.step):
            await self._advertiser.wait_withdrawn(generation)
            return
        log.warning(timed_out_event, generation=generation, timeout=self._deadlines.step)

    # --- detach (7.4) and quarantine (7.7) -----------------------------------------------------
    async def _detach(self, generation: int) -> int:
        await self._bounded("detach", partial(self._coordinator.begin_detach, generation))
        # From here the detach finishes: the ad's withdrawal is retried until discovery answers (only the
        # shutdown interrupts the wait, and then quarantines the attachment instead).
        self._advertiser.close(generation)
        await self._advertiser.wait_withdrawn(generation)
        await self._stop_listener()
        cursor = await self._bounded(
            "detach completion", partial(self._coordinator.complete_detach, generation)
        )
        self._attachment = None
        log.info("slot_detached", slot=self._config.name, generation=generation, outbound_cursor=cursor)
        return cursor

    async def _quarantine(self, generation: int, reason: str) -> bool:
        """Quarantine ``generation`` if it is the current attachment (True); an older one changes nothing.

        Returns without waiting for discovery: the advertiser withdraws the ad, retrying until discovery
        answers.
        """
        affected = await self._bounded(
            "quarantine", partial(self._coordinator.quarantine, generation, reason)
        )
        if affected:
            self._advertiser.close(generation)  # a quarantined generation is never advertised again
        if self._listener is not None and self._listener.generation == generation:
            await self._stop_listener()
        if affected:
            log.info("slot_quarantined", slot=self._config.name, generation=generation, reason=reason)
        return affected

    # --- shutdown (7.8 steps 1-3) --------------------------------------------------------------
    async def _shutdown_attachment(self) -> None:
        """Quarantine the current attachment, withdraw its ad (one step), stop its listener."""
        current = self._status.get().attachment
        if current is None:
            await self._stop_listener()
            return
        with trio.move_on_after(self._deadlines.step):
            try:
                await self._coordinator.quarantine(current.generation, SHUTDOWN_QUARANTINE)
            except Exception as exc:
                log.warning("shutdown_quarantine_failed", generation=current.generation, error=str(exc))
        await self._withdraw_ad(current.generation, "attachment_ad_withdrawal_timed_out")
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
            with trio.move_on_after(self._deadlines.step, shield=True):
                await self._coordinator.quarantine(attachment.generation, LISTENER_TERMINATED)
        finally:
            task.finished.set()

    async def _stop_listener(self) -> None:
        task, self._listener = self._listener, None
        if task is None:
            return
        task.scope.cancel()
        with trio.move_on_after(self._deadlines.listener_join) as join:
            await task.finished.wait()
        if join.cancelled_caught:
            log.warning("listener_join_timed_out", generation=task.generation)
