"""The slot agent: one slot's nursery ladder and the public surface of its lifecycle.

The ladder (:func:`slot_rungs`, run by :func:`kvagent.agent.ladder.run_ladder`), outermost first; each rung
outlives every rung inside it and stops after them:

    publishing     attachment advertiser (the one owner of the attachment ad: outlives every quarantine that
                   asks it to withdraw the ad, and the slot task's withdrawals); republisher (outlives the
                   coordinator, which publishes into it)
    persistence    persistence writer (its clean stop runs once nothing applies any more)
    coordinator    coordinator task (single owner of the slot's state)
    lifecycle      slot task (single owner of attach, detach, quarantine and shutdown, and of the listeners, one
                   per attachment)

To add a component, add a :class:`~kvagent.agent.ladder.Child` (``run(*, task_status)`` and an optional
graceful ``stop``) to the rung whose lifetime it needs in :func:`slot_rungs`; e.g. a stream writer fed by the
coordinator's outbound events belongs in ``publishing`` beside the republisher.

Shutdown follows the seed's order (docs/spec/agent-semantics.md 7.8): the slot task quarantines the current attachment,
waits for its advertisement's withdrawal and stops its listener; then the coordinator stops, the persistence
writer records its clean stop, the advertiser finishes its withdrawals and is joined; :func:`open_slot_agent`
finally withdraws the source advertisement.  Every step is shielded and bounded by the slot's
:class:`~kvagent.agent.deadlines.StopDeadlines`, so a stuck backend cannot hang the process.

The attachment advertisement exists only while the attachment is ``ready``: the advertiser registers it at
the current ``ready_at_outbound_cursor`` whenever the open attachment is ready, and withdraws it when the
coordinator asks (the attachment left ready, or its ready cursor moved) or the slot task closes the
generation (:mod:`kvagent.agent.advertising`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import structlog
import trio
import zmq

from kvagent._util.latency import LatencySnapshot
from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.agent.deadlines import StopDeadlines
from kvagent.agent.durable import DurableSlot, open_slot_state, run_persistence, withdraw_stale_records
from kvagent.agent.groups import unwrap_sole_exception
from kvagent.agent.ladder import Child, Rung, run_ladder
from kvagent.agent.lifecycle import LifecycleStatistics, SlotLifecycle
from kvagent.agent.slot_parts import SlotParts, build_slot, open_republisher
from kvagent.agent.staleness import last_event_age
from kvagent.coordinator.machine import CoordinatorStatistics
from kvagent.coordinator.task import StatusCell
from kvagent.discovery.advertisement import WithdrawalStatistics
from kvagent.discovery.base import Discovery
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import KvAgentError
from kvagent.model.status import AgentStatus, Attachment, AttachmentStatus, PersistenceStatus
from kvagent.persist.writer import PersistenceStatistics
from kvagent.publish.republisher import RepublisherStatistics
from kvagent.publish.sinks import EventSink
from kvagent.stream.writer import StreamWriterStatistics
from kvagent.vllm.listener import ListenerStatistics

__all__ = ["SlotAgent", "SlotStatistics", "open_slot_agent", "slot_rungs"]

log = structlog.get_logger(__name__)


@attrs.frozen(slots=True)
class SlotStatistics:
    """One slot's counters at one instant (trio ``statistics()`` style).

    ``coordinator`` includes the coordinator task's ingress queue depth; ``listener`` is the listener of the
    latest attachment (None before the first attach); ``withdrawal`` counts the attachment ad's registrations
    and withdrawals;
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
    lifecycle: LifecycleStatistics | None = None  # the slot task's (None: not measured, e.g. a test double)
    stream: StreamWriterStatistics | None = None  # the Redis/Valkey stream writer's (None: no stream)


