"""Recovery index: range answers, ring, ids, subscribers, clear scopes, validation, tree dumps, replay.

The live vLLM capture is exercised in test_index_live_vectors.py.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvagent.index.recovery_index import (
    EventsAnswer,
    InvalidRangeAnswer,
    RecoveryIndex,
    TooNewAnswer,
    TreeDumpAnswer,
)
from kvagent.model.errors import IndexApplyError
from kvagent.model.events import (
    CLEARED,
    RESET_ALL,
    MmExtraInfo,
    MmObject,
    Removed,
    ResidencyDomain,
    ResidencyOwner,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
    residency_owner,
)
from kvagent.model.ids import CacheOwnerId, derive_cache_owner_id
from tests.support.ids import OWNER

OTHER_OWNER = derive_cache_owner_id("other-slot", kv_block_size=16)
W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
DEVICE, HOST, DISK = StorageTier.DEVICE, StorageTier.HOST_PINNED, StorageTier.DISK


def store(
    event_id: int,
    hashes: tuple[int, ...],
    parent: int | None = None,
    *,
    domain: ResidencyDomain = W,
    tier: StorageTier = DEVICE,
    worker: int = 7,
    rank: int = 0,
    owner: CacheOwnerId | None = OWNER,
    tokens: tuple[int, ...] | None = None,
) -> RouterEvent:
    data = Stored(parent, hashes, tokens if tokens is not None else tuple(h + 1000 for h in hashes))
    return RouterEvent(worker, tier, domain, event_id, data, rank, owner)


def remove(
    event_id: int,
    hashes: tuple[int, ...],
    *,
    domain: ResidencyDomain = W,
    tier: StorageTier = DEVICE,
    worker: int = 7,
    rank: int = 0,
    owner: CacheOwnerId | None = OWNER,
) -> RouterEvent:
    return RouterEvent(worker, tier, domain, event_id, Removed(hashes), rank, owner)


def clear(
    event_id: int, domain: ResidencyDomain = W, *, worker: int = 7, rank: int = 0, owner: CacheOwnerId = OWNER
) -> RouterEvent:
    return RouterEvent(worker, DEVICE, domain, event_id, CLEARED, rank, owner)


Row = tuple[ResidencyOwner | None, StorageTier, int, int | None, int, object]


def state(index: RecoveryIndex) -> set[Row]:
    """The full resident state (owner, tier, block, parent, tokens hash, mm info), read through a dump."""
    rows: set[Row] = set()
    for event in index.tree_dump().events:
        assert isinstance(event.data, Stored) and len(event.data.block_hashes) == 1
        mm = None if event.data.mm_extra_infos is None else event.data.mm_extra_infos[0]
        rows.add(
            (
                residency_owner(event),
                event.storage_tier,
                event.data.block_hashes[0],
                event.data.parent_hash,
                event.data.tokens_hashes[0],
                mm,
            )
        )
    return rows


def replay_dump(dump: TreeDumpAnswer, first_id: int = 1) -> RecoveryIndex:
    replica = RecoveryIndex(16, ring_capacity=1024)
    for event_id, event in enumerate(dump.events, start=first_id):
        replica.apply(attrs.evolve(event, event_id=event_id))
    return replica


# --- range answers and the ring ----------------------------------------------------------------------


def test_range_answers_follow_the_exact_conditions() -> None:
    index = RecoveryIndex(16, ring_capacity=32)
    empty = index.events_in_range(None, None)
    assert empty == TreeDumpAnswer((), 0, RESET_ALL)
    assert index.events_in_range(5, None) == TreeDumpAnswer((), 0, RESET_ALL)  # empty ring beats TooNew
    assert index.current_event_id() == 0 and index.oldest_buffered_id() is None
    for i in range(1, 41):
        index.apply(store(i, (i,)))
    assert index.current_event_id() == 40 and index.oldest_buffered_id() == 9
    assert index.events_in_range(5, 3) == InvalidRangeAnswer(5, 3)
    assert index.events_in_range(50, 3) == InvalidRangeAnswer(50, 3)  # checked before TooNew
    dump = index.events_in_range(None, 10)
    assert isinstance(dump, TreeDumpAnswer) and dump.last_event_id == 40 and dump.reset_scope == RESET_ALL
    assert isinstance(index.events_in_range(8, None), TreeDumpAnswer)  # older than the oldest buffered
    assert index.events_in_range(41, 50) == TooNewAnswer(41, 50, 40)
    assert index.events_in_range(41, None) == TooNewAnswer(41, None, 40)
    answer = index.events_in_range(30, 31)
    assert isinstance(answer, EventsAnswer) and answer.last_event_id == 40
    assert [e.event_id for e in answer.events] == list(range(30, 41))  # end validates, never truncates
    oldest = index.events_in_range(9, None)
    assert isinstance(oldest, EventsAnswer) and [e.event_id for e in oldest.events] == list(range(9, 41))
    newest = index.events_in_range(40, 40)
    assert isinstance(newest, EventsAnswer) and [e.event_id for e in newest.events] == [40]


def test_ring_evicts_at_capacity_but_state_stays() -> None:
    index = RecoveryIndex(16, ring_capacity=32)
    for i in range(1, 33):
        index.apply(store(i, (i,)))
    assert index.oldest_buffered_id() == 1
    index.apply(store(33, (33,)))
    assert index.oldest_buffered_id() == 2 and index.current_event_id() == 33
    assert index.resident_block_count == 33  # eviction drops events, never residency


def test_non_consecutive_ids_warn_and_are_buffered() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (1,)))
    with capture_logs() as logs:
        index.apply(store(5, (5,)))
    assert logs == [
        {"event": "non_consecutive_event_id", "log_level": "warning", "expected_event_id": 2, "event_id": 5}
    ]
    assert index.current_event_id() == 5
    answer = index.events_in_range(3, None)  # a start inside the gap begins at the next buffered id
    assert isinstance(answer, EventsAnswer) and [e.event_id for e in answer.events] == [5]
    with capture_logs() as logs:
        index.apply(store(6, (6,)))
    assert not logs


def test_ids_that_do_not_increase_are_refused() -> None:
    index = RecoveryIndex(16)
    index.apply(store(3, (1,)))
    for event_id in (3, 2):
        with pytest.raises(IndexApplyError):
            index.apply(store(event_id, (99,)))
    assert index.current_event_id() == 3 and index.resident_block_count == 1


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        RecoveryIndex(0)
    with pytest.raises(ValueError):
        RecoveryIndex(16, ring_capacity=0)
    index = RecoveryIndex(16, ring_capacity=32)
    assert (index.kv_block_size, index.ring_capacity) == (16, 32)
    assert RecoveryIndex(16).ring_capacity == 1024


# --- subscribers ------------------------------------------------------------------------------------


def test_subscribers_see_every_applied_event_in_order() -> None:
    index = RecoveryIndex(16)
    seen: list[tuple[str, int, int]] = []

    def first(event: RouterEvent) -> None:
        # Called after the apply: the state already includes the event.
        seen.append(("first", event.event_id, index.current_event_id()))

    def broken(event: RouterEvent) -> None:
        raise RuntimeError("subscriber bug")

    unsubscribe_first = index.subscribe(first)
    unsubscribe_broken = index.subscribe(broken)
    index.subscribe(lambda e: seen.append(("second", e.event_id, index.resident_block_count)))
    with capture_logs() as logs:
        index.apply(store(1, (1,)))
    assert seen == [("first", 1, 1), ("second", 1, 1)]
    assert index.current_event_id() == 1  # a failing subscriber does not fail the apply
    assert any("subscriber" in log["event"] and log["log_level"] == "error" for log in logs)
    unsubscribe_broken()
    with pytest.raises(IndexApplyError):
        index.apply(store(1, (2,)))  # refused: no subscriber hears about it
    unsubscribe_first()
    unsubscribe_first()  # idempotent
    index.apply(store(2, (2,)))
    assert seen == [("first", 1, 1), ("second", 1, 1), ("second", 2, 2)]


def test_unsubscribe_during_callback_takes_effect_after_the_current_event() -> None:
    index = RecoveryIndex(16)
    calls: list[int] = []

    def once(event: RouterEvent) -> None:
        calls.append(event.event_id)
        unsubscribe()

    unsubscribe = index.subscribe(once)
    index.apply(store(1, (1,)))
    index.apply(store(2, (2,)))
    assert calls == [1]


# --- residency semantics ----------------------------------------------------------------------------


def test_stored_chains_removed_and_overwrite() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (10, 11, 12), parent=5, tokens=(1, 2, 3)))
    worker = WorkerWithDpRank(7, 0)
    assert state(index) == {
        (worker, DEVICE, 10, 5, 1, None),
        (worker, DEVICE, 11, 10, 2, None),
        (worker, DEVICE, 12, 11, 3, None),
    }
    index.apply(store(2, (11,), parent=None, tokens=(9,)))  # re-store overwrites parent and tokens
    index.apply(remove(3, (12, 404)))  # unknown hashes are ignored
    index.apply(remove(4, (10,), tier=HOST))  # another tier holds nothing of it
    assert state(index) == {(worker, DEVICE, 10, 5, 1, None), (worker, DEVICE, 11, None, 9, None)}
    assert index.resident_block_count == 2


def test_mm_extra_info_is_kept_per_block() -> None:
    info = MmExtraInfo((MmObject(77, ((0, 3),)),))
    index = RecoveryIndex(16)
    index.apply(RouterEvent(7, DEVICE, W, 1, Stored(None, (1, 2), (3, 4), (None, info)), 0))
    rows = {row[2]: row[5] for row in state(index)}
    assert rows == {1: None, 2: info}
    index.apply(store(2, (2,)))  # re-stored without MM info
    assert {row[2]: row[5] for row in state(index)} == {1: None, 2: None}


def test_worker_clear_resets_every_worker_of_its_rank_on_every_tier() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (1,), worker=7, rank=0))
    index.apply(store(2, (2,), worker=8, rank=0, tier=DISK))  # another worker, same rank
    index.apply(store(3, (3,), worker=7, rank=1, tier=HOST))  # another rank
    index.apply(store(4, (4,), domain=C, tier=HOST))
    index.apply(clear(5, rank=0))
    assert {(o, h) for (o, _t, h) in index.resident_blocks()} == {(WorkerWithDpRank(7, 1), 3), (OWNER, 4)}


def test_cache_owner_clear_resets_only_that_owner() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (1,)))
    index.apply(store(2, (2,), domain=C, tier=HOST))
    index.apply(store(3, (3,), domain=C, tier=DISK))
    index.apply(store(4, (4,), domain=C, tier=DISK, owner=OTHER_OWNER))
    index.apply(clear(5, C))  # Device is a CacheOwner clear's placeholder tier
    assert {(o, h) for (o, _t, h) in index.resident_blocks()} == {
        (WorkerWithDpRank(7, 0), 1),
        (OTHER_OWNER, 4),
    }


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (store(2, (1,), domain=C, tier=HOST, owner=None), "state_source"),
        (RouterEvent(7, DEVICE, C, 2, CLEARED, 0, None), "state_source"),
        (store(2, (1,), domain=C, tier=DEVICE), "Device"),
        (remove(2, (1,), domain=C, tier=DEVICE), "Device"),
        (RouterEvent(7, DEVICE, W, 2, Stored(None, (1, 2), (3,)), 0), "tokens hashes"),
        (RouterEvent(7, DEVICE, W, 2, Stored(None, (1,), (3,), (None, None)), 0), "mm_extra_infos"),
        (RouterEvent(7, DEVICE, W, 2, Stored(None, (2**64,), (3,)), 0), "u64"),
        (RouterEvent(7, DEVICE, W, 2, Stored(-1, (1,), (3,)), 0), "u64"),
    ],
)
def test_invalid_events_change_nothing(event: RouterEvent, reason: str) -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (50,), domain=C, tier=HOST))
    before = state(index)
    with pytest.raises(IndexApplyError, match=reason):
        index.apply(event)
    assert state(index) == before and index.current_event_id() == 1


def test_compaction_after_mass_removal_keeps_the_survivors() -> None:
    index = RecoveryIndex(16)
    hashes = tuple(range(1, 10_001))
    index.apply(store(1, hashes))
    index.apply(remove(2, hashes[:9_000]))  # frees 9000 rows: compacts
    index.apply(store(3, (20_000, 20_001), parent=hashes[-1]))
    worker = WorkerWithDpRank(7, 0)
    expected = {(worker, DEVICE, h, h - 1, h + 1000, None) for h in hashes[9_001:]}
    expected |= {(worker, DEVICE, 9_001, 9_000, 10_001, None)}
    expected |= {
        (worker, DEVICE, 20_000, 10_000, 21_000, None),
        (worker, DEVICE, 20_001, 20_000, 21_001, None),
    }
    assert state(index) == expected
    index.apply(remove(4, (*hashes, 20_000, 20_001)))
    assert index.resident_block_count == 0 and index.tree_dump().events == ()


# --- tree dumps -------------------------------------------------------------------------------------


def test_dump_entries_carry_their_owner() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (1,), worker=7, rank=2, tier=HOST))
    index.apply(store(2, (2,), domain=C, tier=DISK, worker=7, rank=2))
    index.apply(remove(3, (404,), domain=C, tier=HOST, worker=9, rank=2))  # newest event touching OWNER
    dump = index.tree_dump()
    assert dump.last_event_id == 3 and dump.reset_scope == RESET_ALL
    assert [e.event_id for e in dump.events] == [0, 1]
    worker_entry, owner_entry = dump.events
    assert worker_entry == RouterEvent(7, HOST, W, 0, Stored(None, (1,), (1001,)), 2, None)
    assert owner_entry == RouterEvent(9, DISK, C, 1, Stored(None, (2,), (1002,)), 2, OWNER)


def test_dump_is_cached_until_the_next_apply() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (1,)))
    first = index.tree_dump()
    assert index.tree_dump() is first
    assert index.events_in_range(None, None) is first
    index.apply(store(2, (2,), parent=1))
    second = index.tree_dump()
    assert second is not first and second.last_event_id == 2 and len(second.events) == 2


def test_parent_stored_after_its_child_is_dumped_first() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (2, 3), parent=1))  # parent 1 not resident yet
    index.apply(store(2, (1,)))  # now it is, inserted after its children
    index.apply(store(3, (0,)))
    index.apply(store(4, (1,), parent=0))  # reparented under a later block
    order = [e.data.block_hashes[0] for e in index.tree_dump().events]
    assert order.index(0) < order.index(1) < order.index(2) < order.index(3)


def test_parent_cycle_dumps_every_block_once() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (1,), parent=2))
    index.apply(store(2, (2,), parent=1))
    dumped = sorted(e.data.block_hashes[0] for e in index.tree_dump().events)
    assert dumped == [1, 2]
    assert replay_dump(index.tree_dump()).resident_blocks() == index.resident_blocks()


@st.composite
def forests(draw: st.DrawFn) -> tuple[list[int | None], list[int]]:
    """Parent index per node (None = root, else an earlier node) and a storing order."""
    size = draw(st.integers(1, 40))
    parents: list[int | None] = [
        None,
        *(draw(st.none() | st.integers(0, node - 1)) for node in range(1, size)),
    ]
    return parents, draw(st.permutations(range(size)))


@settings(max_examples=150, deadline=None)
@given(forests(), st.booleans())
def test_dump_orders_random_forests_parent_first(
    forest: tuple[list[int | None], list[int]], split: bool
) -> None:
    parents, order = forest
    index = RecoveryIndex(16)
    tiers = (HOST, DISK) if split else (HOST,)
    event_id = 0
    for node in order:
        parent = None if parents[node] is None else parents[node] + 100  # type: ignore[operator]
        for tier in tiers:
            event_id += 1
            index.apply(store(event_id, (node + 100,), parent, tier=tier))
    dump = index.tree_dump()
    position = {(e.storage_tier, e.data.block_hashes[0]): n for n, e in enumerate(dump.events)}
    assert len(position) == len(dump.events) == len(parents) * len(tiers)
    for n, event in enumerate(dump.events):
        assert isinstance(event.data, Stored)
        node = event.data.block_hashes[0] - 100
        expected_parent = parents[node]
        assert event.data.parent_hash == (None if expected_parent is None else expected_parent + 100)
        if expected_parent is not None:
            assert position[(event.storage_tier, expected_parent + 100)] < n
    assert replay_dump(dump).resident_blocks() == index.resident_blocks()


WORKERS = [WorkerWithDpRank(7, 0), WorkerWithDpRank(8, 0), WorkerWithDpRank(7, 1)]
CACHE_OWNERS = [OWNER, OTHER_OWNER]

operations = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "remove", "clear"]),
        st.integers(0, len(WORKERS) + len(CACHE_OWNERS) - 1),
        st.sampled_from([DEVICE, HOST, DISK]),
        st.lists(st.integers(1, 25), min_size=1, max_size=4, unique=True),
        st.none() | st.integers(1, 25),
    ),
    max_size=50,
)


def build(ops: list[tuple[str, int, StorageTier, list[int], int | None]]) -> list[RouterEvent]:
    events: list[RouterEvent] = []
    for event_id, (op, who, tier, hashes, parent) in enumerate(ops, start=1):
        if who < len(WORKERS):
            worker, domain, owner = (
                WORKERS[who],
                W,
                OWNER,
            )  # the coordinator stamps the owner on Worker events
        else:
            worker, domain, owner = WORKERS[who % len(WORKERS)], C, CACHE_OWNERS[who - len(WORKERS)]
            tier = HOST if tier is DEVICE else tier  # CacheOwner residency never targets Device
        if op == "store":
            data: Stored | Removed = Stored(parent, tuple(hashes), tuple(h * 3 for h in hashes))
        elif op == "remove":
            data = Removed(tuple(hashes))
        else:
            events.append(
                RouterEvent(worker.worker_id, DEVICE, domain, event_id, CLEARED, worker.dp_rank, owner)
            )
            continue
        events.append(RouterEvent(worker.worker_id, tier, domain, event_id, data, worker.dp_rank, owner))
    return events


def model(events: list[RouterEvent]) -> set[tuple[ResidencyOwner, StorageTier, int]]:
    """Independent reference: plain sets and the 4.2 clear scopes."""
    resident: set[tuple[ResidencyOwner, StorageTier, int]] = set()
    for event in events:
        owner = residency_owner(event)
        assert owner is not None
        if isinstance(event.data, Stored):
            resident |= {(owner, event.storage_tier, h) for h in event.data.block_hashes}
        elif isinstance(event.data, Removed):
            resident -= {(owner, event.storage_tier, h) for h in event.data.block_hashes}
        elif isinstance(owner, WorkerWithDpRank):
            resident = {
                r
                for r in resident
                if not (isinstance(r[0], WorkerWithDpRank) and r[0].dp_rank == owner.dp_rank)
            }
        else:
            resident = {r for r in resident if r[0] != owner}
    return resident


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(0, 50))
def test_dump_then_tail_reproduces_live_state(
    ops: list[tuple[str, int, StorageTier, list[int], int | None]], cut: int
) -> None:
    events = build(ops)
    cut = min(cut, len(events))
    live = RecoveryIndex(16, ring_capacity=1024)
    for event in events[:cut]:
        live.apply(event)
    dump = live.events_in_range(None, None)
    assert isinstance(dump, TreeDumpAnswer) and dump.last_event_id == cut
    for event in events[cut:]:
        live.apply(event)
    assert live.resident_blocks() == model(events)

    # A router's recovery: the dump, then the buffered tail after its watermark.
    tail = live.events_in_range(dump.last_event_id + 1, None)
    assert isinstance(tail, EventsAnswer) == (cut < len(events))  # otherwise TooNew, or a dump when empty
    tail_events = tail.events if isinstance(tail, EventsAnswer) else ()
    assert [e.event_id for e in tail_events] == list(range(cut + 1, len(events) + 1))
    replica = replay_dump(dump)
    next_id = replica.current_event_id() + 1
    for event in tail_events:
        replica.apply(attrs.evolve(event, event_id=next_id))
        next_id += 1
    assert replica.resident_blocks() == live.resident_blocks()
    assert state(replica) == state(live)
    # A dump replayed into a fresh index reproduces the state it was taken from, exactly.
    assert state(replay_dump(live.tree_dump())) == state(live)
