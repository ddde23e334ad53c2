"""RepublishState: kvagent's seq space, the replay ring, snapshots, and a plain vLLM-style consumer model.

The model test drives random Worker-domain (and ignored CacheOwner) batches through the state and checks,
with a consumer that reads the payloads the way vLLM's docs show (untyped msgpack, a set of blocks per
medium, AllBlocksCleared forgets everything), that the live stream, and a snapshot followed by the later
ring batches, both rebuild exactly the blocks (and tokens) a direct model of the events holds.
"""

from __future__ import annotations

import gc
import struct
import tracemalloc
from collections.abc import Iterable, Sequence
from unittest import mock

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvagent.model.events import (
    CLEARED,
    EventData,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.publish import republish_state
from kvagent.publish.republish_state import (
    RangeAnswer,
    RepublishState,
    SnapshotAnswer,
    snapshot_frame_seq,
)
from kvagent.wire.vllm_events import SNAPSHOT_REQUEST, medium_of

BLOCK_SIZE = 2
W = ResidencyDomain.WORKER
C = ResidencyDomain.CACHE_OWNER
DEV = StorageTier.DEVICE
HOST = StorageTier.HOST_PINNED
TIERS = (DEV, HOST)

Blocks = dict[tuple[str, int], bytes]  # (medium, block hash) -> the block's token bytes


def tokens_of(block_hash: int, version: int) -> bytes:
    return struct.pack("<2I", block_hash, version)


def event(data: EventData, tier: StorageTier = DEV, domain: ResidencyDomain = W) -> RouterEvent:
    return RouterEvent(7, tier, domain, 0, data, 0)


def store(*hashes: int, parent: int | None = None, tier: StorageTier = DEV, version: int = 0) -> RouterEvent:
    token_bytes = b"".join(tokens_of(h, version) for h in hashes)
    return event(Stored(parent, hashes, tuple(hashes), token_bytes=token_bytes), tier)


def remove(*hashes: int, tier: StorageTier = DEV) -> RouterEvent:
    return event(Removed(hashes), tier)


def seq_bounds(state: RepublishState) -> tuple[int | None, int | None]:
    return state.oldest_seq, state.last_seq


def seq_request(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class Consumer:
    """A plain vLLM-style consumer: applies batches in order; checks snapshot stores come parents first."""

    def __init__(self) -> None:
        self.blocks: Blocks = {}

    def apply(self, payload: bytes, *, resident_parents: Iterable[tuple[str, int]] = ()) -> None:
        must_know = set(resident_parents)
        _, events, _ = msgpack.unpackb(payload, strict_map_key=False)
        for item in events:
            if item["type"] == "AllBlocksCleared":
                self.blocks.clear()
            elif item["type"] == "BlockRemoved":
                for block_hash in item["block_hashes"]:
                    self.blocks.pop((item["medium"], block_hash), None)
            else:
                assert item["type"] == "BlockStored" and item["block_size"] == BLOCK_SIZE
                parent = item["parent_block_hash"]
                if parent is not None and (item["medium"], parent) in must_know:
                    assert (item["medium"], parent) in self.blocks, f"store under unknown parent {parent}"
                tokens = struct.pack(f"<{len(item['token_ids'])}I", *item["token_ids"])
                width = 4 * BLOCK_SIZE
                for index, block_hash in enumerate(item["block_hashes"]):
                    self.blocks[(item["medium"], block_hash)] = tokens[index * width : (index + 1) * width]


def reference(events: Iterable[RouterEvent], blocks: Blocks | None = None) -> Blocks:
    """The Worker-domain blocks after ``events``, straight from the events (no encoding involved)."""
    blocks = {} if blocks is None else dict(blocks)
    for item in events:
        if item.residency_domain is not W:
            continue
        data = item.data
        if data is CLEARED:
            blocks.clear()
        elif isinstance(data, Removed):
            for block_hash in data.block_hashes:
                blocks.pop((medium_of(item.storage_tier), block_hash), None)
        else:
            assert isinstance(data, Stored) and data.token_bytes is not None
            for index, block_hash in enumerate(data.block_hashes):
                width = 4 * BLOCK_SIZE
                blocks[(medium_of(item.storage_tier), block_hash)] = data.token_bytes[
                    index * width : (index + 1) * width
                ]
    return blocks


def mirror(state: RepublishState) -> Blocks:
    return {(medium_of(tier), h): tokens or b"" for tier, h, _, tokens in state.snapshot_blocks()}


def consume_snapshot(answer: SnapshotAnswer, expected: Blocks) -> Consumer:
    consumer = Consumer()
    for payload in answer.payloads:
        consumer.apply(payload, resident_parents=expected)
    return consumer


# --- the seq space and the ring ------------------------------------------------------------------------------


def test_seqs_start_at_zero_and_skip_nothing_for_noops() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    assert state.last_seq is None and state.oldest_seq is None
    assert state.publish([]) is None
    assert state.publish([remove()]) is None  # an empty remove: a no-op
    assert state.publish([event(Stored(None, (5,), (5,)), HOST, C)]) is None  # not Worker residency
    published = [state.publish([store(h)]) for h in (1, 2, 3)]
    assert [item[0] for item in published if item is not None] == [0, 1, 2]
    assert seq_bounds(state) == (0, 2)


def test_ring_is_bounded_by_batches_and_by_bytes_and_keeps_the_newest() -> None:
    by_count = RepublishState(dp_rank=0, block_size=BLOCK_SIZE, ring_batches=3)
    for h in range(10):
        by_count.publish([store(h)])
    assert (by_count.oldest_seq, by_count.last_seq, by_count.statistics().ring_batches) == (7, 9, 3)
    by_bytes = RepublishState(dp_rank=0, block_size=BLOCK_SIZE, ring_bytes=1)
    for h in range(4):
        by_bytes.publish([store(h)])
    stats = by_bytes.statistics()
    assert (by_bytes.oldest_seq, stats.ring_batches) == (3, 1) and stats.ring_bytes > 1


def test_range_answers_hold_the_exact_published_batches() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    published = [state.publish([store(h)]) for h in range(5)]
    answer = state.answer(seq_request(2))
    assert isinstance(answer, RangeAnswer)
    assert list(answer.batches) == published[2:]
    for request in (seq_request(5), b"\xff" * 8):
        beyond = state.answer(request)
        assert isinstance(beyond, RangeAnswer) and list(beyond.batches) == []


def test_a_range_keeps_streaming_while_the_ring_evicts() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE, ring_batches=3)
    published = [state.publish([store(h)]) for h in range(3)]
    answer = state.answer(seq_request(0))
    assert isinstance(answer, RangeAnswer)
    first = next(answer.batches)
    for h in range(3, 10):
        state.publish([store(h)])
    assert [first, *answer.batches] == published


def test_nothing_published_answers_every_request_with_an_empty_range() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    for request in (SNAPSHOT_REQUEST, seq_request(0)):
        answer = state.answer(request)
        assert isinstance(answer, RangeAnswer) and list(answer.batches) == []


@pytest.mark.parametrize("request_frame", [b"", b"\x00" * 7, b"\x00" * 9, b"snapshots"])
def test_malformed_requests_raise_a_clear_error(request_frame: bytes) -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="8-byte big-endian start seq"):
        state.answer(request_frame)


