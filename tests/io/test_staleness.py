"""A silent engine is visible: last-event age in the status and /metrics, one WARNING per silence episode.

The slot-level tests run a real slot agent against a real XPUB engine on 127.0.0.1; the episode logic is
pinned separately with a fake source under pytest-trio's ``autojump_clock`` (virtual time, no waiting).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvagent import SlotAgent, SlotAgentConfig, open_slot_agent
from kvagent.agent.metrics import MetricSources, render_metrics
from kvagent.agent.staleness import last_event_age, watch_silence
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.errors import KvAgentError
from kvagent.model.status import AgentStatus
from kvagent.testing import RecordingSink
from tests.support.agent import TIMEOUT, XpubEngine, attach, batch, gpu_store, is_store_of, wait_for_event
from tests.support.ids import IDENTITY, OWNER
from tests.support.logwatch import LogWatch, watch_logs


@pytest.fixture
def logs() -> Iterator[LogWatch]:
    with watch_logs() as watch:
        yield watch


@asynccontextmanager
async def slot_agent(silence_warning: float = 60.0) -> AsyncIterator[tuple[SlotAgent, zmq.Context[Any]]]:
    context: zmq.Context[Any] = zmq.Context()
    config = SlotAgentConfig(
        name="s0", cache_owner_id=OWNER, kv_block_size=32, silence_warning=silence_warning
    )
    try:
        async with open_slot_agent(
            config, discovery=MemoryDiscovery(), sink=RecordingSink(), zmq_context=context
        ) as agent:
            yield agent, context
    finally:
        context.destroy(linger=0)


def age_samples(agent: SlotAgent) -> dict[str, float]:
    text = render_metrics(MetricSources(slots=lambda: [agent])).decode()
    return {
        sample.labels["slot"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvagent_slot_last_event_age_seconds"
        for sample in family.samples
    }


async def test_the_age_is_absent_before_the_first_event_and_then_counts_from_the_last_one() -> None:
    with trio.fail_after(TIMEOUT):
        async with slot_agent() as (agent, context):
            assert agent.status().last_event_age_s is None
            assert agent.status().to_json()["last_event_age_s"] is None
            engine = XpubEngine(context)
            await attach(agent, engine)
            assert agent.status().last_event_age_s is None, "attached, but nothing received yet"
            assert age_samples(agent) == {}
            await engine.send_payload(batch([gpu_store([0xA1])]))
            await wait_for_event(agent, is_store_of(0xA1))
            received_at = trio.current_time()
            age = agent.status().last_event_age_s
            assert age is not None and 0.0 <= age <= trio.current_time() - received_at + 1.0
            status_json = json.loads(json.dumps(agent.status().to_json()))
            assert isinstance(status_json["last_event_age_s"], float)
            assert AgentStatus.from_json(status_json).last_event_age_s == status_json["last_event_age_s"]
            gauge = age_samples(agent)
            assert set(gauge) == {"s0"} and gauge["s0"] >= 0.0
            # The age grows while the engine is quiet: it is read from Trio's clock at each status.
            assert (agent.status().last_event_age_s or 0.0) >= age
            await agent.detach(1)
            assert agent.status().last_event_age_s is None, "no attachment, no age"
            assert age_samples(agent) == {}
            engine.close()


async def test_a_silent_engine_warns_once_and_an_info_line_follows_when_events_resume(logs: LogWatch) -> None:
    with trio.fail_after(TIMEOUT):
        async with slot_agent(silence_warning=0.2) as (agent, context):
            engine = XpubEngine(context)
            await attach(agent, engine)
            (warning,) = await logs.wait_for("engine_silent")
            assert warning["log_level"] == "warning"
            assert warning["slot"] == "s0" and warning["generation"] == 1
            assert warning["endpoint"] == engine.endpoint and warning["ever_received"] is False
            assert warning["silent_s"] >= 0.2
            assert logs.named("engine_events_resumed") == []
            await engine.send_payload(batch([gpu_store([0xB2])]))
            (resumed,) = await logs.wait_for("engine_events_resumed")
            assert resumed["log_level"] == "info" and resumed["slot"] == "s0" and resumed["generation"] == 1
            # A new episode after the resume: one more warning, now after events were seen.
            second = await logs.wait_for("engine_silent", count=2)
            assert second[1]["ever_received"] is True
            engine.close()


def test_silence_warning_must_be_positive() -> None:
    with pytest.raises(KvAgentError, match="silence_warning"):
        SlotAgentConfig(name="s", cache_owner_id=OWNER, kv_block_size=16, silence_warning=0)


def test_a_status_from_an_older_agent_has_no_age_and_a_bad_age_is_refused() -> None:
    value = AgentStatus(IDENTITY).to_json()
    del value["last_event_age_s"]
    assert AgentStatus.from_json(value).last_event_age_s is None
    for bad in (-1, "3", True):
        with pytest.raises(Exception, match="last_event_age_s"):
            AgentStatus.from_json({**value, "last_event_age_s": bad})


# -- the episode logic, in virtual time --------------------------------------------------------------------


class FakeSource:
    """A reader stand-in: ``receive()`` is a drain that got a live message."""

    endpoint = "tcp://127.0.0.1:5557"

    def __init__(self) -> None:
        self.last_live_at: float | None = None
        self._waiter: trio.Event | None = None

    async def wait_for_live(self) -> None:
        self._waiter = trio.Event()
        await self._waiter.wait()

    def receive(self) -> None:
        self.last_live_at = trio.current_time()
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None


async def test_one_warning_per_episode_in_virtual_time(
    logs: LogWatch, autojump_clock: trio.testing.MockClock
) -> None:
    source = FakeSource()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: watch_silence(source, slot="s", generation=3, silence_warning=60.0))
        await trio.sleep(59.0)
        assert logs.named("engine_silent") == []
        await trio.sleep(2.0)
        (first,) = logs.named("engine_silent")
        assert first["generation"] == 3 and first["ever_received"] is False
        await trio.sleep(3600.0)
        assert len(logs.named("engine_silent")) == 1, "one warning per episode, however long"
        source.receive()
        await trio.testing.wait_all_tasks_blocked()
        (resumed,) = logs.named("engine_events_resumed")
        assert resumed["silent_s"] >= 3600.0
        # Events every 30 s keep it quiet; then 60 s of silence is a new episode.
        for _ in range(5):
            await trio.sleep(30.0)
            source.receive()
        assert len(logs.named("engine_silent")) == 1
        assert last_event_age(source) == 0.0
        await trio.sleep(61.0)
        assert len(logs.named("engine_silent")) == 2
        assert last_event_age(source) == pytest.approx(61.0)
        nursery.cancel_scope.cancel()


def test_the_age_is_a_measurement_left_out_of_status_equality() -> None:
    assert AgentStatus(IDENTITY, last_event_age_s=1.0) == AgentStatus(IDENTITY, last_event_age_s=2.0)
    assert AgentStatus(IDENTITY, last_event_age_s=1.0).to_json()["last_event_age_s"] == 1.0
