"""Dynamo 1.6.1's indexer follows ``kvagent serve --republish`` across kvagent's own restart (issue #28, item 5).

kvagent runs with a state directory, is killed and started again on the same directory and the same ports,
while the engine restarts too: the restarted kvagent publishes a reset (``AllBlocksCleared``) and the new
engine's blocks. The indexer reads kvagent's PUB through a forwarder (``tests/interop/link.py``) that is
disconnected from kvagent before the kill and connects again only once the restarted kvagent has published
all of that, so the indexer certainly misses it — the way its own SUB misses what a restarted publisher sends
before the SUB's reconnect. kvagent sees the forwarder's subscription arrive and resyncs; the indexer, with a
replay endpoint registered and without one, must end with exactly kvagent's Worker state (no stale blocks of
the dead engine next to the live ones).

Issue #37: with an engine whose replay buffer has rolled past seq 0, kvagent restarts several times (a clean
stop and ``kill -9``, before and after its first compaction) and each time resumes from its persisted engine
seq, without a Worker reset; the indexer, following kvagent's PUB on its own reconnects, is exact after each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import zmq

from kvagent.simulator.engine import FakeVllmEngine
from tests.e2e.test_restart_rolled_replay import compact
from tests.interop.blocks import BLOCK_SIZE, PrefixClosedWorkload
from tests.interop.dynamo import DynamoIndexer, IndexerDump, run_indexer
from tests.interop.link import LossyLink
from tests.interop.test_dynamo_kvagent import STEPS, WAIT, WORKER, Scenario
from tests.support.serve import ServeProcess, client, serve

_REPUBLISHING = "republishes vLLM KV events on "


ROLLED_BUFFER = 50  # the engine keeps its last 50 batches: after STEPS + ROLLED_BUFFER it no longer has seq 0


def _config(tmp: Path, engine: FakeVllmEngine, endpoint: str, replay: str) -> str:
    return f"""
state_dir = "{tmp / "state"}"

[[slots]]
name = "s0"
kv_block_size = {BLOCK_SIZE}

[slots.engine]
endpoint = "{engine.endpoint}"
replay_endpoint = "{engine.replay_endpoint}"
worker_id = {WORKER}

[slots.republish]
endpoint = "{endpoint}"
replay_endpoint = "{replay}"
"""


@asynccontextmanager
async def kvagent_run(
    tmp: Path, engine: FakeVllmEngine, endpoint: str, replay: str
) -> AsyncIterator[tuple[ServeProcess, str, str]]:
    """One run of ``kvagent serve`` on ``tmp``'s state directory; yields it and the endpoints it bound."""
    config = tmp / "kvagent.toml"
    config.write_text(_config(tmp, engine, endpoint, replay))
    async with serve(tmp, "--config", str(config)) as agent:
        with trio.fail_after(WAIT):
            line = await agent.log.wait_for(lambda text: _REPUBLISHING in text)
            await engine.wait_for_subscriber()
        bound, _, bound_replay = line.split(_REPUBLISHING, 1)[1].partition(" replay ")
        yield agent, bound.strip(), bound_replay.strip()


async def until_following(indexer: DynamoIndexer, scenario: Scenario) -> None:
    """Live sentinels until one reaches the indexer (its SUB is subscribed, whatever it does on the gap)."""
    with trio.fail_after(WAIT):
        while True:
            sentinel = await scenario.sentinel()

            def holds(dump: IndexerDump, sentinel: int = sentinel) -> bool:
                return sentinel in dump.hashes()

            with trio.move_on_after(0.5):
                await indexer.wait_for_dump(holds)
                return


