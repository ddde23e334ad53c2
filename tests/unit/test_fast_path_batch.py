"""The batch-level fast path (issue #18) agrees with the general path, which defines behaviour.

Two coordinators run in lockstep over the same chunks: one with ``fast_path`` on (plain chunks go through
``coordinator/fastpath.py``), one with it off (every chunk through the general loop). Each step must raise
the same error or none, and after it the published events (token bytes included), publication calls, index
state and ring, counters, status and withdrawal requests must be equal. The chunks come from Hypothesis
(stores continuing chains, duplicate copies, removes of known and unknown hashes, barriers, CacheOwner
events, another rank, invalid hashes, failing applies, a lease end close by) and from the real vLLM vectors
through the listener's decode, normalize and chunking.

Every test runs twice (``native``): the fast side through the compiled core (kvagent/_native; skipped when
it is not built) and through the pure-Python fast path, each against the general loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvagent import _native
from kvagent.coordinator.coalesce import coalesce
from kvagent.coordinator.fastpath import is_plain_chunk, may_coalesce
from kvagent.coordinator.machine import SlotCoordinator
from kvagent.coordinator.task import StatusCell
from kvagent.index.recovery_index import EventsAnswer, RecoveryIndex
from kvagent.model.errors import CoordinatorError, WireDecodeError
from kvagent.model.events import (
    CLEARED,
    MAX_CHUNK_BLOCKS,
    MAX_CHUNK_EVENTS,
    U64_MAX,
    IngressChunk,
    PlacementEvent,
    Removed,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.model.status import AgentStatus
from kvagent.testing import RecordingSink
from kvagent.vllm.decode import RawBatch, decode_payload
from kvagent.vllm.normalize import (
    AttachmentNormalizer,
    NormalizedBatch,
    bounded_ingress_chunks,
    build_ingress_chunks,
)
from tests.support.coordinator import FIRST, SLOT_RANK, FlakyIndex
from tests.support.fuzz_decoder import normalize_each
from tests.support.ids import DEVICE, DISK, HP, IDENTITY, C, W, attachment_for
from tests.support.vectors import load_live, load_structs

NATIVE = [
    pytest.param(True, id="native", marks=pytest.mark.skipif(not _native.NATIVE, reason=_native.REASON)),
    pytest.param(False, id="python"),
]


class Side:
    """One coordinator with its index, sink and status; ``fast`` picks the path for plain chunks, ``native``
    whether that path is the compiled core's."""

    def __init__(
        self,
        *,
        fast: bool,
        lease_end: int | None = None,
        block_size: int = 4,
        flaky: bool = False,
        native: bool = False,
    ) -> None:
        self.index = RecoveryIndex(block_size, ring_capacity=64)
        # FlakyIndex injects failing applies; it has no apply_run, so the fast path applies event by event.
        self.local = FlakyIndex(self.index)
        local: FlakyIndex | RecoveryIndex = self.local if flaky else self.index
        self.sink = RecordingSink()
        self.status = StatusCell(AgentStatus(IDENTITY))
        self.withdrawals: list[int] = []
        self.core = SlotCoordinator(
            identity=IDENTITY,
            slot_rank=SLOT_RANK,
            index=local,
            sink=self.sink,
            on_status=self.status.set,
            request_withdrawal=self.withdrawals.append,
            lease_end=lease_end,
        )
        self.core.fast_path = fast
        self.core.native = _native.core if native else None
        # What a subscriber sees at each announcement: the event and the state right after it applied.
        self.announced: list[tuple[int, int]] = []
        self.index.subscribe(
            lambda event: self.announced.append((event.event_id, self.index.resident_block_count))
        )

    def observable(self) -> dict[str, Any]:
        ring = self.index.events_in_range(self.index.oldest_buffered_id(), None)
        return {
            "published": [(event, _token_bytes(event)) for event in self.sink.events],
            "calls": self.sink.calls,
            "resident": self.index.resident_blocks(),
            "dump": self.index.tree_dump().events,
            "ring": ring.events if isinstance(ring, EventsAnswer) else ring,
            "counters": self.core.counters.statistics(ingress_queue_depth=0, ingress_bytes=0),
            "status": self.status.get(),
            "withdrawals": list(self.withdrawals),
            "announced": list(self.announced),
            "cursor": self.core.outbound_cursor,
        }


