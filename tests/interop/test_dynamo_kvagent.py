"""Dynamo 1.6.1's standalone indexer reads ``kvagent serve --republish`` and ends exactly where kvagent is.

A fake vLLM engine feeds ``kvagent serve`` (a subprocess, as an operator runs it); the indexer (another
subprocess, its own venv) is registered with the slot's republished PUB and replay ROUTER. The scenario goes
through a late join, live stores and removes, a range the engine's PUB dropped (kvagent repairs it from the
engine's replay ROUTER), an engine restart (seq back to 0) and an indexer restart. After each phase the
indexer's ``/dump`` equals kvagent's Worker-domain dump, block for block (hash, tokens hash, tier, worker),
and kvagent's GPU view equals what the engine really holds. A small republish ring makes the indexer's
recovery a snapshot; a large one makes it a replayed range.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import zmq

from kvagent.simulator.engine import FakeVllmEngine, block_removed
from tests.interop.blocks import BLOCK_SIZE, BlockMaker, PrefixClosedWorkload, stored
from tests.interop.dynamo import (
    DynamoIndexer,
    IndexerDump,
    blocks_of,
    run_indexer,
)
from tests.interop.link import LossyLink
from tests.support.serve import ServeProcess, client, serve

WAIT = 60.0
WORKER = 1
STEPS = 40  # engine steps per phase
_REPUBLISHING = "republishes vLLM KV events on "


@attrs.frozen(slots=True)
class Variant:
    """How kvagent republishes: its ring (a small one makes recoveries snapshots), replay form, DP rank."""

    ring: int = 10_000
    recovery: str = "range"
    legacy: bool = False
    dp_rank: int = 0


def _config(engine: FakeVllmEngine, variant: Variant) -> str:
    return f"""
[[slots]]
name = "s0"
kv_block_size = {BLOCK_SIZE}
dp_rank = {variant.dp_rank}

[slots.engine]
endpoint = "{engine.endpoint}"
replay_endpoint = "{engine.replay_endpoint}"
worker_id = {WORKER}

[slots.republish]
endpoint = "tcp://127.0.0.1:0"
replay_endpoint = "tcp://127.0.0.1:0"
buffer_batches = {variant.ring}
legacy_replay = {"true" if variant.legacy else "false"}
"""


@asynccontextmanager
async def kvagent_serving(
    tmp: Path, engine: FakeVllmEngine, variant: Variant
) -> AsyncIterator[tuple[ServeProcess, str, str]]:
    """``kvagent serve`` attached to ``engine``, republishing; yields it and its PUB and replay endpoints."""
    config = tmp / "kvagent.toml"
    config.write_text(_config(engine, variant))
    async with serve(tmp, "--config", str(config)) as agent:
        with trio.fail_after(WAIT):
            line = await agent.log.wait_for(lambda text: _REPUBLISHING in text)
            await engine.wait_for_subscriber()
        endpoint, _, replay = line.split(_REPUBLISHING, 1)[1].partition(" replay ")
        yield agent, endpoint.strip(), replay.strip()


async def kvagent_blocks(agent: ServeProcess) -> IndexerDump:
    """kvagent's Worker-domain resident blocks, from its websocket tree dump."""
    async with client(agent.url) as c:
        dump = await c.request("recover", start=None, end=None)
    assert dump["ok"] and dump["kind"] == "tree_dump", dump
    return blocks_of(event for event in dump["events"] if event.get("residency_domain") == "worker")


class Scenario:
    def __init__(self, engine: FakeVllmEngine, agent: ServeProcess, seed: int) -> None:
        self.engine = engine
        self.agent = agent
        self.workload = PrefixClosedWorkload(seed)
        self.sentinels = BlockMaker(seed + 1000)

    async def steps(self, count: int, *, drop_live: bool = False) -> None:
        for _ in range(count):
            events = self.workload.next_step()
            if events:
                await self.engine.publish_batch(events, drop_live=drop_live)

    async def sentinel(self) -> int:
        """A fresh root block, live: it pushes every consumer to notice any gap before it."""
        block = self.sentinels.chain(1)[0]
        await self.engine.publish_batch([stored([block])])
        return block.hash

    async def missed_by(self, link: LossyLink, batches: int) -> None:
        """Engine steps of which the indexer's link to kvagent drops the first ``batches`` republished ones."""
        target = link.dropped + batches
        link.drop_next(batches)
        with trio.fail_after(WAIT):
            while link.dropped < target:
                await self.steps(1)
                with trio.move_on_after(0.05):
                    await link.wait_dropped(target)

    async def kvagent_converged(self, sentinel: int) -> IndexerDump:
        """kvagent's dump once it holds the sentinel; its GPU view is then the engine's truth."""
        while True:
            blocks = await kvagent_blocks(self.agent)
            if sentinel in blocks.hashes():
                break
            await trio.sleep(0.05)
        assert blocks.hashes(tier="device") == self.engine.truth.blocks("GPU")
        return blocks

    async def check(self, indexer: DynamoIndexer) -> IndexerDump:
        """Phase end: the indexer's dump equals kvagent's, which equals the engine's GPU truth."""
        with trio.fail_after(WAIT):
            expected = await self.kvagent_converged(await self.sentinel())
            got = await _wait_equal(indexer, expected)
        assert got.blocks == expected.blocks
        return got


async def _wait_equal(indexer: DynamoIndexer, expected: IndexerDump) -> IndexerDump:
    try:
        return await indexer.wait_for_dump(lambda dump: dump.blocks == expected.blocks)
    except trio.Cancelled:
        indexer.report(expected)
        raise


