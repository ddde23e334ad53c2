"""Late batches are reorders, never restarts (issue #28 item 3), in SourceSync's pure form.

An engine whose live batches are sometimes swapped with their successor also buffers them in the order it
sent them, so a replay answer carries the same swaps. A reply after its successor is a reorder within the
answer: neither a hole nor a sign that the engine lost (or never had) the requested start.
"""

from __future__ import annotations

import random

import pytest

from kvagent.vllm.sequence import CancelReplay, RequestReplay, SourceSync
from tests.support.sim_engine import SimBatch, SimEngine, SyncDriver
from tests.unit.test_sequence import NBYTES, READY, applied, digest, live, reply, started


def swap_last_two_in_buffer(engine: SimEngine) -> None:
    """The engine sent (and so buffered) its last batch before the one before it."""
    last, before = engine.buffer.pop(), engine.buffer.pop()
    engine.buffer.append(last)
    engine.buffer.append(before)


@pytest.mark.parametrize("seed", range(12))
def test_one_percent_swaps_with_replay_answers_in_send_order_publish_no_reset(seed: int) -> None:
    rng = random.Random(seed)
    engine = SimEngine(rng)
    sync: SourceSync[SimBatch] = SourceSync(has_replay=True, cold_bootstrap=False)
    driver = SyncDriver(sync, engine, rng)
    sync.start(0.0)
    driver.execute()
    swaps = 0
    for _ in range(3_000):
        swap = rng.random() < 0.01 and bool(driver.live)
        driver.publish(swap=swap, drop=rng.random() < 0.01)  # drops make the sync ask the replay socket
        if swap:
            swaps += 1
            swap_last_two_in_buffer(engine)
        if rng.random() < 0.3:
            driver.deliver_live(rng.randint(1, 3))
        if rng.random() < 0.2:
            driver.advance(rng.choice([0.001, 0.01, 0.06]))
        if rng.random() < 0.3:
            driver.deliver_replay(rng.randint(1, 5))
    driver.quiesce()
    stats = sync.statistics()
    assert swaps > 10
    assert driver.resets() == 0, f"{driver.resets()} resets for {swaps} swaps ({stats})"
    assert stats.restarts_seen == 0 and stats.history_losses == 0 and stats.lost_batches == 0
    assert driver.state is READY
    assert driver.index == engine.resident


def test_an_answer_whose_first_reply_is_the_starts_successor_waits_for_the_start() -> None:
    """Asked from 9 (the anchor of a repair), the engine answers 9, 11, 10: 11 waits for 10, no hole."""
    sync = started(upto=9)
    assert live(sync, 12) == []
    sync.on_timer(1.0)
    assert sync.take_actions() == [RequestReplay(9)]
    assert reply(sync, 9) == []  # the anchor
    assert reply(sync, 11) == []  # ahead of 10: kept for now
    assert reply(sync, 10) == [*applied(10, 11, replayed=True), *applied(12), CancelReplay()]
    stats = sync.statistics()
    assert stats.state is READY and stats.resets == 0 and stats.replay_holes == 0 and stats.held_bytes == 0


def test_a_repair_answered_successor_first_is_not_a_lost_start() -> None:
    """Asked from 10 (a repair), the engine answers 11 then 10: 10 is not gone from its buffer."""
    sync = started(upto=9)
    sync.on_live(12, digest(12), NBYTES, "L12", 0.0)
    sync.on_timer(1.0)
    reply(sync, 9)
    reply(sync, 10)
    reply(sync, 11)  # applies 10, 11 and the held 12; the repair is done
    assert live(sync, 14) == []
    sync.on_timer(2.0)
    assert sync.take_actions() == [RequestReplay(12)]
    assert reply(sync, 13) == []  # the anchor 12 evicted? no: it comes next
    assert reply(sync, 12) == [*applied(13, replayed=True), *applied(14), CancelReplay()]
    stats = sync.statistics()
    assert stats.history_losses == 0 and stats.resets == 0 and stats.lost_batches == 0


def test_a_strict_anchor_answered_after_its_successor_proves_the_same_engine() -> None:
    """A late batch with no digest left to compare: the anchor check must find the anchor even when the
    engine buffered it after its successor."""
    sync = started(upto=9, digest_memory=4)
    assert live(sync, 2) == [RequestReplay(9)]  # seq 2's digest is forgotten: the replay socket decides
    assert reply(sync, 10) == []  # the anchor (9) comes after its successor
    reply(sync, 9)
    stats = sync.statistics()
    assert stats.restarts_seen == 0 and stats.resets == 0 and stats.state is READY
    assert stats.duplicates == 1  # the late batch, proven the same engine's
