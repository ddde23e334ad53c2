"""A slot's objects, built and wired before any of its tasks runs (and restored from its state file).

Split from :mod:`kvagent.agent.slot`, which runs them: :func:`build_slot` makes the index, the coordinator
(restored and leased when the slot persists, docs/durability.md), the status cell, the source advertisement and
the attachment advertiser the coordinator asks for withdrawals; :func:`open_republisher` the slot's
vLLM-compatible stream.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import attrs
import structlog
import zmq

from kvagent._util.latency import LatencyHistogram
from kvagent.agent.advertising import AttachmentAdvertiser
from kvagent.agent.config import SlotAgentConfig
from kvagent.agent.durable import DurableSlot
from kvagent.coordinator.machine import SlotCoordinator
from kvagent.coordinator.task import CoordinatorHandle, StatusCell, open_coordinator
from kvagent.discovery.ads import source_advertisement
from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.ids import KvStateAgentIdentity
from kvagent.model.status import AgentStatus
from kvagent.publish.republisher import VllmRepublisher
from kvagent.publish.sinks import EventSink, FanoutSink, NullSink
from kvagent.stream.writer import StreamWriter

__all__ = ["SlotParts", "TimedSlotCoordinator", "build_slot", "open_republisher"]

log = structlog.get_logger(__name__)


class _TimedDrain:
    """Wraps the coordinator's own drain context and times it (a class: a generator CM costs ~2 µs more)."""

    __slots__ = ("_histogram", "_inner", "_started")

    def __init__(self, inner: AbstractContextManager[None], histogram: LatencyHistogram) -> None:
        self._inner = inner
        self._histogram = histogram
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()
        self._inner.__enter__()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> bool | None:
        try:
            return self._inner.__exit__(kind, value, traceback)
        finally:
            self._histogram.observe(time.perf_counter() - self._started)


class TimedSlotCoordinator(SlotCoordinator):
    """The slot's coordinator, timing each drain of ingress it applies (``kvagent_ingest_apply_latency_seconds``).

    The coordinator task wraps every drain (up to a few chunks) in :meth:`ingress_batch`; two clock reads
    and a bucket increment per drain are well under a microsecond.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.apply_latency = LatencyHistogram()

    # The base returns contextlib's generator context manager; this one is a plain context manager of the
    # same protocol (``with core.ingress_batch(): ...`` is the only use), hence the ignore.
    def ingress_batch(self) -> _TimedDrain:  # type: ignore[override]
        return _TimedDrain(super().ingress_batch(), self.apply_latency)


@attrs.frozen
class SlotParts:
    """Everything one slot owns, built before any task starts (see :func:`build_slot`)."""

    config: SlotAgentConfig
    identity: KvStateAgentIdentity
    index: RecoveryIndex
    status_cell: StatusCell
    coordinator: CoordinatorHandle
    run_coordinator: Callable[..., Awaitable[None]]
    advertiser: AttachmentAdvertiser  # the one owner of the attachment advertisement
    source_record: DiscoveryRecord
    republisher: VllmRepublisher | None  # lives as long as the slot: its seq space spans every attachment
    core: TimedSlotCoordinator
    durable: DurableSlot | None  # the slot's state file (None: in memory only)
    stream_writer: StreamWriter | None = None  # a sink and a task: reads the index's ring by cursor


def build_slot(
    config: SlotAgentConfig,
    sink: EventSink | None,
    republisher: VllmRepublisher | None,
    durable: DurableSlot | None = None,
    *,
    discovery: Discovery,
) -> SlotParts:
    """The slot's objects, wired together (and restored from ``durable``); nothing runs yet.

    ``config.publisher_id`` must be decided already (:func:`kvagent.agent.durable.open_slot_state`).
    """
    publisher_id = config.publisher_id
    if publisher_id is None or (durable is not None and durable.publisher_id != publisher_id):
        raise ValueError("build_slot needs the publisher id open_slot_state decided")
    identity = KvStateAgentIdentity(config.cache_owner_id, publisher_id)
    index = RecoveryIndex(config.kv_block_size, config.ring_capacity)
    status_cell = StatusCell(AgentStatus(identity))
    advertiser = AttachmentAdvertiser(
        identity=identity,
        kv_state_endpoint=config.kv_state_endpoint,
        recovery_url=config.recovery_url,
        discovery=discovery,
        status=status_cell,
    )

    stream_writer = open_stream_writer(config, identity, index, status_cell)
    sinks = [each for each in (sink, republisher, stream_writer) if each is not None]
    outbound: EventSink = FanoutSink(*sinks) if len(sinks) > 1 else sinks[0] if sinks else NullSink()
    core = TimedSlotCoordinator(
        identity=identity,
        slot_rank=config.dp_rank,
        index=index,
        sink=outbound,
        on_status=status_cell.set,
        request_withdrawal=advertiser.request_withdrawal,  # never waits on discovery
        strict_cache_owner=config.strict_cache_owner,
        first_outbound_id=1 if durable is None else durable.first_outbound_id,
        lease_end=None if durable is None else durable.lease_end,
    )
    if durable is not None:
        durable.restore(index, core, republisher)
    coordinator, run_coordinator = open_coordinator(core)
    source_record = source_advertisement(
        identity=identity,
        global_dp_rank=config.dp_rank,
        kv_state_endpoint=config.kv_state_endpoint,
        kv_block_size=config.kv_block_size,
        ingress_protocol=config.ingress_protocol,
        recovery_url=config.recovery_url,
    )
    return SlotParts(
        config=config,
        identity=identity,
        index=index,
        status_cell=status_cell,
        coordinator=coordinator,
        run_coordinator=run_coordinator,
        advertiser=advertiser,
        source_record=source_record,
        republisher=republisher,
        core=core,
        durable=durable,
        stream_writer=stream_writer,
    )


def open_republisher(config: SlotAgentConfig, context: zmq.Context[Any]) -> VllmRepublisher | None:
    """The slot's republisher, bound at its endpoints offset by its dp_rank (vLLM's convention)."""
    if config.republish is None:
        return None
    republisher = VllmRepublisher(
        config.republish.for_rank(config.dp_rank),
        dp_rank=config.dp_rank,
        block_size=config.kv_block_size,
        context=context,
    )
    log.info(
        "republishing",
        slot=config.name,
        endpoint=republisher.endpoint,
        replay_endpoint=republisher.replay_endpoint,
    )
    return republisher


def open_stream_writer(
    config: SlotAgentConfig, identity: KvStateAgentIdentity, index: RecoveryIndex, status_cell: StatusCell
) -> StreamWriter | None:
    """The slot's Redis/Valkey stream writer (docs/fleet.md): it reads the index's ring and the status cell."""
    if config.stream is None:
        return None
    return StreamWriter(
        config.stream,
        slot=config.name,
        publisher_id=identity.publisher_id,
        cache_owner_id=str(identity.cache_owner_id),
        kv_block_size=config.kv_block_size,
        ring=index,
        status=status_cell,
    )
