"""SourceSync after a shed (issue #28 item 2): the re-opened SUB may have lost batches nobody saw.

When the listener sheds it drops what it holds and re-opens the SUB; batches in flight between the old SUB
and the new one are lost without a trace. Until a batch received after the shed has been applied in order,
the history cannot be known complete, so the source is not ready; with replay the gap that batch shows is
repaired, without replay it is counted as lost.
"""

from __future__ import annotations

from kvagent.vllm.sequence import Apply, RequestReplay, Signal
from tests.unit.test_sequence import DEGRADED, NBYTES, READY, applied, end, live, reply, started


def test_a_shed_with_nothing_after_it_is_never_ready() -> None:
    """The flood's tail lost in the re-open: no later batch shows the gap, so the shed itself must."""
    sync = started(upto=9)
    sync.shed(1.0)
    actions = sync.take_actions()
    assert [a for a in actions if isinstance(a, Signal)] == [
        Signal(state=DEGRADED, reason="live batches shed: history unproven until a later batch applies in order")
    ]
    assert sync.statistics().state is not READY


def test_after_a_shed_the_next_batch_in_order_proves_nothing_was_lost() -> None:
    sync = started(has_replay=False, upto=9)
    sync.shed(1.0)
    sync.take_actions()
    assert live(sync, 10, now=1.0) == [*applied(10), Signal(state=READY, reason="live batches in order after a shed")]
    stats = sync.statistics()
    assert stats.state is READY and stats.resets == 0 and stats.lost_batches == 0


def test_after_a_shed_a_gap_is_repaired_from_replay_and_then_ready() -> None:
    sync = started(upto=9)
    sync.shed(1.0)
    sync.take_actions()
    assert live(sync, 15, now=1.0) == []  # 10..14 went with the old SUB: held, a gap
    sync.on_timer(1.1)  # the reorder wait is over: ask the replay socket from the anchor
    assert sync.take_actions() == [RequestReplay(9)]
    assert reply(sync, 9, now=1.1) == []
    for seq in range(10, 14):
        assert reply(sync, seq, now=1.1) == applied(seq, replayed=True)
    actions = reply(sync, 14, now=1.1)
    assert actions[:2] == [*applied(14, replayed=True), *applied(15)]
    assert Signal(state=READY, reason="live batches in order after a shed") in actions
    assert sync.statistics().state is READY


def test_after_a_shed_without_replay_a_gap_is_counted_lost() -> None:
    sync = started(has_replay=False, upto=9)
    sync.shed(1.0)
    sync.take_actions()
    sync.on_live(15, 15, NBYTES, "L15", 1.0)
    sync.on_timer(1.1)
    actions = sync.take_actions()
    assert actions[0] == Signal(state=DEGRADED, reset=True, lost_batches=5, reason="seq gap and no replay socket")
    assert isinstance(actions[1], Apply) and actions[1].seq == 15
    stats = sync.statistics()
    assert stats.state is DEGRADED and stats.lost_batches == 5


def test_a_replay_in_flight_does_not_prove_the_live_stream_after_a_shed() -> None:
    """The repair's answer ends, but no live batch came after the shed: still not ready."""
    sync = started(upto=9)
    sync.on_live(12, 12, NBYTES, "L12", 0.5)
    sync.on_timer(0.6)
    assert sync.take_actions() == [RequestReplay(9)]
    sync.shed(0.7)  # drops the held 12
    sync.take_actions()
    reply(sync, 9, now=0.7)
    for seq in (10, 11, 12):
        reply(sync, seq, now=0.7)
    end(sync, now=0.7)
    assert sync.statistics().state is not READY