# --- snapshots ------------------------------------------------------------------------------------------------


def test_old_start_and_snapshot_request_get_the_same_snapshot() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE, ring_batches=2)
    events = [store(1, 2), store(3, parent=2), remove(1), store(9, tier=HOST), store(10, parent=9, tier=HOST)]
    for item in events:
        state.publish([item])
    expected = reference(events)
    for request in (seq_request(0), SNAPSHOT_REQUEST):
        answer = state.answer(request)
        assert isinstance(answer, SnapshotAnswer)
        assert answer.seq == snapshot_frame_seq(4) == 4
        assert consume_snapshot(answer, expected).blocks == expected
    assert state.statistics().snapshots_served == 2


def test_snapshot_starts_with_a_clear_and_lists_a_re_stored_parent_before_its_children() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    events = [store(1, 2, 3), remove(1), store(1, version=1), store(4, parent=3), store(5, parent=1)]
    for item in events:
        state.publish([item])
    order = [h for _, h, _, _ in state.snapshot_blocks()]
    assert order.index(1) < order.index(2) < order.index(3) < order.index(4)
    answer = state.answer(SNAPSHOT_REQUEST)
    assert isinstance(answer, SnapshotAnswer)
    payloads = list(answer.payloads)
    assert msgpack.unpackb(payloads[0])[1][0] == {"type": "AllBlocksCleared"}
    consumer = Consumer()
    for payload in payloads:
        consumer.apply(payload, resident_parents=reference(events))
    assert consumer.blocks == reference(events)