def _token_bytes(event: RouterEvent) -> bytes | None:
    return event.data.token_bytes if isinstance(event.data, Stored) else None  # not part of Stored equality


class Lockstep:
    def __init__(
        self, *, lease_end: int | None = None, block_size: int = 4, flaky: bool = False, native: bool = False
    ) -> None:
        self.fast = Side(fast=True, lease_end=lease_end, block_size=block_size, flaky=flaky, native=native)
        self.general = Side(fast=False, lease_end=lease_end, block_size=block_size, flaky=flaky)
        self.plain_chunks = 0
        attached = [side.core.attach(attachment_for(FIRST)) for side in (self.fast, self.general)]
        assert attached[0] == attached[1]
        self.generation = attached[0].generation
        self.cursor = 0

    def feed(self, events: Sequence[PlacementEvent], *, fail_ordinary: bool = False) -> None:
        self.cursor += 1
        chunk = IngressChunk(self.generation, self.cursor, 0, True, tuple(events))
        if is_plain_chunk(chunk.events, SLOT_RANK):
            self.plain_chunks += 1
        outcomes: list[tuple[str, str] | None] = []
        for side in (self.fast, self.general):
            side.local.fail_ordinary = fail_ordinary
            try:
                side.core.handle_ingress(chunk)
                outcomes.append(None)
            except CoordinatorError as error:
                outcomes.append((error.code, str(error)))
        assert outcomes[0] == outcomes[1]
        assert self.fast.observable() == self.general.observable()


# -- Hypothesis streams ---------------------------------------------------------------------------------

HASHES = st.integers(min_value=1, max_value=40)


@st.composite
def _event(draw: st.DrawFn, previous_last: int | None) -> PlacementEvent:
    kind = draw(st.sampled_from(["store", "store", "chain", "remove", "remove", "clear", "owner", "odd"]))
    tier = draw(st.sampled_from([DEVICE, DEVICE, HP]))
    session = draw(st.sampled_from([None, None, "s1"]))
    if kind in ("store", "chain"):
        hashes = tuple(draw(st.lists(HASHES, min_size=0, max_size=4, unique=True)))
        parent = previous_last if kind == "chain" else draw(st.one_of(st.none(), HASHES))
        width = draw(st.sampled_from([0, 4]))  # token bytes present or absent
        tokens = None if width == 0 else bytes(range(len(hashes) * 16))
        data = Stored(parent, hashes, tuple(h + 1000 for h in hashes), None, None, tokens)
        return PlacementEvent(data, tier, W, SLOT_RANK, session)
    if kind == "remove":
        return PlacementEvent(Removed(tuple(draw(st.lists(HASHES, max_size=3)))), tier, W, SLOT_RANK, session)
    if kind == "clear":
        return PlacementEvent(CLEARED, tier, W, SLOT_RANK)
    if kind == "owner":
        choices: list[Stored | Removed] = [Stored(None, (7,), (8,)), Removed((7,))]
        owned = draw(st.sampled_from(choices))
        return PlacementEvent(owned, draw(st.sampled_from([HP, DISK])), C, SLOT_RANK)
    # odd: an invalid hash (the index refuses it, the stream goes on), or another rank (fails the source)
    if draw(st.booleans()):
        return PlacementEvent(Stored(None, (U64_MAX + 1,), (1,)), tier, W, SLOT_RANK)
    return PlacementEvent(Removed((1,)), tier, W, SLOT_RANK + 1)


@st.composite
def _chunk_events(draw: st.DrawFn, plain_bias: bool) -> list[PlacementEvent]:
    events: list[PlacementEvent] = []
    previous_last: int | None = None
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        event = draw(_event(previous_last))
        if plain_bias and not is_plain_chunk([event], SLOT_RANK):
            continue  # mostly plain chunks, so the fast path is exercised, not skipped
        events.append(event)
        hashes = event.data.block_hashes
        previous_last = hashes[-1] if hashes else previous_last
    return events


