"""SourceSync by example: one test per rule of docs/trust.md (1-8), with the exact actions and figures,
then the five cases of issue #14 in their pure form (a simulated engine, tests/support/sim_engine.py).

Messages are strings ``"L<seq>"`` (live) and ``"R<seq>"`` (replayed); the digest of a batch is derived from
the engine incarnation and seq, like the payload bytes of a real one.
"""

from __future__ import annotations

import random
import sys

import pytest
import xxhash

from kvagent.model.events import SourceState
from kvagent.vllm.sequence import (
    Action,
    Apply,
    CancelReplay,
    RequestReplay,
    Signal,
    SourceSync,
)
from tests.support.sim_engine import SimBatch, SimEngine, SyncDriver

READY, DEGRADED, DISCONNECTED = SourceState.READY, SourceState.DEGRADED, SourceState.DISCONNECTED
NBYTES = 100


def digest(seq: int, engine: int = 0) -> int:
    return xxhash.xxh3_64_intdigest(f"{engine}:{seq}".encode())


def live(sync: SourceSync[str], seq: int, *, engine: int = 0, now: float = 0.0) -> list[Action[str]]:
    sync.on_live(seq, digest(seq, engine), NBYTES, f"L{seq}", now)
    return sync.take_actions()


def reply(sync: SourceSync[str], seq: int, *, engine: int = 0, now: float = 0.0) -> list[Action[str]]:
    sync.on_replay_reply(seq, digest(seq, engine), NBYTES, f"R{seq}", now)
    return sync.take_actions()


def end(sync: SourceSync[str], *, complete: bool = True, now: float = 0.0) -> list[Action[str]]:
    sync.on_replay_end(complete, now)
    return sync.take_actions()


def applied(*seqs: int, replayed: bool = False) -> list[Action[str]]:
    return [Apply(f"{'R' if replayed else 'L'}{seq}", seq, replayed) for seq in seqs]


def started(
    *,
    has_replay: bool = True,
    upto: int = -1,
    reorder_window: int = 8,
    reorder_wait: float = 0.05,
    max_attempts_without_progress: int = 3,
    digest_memory: int = 4096,
) -> SourceSync[str]:
    """A sync without cold bootstrap whose seqs 0..upto were applied live."""
    sync: SourceSync[str] = SourceSync(
        has_replay=has_replay,
        reorder_window=reorder_window,
        reorder_wait=reorder_wait,
        max_attempts_without_progress=max_attempts_without_progress,
        digest_memory=digest_memory,
        cold_bootstrap=False,
    )
    sync.start(0.0)
    for seq in range(upto + 1):
        assert live(sync, seq) == applied(seq)
    return sync


# -- rule 1: in order ----------------------------------------------------------------------------------------


def test_rule1_the_next_seq_applies_at_once() -> None:
    sync = started()
    assert [live(sync, seq) for seq in range(3)] == [applied(0), applied(1), applied(2)]
    stats = sync.statistics()
    assert (stats.applied_seq, stats.applied, stats.held, stats.held_bytes) == (2, 3, 0, 0)
    assert sync.deadline is None


def test_rule1_the_in_order_path_keeps_nothing_but_the_apply() -> None:
    sync = started(upto=0)
    batches = [(seq, digest(seq), f"L{seq}") for seq in range(1, 20_001)]
    before = sys.getallocatedblocks()
    for seq, batch_digest, message in batches:
        sync.on_live(seq, batch_digest, NBYTES, message, 0.0)
    growth = sys.getallocatedblocks() - before
    # One Apply per batch (the action list grows in place); nothing else survives the call.
    assert growth <= len(batches) + 10, growth
    assert sync.take_actions() == applied(*range(1, 20_001))


# -- rule 2: hold within the reorder window -------------------------------------------------------------------


