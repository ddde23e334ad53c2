"""Attach, detach and quarantine are logged at INFO with the slot and generation (and the reason).

Logs are captured with the contextvars the agent's tasks bind merged in, as ``kvagent serve`` renders them.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest
import trio
import trio.testing

from kvagent.agent.host import SlotRegistry
from kvagent.model.errors import KvAgentError, RecoveryClientError
from kvagent.recovery.client import connect_slot
from kvagent.recovery.server import RecoveryServerInfo, serve_recovery
from tests.support.agent import TIMEOUT, XpubEngine, attach, batch, gpu_store, running_agent
from tests.support.logwatch import LogWatch, watch_logs
from tests.support.recovery import TOKEN


def running_task_names() -> list[str]:
    """The names of every task of this run (trio names a task after its function, partials unwrapped)."""
    names: list[str] = []
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        if task is None:
            continue
        names.append(task.name)
        pending.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return names


@pytest.fixture
def logs() -> Iterator[LogWatch]:
    with watch_logs() as watch:
        yield watch


async def test_control_attach_quarantine_detach_are_logged_with_slot_and_generation(logs: LogWatch) -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, _discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            (attached,) = logs.named("slot_attached")
            assert attached["log_level"] == "info"
            assert (attached["slot"], attached["generation"]) == ("s0", generation)
            assert attached["endpoint"] == engine.endpoint and attached["worker_id"] == 17

            await agent.control_quarantine(generation, "operator says so")
            (quarantined,) = logs.named("slot_quarantined")
            assert quarantined["log_level"] == "info"
            assert (quarantined["slot"], quarantined["generation"]) == ("s0", generation)
            assert quarantined["reason"] == "operator says so"
            with pytest.raises(KvAgentError):
                await agent.control_quarantine(generation + 5, "stale")
            assert len(logs.named("slot_quarantined")) == 1, "a refused quarantine logs no quarantine"

            cursor = await agent.control_detach(generation)
            (detached,) = logs.named("slot_detached")
            assert detached["log_level"] == "info"
            assert (detached["slot"], detached["generation"], detached["outbound_cursor"]) == (
                "s0",
                generation,
                cursor,
            )
            engine.close()


async def test_an_internal_quarantine_names_the_slot_generation_and_reason(logs: LogWatch) -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, _discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            task_names_before = running_task_names()
            await engine.send_payload(batch([gpu_store([1])], rank=3))  # another rank: the listener ends
            await agent.status_cell.wait_for(lambda status: not status.is_open_generation(generation))
            (entry,) = logs.named("ingress_quarantined")
            assert entry["slot"] == "s0" and entry["generation"] == generation
            assert entry["reason"] and entry["log_level"] == "warning"
            # The ended listener's silence watch ended with it (no warning for a quarantined generation).
            assert "watch_silence" in str(task_names_before), "the watch ran beside the listener"
            await trio.testing.wait_all_tasks_blocked()
            assert not any("watch_silence" in name for name in running_task_names())
            engine.close()


async def test_control_over_the_websocket_is_logged_and_the_token_never_is(
    logs: LogWatch, nursery: trio.Nursery
) -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, _discovery, _sink, context):
            registry = SlotRegistry()
            registry.add(agent)
            info: RecoveryServerInfo = await nursery.start(
                partial(serve_recovery, registry, host="127.0.0.1", port=0, token=TOKEN)
            )
            url = f"ws://127.0.0.1:{info.port}"
            engine = XpubEngine(context)
            async with trio.open_nursery() as subscribing:
                subscribing.start_soon(engine.wait_subscribed)
                async with connect_slot(url, "s0", token=TOKEN) as client:
                    answer = await client.attach(worker_id=5, dp_rank=0, endpoint=engine.endpoint)
            generation = int(answer["generation"])
            async with connect_slot(url, "s0", token=TOKEN) as client:
                await client.quarantine(generation, "maintenance")
                await client.detach(generation)
            async with connect_slot(url, "s0", token="wrong-" + TOKEN) as client:
                with pytest.raises(RecoveryClientError):
                    await client.detach(generation)
            (attach_line,) = logs.named("slot_attached")
            (quarantine_line,) = logs.named("slot_quarantined")
            (detach_line,) = logs.named("slot_detached")
            for line in (attach_line, quarantine_line, detach_line):
                assert (line["slot"], line["generation"]) == ("s0", generation)
            assert attach_line["worker_id"] == 5 and quarantine_line["reason"] == "maintenance"
            (failed,) = logs.named("request_failed")
            assert (failed["slot"], failed["code"]) == ("s0", "unauthorized")
            assert TOKEN not in repr(logs.entries)
            engine.close()
