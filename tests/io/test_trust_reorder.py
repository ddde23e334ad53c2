"""Issue #28 item 3 over real ZMQ: adjacent swaps with a replay socket publish no Worker reset.

The engine buffers what it sends in the order it sends it, so a replay answer carries the same swaps as the
live stream; runs of batches are dropped live (kept for replay) so that the agent's repairs read answers
that carry swaps.
A late batch whose bytes match the history is a duplicate or a reorder, never a restart.
"""

from __future__ import annotations

import pytest
import trio

from kvagent.simulator.engine import VLLM_REPLAY_HWM, SimulatedWorkload
from tests.io.trust_harness import BLOCK, open_rig

GUARD = 120  # seconds: a hang guard only


@pytest.mark.parametrize("seed", [3, 28])
async def test_one_percent_swaps_in_3000_batches_publish_no_reset(seed: int) -> None:
    with trio.fail_after(GUARD):
        async with open_rig(
            swap_rate=0.01, fault_seed=seed, replay_hwm=VLLM_REPLAY_HWM, buffer_in_send_order=True
        ) as rig:
            workload = SimulatedWorkload(seed=seed, block_size=BLOCK, offload_probability=0.0)
            published = 0
            while published < 3_000:
                events = workload.next_step()
                if events:
                    # 30 of every 150 batches go unseen live: each run is a gap the replay socket repairs,
                    # and one of each run is sent (and buffered) after its successor.
                    phase = published % 150
                    await rig.engine.publish_batch(
                        events, drop_live=phase >= 120, swap_with_next=phase == 130
                    )
                    published += 1
            await rig.settle()
            stats = rig.listener()
            print(
                f"seed {seed}: {rig.engine.swapped} swaps, replay requests {stats.replay_requests}, "
                f"late {stats.late_batches}, duplicates {stats.duplicates}, resets {rig.worker_resets()}"
            )
            assert rig.engine.swapped > 15 and stats.replay_requests >= 20
            assert rig.worker_resets() == 0 and stats.restarts_seen == 0 and stats.lost_batches == 0
            assert rig.state == "ready"
            assert rig.dump() == rig.truth()