def test_rule2_a_late_batch_within_the_window_applies_in_order() -> None:
    sync = started(upto=0, reorder_window=2, reorder_wait=0.05)
    assert live(sync, 2, now=1.0) == []
    assert live(sync, 3, now=1.01) == []
    assert sync.held_bytes == 2 * NBYTES and sync.deadline == pytest.approx(1.05)
    assert live(sync, 1, now=1.02) == applied(1, 2, 3)
    stats = sync.statistics()
    assert (stats.gaps, stats.late_batches, stats.held_bytes, stats.replay_requests) == (1, 1, 0, 0)
    assert sync.deadline is None


def test_rule2_more_held_than_the_window_starts_a_repair_at_once() -> None:
    sync = started(upto=3, reorder_window=2)
    assert live(sync, 5) == [] and live(sync, 6) == []
    assert live(sync, 7) == [RequestReplay(3)], "three held > window 2: repair from the anchor"
    assert sync.deadline is None


def test_rule2_the_reorder_wait_starts_a_repair() -> None:
    sync = started(upto=3, reorder_wait=0.05)
    assert live(sync, 5, now=2.0) == []
    assert sync.deadline == pytest.approx(2.05)
    sync.on_timer(2.04)
    assert sync.take_actions() == []
    sync.on_timer(2.05)
    assert sync.take_actions() == [RequestReplay(3)]


# -- rule 3: gap repair ---------------------------------------------------------------------------------------


def gap(sync: SourceSync[str], *seqs: int) -> list[Action[str]]:
    actions: list[Action[str]] = []
    for seq in seqs:
        actions += live(sync, seq)
    return actions


def test_rule3_the_anchor_proves_the_engine_and_the_repair_stops_at_the_held_batches() -> None:
    sync = started(upto=9, reorder_window=1)
    assert gap(sync, 13, 14) == [RequestReplay(9)]
    assert reply(sync, 9) == [], "the anchor: same bytes as the applied 9"
    assert reply(sync, 10) + reply(sync, 11) == applied(10, 11, replayed=True)
    assert reply(sync, 12) == [*applied(12, replayed=True), *applied(13, 14), CancelReplay()]
    stats = sync.statistics()
    assert (stats.repaired_batches, stats.lost_batches, stats.resets, stats.state) == (3, 0, 0, READY)
    assert (stats.held, stats.held_bytes, stats.replay_requests, stats.replay_cancels) == (0, 0, 1, 1)


def test_rule3_a_hole_mid_answer_is_asked_again_from_the_hole() -> None:
    sync = started(upto=9, reorder_window=0)
    assert gap(sync, 20) == [RequestReplay(9)]
    assert reply(sync, 9) + reply(sync, 10) + reply(sync, 11) == applied(10, 11, replayed=True)
    assert reply(sync, 15) == [CancelReplay(), RequestReplay(12)], "the send HWM dropped 12..14"
    for seq in range(12, 19):
        assert reply(sync, seq) == applied(seq, replayed=True)
    assert reply(sync, 19) == [*applied(19, replayed=True), *applied(20), CancelReplay()]
    stats = sync.statistics()
    assert (stats.replay_holes, stats.repaired_batches, stats.lost_batches, stats.state) == (1, 10, 0, READY)


def test_rule3_an_answer_that_ends_early_is_asked_again_and_an_empty_one_means_caught_up() -> None:
    sync = started(upto=9, reorder_window=0)
    assert gap(sync, 14) == [RequestReplay(9)]
    assert reply(sync, 9) + reply(sync, 10) == applied(10, replayed=True)
    assert end(sync, complete=False) == [RequestReplay(11)], "timed out after progress: ask again"
    assert reply(sync, 11) + reply(sync, 12) == applied(11, 12, replayed=True)
    assert reply(sync, 13) == [*applied(13, replayed=True), *applied(14), CancelReplay()]
    assert sync.statistics().replay_attempts_without_progress == 0


def test_rule3_the_first_reply_one_past_the_anchor_is_accepted() -> None:
    sync = started(upto=9, reorder_window=0)
    assert gap(sync, 12) == [RequestReplay(9)]
    assert reply(sync, 10) == applied(10, replayed=True), "the engine just evicted the anchor"
    assert reply(sync, 11) == [*applied(11, replayed=True), *applied(12), CancelReplay()]
    assert sync.statistics().lost_batches == 0


