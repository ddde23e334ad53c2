"""End-to-end slot agent: real ZMQ PUB/SUB on loopback, the real listener, coordinator, index and supervisor."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.agent.slot import AttachmentConfig, SlotAgent, SlotAgentConfig, open_slot_agent
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.errors import KvAgentError
from kvagent.model.events import (
    KV_STATE_ATTACHMENTS_TOPIC,
    KV_STATE_SOURCES_TOPIC,
    Cleared,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.model.ids import CacheOwnerId
from kvagent.testing import RecordingSink
from tests.support.vectors import load_live

OWNER = CacheOwnerId.parse(
    "01010101010101010101010101010101:02020202020202020202020202020202/0000000000000003/04040404040404040404040404040404"
)
TIMEOUT = 20


class XpubEngine:
    """A vLLM-like publisher on an XPUB socket, so the test knows exactly when the agent has subscribed."""

    def __init__(
        self, context: zmq.Context[Any], topic: bytes = b"kv-events", endpoint: str = "tcp://127.0.0.1:0"
    ) -> None:
        sock = context.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        self.endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.socket = TrioSocket(sock)
        self.topic = topic
        self.seq = 0

    async def wait_subscribed(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if frames and frames[0][:1] == b"\x01":
                return

    async def send_payload(self, payload: bytes, seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        await self.socket.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.socket.send_multipart(frames)

    def close(self) -> None:
        self.socket.close()

    @classmethod
    async def rebind(cls, context: zmq.Context[Any], endpoint: str) -> XpubEngine:
        """A new engine process on the same endpoint (libzmq releases the old port asynchronously)."""
        with trio.fail_after(10):
            while True:
                try:
                    return cls(context, endpoint=endpoint)
                except zmq.ZMQError:
                    await trio.sleep(0.05)


def batch(events: list[dict[str, object]], rank: int = 0) -> bytes:
    payload: bytes = msgpack.packb([1.0, events, rank])
    return payload


def gpu_store(hashes: list[int], parent: int | None = None, block_size: int = 32) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(len(hashes) * block_size)),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def kvcr_store(hashes: list[int], medium: str = "CPU_PINNED", block_size: int = 32) -> dict[str, object]:
    return {
        **gpu_store(hashes, block_size=block_size),
        "medium": medium,
        "locality": "LOCAL",
        "ownership": "kvcr",
    }


async def wait_for_event(agent: SlotAgent, predicate: Callable[[RouterEvent], bool]) -> RouterEvent:
    """Wait until the index applies an event matching ``predicate``."""
    seen: list[RouterEvent] = []
    arrived = trio.Event()

    def on_event(event: RouterEvent) -> None:
        if predicate(event) and not seen:
            seen.append(event)
            arrived.set()

    unsubscribe = agent.index.subscribe(on_event)
    # The event may already have been applied (the sender's checkpoint can let the agent run first):
    # look through the ring buffer too, in the same synchronous step as the subscription.
    oldest = agent.index.oldest_buffered_id()
    if oldest is not None and not seen:
        answer = agent.index.events_in_range(oldest, None)
        for event in getattr(answer, "events", ()):
            on_event(event)
    try:
        await arrived.wait()
    finally:
        unsubscribe()
    return seen[0]


def is_store_of(block_hash: int) -> Callable[[RouterEvent], bool]:
    return lambda e: isinstance(e.data, Stored) and block_hash in e.data.block_hashes


@asynccontextmanager
async def running_agent(
    discovery: MemoryDiscovery | None = None, sink: Any = None, block_size: int = 32
) -> AsyncIterator[tuple[SlotAgent, MemoryDiscovery, Any, zmq.Context[Any]]]:
    discovery = discovery or MemoryDiscovery()
    sink = sink or RecordingSink()
    context: zmq.Context[Any] = zmq.Context()
    config = SlotAgentConfig(name="s0", cache_owner_id=OWNER, kv_block_size=block_size, dp_rank=0)
    try:
        async with open_slot_agent(config, discovery=discovery, sink=sink, zmq_context=context) as agent:
            yield agent, discovery, sink, context
    finally:
        context.destroy(linger=0)


async def attach(agent: SlotAgent, engine: XpubEngine, worker_id: int = 17) -> int:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.wait_subscribed)
        status = await agent.attach(
            AttachmentConfig(worker_id=worker_id, dp_rank=0, endpoint=engine.endpoint)
        )
    return status.generation


def attachment_ads(discovery: MemoryDiscovery) -> list[int]:
    return [record_id for (topic, record_id) in discovery.records if topic == KV_STATE_ATTACHMENTS_TOPIC]


async def test_live_capture_end_to_end_detach_and_reattach() -> None:
    sub_messages, _ = load_live()
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, sink, context):
            assert [t for (t, _) in discovery.records] == [KV_STATE_SOURCES_TOPIC]
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            assert generation == 1
            attached = agent.status().attachment
            assert attached is not None and attached.ready
            assert len(attachment_ads(discovery)) == 1
            for frames in sub_messages:
                await engine.send_frames(frames)
            # A sentinel batch after the capture: once it is indexed, every earlier batch is too.
            await engine.send_payload(batch([gpu_store([0xFEED])]), seq=len(sub_messages))
            await wait_for_event(agent, is_store_of(0xFEED))

            # Expected resident set: replay the capture through an independent model.
            model: set[int] = set()
            for frames in sub_messages:
                _, events, _rank = msgpack.unpackb(frames[2], strict_map_key=False)
                for event in events:
                    if event["type"] == "BlockStored":
                        model.update(event["block_hashes"])
                    elif event["type"] == "BlockRemoved":
                        model.difference_update(event["block_hashes"])
                    else:
                        model.clear()
            model.add(0xFEED)
            worker = WorkerWithDpRank(17, 0)
            resident = {h for (owner, tier, h) in agent.index.resident_blocks() if owner == worker}
            assert resident == model
            assert agent.core.counters.dropped_events == 0

            cursor = await agent.detach(generation)
            assert cursor == agent.status().outbound_cursor
            assert agent.status().attachment is None
            assert attachment_ads(discovery) == []
            assert not any(owner == worker for (owner, _, _) in agent.index.resident_blocks())

            replacement = XpubEngine(context)
            generation2 = await attach(agent, replacement, worker_id=29)
            assert generation2 == 2
            status = agent.status()
            assert status.attachment is not None and status.attachment.worker == WorkerWithDpRank(29, 0)
            assert status.attachment.ready_at_outbound_cursor == cursor + 1
            ids = [e.event_id for e in sink.events]
            assert ids == sorted(set(ids)) and ids[-1] == cursor + 1
            engine.close()
            replacement.close()


async def test_cache_owner_state_survives_worker_replacement() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, _discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            await engine.send_payload(batch([kvcr_store([501]), gpu_store([502])]))
            await wait_for_event(agent, is_store_of(502))
            await agent.detach(generation)
            replacement = XpubEngine(context)
            await attach(agent, replacement, worker_id=29)
            blocks = agent.index.resident_blocks()
            assert (OWNER, StorageTier.HOST_PINNED, 501) in blocks
            assert not any(h == 502 for (_, _, h) in blocks)
            engine.close()
            replacement.close()


@pytest.mark.parametrize(
    ("payload", "expect_owner_ready"),
    [
        pytest.param(batch([{**gpu_store([1]), "ownership": "future_owner"}]), False, id="source-fault"),
        pytest.param(batch([gpu_store([1])], rank=1), True, id="rank-mismatch"),
        pytest.param(b"\x93\xcb", True, id="decode-error"),
        pytest.param(batch([gpu_store(list(range(9000)))]), True, id="oversized-event"),
        pytest.param(batch([kvcr_store([1], medium="GPU")]), False, id="cache-owner-fault"),
    ],
)
async def test_each_fault_class_quarantines_and_withdraws(payload: bytes, expect_owner_ready: bool) -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            await engine.send_payload(payload)
            status = await agent.status_cell.wait_for(
                lambda s: s.attachment is not None and not s.attachment.ready
            )
            assert status.attachment is not None and status.attachment.generation == generation
            assert status.cache_owner_ready is expect_owner_ready
            await discovery.wait_for(lambda records: not attachment_ads_of(records))
            # The agent keeps its record until detach; a new attach is refused until then.
            with pytest.raises(KvAgentError, match="previous engine attachment has not fully detached"):
                await agent.attach(AttachmentConfig(worker_id=18, dp_rank=0, endpoint=engine.endpoint))
            engine.close()


def attachment_ads_of(records: Mapping[tuple[str, int], object]) -> list[int]:
    return [record_id for (topic, record_id) in records if topic == KV_STATE_ATTACHMENTS_TOPIC]


async def test_attach_rejects_wrong_rank_before_anything_happens() -> None:
    async with running_agent() as (agent, discovery, sink, _context):
        with pytest.raises(
            KvAgentError, match="attachment DP rank does not match the stable state-agent slot"
        ):
            await agent.attach(AttachmentConfig(worker_id=1, dp_rank=3, endpoint="tcp://127.0.0.1:9"))
        assert sink.calls == 0
        assert attachment_ads(discovery) == []


async def test_failed_registration_rolls_back_with_a_final_barrier() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, sink, context):
            engine = XpubEngine(context)
            discovery.fail_next(1, on=("register",))
            with pytest.RaisesGroup(
                pytest.RaisesExc(KvAgentError, match="failed to advertise reattached engine attachment")
            ):
                await attach(agent, engine)
            assert agent.status().attachment is None
            assert attachment_ads(discovery) == []
            # attach barrier (1) and the rollback's final barrier (2), both Worker clears.
            assert [(e.event_id, isinstance(e.data, Cleared)) for e in sink.events] == [(1, True), (2, True)]
            engine2 = XpubEngine(context)
            assert await attach(agent, engine2, worker_id=18) == 2
            engine.close()
            engine2.close()


async def test_ad_registered_after_listener_established_and_withdrawn_before_it_stops() -> None:
    with trio.fail_after(TIMEOUT):
        discovery = MemoryDiscovery()
        observed: list[tuple[str, bool]] = []
        register, unregister = discovery.register, discovery.unregister
        holder: list[SlotAgent] = []

        def listener_running() -> bool:
            task = holder[0]._listener if holder else None
            return task is not None and not task.finished.is_set()

        async def spy_register(record: Any) -> None:
            if record.topic == KV_STATE_ATTACHMENTS_TOPIC:
                # The listener task is started (SUB connected) before the ad is registered.
                observed.append(("register", holder[0].listener_stats is not None))
            await register(record)

        async def spy_unregister(topic: str, record_id: int) -> None:
            if topic == KV_STATE_ATTACHMENTS_TOPIC:
                observed.append(("unregister", listener_running()))
            await unregister(topic, record_id)

        discovery.register = spy_register  # type: ignore[method-assign]
        discovery.unregister = spy_unregister  # type: ignore[method-assign]
        async with running_agent(discovery) as (agent, _, _sink, context):
            holder.append(agent)
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            await agent.detach(generation)
            engine.close()
        assert observed == [("register", True), ("unregister", True)]


async def test_withdrawal_retried_until_discovery_recovers() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            discovery.fail_next(3, on=("unregister",))
            # A listener-detected fault: the coordinator queues the withdrawal for the supervisor.
            await engine.send_payload(batch([gpu_store([1])], rank=5))
            await discovery.wait_for(lambda records: not attachment_ads_of(records))
            failures = [a for a in discovery.attempts if a.operation == "unregister" and a.failed]
            assert len(failures) == 3
            current = agent.status().attachment
            assert current is not None and current.generation == generation
            engine.close()


async def test_shutdown_is_bounded_when_discovery_is_down_and_mid_ingest() -> None:
    with trio.fail_after(TIMEOUT):
        discovery = MemoryDiscovery()
        async with running_agent(discovery) as (agent, _, _sink, context):
            engine = XpubEngine(context)
            await attach(agent, engine)
            for i in range(200):
                await engine.send_payload(batch([gpu_store([10_000 + i])]))
            discovery.set_failing(True)
        # Shutdown finished (bounded) even though every withdrawal failed; the agent never raised.
        engine.close()


async def test_clean_shutdown_withdraws_every_advertisement() -> None:
    with trio.fail_after(TIMEOUT):
        discovery = MemoryDiscovery()
        async with running_agent(discovery) as (agent, _, sink, context):
            engine = XpubEngine(context)
            await attach(agent, engine)
            await engine.send_payload(batch([gpu_store([7])]))
            await wait_for_event(agent, is_store_of(7))
        assert discovery.records == {}
        # Shutdown publishes no final barrier: the last event is the store.
        assert isinstance(sink.events[-1].data, Stored)
        assert sink.events[-1].residency_domain is ResidencyDomain.WORKER
        engine.close()
