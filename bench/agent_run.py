"""Running the real slot agent in-process against the publisher process (figures 1 and 5)."""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio
import zmq

from bench.publisher import Publisher

OWNER_TEXT = (
    "01010101010101010101010101010101:02020202020202020202020202020202/0000000000000003/"
    "04040404040404040404040404040404"
)
WORKER_ID = 7
BLOCK_SIZE = 16


def owner() -> Any:
    from kvagent.model.ids import CacheOwnerId

    return CacheOwnerId.parse(OWNER_TEXT)


async def _run_agent(publisher: Publisher, *, paced: tuple[float, float] | None,
                     cpu_window: tuple[float, float] | None, wait_limit: float,
                     state_path: Path | None = None) -> dict[str, Any]:
    from kvagent import AttachmentConfig, MemoryDiscovery, SlotAgentConfig, open_slot_agent
    from kvagent.vllm.listener import ListenerOptions

    stats = publisher.stats
    context: zmq.Context[Any] = zmq.Context()
    # Zero-loss burst ingest: past its byte budget the listener waits (the publisher queues, SNDHWM 0) instead
    # of shedding, which a real deployment does to stay current.
    config = SlotAgentConfig(
        name="bench",
        cache_owner_id=owner(),
        kv_block_size=BLOCK_SIZE,
        dp_rank=0,
        listener=ListenerOptions(shed_after=math.inf),
        state_path=state_path,
    )
    try:
        async with open_slot_agent(config, discovery=MemoryDiscovery(), zmq_context=context) as agent:
            publisher.request_subscriber_wait()
            async with trio.open_nursery() as nursery:
                # The publisher reports the subscription over the pipe; attach returns once the SUB is set up.
                nursery.start_soon(partial(trio.to_thread.run_sync, publisher.wait_subscribed))
                await agent.attach(
                    AttachmentConfig(worker_id=WORKER_ID, dp_rank=0, endpoint=publisher.endpoint, topic="kv-events")
                )
            base = agent.status().outbound_cursor
            if paced is None:
                events = stats.events
                publisher.burst()
            else:
                batches = int(paced[0] / 8 * paced[1])
                events = -1  # computed below from the batches actually sent
                publisher.paced(*paced)
            started, cpu_started = time.perf_counter(), time.process_time()
            result: dict[str, Any] = {"base_cursor": base}
            if cpu_window is not None:
                await trio.sleep(cpu_window[0])  # a measuring window, not synchronization
                cpu0, wall0 = time.process_time(), time.perf_counter()
                await trio.sleep(cpu_window[1])
                cpu1, wall1 = time.process_time(), time.perf_counter()
                result["cpu_percent"] = 100 * (cpu1 - cpu0) / (wall1 - wall0)
            if paced is not None:
                sent, _, _ = await trio.to_thread.run_sync(publisher.wait_sent)
                # The paced stream is a prefix of the trace; with 8 events a batch, every raw event of it
                # becomes one outbound event (see bench/trace.py), so the target follows from the count.
                events = sent * 8
                assert sent <= batches + 1
            target = base + events
            with trio.move_on_after(wait_limit) as waited:
                await agent.status_cell.wait_for(lambda s: s.outbound_cursor >= target)
            finished, cpu_finished = time.perf_counter(), time.process_time()
            if paced is None:
                await trio.to_thread.run_sync(publisher.wait_sent)
            cursor = agent.status().outbound_cursor
            statistics = agent.statistics()
            listener = statistics.listener
            counters = statistics.coordinator
            if statistics.persistence is not None:  # persisted to the end, so the figure sees the whole state
                with trio.move_on_after(wait_limit):
                    while True:  # polling the writer's lag (a real observable), bounded
                        lagging = agent.statistics().persistence
                        if lagging is None or lagging.lag_events == 0:
                            break
                        await trio.sleep(0.01)
                result["persisted_seconds"] = time.perf_counter() - started
                persistence = agent.statistics().persistence
                assert persistence is not None
                result["persistence"] = {**_attrs_dict(persistence), "state": persistence.state.value}
                result["resident_blocks"] = agent.index.resident_block_count
            result.update(
                seconds=finished - started,
                cpu_seconds=cpu_finished - cpu_started,
                events=events,
                applied=cursor - base,
                timed_out=waited.cancelled_caught,
                index_cursor=agent.index.current_event_id(),
                lost_events=max(0, target - cursor),
                listener=_attrs_dict(listener),
                dropped_events=counters.dropped_events,
                source_losses=counters.source_losses,
                filtered=dict(counters.events_filtered),
                quarantines=dict(counters.quarantines),
            )
            return result
    finally:
        context.destroy(linger=0)


def _attrs_dict(value: object) -> dict[str, Any]:
    import attrs

    if value is None:
        return {}
    return dict(attrs.asdict(value))  # type: ignore[arg-type]


def run_agent(publisher: Publisher, *, paced: tuple[float, float] | None = None,
              cpu_window: tuple[float, float] | None = None, timeout: float = 300,
              state_path: Path | None = None) -> dict[str, Any]:
    """One agent run; with ``state_path`` the slot persists its state there (issue #17)."""
    return trio.run(lambda: _run_agent(publisher, paced=paced, cpu_window=cpu_window, wait_limit=timeout,
                                       state_path=state_path))