def test_rule3_a_first_reply_past_the_gap_means_history_lost() -> None:
    sync = started(upto=9, reorder_window=0)
    assert gap(sync, 60) == [RequestReplay(9)]
    assert reply(sync, 50) == [
        Signal(state=DEGRADED, reset=True, lost_batches=40, reason="gap no longer in the engine's replay buffer"),
        *applied(50, replayed=True),
    ]
    for seq in range(51, 59):
        assert reply(sync, seq) == applied(seq, replayed=True)
    assert reply(sync, 59) == [*applied(59, replayed=True), *applied(60), CancelReplay()]
    stats = sync.statistics()
    assert (stats.state, stats.lost_batches, stats.resets, stats.history_losses, stats.degradations) == (
        DEGRADED,
        40,
        1,
        1,
        1,
    )


def test_rule3_answers_without_progress_end_in_history_lost() -> None:
    sync = started(upto=9, reorder_window=0, max_attempts_without_progress=3)
    assert gap(sync, 12) == [RequestReplay(9)]
    assert live(sync, 13) == [] and live(sync, 15) == []
    assert end(sync, complete=False) == [RequestReplay(9)]
    assert end(sync) == [RequestReplay(9)], "an empty answer while batches are held is no progress"
    # Given up: reset, and continue from the last contiguous run of held batches (15), losing 10..14.
    assert end(sync, complete=False) == [
        Signal(state=DEGRADED, reset=True, lost_batches=5, reason="replay unavailable"),
        *applied(15),
    ]
    stats = sync.statistics()
    assert (stats.replay_attempts_without_progress, stats.held, stats.held_bytes) == (3, 0, 0)


# -- rule 4: a live seq at or below the last applied ------------------------------------------------------------


def test_rule4_same_bytes_is_a_duplicate() -> None:
    sync = started(upto=5)
    assert live(sync, 5) == [] and live(sync, 3) == []
    assert sync.statistics().duplicates == 2


def test_rule4_different_bytes_is_a_new_engine() -> None:
    sync = started(upto=5)
    assert live(sync, 3, engine=1) == [RequestReplay(0)]
    assert sync.statistics().restarts_seen == 1


def test_rule4_unknown_digest_with_replay_asks_the_anchor_late_batch() -> None:
    sync = started(upto=9, digest_memory=4)  # keeps 6..9
    assert live(sync, 2) == [RequestReplay(9)], "seq 2's digest is forgotten: suspected restart"
    assert live(sync, 10) == [], "deferred while the engine's identity is checked"
    assert reply(sync, 9) == [CancelReplay(), *applied(10)], "same engine: 2 was late; 10 applies"
    stats = sync.statistics()
    assert (stats.suspected_restarts, stats.duplicates, stats.restarts_seen, stats.resets) == (1, 1, 0, 0)


def test_rule4_unknown_digest_with_replay_asks_the_anchor_new_engine() -> None:
    sync = started(upto=9, digest_memory=4)
    assert live(sync, 2, engine=1) == [RequestReplay(9)]
    assert reply(sync, 9, engine=1) == [CancelReplay(), RequestReplay(0)], "the anchor's bytes differ"
    assert live(sync, 3, engine=1) == []
    assert reply(sync, 0, engine=1) == [
        Signal(state=READY, reset=True, lost_batches=0, reason="engine restarted"),
        *applied(0, replayed=True),
    ]
    assert reply(sync, 1, engine=1) == applied(1, replayed=True)
    assert reply(sync, 2, engine=1) == [*applied(2, replayed=True), *applied(3), CancelReplay()]
    stats = sync.statistics()
    assert (stats.restarts_seen, stats.resets, stats.state, stats.applied_seq, stats.stale_dropped) == (1, 1, READY, 3, 1)


def test_rule4_without_replay_a_regression_resets_and_the_next_batch_continues() -> None:
    sync = started(has_replay=False, upto=9, digest_memory=4)
    assert live(sync, 2) == [
        Signal(state=DEGRADED, reset=True, lost_batches=0, reason="seq went back: engine restarted or a batch arrived late")
    ], "nothing can tell a restart from a late batch: reset, and do not apply it"
    assert live(sync, 3) == applied(3)
    assert live(sync, 4) == applied(4)
    assert sync.statistics().state is DEGRADED


