"""SourceSync's phases (issue #35 item 4): the phase each rule of docs/trust.md leads to, the phase machine's
own consistency under the model of test_sync_model.py, and a shed at the end of a flood proven by replay.

Messages and digests as in test_sequence.py; the model's engine, network and shell are tests/support/sim_engine.py.
"""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from kvagent.vllm.sequence import Phase, RequestReplay, SourceSync, SyncProtocolError
from kvagent.vllm.sync_state import DEFERRING, TRANSITIONS, ReplayPurpose
from tests.support.sim_engine import SimBatch, SimEngine, SyncDriver
from tests.unit.test_sequence import DEGRADED, READY, end, live, reply, started
from tests.unit.test_sync_model import SyncMachine


def phase(sync: SourceSync[str]) -> Phase:
    return sync.phase  # (read through a call: mypy would narrow the property across the test)


# -- the phase of each rule ------------------------------------------------------------------------------------


def test_a_cold_start_with_replay_bootstraps_then_repairs_then_goes_live() -> None:
    sync: SourceSync[str] = SourceSync(has_replay=True)
    assert phase(sync) is Phase.UNANCHORED
    sync.start(0.0)
    assert sync.take_actions() == [RequestReplay(0)] and phase(sync) is Phase.BOOTSTRAPPING
    reply(sync, 0)
    assert phase(sync) is Phase.REPAIRING  # the answer goes on as the repair up to the engine's newest batch
    end(sync)
    assert phase(sync) is Phase.REPAIRING  # asked again from 1: the tail may have been cut
    end(sync)
    assert phase(sync) is Phase.LIVE and sync.statistics().state is READY


def test_a_cold_start_without_replay_is_unanchored_until_the_first_batch() -> None:
    sync = started(has_replay=False)
    assert phase(sync) is Phase.UNANCHORED
    live(sync, 5)
    assert phase(sync) is Phase.LIVE and sync.statistics().state is DEGRADED


def test_a_gap_is_held_live_then_repaired() -> None:
    sync = started(upto=3)
    live(sync, 5, now=1.0)
    assert phase(sync) is Phase.LIVE  # held within the reorder window
    sync.on_timer(1.1)
    assert sync.take_actions() == [RequestReplay(3)] and phase(sync) is Phase.REPAIRING
    reply(sync, 3, now=1.1)
    reply(sync, 4, now=1.1)
    assert phase(sync) is Phase.LIVE  # the held batch is reached: the live stream carries the rest


def test_a_seq_gone_back_without_a_digest_awaits_identity_then_a_new_engine() -> None:
    sync = started(upto=9, digest_memory=4)
    live(sync, 2, engine=1)  # its digest is no longer kept: late batch or restart?
    assert phase(sync) is Phase.AWAITING_IDENTITY
    reply(sync, 9, engine=1)  # the anchor's bytes differ: a new engine
    assert phase(sync) is Phase.AWAITING_NEW_ENGINE
    reply(sync, 0, engine=1)
    assert phase(sync) is Phase.REPAIRING  # the new engine's history, from 0


def test_a_seq_gone_back_with_the_same_anchor_is_a_late_batch() -> None:
    sync = started(upto=9, digest_memory=4)
    live(sync, 2)
    assert phase(sync) is Phase.AWAITING_IDENTITY
    reply(sync, 9)
    assert phase(sync) is Phase.LIVE and sync.statistics().duplicates == 1


def test_a_gap_without_replay_resets_to_unanchored_only_when_nothing_follows() -> None:
    sync = started(has_replay=False, upto=3)
    sync.on_disconnected(1.0)
    sync.on_connected(1.0)
    assert phase(sync) is Phase.UNANCHORED  # rule 6 without replay: the next batch decides
    live(sync, 0, now=1.0)
    assert phase(sync) is Phase.LIVE and sync.statistics().state is READY


# -- the machine refuses what it does not allow ---------------------------------------------------------------


def test_an_illegal_transition_raises() -> None:
    sync = started(has_replay=False)
    assert Phase.REPAIRING not in TRANSITIONS[Phase.UNANCHORED]
    with pytest.raises(SyncProtocolError, match="unanchored to repairing"):
        sync._enter(Phase.REPAIRING)
    assert phase(sync) is Phase.UNANCHORED


def test_a_second_request_or_a_new_engine_request_out_of_phase_raises() -> None:
    sync = started(upto=3)
    live(sync, 6, now=1.0)
    sync.on_timer(1.1)
    assert phase(sync) is Phase.REPAIRING
    with pytest.raises(SyncProtocolError, match="already outstanding"):
        sync._ask(ReplayPurpose.REPAIR)
    idle = started(upto=3)
    with pytest.raises(SyncProtocolError, match="new engine's history asked while live"):
        idle._ask(ReplayPurpose.NEW_ENGINE)