def test_a_parent_cycle_still_lists_every_block() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    for item in (store(1), store(2, parent=1), store(1, parent=2)):  # contradictory re-stores
        state.publish([item])
    assert sorted(h for _, h, _, _ in state.snapshot_blocks()) == [1, 2]


def test_publishing_while_a_snapshot_is_open_defers_the_mirror() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    before = [store(1, 2), store(3, parent=2)]
    for item in before:
        state.publish([item])
    answer = state.answer(SNAPSHOT_REQUEST)
    assert isinstance(answer, SnapshotAnswer) and answer.seq == 1
    after = [remove(1, 2, 3), store(8), event(CLEARED), store(9)]
    live = [state.publish([item]) for item in after]
    assert [item[0] for item in live if item is not None] == [2, 3, 4, 5]
    stats = state.statistics()
    assert (stats.snapshots_open, stats.deferred_batches, stats.resident_blocks) == (1, 4, 3)
    second = state.answer(SNAPSHOT_REQUEST)  # the mirror is still at seq 1
    assert isinstance(second, SnapshotAnswer) and second.seq == 1
    assert consume_snapshot(second, reference(before)).blocks == reference(before)
    assert consume_snapshot(answer, reference(before)).blocks == reference(before)
    stats = state.statistics()
    assert (stats.snapshots_open, stats.deferred_batches) == (0, 0)
    assert mirror(state) == reference(before + after)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_snapshot_abandoned_before_its_first_payload_releases_the_mirror(how: str) -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    state.publish([store(1)])
    answer = state.answer(SNAPSHOT_REQUEST)
    state.publish([store(2)])
    assert state.statistics().deferred_batches == 1
    if how == "close":
        answer.close()
        answer.close()  # idempotent
    else:
        del answer
        gc.collect()
    assert state.statistics().snapshots_open == 0
    assert mirror(state) == reference([store(1), store(2)])


def test_statistics_count_publications() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    state.publish([store(1, 2), event(Stored(2, (3,), (3,))), remove(), event(CLEARED)])
    state.publish([store(4), event(Stored(None, (5,), (5,)), HOST, C)])
    state.answer(seq_request(0))
    stats = state.statistics()
    assert (stats.batches, stats.events, stats.stores_without_tokens) == (2, 4, 1)
    assert (stats.resident_blocks, stats.ranges_served, stats.snapshots_served) == (1, 1, 0)


def test_payloads_carry_the_clock_and_the_rank() -> None:
    state = RepublishState(dp_rank=3, block_size=BLOCK_SIZE, clock=lambda: 42.0)
    published = state.publish([store(1)])
    assert published is not None
    ts, _, rank = msgpack.unpackb(published[1])
    assert (ts, rank) == (42.0, 3)


# --- the model ------------------------------------------------------------------------------------------------

MAX_HASH = 10


@st.composite
def worker_events(draw: st.DrawFn, tree: dict[int, int | None], version: int) -> RouterEvent:
    """A store of a chain of ``tree`` (a block hash fixes its parent, as vLLM's chained hashes do), a remove,
    a clear, or a CacheOwner store the republisher must ignore."""
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear", "cache_owner"]))
    tier = draw(st.sampled_from(TIERS))
    if kind == "clear":
        return event(CLEARED)
    if kind == "cache_owner":
        return event(
            Stored(None, (draw(st.integers(1, MAX_HASH)),), (0,), token_bytes=tokens_of(0, 0)), HOST, C
        )
    if kind == "remove":
        return remove(*draw(st.lists(st.integers(1, MAX_HASH), max_size=4, unique=True)), tier=tier)
    tip = draw(st.integers(1, MAX_HASH))
    path = [tip]
    while (parent := tree[path[-1]]) is not None:
        path.append(parent)
    chain = path[: draw(st.integers(1, len(path)))][::-1]
    return store(*chain, parent=tree[chain[0]], tier=tier, version=version)


@st.composite
def trees(draw: st.DrawFn) -> dict[int, int | None]:
    """Each block hash's parent: a forest over 1..MAX_HASH, as chained block hashes fix it."""
    tree: dict[int, int | None] = {1: None}
    for block_hash in range(2, MAX_HASH + 1):
        tree[block_hash] = draw(st.one_of(st.none(), st.integers(1, block_hash - 1)))
    return tree


@st.composite
def streams(draw: st.DrawFn) -> list[list[RouterEvent]]:
    tree = draw(trees())
    count = draw(st.integers(1, 25))
    return [draw(st.lists(worker_events(tree, version), max_size=4)) for version in range(count)]


