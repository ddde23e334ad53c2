"""Recovery index: range answers, ring, clear scopes, dumps, and the live vLLM capture."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.events import (
    CLEARED,
    EventsAnswer,
    InvalidRangeAnswer,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    TooNewAnswer,
    TreeDumpAnswer,
)
from kvagent.identity import CacheOwnerId
from kvagent.index import RecoveryIndex
from kvagent.vllm.wire import RawBlockRemoved, RawBlockStored, RawMessage, decode_frames, decode_replay_reply
from tests.vectors import load_live

OWNER = CacheOwnerId.parse(
    "01010101010101010101010101010101:02020202020202020202020202020202/0000000000000003/04040404040404040404040404040404"
)
W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER


def store(
    event_id: int,
    hashes: tuple[int, ...],
    parent: int | None = None,
    *,
    domain: ResidencyDomain = W,
    tier: StorageTier = StorageTier.DEVICE,
    rank: int = 0,
) -> RouterEvent:
    source = OWNER if domain is C else None
    return RouterEvent(7, tier, domain, event_id, Stored(parent, hashes, hashes), rank, source)


def remove(
    event_id: int,
    hashes: tuple[int, ...],
    *,
    domain: ResidencyDomain = W,
    tier: StorageTier = StorageTier.DEVICE,
) -> RouterEvent:
    return RouterEvent(7, tier, domain, event_id, Removed(hashes), 0, OWNER if domain is C else None)


def clear(event_id: int, domain: ResidencyDomain = W, rank: int = 0) -> RouterEvent:
    return RouterEvent(7, StorageTier.DEVICE, domain, event_id, CLEARED, rank, OWNER)


def test_range_answers_follow_the_exact_conditions() -> None:
    index = RecoveryIndex(16, ring_capacity=32)
    assert isinstance(index.events_in_range(None, None), TreeDumpAnswer)
    assert index.current_event_id() == 0
    for i in range(1, 41):
        index.apply(store(i, (i,)))
    assert index.current_event_id() == 40 and index.oldest_buffered_id() == 9
    assert index.events_in_range(5, 3) == InvalidRangeAnswer(5, 3)
    assert isinstance(index.events_in_range(None, 10), TreeDumpAnswer)
    assert isinstance(index.events_in_range(3, None), TreeDumpAnswer)  # older than the oldest buffered
    assert index.events_in_range(41, 50) == TooNewAnswer(41, 50, 40)
    answer = index.events_in_range(30, 31)
    assert isinstance(answer, EventsAnswer) and answer.last_event_id == 40
    assert [e.event_id for e in answer.events] == list(range(30, 41))  # end validates, never truncates


def test_clear_scopes() -> None:
    index = RecoveryIndex(16)
    index.apply(store(1, (1,)))
    index.apply(store(2, (2,), rank=1))
    index.apply(store(3, (3,), domain=C, tier=StorageTier.HOST_PINNED))
    index.apply(clear(4))
    blocks = {h for (_o, _t, h) in index.resident_blocks()}
    assert blocks == {2, 3}  # only rank 0's Worker residency was reset
    index.apply(clear(5, domain=C))
    assert {h for (_o, _t, h) in index.resident_blocks()} == {2}


def test_subscribers_see_every_applied_event_in_order() -> None:
    index = RecoveryIndex(16)
    seen: list[int] = []
    unsubscribe = index.subscribe(lambda e: seen.append(e.event_id))
    index.apply(store(1, (1,)))
    index.apply(store(2, (2,)))
    unsubscribe()
    index.apply(store(3, (3,)))
    assert seen == [1, 2]


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear"]),
        st.sampled_from([W, C]),
        st.sampled_from([StorageTier.HOST_PINNED, StorageTier.DISK]),
        st.lists(st.integers(1, 30), min_size=1, max_size=4, unique=True),
        st.booleans(),
    ),
    max_size=60,
)


def build(operations: list[tuple[str, ResidencyDomain, StorageTier, list[int], bool]]) -> list[RouterEvent]:
    events = []
    for i, (op, domain, tier, hashes, chained) in enumerate(operations, start=1):
        if op == "store":
            events.append(
                store(i, tuple(hashes), hashes[0] + 100 if chained else None, domain=domain, tier=tier)
            )
        elif op == "remove":
            events.append(remove(i, tuple(hashes), domain=domain, tier=tier))
        else:
            events.append(clear(i, domain))
    return events


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(0, 60))
def test_dump_then_tail_reproduces_live_state(
    operations: list[tuple[str, ResidencyDomain, StorageTier, list[int], bool]], cut: int
) -> None:
    events = build(operations)
    live = RecoveryIndex(16, ring_capacity=1024)
    for event in events[: min(cut, len(events))]:
        live.apply(event)
    dump = live.tree_dump()
    position = {
        (e.residency_domain, e.storage_tier, e.data.block_hashes[0]): n  # type: ignore[union-attr]
        for n, e in enumerate(dump.events)
    }
    for n, e in enumerate(dump.events):
        parent = e.data.parent_hash  # type: ignore[union-attr]
        if parent is not None and (e.residency_domain, e.storage_tier, parent) in position:
            assert position[(e.residency_domain, e.storage_tier, parent)] < n  # parents first
    replica = RecoveryIndex(16, ring_capacity=1024)
    next_id = 1
    for e in dump.events:
        replica.apply(
            RouterEvent(
                e.worker_id,
                e.storage_tier,
                e.residency_domain,
                next_id,
                e.data,
                e.dp_rank,
                e.state_source if e.residency_domain is C else OWNER,
            )
        )
        next_id += 1
    for event in events[min(cut, len(events)) :]:
        live.apply(event)
        replica.apply(
            RouterEvent(
                event.worker_id,
                event.storage_tier,
                event.residency_domain,
                next_id,
                event.data,
                event.dp_rank,
                event.state_source,
            )
        )
        next_id += 1
    assert replica.resident_blocks() == live.resident_blocks()


def apply_raw(index: RecoveryIndex, messages: list[RawMessage], first_id: int) -> int:
    event_id = first_id
    for message in messages:
        for raw in message.batch.events:
            if isinstance(raw, RawBlockStored):
                index.apply(store(event_id, raw.block_hashes, raw.parent_block_hash))
            elif isinstance(raw, RawBlockRemoved):
                index.apply(remove(event_id, raw.block_hashes))
            else:
                index.apply(clear(event_id))
            event_id += 1
    return event_id


def test_live_capture_and_its_replay_give_the_same_resident_set() -> None:
    sub, replay = load_live()
    live_messages = [decode_frames(f) for f in sub]
    replayed = [m for m in (decode_replay_reply(f) for f in replay) if m is not None]
    from_live, from_replay = RecoveryIndex(32), RecoveryIndex(32)
    apply_raw(from_live, live_messages, 1)
    apply_raw(from_replay, replayed, 1)
    assert from_live.resident_blocks() == from_replay.resident_blocks()
    # After the reset only blocks stored after it remain.
    reset_at = next(
        i
        for i, m in enumerate(live_messages)
        if any(not isinstance(e, RawBlockStored | RawBlockRemoved) for e in m.batch.events)
    )
    expected: set[int] = set()
    for message in live_messages[reset_at:]:
        seen_clear = message is not live_messages[reset_at]
        for raw in message.batch.events:
            if isinstance(raw, RawBlockStored):
                expected.update(raw.block_hashes)
            elif isinstance(raw, RawBlockRemoved):
                expected.difference_update(raw.block_hashes)
            else:
                expected.clear()
                seen_clear = True
        assert seen_clear
    assert {h for (_o, _t, h) in from_live.resident_blocks()} == expected
    assert expected