def test_unanchored_with_a_request_outstanding_raises() -> None:
    sync = started(upto=3)
    live(sync, 6, now=1.0)
    sync.on_timer(1.1)
    with pytest.raises(SyncProtocolError):
        sync._enter(Phase.UNANCHORED)


# -- the model, with the phase machine's consistency and a shed at the end of a flood -------------------------


class PhasedSyncMachine(SyncMachine):
    """test_sync_model's machine, plus: the phase agrees with what the sync holds after every step, and a
    flood whose tail the shed's re-open loses, with nothing published after it, is exact or not ready."""

    @invariant()
    def phase_agrees_with_what_is_held(self) -> None:
        if not hasattr(self, "sync"):
            return
        sync = self.sync
        request = sync._outstanding
        phase = sync.phase
        if phase in (Phase.BOOTSTRAPPING, Phase.REPAIRING):
            assert request is not None
            assert (phase is Phase.BOOTSTRAPPING) == (request.purpose is ReplayPurpose.BOOTSTRAP)
        elif phase is Phase.AWAITING_IDENTITY:
            assert request is None or request.purpose is ReplayPurpose.ANCHOR
        elif phase is Phase.AWAITING_NEW_ENGINE:
            assert request is None or request.purpose is ReplayPurpose.NEW_ENGINE
        else:
            assert request is None
        if phase not in DEFERRING:
            assert not sync._deferred

    @precondition(lambda self: self.driver.connected and not self.driver.engine_dead)
    @rule(flood=st.integers(1, 30), delivered=st.integers(0, 30))
    def flood_then_shed(self, flood: int, delivered: int) -> None:
        """The listener's shed at the end of a flood: what was in flight goes with the old SUB."""
        self._quiesce()
        self._check()
        driver, sync = self.driver, self.sync
        before = driver.state
        for _ in range(flood):
            driver.publish()
        driver.deliver_live(min(delivered, flood))
        driver.live = collections.deque(item for item in driver.live if not isinstance(item, SimBatch))
        sync.shed(driver.now)
        sync.verify_after_shed(driver.now)
        driver.execute()
        driver.quiesce()  # nothing published after the flood: no later batch shows the gap
        if driver.state is READY:
            assert driver.index == self.engine.resident, "ready while wrong after a shed"
            assert driver.applied == driver.full_history()
        buffer = self.engine.buffer.maxlen
        benign = driver.silence == 0 and buffer is not None and buffer >= 10_000  # the answer comes, whole
        if self.has_replay and before is READY and benign:
            assert driver.state is READY, "a shed fully repaired by replay must end ready"


seen: collections.Counter[Phase] = collections.Counter()


def test_phased_sync_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runs with the phase invariant and the flood-then-shed rule, and enters every phase."""
    seen.clear()
    enter = SourceSync._enter

    def counted_enter(self: SourceSync[SimBatch], phase: Phase) -> None:
        enter(self, phase)
        seen[phase] += 1

    monkeypatch.setattr(SourceSync, "_enter", counted_enter)
    PhasedSyncMachine.TestCase.settings = settings(
        max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    PhasedSyncMachine.TestCase().runTest()
    assert set(seen) >= set(Phase) - {Phase.UNANCHORED}, f"phases never entered: {set(Phase) - set(seen)}"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    before=st.integers(0, 20),
    delivered=st.integers(0, 20),
    lost=st.integers(1, 40),
    window=st.integers(0, 4),
    hwm=st.sampled_from([3, 12, 1000]),
    tail=st.sampled_from([0.0, 0.3]),
    end_delivery=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_a_flood_whose_tail_the_shed_lost_ends_ready_and_exact_once_the_replay_repairs_it(
    seed: int, before: int, delivered: int, lost: int, window: int, hwm: int, tail: float, end_delivery: float
) -> None:
    """Replay that answers (cut by its send HWM or not): nothing is published after the flood, and the slot
    ends ready and exact without waiting for another batch."""
    rng = random.Random(seed)
    engine = SimEngine(rng)
    sync: SourceSync[SimBatch] = SourceSync(
        has_replay=True, reorder_window=window, max_attempts_without_progress=2, cold_bootstrap=True
    )
    driver = SyncDriver(sync, engine, rng, hwm=hwm, tail_delivery=tail, end_delivery=end_delivery)
    sync.start(driver.now)
    driver.execute()
    for _ in range(before):
        driver.publish()
    driver.quiesce()
    assert driver.state is READY
    for _ in range(delivered + lost):
        driver.publish()
    driver.deliver_live(delivered)
    driver.live.clear()  # the rest goes with the old SUB
    sync.shed(driver.now)
    sync.verify_after_shed(driver.now)
    driver.execute()
    driver.quiesce()
    assert driver.state is READY
    assert driver.index == engine.resident and driver.applied == driver.full_history()
    assert sync.statistics().resets == 0
