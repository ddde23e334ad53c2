"""End-to-end slot agent: real ZMQ PUB/SUB on loopback, the real listener, coordinator, index and supervisor."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kvagent import AttachmentConfig, SlotAgent
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.errors import KvAgentError
from kvagent.model.events import (
    KV_STATE_ATTACHMENTS_TOPIC,
    KV_STATE_SOURCES_TOPIC,
    Cleared,
    ResidencyDomain,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from tests.support.agent import (
    TIMEOUT,
    XpubEngine,
    attach,
    attachment_ads,
    attachment_ads_of,
    batch,
    gpu_store,
    is_store_of,
    kvcr_store,
    running_agent,
    wait_for_event,
)
from tests.support.ids import OWNER
from tests.support.vectors import live_model, load_live


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
            model = live_model(sub_messages) | {0xFEED}
            worker = WorkerWithDpRank(17, 0)
            resident = {h for (owner, tier, h) in agent.index.resident_blocks() if owner == worker}
            assert resident == model
            assert agent.statistics().coordinator.dropped_events == 0

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
            return bool(holder) and holder[0].lifecycle.listener_generation is not None

        async def spy_register(record: Any) -> None:
            if record.topic == KV_STATE_ATTACHMENTS_TOPIC:
                # The listener task is started (SUB connected) before the ad is registered.
                observed.append(("register", listener_running()))
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


async def test_an_event_larger_than_a_chunk_is_applied_not_quarantined() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            hashes = list(range(1, 9001))
            await engine.send_payload(batch([gpu_store(hashes)]))
            await engine.send_payload(batch([gpu_store([0xFEED])]))
            await wait_for_event(agent, is_store_of(0xFEED))
            worker = WorkerWithDpRank(17, 0)
            assert {h for (owner, _, h) in agent.index.resident_blocks() if owner == worker} == {*hashes, 0xFEED}
            assert agent.status().is_ready_generation(generation)
            assert agent.statistics().coordinator.quarantines == {}
            assert len(attachment_ads(discovery)) == 1
            engine.close()
