"""RepublishState.mirror_rows and restore (issue #17): a restarted agent's republished stream.

The mirror is persisted at compaction (``mirror_rows``) and restored with the outbound events after it; the
ring starts empty and seqs continue at the persisted lease, so every start older than the restart is
answered with a snapshot, which must show exactly the blocks (and tokens) the agent had.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.model.events import RouterEvent
from kvagent.publish.republish_state import RangeAnswer, RepublishState, SnapshotAnswer, snapshot_frame_seq
from kvagent.wire.vllm_events import SNAPSHOT_REQUEST
from tests.unit.test_republish_state import (
    BLOCK_SIZE,
    Consumer,
    consume_snapshot,
    mirror,
    publish_all,
    reference,
    remove,
    seq_request,
    store,
    streams,
)


def restarted(before: RepublishState, suffix: list[list[RouterEvent]], next_seq: int) -> RepublishState:
    rows = before.mirror_rows()
    try:
        persisted = list(rows)
    finally:
        rows.close()
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    state.restore(persisted, [event for batch in suffix for event in batch], next_seq)
    return state


@settings(max_examples=200, deadline=None)
@given(batches=streams(), cut=st.integers(0, 25), skipped=st.integers(0, 5))
def test_a_restored_mirror_answers_snapshots_with_the_blocks_the_agent_had(
    batches: list[list[RouterEvent]], cut: int, skipped: int
) -> None:
    cut = min(cut, len(batches))
    before = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    published = publish_all(before, batches[:cut])
    expected = reference(event for batch in batches for event in batch)
    next_seq = len(publish_all(before, batches[cut:])) + len(published) + skipped
    state = restarted(_published(batches[:cut]), batches[cut:], next_seq)
    assert mirror(state) == expected
    assert state.last_seq == (next_seq - 1 if next_seq else None) and state.oldest_seq is None
    for start in range(next_seq):
        answer = state.answer(seq_request(start))
        if not expected and next_seq == 0:
            continue
        assert isinstance(answer, SnapshotAnswer), f"start {start} is older than the (empty) ring"
        assert answer.seq == snapshot_frame_seq(next_seq - 1)
        assert consume_snapshot(answer, expected).blocks == expected
    empty = state.answer(seq_request(next_seq))
    assert isinstance(empty, RangeAnswer) and list(empty.batches) == []
    # Publishing continues at next_seq, and a consumer that joined by snapshot follows exactly.
    consumer = Consumer()
    if next_seq:
        snapshot = state.answer(SNAPSHOT_REQUEST)
        assert isinstance(snapshot, SnapshotAnswer)
        consumer = consume_snapshot(snapshot, expected)
    later = [store(1, version=7), remove(1), store(2, version=8)]
    seq, payload = state.publish(later[:1]) or (None, b"")
    assert seq == next_seq
    consumer.apply(payload)
    for item in later[1:]:
        result = state.publish([item])
        assert result is not None
        consumer.apply(result[1])
    assert consumer.blocks == reference(later, expected) == mirror(state)


def _published(batches: list[list[RouterEvent]]) -> RepublishState:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    publish_all(state, batches)
    return state


def test_rows_without_tokens_stay_without_tokens() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    state.restore([(store(1).storage_tier, 1, None, None), (store(1).storage_tier, 2, 1, b"")], [], 5)
    assert [(block, parent, tokens) for _tier, block, parent, tokens in state.snapshot_blocks()] == [
        (1, None, None),
        (2, 1, None),
    ]
    assert state.statistics().resident_blocks == 2


def test_mirror_rows_freeze_the_mirror_until_closed_even_when_read_in_another_thread() -> None:
    state = _published([[store(1, 2, version=1)]])
    rows = state.mirror_rows()
    assert state.publish([store(3, parent=2)]) is not None
    assert state.statistics().deferred_batches == 1, "the new batch waits for the rows to be closed"
    assert not state.mirror_current
    read: list[int] = []
    reader = threading.Thread(target=lambda: read.extend(block for _t, block, _p, _k in rows))
    reader.start()
    reader.join()
    assert read == [1, 2]
    with pytest.raises(RuntimeError):
        state.mirror_rows()
    rows.close()
    rows.close()  # idempotent
    assert state.statistics().deferred_batches == 0
    assert [block for _t, block, _p, _k in state.snapshot_blocks()] == [1, 2, 3]


def test_restore_needs_a_state_that_published_nothing() -> None:
    state = _published([[store(1)]])
    with pytest.raises(RuntimeError):
        state.restore([], [], 9)
    with pytest.raises(ValueError):
        RepublishState(dp_rank=0, block_size=BLOCK_SIZE).restore([], [], -1)
