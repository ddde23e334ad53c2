"""Bounded soak: steady ingest with churn and periodic reattach; memory must stay flat.

CI runs 60 s (``KVAGENT_SOAK_SECONDS``, default 60); ``nox -s soak`` runs 10 minutes.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import tracemalloc

import pytest
import trio

from kvagent.publish.sinks import NullSink
from tests.support.agent import (
    XpubEngine,
    attach,
    batch,
    gpu_store,
    is_store_of,
    running_agent,
    wait_for_event,
)

SOAK_SECONDS = float(os.environ.get("KVAGENT_SOAK_SECONDS", "60"))
REATTACH_EVERY = 10.0
POOL = 4000  # distinct block hashes: the resident set is bounded by this


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


@pytest.mark.slow
async def test_soak_memory_stays_flat() -> None:
    rng = random.Random(7)
    resident: set[int] = set()
    samples: list[tuple[float, int, int]] = []
    published = 0
    tracemalloc.start()
    try:
        async with running_agent(sink=NullSink()) as (agent, _discovery, _sink, context):
            engine = XpubEngine(context)
            generation = await attach(agent, engine)
            worker_id = 17
            start = trio.current_time()
            next_reattach = start + REATTACH_EVERY
            sentinel = 1 << 40
            while trio.current_time() - start < SOAK_SECONDS:
                events: list[dict[str, object]] = []
                for _ in range(8):
                    block = rng.randrange(1, POOL)
                    if block in resident:
                        resident.discard(block)
                        events.append({"type": "BlockRemoved", "block_hashes": [block], "medium": "GPU"})
                    else:
                        resident.add(block)
                        events.append(gpu_store([block]))
                await engine.send_payload(batch(events))
                published += 1
                if published % 500 == 0:
                    # Pace to the agent: wait until this batch is indexed (never sleeps blindly).
                    sentinel += 1
                    await engine.send_payload(batch([gpu_store([sentinel])]))
                    with trio.fail_after(30):
                        await wait_for_event(agent, is_store_of(sentinel))
                    resident.add(sentinel)
                    gc.collect()
                    current, _peak = tracemalloc.get_traced_memory()
                    samples.append((trio.current_time() - start, rss_bytes(), current))
                if trio.current_time() >= next_reattach:
                    with trio.fail_after(30):
                        await agent.detach(generation)
                    engine.close()
                    resident.clear()  # a new engine incarnation starts empty (the detach barrier reset it)
                    engine = XpubEngine(context)
                    worker_id += 1
                    with trio.fail_after(30):
                        generation = await attach(agent, engine, worker_id=worker_id)
                    next_reattach = trio.current_time() + REATTACH_EVERY
            engine.close()
            assert agent.statistics().coordinator.dropped_events == 0
    finally:
        tracemalloc.stop()
    assert len(samples) >= 4, "soak too short to judge"
    warm = samples[len(samples) // 4]
    last = samples[-1]
    traced_growth = last[2] - warm[2]
    rss_growth = last[1] - warm[1]
    print(
        f"soak: {published} batches in {last[0]:.0f} s, traced {warm[2] / 1e6:.1f} → {last[2] / 1e6:.1f} MB, "
        f"RSS {warm[1] / 1e6:.1f} → {last[1] / 1e6:.1f} MB"
    )
    assert traced_growth < 4 * 1024 * 1024, f"Python heap grew by {traced_growth} bytes once stable"
    assert rss_growth < max(16 * 1024 * 1024, warm[1] // 10), f"RSS grew by {rss_growth} bytes once stable"
