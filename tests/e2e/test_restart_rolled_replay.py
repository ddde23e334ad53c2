"""Issue #37: a restarted slot resumes exactly against an engine whose replay buffer has rolled past seq 0.

The fake engine keeps only its last 50 batches and has published 300 before the restart, so a slot that
re-took the engine's history from seq 0 would be degraded; one that resumes from its persisted engine seq
(still inside the buffer) is exact without a Worker reset. Every combination the issue lists: restart
before or after the first compaction, republish off / on / on with its replay ROUTER, after a clean stop
(SIGTERM) or a crash (``kill -9``). With republish, a vLLM-style consumer stays subscribed across the restart
(same ports) and must end with exactly kvagent's Worker blocks.
"""

from __future__ import annotations

import re
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from kvagent.simulator.engine import FakeVllmEngine, block_removed, block_stored
from tests.e2e.test_durability import (
    BLOCK,
    Churn,
    apply_events,
    event_ids,
    is_cleared,
    kill9,
    wait_persisted,
    worker_device,
    worker_dump,
)
from tests.e2e.test_republish_consumer import consumer_blocks, settle, worker_blocks
from tests.support.serve import ServeProcess, client, follow_until, serve
from tests.support.vllm_consumer import VllmStyleConsumer

TIMEOUT = 120
ENGINE_BUFFER = 50  # the engine keeps its last 50 batches for replay
BEFORE_RESTART = 300  # batches published before the restart: the buffer no longer reaches seq 0
WHILE_DOWN = 20  # batches published while the agent is down (inside the buffer)
COMPACTION_BLOCKS = 2_600  # stored then removed: 5200 events > the 4096 that trigger a compaction
SENTINEL = 1 << 60
LAST_BLOCK = 1 << 61  # the first life's last store: the follower that saw everything stops there


class Restart:
    def __init__(self, tmp: Path, engine: FakeVllmEngine, republish: str, stop: str) -> None:
        self.tmp = tmp
        self.engine = engine
        self.republish = republish
        self.stop = stop
        self.churn = Churn()
        self.sentinels = 0
        self.state_file = tmp / "state" / "slots" / "s0.sqlite3"

    def args(self, ports: tuple[str, str] | None) -> list[str]:
        replay = self.engine.replay_endpoint
        assert replay is not None
        args = ["--slot", f"s0={self.engine.endpoint}", "--replay", replay, "--topic", "kv-events"]
        args += ["--block-size", str(BLOCK), "--state-dir", str(self.tmp / "state")]
        pub, router = ports or ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        if self.republish != "off":
            args += ["--republish", pub, "--republish-topic", "kvagent"]
        if self.republish == "replay":
            args += ["--republish-replay", router]
        return args

    async def sentinel(self) -> int:
        block = SENTINEL + self.sentinels
        self.sentinels += 1
        await self.engine.publish_batch([block_stored([block], None, [7] * BLOCK, BLOCK)])
        return block

    async def churn_steps(self, count: int) -> None:
        for _ in range(count):
            await self.engine.publish_batch(self.churn.step())

    def truth(self) -> set[int]:
        return {int(block) for block in self.engine.truth.blocks("GPU")}  # type: ignore[call-overload]

    def snapshot_id(self) -> int | None:
        with closing(sqlite3.connect(self.state_file)) as db:
            (snapshot_id,) = db.execute("SELECT snapshot_id FROM slot").fetchone()
        return snapshot_id if snapshot_id is None else int(snapshot_id)

    async def stop_agent(self, agent: ServeProcess) -> None:
        if self.stop == "sigterm":
            agent.process.terminate()
            assert await agent.process.wait() == 0
        else:
            kill9(agent)
            await agent.process.wait()


