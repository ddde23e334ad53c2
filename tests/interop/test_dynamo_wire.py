"""What Dynamo 1.6.1's standalone indexer does with vLLM's wire protocol (phase 1: a fake engine, no kvagent).

These pin the facts docs/interop.md states and the republisher is built on: which replay answer forms the
indexer parses, when it asks for replay, which seq on snapshot frames it accepts, what a seq regression and
an ``AllBlocksCleared`` do to it. Each test drives :class:`FakeVllmEngine` (vLLM 0.32.0's bytes) and reads
the indexer's ``/dump``; waits are on the indexer's log or on ``/dump`` itself, bounded by ``fail_after``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Literal

import pytest
import trio

from kvagent.simulator.engine import FakeVllmEngine, all_blocks_cleared, block_removed, block_stored
from tests.interop.blocks import (
    BLOCK_SIZE,
    Block,
    BlockMaker,
    replay_frames,
    snapshot_payload_events,
    stored,
)
from tests.interop.dynamo import DynamoIndexer, run_indexer

WAIT = 30.0
WORKER = 1


@pytest.fixture(params=[1, 4], ids=["threads1", "threads4"])
def threads(request: pytest.FixtureRequest) -> int:
    """The indexer's --threads: 1 is its single KvIndexer, 4 (its default) a concurrent tree."""
    value: int = request.param
    return value


Layout = Literal["v0.26", "v0.25"]


class SnapshotEngine(FakeVllmEngine):
    """Answers every replay request with a snapshot (as a publisher whose ring no longer holds the start).

    The frames carry ``snapshot_seq`` — the variable under test — and hold ``snapshot_blocks``.
    """

    snapshot_blocks: Sequence[Block] = ()
    snapshot_seq = 0
    per_payload = 2  # several payloads share one seq, as a large snapshot's do

    def replay_replies(self, start: int) -> list[list[bytes]]:
        payloads = [
            self.encode_batch(events)
            for events in snapshot_payload_events(self.snapshot_blocks, per_payload=self.per_payload)
        ]
        pairs = [(self.snapshot_seq, payload) for payload in payloads]
        return replay_frames(self.topic, pairs, legacy=self.replay_layout != "v0.26")


@asynccontextmanager
async def indexer_and_engine(
    dynamo: str,
    threads: int,
    *,
    layout: Layout = "v0.26",
    replay: bool = True,
    engine_type: type[FakeVllmEngine] = FakeVllmEngine,
) -> AsyncIterator[tuple[DynamoIndexer, FakeVllmEngine]]:
    engine = engine_type(
        replay_endpoint="tcp://127.0.0.1:0" if replay else None, replay_layout=layout, block_size=BLOCK_SIZE
    )
    async with run_indexer(dynamo, threads=threads) as indexer, trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield indexer, engine
        nursery.cancel_scope.cancel()


async def attach(indexer: DynamoIndexer, engine: FakeVllmEngine, *, replay: bool = True) -> None:
    """Register the engine with the indexer and wait until its SUB has really subscribed."""
    await indexer.register(
        instance_id=WORKER,
        endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint if replay else None,
        block_size=BLOCK_SIZE,
    )
    with trio.fail_after(WAIT):
        await engine.wait_for_subscriber()


def gpu_truth(engine: FakeVllmEngine) -> frozenset[object]:
    return engine.truth.blocks("GPU")


@pytest.mark.parametrize("layout", ["v0.26", "v0.25"])
async def test_late_join_is_replayed_from_seq_0_in_either_replay_form(
    dynamo: str, threads: int, layout: Layout
) -> None:
    """A late joiner asks replay from 0 on its first live batch; 4-frame and legacy 3-frame answers both work."""
    maker = BlockMaker(1)
    async with indexer_and_engine(dynamo, threads, layout=layout) as (indexer, engine):
        first, second = maker.chain(3), maker.chain(2)
        await engine.publish_batch([stored(first)])
        await engine.publish_batch([stored(second)])
        await engine.publish_batch([block_removed([second[-1].hash])])
        await attach(indexer, engine)
        last = maker.chain(2, after=first[-1])
        await engine.publish_batch([stored(last)])
        with trio.fail_after(WAIT):
            dump = await indexer.wait_for_hashes(gpu_truth(engine))
        assert engine.replay_starts == [0]
        assert indexer.count("Replay complete") == 1
        # Dynamo hashes the token_ids itself: the tokens travel and must be the block's own.
        expected_tokens = {b.hash: b.tokens_hash for b in [*first, second[0], *last]}
        assert dump.tokens_hashes() == expected_tokens


async def test_first_live_seq_0_needs_no_replay(dynamo: str, threads: int) -> None:
    maker = BlockMaker(2)
    async with indexer_and_engine(dynamo, threads) as (indexer, engine):
        await attach(indexer, engine)
        await engine.publish_batch([stored(maker.chain(2))])
        with trio.fail_after(WAIT):
            await indexer.wait_for_hashes(gpu_truth(engine))
        assert engine.replay_starts == []