def test_rule4_without_replay_different_bytes_is_a_new_engine_applied_after_a_reset() -> None:
    sync = started(has_replay=False, upto=9)
    assert live(sync, 7, engine=1) == [
        Signal(state=DEGRADED, reset=True, lost_batches=7, reason="engine restarted (batch bytes differ)"),
        *applied(7),
    ]


# -- rule 5: a confirmed new engine ---------------------------------------------------------------------------


def test_rule5_a_new_engine_seen_from_seq_0_is_ready_at_once() -> None:
    sync = started(upto=4)
    assert live(sync, 0, engine=1) == [
        Signal(state=READY, reset=True, lost_batches=0, reason="engine restarted (batch bytes differ)"),
        *applied(0),
    ]
    assert live(sync, 1, engine=1) == applied(1)


def test_rule5_a_new_engine_whose_buffer_starts_late_is_degraded() -> None:
    sync = started(upto=9)
    assert live(sync, 9, engine=1) == [RequestReplay(0)]
    assert reply(sync, 4, engine=1) == [], "seq 0 might still come (an answer out of seq order)"
    assert end(sync) == [
        Signal(state=DEGRADED, reset=True, lost_batches=4, reason="engine restarted"),
        *applied(4, replayed=True),
        RequestReplay(5),
    ]


def test_rule5_a_new_engine_with_an_empty_buffer_continues_from_its_first_live_batch() -> None:
    sync = started(upto=9)
    assert live(sync, 9, engine=1) == [RequestReplay(0)]
    assert live(sync, 11, engine=1) == []
    assert end(sync) == [Signal(state=DEGRADED, reset=True, lost_batches=11, reason="engine restarted"), *applied(11)]


# -- rule 6: disconnect and reconnect -------------------------------------------------------------------------


def test_rule6_reconnect_to_the_same_engine_repairs_and_is_ready_again() -> None:
    sync = started(upto=9)
    sync.on_disconnected(1.0)
    assert sync.take_actions() == [Signal(state=DISCONNECTED, reason="engine disconnected")]
    assert live(sync, 10) == [], "held until the reconnect's identity check"
    sync.on_connected(2.0)
    assert sync.take_actions() == [RequestReplay(9)]
    assert live(sync, 14) == []
    assert reply(sync, 9) == []
    for seq in (10, 11, 12):
        assert reply(sync, seq) == applied(seq, replayed=True)
    assert reply(sync, 13) == [
        *applied(13, replayed=True),
        *applied(14),
        CancelReplay(),
        Signal(state=READY, reason="engine reconnected"),
    ]
    stats = sync.statistics()
    assert (stats.engine_disconnects, stats.reconnects, stats.resets, stats.state) == (1, 1, 0, READY)
    assert stats.duplicates == 1, "the held live 10 gave way to the replayed one"
    assert stats.applied_seq == 14


def test_rule6_reconnect_to_a_new_engine_resets() -> None:
    sync = started(upto=9)
    sync.on_disconnected(1.0)
    sync.on_connected(2.0)
    assert sync.take_actions() == [Signal(state=DISCONNECTED, reason="engine disconnected"), RequestReplay(9)]
    assert reply(sync, 9, engine=1) == [CancelReplay(), RequestReplay(0)], "the anchor's bytes differ"
    assert reply(sync, 0, engine=1) == [
        Signal(state=READY, reset=True, lost_batches=0, reason="engine restarted"),
        *applied(0, replayed=True),
    ]


def test_rule6_reconnect_to_an_engine_without_the_anchor_is_a_new_engine() -> None:
    sync = started(upto=9)
    sync.on_disconnected(1.0)
    sync.on_connected(2.0)
    sync.take_actions()
    assert end(sync) == [RequestReplay(0)], "nothing at or after the anchor: it published less"
    assert reply(sync, 0, engine=1) == [
        Signal(state=READY, reset=True, lost_batches=0, reason="engine restarted"),
        *applied(0, replayed=True),
    ]