@pytest.mark.parametrize("forwarded", [True, False], ids=["late-for-sure", "own-reconnect"])
@pytest.mark.parametrize("with_replay", [True, False], ids=["replay", "no-replay"])
async def test_the_indexer_is_exact_after_kvagent_restarts(
    dynamo: str, tmp_path: Path, with_replay: bool, forwarded: bool
) -> None:
    """``late-for-sure``: through the forwarder, rejoining after everything the restart published.
    ``own-reconnect``: the indexer's SUB on kvagent's PUB, reconnecting whenever libzmq does (the field case:
    its reconnect backs off while kvagent is down, so it is back seconds after kvagent's restart batches).

    Without the resync the indexer keeps the dead engine's blocks: without replay it applies what follows
    the gap and nothing repairs it; with replay it repairs only when a live batch arrives after its reconnect,
    which an idle stream (here: after the check's one sentinel) never sends."""
    engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK_SIZE)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with run_indexer(dynamo) as indexer:
            ephemeral = "tcp://127.0.0.1:0"
            async with kvagent_run(tmp_path, engine, ephemeral, ephemeral) as (agent, endpoint, replay):
                link: LossyLink | None = None
                if forwarded:  # the indexer's way to kvagent's PUB
                    link = LossyLink(endpoint, zmq.Context.instance())
                    await nursery.start(link.run)
                await indexer.register(
                    instance_id=WORKER,
                    endpoint=endpoint if link is None else link.endpoint,
                    replay_endpoint=replay if with_replay else None,
                    block_size=BLOCK_SIZE,
                )
                scenario = Scenario(engine, agent, seed=11)
                await until_following(indexer, scenario)
                await scenario.steps(STEPS)
                before = await scenario.check(indexer)
                assert before.hashes(), "the indexer follows the first run"
                if link is not None:
                    link.leave_upstream()  # from here the indexer sees nothing of kvagent until it reconnects
            # kvagent was killed (SIGKILL); while it is down, the engine restarts with an empty cache.
            engine.kill()
            await engine.revive(restart=True)
            async with kvagent_run(tmp_path, engine, endpoint, replay) as (agent, again, again_replay):
                assert (again, again_replay) == (endpoint, replay)  # the same ports: routers keep them
                scenario.agent = agent
                scenario.workload = PrefixClosedWorkload(12)
                await scenario.steps(STEPS)  # the reset and the new engine's blocks, unseen by the indexer
                with trio.fail_after(WAIT):
                    after = await scenario.kvagent_converged(await scenario.sentinel())
                assert not after.hashes() & before.hashes(), "kvagent forgot the dead engine's blocks"
                if link is not None:
                    link.join(endpoint)  # the indexer's SUB is back
                exact = await scenario.check(indexer)
                assert exact.hashes() and not exact.hashes() & before.hashes(), "no stale block is left"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("compacted", [False, True], ids=["before-compaction", "after-compaction"])
@pytest.mark.parametrize("with_replay", [True, False], ids=["replay", "no-replay"])
async def test_the_indexer_stays_exact_as_kvagent_resumes_past_the_engine_replay_buffer(
    dynamo: str, tmp_path: Path, with_replay: bool, compacted: bool
) -> None:
    engine = FakeVllmEngine(
        replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK_SIZE, buffer_steps=ROLLED_BUFFER
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with run_indexer(dynamo) as indexer:
            ephemeral = "tcp://127.0.0.1:0"
            async with kvagent_run(tmp_path, engine, ephemeral, ephemeral) as (agent, endpoint, replay):
                await indexer.register(
                    instance_id=WORKER,
                    endpoint=endpoint,
                    replay_endpoint=replay if with_replay else None,
                    block_size=BLOCK_SIZE,
                )
                scenario = Scenario(engine, agent, seed=31)
                await until_following(indexer, scenario)
                if compacted:
                    await compact(engine)
                await scenario.steps(STEPS + ROLLED_BUFFER)
                assert engine.buffer[0][0] > 0, "the engine's replay buffer has rolled past seq 0"
                assert (await scenario.check(indexer)).hashes()
                agent.process.terminate()
                assert await agent.process.wait() == 0
            for stop in ("kill9", "sigterm", "kill9"):
                await scenario.steps(10)  # while kvagent is down: only the engine's buffer has them
                replays = len(engine.replay_starts)
                async with kvagent_run(tmp_path, engine, endpoint, replay) as (agent, again, again_replay):
                    assert (again, again_replay) == (endpoint, replay)
                    scenario.agent = agent
                    await scenario.steps(5)
                    await scenario.check(indexer)  # kvagent equals the engine, the indexer equals kvagent
                    assert min(engine.replay_starts[replays:], default=1) > 0, "resumed, not from seq 0"
                    assert not [line for line in agent.stderr_lines if "resume=skipped" in line]
                    async with client(agent.url) as c:
                        status = (await c.request("status"))["status"]
                    assert status["attachment"]["state"] == "ready"
                    if stop == "sigterm":
                        agent.process.terminate()
                        assert await agent.process.wait() == 0
                    # (kill9: leaving the block kills kvagent with SIGKILL)
        nursery.cancel_scope.cancel()