@pytest.mark.parametrize("native", NATIVE)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(_chunk_events(plain_bias=True), st.booleans(), st.integers(0, 9)), max_size=14),
    st.one_of(st.none(), st.integers(min_value=2, max_value=40)),
    st.booleans(),
)
def test_generated_streams_agree(
    native: bool, chunks: list[tuple[list[PlacementEvent], bool, int]], lease_end: int | None, flaky: bool
) -> None:
    lockstep = Lockstep(lease_end=lease_end, flaky=flaky, native=native)
    for events, mixed, failing in chunks:
        if mixed:
            # A barrier now and then after the plain events: the chunk takes the general loop.
            events = [*events, PlacementEvent(CLEARED, DEVICE, W, SLOT_RANK)]
        lockstep.feed(events, fail_ordinary=failing == 0)


@pytest.mark.parametrize("native", NATIVE)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_chunk_events(plain_bias=False), max_size=10))
def test_unbiased_streams_agree(native: bool, chunks: list[list[PlacementEvent]]) -> None:
    lockstep = Lockstep(native=native)
    for events in chunks:
        lockstep.feed(events)


@pytest.mark.parametrize("native", NATIVE)
def test_plain_chunks_take_the_fast_path_and_agree(native: bool) -> None:
    lockstep = Lockstep(native=native)
    chain = [PlacementEvent(Stored(None, (1, 2), (11, 12)), DEVICE, W, SLOT_RANK)]
    chain.append(PlacementEvent(Stored(2, (3,), (13,)), DEVICE, W, SLOT_RANK))  # continues: coalesced
    chain.append(PlacementEvent(Stored(None, (1,), (11,)), DEVICE, W, SLOT_RANK))  # a second copy of 1
    chain.append(PlacementEvent(Removed((1,)), DEVICE, W, SLOT_RANK))  # one copy left: swallowed
    chain.append(PlacementEvent(Removed((3, 1)), DEVICE, W, SLOT_RANK))  # adjacent removes: coalesced
    lockstep.feed(chain)
    assert lockstep.plain_chunks == 1
    published = lockstep.fast.sink.events
    assert [type(event.data) for event in published[1:]] == [Stored, Stored, Removed]
    counters = lockstep.fast.core.counters.statistics(ingress_queue_depth=0, ingress_bytes=0)
    assert counters.events_filtered == {}  # the partial remove was trimmed, not swallowed
    lockstep.feed([PlacementEvent(Removed((99,)), DEVICE, W, SLOT_RANK)])  # unknown hash: passed through


@pytest.mark.parametrize("native", NATIVE)
def test_a_lease_end_inside_a_plain_chunk_fails_at_the_same_event(native: bool) -> None:
    lockstep = Lockstep(lease_end=4, native=native)  # the attach barrier took id 1: ids 2 and 3 are left
    events = [PlacementEvent(Stored(None, (h,), (h,)), DEVICE, W, SLOT_RANK) for h in (1, 5, 9)]
    lockstep.feed(events)
    assert lockstep.fast.core.outbound_cursor == 3


def test_may_coalesce_is_true_whenever_coalesce_merges() -> None:
    stores = [
        PlacementEvent(Stored(None, (1,), (1,)), DEVICE, W, 0),
        PlacementEvent(Stored(1, (2,), (2,)), HP, W, 0),
    ]
    assert may_coalesce(stores)  # conservative: the tiers differ, so coalesce keeps both
    assert coalesce(stores) == stores
    removes = [PlacementEvent(Removed((1,)), DEVICE, W, 0), PlacementEvent(Removed((2,)), DEVICE, W, 0)]
    assert may_coalesce(removes) and len(coalesce(removes)) == 1
    apart = [stores[0], removes[0], PlacementEvent(Stored(None, (3,), (3,)), DEVICE, W, 0), removes[1]]
    assert not may_coalesce(apart) and coalesce(apart) == apart


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["store", "remove"]), st.integers(0, 3), st.integers(0, 2)), max_size=10
    )
)
def test_may_coalesce_never_misses_a_merge(shape: list[tuple[str, int, int]]) -> None:
    events = []
    for kind, parent, width in shape:
        hashes = tuple(range(parent + 1, parent + 1 + width))
        data = Stored(parent or None, hashes, hashes) if kind == "store" else Removed(hashes)
        events.append(PlacementEvent(data, DEVICE, W, 0))
    if not may_coalesce(events):
        assert coalesce(events) == events


