"""A SUB that never meets a publisher says so: one WARNING naming the endpoint and why.

Real ZMQ on 127.0.0.1: a port nobody binds (an engine not up yet: said so, and the slot keeps retrying), a
PUB that *connects* to the same port while the engine's replay ROUTER is bound (what vLLM 0.32.0 does for
``tcp://127.0.0.1:PORT``: it binds only for ``*``, ``::`` or ipc: the bind-address hint), and a PUB that
binds (no warning).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvagent import SlotAgent, SlotAgentConfig, open_slot_agent
from kvagent.agent.config import AttachmentConfig
from kvagent.agent.metrics import MetricSources, render_metrics
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.testing import RecordingSink
from kvagent.vllm.budget import IngestBudget
from kvagent.vllm.connect_hint import unreachable_endpoint_hint
from kvagent.vllm.listener import ListenerOptions
from kvagent.vllm.reader import Inbox, LiveReader
from tests.support.agent import TIMEOUT, XpubEngine, attach
from tests.support.ids import OWNER
from tests.support.logwatch import LogWatch, watch_logs

WARNING = "vllm_endpoint_unreachable"


@pytest.fixture
def logs() -> Iterator[LogWatch]:
    with watch_logs() as watch:
        yield watch


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def unbound_endpoint() -> str:
    """A loopback port that was free a moment ago (nothing in this test binds it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@asynccontextmanager
async def running_reader(
    context: zmq.Context[Any], endpoint: str, warn_after: float, replay_endpoint: str | None = None
) -> AsyncIterator[LiveReader]:
    reader = LiveReader(
        context,
        endpoint=endpoint,
        topic=b"",
        rcvhwm=1000,
        inbox=Inbox(reply_bytes_bound=1 << 20),
        budget=IngestBudget(total=1 << 25, max_payload_bytes=1 << 20),
        held_bytes=lambda: 0,
        shed_held=lambda: 0,
        connect_warning_after=warn_after,
        replay_endpoint=replay_endpoint,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.run)
        yield reader
        nursery.cancel_scope.cancel()


async def wait_for_warning(logs: LogWatch) -> MutableMapping[str, Any]:
    with trio.fail_after(TIMEOUT):
        (warning,) = await logs.wait_for(WARNING)
    return warning


async def test_nothing_bound_at_the_endpoint_warns_once_naming_it(
    logs: LogWatch, context: zmq.Context[Any]
) -> None:
    endpoint = unbound_endpoint()
    async with running_reader(context, endpoint, warn_after=0.2) as reader:
        warning = await wait_for_warning(logs)
        assert warning["log_level"] == "warning" and warning["endpoint"] == endpoint
        # The common case (pods start in any order): the engine is not up yet, which is not vLLM's bind.
        assert warning["reason"] == "engine_not_up" and warning["retrying"] is True
        assert f"no engine listens at {endpoint} yet" in warning["hint"]
        assert "tcp://*" not in warning["hint"]
        assert reader.connect_warnings == 1


async def test_a_publisher_that_connects_instead_of_binding_is_the_same_dead_end(
    logs: LogWatch, context: zmq.Context[Any]
) -> None:
    endpoint = unbound_endpoint()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(endpoint)  # vLLM's behaviour for a non-wildcard tcp endpoint
    router = context.socket(zmq.ROUTER)  # vLLM always binds its replay endpoint: the engine is up
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        async with running_reader(context, endpoint, warn_after=0.2, replay_endpoint=replay) as reader:
            warning = await wait_for_warning(logs)
            assert warning["endpoint"] == endpoint and "CONNECTS" in warning["hint"]
            assert warning["reason"] == "engine_not_bound"
            assert f"start vLLM with endpoint tcp://*:{endpoint.rpartition(':')[2]}" in warning["hint"]
            assert reader.last_live_at is None
    finally:
        pub.close()
        router.close()


async def test_a_bound_publisher_is_met_and_nothing_is_logged(
    logs: LogWatch, context: zmq.Context[Any]
) -> None:
    engine = XpubEngine(context)
    try:
        with trio.fail_after(TIMEOUT):
            async with running_reader(context, engine.endpoint, warn_after=0.5) as reader:
                await reader.wait_connected()
                # The warning task saw the handshake and ended: let every task reach its next block.
                await trio.testing.wait_all_tasks_blocked()
                assert reader.connect_warnings == 0
                assert logs.named(WARNING) == []
    finally:
        engine.close()


async def test_a_late_publisher_clears_the_warning_with_an_info_line(
    logs: LogWatch, context: zmq.Context[Any]
) -> None:
    endpoint = unbound_endpoint()
    async with running_reader(context, endpoint, warn_after=0.2) as reader:
        await wait_for_warning(logs)
        engine = await XpubEngine.rebind(context, endpoint)
        try:
            with trio.fail_after(TIMEOUT):
                await reader.wait_connected()
                await trio.testing.wait_all_tasks_blocked()
            (connected,) = logs.named("vllm_endpoint_connected")
            assert connected["log_level"] == "info" and connected["endpoint"] == endpoint
        finally:
            engine.close()


async def test_an_attached_slot_on_a_dead_endpoint_warns(logs: LogWatch, context: zmq.Context[Any]) -> None:
    endpoint = unbound_endpoint()
    config = SlotAgentConfig(
        name="s0",
        cache_owner_id=OWNER,
        kv_block_size=32,
        listener=ListenerOptions(connect_warning_after=0.2),
    )
    with trio.fail_after(TIMEOUT):
        async with open_slot_agent(
            config, discovery=MemoryDiscovery(), sink=RecordingSink(), zmq_context=context
        ) as agent:
            await agent.attach(AttachmentConfig(worker_id=1, dp_rank=0, endpoint=endpoint))
            warning = await wait_for_warning(logs)
            assert warning["endpoint"] == endpoint
            assert agent.statistics().engine_connected is False
            assert connected_gauge(agent) == {"s0": 0.0}
            await agent.detach(1)
            assert agent.statistics().engine_connected is None
            assert connected_gauge(agent) == {}


async def test_an_attached_slot_on_a_bound_engine_is_connected(context: zmq.Context[Any]) -> None:
    config = SlotAgentConfig(name="s0", cache_owner_id=OWNER, kv_block_size=32)
    engine = XpubEngine(context)
    try:
        with trio.fail_after(TIMEOUT):
            async with open_slot_agent(
                config, discovery=MemoryDiscovery(), sink=RecordingSink(), zmq_context=context
            ) as agent:
                assert connected_gauge(agent) == {}, "no attachment: no series"
                await attach(agent, engine)
                while agent.statistics().engine_connected is not True:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.01)  # the monitor event is on its way
                assert connected_gauge(agent) == {"s0": 1.0}
    finally:
        engine.close()


def connected_gauge(agent: SlotAgent) -> dict[str, float]:
    text = render_metrics(MetricSources(slots=lambda: [agent])).decode()
    return {
        sample.labels["slot"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvagent_engine_connected"
        for sample in family.samples
    }


def test_the_hint_for_other_transports_names_the_endpoint() -> None:
    assert "ipc:///tmp/kv.sock" in unreachable_endpoint_hint("ipc:///tmp/kv.sock")[1]
    with pytest.raises(ValueError):
        ListenerOptions(connect_warning_after=0)


async def test_an_ipc_endpoint_nobody_binds_warns_too(
    logs: LogWatch, context: zmq.Context[Any], tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path / 'kv-events.sock'}"
    async with running_reader(context, endpoint, warn_after=0.2):
        warning = await wait_for_warning(logs)
        assert warning["endpoint"] == endpoint
        assert (warning["reason"], warning["hint"]) == unreachable_endpoint_hint(endpoint)
        assert "tcp://*" not in warning["hint"], "the vLLM tcp advice does not apply to ipc"
