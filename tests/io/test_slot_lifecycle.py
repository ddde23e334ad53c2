"""A lifecycle call cancelled halfway never leaves a half-done slot (issue #28 item 4).

The caller of ``attach``, ``detach`` or ``quarantine`` is cancelled after the k-th task step of the whole
program (any task: the caller, the slot task, the coordinator, the listener...) for k = 0, 1, 2, ... until
the call completes before its cancellation.  After each cancelled call the slot must be whole:

- fully attached: the coordinator's attachment is the slot's current one and ready, its listener delivers
  the engine's next batch, and exactly its ad is registered at the ready cursor; or
- fully not: no attachment, no attachment ad, and the next attach succeeds; or (quarantine only)
- fully quarantined: the attachment is held but unready, no attachment ad, and detach completes.

The websocket-level case: a client that disconnects while its ``attach`` is on its way (held in the
attachment ad's registration) leaves the slot whole too.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
import zmq
from trio_websocket import open_websocket_url

from kvagent import AttachmentConfig, SlotAgent, SlotAgentConfig, open_slot_agent
from kvagent.agent.host import SlotRegistry
from kvagent.discovery.base import DiscoveryRecord
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.errors import KvAgentError
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC, Cleared
from kvagent.recovery.server import RecoveryServerInfo, ServerStats, serve_recovery
from kvagent.testing import RecordingSink
from tests.support.agent import (
    XpubEngine,
    attach,
    attachment_ads_of,
    batch,
    gpu_store,
    is_store_of,
    running_agent,
    wait_for_event,
)
from tests.support.ids import OWNER
from tests.support.recovery import TOKEN

LIFECYCLE_CALLS = ("attach", "detach", "quarantine")


class _CancelAfterSteps(trio.abc.Instrument):
    """Cancels ``scope`` once the program has taken ``steps`` task steps (of any task) since installed."""

    def __init__(self, steps: int, scope: trio.CancelScope) -> None:
        self.remaining = steps
        self.scope = scope

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.scope.cancel()


async def completed_unless_cancelled_after(steps: int, call: Callable[[], Awaitable[object]]) -> bool:
    """Run ``call``, its caller cancelled after ``steps`` task steps; True if it completed first."""
    with trio.CancelScope() as scope:
        if steps == 0:
            scope.cancel()
        instrument = _CancelAfterSteps(steps, scope)
        trio.lowlevel.add_instrument(instrument)
        try:
            await call()
        finally:
            trio.lowlevel.remove_instrument(instrument)
    return not scope.cancelled_caught


async def settle(agent: SlotAgent) -> None:
    """Every lifecycle step begun before now has finished: a stale quarantine (no attachment ever has
    generation 0) is one more lifecycle call, served after them."""
    assert not await agent.quarantine(0, "settle")


def ad_cursors(records: dict[tuple[str, int], DiscoveryRecord]) -> list[int]:
    return [
        int(record.metadata["ready_at_outbound_cursor"])  # type: ignore[call-overload]
        for (topic, _), record in records.items()
        if topic == KV_STATE_ATTACHMENTS_TOPIC
    ]


class Probe:
    """Sends a fresh block through the engine and waits until the slot has applied it."""

    def __init__(self) -> None:
        self.block = 0xB10C_0000

    async def delivered(self, agent: SlotAgent, engine: XpubEngine) -> None:
        self.block += 1
        await engine.send_payload(batch([gpu_store([self.block])]))
        await wait_for_event(agent, is_store_of(self.block))


async def assert_whole(
    agent: SlotAgent, discovery: MemoryDiscovery, engine: XpubEngine, probe: Probe, *, subscribed: bool
) -> int | None:
    """The slot is fully attached, fully quarantined (returns the generation) or fully not (None).

    ``subscribed``: the engine has already seen this attachment's subscription (else it is awaited).
    """
    await settle(agent)
    status = agent.status().attachment
    current = agent.current_attachment
    if status is None:
        assert current is None, "the slot holds an attachment the coordinator does not have"
        await discovery.wait_for(lambda records: attachment_ads_of(records) == [])
        return None
    assert current is not None, f"the coordinator holds generation {status.generation}, the slot none"
    assert current.generation == status.generation
    if status.ready:
        if not subscribed:
            await engine.wait_subscribed()
        await probe.delivered(agent, engine)  # the listener runs
        cursor = status.ready_at_outbound_cursor
        await discovery.wait_for(lambda records: ad_cursors(records) == [cursor])
    else:
        assert status.state == "unready", status  # quarantined: held, not ready
        await discovery.wait_for(lambda records: attachment_ads_of(records) == [])
    return status.generation


async def cancel_at_every_step(call_name: str) -> int:
    """The cancellation loop for one lifecycle call; returns how many steps the call took."""
    probe = Probe()
    async with running_agent() as (agent, discovery, _sink, context):
        steps = 0
        while True:
            engine = XpubEngine(context)
            config = AttachmentConfig(worker_id=17 + steps, dp_rank=0, endpoint=engine.endpoint)
            call: Callable[[], Awaitable[object]]
            if call_name == "attach":
                call = partial(agent.attach, config)
            else:
                generation = await attach(agent, engine, worker_id=17 + steps)
                await discovery.wait_for(lambda records: len(ad_cursors(records)) == 1)
                if call_name == "detach":
                    call = partial(agent.detach, generation)
                else:
                    call = partial(agent.quarantine, generation, "cancelled quarantine")
            completed = await completed_unless_cancelled_after(steps, call)
            left = await assert_whole(agent, discovery, engine, probe, subscribed=call_name != "attach")
            if left is not None:
                await agent.detach(left)
            # The next attach succeeds (and is undone), so nothing of this round stays behind.
            replacement = XpubEngine(context)
            generation = await attach(agent, replacement, worker_id=1000 + steps)
            await probe.delivered(agent, replacement)
            await agent.detach(generation)
            replacement.close()
            engine.close()
            if completed:
                return steps
            steps += 1


@pytest.mark.parametrize("call_name", LIFECYCLE_CALLS)
async def test_a_lifecycle_call_cancelled_after_any_step_leaves_the_slot_whole(call_name: str) -> None:
    with trio.fail_after(200):
        steps = await cancel_at_every_step(call_name)
    print(f"{call_name}: cancelled after each of {steps} steps")
    assert steps > 1  # the call really had steps to be cancelled in


async def test_an_attach_abandoned_once_the_coordinator_attached_still_ends_whole() -> None:
    """Issue #28 item 4: the coordinator attaches after its caller gave up waiting; the listener start
    is cancelled.  The slot must not keep a ready attachment without a listener or an ad."""
    with trio.fail_after(30):
        async with running_agent() as (agent, discovery, _sink, context):
            engine = XpubEngine(context)
            config = AttachmentConfig(worker_id=17, dp_rank=0, endpoint=engine.endpoint)
            async with trio.open_nursery() as nursery:
                caller = trio.CancelScope()

                async def attach_then_leave() -> None:
                    with caller:
                        await agent.attach(config)

                nursery.start_soon(attach_then_leave)
                await agent.status_cell.wait_for(lambda s: s.attachment is not None and s.attachment.ready)
                caller.cancel()
            generation = await assert_whole(agent, discovery, engine, Probe(), subscribed=False)
            assert generation is not None  # the coordinator had attached: the slot finished the attach
            lifecycle = agent.statistics().lifecycle
            assert lifecycle is not None and lifecycle.unheard == 1 and lifecycle.rollbacks == 0
            await agent.detach(generation)
            replacement = XpubEngine(context)
            await attach(agent, replacement, worker_id=29)  # no "has not fully detached" conflict
            replacement.close()
            engine.close()


class HeldDiscovery(MemoryDiscovery):
    """Attachment-ad registrations wait for :attr:`release` while :attr:`holding` (entering sets ``entered``)."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.entered = trio.Event()
        self.release = trio.Event()

    async def register(self, record: DiscoveryRecord) -> None:
        if self.holding and record.topic == KV_STATE_ATTACHMENTS_TOPIC:
            self.entered.set()
            await self.release.wait()
        await super().register(record)


