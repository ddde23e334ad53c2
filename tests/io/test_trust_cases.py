"""Issue #14's cases over real ZMQ: a fake vLLM engine, a real slot agent, the dump against the engine's truth.

Each test prints the figures it produced (``pytest -s``): replay requests, batches repaired and lost, resets.
"""

from __future__ import annotations

import pytest
import trio

from kvagent.simulator.engine import VLLM_REPLAY_HWM, SimulatedWorkload, block_stored
from tests.io.trust_harness import BLOCK, ChurnWorkload, TrustRig, open_rig

GUARD = 120  # seconds: a hang guard only


def figures(rig: TrustRig, case: str) -> None:
    stats = rig.listener()
    print(
        f"{case}: state={rig.state} dump={len(rig.dump())} truth={len(rig.truth())} "
        f"replay_requests={stats.replay_requests} (engine served {rig.engine.replay_requests}) "
        f"repaired={stats.repaired_batches} lost={stats.lost_batches} gaps={stats.gaps} late={stats.late_batches} "
        f"duplicates={stats.duplicates} restarts={stats.restarts_seen} resets={rig.worker_resets()} "
        f"degradations={stats.degradations}"
    )


async def publish_batches(rig: TrustRig, workload: SimulatedWorkload | ChurnWorkload, batches: int, **faults: bool) -> None:
    """Exactly ``batches`` engine batches (idle steps publish nothing and are not counted)."""
    published = 0
    while published < batches:
        events = workload.next_step()
        if events:
            await rig.engine.publish_batch(events, **faults)
            published += 1


async def test_a_10000_batch_gap_inside_the_replay_buffer_is_repaired_exactly() -> None:
    """vLLM's replay ROUTER drops past 1,000 queued replies: the holes are asked again until covered."""
    with trio.fail_after(GUARD):
        async with open_rig(buffer_steps=20_000, replay_hwm=VLLM_REPLAY_HWM) as rig:
            workload = SimulatedWorkload(seed=14, block_size=BLOCK, offload_probability=0.0)
            await publish_batches(rig, workload, 200)
            await rig.settle()
            await publish_batches(rig, workload, 10_000, drop_live=True)
            await rig.settle()
            figures(rig, "gap of 10,000 inside a 20,000 buffer, HWM 1000")
            stats = rig.listener()
            assert rig.state == "ready"
            assert rig.dump() == rig.truth()
            assert stats.lost_batches == 0 and rig.worker_resets() == 0
            assert stats.repaired_batches >= 10_000
            assert rig.engine.replay_requests > 1, "one answer cannot carry 10,000 replies past the HWM"


async def test_a_50000_batch_gap_beyond_the_replay_buffer_degrades_with_a_reset_and_no_stale_block() -> None:
    with trio.fail_after(GUARD):
        async with open_rig(buffer_steps=10_000, replay_hwm=VLLM_REPLAY_HWM) as rig:
            workload = ChurnWorkload()
            await publish_batches(rig, workload, 200)
            await rig.settle()
            await publish_batches(rig, workload, 50_000, drop_live=True)
            await rig.settle()
            figures(rig, "gap of 50,000 beyond a 10,000 buffer")
            stats = rig.listener()
            dump, truth = rig.dump(), rig.truth()
            assert rig.state == "degraded"
            assert rig.worker_resets() == 1
            assert dump <= truth, f"stale blocks: {set(dump - truth)}"
            # What the engine still held was applied after the reset: every block it holds from those batches.
            assert truth - dump == {rig.first_sentinel}
            # Seqs 201..50,200 were dropped; the second sentinel (50,201) entered the 10,000-batch buffer before
            # the repair asked, so the engine held 40,202..50,201: 201..40,201 are lost.
            assert stats.lost_batches == 40_001 and stats.repaired_batches == 9_999


@pytest.mark.parametrize("first_seen", ["below", "equal", "above"])
async def test_an_engine_restart_is_detected_whatever_its_first_seq_and_resets(first_seen: str) -> None:
    with trio.fail_after(GUARD):
        async with open_rig() as rig:
            await publish_batches(rig, ChurnWorkload(), 100)
            await rig.settle()
            last = rig.engine.next_seq - 1
            rig.engine.restart()  # a new engine on the same sockets: seq 0, new buffer, new timestamps
            first = {"below": last - 50, "equal": last, "above": last + 50}[first_seen]
            workload = ChurnWorkload(first_hash=1_000_000)
            await publish_batches(rig, workload, first, drop_live=True)  # before the SUB saw the new engine
            await publish_batches(rig, workload, 20)
            await rig.settle()
            figures(rig, f"restart, first seen seq {first} vs old last {last}")
            stats = rig.listener()
            assert rig.state == "ready"
            assert rig.dump() == rig.truth()
            assert rig.worker_resets() == 1 and stats.restarts_seen == 1
            assert stats.lost_batches == 0


async def test_one_percent_adjacent_swaps_converge_without_loss() -> None:
    with trio.fail_after(GUARD):
        async with open_rig(swap_rate=0.01, fault_seed=14, replay_hwm=VLLM_REPLAY_HWM) as rig:
            workload = SimulatedWorkload(seed=4, block_size=BLOCK, offload_probability=0.0)
            await publish_batches(rig, workload, 20_000)
            await rig.settle()
            figures(rig, f"20,000 batches, {rig.engine.swapped} adjacent swaps")
            stats = rig.listener()
            assert rig.engine.swapped > 100
            assert rig.state == "ready"
            assert rig.dump() == rig.truth()
            assert stats.lost_batches == 0 and rig.worker_resets() == 0 and stats.restarts_seen == 0
            assert stats.late_batches >= rig.engine.swapped - 1  # each swap applied in order, late


async def test_a_killed_engine_is_disconnected_at_once_and_its_revival_decides_the_reset() -> None:
    with trio.fail_after(GUARD):
        async with open_rig() as rig:
            await publish_batches(rig, ChurnWorkload(), 50)
            await rig.settle()
            engine = rig.engine
            engine.kill()
            await rig.wait_state("disconnected")
            status = rig.agent.status().attachment
            assert status is not None and not status.ready

            await engine.revive(restart=False)  # the same engine: its history continues
            await engine.wait_for_subscriber()
            await publish_batches(rig, ChurnWorkload(first_hash=1000), 10)
            await rig.settle()
            figures(rig, "killed, revived same")
            assert rig.state == "ready" and rig.worker_resets() == 0
            assert rig.dump() == rig.truth()

            engine.kill()
            await rig.wait_state("disconnected")
            await engine.revive(restart=True)  # a new engine on the same ports
            await engine.wait_for_subscriber()
            await publish_batches(rig, ChurnWorkload(first_hash=2000), 10)
            await rig.settle()
            figures(rig, "killed, revived new")
            assert rig.state == "ready" and rig.worker_resets() == 1
            assert rig.dump() == rig.truth()


async def test_valid_batches_before_a_malformed_frame_are_all_applied_then_quarantined() -> None:
    with trio.fail_after(GUARD):
        async with open_rig(replay=False) as rig:
            engine = rig.engine
            for n in range(8):  # 80 blocks in 8 valid batches
                hashes = list(range(100 + 10 * n, 110 + 10 * n))
                await engine.publish_batch([block_stored(hashes, None, [n + 1] * (10 * BLOCK), BLOCK)])
            await engine.publish_frames([engine.topic, engine.next_seq.to_bytes(8, "big"), b"\xc1"])
            await rig.wait_state("unready")
            assert rig.dump() == set(range(100, 180)) == rig.truth()
            assert rig.listener().decode_errors == 1
