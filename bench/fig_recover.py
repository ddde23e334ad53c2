"""Figure 4: buffered-recovery latency with 64 concurrent websocket clients while the index takes 50k ev/s."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import trio

from bench.harness import FigureResult, Row, percentile
from bench.slot_fixture import BenchSlot, build_index

NAME = "recover"
TITLE = "Buffered recovery latency, 64 clients, 50k events/s applied"
CLIENTS = 64
APPLY_RATE = 50_000
APPLY_TICK = 0.005  # apply in timed batches of 250 events


async def _applier(index: Any, stop: trio.Event, applied: list[int]) -> None:
    """Apply stores and removes of earlier stores at APPLY_RATE, keeping the resident set bounded."""
    import random

    from bench.agent_run import WORKER_ID
    from kvagent.events import Removed, ResidencyDomain, RouterEvent, StorageTier, Stored

    rng = random.Random(5)
    live: list[tuple[int, ...]] = []
    per_tick = int(APPLY_RATE * APPLY_TICK)
    deadline = trio.current_time()
    while not stop.is_set():
        for _ in range(per_tick):
            event_id = index.current_event_id() + 1
            if live and rng.random() < 0.5:
                data: Any = Removed(live.pop(rng.randrange(len(live))))
            else:
                hashes = tuple(rng.getrandbits(64) for _ in range(4))
                live.append(hashes)
                data = Stored(None, hashes, hashes)
            index.apply(RouterEvent(WORKER_ID, StorageTier.DEVICE, ResidencyDomain.WORKER, event_id, data, 0))
        applied[0] += per_tick
        deadline += APPLY_TICK
        await trio.sleep_until(deadline)  # pacing the load generator, not synchronization


async def _client_process_main(url: str, op: str, seconds: float, first_cursor: int) -> dict[str, Any]:
    """64 clients in their own process (a router's view): each asks for the events since its last answer."""
    from kvagent.recovery.client import connect_slot

    latencies: list[float] = []
    kinds: dict[str, int] = {}

    async def client_loop(deadline: float) -> None:
        cursor = first_cursor
        async with connect_slot(url, "bench", encoding="msgpack") as client:
            while trio.current_time() < deadline:
                started = time.perf_counter()
                if op == "status":
                    await client.status()
                    kind = "status"
                else:
                    answer = await client.recover(max(1, cursor))
                    kind = answer.kind
                    if answer.last_event_id is not None:
                        cursor = answer.last_event_id
                latencies.append(time.perf_counter() - started)
                kinds[kind] = kinds.get(kind, 0) + 1

    deadline = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        for _ in range(CLIENTS):
            nursery.start_soon(client_loop, deadline)
    return {"latencies": latencies, "kinds": kinds}


def _client_process(conn: Any, url: str, op: str, seconds: float, first_cursor: int) -> None:
    try:
        conn.send(("ok", trio.run(_client_process_main, url, op, seconds, first_cursor)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


async def _clients(index: Any, op: str, seconds: float) -> tuple[list[float], dict[str, int], int, float]:
    import multiprocessing

    from kvagent.recovery.server import SlotRegistry, serve_recovery

    registry = SlotRegistry()
    registry.add(BenchSlot(index))
    applied = [0]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        info = await nursery.start(partial(serve_recovery, registry, host="127.0.0.1", port=0))
        url = f"ws://127.0.0.1:{info.port}"
        nursery.start_soon(_applier, index, stop, applied)
        started = trio.current_time()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_client_process, args=(child, url, op, seconds, index.current_event_id()))
        process.start()
        child.close()
        status, value = await trio.to_thread.run_sync(parent.recv)
        process.join()
        stop.set()
        elapsed = trio.current_time() - started
        nursery.cancel_scope.cancel()
    if status != "ok":
        raise RuntimeError(value)
    return value["latencies"], value["kinds"], applied[0], elapsed


def run(result: FigureResult, *, quick: bool) -> None:
    seconds = 3.0 if quick else 8.0
    index = build_index(100_000)
    result.params.update(clients=CLIENTS, apply_rate=APPLY_RATE, seconds=seconds,
                         resident_blocks_at_start=100_000)
    base, base_kinds, base_applied, base_elapsed = trio.run(_clients, index, "status", seconds)
    rec, kinds, applied, elapsed = trio.run(_clients, index, "recover", seconds)
    result.extra.update(
        recover_answer_kinds=kinds, status_answer_kinds=base_kinds,
        applied_rate_recover=applied / elapsed, applied_rate_status=base_applied / base_elapsed,
        requests_recover=len(rec), requests_status=len(base),
    )
    ms = 1000.0
    result.rows += [
        Row("recover p50", percentile(rec, 50) * ms, "ms", "status op p50", percentile(base, 50) * ms,
            higher_is_better=False),
        Row("recover p99", percentile(rec, 99) * ms, "ms", "status op p99", percentile(base, 99) * ms,
            target="<= 5 ms", higher_is_better=False),
        Row("applied rate", applied / elapsed, "events/s", "during status loop", base_applied / base_elapsed,
            note="load actually achieved"),
    ]
