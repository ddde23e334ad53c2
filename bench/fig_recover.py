"""Figure 4: buffered-recovery latency with 64 concurrent websocket clients while the index takes 50k ev/s."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import trio

from bench.harness import FigureResult, Row, median, percentile
from bench.slot_fixture import BenchSlot, build_index

NAME = "recover"
TITLE = "Buffered recovery latency, 64 clients, 50k events/s applied"
CLIENTS = 64
APPLY_RATE = 50_000
APPLY_TICK = 0.001  # apply in timed slices of 50 events, as the agent's coordinator works in ~1 ms slices
WARMUP = 0.5  # requests started in the first half second (64 handshakes, cold caches) are not recorded
PACED_INTERVAL = 0.2  # paced mode: each client recovers every 200 ms (320 recoveries/s from 64 clients)
BACKLOG = 200  # a recovering router is 200 events behind the live cursor
RINGS = (1024, 65536)  # the default ring, and one holding ~1.3 s of history at 50k ev/s


def _load_cycle(stores: int, lag: int = 2_000) -> list[Any]:
    """Event data applied in a loop: stores of fresh 4-block chains, each removed ``lag`` stores later.

    Built before any timing so the load generator costs little more than ``apply`` itself; every chain is
    removed by the end of the cycle, so the cycle can repeat and the resident set stays bounded.
    """
    import random

    from kvagent.model.events import Removed, Stored

    rng = random.Random(5)
    chains = [tuple(rng.getrandbits(64) for _ in range(4)) for _ in range(stores)]
    cycle: list[Any] = []
    for i, chain in enumerate(chains):
        cycle.append(Stored(None, chain, chain))
        if i >= lag:
            cycle.append(Removed(chains[i - lag][:1]))
            cycle.append(Removed(chains[i - lag][1:]))
    cycle += [Removed(chain) for chain in chains[-lag:]]
    return cycle


async def _applier(index: Any, stop: trio.Event, applied: list[int], cycle: list[Any]) -> None:
    """Apply the cycle's events at APPLY_RATE in ~1 ms slices (the agent's coordinator works the same way)."""
    import itertools

    from bench.agent_run import WORKER_ID
    from kvagent.model.events import ResidencyDomain, RouterEvent, StorageTier

    data = itertools.cycle(cycle)
    tier, domain = StorageTier.DEVICE, ResidencyDomain.WORKER
    per_tick = int(APPLY_RATE * APPLY_TICK)
    deadline = trio.current_time()
    apply = index.apply
    while not stop.is_set():
        event_id = index.current_event_id()
        for _ in range(per_tick):
            event_id += 1
            apply(RouterEvent(WORKER_ID, tier, domain, event_id, next(data), 0))
        applied[0] += per_tick
        deadline += APPLY_TICK
        await trio.sleep_until(deadline)  # pacing the load generator, not synchronization


async def _client_process_main(url: str, op: str, seconds: float, paced: bool) -> dict[str, Any]:
    """64 clients in their own process (a router's view), each looping over one timed request.

    For ``recover`` a client first reads the live cursor with an (untimed) ``status`` and then asks for the
    newest BACKLOG events from it; the answer also carries whatever was applied in between, which is
    recorded as the answer size. Closed loop (``paced=False``): each client sends its next request as soon
    as the last one is answered, so the server is saturated and latency is mostly queueing behind the other
    63 clients. Paced: each client starts a request every PACED_INTERVAL (a fixed offered load).
    """
    from kvagent.recovery.client import connect_slot

    latencies: list[float] = []
    sizes: list[int] = []
    kinds: dict[str, int] = {}

    async def client_loop(deadline: float, offset: float) -> None:
        async with connect_slot(url, "bench", encoding="msgpack") as client:
            next_start = trio.current_time() + offset
            while trio.current_time() < deadline:
                if paced:
                    await trio.sleep_until(next_start)  # the offered load's schedule, not synchronization
                    next_start += PACED_INTERVAL
                if op == "status":
                    started = time.perf_counter()
                    await client.status()
                    kind = "status"
                else:
                    cursor = (await client.status()).outbound_cursor
                    started = time.perf_counter()
                    # The answer as received: events left encoded (lazy_events) and dumps in the compact columns
                    # format; decoding is the router's own work (about 4.5 us per event as wire maps).
                    answer = await client.recover(
                        max(1, cursor - BACKLOG), dump_format="columns", lazy_events=True
                    )
                    kind = answer.kind
                    if trio.current_time() >= warm:
                        sizes.append(_answer_events(answer))
                if trio.current_time() >= warm:
                    latencies.append(time.perf_counter() - started)
                    kinds[kind] = kinds.get(kind, 0) + 1

    warm = trio.current_time() + WARMUP
    deadline = warm + seconds
    async with trio.open_nursery() as nursery:
        for i in range(CLIENTS):
            nursery.start_soon(client_loop, deadline, PACED_INTERVAL * i / CLIENTS)
    return {"latencies": latencies, "kinds": kinds, "sizes": sizes}


def _answer_events(answer: Any) -> int:
    """Events in an answer without decoding them: each lazy blob is one msgpack array (count in its header)."""
    import msgpack

    count = len(answer.wire_events) + sum(piece.live for piece in answer.dump)
    for blob in answer.events_msgpack:
        unpacker = msgpack.Unpacker()
        unpacker.feed(blob)
        count += unpacker.read_array_header()
    return int(count)


def _client_process(conn: Any, url: str, op: str, seconds: float, paced: bool) -> None:
    try:
        conn.send(("ok", trio.run(_client_process_main, url, op, seconds, paced)))
    except Exception as exc:
        import traceback

        conn.send(("error", "".join(traceback.format_exception(exc))[-3000:]))


async def _clients(
    index: Any, op: str, seconds: float, paced: bool, cycle: list[Any]
) -> tuple[list[float], dict[str, int], int, float, list[int]]:
    import multiprocessing

    from kvagent.agent.host import SlotRegistry
    from kvagent.recovery.server import serve_recovery

    registry = SlotRegistry()
    registry.add(BenchSlot(index))
    applied = [0]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        info = await nursery.start(partial(serve_recovery, registry, host="127.0.0.1", port=0))
        url = f"ws://127.0.0.1:{info.port}"
        nursery.start_soon(_applier, index, stop, applied, cycle)
        started = trio.current_time()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_client_process, args=(child, url, op, seconds, paced))
        process.start()
        child.close()
        status, value = await trio.to_thread.run_sync(parent.recv)
        process.join()
        stop.set()
        elapsed = trio.current_time() - started
        nursery.cancel_scope.cancel()
    if status != "ok":
        raise RuntimeError(value)
    return value["latencies"], value["kinds"], applied[0], elapsed, value["sizes"]


def run(result: FigureResult, *, quick: bool) -> None:
    """Default ring (1024 events = 20 ms at 50k ev/s) and a 64k ring, which keeps every request buffered."""
    seconds = 3.0 if quick else 8.0
    result.params.update(
        clients=CLIENTS,
        apply_rate=APPLY_RATE,
        seconds=seconds,
        resident_blocks_at_start=100_000,
        backlog=BACKLOG,
        rings=list(RINGS),
    )
    ms = 1000.0
    cycle = _load_cycle(60_000)
    for ring in RINGS:
        index = build_index(100_000, ring)
        for paced in (False, True):
            mode = "paced 5/s/client" if paced else "closed loop"
            base, base_kinds, base_applied, base_elapsed, _ = trio.run(
                _clients, index, "status", seconds, paced, cycle
            )
            rec, kinds, applied, elapsed, sizes = trio.run(_clients, index, "recover", seconds, paced, cycle)
            result.extra[f"ring_{ring}_{'paced' if paced else 'closed'}"] = dict(
                recover_answer_kinds=kinds,
                status_answer_kinds=base_kinds,
                applied_rate_recover=applied / elapsed,
                applied_rate_status=base_applied / base_elapsed,
                requests_recover=len(rec),
                requests_status=len(base),
                mean_events_per_answer=sum(sizes) / len(sizes) if sizes else None,
            )
            dumps = kinds.get("tree_dump", 0)
            mean_size = sum(sizes) / len(sizes) if sizes else 0
            note = (
                f"{len(rec) / elapsed:.0f} req/s; {dumps} of {len(rec)} answers were tree dumps; "
                f"mean {mean_size:.0f} events/answer"
            )
            result.rows += [
                Row(
                    f"recover p50 (ring {ring}, {mode})",
                    percentile(rec, 50) * ms,
                    "ms",
                    "status op p50",
                    percentile(base, 50) * ms,
                    higher_is_better=False,
                    note=note,
                ),
                Row(
                    f"recover p99 (ring {ring}, {mode})",
                    percentile(rec, 99) * ms,
                    "ms",
                    "status op p99",
                    percentile(base, 99) * ms,
                    target="<= 5 ms",
                    higher_is_better=False,
                    note=note,
                ),
                Row(
                    f"applied rate (ring {ring}, {mode})",
                    applied / elapsed,
                    "events/s",
                    "during status loop",
                    base_applied / base_elapsed,
                    note="load actually achieved",
                ),
            ]
        del index
    run_serve_rings(result, quick=quick)


# --- issue #25: recovery p99 against the ring's size, through a real ``kvagent serve`` ------------------

SERVE_RINGS = (20_000, 200_000, 2_000_000)
PREFILL_EVENTS = 200_000  # applied before the clients start: the 200k ring full, the 2M ring a tenth
# (filling 2M at 10k events/s would take 200 s a run)


def serve_ring_run(publisher: Any, ring: int, seconds: float, workdir: Any, prefill: int) -> dict[str, Any]:
    """``bench.fig_serving.one_run`` with ``--ring-capacity ring``: one paced stream of 10k events/s from the
    start; once ``prefill`` events are applied, 64 lite clients ask for the last 200 events 5x/s each."""
    import tempfile

    from bench import fig_serving
    from bench.trace import EVENTS_PER_BATCH

    rate = fig_serving.INGEST_RATE
    publisher.request_subscriber_wait()
    # A state directory of its own (persistence on, as deployed; never another run's or another user's).
    state = tempfile.mkdtemp(dir=workdir)
    server = fig_serving.start_server(
        publisher.endpoint, workdir, ["--ring-capacity", str(ring), "--state-dir", state]
    )
    try:
        publisher.wait_subscribed(fig_serving.SERVER_START_TIMEOUT)
        base = fig_serving._cursor(server.ws_url)
        # One stream (the publisher numbers every paced call from seq 0: a second call would look like an
        # engine restart), long enough for the prefill, the clients' warm-up and window, and a margin.
        publisher.paced(rate, prefill / rate + seconds + fig_serving.WARMUP + 3)
        fig_serving._wait_cursor(server.ws_url, base + prefill)
        cpu_before = fig_serving._cpu_seconds(server.process.pid)
        publisher_before = fig_serving._cpu_seconds(publisher.pid or 0)
        busy_before = fig_serving._machine_busy_seconds()
        started = time.monotonic()
        tally = fig_serving._run_clients(server.ws_url, CLIENTS, seconds, True)
        elapsed = time.monotonic() - started
        server_cpu = (fig_serving._cpu_seconds(server.process.pid) - cpu_before) / elapsed
        busy = (fig_serving._machine_busy_seconds() - busy_before) / elapsed
        busy -= (fig_serving._cpu_seconds(publisher.pid or 0) - publisher_before) / elapsed
        sent, _, _ = publisher.wait_sent()
        target = base + sent * EVENTS_PER_BATCH
        cursor = fig_serving._wait_cursor(server.ws_url, target)
    finally:
        server.stop()
    tally.update(
        clients=CLIENTS,
        events_sent=sent * EVENTS_PER_BATCH,
        publish_rate=0.0,
        events_lost=max(0, target - cursor),
        server_cpu_share=server_cpu,
        other_cpu_cores=max(0.0, busy - server_cpu - tally["client_cpu_seconds"] / elapsed),
        client_cpu_share=tally["client_cpu_seconds"] / seconds,
    )
    return tally


def run_serve_rings(
    result: FigureResult, *, quick: bool, rings: tuple[int, ...] = SERVE_RINGS, repetitions: int | None = None
) -> None:
    """p99 of 64 paced recover clients against ``--ring-capacity`` (issue #25's targets)."""
    import json
    import tempfile
    from pathlib import Path

    from bench import fig_serving
    from bench.publisher import Publisher
    from bench.trace import EVENTS_PER_BATCH

    seconds = 4.0 if quick else 8.0
    repetitions = repetitions or (1 if quick else 3)
    prefill = 0 if quick else PREFILL_EVENTS
    result.params.update(
        serve_rings=list(rings),
        prefill_events=prefill,
        serve_seconds=seconds,
        serve_repetitions=repetitions,
    )
    batches = int((prefill + fig_serving.INGEST_RATE * (seconds + fig_serving.WARMUP + 4)) / EVENTS_PER_BATCH)
    p99_by_ring: dict[int, float] = {}
    with Publisher(batches) as publisher, tempfile.TemporaryDirectory() as tmp:
        runs_by_ring: dict[int, list[dict[str, Any]]] = {ring: [] for ring in rings}
        for _ in range(repetitions):  # interleaved, so drifting foreign load hits every ring alike
            for ring in rings:
                summary = fig_serving.summarize(serve_ring_run(publisher, ring, seconds, Path(tmp), prefill))
                runs_by_ring[ring].append(summary)
                print(f"   ring {ring}: {json.dumps(summary)}", flush=True)
        for ring, runs in runs_by_ring.items():
            result.extra[f"serve_ring_{ring}"] = runs
            p99s = [run["p99_ms"] for run in runs if run["p99_ms"] is not None]
            p99_by_ring[ring] = median(p99s) if p99s else float("nan")
            unanswered = max(run["hanging"] + run["closed"] + run["refused"] for run in runs)
            lost = max(run["events_lost"] for run in runs)
            note = (
                f"median of {len(runs)}; unanswered/refused {unanswered} (max), lost {lost} events; "
                f"server CPU {100 * median([run['server_cpu_share'] for run in runs]):.0f}%, "
                f"other processes {median([run['other_cpu_cores'] for run in runs]):.2f} cores"
            )
            result.rows += [
                Row(
                    f"serve recover p50 (ring {ring})",
                    median([run["p50_ms"] for run in runs]),
                    "ms",
                    higher_is_better=False,
                    samples=[run["p50_ms"] for run in runs],
                ),
                Row(
                    f"serve recover p99 (ring {ring})",
                    p99_by_ring[ring],
                    "ms",
                    higher_is_better=False,
                    target="<= 20 ms" if ring == 200_000 else "",
                    samples=p99s,
                    note=note,
                ),
            ]
    if rings[0] in p99_by_ring and rings[-1] in p99_by_ring:
        result.rows.append(
            Row(
                f"serve p99 ring {rings[-1]} / ring {rings[0]}",
                p99_by_ring[rings[-1]] / p99_by_ring[rings[0]],
                "x",
                higher_is_better=False,
                target="<= 1.2",
            )
        )


def main() -> int:
    import argparse
    import sys

    from bench.harness import run_figure, table

    parser = argparse.ArgumentParser(prog="python -m bench.fig_recover", description=__doc__)
    parser.add_argument(
        "--serve-rings", type=str, help="only the kvagent-serve ring sweep, e.g. 20000,200000"
    )
    parser.add_argument("--repetitions", type=int)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.serve_rings:
        rings = tuple(int(ring) for ring in args.serve_rings.split(","))
        result = run_figure(
            NAME + "-serve",
            TITLE,
            lambda figure: run_serve_rings(
                figure, quick=args.quick, rings=rings, repetitions=args.repetitions
            ),
        )
    else:
        result = run_figure(NAME, TITLE, lambda figure: run(figure, quick=args.quick))
    print(table([result]))
    sys.stdout.flush()
    return 1 if result.error else 0


if __name__ == "__main__":
    raise SystemExit(main())
