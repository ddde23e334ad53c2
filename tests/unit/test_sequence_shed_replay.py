"""SourceSync after a shed, with a replay socket (issue #35 item 4): the replay proves the history, not the
next live batch.

A shed loses the batches in flight between the old SUB and the re-opened one, and no later input may ever
show them (the end of a flood). ``verify_after_shed`` asks the replay socket once the reorder wait is over;
an answer asked after the shed that ends complete with nothing held makes the source ready again while the
engine is idle. An answer that cannot show it leaves the source not ready until a live batch proves it.
Messages and digests as in test_sequence.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvagent.vllm.sequence import Action, Apply, CancelReplay, RequestReplay, Signal, SourceSync
from tests.unit.test_sequence import (
    DEGRADED,
    DISCONNECTED,
    NBYTES,
    READY,
    applied,
    digest,
    end,
    live,
    reply,
    started,
)

SHED = Signal(state=DEGRADED, reason="live batches shed: history unproven until a later batch applies in order")
PROVEN_BY_REPLAY = Signal(state=READY, reason="the replay proved the history complete after a shed")


def shed_and_verify(sync: SourceSync[str], now: float) -> list[Action[str]]:
    sync.shed(now)
    sync.verify_after_shed(now)
    return sync.take_actions()


def deadline(sync: SourceSync[str]) -> float | None:
    return sync.deadline  # (read through a call: mypy would narrow the attribute across the test)


def applied_seqs(actions: Sequence[object]) -> list[int]:
    return [action.seq for action in actions if isinstance(action, Apply)]


def test_a_flood_shed_then_fully_repaired_by_replay_is_ready_and_exact_while_the_engine_is_idle() -> None:
    """Batches 10..20 went with the old SUB and nothing is published after them: the replay brings them."""
    sync = started(upto=9)
    assert shed_and_verify(sync, 1.0) == [SHED]
    assert deadline(sync) == 1.05  # the reorder wait: the re-opened SUB's time to subscribe
    sync.on_timer(1.01)
    assert sync.take_actions() == []  # not yet
    sync.on_timer(1.05)
    assert sync.take_actions() == [RequestReplay(9)]  # from the anchor: its bytes prove the same engine
    seen: list[object] = []
    for seq in range(9, 21):
        seen += reply(sync, seq, now=1.06)
    assert applied_seqs(seen) == list(range(10, 21))
    assert sync.statistics().state is DEGRADED  # the answer's tail may have been cut: not proven yet
    assert end(sync, now=1.07) == [RequestReplay(21)]  # asked again from the first seq it did not carry
    assert end(sync, now=1.08) == [PROVEN_BY_REPLAY]  # empty: nothing after 20, the history is exact
    stats = sync.statistics()
    assert (stats.state, stats.applied_seq, stats.resets, stats.lost_batches) == (READY, 20, 0, 0)
    assert sync.deadline is None
    # Idle: nothing more is asked, nothing changes.
    sync.on_timer(5.0)
    assert sync.take_actions() == [] and sync.statistics().state is READY
    # And the live stream goes on in order, on the fast path again.
    assert live(sync, 21, now=5.0) == applied(21)


def test_an_answer_of_only_the_anchor_proves_a_shed_lost_nothing() -> None:
    sync = started(upto=9)
    shed_and_verify(sync, 1.0)
    sync.on_timer(1.05)
    assert sync.take_actions() == [RequestReplay(9)]
    assert reply(sync, 9, now=1.06) == []
    assert end(sync, now=1.06) == [PROVEN_BY_REPLAY]
    assert sync.statistics().state is READY


def test_a_replay_that_never_answers_leaves_the_source_not_ready_without_a_reset() -> None:
    sync = started(upto=9, max_attempts_without_progress=3)
    shed_and_verify(sync, 1.0)
    sync.on_timer(1.05)
    assert sync.take_actions() == [RequestReplay(9)]
    assert end(sync, complete=False, now=2.0) == [RequestReplay(9)]
    assert end(sync, complete=False, now=3.0) == [RequestReplay(9)]
    assert end(sync, complete=False, now=4.0) == []  # given up: the proof is left to a live batch
    stats = sync.statistics()
    assert (stats.state, stats.resets, stats.lost_batches, stats.history_losses) == (DEGRADED, 0, 0, 0)
    assert sync.deadline is None
    sync.on_timer(9.0)
    assert sync.take_actions() == [] and sync.statistics().state is DEGRADED  # never ready on a guess
    assert live(sync, 10, now=9.0) == [*applied(10), Signal(state=READY, reason="live batches in order after a shed")]


def test_an_empty_answer_for_the_anchor_proves_nothing() -> None:
    """The engine no longer holds the anchor (or holds nothing): continuity cannot be shown from it."""
    sync = started(upto=9, max_attempts_without_progress=1)
    shed_and_verify(sync, 1.0)
    sync.on_timer(1.05)
    assert sync.take_actions() == [RequestReplay(9)]
    assert end(sync, now=1.06) == []
    assert sync.statistics().state is DEGRADED


def test_an_answer_past_the_anchor_is_lost_history_and_never_ready() -> None:
    """The shed's gap is no longer in the engine's buffer: counted lost, a Worker reset, degraded."""
    sync = started(upto=9)
    shed_and_verify(sync, 1.0)
    sync.on_timer(1.05)
    sync.take_actions()
    assert reply(sync, 14, now=1.06) == []  # kept: the anchor may still come (a reorder within the answer)
    actions = end(sync, now=1.06)  # it did not: the answer starts past the anchor
    assert actions[0] == Signal(
        state=DEGRADED, reset=True, lost_batches=4, reason="gap no longer in the engine's replay buffer"
    )
    assert applied_seqs(actions) == [14]
    sync.on_timer(5.0)
    stats = sync.statistics()
    assert stats.state is DEGRADED and stats.lost_batches == 4


def test_an_anchor_with_other_bytes_is_a_new_engine_not_a_proof() -> None:
    sync = started(upto=9)
    shed_and_verify(sync, 1.0)
    sync.on_timer(1.05)
    sync.take_actions()
    # A new engine: the answer is abandoned and the new one's history asked from 0 (its reset comes with it).
    assert reply(sync, 9, engine=1, now=1.06) == [CancelReplay(), RequestReplay(0)]
    assert sync.statistics().state is DEGRADED
    assert sync.statistics().restarts_seen == 1


def test_a_live_batch_held_during_the_check_is_repaired_to_and_proves_the_history() -> None:
    sync = started(upto=9)
    shed_and_verify(sync, 1.0)
    sync.on_timer(1.05)
    assert sync.take_actions() == [RequestReplay(9)]
    assert live(sync, 13, now=1.06) == []  # received on the re-opened SUB: held behind the answer
    actions: list[object] = []
    for seq in (9, 10, 11, 12):
        actions += reply(sync, seq, now=1.07)
    assert applied_seqs(actions) == [10, 11, 12, 13]
    assert Signal(state=READY, reason="live batches in order after a shed") in actions
    assert sync.statistics().state is READY


def test_a_request_from_before_the_shed_proves_nothing_but_the_next_one_does() -> None:
    sync = started(upto=9)
    sync.on_live(12, digest(12), NBYTES, "L12", 0.5)
    sync.on_timer(0.6)
    assert sync.take_actions() == [RequestReplay(9)]
    shed_and_verify(sync, 0.7)  # drops the held 12; the answer in flight was asked before the shed
    for seq in (9, 10, 11, 12):
        reply(sync, seq, now=0.7)
    assert end(sync, now=0.7) == [RequestReplay(13)]  # the tail may be cut: asked again, after the shed
    assert sync.statistics().state is DEGRADED
    assert end(sync, now=0.8) == [PROVEN_BY_REPLAY]
    assert sync.statistics().state is READY


def test_without_replay_the_check_asks_nothing_and_a_live_batch_proves() -> None:
    sync = started(has_replay=False, upto=9)
    assert shed_and_verify(sync, 1.0) == [SHED]
    assert sync.deadline is None
    sync.on_timer(2.0)
    assert sync.take_actions() == [] and sync.statistics().state is DEGRADED
    assert live(sync, 10, now=2.0) == [*applied(10), Signal(state=READY, reason="live batches in order after a shed")]


def test_a_shed_while_disconnected_is_proven_by_the_reconnect_repair() -> None:
    sync = started(upto=9)
    sync.on_disconnected(0.5)
    assert sync.take_actions() == [Signal(state=DISCONNECTED, reason="engine disconnected")]
    assert shed_and_verify(sync, 1.0) == []
    assert sync.deadline is None  # the reconnect's identity check comes first
    sync.on_connected(2.0)
    assert sync.take_actions() == [RequestReplay(9)]
    reply(sync, 9, now=2.0)
    for seq in (10, 11):
        assert reply(sync, seq, now=2.0) == applied(seq, replayed=True)
    assert end(sync, now=2.0) == [RequestReplay(12)]
    actions = end(sync, now=2.0)
    assert [a.state for a in actions if isinstance(a, Signal)] == [READY]
    assert sync.statistics().state is READY