# -- the real vLLM vectors, through decode, normalize and chunking ---------------------------------------


def _with_rank(payload: bytes, rank: int | None) -> bytes:
    """The payload with its envelope's rank (a last element that is a small int or nil, or none) made SLOT_RANK."""
    if payload[0] == 0x93 and (rank is None or rank <= 0x7F) and (payload[-1] <= 0x7F or payload[-1] == 0xC0):
        return payload[:-1] + bytes([SLOT_RANK])
    assert payload[0] == 0x92 and rank is None, "a vector envelope this test does not know"
    return b"\x93" + payload[1:] + bytes([SLOT_RANK])


def _vector_chunks(payloads: list[bytes], block_size: int, native: bool) -> list[IngressChunk]:
    """The chunks the listener admits: ``normalize_payload`` (natively with ``native``) and chunking."""
    normalizer = AttachmentNormalizer(
        kv_block_size=block_size, worker=WorkerWithDpRank(FIRST.worker_id, SLOT_RANK), native=native
    )
    chunks: list[IngressChunk] = []
    for seq, payload in enumerate(payloads):
        try:
            batch = decode_payload(payload)
        except WireDecodeError:
            continue  # some struct vectors are refused on purpose: the listener ends there
        # The vectors carry rank 0 or none, the slot sits at SLOT_RANK: the envelope's last byte says so.
        payload = _with_rank(payload, batch.data_parallel_rank)
        _rank, normalized = normalizer.normalize_payload(payload)
        assert normalized is not None
        chunks += build_ingress_chunks(1, seq, normalized, raw_bytes=len(payload), source_digest=seq)
    return chunks


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("source", ["live", "structs"])
def test_vllm_vectors_agree(source: str, native: bool) -> None:
    if source == "live":
        payloads, block_size = [frames[2] for frames in load_live()[0]], 32
    else:
        payloads, block_size = [frames[-1] for _note, frames in load_structs().values()], 16
    lockstep = Lockstep(block_size=block_size, native=native)
    for chunk in _vector_chunks(payloads, block_size, native):
        lockstep.feed(chunk.events)
    if source == "live":
        assert lockstep.plain_chunks > 0
        assert lockstep.fast.index.resident_block_count > 0


# -- the listener's chunking shortcut against bounded_ingress_chunks --------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=3000), max_size=MAX_CHUNK_EVENTS + 20),
    st.integers(min_value=0, max_value=1 << 20),
    st.integers(min_value=0, max_value=U64_MAX),
)
def test_chunks_match_the_bounded_split(sizes: list[int], raw_bytes: int, digest: int) -> None:
    events = [PlacementEvent(Removed(tuple(range(size))), StorageTier.DEVICE, W, 0) for size in sizes]
    normalized = NormalizedBatch(events, source_fault="f" if raw_bytes % 2 else None)
    chunks = build_ingress_chunks(5, 9, normalized, raw_bytes=raw_bytes, source_digest=digest)
    pieces = bounded_ingress_chunks(events)
    assert [chunk.events for chunk in chunks] == pieces
    assert [chunk.chunk_index for chunk in chunks] == list(range(len(pieces)))
    assert [chunk.final for chunk in chunks] == [False] * (len(pieces) - 1) + [True]
    assert [chunk.raw_bytes for chunk in chunks] == [0] * (len(pieces) - 1) + [raw_bytes]
    assert {chunk.source_digest for chunk in chunks} == {digest}
    assert [chunk.source_fault for chunk in chunks] == [normalized.source_fault] + [None] * (len(pieces) - 1)
    assert sum(len(chunk.events) for chunk in chunks) >= len(events)
    assert all(sum(len(e.data.block_hashes) for e in c.events) <= MAX_CHUNK_BLOCKS for c in chunks)


# -- RecoveryIndex.apply_run against apply, event by event ------------------------------------------------

ROUTER_TIERS = [DEVICE, DEVICE, HP]


