"""The defaults that made the library a different agent from ``kvagent serve`` (issue #35 item 1), over real ZMQ.

An embedded slot (``open_slot_agent`` with a default ``SlotAgentConfig``) used to shed at once over its
ingest budget (``shed_after`` 0) and wake for every batch (``coalesce_window`` 0), where ``kvagent serve``
waits up to 5 s and paces its reads: under a burst on a shared machine the library's slots ended degraded.
Here a burst well past a (shrunk) budget reaches an agent with the library's defaults otherwise: it waits
instead of shedding and stays ready and exact; the same burst with ``shed_after=0`` sheds, which shows the
burst does pass the budget.
"""

from __future__ import annotations

import attrs
import trio

from kvagent.vllm.listener import ListenerOptions
from tests.io.trust_harness import flood, open_rig

GUARD = 60  # seconds: a hang guard only
BATCHES = 600  # ~6 KB each: ~3.6 MB into a 256 KiB budget, under the fake engine's PUB high-water mark


def small_budget(options: ListenerOptions) -> ListenerOptions:
    return attrs.evolve(options, max_payload_bytes=8 << 10, ingress_bytes=256 << 10)


def test_the_library_default_listener_is_serve_s() -> None:
    assert ListenerOptions().shed_after == 5.0
    assert ListenerOptions().coalesce_window == 0.02


async def test_with_the_default_listener_a_burst_past_the_budget_waits_and_the_slot_stays_exact() -> None:
    with trio.fail_after(GUARD):
        # No replay socket: anything shed would be lost for good and leave the slot degraded.
        async with open_rig(small_budget(ListenerOptions()), replay=False) as rig:
            await flood(rig, blocks_per_batch=24, batches=BATCHES)
            await rig.settle()
            stats = rig.listener()
            assert stats.ingest_sheds == 0 and stats.lost_batches == 0
            assert stats.batches == BATCHES + 2  # both sentinels too
            assert rig.state == "ready" and rig.dump() == rig.truth()


async def test_shedding_at_once_the_same_burst_is_shed() -> None:
    with trio.fail_after(GUARD):
        async with open_rig(small_budget(ListenerOptions(shed_after=0.0)), replay=False) as rig:
            await flood(rig, blocks_per_batch=24, batches=BATCHES)
            await rig.settle()
            assert rig.listener().ingest_sheds > 0
            assert rig.state == "degraded"