RECONNECTED_WITHOUT_REPLAY = "reconnected without a replay socket: which engine answers cannot be told"


def test_rule6_without_replay_a_reconnect_resets_since_the_next_seq_proves_nothing() -> None:
    """A restarted engine numbers from 0 again and the SUB may miss its first batches, so its next seq can be
    the last applied + 1 by chance (found by test_trust_mixed_model: a restart whose first batch went unseen).
    The old connection's queued batches still apply; at the reconnect the history is reset."""
    sync = started(has_replay=False, upto=9)
    sync.on_disconnected(1.0)
    assert live(sync, 10) == [Signal(state=DISCONNECTED, reason="engine disconnected"), *applied(10)]
    sync.on_connected(2.0)
    assert sync.take_actions() == [Signal(state=DEGRADED, reset=True, reason=RECONNECTED_WITHOUT_REPLAY)]
    assert live(sync, 11, engine=1) == applied(11), "the new engine's 1, or the old one's 11: not ready"
    stats = sync.statistics()
    assert (stats.state, stats.resets, stats.lost_batches) == (DEGRADED, 1, 0)


def test_rule6_without_replay_a_new_engine_seen_from_seq_0_is_ready() -> None:
    sync = started(has_replay=False, upto=9)
    sync.on_disconnected(1.0)
    sync.on_connected(2.0)
    sync.take_actions()
    assert live(sync, 0, engine=1) == [Signal(state=READY, reason="history complete from seq 0"), *applied(0)]
    assert live(sync, 1, engine=1) == applied(1)
    stats = sync.statistics()
    assert (stats.restarts_seen, stats.resets, stats.lost_batches) == (1, 1, 0)


def test_rule6_without_replay_a_gap_after_a_reconnect_is_history_lost() -> None:
    sync = started(has_replay=False, upto=9, reorder_window=0)
    sync.on_disconnected(1.0)
    sync.on_connected(2.0)
    sync.take_actions()
    assert live(sync, 30) == [
        Signal(state=DEGRADED, lost_batches=20, reason="joined mid-stream"),
        *applied(30),
    ]


# -- rule 7: cold start ---------------------------------------------------------------------------------------


def test_rule7_cold_start_replays_from_0_then_checks_it_is_caught_up() -> None:
    sync: SourceSync[str] = SourceSync(has_replay=True)
    sync.start(0.0)
    assert sync.take_actions() == [RequestReplay(0)]
    assert live(sync, 4) == []
    assert reply(sync, 0) + reply(sync, 1) + reply(sync, 2) == applied(0, 1, 2, replayed=True)
    assert reply(sync, 3) == [*applied(3, replayed=True), *applied(4), CancelReplay()]
    assert sync.statistics().state is READY


def test_rule7_cold_start_with_history_already_evicted_is_degraded_without_reset() -> None:
    sync: SourceSync[str] = SourceSync(has_replay=True)
    sync.start(0.0)
    sync.take_actions()
    assert reply(sync, 500) == [], "seq 0 might still come (an answer out of seq order)"
    assert end(sync) == [
        Signal(state=DEGRADED, lost_batches=500, reason="history before the replay buffer lost"),
        *applied(500, replayed=True),
        RequestReplay(501),  # the end marker may follow dropped replies: ask once more
    ]
    assert end(sync) == []


def test_rule7_cold_start_on_an_engine_that_published_nothing_stays_ready() -> None:
    sync: SourceSync[str] = SourceSync(has_replay=True)
    sync.start(0.0)
    sync.take_actions()
    assert end(sync) == []
    assert live(sync, 0) == applied(0)
    assert sync.statistics().state is READY


def test_rule7_cold_start_without_replay_joins_mid_stream_degraded() -> None:
    sync: SourceSync[str] = SourceSync(has_replay=False)
    sync.start(0.0)
    assert sync.take_actions() == []
    assert live(sync, 7) == [Signal(state=DEGRADED, lost_batches=7, reason="joined mid-stream"), *applied(7)]
    fresh: SourceSync[str] = SourceSync(has_replay=False)
    fresh.start(0.0)
    assert live(fresh, 0) == applied(0)
    assert fresh.statistics().state is READY


