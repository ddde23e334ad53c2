"""SourceSync resumed from a restarted agent's persisted point (issue #17): examples, then a model.

``SourceSync(resume=(seq, digest))`` starts as if batch ``seq`` with payload digest ``digest`` was the last
applied. Its first action asks the replay socket from ``seq`` (the anchor, strictly): the same bytes prove the
same engine and the answer repairs what the agent missed, with no reset; anything else takes the new-engine
or lost-history path. Messages and digests as in test_sequence.py.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kvagent.model.events import SourceState
from kvagent.vllm.sequence import Apply, CancelReplay, RequestReplay, Signal, SourceSync
from tests.support.sim_engine import SimBatch, SimEngine, SyncDriver
from tests.unit.test_sequence import applied, digest, end, live, reply

READY, DEGRADED, DISCONNECTED = SourceState.READY, SourceState.DEGRADED, SourceState.DISCONNECTED
RESUMED = "resumed: the engine's replay continues the applied history"


def resumed(seq: int, *, engine: int = 0, has_replay: bool = True, attempts: int = 3) -> SourceSync[str]:
    """A sync resumed at ``seq`` of ``engine`` and started: with replay, it asked for the anchor."""
    sync: SourceSync[str] = SourceSync(
        has_replay=has_replay, resume=(seq, digest(seq, engine)), max_attempts_without_progress=attempts
    )
    sync.start(0.0)
    if has_replay:
        assert sync.take_actions() == [RequestReplay(seq)]
    return sync


def test_starts_anchored_at_the_resume_point_and_disconnected_until_proven() -> None:
    sync: SourceSync[str] = SourceSync(has_replay=True, resume=(41, digest(41)))
    stats = sync.statistics()
    assert (stats.state, stats.applied_seq, stats.applied) == (DISCONNECTED, 41, 0)
    sync.start(0.0)
    assert sync.take_actions() == [RequestReplay(41)], "the anchor itself, strictly"


def test_same_engine_gap_covered_continues_without_reset_and_is_ready_once_caught_up() -> None:
    sync = resumed(5)
    assert live(sync, 9) == [], "live batches wait for the identity check"
    assert reply(sync, 5) == []
    assert reply(sync, 6) + reply(sync, 7) == applied(6, 7, replayed=True)
    # The replay reached the held live batch: the repair is over, the live stream carries the rest.
    assert reply(sync, 8) == [
        *applied(8, replayed=True),
        *applied(9),
        CancelReplay(),
        Signal(state=READY, reason=RESUMED),
    ]
    assert reply(sync, 9) == [], "a reply of the cancelled answer is stray"
    assert live(sync, 10) == applied(10)
    stats = sync.statistics()
    assert (stats.state, stats.resets, stats.lost_batches, stats.restarts_seen) == (READY, 0, 0, 0)
    assert (stats.applied_seq, stats.applied, stats.repaired_batches) == (10, 5, 3)


def test_same_engine_with_nothing_new_is_ready_after_the_anchor_alone() -> None:
    sync = resumed(5)
    assert reply(sync, 5) == []
    assert end(sync) == [Signal(state=READY, reason=RESUMED)]
    assert live(sync, 6) == applied(6)
    assert sync.statistics().resets == 0


def test_an_answer_cut_short_is_asked_again_from_the_first_missing_seq() -> None:
    sync = resumed(5)
    assert reply(sync, 5) + reply(sync, 6) == applied(6, replayed=True)
    assert end(sync, complete=False) == [RequestReplay(7)]
    assert reply(sync, 7) == applied(7, replayed=True)
    assert end(sync) == [RequestReplay(8)]
    assert end(sync) == [Signal(state=READY, reason=RESUMED)]
    assert sync.statistics().resets == 0


def test_a_different_engine_at_the_anchor_is_a_new_engine_replayed_from_0() -> None:
    sync = resumed(5)
    assert reply(sync, 5, engine=1) == [CancelReplay(), RequestReplay(0)]
    assert reply(sync, 0, engine=1) == [
        Signal(state=READY, reset=True, reason="engine restarted"),
        *applied(0, replayed=True),
    ]
    assert reply(sync, 1, engine=1) == applied(1, replayed=True)
    assert end(sync) == [RequestReplay(2)]
    assert end(sync) == []
    stats = sync.statistics()
    assert (stats.state, stats.resets, stats.restarts_seen) == (READY, 1, 1)


def test_an_engine_that_no_longer_holds_the_anchor_is_taken_as_new_and_degraded_if_its_buffer_starts_late() -> (
    None
):
    sync = resumed(5)
    # The answer's first seq is past the anchor: the engine's buffer no longer reaches back to it (decided
    # when the answer ends without the anchor: a reply ahead of it might have been a reorder).
    assert reply(sync, 20) == []
    assert end(sync) == [RequestReplay(0)]
    assert reply(sync, 20) == []
    assert end(sync) == [
        Signal(state=DEGRADED, reset=True, lost_batches=20, reason="engine restarted"),
        *applied(20, replayed=True),
        RequestReplay(21),  # an answer that applied something is checked for a cut tail
    ]
    assert end(sync) == []
    assert live(sync, 21) == applied(21)
    stats = sync.statistics()
    assert (stats.state, stats.resets, stats.lost_batches) == (DEGRADED, 1, 20)


def test_an_empty_answer_to_the_anchor_is_a_new_engine() -> None:
    sync = resumed(5)
    assert end(sync) == [RequestReplay(0)]
    assert reply(sync, 0, engine=1) == [
        Signal(state=READY, reset=True, reason="engine restarted"),
        *applied(0, replayed=True),
    ]


def test_an_unanswered_anchor_is_ambiguous_and_resets() -> None:
    sync = resumed(5, attempts=2)
    assert end(sync, complete=False) == [RequestReplay(5)]
    actions = end(sync, complete=False)
    assert actions == [
        Signal(state=DEGRADED, reset=True, reason="engine identity unknown: replay unavailable")
    ]
    assert live(sync, 9) == [
        Signal(state=DEGRADED, lost_batches=3, reason="joined mid-stream"),
        *applied(9),
    ]
    assert sync.statistics().ambiguous == 1


def test_without_a_replay_socket_the_engine_cannot_be_checked_so_a_reset_comes_first() -> None:
    sync = resumed(5, has_replay=False)
    assert sync.take_actions() == [
        Signal(
            state=DEGRADED, reset=True, reason="resumed without a replay socket: the engine cannot be checked"
        )
    ]
    # A new engine's seq 0: its history is complete from 0.
    assert live(sync, 0, engine=1) == [Signal(state=READY, reason="history complete from seq 0"), *applied(0)]


def test_without_a_replay_socket_the_same_engine_continues_degraded_after_the_reset() -> None:
    sync = resumed(5, has_replay=False)
    sync.take_actions()
    assert live(sync, 6) == applied(6), "already DEGRADED (the reset said so): nothing lost since"
    stats = sync.statistics()
    assert (stats.state, stats.lost_batches, stats.resets) == (DEGRADED, 0, 1)


def test_a_disconnect_during_the_anchor_check_asks_again_on_reconnect() -> None:
    sync = resumed(5)
    sync.on_disconnected(0.0)
    assert sync.take_actions() == [Signal(state=DISCONNECTED, reason="engine disconnected"), CancelReplay()]
    sync.on_connected(0.0)
    assert sync.take_actions() == [RequestReplay(5)]
    assert reply(sync, 5) + end(sync) == [Signal(state=READY, reason=RESUMED)]


def test_the_resume_point_must_be_a_seq() -> None:
    with pytest.raises(ValueError):
        SourceSync(has_replay=True, resume=(-1, 0))


# -- model: crash, the engine goes on (or restarts), resume ------------------------------------------------


def _run_until_ready(driver: SyncDriver, batches: int) -> None:
    for _ in range(batches):
        driver.publish()
    driver.quiesce()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    before=st.integers(1, 30),
    while_down=st.integers(0, 30),
    restarted=st.booleans(),
    missed_after_restart=st.integers(0, 10),
    buffer=st.sampled_from([4, 12, 10_000]),
    after=st.integers(0, 20),
    faulty=st.booleans(),
)
def test_model_a_resume_is_exact_and_resets_only_when_it_must(
    seed: int,
    before: int,
    while_down: int,
    restarted: bool,
    missed_after_restart: int,
    buffer: int,
    after: int,
    faulty: bool,
) -> None:
    """After a crash the resumed sync never applies a batch out of order; if the engine is the same and its
    replay buffer still holds the persisted batch, nothing is reset and the state is READY and exact; else a
    reset comes first and the state is READY and exact, or DEGRADED and a subset of the engine's."""
    rng = random.Random(seed)
    engine = SimEngine(rng, buffer_steps=buffer)
    first: SourceSync[SimBatch] = SourceSync(has_replay=True, cold_bootstrap=True)
    old = SyncDriver(first, engine, rng)
    first.start(old.now)
    old.execute()
    _run_until_ready(old, before)
    assert old.state is READY and old.index == engine.resident
    last = engine.history[-1]
    persisted_index, persisted_applied = set(old.index), list(old.applied)

    # The agent is down: the engine goes on, or is replaced by a new one.
    for _ in range(while_down):
        engine.publish()
    if restarted:
        engine.restart()
        for _ in range(missed_after_restart):
            engine.publish()
    same_and_covered = not restarted and engine.buffer[0].seq <= last.seq
    # A tiny buffer may evict what the network drops after the resume: a loss of its own, not the resume's.
    no_later_loss = buffer == 10_000

    sync: SourceSync[SimBatch] = SourceSync(has_replay=True, resume=(last.seq, last.digest))
    driver = SyncDriver(
        sync, engine, rng, index=persisted_index, applied=persisted_applied, state=DISCONNECTED
    )
    sync.start(driver.now)
    driver.execute()
    faults = ("drop", "duplicate", "swap", "delay")
    for _ in range(after):
        fault = rng.choice(faults) if faulty and rng.random() < 0.3 else None
        driver.publish(**({fault: True} if fault else {}))
        driver.deliver_live(rng.randrange(3))
        driver.deliver_replay(rng.randrange(5))
    driver.publish()  # reliable: a lost tail shows as a gap
    driver.quiesce()

    if same_and_covered and no_later_loss:
        assert driver.resets() == 0 and driver.lost_reported() == 0
        assert driver.state is READY
    elif not same_and_covered:
        assert driver.resets() >= 1
        assert driver.signals[0].reset, "the reset comes before anything else of the new history"
    if driver.state is READY:
        assert driver.index == engine.resident
        assert driver.applied == driver.full_history()
    else:
        assert driver.state is DEGRADED
        assert driver.index <= engine.resident
        assert {inc for inc, _ in driver.applied} <= {engine.incarnation}
    assert all(isinstance(a, Apply) for a in sync.take_actions()), "nothing left unexecuted"
