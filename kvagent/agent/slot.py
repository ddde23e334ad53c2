"""The slot agent: one nursery owning the withdrawal supervisor, the coordinator and the listener.

Nesting expresses dependency order (outermost lives longest)::

    supervisor nursery      withdrawal supervisor (must outlive every quarantine the coordinator requests)
      coordinator nursery   coordinator task (single owner of slot state)
        listener nursery    one listener per attachment generation, each in its own cancel scope

Shutdown follows the seed's order (agent-semantics 7.8): quarantine the current attachment, withdraw the
attachment advertisement, stop the listener, stop the coordinator, join the supervisor, withdraw the source
advertisement.  Every step is shielded and time-bounded so a stuck backend cannot hang the process.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import structlog
import trio
import zmq

from kvagent.coordinator.machine import SlotCoordinator
from kvagent.coordinator.task import CoordinatorHandle, open_coordinator
from kvagent.discovery.ads import attachment_advertisement, source_advertisement
from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.discovery.withdrawal import (
    AttachmentRecordHolder,
    run_withdrawal_supervisor,
    unregister_required,
)
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import KvAgentError
from kvagent.model.events import (
    KV_STATE_ATTACHMENTS_TOPIC,
    U32_MAX,
    U64_MAX,
    IngressProtocol,
    WorkerWithDpRank,
)
from kvagent.model.ids import (
    CacheOwnerId,
    KvStateAgentIdentity,
    attachment_record_id,
    new_publisher_id,
)
from kvagent.model.status import AgentStatus, Attachment, AttachmentSource, AttachmentStatus, StatusCell
from kvagent.publish.sinks import EventSink, NullSink
from kvagent.vllm.listener import ListenerCounters, ListenerOptions, run_listener

__all__ = ["AttachmentConfig", "SlotAgent", "SlotAgentConfig", "open_slot_agent"]

log = logging.getLogger(__name__)


def _with_log_context(
    run: Callable[..., Awaitable[None]], **context: object
) -> Callable[..., Awaitable[None]]:
    """``run`` as a task whose log lines all carry ``context`` (bound in the new task's own context)."""

    async def task(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(**context)
        await run(task_status=task_status)

    return task

LISTENER_JOIN_TIMEOUT = 2.0


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise KvAgentError(f"{attribute.name} must be > 0, got {value}", code="bad_request")


def _u32(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= U32_MAX:
        raise KvAgentError(f"{attribute.name} must be in 0..{U32_MAX}, got {value}", code="bad_request")


def _u64(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= U64_MAX:
        raise KvAgentError(f"{attribute.name} must be a u64, got {value}", code="bad_request")


def _endpoint(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise KvAgentError(
            f"{attribute.name} must be a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH or inproc://NAME), got {value!r}",
            code="bad_request",
        )
    if value.startswith("tcp://"):
        host, sep, port = value[len("tcp://") :].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KvAgentError(f"{attribute.name} must be tcp://HOST:PORT, got {value!r}", code="bad_request")


def _optional_endpoint(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None:
        _endpoint(instance, attribute, value)  # type: ignore[arg-type]


@attrs.frozen(slots=True)
class SlotAgentConfig:
    """One stable DP slot: its identity, geometry and local recovery settings."""

    name: str
    cache_owner_id: CacheOwnerId
    kv_block_size: int = attrs.field(validator=_positive)
    dp_rank: int = attrs.field(default=0, validator=_u32)
    ring_capacity: int = attrs.field(default=1024, validator=_positive)
    ingress_protocol: IngressProtocol = IngressProtocol.VLLM_RESIDENCY_V1
    strict_cache_owner: bool = False
    publisher_id: int | None = None
    kv_state_endpoint: str = ""
    recovery_url: str | None = None
    listener: ListenerOptions = ListenerOptions()
    shutdown_step_timeout: float = 5.0

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise KvAgentError("slot name must not be empty", code="bad_request")
        if self.ingress_protocol is not IngressProtocol.VLLM_RESIDENCY_V1:
            raise KvAgentError("external state-agent slots require vllm_residency_v1 ingress", code="bad_request")


@attrs.frozen(slots=True)
class AttachmentConfig:
    """One engine incarnation to attach: who it is and where its raw KV events are published."""

    worker_id: int = attrs.field(validator=_u64)
    dp_rank: int = attrs.field(validator=_u32)
    endpoint: str = attrs.field(validator=_endpoint)
    topic: str = ""
    replay_endpoint: str | None = attrs.field(default=None, validator=_optional_endpoint)
    producer_instance: str = ""
    intent_incarnation: int | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    ingress_protocol: IngressProtocol = IngressProtocol.VLLM_RESIDENCY_V1

    def to_attachment(self) -> Attachment:
        source = AttachmentSource(
            endpoint=self.endpoint,
            topic=self.topic,
            replay_endpoint=self.replay_endpoint,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            ingress_protocol=self.ingress_protocol,
        )
        return Attachment(
            worker=WorkerWithDpRank(self.worker_id, self.dp_rank),
            source=source,
            producer_instance=self.producer_instance or f"kvagent/{self.worker_id}",
            intent_incarnation=self.worker_id if self.intent_incarnation is None else self.intent_incarnation,
        )


@attrs.define
class _ListenerTask:
    generation: int
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    finished: trio.Event = attrs.field(factory=trio.Event)
    stats: ListenerCounters = attrs.field(factory=ListenerCounters)


class SlotAgent:
    """A running slot agent. Lifecycle calls are serialized; ``status()`` never waits."""

    def __init__(
        self,
        *,
        config: SlotAgentConfig,
        identity: KvStateAgentIdentity,
        index: RecoveryIndex,
        status_cell: StatusCell,
        coordinator: CoordinatorHandle,
        core: SlotCoordinator,
        discovery: Discovery,
        holder: AttachmentRecordHolder,
        listener_nursery: trio.Nursery,
        zmq_context: zmq.Context[Any],
    ) -> None:
        self.config = config
        self.identity = identity
        self._index = index
        self._status = status_cell
        self._coordinator = coordinator
        self.core = core
        self._discovery = discovery
        self._holder = holder
        self._listener_nursery = listener_nursery
        self._zmq_context = zmq_context
        self._lifecycle = trio.Lock()
        self._closing = False
        self._attachment: Attachment | None = None
        self._listener: _ListenerTask | None = None
        self.listener_stats: ListenerCounters | None = None

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
        return self._status.get()

    @property
    def attachment_record(self) -> DiscoveryRecord | None:
        return self._holder.record

    # --- lifecycle -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closing:
            raise KvAgentError("state-agent is shutting down", code="not_ready")

    async def attach(self, config: AttachmentConfig) -> AttachmentStatus:
        async with self._lifecycle:
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
            attached = await self._coordinator.attach(config.to_attachment())
            generation = attached.generation
            try:
                await self._start_listener(attached)
            except Exception as exc:
                log.warning("failed to start listener for generation %d: %s", generation, exc)
                await self._coordinator.abort_attach(generation)
                raise KvAgentError("failed to start the attached raw KV listener", code="internal") from exc
            record = attachment_advertisement(
                identity=self.identity,
                attachment=attached,
                kv_state_endpoint=self.config.kv_state_endpoint,
                recovery_url=self.config.recovery_url,
            )
            try:
                await self._discovery.register(record)
            except Exception as exc:
                await self._rollback_started_attach(generation, "Failed to roll back active KV attachment")
                raise KvAgentError(
                    "failed to advertise reattached engine attachment", code="internal"
                ) from exc
            self._holder.set(record)
            if not self._status.get().is_ready_generation(generation):
                try:
                    await self._discovery.unregister(record.topic, record.record_id)
                    self._holder.forget_if(record)
                except Exception as exc:
                    log.warning("could not withdraw the advertisement of a terminated attachment: %s", exc)
                await self._rollback_started_attach(generation, "failed to roll back terminated KV attachment")
                raise KvAgentError(
                    "raw KV listener terminated before attachment advertisement completed", code="not_ready"
                )
            self._attachment = attached
            return attached.status()

    async def detach(self, generation: int) -> int:
        async with self._lifecycle:
            self._check_open()
            await self._coordinator.begin_detach(generation)
            await self._withdraw_attachment_ad(generation)
            await self._stop_listener()
            cursor = await self._coordinator.complete_detach(generation)
            self._attachment = None
            return cursor

    async def quarantine(self, generation: int, reason: str) -> None:
        async with self._lifecycle:
            self._check_open()
            await self._coordinator.quarantine(generation, reason)
            await self._withdraw_attachment_ad(generation)
            await self._stop_listener()

    # SlotSurface control ops (websocket)
    async def control_attach(
        self, *, worker_id: int, dp_rank: int, endpoint: str, topic: str, replay_endpoint: str | None
    ) -> AttachmentStatus:
        config = AttachmentConfig(
            worker_id=worker_id, dp_rank=dp_rank, endpoint=endpoint, topic=topic, replay_endpoint=replay_endpoint
        )
        return await self.attach(config)

    async def control_detach(self, generation: int) -> int:
        return await self.detach(generation)

    async def control_quarantine(self, generation: int, reason: str) -> None:
        await self.quarantine(generation, reason)

    # --- internals -----------------------------------------------------------------------------
    async def _start_listener(self, attachment: Attachment) -> None:
        task = _ListenerTask(attachment.generation)
        self.listener_stats = task.stats
        await self._listener_nursery.start(self._run_listener_task, attachment, task)
        self._listener = task

    async def _run_listener_task(
        self,
        attachment: Attachment,
        task: _ListenerTask,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        # Every log line of this listener task carries its slot and generation (structlog contextvars; each
        # Trio task has its own context, so the binding stays in this task).
        structlog.contextvars.bind_contextvars(slot=self.config.name, generation=attachment.generation)
        started = False

        class _Started:
            def started(self, value: None = None) -> None:
                nonlocal started
                started = True
                task_status.started()

        try:
            with task.scope:
                await run_listener(
                    attachment=attachment,
                    kv_block_size=self.config.kv_block_size,
                    coordinator=self._coordinator,
                    status=self._status,
                    options=self.config.listener,
                    zmq_context=self._zmq_context,
                    stats=task.stats,
                    task_status=_Started(),
                )
        except Exception:
            if not started:
                raise
            # The listener reports its own failures by quarantining; anything escaping is a bug that
            # must not take the whole slot down.
            log.exception("listener for generation %d crashed", attachment.generation)
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
            log.warning("Timed out joining framework KV listener")

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

    async def _rollback_started_attach(self, generation: int, context: str) -> None:
        try:
            try:
                await self._coordinator.begin_detach(generation)
            finally:
                await self._stop_listener()
            await self._coordinator.complete_detach(generation)
        except Exception as exc:
            log.error("%s: %s", context, exc)

    async def _shutdown_attachment(self) -> None:
        """Shutdown steps 1–3: quarantine, withdraw the attachment ad (once), stop the listener.

        Lifecycle calls already running finish first (their ad must not appear after the withdrawal);
        later ones are refused.
        """
        self._closing = True
        with trio.move_on_after(2 * self.config.shutdown_step_timeout):
            await self._lifecycle.acquire()
        try:
            await self._shutdown_attachment_locked()
        finally:
            if self._lifecycle.locked() and self._lifecycle.statistics().owner is trio.lowlevel.current_task():
                self._lifecycle.release()

    async def _shutdown_attachment_locked(self) -> None:
        current = self._status.get().attachment
        if current is not None:
            try:
                await self._coordinator.quarantine(current.generation, "state-agent shutdown")
            except Exception as exc:
                log.warning("shutdown quarantine failed: %s", exc)
        record = self._holder.record
        if record is not None:
            try:
                await self._discovery.unregister(record.topic, record.record_id)
                self._holder.forget_if(record)
            except Exception as exc:
                log.warning("Failed to unregister KV state-agent advertisement: %s", exc)
        await self._stop_listener()


@asynccontextmanager
async def open_slot_agent(
    config: SlotAgentConfig,
    *,
    discovery: Discovery,
    sink: EventSink | None = None,
    zmq_context: zmq.Context[Any] | None = None,
) -> AsyncIterator[SlotAgent]:
    """Run one slot agent for the duration of the ``async with`` block."""
    publisher_id = config.publisher_id if config.publisher_id is not None else new_publisher_id()
    identity = KvStateAgentIdentity(config.cache_owner_id, publisher_id)
    if sink is not None and getattr(sink, "publisher_id", 0) is None:
        sink.publisher_id = publisher_id  # type: ignore[attr-defined]  # event-plane sinks name their slot
    index = RecoveryIndex(config.kv_block_size, config.ring_capacity)
    status_cell = StatusCell(AgentStatus(identity))
    context = zmq_context if zmq_context is not None else zmq.Context.instance()
    # Unbounded as in the seed: the coordinator must never block on a withdrawal request, and the
    # queue is bounded in practice by the number of quarantines (at most a few per attachment).
    withdraw_tx, withdraw_rx = trio.open_memory_channel[int](math.inf)

    def request_withdrawal(generation: int) -> None:
        try:
            withdraw_tx.send_nowait(generation)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.warning("withdrawal supervisor is gone; generation %d not queued for withdrawal", generation)

    core = SlotCoordinator(
        identity=identity,
        slot_rank=config.dp_rank,
        index=index,
        sink=sink if sink is not None else NullSink(),
        status=status_cell,
        request_withdrawal=request_withdrawal,
        strict_cache_owner=config.strict_cache_owner,
    )
    handle, run_coordinator = open_coordinator(core)
    holder = AttachmentRecordHolder()
    source_record = source_advertisement(
        identity=identity,
        global_dp_rank=config.dp_rank,
        kv_state_endpoint=config.kv_state_endpoint,
        kv_block_size=config.kv_block_size,
        ingress_protocol=config.ingress_protocol,
        recovery_url=config.recovery_url,
    )
    try:
        await discovery.register(source_record)
    except Exception as exc:
        raise KvAgentError("failed to advertise persistent state source", code="internal") from exc
    step = config.shutdown_step_timeout
    # An exception from the user's block is re-raised as itself once the nurseries have closed cleanly,
    # instead of arriving wrapped in one exception group per nursery level.
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as supervisor_nursery:
            with withdraw_tx:
                await supervisor_nursery.start(
                    _with_log_context(
                        lambda task_status: run_withdrawal_supervisor(
                            discovery=discovery,
                            holder=holder,
                            publisher_id=publisher_id,
                            requests=withdraw_rx,
                            task_status=task_status,
                        ),
                        slot=config.name,
                    )
                )
                async with trio.open_nursery() as coordinator_nursery:
                    await coordinator_nursery.start(_with_log_context(run_coordinator, slot=config.name))
                    async with trio.open_nursery() as listener_nursery:
                        agent = SlotAgent(
                            config=config,
                            identity=identity,
                            index=index,
                            status_cell=status_cell,
                            coordinator=handle,
                            core=core,
                            discovery=discovery,
                            holder=holder,
                            listener_nursery=listener_nursery,
                            zmq_context=context,
                        )
                        try:
                            yield agent
                        except BaseException as exc:
                            body_error = exc
                        finally:
                            with trio.move_on_after(3 * step, shield=True):
                                await agent._shutdown_attachment()
                            listener_nursery.cancel_scope.cancel()
                    with trio.move_on_after(step, shield=True) as stopping:
                        await handle.shutdown()
                    if stopping.cancelled_caught:
                        log.warning("coordinator did not acknowledge shutdown in time; cancelling it")
                    coordinator_nursery.cancel_scope.cancel()
            # The supervisor drains queued withdrawals now that its channel is closed; bound the wait.
            supervisor_nursery.cancel_scope.deadline = trio.current_time() + step
        if body_error is not None:
            raise body_error
    finally:
        with trio.move_on_after(step, shield=True):
            try:
                await discovery.unregister(source_record.topic, source_record.record_id)
            except Exception as exc:
                log.warning("Failed to unregister KV state-agent advertisement: %s", exc)
