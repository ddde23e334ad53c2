"""Issue #28 items 1 and 2 over real ZMQ: a large batch, then more; a flood past the ingest budget.

A fake vLLM engine and a real slot agent; the invariant is the trust spec's: the slot is ready only while
its dump is exactly the engine's truth.
"""

from __future__ import annotations

import pytest
import trio

from kvagent.vllm.fake_engine import block_stored
from kvagent.vllm.listener import ListenerOptions
from tests.io.trust_harness import BLOCK, TrustRig, open_rig

GUARD = 30  # seconds: a hang guard only


async def publish_small(rig: TrustRig, first_hash: int, batches: int) -> int:
    """``batches`` batches of four new blocks each; returns the next free hash."""
    for _ in range(batches):
        hashes = list(range(first_hash, first_hash + 4))
        first_hash += 4
        await rig.engine.publish_batch([block_stored(hashes, None, [first_hash % 50_000] * (4 * BLOCK), BLOCK)])
    return first_hash


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("blocks", [8192, 8193])
async def test_a_batch_of_one_8192_block_store_then_more_batches_all_arrive(blocks: int, replay: bool) -> None:
    """One ~570 KB batch between 20 small ones on each side: every later batch is applied, ready and exact.

    The reader used to lower the SUB's RCVHWM when it saw a larger message; libzmq applies that to the live
    pipe, whose writer can then wait forever for a read report the reader already passed: every later batch
    was dropped at the engine's PUB, and with nothing arriving no gap was ever seen (ready, 80 blocks missing).
    """
    with trio.fail_after(GUARD):
        async with open_rig(replay=replay) as rig:
            next_hash = await publish_small(rig, 1, 20)
            big = list(range(1_000_000, 1_000_000 + blocks))
            tokens = [1_000 + (i * 7) % 49_000 for i in range(blocks * BLOCK)]
            await rig.engine.publish_batch([block_stored(big, None, tokens, BLOCK)])
            await publish_small(rig, next_hash, 20)
            await rig.settle()  # the sentinel: applied only if the SUB still receives
            stats = rig.listener()
            assert stats.messages == 42 and stats.batches == 42
            assert rig.state == "ready"
            assert rig.dump() == rig.truth()
            assert stats.sheds == 0 and stats.lost_batches == 0 and rig.worker_resets() == 0