async def test_a_gap_is_replayed_from_the_next_expected_seq(dynamo: str, threads: int) -> None:
    maker = BlockMaker(3)
    async with indexer_and_engine(dynamo, threads) as (indexer, engine):
        await attach(indexer, engine)
        root = maker.chain(2)
        await engine.publish_batch([stored(root)])
        lost_a, lost_b = maker.chain(1, after=root[-1]), maker.chain(2)
        dropped = await engine.publish_batch([stored(lost_a)], drop_live=True)
        await engine.publish_batch([stored(lost_b)], drop_live=True)
        await engine.publish_batch([stored(maker.chain(1, after=lost_a[-1]))])
        with trio.fail_after(WAIT):
            await indexer.wait_for_hashes(gpu_truth(engine))
        assert engine.replay_starts == [dropped]


async def test_without_a_replay_endpoint_a_gap_is_lost(dynamo: str, threads: int) -> None:
    """``--workers`` and a /register without ``replay_endpoint`` leave gaps unrepaired."""
    maker = BlockMaker(4)
    async with indexer_and_engine(dynamo, threads, replay=False) as (indexer, engine):
        await attach(indexer, engine, replay=False)
        kept = maker.chain(2)
        await engine.publish_batch([stored(kept)])
        lost = maker.chain(2)
        await engine.publish_batch([stored(lost)], drop_live=True)
        after = maker.chain(1)
        await engine.publish_batch([stored(after)])
        with trio.fail_after(WAIT):
            dump = await indexer.wait_for_dump(lambda d: after[0].hash in d.hashes())
        assert dump.hashes() == {b.hash for b in [*kept, *after]}
        assert indexer.count("No replay endpoint configured") == 1


async def test_a_seq_regression_is_dropped_as_stale_until_it_passes_the_watermark(
    dynamo: str, threads: int
) -> None:
    """An engine restart (seq back to 0, no AllBlocksCleared) is invisible: old blocks stay, new ones are lost."""
    maker = BlockMaker(5)
    async with indexer_and_engine(dynamo, threads) as (indexer, engine):
        await attach(indexer, engine)
        before = [maker.chain(1) for _ in range(4)]  # seqs 0..3: watermark 3
        for chain in before:
            await engine.publish_batch([stored(chain)])
        with trio.fail_after(WAIT):
            await indexer.wait_for_hashes(gpu_truth(engine))
        engine.restart()
        ignored = [maker.chain(1) for _ in range(4)]  # seqs 0..3 again: stale
        for chain in ignored:
            await engine.publish_batch([stored(chain)])
        passing = maker.chain(1)  # seq 4 = watermark + 1: applied
        await engine.publish_batch([stored(passing)])
        with trio.fail_after(WAIT):
            dump = await indexer.wait_for_dump(lambda d: passing[0].hash in d.hashes())
        assert dump.hashes() == {b.hash for chain in [*before, passing] for b in chain}
        assert engine.replay_starts == []


async def test_all_blocks_cleared_in_the_stream_clears_the_worker(dynamo: str, threads: int) -> None:
    maker = BlockMaker(6)
    async with indexer_and_engine(dynamo, threads) as (indexer, engine):
        await attach(indexer, engine)
        await engine.publish_batch([stored(maker.chain(3))])
        with trio.fail_after(WAIT):
            await indexer.wait_for_hashes(gpu_truth(engine))
        fresh = maker.chain(2)
        await engine.publish_batch([all_blocks_cleared(), stored(fresh)])
        with trio.fail_after(WAIT):
            await indexer.wait_for_hashes(frozenset(b.hash for b in fresh))
        assert gpu_truth(engine) == {b.hash for b in fresh}


async def test_a_store_whose_parent_is_unknown_is_dropped(dynamo: str, threads: int) -> None:
    """Why a snapshot must list parents first: a child sent before its parent never reaches the tree."""
    maker = BlockMaker(7)
    async with indexer_and_engine(dynamo, threads) as (indexer, engine):
        await attach(indexer, engine)
        parent = maker.chain(1)
        child = maker.chain(1, after=parent[0])
        await engine.publish_batch([stored(child), stored(parent)])
        with trio.fail_after(WAIT):
            dump = await indexer.wait_for_dump(lambda d: parent[0].hash in d.hashes())
        assert dump.hashes() == {parent[0].hash}


