"""The side-by-side figure (issue #18): ``kvagent serve`` and Dynamo's standalone indexer on the SAME stream.

One publisher process (bench/publisher.py) holds the pre-encoded trace; each consumer is a process of its
own, started afresh for every run and subscribed to that publisher; the runs of one repetition are
interleaved (bare loop, Dynamo, kvagent) so drifting machine load hits every side alike. Phases:

* **burst**: the whole trace as fast as the consumer takes it. events/s from the burst's start to the moment
  the consumer's progress counter reached the trace's event count (polled over HTTP, at intervals of ~1% of
  the elapsed time); CPU µs/event from the consumer's CPU time over the same span (all threads). The bare
  loop is ``recv_multipart`` + ``msgpack.unpackb`` in the bench process. Median of the repetitions.
* **burst, prefix-closed trace**: the same on a variant whose removes take leaves only and whose blocks all
  have distinct tokens, so Dynamo's prefix-closed, content-keyed tree applies every event (on the issue #8
  trace it refuses the stores under removed parents, and so does less work than kvagent).
* **memory**: a stores-only trace of N blocks (every block stays resident in both consumers); RSS after it
  minus RSS before it, per resident block.
* **paced**: 2k and 10k events/s (and, in the full run, higher rates for the curve): CPU % of one core over
  a window after a warm-up, and the rate each consumer applied in that window.

Zero loss is checked for kvagent in every run (its final cursor against the events sent, and its shed /
drop / loss counters). Without a Dynamo python (bench/dynamo_env.py) the figure says why and runs kvagent
alone. kvagent runs with ``--state-dir none`` (Dynamo keeps no state on disk either).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.baselines import bare_loop
from bench.dynamo_env import DynamoPython, find_dynamo
from bench.harness import RESULTS_DIR, FigureResult
from bench.peer_procs import Consumer, DynamoConsumer, ForeignLoad, ServeConsumer, cpu_seconds, rss_bytes
from bench.publisher import Publisher
from bench.trace import BLOCKS_PER_STORE, EVENTS_PER_BATCH

NAME = "peer"
TITLE = "kvagent serve vs Dynamo's standalone indexer, same stream, separate processes"
WARMUP = 1.0
WAIT_LIMIT = 600.0  # for a burst or a paced backlog to be applied
STALL_LIMIT = 20.0  # seconds without progress: the rest is lost
BURST = "burst"

# Set by ``python -m bench --peer dynamo|none``: "dynamo" installs Dynamo's venv if needed, "none" runs
# kvagent alone; None (no --peer) uses a Dynamo venv that is already there and installs nothing.
peer_choice: str | None = None


def _plan(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "batches": 10_000,
            "repetitions": 1,
            "fill_blocks": 200_000,
            "window": 4.0,
            "rates": [2_000.0, 10_000.0],
            "paced_repetitions": 1,
        }
    return {
        "batches": 50_000,
        "repetitions": 3,
        "fill_blocks": 1_000_000,
        "window": 10.0,
        "rates": [2_000.0, 10_000.0, 25_000.0, 50_000.0],
        "paced_repetitions": 3,
    }


def _dynamo() -> DynamoPython:
    if peer_choice == "none":
        return DynamoPython(None, "the Dynamo peer was turned off (--peer none)")
    return find_dynamo(install=peer_choice == "dynamo")


ConsumerFactory = Callable[[str, Path], Consumer]


def _factories(dynamo: DynamoPython) -> dict[str, ConsumerFactory]:
    factories: dict[str, ConsumerFactory] = {}
    if dynamo.python is not None:
        python = dynamo.python
        factories["dynamo"] = lambda endpoint, workdir: DynamoConsumer(python, endpoint, workdir)
    factories["kvagent"] = ServeConsumer
    return factories


# Burst-only consumers (issue #25): kvagent without its native core (KVAGENT_NO_NATIVE=1, the "before" in
# the same run), and kvagent serve exactly as installed (persistence on, default budget, no replay socket).
EXTRA_BURST: dict[str, ConsumerFactory] = {
    "kvagent-python": lambda endpoint, workdir: ServeConsumer(endpoint, workdir, native=False),
    "kvagent-default": lambda endpoint, workdir: ServeConsumer(endpoint, workdir, default=True),
}


def _started(publisher: Publisher, factory: ConsumerFactory, workdir: Path) -> tuple[Consumer, int]:
    """A fresh consumer subscribed to the publisher, and its progress counter before anything was sent."""
    publisher.request_subscriber_wait()
    consumer = factory(publisher.endpoint, workdir)
    try:
        publisher.wait_subscribed(120)
        return consumer, consumer.applied()
    except BaseException:
        consumer.stop()
        raise


def _wait_applied(consumer: Consumer, target: int, started: float) -> tuple[int, float]:
    """Poll until ``target`` is reached; (last progress, time it was seen). Intervals ~1% of the elapsed time,
    so the end is known to about 1% while the polling costs the consumer next to nothing. Gives up after
    STALL_LIMIT without progress (a consumer that lost events never reaches the target) or WAIT_LIMIT."""
    last, last_change = -1, started
    while True:
        applied, now = consumer.applied(), time.perf_counter()
        if applied != last:
            last, last_change = applied, now
        if applied >= target or now - last_change > STALL_LIMIT or now - started > WAIT_LIMIT:
            return applied, now
        time.sleep(min(0.05, max(0.005, 0.01 * (now - started))))  # polling another process's progress


def _loss(consumer: Consumer, target: int, applied: int) -> dict[str, Any]:
    details = consumer.details()
    return {"lost_events": max(0, target - applied), "details": details}


def _burst_run(publisher: Publisher, factory: ConsumerFactory, workdir: Path) -> dict[str, Any]:
    consumer, base = _started(publisher, factory, workdir)
    try:
        pid = consumer.process.pid
        events = publisher.stats.events
        load = ForeignLoad(pid, publisher.pid, os.getpid())
        cpu0, started = cpu_seconds(pid), time.perf_counter()
        publisher.burst()
        applied, finished = _wait_applied(consumer, base + events, started)
        cpu1, foreign = cpu_seconds(pid), load.cores()
        publisher.wait_sent()
        seconds = finished - started
        return {
            "events": events,
            "applied": applied - base,
            "seconds": seconds,
            "events_per_s": (applied - base) / seconds,
            "cpu_us_per_event": 1e6 * (cpu1 - cpu0) / max(1, applied - base),
            "cpu_percent": 100 * (cpu1 - cpu0) / seconds,
            "foreign_cores": foreign,
            **_loss(consumer, base + events, applied),
        }
    finally:
        consumer.stop()
        # A kvagent that shed (the default serve) subscribed again: not a sign of the next consumer.
        publisher.forget_subscriptions()


def _fill_run(publisher: Publisher, factory: ConsumerFactory, workdir: Path) -> dict[str, Any]:
    """RSS growth over a stores-only burst, per block the trace leaves resident."""
    consumer, base = _started(publisher, factory, workdir)
    try:
        pid = consumer.process.pid
        rss_before = rss_bytes(pid)
        events, blocks = publisher.stats.events, publisher.stats.stored_blocks
        started = time.perf_counter()
        publisher.burst()
        applied, _ = _wait_applied(consumer, base + events, started)
        publisher.wait_sent()
        time.sleep(0.5)  # a settling window for allocator caches before RSS is read, not synchronization
        rss_after = rss_bytes(pid)
        resident = consumer.resident_blocks()
        return {
            "blocks": blocks,
            "resident_blocks": resident,
            "rss_before": rss_before,
            "rss_after": rss_after,
            "bytes_per_block": (rss_after - rss_before) / max(1, resident),
            **_loss(consumer, base + events, applied),
        }
    finally:
        consumer.stop()


def _paced_run(
    publisher: Publisher, factory: ConsumerFactory, workdir: Path, rate: float, window: float
) -> dict[str, Any]:
    consumer, base = _started(publisher, factory, workdir)
    try:
        pid = consumer.process.pid
        started = time.perf_counter()
        publisher.paced(rate, WARMUP + window + 0.5)
        time.sleep(WARMUP)  # a measuring window, not synchronization
        load = ForeignLoad(pid, publisher.pid, os.getpid())
        cpu0, wall0, applied0 = cpu_seconds(pid), time.perf_counter(), consumer.applied()
        time.sleep(window)
        cpu1, wall1, applied1 = cpu_seconds(pid), time.perf_counter(), consumer.applied()
        foreign = load.cores()
        sent, _, _ = publisher.wait_sent()
        target = base + sent * EVENTS_PER_BATCH
        applied, _ = _wait_applied(consumer, target, started)
        return {
            "rate": rate,
            "sent_events": sent * EVENTS_PER_BATCH,
            "cpu_percent": 100 * (cpu1 - cpu0) / (wall1 - wall0),
            "events_per_s": (applied1 - applied0) / (wall1 - wall0),
            "foreign_cores": foreign,
            **_loss(consumer, target, applied),
        }
    finally:
        consumer.stop()


def _burst_phase(
    result: FigureResult,
    factories: dict[str, ConsumerFactory],
    plan: dict[str, Any],
    workdir: Path,
    *,
    prefix_closed: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Burst runs on the issue #8 trace, or (``prefix_closed``) on its variant every Dynamo event applies to."""
    runs: dict[str, list[dict[str, Any]]] = {"bare": [], **{name: [] for name in factories}}
    label = "burst, prefix-closed trace" if prefix_closed else "burst"
    with Publisher(plan["batches"], prefix_closed=prefix_closed) as publisher:
        stats = publisher.stats
        result.params["prefix_closed_trace" if prefix_closed else "trace"] = {
            "batches": stats.batches,
            "events": stats.events,
            "stores": stats.stores,
            "removes": stats.removes,
            "stored_blocks": stats.stored_blocks,
            "payload_bytes": stats.payload_bytes,
        }
        for repetition in range(plan["repetitions"]):
            runs["bare"].append(bare_loop(publisher))
            for name, factory in factories.items():
                runs[name].append(_burst_run(publisher, factory, workdir))
                _progress(f"{label} {repetition + 1}/{plan['repetitions']} {name}", runs[name][-1])
    return runs