class SlotAgent:
    """A running slot agent: its lifecycle calls go to the slot task, in order; ``status()`` never waits.

    A caller cancelled during a lifecycle call only stops waiting; the slot task finishes or rolls back
    what the call began (:mod:`kvagent.agent.lifecycle`).
    """

    def __init__(self, parts: SlotParts, *, zmq_context: zmq.Context[Any]) -> None:
        self.config = parts.config
        self.identity = parts.identity
        self._index = parts.index
        self._status = parts.status_cell
        self._coordinator = parts.coordinator
        self.republisher = parts.republisher
        self.durable = parts.durable
        self._stream_writer = parts.stream_writer
        self._core = parts.core
        self._advertiser = parts.advertiser
        self._lifecycle = SlotLifecycle(
            config=parts.config,
            coordinator=parts.coordinator,
            status=parts.status_cell,
            advertiser=parts.advertiser,
            durable=parts.durable,
            zmq_context=zmq_context,
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

    @property
    def lifecycle(self) -> SlotLifecycle:
        """The slot task (a child of the slot's ladder)."""
        return self._lifecycle

    def status(self) -> AgentStatus:
        status = self._status.get()
        if self.republisher is not None:
            status = attrs.evolve(status, republish=self.republisher.status())
        writer = None if self.durable is None else self.durable.writer
        persistence = PersistenceStatus() if writer is None else writer.statistics().status()
        return attrs.evolve(status, persistence=persistence, last_event_age_s=self.last_event_age())

    def last_event_age(self) -> float | None:
        """Seconds since the attached engine's last live message (None: detached, or nothing received yet)."""
        counters = self._lifecycle.latest_listener_counters
        if self.current_attachment is None or counters is None:
            return None
        return last_event_age(counters.reader)

    @property
    def current_attachment(self) -> Attachment | None:
        """The attachment this slot last attached and has not detached (with its source)."""
        return self._lifecycle.current_attachment

    def persisted_attachment(self) -> AttachmentConfig | None:
        """The engine the slot's loaded state followed (None: no state file or none attached)."""
        return None if self.durable is None else self.durable.persisted_attachment()

    def statistics(self) -> SlotStatistics:
        listener = self._lifecycle.latest_listener_counters
        return SlotStatistics(
            coordinator=self._coordinator.statistics(),
            listener=None if listener is None else listener.statistics(),
            withdrawal=self._advertiser.statistics(),
            republish=None if self.republisher is None else self.republisher.statistics(),
            persistence=None
            if self.durable is None or self.durable.writer is None
            else self.durable.writer.statistics(),
            apply_latency=self._core.apply_latency.snapshot(),
            engine_connected=self._engine_connected(),
            lifecycle=self._lifecycle.statistics(),
            stream=None if self._stream_writer is None else self._stream_writer.statistics(),
        )

    def _engine_connected(self) -> bool | None:
        counters = self._lifecycle.latest_listener_counters
        if self.current_attachment is None or counters is None or counters.reader is None:
            return None
        return counters.reader.engine_connected

    # --- lifecycle -----------------------------------------------------------------------------
    async def attach(self, config: AttachmentConfig) -> AttachmentStatus:
        """Attach an engine: barrier, listener, then the advertisement (docs/spec/agent-semantics.md 7.4 order).

        The advertisement is registered only if the attachment is ready by then; a degraded or disconnected
        attachment is attached all the same, and the advertiser registers its ad once it is ready.
        """
        return await self._lifecycle.attach(config)

    async def detach(self, generation: int) -> int:
        return await self._lifecycle.detach(generation)

    async def quarantine(self, generation: int, reason: str) -> bool:
        """Quarantine ``generation`` if it is the current attachment (True); an older one changes nothing.

        Returns without waiting for discovery: the advertiser withdraws the ad, retrying until discovery
        answers.
        """
        return await self._lifecycle.quarantine(generation, reason)

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


def slot_rungs(parts: SlotParts, agent: SlotAgent) -> list[Rung]:
    """The slot's nursery ladder, outermost rung first (see the module doc for why each is where it is)."""
    deadlines = StopDeadlines(parts.config.shutdown_step_timeout)
    advertiser = parts.advertiser
    # Its stop: nothing is wanted any more; it ends once what may be registered is withdrawn.
    publishing = [Child("attachment advertiser", advertiser.run, stop=advertiser.stop)]
    if parts.republisher is not None:
        publishing.append(Child("republisher", parts.republisher.run))
    if parts.stream_writer is not None:  # outlives the coordinator, which wakes it
        publishing.append(Child("stream writer", parts.stream_writer.run))
    rungs = [Rung("publishing", publishing)]
    if parts.durable is not None:
        persistence = partial(
            run_persistence,
            parts.durable,
            index=parts.index,
            coordinator=parts.coordinator,
            republisher=parts.republisher,
            attachment=lambda: agent.current_attachment,
            step_timeout=deadlines.step,
        )
        rungs.append(Rung("persistence", [Child("persistence writer", persistence)]))
    rungs.append(
        Rung("coordinator", [Child("coordinator", parts.run_coordinator, stop=parts.coordinator.shutdown)])
    )
    lifecycle = agent.lifecycle
    rungs.append(
        Rung(
            "lifecycle",
            [
                # Its stop waits for the command in progress, then the shutdown's steps.
                Child("slot task", lifecycle.run, stop=lifecycle.stop, stop_timeout=deadlines.slot_task_stop),
            ],
        )
    )
    return rungs


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
    be built for the slot's publisher id, which :func:`~kvagent.agent.durable.open_slot_state` decides (pass
    its config and ``durable``).  An exception from the block is re-raised as itself once the slot has shut
    down, not wrapped in one exception group per nursery level.  ``durable`` is the slot's opened state file
    (opened here from ``config.state_path`` when not given); the slot closes it.
    """
    context = zmq_context if zmq_context is not None else zmq.Context.instance()
    if durable is None:
        config, durable = await open_slot_state(config)
    elif config.publisher_id != durable.publisher_id:
        config = attrs.evolve(config, publisher_id=durable.publisher_id)
    republisher = open_republisher(config, context)
    parts = build_slot(config, sink, republisher, durable, discovery=discovery)
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
    agent = SlotAgent(parts, zmq_context=context)
    deadlines = StopDeadlines(config.shutdown_step_timeout)
    try:
        with unwrap_sole_exception():
            async with run_ladder(
                slot_rungs(parts, agent),
                slot=config.name,
                step_timeout=deadlines.step,
            ):
                yield agent
    finally:
        if republisher is not None:
            republisher.close()
        with trio.move_on_after(deadlines.step, shield=True):
            try:
                await discovery.unregister(parts.source_record.topic, parts.source_record.record_id)
            except Exception as exc:
                log.warning(
                    "source_ad_withdrawal_failed", record_id=parts.source_record.record_id, error=str(exc)
                )