async def test_a_store_without_token_ids_is_dropped(dynamo: str, threads: int) -> None:
    """Dynamo hashes token_ids itself: a store with ``token_ids=[]`` never reaches the tree, nor do its children."""
    maker = BlockMaker(11)
    async with indexer_and_engine(dynamo, threads) as (indexer, engine):
        await attach(indexer, engine)
        tokenless = maker.chain(2)
        await engine.publish_batch([block_stored([b.hash for b in tokenless], None, [], BLOCK_SIZE)])
        orphan = maker.chain(1, after=tokenless[-1])
        await engine.publish_batch([stored(orphan)])
        sentinel = maker.chain(1)
        await engine.publish_batch([stored(sentinel)])
        with trio.fail_after(WAIT):
            dump = await indexer.wait_for_dump(lambda d: sentinel[0].hash in d.hashes())
        assert dump.hashes() == {sentinel[0].hash}
        assert indexer.count("token_ids too short") == 1


@pytest.mark.parametrize("layout", ["v0.26", "v0.25"])
@pytest.mark.parametrize("frame_seq", ["last_included", "next_live"])
async def test_snapshot_frame_seq(dynamo: str, threads: int, layout: Layout, frame_seq: str) -> None:
    """Snapshot frames must carry the seq of the last batch the snapshot includes.

    With vLLM PR #50134's choice (the next live seq) the indexer's watermark ends one ahead and the next
    live batch is dropped as stale: its blocks never reach the index.
    """
    maker = BlockMaker(8)
    async with indexer_and_engine(dynamo, threads, layout=layout, engine_type=SnapshotEngine) as (
        indexer,
        raw,
    ):
        assert isinstance(raw, SnapshotEngine)
        engine = raw
        resident: list[Block] = []
        for _ in range(5):  # seqs 0..4 before the indexer joins: it will ask replay from 0
            chain = maker.chain(2, after=resident[-1] if resident else None)
            resident += chain
            await engine.publish_batch([stored(chain)])
        await attach(indexer, engine)
        joined = maker.chain(1, after=resident[0])  # seq 5, live: triggers the replay request
        resident += joined
        engine.snapshot_blocks = list(resident)
        last_included = engine.next_seq
        engine.snapshot_seq = last_included if frame_seq == "last_included" else last_included + 1
        await engine.publish_batch([stored(joined)])
        with trio.fail_after(WAIT):
            await indexer.wait_for_log("Replay complete")
        after_snapshot = maker.chain(1)  # seq 6
        await engine.publish_batch([stored(after_snapshot)])
        sentinel = maker.chain(1)  # seq 7
        await engine.publish_batch([stored(sentinel)])
        with trio.fail_after(WAIT):
            dump = await indexer.wait_for_dump(lambda d: sentinel[0].hash in d.hashes())
        assert engine.replay_starts == [0]
        truth = gpu_truth(engine)
        if frame_seq == "last_included":
            assert dump.hashes() == truth
        else:
            assert dump.hashes() == truth - {after_snapshot[0].hash}


async def test_a_snapshot_answering_a_gap_replaces_the_workers_state(dynamo: str, threads: int) -> None:
    """``AllBlocksCleared`` first makes a snapshot safe for an indexer that already holds (stale) blocks."""
    maker = BlockMaker(9)
    async with indexer_and_engine(dynamo, threads, engine_type=SnapshotEngine) as (indexer, raw):
        assert isinstance(raw, SnapshotEngine)
        engine = raw
        await attach(indexer, engine)
        doomed, kept = maker.chain(2), maker.chain(2)
        await engine.publish_batch([stored(doomed), stored(kept)])
        with trio.fail_after(WAIT):
            await indexer.wait_for_hashes(gpu_truth(engine))
        await engine.publish_batch([block_removed([b.hash]) for b in doomed], drop_live=True)
        grown = maker.chain(2, after=kept[-1])
        await engine.publish_batch([stored(grown)], drop_live=True)
        closing = maker.chain(1)
        engine.snapshot_blocks = [*kept, *grown, *closing]
        engine.snapshot_seq = engine.next_seq
        await engine.publish_batch([stored(closing)])
        with trio.fail_after(WAIT):
            await indexer.wait_for_hashes(gpu_truth(engine))
        assert engine.replay_starts == [1]


async def test_duplicate_physical_copies_are_not_counted(dynamo: str, threads: int) -> None:
    """vLLM stores a hash once per physical copy and removes each copy; Dynamo keeps one: the first remove wins.

    A consumer fed by vLLM directly loses a still-resident block here; kvagent's republished stream removes a
    block only when its last copy goes, so the indexer stays exact.
    """
    maker = BlockMaker(10)
    async with indexer_and_engine(dynamo, threads) as (indexer, engine):
        await attach(indexer, engine)
        shared = maker.chain(1)
        await engine.publish_batch([stored(shared)])
        await engine.publish_batch([stored(shared)])  # a second physical copy of the same hash
        await engine.publish_batch([block_removed([shared[0].hash])])  # one copy evicted
        sentinel = maker.chain(1)
        await engine.publish_batch([stored(sentinel)])
        with trio.fail_after(WAIT):
            dump = await indexer.wait_for_dump(lambda d: sentinel[0].hash in d.hashes())
        assert shared[0].hash in gpu_truth(engine)
        assert dump.hashes() == {sentinel[0].hash}