@st.composite
def _router_event(draw: st.DrawFn, event_id: int, plain: bool) -> RouterEvent:
    kinds = (
        ["store", "store", "remove"]
        if plain
        else ["store", "remove", "bad_hash", "owner", "clear", "bad_tier"]
    )
    kind = draw(st.sampled_from(kinds))
    tier: Any = draw(st.sampled_from(ROUTER_TIERS))
    domain, source = W, None
    data: Any
    if kind == "store":
        hashes = tuple(draw(st.lists(HASHES, max_size=3, unique=True)))
        data = Stored(draw(st.one_of(st.none(), HASHES)), hashes, tuple(h + 100 for h in hashes))
    elif kind == "remove":
        data = Removed(tuple(draw(st.lists(HASHES, max_size=3))))
    elif kind == "bad_hash":
        data = Stored(None, (draw(st.sampled_from([-1, U64_MAX + 1, 5])),), (draw(st.sampled_from([-1, 6])),))
    elif kind == "owner":
        data, domain, source, tier = Stored(None, (3,), (4,)), C, IDENTITY.cache_owner_id, HP
    elif kind == "clear":
        data = CLEARED
    else:
        data, tier = Removed((1,)), "gpu"
    return RouterEvent(FIRST.worker_id, tier, domain, event_id, data, SLOT_RANK, source)


def _recorder(index: RecoveryIndex, record: list[tuple[int, int]]) -> Callable[[RouterEvent], None]:
    """A subscriber noting each announced id with the resident block count at that moment."""
    return lambda event: record.append((event.event_id, len(index.resident_blocks())))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_apply_run_is_apply_event_by_event(data: st.DataObject) -> None:
    one_by_one, at_once = RecoveryIndex(4, ring_capacity=16), RecoveryIndex(4, ring_capacity=16)
    seen: list[list[tuple[int, int]]] = [[], []]
    for index, record in zip((one_by_one, at_once), seen, strict=True):
        index.subscribe(_recorder(index, record))
    next_id = data.draw(st.integers(min_value=-1, max_value=2))
    for _ in range(data.draw(st.integers(min_value=1, max_value=8))):
        step = data.draw(st.sampled_from([1, 1, 1, 0, 2]))  # mostly consecutive; a repeat or a skip
        events = []
        plain = data.draw(st.booleans())  # half the runs of the shape apply_run takes (if the ids allow)
        for _ in range(data.draw(st.integers(min_value=0, max_value=5))):
            events.append(data.draw(_router_event(next_id, plain)))
            next_id += step
        expected: list[tuple[int, str]] = []
        for position, event in enumerate(events):
            try:
                one_by_one.apply(event)
            except Exception as error:
                expected.append((position, str(error)))
        before = (at_once.resident_blocks(), at_once.current_event_id(), list(seen[1]))
        failures = at_once.apply_run(events)
        if failures is None:
            # Declined (an event apply() refuses, or one not of the run's shape): nothing changed.
            assert (at_once.resident_blocks(), at_once.current_event_id(), seen[1]) == before
            for event in events:
                with contextlib.suppress(Exception):  # the refusals compared above, on the other index
                    at_once.apply(event)
        else:
            assert [(position, str(error)) for position, error in failures] == expected
        assert at_once.resident_blocks() == one_by_one.resident_blocks()
        assert at_once.tree_dump().events == one_by_one.tree_dump().events
        assert at_once.events_in_range(at_once.oldest_buffered_id(), None) == one_by_one.events_in_range(
            one_by_one.oldest_buffered_id(), None
        )
        assert seen[0] == seen[1]


def test_apply_run_leaves_a_failing_store_out_of_the_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvagent.index.store import BlockStore

    original = BlockStore.store

    def failing(self: BlockStore, parent: Any, hashes: Any, *rest: Any) -> None:
        if 13 in hashes:
            raise ValueError("injected store failure")
        original(self, parent, hashes, *rest)

    monkeypatch.setattr(BlockStore, "store", failing)
    # The Python store, whatever store the index would make (the compiled one does not call BlockStore.store).
    monkeypatch.setattr("kvagent.index.recovery_index.new_block_store", BlockStore)
    events = [
        RouterEvent(FIRST.worker_id, DEVICE, W, event_id, Stored(None, (block,), (block,)), SLOT_RANK)
        for event_id, block in ((1, 11), (2, 13), (3, 15))
    ]
    one_by_one, at_once = RecoveryIndex(4), RecoveryIndex(4)
    refused = []
    for event in events:
        try:
            one_by_one.apply(event)
        except ValueError as error:
            refused.append((event.event_id, str(error)))
    failures = at_once.apply_run(events)
    assert failures is not None
    assert (
        [(events[position].event_id, str(error)) for position, error in failures]
        == refused
        == [(2, "injected store failure")]
    )
    assert at_once.resident_blocks() == one_by_one.resident_blocks()
    assert at_once.ring_tail(0) == one_by_one.ring_tail(0) == (events[0], events[2])


