"""Issue #27: a fleet's slots writing their events into one redis-server, one reader rebuilding them all.

``python -m bench fleet --slots 1000`` (issue #36): the same slots on a private 3-master Redis Cluster (no
replicas, no persistence), 8 processes, each slot paced at 50 events/s as a steady engine publishes: the write
lag (publish to written, p50/p99), Redis memory per slot and per event kept, the agent's CPU per slot (with and
without the stream), and one cold reader rebuilding every slot from the cluster (time, and exactness against
each slot's own state).  The rest of this docstring is the single-server figure.

``python -m bench fleet``: a private ``redis-server`` (no persistence) on a free loopback port; N simulated
slots (bench/fleet_sim.py: a real RecoveryIndex and StreamWriter each, fed with random outbound events) in
P worker processes, all writing at once; then one cold StreamFollower rebuilding every slot from the
snapshots and streams, checked block for block against each slot's own state.  Reported: the fleet's
events/s into Redis (and the same workers without a stream, as the baseline), the reader's catch-up time
for all the events, and Redis's memory per resident block and per event kept.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import redis
import redis.cluster
import trio

from bench.fleet_sim import SimulatedSlot, canonical_state, run_paced, timed_catch_up
from bench.harness import FigureResult, Row
from bench.redis_procs import redis_server, redis_server_binary, start_cluster
from kvagent._util.redis_target import StreamTarget
from kvagent.stream.writer import StreamConfig

NAME = "fleet"
TITLE = "Fleet: slots' events into one redis-server, one reader rebuilding all"
STEP = 1000  # events a slot applies per turn (in coordinator-sized chunks of 128)

slots_choice: int | None = None  # ``--slots N``: the cluster figure with N slots (bench/__main__.py sets it)
CLUSTER_MASTERS = 3
CLUSTER_PROCESSES = 8
SLOT_RATE = 50.0  # events/s per slot
STEADY_SECONDS = 20.0  # the paced window with the stream (the one without it: BASELINE_SECONDS)
BASELINE_SECONDS = 8.0


def _digest(state: frozenset[tuple[object, ...]]) -> str:
    return hashlib.sha256(repr(sorted(map(repr, state))).encode()).hexdigest()


async def _run_slots(url: str | None, prefix: str, numbers: list[int], events: int) -> dict[str, Any]:
    config = None if url is None else StreamConfig(StreamTarget(url), prefix=prefix)
    slots = [SimulatedSlot.create(n, config, ring=1 << 14) for n in numbers]
    started = time.time()
    async with trio.open_nursery() as nursery:
        for slot in slots:
            if slot.writer is not None:
                await nursery.start(slot.writer.run)
            slot.set_ready(1, ready=True)
        done = 0
        while done < events:
            for slot in slots:
                slot.step(STEP)
            done += STEP
            await trio.lowlevel.checkpoint()  # the writers run between turns, as beside a coordinator
        for slot in slots:
            if slot.writer is not None:
                await slot.flushed()
        finished = time.time()
        nursery.cancel_scope.cancel()
    return {
        "started": started,
        "finished": finished,
        "events": events * len(slots),
        "blocks": {slot.name: slot.index.resident_block_count for slot in slots},
        "digests": {slot.name: _digest(canonical_state(slot.index)) for slot in slots},
        "resets": sum(0 if s.writer is None else s.writer.statistics().resets for s in slots),
        "refused": sum(0 if s.writer is None else s.writer.statistics().refused for s in slots),
    }


def worker(url: str | None, prefix: str, numbers: list[int], events: int) -> dict[str, Any]:
    """One worker process: its slots, ``events`` each (``url`` None: no stream, the baseline)."""
    return trio.run(_run_slots, url, prefix, numbers, events)


def _fleet(url: str | None, prefix: str, slots: int, processes: int, events: int) -> list[dict[str, Any]]:
    shares = [list(range(p, slots, processes)) for p in range(processes)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        futures = [pool.submit(worker, url, prefix, share, events) for share in shares]
        return [future.result() for future in futures]


def _used_memory(client: redis.Redis) -> int:
    info: Any = client.info("memory")
    return int(info["used_memory"])


def run(result: FigureResult, *, quick: bool) -> None:
    if slots_choice is not None:
        run_cluster(result, slots=slots_choice, quick=quick)
        return
    slots, processes = (8, 2) if quick else (16, 4)
    total = 200_000 if quick else 1_000_000
    per_slot = total // slots
    with redis_server("kvagent-fleet-") as (url, client, workdir):
        baseline_memory = _used_memory(client)
        version: Any = client.info("server")
        _measure(result, url, client, slots, processes, per_slot, baseline_memory)
        result.params.update(
            slots=slots,
            processes=processes,
            events=per_slot * slots,
            redis=version.get("redis_version"),
            cpus=os.cpu_count(),
            note="shared machine (2 cores, several engineers): figures are indicative",
            workdir=str(workdir),
        )


def _measure(
    result: FigureResult,
    url: str,
    client: redis.Redis,
    slots: int,
    processes: int,
    per_slot: int,
    baseline_memory: int,
) -> None:
    plain = _fleet(None, "unused", slots, processes, per_slot)
    prefix = f"fleet-{uuid.uuid4().hex[:8]}"
    streamed = _fleet(url, prefix, slots, processes, per_slot)

    def rate(runs: list[dict[str, Any]]) -> float:
        wall = float(max(r["finished"] for r in runs) - min(r["started"] for r in runs))
        return float(sum(r["events"] for r in runs)) / wall

    events = sum(r["events"] for r in streamed)
    blocks = {name: count for r in streamed for name, count in r["blocks"].items()}
    digests = {name: digest for r in streamed for name, digest in r["digests"].items()}
    used = _used_memory(client) - baseline_memory
    seconds, follower = trio.run(timed_catch_up, StreamTarget(url), prefix)
    rebuilt = {name: _digest(canonical_state(r.index)) for name, r in follower.replicas.items()}
    if rebuilt != digests:
        raise AssertionError("the reader's state differs from a slot's own")
    stream_bytes = sum(int(client.memory_usage(r.keys.events) or 0) for r in follower.replicas.values())
    snapshot_bytes = sum(int(client.memory_usage(r.keys.snapshot) or 0) for r in follower.replicas.values())
    resident = sum(blocks.values())
    result.rows += [
        Row(
            "fleet events into Redis",
            rate(streamed),
            "events/s",
            "same workers, no stream",
            rate(plain),
            note=f"{slots} slots in {processes} processes",
        ),
        Row(
            "reader catch-up, every slot, cold", seconds, "s", higher_is_better=False, note=f"{events} events"
        ),
        Row("reader catch-up rate", events / seconds, "events/s"),
        Row("Redis memory per resident block", used / max(1, resident), "bytes", higher_is_better=False),
        Row("Redis memory per event kept", stream_bytes / events, "bytes", higher_is_better=False),
    ]
    result.extra.update(
        resident_blocks=resident,
        redis_used_memory=used,
        stream_bytes=stream_bytes,
        snapshot_bytes=snapshot_bytes,
        resets=sum(r["resets"] for r in streamed),
        refused=sum(r["refused"] for r in streamed),
        reader=follower.statistics().__repr__(),
    )


# --- the cluster figure (--slots N) ----------------------------------------------------------------------


async def _paced_slots(
    target: StreamTarget | None, prefix: str, numbers: list[int], seconds: float
) -> dict[str, Any]:
    config = None if target is None else StreamConfig(target, prefix=prefix)
    slots = [SimulatedSlot.create(n, config) for n in numbers]
    paced = await run_paced(slots, rate=SLOT_RATE, seconds=seconds)
    writers = [s.writer.statistics() for s in slots if s.writer is not None]
    return {
        **paced,
        "digests": {slot.name: _digest(canonical_state(slot.index)) for slot in slots},
        "blocks": sum(slot.index.resident_block_count for slot in slots),
        "failures": sum(w.failures for w in writers),
        "resets": sum(w.resets for w in writers),
        "entries": sum(w.entries for w in writers),
    }


def paced_worker(url: str | None, prefix: str, numbers: list[int], seconds: float) -> dict[str, Any]:
    """One worker process of the cluster figure (``url`` None: no stream, the CPU baseline)."""
    target = None if url is None else StreamTarget(url, cluster=True)
    return trio.run(_paced_slots, target, prefix, numbers, seconds)


def _paced_fleet(url: str | None, prefix: str, slots: int, seconds: float) -> list[dict[str, Any]]:
    shares = [list(range(p, slots, CLUSTER_PROCESSES)) for p in range(CLUSTER_PROCESSES)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(CLUSTER_PROCESSES, mp_context=context) as pool:
        futures = [pool.submit(paced_worker, url, prefix, share, seconds) for share in shares]
        return [future.result() for future in futures]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _cluster_memory(ports: list[int]) -> int:
    return sum(_used_memory(redis.Redis(port=port)) for port in ports)


def run_cluster(result: FigureResult, *, slots: int, quick: bool) -> None:
    binary = redis_server_binary()
    steady = 5.0 if quick else STEADY_SECONDS
    with tempfile.TemporaryDirectory(prefix="kvagent-fleet-cluster-") as tmp:
        ports, processes = start_cluster(binary, Path(tmp), CLUSTER_MASTERS)
        try:
            url = f"redis://127.0.0.1:{ports[0]}"
            baseline_memory = _cluster_memory(ports)
            plain = _paced_fleet(None, "unused", slots, 2.0 if quick else BASELINE_SECONDS)
            prefix = f"fleet-{uuid.uuid4().hex[:8]}"
            streamed = _paced_fleet(url, prefix, slots, steady)
            used = _cluster_memory(ports) - baseline_memory
            _report_cluster(result, url, prefix, slots, plain, streamed, used)
            version: Any = redis.Redis(port=ports[0]).info("server")
            result.params.update(
                slots=slots,
                processes=CLUSTER_PROCESSES,
                masters=CLUSTER_MASTERS,
                rate_per_slot=SLOT_RATE,
                steady_seconds=steady,
                redis=version.get("redis_version"),
                cpus=os.cpu_count(),
                note="shared 2-core machine, other engineers' load: figures are indicative",
            )
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=10)


def _report_cluster(
    result: FigureResult,
    url: str,
    prefix: str,
    slots: int,
    plain: list[dict[str, Any]],
    streamed: list[dict[str, Any]],
    used: int,
) -> None:
    lags = [lag for r in streamed for lag in r["lags"]]
    events = sum(r["events"] for r in streamed)
    digests = {name: digest for r in streamed for name, digest in r["digests"].items()}
    seconds, follower = trio.run(timed_catch_up, StreamTarget(url, cluster=True, socket_timeout=30), prefix)
    rebuilt = {name: _digest(canonical_state(r.index)) for name, r in follower.replicas.items()}
    exact = sum(1 for name, digest in digests.items() if rebuilt.get(name) == digest)
    client = redis.cluster.RedisCluster.from_url(url)
    try:
        stream_bytes = sum(int(client.memory_usage(r.keys.events) or 0) for r in follower.replicas.values())
        snapshot_bytes = sum(
            int(client.memory_usage(r.keys.snapshot) or 0) for r in follower.replicas.values()
        )
    finally:
        client.close()

    def cpu_us_per_event(runs: list[dict[str, Any]]) -> float:
        return 1e6 * sum(float(r["cpu"]) for r in runs) / max(1, sum(int(r["events"]) for r in runs))

    def cpu_ms_per_slot_second(runs: list[dict[str, Any]]) -> float:
        return 1000 * sum(float(r["cpu"]) / float(r["wall"]) for r in runs) / slots

    wall = max(float(r["wall"]) for r in streamed)
    result.rows += [
        Row("events paced into the cluster", events / wall, "events/s", "asked",
            SLOT_RATE * slots, note=f"{len(streamed)} processes"),
        Row("write lag p50 (publish to written)", _percentile(lags, 0.5) * 1000, "ms", higher_is_better=False,
            note=f"{slots} slots x {SLOT_RATE:.0f} ev/s, sampled every 20 ms"),
        Row("write lag p99", _percentile(lags, 0.99) * 1000, "ms", higher_is_better=False),
        Row("agent CPU per slot", cpu_ms_per_slot_second(streamed), "ms/s", "same slots, no stream",
            cpu_ms_per_slot_second(plain), higher_is_better=False),
        Row("agent CPU per event", cpu_us_per_event(streamed), "us", "same slots, no stream",
            cpu_us_per_event(plain), higher_is_better=False, note="simulated engine and index included"),
        Row("Redis memory per slot", used / slots, "bytes", higher_is_better=False),
        Row("Redis memory per event kept", stream_bytes / max(1, events), "bytes", higher_is_better=False),
        Row("cold replica rebuild, every slot", seconds, "s", higher_is_better=False,
            note=f"{events} events, {exact}/{slots} slots exact"),
    ]  # fmt: skip
    result.extra.update(
        events=events,
        exact_slots=exact,
        redis_used_memory=used,
        stream_bytes=stream_bytes,
        snapshot_bytes=snapshot_bytes,
        writer_failures=sum(r["failures"] for r in streamed),
        writer_resets=sum(r["resets"] for r in streamed),
        entries=sum(r["entries"] for r in streamed),
        reader=repr(follower.statistics()),
    )
    if exact != slots:
        raise AssertionError(f"the cold reader rebuilt {exact} of {slots} slots exactly")


