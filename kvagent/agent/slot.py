"""The slot agent: one nursery owning the withdrawal supervisor, the coordinator and the listener.

Nesting expresses dependency order (outermost lives longest)::

    supervisor nursery      withdrawal supervisor (must outlive every quarantine the coordinator requests)
      coordinator nursery   coordinator task (single owner of slot state)
        listener nursery    one listener per attachment generation, each in its own cancel scope

Shutdown follows the seed's order (agent-semantics 7.8): quarantine the current attachment, withdraw the
attachment advertisement, stop the listener, stop the coordinator, join the supervisor, withdraw the source
advertisement.  Every step is shielded and time-bounded so a stuck backend cannot hang the process.

The attachment advertisement exists only while the attachment is ``ready``: the coordinator asks the
withdrawal supervisor to withdraw it when the attachment leaves ready (or its ready cursor moves), and the
slot's ad keeper (a task beside the listeners) registers it again, with the new ``ready_at_outbound_cursor``,
once the attachment is ready again.  The keeper takes the lifecycle lock, so it never registers the ad of
a generation that a detach or quarantine has closed, and a lifecycle call interrupts a registration that
discovery keeps waiting.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import structlog
import trio
import zmq

from kvagent._util.latency import LatencySnapshot
from kvagent.agent.advertising import AttachmentAdKeeper
from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.agent.durable import (
    DurableSlot,
    open_durable_slot,
    run_durably,
    withdraw_stale_records,
)
from kvagent.agent.groups import unwrap_sole_exception
from kvagent.agent.slot_parts import SlotParts, build_slot, open_republisher
from kvagent.agent.staleness import last_event_age, run_then_cancel, watch_silence
from kvagent.coordinator.machine import SHUTDOWN_QUARANTINE, CoordinatorStatistics
from kvagent.coordinator.task import StatusCell
from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.discovery.withdrawal import (
    WithdrawalStatistics,
    run_withdrawal_supervisor,
    unregister_required,
)
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import KvAgentError
from kvagent.model.events import (
    KV_STATE_ATTACHMENTS_TOPIC,
)
from kvagent.model.ids import attachment_record_id, new_publisher_id
from kvagent.model.status import AgentStatus, Attachment, AttachmentStatus, PersistenceStatus
from kvagent.persist.writer import PersistenceStatistics
from kvagent.publish.republisher import RepublisherStatistics
from kvagent.publish.sinks import EventSink
from kvagent.publish.stream_writer import StreamWriterStatistics
from kvagent.vllm.listener import ListenerCounters, ListenerStatistics, run_listener

__all__ = ["SlotAgent", "SlotStatistics", "open_slot_agent"]

log = structlog.get_logger(__name__)

LISTENER_JOIN_TIMEOUT = 2.0


@attrs.frozen(slots=True)
class SlotStatistics:
    """One slot's counters at one instant (trio ``statistics()`` style).

    ``coordinator`` includes the coordinator task's ingress queue depth; ``listener`` is the listener of the
    latest attachment (None before the first attach); ``withdrawal`` counts the attachment-ad withdrawals;
    ``republish`` is the vLLM-compatible republisher's (None when the slot does not republish).
    """

    coordinator: CoordinatorStatistics
    listener: ListenerStatistics | None
    withdrawal: WithdrawalStatistics
    republish: RepublisherStatistics | None = None
    persistence: PersistenceStatistics | None = None  # None: the slot keeps its state in memory only
    # Seconds the coordinator spent applying each drain of ingress (None: not measured, e.g. a test double).
    apply_latency: LatencySnapshot | None = None
    # Whether the attached engine's PUB and the slot's SUB are connected (None: no attachment).
    engine_connected: bool | None = None
    stream: StreamWriterStatistics | None = None  # the Redis/Valkey stream writer's (None: no stream)


@attrs.define
class _ListenerTask:
    generation: int
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    finished: trio.Event = attrs.field(factory=trio.Event)
    counters: ListenerCounters = attrs.field(factory=ListenerCounters)
    running: bool = False  # set once the listener reported itself started (SUB connected)


class SlotAgent:
    """A running slot agent. Lifecycle calls are serialized; ``status()`` never waits."""

    def __init__(
        self,
        parts: SlotParts,
        *,
        discovery: Discovery,
        listener_nursery: trio.Nursery,
        zmq_context: zmq.Context[Any],
    ) -> None:
        self.config = parts.config
        self.identity = parts.identity
        self._index = parts.index
        self._status = parts.status_cell
        self._coordinator = parts.coordinator
        self.republisher = parts.republisher
        self.durable = parts.durable
        self._stream_writer = parts.stream_writer
        self._core = parts.core
        self._discovery = discovery
        self._holder = parts.holder
        self._listener_nursery = listener_nursery
        self._zmq_context = zmq_context
        self._lifecycle = trio.Lock()
        self._closing = False
        self._attachment: Attachment | None = None
        self._listener: _ListenerTask | None = None
        self._latest_listener_counters: ListenerCounters | None = None
        self.ad_keeper = AttachmentAdKeeper(
            identity=self.identity,
            kv_state_endpoint=self.config.kv_state_endpoint,
            recovery_url=self.config.recovery_url,
            discovery=discovery,
            holder=self._holder,
            status=self._status,
            lifecycle=self._lifecycle,
            request_withdrawal=parts.request_withdrawal,
        )

    # --- read side (SlotSurface) ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def slot_rank(self) -> int:
        return self.config.dp_rank

    @property
    def index(self) -> RecoveryIndex:
        return self._index

    @property
    def status_cell(self) -> StatusCell:
        return self._status

    def status(self) -> AgentStatus:
        status = self._status.get()
        if self.republisher is not None:
            status = attrs.evolve(status, republish=self.republisher.status())
        writer = None if self.durable is None else self.durable.writer
        persistence = PersistenceStatus() if writer is None else writer.statistics().status()
        return attrs.evolve(status, persistence=persistence, last_event_age_s=self.last_event_age())

    def last_event_age(self) -> float | None:
        """Seconds since the attached engine's last live message (None: detached, or nothing received yet)."""
        counters = self._latest_listener_counters
        if self._attachment is None or counters is None:
            return None
        return last_event_age(counters.reader)

    @property
    def current_attachment(self) -> Attachment | None:
        """The attachment this slot last attached and has not detached (with its source)."""
        return self._attachment

    def persisted_attachment(self) -> AttachmentConfig | None:
        """The engine the slot's loaded state followed (None: no state file or none attached)."""
        return None if self.durable is None else self.durable.persisted_attachment()

    def statistics(self) -> SlotStatistics:
        listener = self._latest_listener_counters
        return SlotStatistics(
            coordinator=self._coordinator.statistics(),
            listener=None if listener is None else listener.statistics(),
            withdrawal=self._holder.statistics(),
            republish=None if self.republisher is None else self.republisher.statistics(),
            persistence=None
            if self.durable is None or self.durable.writer is None
            else self.durable.writer.statistics(),
            apply_latency=self._core.apply_latency.snapshot(),
            engine_connected=self._engine_connected(),
            stream=None if self._stream_writer is None else self._stream_writer.statistics(),
        )

    def _engine_connected(self) -> bool | None:
        counters = self._latest_listener_counters
        if self._attachment is None or counters is None or counters.reader is None:
            return None
        return counters.reader.engine_connected

    # --- lifecycle -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closing:
            raise KvAgentError("state-agent is shutting down", code="not_ready")

    def _check_attachable(self, config: AttachmentConfig) -> None:
        self._check_open()
        if config.dp_rank != self.config.dp_rank:
            raise KvAgentError(
                "attachment DP rank does not match the stable state-agent slot", code="bad_request"
            )
        if config.ingress_protocol is not self.config.ingress_protocol:
            raise KvAgentError(
                "raw KV protocol mode is immutable for one state-agent publisher", code="bad_request"
            )
        if self._attachment is not None or self._holder.record is not None or self._listener is not None:
            raise KvAgentError("previous engine attachment has not fully detached", code="conflict")

    async def attach(self, config: AttachmentConfig) -> AttachmentStatus:
        """Attach an engine: barrier, listener, then the advertisement (agent-semantics 7.4 order).

        The advertisement is registered only if the attachment is ready by then; a degraded or disconnected
        attachment is attached all the same, and the ad keeper advertises it once it is ready.
        """
        self.ad_keeper.interrupt()
        async with self._lifecycle:
            self._check_attachable(config)
            resume = None if self.durable is None else self.durable.take_resume_point(config)
            attached = await self._coordinator.attach(config.to_attachment(), resume=resume)
            generation = attached.generation
            try:
                await self._start_listener(attached, resume)
            except Exception as exc:
                log.warning("listener_start_failed", generation=generation, error=str(exc))
                await self._coordinator.abort_attach(generation)
                raise KvAgentError("failed to start the attached raw KV listener", code="internal") from exc
            await self._advertise_attachment(attached)
            self._attachment = self.ad_keeper.attached = attached
            self.ad_keeper.wake()
            log.info(
                "slot_attached",
                slot=self.name,
                generation=generation,
                worker_id=config.worker_id,
                endpoint=config.endpoint,
                replay_endpoint=config.replay_endpoint,
                resumed=resume is not None,
            )
            status = self._status.get().attachment
            return status if status is not None and status.generation == generation else attached.status()

    async def _advertise_attachment(self, attached: Attachment) -> None:
        """Register the attachment ad if ready; roll the attachment back if that fails or it terminated."""
        generation = attached.generation
        status = self._status.get().attachment
        record: DiscoveryRecord | None = None
        if status is not None and status.generation == generation and status.ready:
            record = self.ad_keeper.record(attached, status.ready_at_outbound_cursor)
            try:
                await self._discovery.register(record)
            except Exception as exc:
                await self._rollback_started_attach(generation, "attach_rollback_failed")
                message = "failed to advertise reattached engine attachment"
                raise KvAgentError(message, code="internal") from exc
            self.ad_keeper.note_registered(record, attached)
        if self._status.get().is_open_generation(generation):
            return
        if record is not None:
            try:
                await self._discovery.unregister(record.topic, record.record_id)
                self._holder.forget_if(record)
            except Exception as exc:
                log.warning(
                    "terminated_attachment_ad_withdrawal_failed", generation=generation, error=str(exc)
                )
        await self._rollback_started_attach(generation, "terminated_attach_rollback_failed")
        raise KvAgentError(
            "raw KV listener terminated before attachment advertisement completed", code="not_ready"
        )

    async def detach(self, generation: int) -> int:
        self.ad_keeper.interrupt()
        async with self._lifecycle:
            self._check_open()
            await self._coordinator.begin_detach(generation)
            await self._withdraw_attachment_ad(generation)
            await self._stop_listener()
            cursor = await self._coordinator.complete_detach(generation)
            self._attachment = self.ad_keeper.attached = None
            self.ad_keeper.wake()
            log.info("slot_detached", slot=self.name, generation=generation, outbound_cursor=cursor)
            return cursor

    async def quarantine(self, generation: int, reason: str) -> bool:
        """Quarantine ``generation`` if it is the current attachment (True); an older one changes nothing.

        Returns without waiting for discovery: the coordinator hands the ad withdrawal to the withdrawal
        supervisor, which retries it until discovery answers.
        """
        self.ad_keeper.interrupt()
        async with self._lifecycle:
            self._check_open()
            affected = await self._coordinator.quarantine(generation, reason)
            if self._listener is not None and self._listener.generation == generation:
                await self._stop_listener()
            self.ad_keeper.wake()
            if affected:
                log.info("slot_quarantined", slot=self.name, generation=generation, reason=reason)
            return affected

    # SlotSurface control ops (websocket)
    async def control_attach(
        self, *, worker_id: int, dp_rank: int, endpoint: str, topic: str, replay_endpoint: str | None
    ) -> AttachmentStatus:
        config = AttachmentConfig(
            worker_id=worker_id,
            dp_rank=dp_rank,
            endpoint=endpoint,
            topic=topic,
            replay_endpoint=replay_endpoint,
        )
        return await self.attach(config)

    async def control_detach(self, generation: int) -> int:
        return await self.detach(generation)

    async def control_quarantine(self, generation: int, reason: str) -> None:
        # Internally a stale quarantine is a silent no-op (a late listener); an operator is told.
        if not await self.quarantine(generation, reason):
            raise KvAgentError(
                f"no current attachment has generation {generation}: nothing was quarantined",
                code="generation_mismatch",
            )

    # --- internals -----------------------------------------------------------------------------
    async def _start_listener(self, attachment: Attachment, resume: tuple[int, int] | None = None) -> None:
        task = _ListenerTask(attachment.generation)
        self._latest_listener_counters = task.counters
        await self._listener_nursery.start(self._run_listener_task, attachment, task, resume)
        self._listener = task

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
        structlog.contextvars.bind_contextvars(slot=self.config.name, generation=attachment.generation)
        listen = partial(
            run_listener,
            attachment=attachment,
            kv_block_size=self.config.kv_block_size,
            coordinator=self._coordinator,
            status=self._status,
            options=self.config.listener,
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
                        watch = partial(watch_silence, reader, slot=self.name, generation=task.generation)
                        nursery.start_soon(partial(watch, silence_warning=self.config.silence_warning))
                    task_status.started()
        except* Exception:
            if not task.running:
                raise
            # The listener reports its own failures by quarantining; anything escaping is a bug that
            # must not take the whole slot down.
            log.exception("listener_crashed", generation=attachment.generation)
            with trio.move_on_after(self.config.shutdown_step_timeout, shield=True):
                await self._coordinator.quarantine(attachment.generation, "framework listener terminated")
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

    async def _withdraw_attachment_ad(self, generation: int) -> None:
        record = self._holder.record
        expected_id = attachment_record_id(self.identity.publisher_id, generation)
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

    async def _rollback_started_attach(self, generation: int, failure_event: str) -> None:
        try:
            try:
                await self._coordinator.begin_detach(generation)
            finally:
                await self._stop_listener()
            await self._coordinator.complete_detach(generation)
        except Exception as exc:
            log.error(failure_event, generation=generation, error=str(exc))

    async def _shutdown_attachment(self) -> None:
        """Shutdown steps 1–3: quarantine, withdraw the attachment ad (once), stop the listener.

        Lifecycle calls already running finish first (their ad must not appear after the withdrawal);
        later ones are refused. A lifecycle call stuck past the wait does not stop the shutdown: the
        steps then run without the lock.
        """
        self._closing = True
        self.ad_keeper.close()
        with trio.move_on_after(2 * self.config.shutdown_step_timeout) as waiting:
            async with self._lifecycle:
                waiting.deadline = math.inf  # only the wait for the lock is bounded here
                await self._shutdown_attachment_steps()
        if waiting.cancelled_caught:
            await self._shutdown_attachment_steps()

    async def _shutdown_attachment_steps(self) -> None:
        current = self._status.get().attachment
        if current is not None:
            try:
                await self._coordinator.quarantine(current.generation, SHUTDOWN_QUARANTINE)
            except Exception as exc:
                log.warning("shutdown_quarantine_failed", generation=current.generation, error=str(exc))
        record = self._holder.record
        if record is not None:
            try:
                await self._discovery.unregister(record.topic, record.record_id)
                self._holder.forget_if(record)
            except Exception as exc:
                log.warning("attachment_ad_withdrawal_failed", record_id=record.record_id, error=str(exc))
        await self._stop_listener()


async def _logged_task(
    run: Callable[..., Awaitable[None]],
    slot: str,
    done: trio.Event | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``run`` as a task whose log lines all carry the slot (bound in the new task's own context)."""
    structlog.contextvars.bind_contextvars(slot=slot)
    try:
        await run(task_status=task_status)
    finally:
        if done is not None:
            done.set()


@asynccontextmanager
async def _slot_nurseries(
    parts: SlotParts, discovery: Discovery, zmq_context: zmq.Context[Any]
) -> AsyncIterator[SlotAgent]:
    """The nursery ladder: supervisor ⊃ coordinator ⊃ listeners; each level stops in its ``finally``."""
    step = parts.config.shutdown_step_timeout
    supervisor = partial(
        run_withdrawal_supervisor,
        discovery=discovery,
        holder=parts.holder,
        publisher_id=parts.identity.publisher_id,
        requests=parts.withdraw_rx,
    )
    supervisor_done = trio.Event()
    async with trio.open_nursery() as supervisor_nursery:
        try:
            with parts.withdraw_tx:
                await supervisor_nursery.start(_logged_task, supervisor, parts.config.name, supervisor_done)
                if parts.republisher is not None:  # outlives the coordinator, which publishes into it
                    await supervisor_nursery.start(_logged_task, parts.republisher.run, parts.config.name)
                if parts.stream_writer is not None:  # outlives the coordinator, which wakes it
                    await supervisor_nursery.start(_logged_task, parts.stream_writer.run, parts.config.name)
                async with (
                    run_durably(
                        parts.durable,
                        index=parts.index,
                        coordinator=parts.coordinator,
                        republisher=parts.republisher,
                        nursery=supervisor_nursery,
                        step_timeout=step,
                    ) as agent_ready,
                    trio.open_nursery() as coordinator_nursery,
                ):
                    await coordinator_nursery.start(_logged_task, parts.run_coordinator, parts.config.name)
                    try:
                        async with trio.open_nursery() as listener_nursery:
                            agent = SlotAgent(
                                parts,
                                discovery=discovery,
                                listener_nursery=listener_nursery,
                                zmq_context=zmq_context,
                            )
                            agent_ready(agent)
                            await listener_nursery.start(_logged_task, agent.ad_keeper.run, parts.config.name)
                            try:
                                yield agent
                            finally:
                                with trio.move_on_after(3 * step, shield=True):
                                    await agent._shutdown_attachment()
                                listener_nursery.cancel_scope.cancel()
                    finally:
                        with trio.move_on_after(step, shield=True) as stopping:
                            await parts.coordinator.shutdown()
                        if stopping.cancelled_caught:
                            log.warning("coordinator_shutdown_timed_out", timeout=step)
                        coordinator_nursery.cancel_scope.cancel()
        finally:
            # The supervisor drains queued withdrawals now that its channel is closed; bound the wait.
            with trio.move_on_after(step, shield=True):
                await supervisor_done.wait()
            supervisor_nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_slot_agent(
    config: SlotAgentConfig,
    *,
    discovery: Discovery,
    sink: EventSink | None = None,
    zmq_context: zmq.Context[Any] | None = None,
    durable: DurableSlot | None = None,
) -> AsyncIterator[SlotAgent]:
    """Run one slot agent for the duration of the ``async with`` block.

    ``sink`` receives the slot's outbound events; a sink that names its publisher (the event plane's) must
    be built for ``config.publisher_id``.  An exception from the block is re-raised as itself once the
    slot has shut down, not wrapped in one exception group per nursery level.  ``durable`` is the slot's
    opened state file (opened here from ``config.state_path`` when not given); the slot closes it.
    """
    context = zmq_context if zmq_context is not None else zmq.Context.instance()
    if durable is None:
        durable = await open_durable_slot(config, new_publisher_id())
    republisher = open_republisher(config, context)
    parts = build_slot(config, sink, republisher, durable)
    try:
        await withdraw_stale_records(discovery, durable, parts.source_record)
        await discovery.register(parts.source_record)
    except Exception as exc:
        if republisher is not None:
            republisher.close()
        if durable is not None:
            with trio.CancelScope(shield=True):
                await durable.close()
        raise KvAgentError("failed to advertise persistent state source", code="internal") from exc
    try:
        with unwrap_sole_exception():
            async with _slot_nurseries(parts, discovery, context) as agent:
                yield agent
    finally:
        if republisher is not None:
            republisher.close()
        with trio.move_on_after(config.shutdown_step_timeout, shield=True):
            try:
                await discovery.unregister(parts.source_record.topic, parts.source_record.record_id)
            except Exception as exc:
                log.warning(
                    "source_ad_withdrawal_failed", record_id=parts.source_record.record_id, error=str(exc)
                )