def publish_all(state: RepublishState, batches: Sequence[Sequence[RouterEvent]]) -> list[tuple[int, bytes]]:
    return [item for item in (state.publish(batch) for batch in batches) if item is not None]


@settings(max_examples=300, deadline=None)
@given(batches=streams(), ring=st.integers(1, 8), cut=st.integers(0, 25))
def test_live_stream_and_late_joins_rebuild_the_mirror(
    batches: list[list[RouterEvent]], ring: int, cut: int
) -> None:
    """Live consumer, a consumer joining late (any start seq), and a snapshot: all end on the same blocks."""
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE, ring_batches=ring)
    cut = min(cut, len(batches))
    published = publish_all(state, batches[:cut])
    at_cut = reference(event for batch in batches[:cut] for event in batch)
    assert mirror(state) == at_cut
    published += publish_all(state, batches[cut:])
    final = reference(event for batch in batches for event in batch)
    assert [seq for seq, _ in published] == list(range(len(published)))
    assert mirror(state) == final

    live = Consumer()
    for _, payload in published:
        live.apply(payload)
    assert live.blocks == final

    for start in range(len(published) + 1):
        answer = state.answer(seq_request(start))
        if isinstance(answer, RangeAnswer):
            assert list(answer.batches) == published[start:]
            continue
        assert start < (state.oldest_seq or 0)
        joined = consume_snapshot(answer, final)
        assert joined.blocks == final and answer.seq == published[-1][0]


@settings(max_examples=300, deadline=None)
@given(batches=streams(), cut=st.integers(0, 25), taken=st.integers(0, 3))
def test_snapshot_open_across_publishes_plus_later_batches_rebuilds_the_mirror(
    batches: list[list[RouterEvent]], cut: int, taken: int
) -> None:
    """A snapshot taken at ``cut`` and read slowly while publishing goes on, then the ring batches after it."""
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    cut = min(cut, len(batches))
    publish_all(state, batches[:cut])
    at_cut = reference(event for batch in batches[:cut] for event in batch)
    answer = state.answer(SNAPSHOT_REQUEST)
    later = publish_all(state, batches[cut:])
    final = reference(event for batch in batches for event in batch)
    if isinstance(answer, RangeAnswer):  # nothing was published before the cut
        assert list(answer.batches) == [] and at_cut == {}
        consumer = Consumer()
    else:
        consumer = Consumer()
        for _ in range(taken):  # part of the snapshot, then more publishing, then the rest
            payload = next(answer.payloads, None)
            if payload is not None:
                consumer.apply(payload, resident_parents=at_cut)
        publish_more = publish_all(state, [[store(10, version=99)]])
        later += publish_more
        final = reference([store(10, version=99)], final)
        for payload in answer.payloads:
            consumer.apply(payload, resident_parents=at_cut)
        assert consumer.blocks == at_cut
        later = [(seq, payload) for seq, payload in later if seq > answer.seq]
    for _, payload in later:
        consumer.apply(payload)
    assert consumer.blocks == final
    assert mirror(state) == final and state.statistics().deferred_batches == 0


def test_mirror_memory_per_block_is_bounded() -> None:
    """100k mirrored blocks of 16 tokens: the figure is in the report; the bound only catches blow-ups."""
    state = RepublishState(dp_rank=0, block_size=16, ring_batches=1)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for base in range(1 << 40, (1 << 40) + 100_000, 100):  # large hashes: 32-byte ints, as in production
            hashes = tuple(range(base, base + 100))
            state.publish([event(Stored(base - 1, hashes, (0,) * 100, token_bytes=bytes(100 * 64)))])
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - before) / 100_000
    finally:
        tracemalloc.stop()
    assert state.resident_blocks() == 100_000
    assert per_block < 400, per_block


@settings(max_examples=200, deadline=None)
@given(batches=streams())
def test_compaction_changes_nothing_a_snapshot_shows(batches: list[list[RouterEvent]]) -> None:
    """Compacting the mirror's rows as often as possible keeps every block, in the same order."""
    normal = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    publish_all(normal, batches)
    with mock.patch.object(republish_state, "_COMPACT_MIN_DEAD", 1):
        compacting = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
        publish_all(compacting, batches)
    assert list(compacting.snapshot_blocks()) == list(normal.snapshot_blocks())


