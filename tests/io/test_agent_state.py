"""The slot agent under issue #14: the attachment ad follows the attachment's state, stale and prompt quarantine.

The listener's verdicts are injected straight into the running coordinator as SourceSignals (the ingress
channel the listener uses), so these tests pin the agent's side whatever listener runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from kvagent import SlotAgent
from kvagent.agent.host import SlotRegistry
from kvagent.agent.http_routes import serve_http
from kvagent.agent.metrics import MetricSources
from kvagent.discovery.base import DiscoveryRecord
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.errors import RecoveryClientError
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC, SourceSignal, SourceState
from kvagent.model.ids import attachment_record_id
from kvagent.recovery.client import connect_slot
from kvagent.recovery.server import RecoveryServerInfo, serve_recovery
from tests.support.agent import (
    TIMEOUT,
    XpubEngine,
    attach,
    attachment_ads,
    batch,
    gpu_store,
    is_store_of,
    running_agent,
    wait_for_event,
)

DEGRADED, DISCONNECTED, READY = SourceState.DEGRADED, SourceState.DISCONNECTED, SourceState.READY
TOKEN = "agent-state-test-token"


class StallingDiscovery(MemoryDiscovery):
    """Memory discovery whose chosen operations hang until released, like an etcd that stopped answering."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled: set[str] = set()
        self.release = trio.Event()
        self.entered: dict[str, trio.Event] = {"register": trio.Event(), "unregister": trio.Event()}

    def stall(self, *operations: str) -> None:
        self.stalled = set(operations)
        self.release = trio.Event()
        self.entered = {"register": trio.Event(), "unregister": trio.Event()}

    def resume(self) -> None:
        self.stalled = set()
        self.release.set()

    async def _hold(self, operation: str, topic: str) -> None:
        if operation in self.stalled and topic == KV_STATE_ATTACHMENTS_TOPIC:
            self.entered[operation].set()
            await self.release.wait()

    async def register(self, record: DiscoveryRecord) -> None:
        await self._hold("register", record.topic)
        await super().register(record)

    async def unregister(self, topic: str, record_id: int) -> None:
        await self._hold("unregister", topic)
        await super().unregister(topic, record_id)


def signal(agent: SlotAgent, generation: int, **fields: Any) -> None:
    """Admit a listener verdict on the agent's ingress channel, as the listener does."""
    agent._coordinator.admit_nowait(SourceSignal(generation, **fields))


def ads(records: Mapping[tuple[str, int], DiscoveryRecord]) -> dict[int, DiscoveryRecord]:
    return {
        record_id: record
        for (topic, record_id), record in records.items()
        if topic == KV_STATE_ATTACHMENTS_TOPIC
    }


def ad_cursor(record: DiscoveryRecord) -> object:
    return record.metadata["ready_at_outbound_cursor"]


async def test_the_ad_is_withdrawn_when_degraded_and_registered_again_at_the_new_ready_cursor() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            record_id = attachment_record_id(agent.identity.publisher_id, generation)
            (first,) = ads(discovery.records).values()
            assert ad_cursor(first) == 1

            signal(agent, generation, state=DEGRADED, reset=True, lost_batches=7, reason="replay exhausted")
            await discovery.wait_for(lambda records: not ads(records))
            status = agent.status()
            assert status.attachment is not None and status.attachment.state == "degraded"
            assert status.is_open_generation(generation) and not status.is_ready_generation(generation)

            signal(agent, generation, state=READY, reset=True, reason="engine restarted")
            records = await discovery.wait_for(lambda records: bool(ads(records)))
            status = agent.status()
            assert status.attachment is not None and status.attachment.ready
            assert status.attachment.ready_at_outbound_cursor == 3  # attach barrier 1, resets 2 and 3
            assert ad_cursor(ads(records)[record_id]) == 3
            assert agent.statistics().coordinator.resyncs == 1
            # The listener kept running through it all: the stream goes on.
            await engine.send_payload(batch([gpu_store([77])]))
            await wait_for_event(agent, is_store_of(77))
            engine.close()


async def test_a_reconnect_of_the_same_engine_re_advertises_the_same_cursor() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            before = dict(ads(discovery.records))
            signal(agent, generation, state=DISCONNECTED, reason="monitor: disconnected")
            await discovery.wait_for(lambda records: not ads(records))
            assert agent.status().state == "disconnected"
            signal(agent, generation, state=READY, reason="same engine")
            records = await discovery.wait_for(lambda records: bool(ads(records)))
            assert ads(records) == before
            engine.close()


async def test_a_ready_to_ready_reset_moves_the_advertised_cursor() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            signal(agent, generation, state=READY, reset=True, reason="engine restarted at seq 0")
            records = await discovery.wait_for(
                lambda records: [ad_cursor(record) for record in ads(records).values()] == [2]
            )
            assert len(ads(records)) == 1 and agent.status().is_ready_generation(generation)
            engine.close()


async def test_registration_failures_are_retried_while_ready() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            signal(agent, generation, state=DEGRADED, reset=True)
            await discovery.wait_for(lambda records: not ads(records))
            discovery.fail_next(2, on=("register",))
            signal(agent, generation, state=READY, reset=True)
            await discovery.wait_for(lambda records: bool(ads(records)))
            failures = [a for a in discovery.attempts if a.operation == "register" and a.failed]
            assert len(failures) == 2
            engine.close()