# -- rule 8: contract -----------------------------------------------------------------------------------------


def test_rule8_shed_drops_held_batches_which_become_a_repaired_gap() -> None:
    sync = started(upto=9, reorder_window=8)
    for seq in (11, 12, 13):
        assert live(sync, seq) == []
    assert sync.held_bytes == 3 * NBYTES
    assert sync.shed(1.0) == 3 * NBYTES
    assert (sync.held_bytes, sync.deadline) == (0, None)
    # What the re-opened SUB lost no later batch may ever show: not ready until one applies in order.
    assert sync.take_actions() == [
        Signal(state=DEGRADED, reason="live batches shed: history unproven until a later batch applies in order")
    ]
    assert live(sync, 14, now=1.1) == []
    sync.on_timer(1.2)
    assert sync.take_actions() == [RequestReplay(9)]
    stats = sync.statistics()
    assert (stats.shed_held_batches, stats.shed_held_bytes, stats.held_bytes) == (3, 3 * NBYTES, NBYTES)


def test_rule8_stray_replies_and_ends_are_ignored() -> None:
    sync = started(upto=2)
    assert reply(sync, 3) == [] and end(sync) == []
    assert sync.statistics().replay_stray == 2


def test_constructor_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        SourceSync(has_replay=True, max_attempts_without_progress=0)


# -- the five cases of issue #14, pure --------------------------------------------------------------------------


def simulated(
    *, has_replay: bool = True, hwm: int = 1000, tail_delivery: float = 0.0, end_delivery: float = 1.0
) -> SyncDriver:
    """A 10,000-deep replay buffer (vLLM's default), cold-started on an engine that published nothing."""
    rng = random.Random(14)
    sync: SourceSync[SimBatch] = SourceSync(has_replay=has_replay)
    engine = SimEngine(rng, buffer_steps=10_000)
    driver = SyncDriver(sync, engine, rng, hwm=hwm, tail_delivery=tail_delivery, end_delivery=end_delivery)
    sync.start(driver.now)
    driver.execute()
    driver.quiesce()
    return driver


def publish(driver: SyncDriver, count: int, **fate: bool) -> None:
    for _ in range(count):
        driver.publish(**fate)


@pytest.mark.parametrize("end_delivery", [1.0, 0.0], ids=["end-marker-kept", "end-marker-dropped"])
def test_issue_gap_inside_the_replay_buffer_cut_by_the_send_hwm_is_fully_repaired(end_delivery: float) -> None:
    # 9,990 lost + 9 held + the anchor = the whole 10,000-deep buffer; the ROUTER sends 1,000 per answer.
    driver = simulated(hwm=1000, tail_delivery=0.05, end_delivery=end_delivery)
    publish(driver, 100)
    publish(driver, 9_990, drop=True)
    publish(driver, 9)
    driver.quiesce()
    stats = driver.sync.statistics()
    assert driver.state is READY and driver.index == driver.engine.resident
    assert driver.applied == driver.full_history()
    assert (stats.lost_batches, stats.resets, stats.repaired_batches, stats.gaps) == (0, 0, 9_990, 1)
    assert stats.replay_requests >= 11, "one bootstrap, then at least ten answers of at most 1,000 frames"


def test_issue_gap_beyond_the_replay_buffer_is_degraded_with_a_reset_and_the_exact_loss() -> None:
    driver = simulated(hwm=1000)
    publish(driver, 100)
    publish(driver, 50_000, drop=True)
    publish(driver, 9)
    driver.quiesce()
    oldest_buffered = driver.engine.next_seq - 10_000  # 40,109
    stats = driver.sync.statistics()
    assert driver.state is DEGRADED
    assert [s for s in driver.signals if s.reset] == [
        Signal(state=DEGRADED, reset=True, lost_batches=oldest_buffered - 100, reason="gap no longer in the engine's replay buffer")
    ]
    assert stats.lost_batches == 40_009 == oldest_buffered - 100
    assert driver.applied == driver.full_history()[oldest_buffered:], "only contiguous history after the reset"
    assert driver.index <= driver.engine.resident