def test_compaction_reclaims_the_rows_of_removed_blocks() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    with mock.patch.object(republish_state, "_COMPACT_MIN_DEAD", 4):
        state.publish([store(*range(1, 11))])
        state.publish([remove(*range(1, 7))])
    tier = state._mirror[DEV]
    assert (len(tier.hashes), len(tier.tokens), tier.dead) == (4, 4 * 4 * BLOCK_SIZE, 0)
    state.publish([store(1, 2, 3, 4, 5, 6, version=2)])  # back under the parent of block 7, in a later row
    expected = reference([store(*range(1, 11)), remove(*range(1, 7)), store(1, 2, 3, 4, 5, 6, version=2)])
    assert mirror(state) == expected
    assert [h for _, h, _, _ in state.snapshot_blocks()] == list(range(1, 11))


def test_a_chain_repeating_a_hash_keeps_one_block_with_its_newest_tokens() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    chain = Stored(
        None, (1, 2, 1), (0, 0, 0), token_bytes=tokens_of(1, 0) + tokens_of(2, 0) + tokens_of(1, 5)
    )
    state.publish([event(chain)])
    assert mirror(state) == {("GPU", 1): tokens_of(1, 5), ("GPU", 2): tokens_of(2, 0)}
    assert state.resident_blocks() == 2


def test_tokens_of_another_block_size_are_not_mirrored() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    state.publish([event(Stored(None, (1, 2), (0, 0), token_bytes=b"\x00" * 4))])
    assert [tokens for _, _, _, tokens in state.snapshot_blocks()] == [None, None]


class RepublishMachine(RuleBasedStateMachine):
    """Publishes, ranges and several snapshots open at once, read at any pace, closed at any point.

    Each snapshot must rebuild exactly the blocks after the batch its frames name, and those blocks plus the
    ring's later batches must give the newest state; with no snapshot open, the mirror is the newest state.
    """

    def __init__(self) -> None:
        super().__init__()
        self.state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE, ring_batches=6)
        self.tree: dict[int, int | None] = {}
        self.published: list[tuple[int, bytes]] = []
        self.history: list[Blocks] = []  # the blocks after each published seq
        self.open: list[tuple[SnapshotAnswer, Consumer]] = []

    def current(self) -> Blocks:
        return self.history[-1] if self.history else {}

    @initialize(data=st.data())
    def make_tree(self, data: st.DataObject) -> None:
        self.tree = data.draw(trees())

    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        batch = data.draw(st.lists(worker_events(self.tree, len(self.published)), max_size=4))
        after = reference(batch, self.current())
        published = self.state.publish(batch)
        if published is None:
            assert after == self.current()
            return
        assert published[0] == len(self.published)
        self.published.append(published)
        self.history.append(after)

    @rule(old=st.booleans())
    def open_snapshot(self, old: bool) -> None:
        oldest = self.state.oldest_seq
        request = seq_request(oldest - 1) if old and oldest else SNAPSHOT_REQUEST
        answer = self.state.answer(request)
        if isinstance(answer, RangeAnswer):
            assert not self.published and list(answer.batches) == []
            return
        assert answer.seq <= len(self.published) - 1
        self.open.append((answer, Consumer()))

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), count=st.integers(1, 3))
    def read(self, data: st.DataObject, count: int) -> None:
        index = data.draw(st.integers(0, len(self.open) - 1))
        answer, consumer = self.open[index]
        expected = self.history[answer.seq]
        for _ in range(count):
            payload = next(answer.payloads, None)
            if payload is None:
                del self.open[index]
                assert consumer.blocks == expected
                oldest = self.state.oldest_seq
                if oldest is not None and oldest <= answer.seq + 1:
                    for _, later in self.published[answer.seq + 1 :]:
                        consumer.apply(later)
                    assert consumer.blocks == self.current()
                return
            consumer.apply(payload, resident_parents=expected)

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        answer, _ = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        answer.close()

    @rule(data=st.data())
    def replay_range(self, data: st.DataObject) -> None:
        start = data.draw(st.integers(0, len(self.published) + 1))
        answer = self.state.answer(seq_request(start))
        if isinstance(answer, RangeAnswer):
            assert list(answer.batches) == self.published[start:]
        else:
            assert start < (self.state.oldest_seq or 0)
            answer.close()

    @invariant()
    def mirror_is_newest_when_no_snapshot_is_open(self) -> None:
        stats = self.state.statistics()
        assert stats.snapshots_open == len(self.open)
        if not self.open:
            assert stats.deferred_batches == 0
            assert mirror(self.state) == self.current()


RepublishMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_republish_machine = RepublishMachine.TestCase