async def test_a_quarantine_while_the_ad_registration_hangs_never_resurrects_the_ad() -> None:
    discovery = StallingDiscovery()
    with trio.fail_after(TIMEOUT):
        async with running_agent(discovery) as (agent, _discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            signal(agent, generation, state=DEGRADED, reset=True)
            await discovery.wait_for(lambda records: not ads(records))
            discovery.stall("register")
            signal(agent, generation, state=READY, reset=True)
            await discovery.entered["register"].wait()  # the advertiser's registration is stuck
            await agent.quarantine(generation, "operator")  # interrupts it instead of waiting
            assert agent.status().state == "unready"
            discovery.resume()
            # The possibly registered ad is withdrawn by the advertiser, and never registered again.
            await agent._advertiser.changed.wait_for(lambda: agent.statistics().withdrawal.withdrawals >= 2)
            await trio.testing.wait_all_tasks_blocked()
            assert not ads(discovery.records)
            assert await agent.detach(generation) == agent.status().outbound_cursor
            engine.close()


async def test_quarantine_of_an_old_generation_leaves_the_current_attachment_alone() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, discovery, _sink, context):
            old_engine = XpubEngine(context)
            old = await attach(agent, old_engine)
            await agent.detach(old)
            engine = XpubEngine(context)
            current = await attach(agent, engine, worker_id=29)
            advertised = attachment_ads(discovery)
            assert advertised == [attachment_record_id(agent.identity.publisher_id, current)]

            await agent.quarantine(old, "stale operator call")
            status = agent.status()
            assert status.is_ready_generation(current) and status.state == "ready"
            assert agent.statistics().coordinator.quarantines == {}
            # The current listener still runs: the engine's next batch advances the cursor.
            cursor = status.outbound_cursor
            await engine.send_payload(batch([gpu_store([4242])]))
            await wait_for_event(agent, is_store_of(4242))
            assert agent.status().outbound_cursor == cursor + 1
            await trio.testing.wait_all_tasks_blocked()
            assert attachment_ads(discovery) == advertised
            old_engine.close()
            engine.close()


async def test_websocket_quarantine_returns_while_discovery_hangs() -> None:
    discovery = StallingDiscovery()
    with trio.fail_after(TIMEOUT):
        async with running_agent(discovery) as (agent, _discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            registry = SlotRegistry()
            registry.add(agent)
            discovery.stall("unregister")
            async with trio.open_nursery() as nursery:
                info: RecoveryServerInfo = await nursery.start(
                    partial(serve_recovery, registry, host="127.0.0.1", port=0, token=TOKEN)
                )
                async with connect_slot(f"ws://127.0.0.1:{info.port}", agent.name, token=TOKEN) as client:
                    await client.quarantine(generation, "operator")  # answered while the withdrawal hangs
                    status = await client.status()
                assert status.attachment is not None and status.attachment.state == "unready"
                await discovery.entered["unregister"].wait()
                assert attachment_ads(discovery) != []  # discovery has not answered yet
                discovery.resume()
                await discovery.wait_for(lambda records: not ads(records))
                nursery.cancel_scope.cancel()
            engine.close()


async def test_websocket_quarantine_of_a_generation_that_is_not_current_is_refused() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, _discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            registry = SlotRegistry()
            registry.add(agent)
            async with trio.open_nursery() as nursery:
                info: RecoveryServerInfo = await nursery.start(
                    partial(serve_recovery, registry, host="127.0.0.1", port=0, token=TOKEN)
                )
                async with connect_slot(f"ws://127.0.0.1:{info.port}", agent.name, token=TOKEN) as client:
                    with pytest.raises(RecoveryClientError) as refused:
                        await client.quarantine(generation + 5, "operator typo")
                    assert refused.value.code == "generation_mismatch"
                    status = await client.status()
                assert status.attachment is not None and status.attachment.state == "ready"
                assert agent.statistics().coordinator.quarantines == {}
                nursery.cancel_scope.cancel()
            engine.close()


async def test_readyz_follows_the_attachment_state_and_healthz_answers() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, _discovery, _sink, context), trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, MetricSources(slots=lambda: [agent])))
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base) as http:
                response = await http.get("/readyz")
                assert response.status_code == 503
                detached = {"ready": False, "state": "detached", "reason": "no engine is attached"}
                assert response.json() == {"ready": False, "slots": {"s0": detached}}
                engine = XpubEngine(context)
                generation = await attach(agent, engine)
                response = await http.get("/readyz")
                assert response.status_code == 200
                ready = {"ready": True, "state": "ready", "reason": None}
                assert response.json() == {"ready": True, "slots": {"s0": ready}}
                signal(agent, generation, state=DISCONNECTED)
                await agent.status_cell.wait_for(lambda status: status.state == "disconnected")
                response = await http.get("/readyz")
                assert response.status_code == 503
                assert response.json()["slots"]["s0"] == {
                    "ready": False,
                    "state": "disconnected",
                    "reason": "the engine's connection dropped",
                }
                assert (await http.get("/healthz")).status_code == 200
                metrics = (await http.get("/metrics")).text
                assert 'kvagent_attachment_state{slot="s0",state="disconnected"} 1.0' in metrics
                assert 'kvagent_disconnects_total{slot="s0"} 1.0' in metrics
            nursery.cancel_scope.cancel()
            engine.close()