async def until_replayed(indexer: DynamoIndexer, scenario: Scenario) -> None:
    """Live sentinels until the indexer has completed one more replay than it had.

    The indexer asks replay only when a live batch arrives, and its SUB may not be subscribed yet when the
    first one is sent: sentinels go out until one reaches it (each has a higher seq: its replay covers all).
    """
    done = indexer.count("Replay complete")
    try:
        with trio.fail_after(WAIT):
            while indexer.count("Replay complete") == done:
                await scenario.sentinel()
                with trio.move_on_after(0.5):
                    await indexer.wait_for_log("Replay complete", count=done + 1)
    except trio.TooSlowError:
        print("\n".join(["indexer log tail:", *indexer.log.lines[-30:]]))
        print("\n".join(["kvagent log tail:", *scenario.agent.stderr_lines[-30:]]))
        raise


async def join(
    indexer: DynamoIndexer, endpoint: str, replay: str, scenario: Scenario, dp_rank: int = 0
) -> None:
    """Register kvagent's stream with its replay ROUTER (as docs/interop.md tells operators to)."""
    await indexer.register(
        instance_id=WORKER, endpoint=endpoint, replay_endpoint=replay, block_size=BLOCK_SIZE, dp_rank=dp_rank
    )
    await until_replayed(indexer, scenario)


@pytest.mark.parametrize(
    "variant",
    [
        Variant(ring=4, recovery="snapshot"),
        Variant(),
        Variant(ring=4, recovery="snapshot", legacy=True),
        Variant(dp_rank=1),
    ],
    ids=["snapshot", "range", "snapshot-legacy-replay", "dp-rank-1"],
)
async def test_dynamo_indexer_follows_kvagent(dynamo: str, tmp_path: Path, variant: Variant) -> None:
    engine = FakeVllmEngine(
        replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK_SIZE, dp_rank=variant.dp_rank
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with kvagent_serving(tmp_path, engine, variant) as (agent, endpoint, replay):
            scenario = Scenario(engine, agent, seed=variant.ring + variant.dp_rank)
            await scenario.steps(STEPS)  # history before the indexer exists: it joins late
            link = LossyLink(endpoint, zmq.Context.instance())  # the indexer's SUB reads kvagent through it
            await nursery.start(link.run)

            async with run_indexer(dynamo) as indexer:
                await join(indexer, link.endpoint, replay, scenario, variant.dp_rank)
                late_join = await scenario.check(indexer)
                assert late_join.hashes(), "the late joiner recovered the resident blocks"
                _assert_recovery(indexer, variant.recovery)

                await scenario.steps(STEPS)  # live stores and removes
                await scenario.check(indexer)

                before = engine.replay_requests
                await scenario.steps(STEPS // 4, drop_live=True)  # the engine's PUB loses a range...
                await scenario.steps(1)
                await scenario.check(indexer)
                assert engine.replay_requests > before, "...which kvagent repaired from the engine's replay"

                engine.kill()
                await engine.revive(restart=True)  # a new engine: seq 0, empty cache, no AllBlocksCleared
                scenario.workload = PrefixClosedWorkload(variant.ring + 1)
                await scenario.steps(STEPS)
                await scenario.check(indexer)  # the dead engine's blocks are gone from both

                await scenario.missed_by(link, 3)  # the indexer misses a range of kvagent's stream
                await until_replayed(indexer, scenario)
                await scenario.check(indexer)
                assert indexer.count("Replay complete") == 2  # the late join's and this range's

            await scenario.steps(STEPS)  # history while no indexer runs
            async with run_indexer(dynamo) as indexer:  # the indexer restarts with nothing
                await join(indexer, link.endpoint, replay, scenario, variant.dp_rank)
                await scenario.check(indexer)
                _assert_recovery(indexer, variant.recovery)
        nursery.cancel_scope.cancel()


def _assert_recovery(indexer: DynamoIndexer, recovery: str) -> None:
    """A fresh indexer's one replay was a snapshot or a range (a snapshot answer starts after the requested
    seq 0, which the indexer reports; it applies it all the same)."""
    assert indexer.count("Replay complete") == 1
    snapshot = indexer.count("reason=started_after_requested") == 1
    assert snapshot == (recovery == "snapshot")


async def test_duplicate_physical_copies_reach_the_indexer_exactly(dynamo: str, tmp_path: Path) -> None:
    """vLLM stores a hash once per physical copy; read directly, Dynamo loses it at the first copy's removal
    (test_dynamo_wire.py). Through kvagent the remove reaches the indexer only when the last copy goes."""
    engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK_SIZE)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with kvagent_serving(tmp_path, engine, Variant()) as (agent, endpoint, replay):
            scenario = Scenario(engine, agent, seed=7)
            await scenario.sentinel()  # history: the indexer joins late, so it does replay
            async with run_indexer(dynamo) as indexer:
                await join(indexer, endpoint, replay, scenario)
                shared = BlockMaker(8).chain(1)
                await engine.publish_batch([stored(shared)])
                await engine.publish_batch([stored(shared)])  # a second physical copy of the same hash
                await engine.publish_batch([block_removed([shared[0].hash])])  # one copy evicted
                held = await scenario.check(indexer)
                assert shared[0].hash in held.hashes()
                await engine.publish_batch([block_removed([shared[0].hash])])  # the last copy evicted
                gone = await scenario.check(indexer)
                assert shared[0].hash not in gone.hashes()
        nursery.cancel_scope.cancel()
