"""Fault tests through the real agent: engine restarts on the same endpoint, sink failures, discovery outages."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kvagent import AttachmentConfig
from kvagent.model.errors import KvAgentError
from kvagent.model.events import Cleared, ResidencyDomain, StorageTier, WorkerWithDpRank
from kvagent.testing import RecordingSink
from tests.support.agent import (
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

TIMEOUT = 20


def worker_blocks(agent: Any, worker_id: int = 17) -> set[int]:
    worker = WorkerWithDpRank(worker_id, 0)
    return {h for (owner, _tier, h) in agent.index.resident_blocks() if owner == worker}


async def test_engine_restarted_on_the_same_endpoint_resets_worker_state_once() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, _discovery, sink, context):
            engine = XpubEngine(context)
            await attach(agent, engine)
            for i in range(3):
                await engine.send_payload(batch([gpu_store([100 + i])]))
            await engine.send_payload(batch([kvcr_store([900])]))
            await wait_for_event(agent, is_store_of(900))
            assert worker_blocks(agent) == {100, 101, 102}
            endpoint = engine.endpoint
            engine.close()
            # A dead engine is not a ready engine: the SUB's monitor saw the connection drop.
            await agent.status_cell.wait_for(
                lambda s: s.attachment is not None and s.attachment.state == "disconnected"
            )

            # The same endpoint, a new process: seq starts at 0 again, no AllBlocksCleared.
            restarted = await XpubEngine.rebind(context, endpoint)
            await restarted.wait_subscribed()  # the agent's SUB reconnected by itself
            barriers_before = sum(isinstance(e.data, Cleared) for e in sink.events)
            await restarted.send_payload(batch([gpu_store([200])]))
            await wait_for_event(agent, is_store_of(200))
            barriers = [e for e in sink.events if isinstance(e.data, Cleared)]
            assert len(barriers) == barriers_before + 1
            assert barriers[-1].residency_domain is ResidencyDomain.WORKER
            assert worker_blocks(agent) == {200}
            # CacheOwner residency belongs to the slot and survives the engine restart.
            assert (OWNER, StorageTier.HOST_PINNED, 900) in agent.index.resident_blocks()
            # The listener saw seq 0 again with other bytes: a new engine, reset before its first batch.
            assert agent.statistics().coordinator.source_resets == 1
            listener = agent.statistics().listener
            assert listener is not None and listener.restarts_seen == 1 and listener.lost_batches == 0
            status = agent.status()
            assert status.attachment is not None and status.attachment.ready
            restarted.close()


async def test_ordinary_publication_failures_are_lossy_and_keep_the_index(recording_sink: RecordingSink) -> None:
    sink = recording_sink
    with trio.fail_after(TIMEOUT):
        async with running_agent(sink=sink) as (agent, _discovery, _sink, context):
            engine = XpubEngine(context)
            await attach(agent, engine)
            sink.fail = True
            await engine.send_payload(batch([gpu_store([1])]))
            await wait_for_event(agent, is_store_of(1))
            sink.fail = False
            await engine.send_payload(batch([gpu_store([2])]))
            await wait_for_event(agent, is_store_of(2))
            assert worker_blocks(agent) == {1, 2}
            status = agent.status()
            assert status.attachment is not None and status.attachment.ready
            # id 2 was consumed by the failed publication and is never reused.
            assert [e.event_id for e in sink.events] == [1, 3]
            engine.close()


async def test_barrier_publication_failure_retires_the_worker_domain(recording_sink: RecordingSink) -> None:
    sink = recording_sink
    with trio.fail_after(TIMEOUT):
        async with running_agent(sink=sink) as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            sink.fail = True
            with pytest.raises(KvAgentError, match="failed to publish final Worker detach barrier"):
                await agent.detach(generation)
            sink.fail = False
            engine2 = XpubEngine(context)
            with pytest.raises(KvAgentError):
                await agent.attach(AttachmentConfig(worker_id=18, dp_rank=0, endpoint=engine2.endpoint))
            assert attachment_ads(discovery) == []
            engine.close()
            engine2.close()


async def test_discovery_outage_during_quarantine_is_retried_then_succeeds() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            discovery.set_failing(True, on=("unregister",))
            # The quarantine returns without waiting for discovery; the attachment advertiser retries.
            await agent.quarantine(generation, "operator test")
            await discovery.wait_for_attempts(3, "unregister")
            assert attachment_ads(discovery) != []
            discovery.set_failing(False)
            await discovery.wait_for(lambda records: not attachment_ads_of(records))
            status = agent.status()
            assert status.attachment is not None and not status.attachment.ready
            cursor = await agent.detach(generation)
            assert cursor == agent.status().outbound_cursor
            engine.close()