async def test_a_websocket_client_leaving_during_attach_leaves_the_slot_whole() -> None:
    """The recovery server cancels a session whose peer left; its attach must not be left half-done."""
    discovery = HeldDiscovery()
    with trio.fail_after(30):
        async with (
            running_agent(discovery=discovery) as (agent, _discovery, _sink, context),
            trio.open_nursery() as nursery,
        ):
            registry = SlotRegistry()
            registry.add(agent)
            stats = ServerStats()
            info: RecoveryServerInfo = await nursery.start(
                partial(serve_recovery, registry, host="127.0.0.1", port=0, token=TOKEN, stats=stats)
            )
            engine = XpubEngine(context)
            discovery.holding = True
            request: dict[str, Any] = {
                "id": 1,
                "op": "attach",
                "token": TOKEN,
                "worker_id": 17,
                "dp_rank": 0,
                "endpoint": engine.endpoint,
            }
            async with open_websocket_url(f"ws://127.0.0.1:{info.port}/v1/slots/{agent.name}") as ws:
                await ws.send_message(json.dumps(request))
                await discovery.entered.wait()  # the attach is on its way: barrier and listener done
            # The client has left; the server notices and cancels the session (its attach's caller).
            while stats.connections_open:
                await trio.testing.wait_all_tasks_blocked(0.01)
            discovery.holding = False
            discovery.release.set()
            generation = await assert_whole(agent, discovery, engine, Probe(), subscribed=False)
            if generation is not None:
                await agent.detach(generation)
            replacement = XpubEngine(context)
            await attach(agent, replacement, worker_id=29)
            replacement.close()
            engine.close()
            nursery.cancel_scope.cancel()