def _fill_phase(factories: dict[str, ConsumerFactory], plan: dict[str, Any], workdir: Path) -> dict[str, Any]:
    batches = plan["fill_blocks"] // (BLOCKS_PER_STORE * EVENTS_PER_BATCH)
    fills: dict[str, Any] = {}
    with Publisher(batches, removes=False) as publisher:
        for name, factory in factories.items():
            fills[name] = _fill_run(publisher, factory, workdir)
            _progress(f"memory {name}", fills[name])
    return fills


def _paced_phase(
    factories: dict[str, ConsumerFactory], plan: dict[str, Any], workdir: Path
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    window = plan["window"]
    batches = int(max(plan["rates"]) / EVENTS_PER_BATCH * (WARMUP + window + 0.5)) + 16
    paced: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in factories}
    with Publisher(batches) as publisher:
        for rate in plan["rates"]:
            # The judged rates get the repetitions; the others are points of the curve.
            repetitions = plan["paced_repetitions"] if rate in (2_000.0, 10_000.0) else 1
            for _ in range(repetitions):
                for name, factory in factories.items():
                    run = _paced_run(publisher, factory, workdir, rate, window)
                    paced[name].setdefault(str(int(rate)), []).append(run)
                    _progress(f"paced {int(rate)} {name}", run)
    return paced


