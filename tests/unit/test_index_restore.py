"""RecoveryIndex.restore and skip_to (issue #17): a restarted agent's index, and the ids a crash skipped.

The persisted form is a tree dump taken at some outbound id S plus the outbound events after S; a restore
must give the very state (and ring) the live index had, and the ids a crash may have skipped exist and are
empty: a follower that saw any of them gets the events after the skip, not a dump.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.index.recovery_index import EventsAnswer, RecoveryIndex, TooNewAnswer, TreeDumpAnswer
from kvagent.model.errors import IndexApplyError
from kvagent.model.events import ResidencyDomain, RouterEvent, StorageTier, WorkerWithDpRank
from kvagent.recovery.session import open_follow
from tests.unit.test_index import build, operations, state, store

W = ResidencyDomain.WORKER
DEVICE, HOST = StorageTier.DEVICE, StorageTier.HOST_PINNED


def live_index(events: list[RouterEvent], capacity: int = 1024) -> RecoveryIndex:
    index = RecoveryIndex(16, ring_capacity=capacity)
    for event in events:
        index.apply(event)
    return index


def restored(snapshot: RecoveryIndex, suffix: list[RouterEvent], capacity: int = 1024) -> RecoveryIndex:
    dump = snapshot.tree_dump()
    index = RecoveryIndex(16, ring_capacity=capacity)
    index.restore(dump.events, suffix, snapshot_id=dump.last_event_id)
    return index


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(0, 50), st.sampled_from([4, 1024]))
def test_restore_reproduces_the_state_and_the_ring(
    ops: list[tuple[str, int, StorageTier, list[int], int | None]], cut: int, capacity: int
) -> None:
    events = build(ops)
    cut = min(cut, len(events))
    live = live_index(events, capacity)
    index = restored(live_index(events[:cut]), events[cut:], capacity)
    assert state(index) == state(live)
    assert index.resident_blocks() == live.resident_blocks()
    assert index.current_event_id() == live.current_event_id() == len(events)
    start = max(cut + 1, len(events) - capacity + 1)  # the oldest id the restored ring holds
    assert index.oldest_buffered_id() == (start if cut < len(events) else None)
    if start <= len(events):
        assert index.events_in_range(start, None) == live.events_in_range(start, None)
    assert isinstance(index.events_in_range(len(events) + 1, None), TooNewAnswer)
    worker_blocks = {
        (o.dp_rank, t, h) for (o, t, h) in live.resident_blocks() if isinstance(o, WorkerWithDpRank)
    }
    assert set(index.resident_worker_blocks()) == worker_blocks


def test_a_restore_without_suffix_stands_at_the_snapshot_id_and_continues_from_it() -> None:
    index = restored(live_index([store(i, (i,)) for i in range(1, 6)]), [])
    assert index.current_event_id() == 5 and index.oldest_buffered_id() is None
    # A follower that saw everything up to 5 is up to date, not sent a dump.
    assert index.events_in_range(6, None) == TooNewAnswer(6, None, 5)
    assert isinstance(index.events_in_range(5, None), TreeDumpAnswer), "5 itself is not buffered"
    with pytest.raises(IndexApplyError):
        index.apply(store(5, (9,)))
    index.apply(store(6, (6,)))
    answer = index.events_in_range(6, None)
    assert isinstance(answer, EventsAnswer) and [e.event_id for e in answer.events] == [6]


def test_subscribers_are_not_told_about_restored_events_and_restore_needs_an_empty_index() -> None:
    index = RecoveryIndex(16)
    index.restore([store(0, (1,))], [store(7, (2,))], snapshot_id=6)
    seen: list[int] = []
    index.subscribe(lambda event: seen.append(event.event_id))
    index.apply(store(8, (3,)))
    assert seen == [8]
    with pytest.raises(RuntimeError):
        index.restore([], [])
    subscribed = RecoveryIndex(16)
    subscribed.subscribe(lambda event: None)
    with pytest.raises(RuntimeError):
        subscribed.restore([], [])


def test_an_invalid_restored_event_is_refused() -> None:
    index = RecoveryIndex(16)
    bad = attrs.evolve(store(0, (1,)), storage_tier="nvme")  # type: ignore[arg-type]
    with pytest.raises(IndexApplyError):
        index.restore([bad], [])


# -- skip_to ------------------------------------------------------------------------------------------------


def skipped(suffix_to: int, skip_to: int, capacity: int = 1024) -> RecoveryIndex:
    """Persisted up to ``suffix_to`` (snapshot at 3, suffix 4..suffix_to), then ids up to ``skip_to`` skipped."""
    events = [store(i, (i,)) for i in range(1, suffix_to + 1)]
    index = restored(live_index(events[:3]), events[3:], capacity)
    index.skip_to(skip_to)
    return index


@pytest.mark.parametrize("suffix_to", [3, 8])
def test_skipped_ids_exist_and_are_empty(suffix_to: int) -> None:
    index = skipped(suffix_to, 20)
    assert index.current_event_id() == 20
    with pytest.raises(IndexApplyError):
        index.apply(store(20, (99,)))
    for start in range(suffix_to + 1, 21):
        answer = index.events_in_range(start, None)
        assert answer == EventsAnswer((), 20), f"start {start}: the skipped ids carry nothing"
        assert not index.answers_with_dump(start, None)
        assert index.range_or_snapshot(start, None) == answer
    assert index.events_in_range(21, None) == TooNewAnswer(21, None, 20)
    index.apply(store(21, (21,)))
    index.apply(store(22, (22,)))
    for start in range(suffix_to + 1, 23):
        answer = index.events_in_range(start, None)
        expected = [21, 22] if start <= 21 else [22]
        assert isinstance(answer, EventsAnswer) and [e.event_id for e in answer.events] == expected
    assert isinstance(
        index.events_in_range(suffix_to, None), TreeDumpAnswer if suffix_to == 3 else EventsAnswer
    )


def test_a_follower_inside_the_skip_gets_a_dump_once_the_ring_evicted_the_events_after_it() -> None:
    index = skipped(8, 20, capacity=2)
    for event_id in (21, 22, 23):
        index.apply(store(event_id, (event_id,)))
    assert isinstance(index.events_in_range(15, None), TreeDumpAnswer), "21 is gone: the tail is incomplete"
    assert index.answers_with_dump(15, None) and not index.answers_with_dump(15, 14)
    answer = index.events_in_range(22, None)
    assert isinstance(answer, EventsAnswer) and [e.event_id for e in answer.events] == [22, 23]


def test_skip_to_at_or_below_the_current_id_changes_nothing() -> None:
    index = skipped(8, 8)
    assert index.current_event_id() == 8
    index.skip_to(5)
    assert index.current_event_id() == 8
    answer = index.events_in_range(4, None)
    assert isinstance(answer, EventsAnswer) and [e.event_id for e in answer.events] == [4, 5, 6, 7, 8]


def test_skip_to_on_a_new_index_and_the_dump_names_the_skipped_id() -> None:
    index = RecoveryIndex(16)
    index.skip_to(1 << 24)
    assert index.current_event_id() == 1 << 24
    assert index.events_in_range(1, None) == EventsAnswer((), 1 << 24)
    dump = index.events_in_range(None, None)
    assert isinstance(dump, TreeDumpAnswer) and dump.last_event_id == 1 << 24


@pytest.mark.parametrize("from_cursor", [8, 9, 15, 20])
def test_a_follower_that_saw_skipped_or_persisted_ids_follows_on_without_a_dump(from_cursor: int) -> None:
    index = skipped(8, 20)
    session = open_follow(index, from_cursor, capacity=16)
    try:
        assert session.backlog == EventsAnswer((), 20)
        index.apply(store(21, (21,)))
        assert [event.event_id for event in session.buffer.drain(16)] == [21]
    finally:
        session.unsubscribe()