async def test_a_shutdown_interrupting_a_stuck_attach_rolls_it_back() -> None:
    """Discovery never answers the attachment ad's registration; the slot shuts down meanwhile.  The slot
    task's step is cancelled once the shutdown's wait is over and the attach is rolled back (final
    barrier); nothing stays advertised."""
    discovery = HeldDiscovery()
    discovery.holding = True  # never released
    sink = RecordingSink()
    context: zmq.Context[Any] = zmq.Context()
    config = SlotAgentConfig(name="s0", cache_owner_id=OWNER, kv_block_size=32, shutdown_step_timeout=0.2)
    try:
        with trio.fail_after(30):
            async with open_slot_agent(config, discovery=discovery, sink=sink, zmq_context=context) as agent:
                engine = XpubEngine(context)
                attaching = AttachmentConfig(worker_id=17, dp_rank=0, endpoint=engine.endpoint)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(agent.attach, attaching)
                    await discovery.entered.wait()  # barrier and listener done, the ad registration stuck
                    nursery.cancel_scope.cancel()  # the caller leaves; the slot shuts down right after
            statistics = agent.statistics().lifecycle
            engine.close()
    finally:
        context.destroy(linger=0)
    assert discovery.records == {}
    assert statistics is not None and statistics.rollbacks == 1
    cleared = [event for event in sink.events if isinstance(event.data, Cleared)]
    assert len(cleared) == 2  # the attach barrier and the rollback's final barrier


async def test_a_step_that_outlives_its_bound_fails_the_call_and_rolls_it_back() -> None:
    """Discovery never answers the ad registration: after ``lifecycle_step_timeout`` the attach fails, is
    rolled back (final barrier), and the next attach succeeds once discovery answers again."""
    discovery = HeldDiscovery()
    discovery.holding = True
    context: zmq.Context[Any] = zmq.Context()
    config = SlotAgentConfig(name="s0", cache_owner_id=OWNER, kv_block_size=32, lifecycle_step_timeout=0.5)
    try:
        with trio.fail_after(30):
            async with open_slot_agent(config, discovery=discovery, zmq_context=context) as agent:
                engine = XpubEngine(context)
                with pytest.raises(KvAgentError, match="failed to advertise") as failed:
                    await agent.attach(AttachmentConfig(worker_id=17, dp_rank=0, endpoint=engine.endpoint))
                assert "did not complete within 0.5 s" in str(failed.value.__cause__)
                assert agent.status().attachment is None and agent.current_attachment is None
                assert attachment_ads_of(discovery.records) == []
                discovery.holding = False
                replacement = XpubEngine(context)
                generation = await attach(agent, replacement, worker_id=29)
                assert generation == 2
                replacement.close()
                engine.close()
    finally:
        context.destroy(linger=0)
