"""Issue #35 item 4 over real ZMQ: after a flood the listener shed, the replay socket proves the history.

A fake vLLM engine with a replay socket and a real slot agent whose listener bound is far below the flood,
so the reader sheds and re-opens its SUB and the flood's tail is lost with the old SUB. Nothing is
published after the flood: no later live batch shows the gap. The listener asks the replay socket after the
shed, and the slot is ready again, and exact, while the engine stays idle.
"""

from __future__ import annotations

import trio
import trio.testing

from kvagent.vllm.listener import ListenerOptions
from tests.io.test_trust_ingest import check_exact_or_not_ready
from tests.io.trust_harness import flood, open_rig

GUARD = 30  # seconds: a hang guard only


async def test_a_flood_shed_and_repaired_by_replay_is_ready_and_exact_with_the_engine_idle() -> None:
    # ~24 KB batches into a 128 KiB listener bound: a handful fill it, so the reader sheds even on a fast,
    # idle machine (the processor cannot admit 600 of them as fast as ZMQ delivers).
    # shed_after=0: shed at once (the default first stops reading for 5 s, and the processor catches up).
    options = ListenerOptions(max_payload_bytes=32 << 10, ingress_bytes=256 << 10, shed_after=0.0)
    with trio.fail_after(GUARD):
        async with open_rig(options, replay=True) as rig:
            await flood(rig, blocks_per_batch=96)
            check_exact_or_not_ready(rig)
            # No batch after the flood: only the replay socket can show what the shed's re-open lost.
            await rig.wait_state("ready")
            stats = rig.listener()
            assert stats.ingest_sheds > 0, "the burst must pass the ingest budget"
            assert rig.dump() == rig.truth()
            assert stats.lost_batches == 0 and rig.worker_resets() == 0
            sync = rig.listener_counters().sync
            assert sync is not None
            assert sync.statistics().applied_seq == rig.engine.next_seq - 1  # the engine's newest batch
