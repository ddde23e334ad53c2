"""Model-based test of SourceSync: a simulated engine, a faulty network and a shell (tests/support/sim_engine.py).

The engine publishes batches; the network drops, duplicates, swaps and delays them; replay answers are cut
by a send HWM (holes mid-answer, a lost end marker), never come, or time out; the engine restarts (its first batch seen
below, equal to or above the old last seq) and its connection drops and comes back.  Checked while it runs:
Applies are contiguous since the last reset (never a seq at or below the last applied), at most one replay
is outstanding, ``held_bytes`` is exact.  Checked at every quiescent point (everything delivered, every
deadline run out, and, while connected, one more batch published so a lost tail shows as a gap):

- READY ⇒ the model index is the engine's true resident set and the applied seqs are exactly 0..last of
  the current incarnation;
- otherwise DEGRADED (DISCONNECTED only while disconnected), and what was applied since the last reset is a
  contiguous run of the current incarnation up to its last seq, so the index holds nothing stale.

Without a replay socket a restart whose first seen seq is the last applied + 1 cannot be told from the same
engine (docs/trust.md rule 6), so there restarts come after a quiescent point with a first seen seq at or below
the old last one.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvagent.model.events import SourceState
from kvagent.vllm.sequence import SourceSync
from tests.support.sim_engine import SimBatch, SimEngine, SyncDriver

READY, DEGRADED, DISCONNECTED = SourceState.READY, SourceState.DEGRADED, SourceState.DISCONNECTED
FAULTS = ("drop", "duplicate", "swap", "delay")


def held_bytes_recount(sync: SourceSync[SimBatch]) -> int:
    """White-box: the bytes of the batches the sync holds, counted from its containers."""
    held = sum(nbytes for _digest, nbytes, _message in sync._held.values())
    ahead = sum(item[2] for item in sync._ahead.values())  # replies kept ahead of an answer's awaited seq
    return held + ahead + sum(item[2] for item in sync._deferred)


class SyncMachine(RuleBasedStateMachine):
    driver: SyncDriver
    sync: SourceSync[SimBatch]
    engine: SimEngine
    has_replay: bool

    @initialize(
        seed=st.integers(0, 2**32 - 1),
        has_replay=st.booleans(),
        bootstrap=st.booleans(),
        window=st.integers(0, 4),
        memory=st.sampled_from([4, 16, 4096]),
        buffer=st.sampled_from([8, 40, 10_000]),
        hwm=st.sampled_from([3, 12, 1000]),
        tail=st.sampled_from([0.0, 0.3]),
        end=st.sampled_from([0.0, 0.5, 1.0]),
        silence=st.sampled_from([0.0, 0.0, 0.3]),
        before_attach=st.integers(0, 12),
    )
    def attach(
        self,
        seed: int,
        has_replay: bool,
        bootstrap: bool,
        window: int,
        memory: int,
        buffer: int,
        hwm: int,
        tail: float,
        end: float,
        silence: float,
        before_attach: int,
    ) -> None:
        rng = random.Random(seed)
        self.has_replay = has_replay
        self.engine = SimEngine(rng, buffer_steps=buffer)
        for _ in range(before_attach):  # published before the SUB connected: only replay has them
            self.engine.publish()
        self.sync = SourceSync(
            has_replay=has_replay,
            reorder_window=window,
            reorder_wait=0.05,
            max_attempts_without_progress=2,
            digest_memory=memory,
            cold_bootstrap=bootstrap,
        )
        self.driver = SyncDriver(
            self.sync, self.engine, rng, hwm=hwm, tail_delivery=tail, end_delivery=end, silence=silence
        )
        self.sync.start(self.driver.now)
        self.driver.execute()

    # -- the engine and the network ------------------------------------------------------------------------

    @rule(count=st.integers(1, 8), faulty=st.booleans())
    def publish(self, count: int, faulty: bool) -> None:
        rng = self.driver.rng
        for _ in range(count):
            fault = rng.choice(FAULTS) if faulty and rng.random() < 0.3 else None
            self.driver.publish(**({fault: True} if fault else {}))

    @rule(count=st.integers(5, 60))
    def burst_lost(self, count: int) -> None:
        for _ in range(count):
            self.driver.publish(drop=True)

    @rule()
    def release_delayed(self) -> None:
        self.driver.release_delayed()

    @precondition(lambda self: self.driver.connected)
    @rule(queued_after=st.integers(0, 3))
    def disconnect(self, queued_after: int) -> None:
        self.driver.disconnect(queued_after=queued_after)

    @precondition(lambda self: not self.driver.connected)
    @rule(early=st.integers(0, 2))
    def reconnect(self, early: int) -> None:
        self.driver.reconnect(early_batches=early)

    @precondition(lambda self: self.has_replay)
    @rule(first_seen=st.sampled_from(["zero", "below", "equal", "next", "above"]), early=st.integers(0, 2))
    def restart(self, first_seen: str, early: int) -> None:
        self.driver.restart(missed=self._missed(first_seen), early_batches=early)

    @precondition(lambda self: not self.has_replay and self.driver.connected)
    @rule(first_seen=st.sampled_from(["zero", "below", "equal"]))
    def restart_without_replay(self, first_seen: str) -> None:
        self._quiesce()  # the old engine's last batch is applied: a new first seq at or below it is seen
        self.driver.restart(missed=self._missed(first_seen))
        self.driver.publish()  # delivered: the first seq seen is at or below the old last

    def _missed(self, first_seen: str) -> int:
        old_last = self.engine.next_seq - 1
        return {
            "zero": 0,
            "below": max(0, old_last // 2),
            "equal": max(0, old_last),
            "next": old_last + 1,
            "above": old_last + 2 + self.driver.rng.randrange(5),
        }[first_seen]

    # -- the shell -------------------------------------------------------------------------------------------

    @rule(count=st.integers(1, 12))
    def deliver_live(self, count: int) -> None:
        self.driver.deliver_live(count)

    @rule(count=st.integers(1, 30))
    def deliver_replay(self, count: int) -> None:
        self.driver.deliver_replay(count)

    @rule()
    def time_out_replay(self) -> None:
        self.driver.time_out_replay()

    @rule(seconds=st.sampled_from([0.01, 0.06]))
    def advance(self, seconds: float) -> None:
        self.driver.advance(seconds)

    @rule()
    def shed(self) -> None:
        before = self.sync.held_bytes
        assert self.sync.shed(self.driver.now) == before
        self.driver.execute()
        assert self.sync.held_bytes == 0

    @rule()
    def check_at_quiescence(self) -> None:
        self._quiesce()
        self._check()

    # -- checks ---------------------------------------------------------------------------------------------------

    def _quiesce(self) -> None:
        self.driver.release_delayed()
        if self.driver.connected:
            self.driver.publish()  # reliable: a lost tail becomes a visible gap
        self.driver.quiesce()

    def _check(self) -> None:
        driver, sync = self.driver, self.sync
        stats = sync.statistics()
        assert stats.state is driver.state
        assert stats.lost_batches == driver.lost_reported()
        if driver.state is READY:
            assert driver.index == self.engine.resident
            assert driver.applied == driver.full_history()
            return
        assert driver.state is DEGRADED or (driver.state is DISCONNECTED and not driver.connected)
        run = driver.applied
        if run:
            assert all(seq == run[0][1] + i for i, (_inc, seq) in enumerate(run)), "applied since reset has a hole"
        if driver.state is DEGRADED:
            assert stats.held == 0
            if not run:  # reset, and waiting for a batch to continue from (a late one was dropped)
                assert not driver.index
                return
            assert {inc for inc, _seq in run} == {self.engine.incarnation}, "stale incarnation kept"
            assert run[-1][1] == self.engine.next_seq - 1, "the last published batch was applied"
            assert driver.index <= self.engine.resident

    def teardown(self) -> None:
        if hasattr(self, "driver"):
            self.check_at_quiescence()

    @invariant()
    def held_bytes_exact(self) -> None:
        assert self.sync.held_bytes == held_bytes_recount(self.sync)


SyncMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_sync_model = SyncMachine.TestCase