async def follow_everything(
    url: str, seen: list[dict[str, Any]], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Follow from the start until :data:`LAST_BLOCK` is stored, collecting every event into ``seen``."""
    async with client(url) as following:
        task_status.started()
        seen.extend(await follow_until(following, LAST_BLOCK, None))


def diagnosis(lines: list[str]) -> list[str]:
    """The agent's log lines that tell why a slot reset or did not resume."""
    words = ("resum", "degrad", "reset", "gap", "replay", "state_loaded", "restart")
    return [line for line in lines if any(word in line for word in words)]


async def republish_ports(agent: ServeProcess) -> tuple[str, str]:
    """The republish PUB and (when bound) replay ROUTER endpoints the agent announced."""
    line = await agent.log.wait_for(lambda text: "republishes vLLM KV events on" in text)
    match = re.search(r"on (tcp://\S+)(?: replay (tcp://\S+))?", line)
    assert match is not None, line
    return match[1], match[2] or "tcp://127.0.0.1:0"


async def compact(engine: FakeVllmEngine) -> None:
    """Enough events for the writer to compact its suffix: each block stored, then removed after the next is
    stored (alternating kinds, so the coordinator's coalescing cannot merge them)."""
    base = 1 << 40
    for first in range(base, base + COMPACTION_BLOCKS, 50):
        events = []
        for block in range(first, first + 50):
            # Tokens of its own for every block: a radix-tree consumer (Dynamo) keys blocks by their tokens.
            tokens = [(block - base) * BLOCK + offset for offset in range(BLOCK)]
            events.append(block_stored([block], None, tokens, BLOCK))
            if block > base:
                events.append(block_removed([block - 1]))
        await engine.publish_batch(events)
    await engine.publish_batch([block_removed([base + COMPACTION_BLOCKS - 1])])


@pytest.mark.parametrize("stop", ["sigterm", "kill9"])
@pytest.mark.parametrize("republish", ["off", "on", "replay"])
@pytest.mark.parametrize("compacted", [False, True], ids=["before-compaction", "after-compaction"])
async def test_a_restart_resumes_exactly_when_the_engine_replay_no_longer_reaches_seq_0(
    tmp_path: Path, zmq_context: zmq.Context[Any], compacted: bool, republish: str, stop: str
) -> None:
    engine = FakeVllmEngine(
        replay_endpoint="tcp://127.0.0.1:0",
        block_size=BLOCK,
        buffer_steps=ENGINE_BUFFER,
        context=zmq_context,
        topic=b"kv-events",
    )
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            restart = Restart(tmp_path, engine, republish, stop)
            consumer: VllmStyleConsumer | None = None
            ports: tuple[str, str] | None = None

            # The first life: the engine's history rolls past its buffer, then the agent stops.
            subscriptions = engine.subscriptions
            async with serve(tmp_path, *restart.args(None)) as agent, client(agent.url) as c:
                await engine.wait_for_subscriber(subscriptions + 1)
                if republish != "off":
                    ports = await republish_ports(agent)
                    router = ports[1] if republish == "replay" else None
                    consumer = VllmStyleConsumer(zmq_context, ports[0], router, topic=b"kvagent")
                    await nursery.start(consumer.run)
                seen: list[dict[str, Any]] = []
                async with trio.open_nursery() as following:
                    # Followed from the start (a follow holds its connection), so that what it sees past its
                    # first dump is live, with the outbound ids a restarted follower resumes from.
                    await following.start(follow_everything, agent.url, seen)
                    if compacted:
                        await compact(engine)
                    await restart.churn_steps(BEFORE_RESTART)
                    if consumer is not None:
                        dump = await settle(engine, c, consumer)
                        assert consumer_blocks(consumer) == worker_blocks(dump)
                    await engine.publish_batch([block_stored([LAST_BLOCK], None, [9] * BLOCK, BLOCK)])
                last_id = max(event_ids(seen))
                await wait_persisted(c, last_id)
                first_life = list(agent.stderr_lines)
                await restart.stop_agent(agent)
            assert engine.buffer[0][0] > 0, "the engine's replay buffer must have rolled past seq 0"
            assert (restart.snapshot_id() is not None) == compacted
            seq_before = None if consumer is None else consumer.last_seq

            # While the agent is down: only the engine's (bounded) replay buffer has these.
            await restart.churn_steps(WHILE_DOWN)

            # The second life, on the same state directory (and the same republish ports).
            subscriptions = engine.subscriptions
            async with serve(tmp_path, *restart.args(ports)) as agent, client(agent.url) as c:
                await engine.wait_for_subscriber(subscriptions + 1)
                async with client(agent.url) as following:
                    missed = await follow_until(following, await restart.sentinel(), last_id)
                status = (await c.request("status"))["status"]
                resident = await worker_dump(c)
                assert not [line for line in agent.stderr_lines if "resume=skipped" in line]
                ids = event_ids(missed)
                assert ids and ids[0] > last_id and ids == sorted(set(ids)), f"ids go on: {last_id} {ids[:8]}"
                if stop == "sigterm":
                    assert ids[0] == last_id + 1, "a clean stop continues without a jump"
                resets = [e for e in missed if worker_device(e) and is_cleared(e)]
                assert not resets, "no Worker reset:\n" + "\n".join(diagnosis(first_life + agent.stderr_lines))
                assert status["attachment"]["state"] == "ready"
                assert resident == restart.truth()
                assert apply_events(apply_events(set(), seen), missed) == restart.truth()
                if consumer is not None:
                    republished = await settle(engine, c, consumer)
                    while consumer_blocks(consumer) != worker_blocks(republished):
                        republished = await settle(engine, c, consumer)  # a resync still on its way
                    assert (consumer.last_seq or 0) > (seq_before or 0), "the republished seq goes on"
                    assert status["republish"]["seq"] is not None
            nursery.cancel_scope.cancel()


async def test_republish_enabled_on_a_state_without_it_attaches_cold_once_then_resumes(
    tmp_path: Path, zmq_context: zmq.Context[Any]
) -> None:
    """The one restart that cannot resume: ``--republish`` newly enabled on a state whose Worker blocks have
    no tokens. It attaches cold (a Worker reset, then the engine's history: this engine still has all of it),
    and the reset, persisted with tokens after it, makes the state complete: the next restart resumes."""
    engine = FakeVllmEngine(
        replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK, context=zmq_context, topic=b"kv-events"
    )
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            restart = Restart(tmp_path, engine, "off", "sigterm")
            last_id: int | None = None
            for life, republish in enumerate(["off", "replay", "replay"]):
                restart.republish = republish
                subscriptions = engine.subscriptions
                async with serve(tmp_path, *restart.args(None)) as agent, client(agent.url) as c:
                    await engine.wait_for_subscriber(subscriptions + 1)
                    await restart.churn_steps(30)
                    async with client(agent.url) as following:
                        events = await follow_until(following, await restart.sentinel(), last_id)
                    assert await worker_dump(c) == restart.truth()
                    resets = [e for e in events if worker_device(e) and is_cleared(e)]
                    skipped = [line for line in agent.stderr_lines if "resume=skipped" in line]
                    if life == 1:
                        assert skipped and resets, "no tokens for the restored blocks: a cold attach"
                    elif life == 2:
                        assert not skipped and not resets, "the reset made the state complete: resumed"
                    last_id = max(event_ids(events))
                    await wait_persisted(c, last_id)
                    await restart.stop_agent(agent)
            nursery.cancel_scope.cancel()