@pytest.mark.parametrize("has_replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("first_seen", ["below", "equal", "above"])
def test_issue_restart_is_never_taken_for_the_old_engine(has_replay: bool, first_seen: str) -> None:
    driver = simulated(has_replay=has_replay)
    publish(driver, 50)
    driver.quiesce()
    old_last = driver.engine.next_seq - 1
    missed = {"below": 20, "equal": old_last, "above": old_last + 5}[first_seen]
    driver.restart(missed=missed)
    publish(driver, 10)
    driver.quiesce()
    assert driver.resets() == 1
    assert {incarnation for incarnation, _seq in driver.applied} == {1}, "no stale history"
    if has_replay:
        assert driver.state is READY and driver.index == driver.engine.resident
        assert driver.applied == driver.full_history()
    else:
        assert driver.state is DEGRADED and driver.index <= driver.engine.resident


@pytest.mark.parametrize("has_replay", [True, False], ids=["replay", "no-replay"])
def test_issue_an_engine_that_only_ever_published_seq_0_restarts(has_replay: bool) -> None:
    driver = simulated(has_replay=has_replay)
    publish(driver, 1)
    driver.quiesce()
    driver.restart(missed=0)
    publish(driver, 1)
    driver.quiesce()
    assert driver.resets() == 1 and driver.state is READY
    assert driver.applied == driver.full_history() == [(1, 0)]
    assert driver.index == driver.engine.resident


def test_issue_adjacent_swaps_converge_without_loss_reset_or_replay() -> None:
    driver = simulated()
    requests_at_start = list(driver.requests)
    rng = random.Random(99)
    swaps = 0
    for _ in range(10_000):
        swap = rng.random() < 0.02  # 1% of the batches: a pair in 50 is swapped
        driver.publish()
        driver.publish(swap=swap)
        swaps += swap
        driver.deliver_live()
        driver.advance(0.001)
    driver.quiesce()
    stats = driver.sync.statistics()
    assert driver.state is READY and driver.index == driver.engine.resident
    assert (stats.lost_batches, stats.resets, stats.duplicates) == (0, 0, 0)
    assert driver.requests == requests_at_start, "swaps inside the window need no replay"
    assert stats.late_batches == stats.gaps == swaps > 150


@pytest.mark.parametrize("has_replay", [True, False], ids=["replay", "no-replay"])
def test_issue_reconnect_of_the_same_engine_is_ready_again_with_replay_and_reset_without(has_replay: bool) -> None:
    """With replay the 40 batches sent while disconnected are repaired, and no reset; without, the reconnect
    resets (rule 6) and they are counted lost."""
    driver = simulated(has_replay=has_replay)
    publish(driver, 30)
    driver.disconnect(queued_after=5)
    publish(driver, 40)  # while disconnected: lost on the SUB (with replay, repaired on reconnect)
    driver.deliver_live()
    assert driver.state is DISCONNECTED
    driver.reconnect()
    publish(driver, 1)
    driver.quiesce()
    states = [signal.state for signal in driver.signals if signal.state is not None]
    if has_replay:
        assert states == [DISCONNECTED, READY] and driver.resets() == 0
        assert driver.applied == driver.full_history() and driver.index == driver.engine.resident
    else:
        # Reset at the reconnect (the engine behind it cannot be told), then the 40 missed are counted lost.
        assert states == [DISCONNECTED, DEGRADED, DEGRADED] and driver.resets() == 1
        assert driver.lost_reported() == 40 and driver.index <= driver.engine.resident


def test_issue_reconnect_to_a_new_engine_resets() -> None:
    driver = simulated()
    publish(driver, 30)
    driver.restart(missed=12)
    publish(driver, 3)
    driver.quiesce()
    assert [s.state for s in driver.signals if s.state is not None] == [DISCONNECTED, READY]
    assert driver.resets() == 1 and driver.applied == driver.full_history()
    assert driver.index == driver.engine.resident
