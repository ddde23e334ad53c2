"""Attach, detach and quarantine are logged at INFO with the slot and generation (and the reason).

Logs are captured with the contextvars the agent's tasks bind merged in, as ``kvagent serve`` renders them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from kvagent.model.errors import KvAgentError
from tests.support.agent import TIMEOUT, XpubEngine, attach, batch, gpu_store, running_agent
from tests.support.logwatch import LogWatch, watch_logs


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
            await engine.send_payload(batch([gpu_store([1])], rank=3))  # another rank: the listener ends
            await agent.status_cell.wait_for(lambda status: not status.is_open_generation(generation))
            (entry,) = logs.named("ingress_quarantined")
            assert entry["slot"] == "s0" and entry["generation"] == generation
            assert entry["reason"] and entry["log_level"] == "warning"
            engine.close()