def _progress(label: str, run: dict[str, Any]) -> None:
    shown = {
        key: round(value, 2) if isinstance(value, float) else value
        for key, value in run.items()
        if key
        in (
            "events_per_s",
            "cpu_us_per_event",
            "cpu_percent",
            "lost_events",
            "bytes_per_block",
            "foreign_cores",
        )
    }
    print(f"   {label}: {shown}", flush=True)


def run(result: FigureResult, *, quick: bool) -> None:
    plan = _plan(quick)
    dynamo = _dynamo()
    factories = _factories(dynamo)
    result.params.update(plan, peer=dynamo.note, dynamo_threads=1, kvagent="kvagent serve --state-dir none")
    print(f"   peer: {dynamo.note}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvagent-peer-") as tmp:
        workdir = Path(tmp)
        burst = _burst_phase(result, {**factories, **EXTRA_BURST}, plan, workdir)
        closed = _burst_phase(result, factories, plan, workdir, prefix_closed=True)
        # RSS per block also through the default serve (persistence on): issue #34's memory target.
        fills = _fill_phase({**factories, "kvagent-default": EXTRA_BURST["kvagent-default"]}, plan, workdir)
        paced = _paced_phase(factories, plan, workdir)
    from bench.stages import breakdown

    # The per-stage breakdown (issue #34): each stage alone, in process, on the same trace shape.
    stages = breakdown(min(plan["batches"], 20_000))
    result.extra.update(burst=burst, burst_prefix_closed=closed, memory=fills, paced=paced, stages=stages)
    from bench.peer_report import add_rows, plot_curves, print_breakdown

    add_rows(result, burst, closed, fills, paced, dynamo)
    print_breakdown(stages, burst)
    plot_curves(result, burst, paced, RESULTS_DIR / f"{NAME}-curves.png")