# -- the per-event value types: constructed without frozen's cost, still values ---------------------------


@attrs.frozen(slots=True)
class FrozenStored:
    """What Stored was declared as before issue #18: the reference for equality and hashing."""

    parent_hash: int | None
    block_hashes: tuple[int, ...]
    tokens_hashes: tuple[int, ...]
    mm_extra_infos: Any = None
    start_position: int | None = None
    token_bytes: bytes | None = attrs.field(default=None, eq=False, repr=False)


@pytest.mark.parametrize("hot", [Stored, Removed, PlacementEvent, RouterEvent, IngressChunk])
def test_per_event_types_store_fields_directly_and_stay_values(hot: type) -> None:
    # The plain slotted __setattr__ is what makes construction fast (see model/events.py).
    assert "__setattr__" not in vars(hot)
    assert attrs.has(hot) and "__dict__" not in dir(hot.__new__(hot))
    assert hot.__hash__ is not None and hot.__hash__ is not object.__hash__


@given(
    st.one_of(st.none(), HASHES),
    st.lists(HASHES, max_size=3).map(tuple),
    st.lists(HASHES, max_size=3).map(tuple),
    st.one_of(st.none(), st.binary(max_size=4)),
)
def test_stored_equality_and_hash_are_the_frozen_ones(
    parent: int | None, hashes: tuple[int, ...], tokens: tuple[int, ...], token_bytes: bytes | None
) -> None:
    hot, frozen = (
        Stored(parent, hashes, tokens, None, None, token_bytes),
        FrozenStored(parent, hashes, tokens),
    )
    assert hash(hot) == hash(Stored(parent, hashes, tokens)) and hot == Stored(parent, hashes, tokens)
    assert attrs.astuple(hot, recurse=False)[:5] == attrs.astuple(frozen, recurse=False)[:5]
    assert {hot: 1}[Stored(parent, hashes, tokens)] == 1
    assert attrs.evolve(hot, parent_hash=7) == Stored(7, hashes, tokens) and hot.parent_hash == parent


# -- normalize's inline plain path once a cache namespace exists ------------------------------------------


def test_plain_events_after_a_salted_chain_take_the_general_path() -> None:
    """A salted store names a namespace; its unsalted child inherits it, so its local hashes differ from a
    plain store's and the inline path must not take it (nor a remove, which updates the namespaces)."""

    def raw(event: dict[str, Any]) -> RawBatch:
        return decode_payload(msgpack.packb([1.0, [event], 0]))

    tokens = list(range(8))
    salted = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 4,
        "cache_salt": "salt",
    }
    child = {
        "type": "BlockStored",
        "block_hashes": [3],
        "parent_block_hash": 2,
        "token_ids": tokens[:4],
        "block_size": 4,
    }
    removed = {"type": "BlockRemoved", "block_hashes": [2]}
    fast, general = (AttachmentNormalizer(kv_block_size=4, worker=WorkerWithDpRank(7, 0)) for _ in range(2))
    for event in (salted, child, removed, child):
        batch = raw(event)
        assert fast.normalize(batch) == normalize_each(general, batch)
        assert fast.framework._namespaces == general.framework._namespaces
    salted_first = AttachmentNormalizer(kv_block_size=4, worker=WorkerWithDpRank(7, 0))
    salted_first.normalize(raw(salted))
    namespaced = salted_first.normalize(raw(child)).events[0].data
    plain = (
        AttachmentNormalizer(kv_block_size=4, worker=WorkerWithDpRank(7, 0))
        .normalize(raw(child))
        .events[0]
        .data
    )
    assert isinstance(namespaced, Stored) and isinstance(plain, Stored)
    assert namespaced.tokens_hashes != plain.tokens_hashes  # the namespace check matters
