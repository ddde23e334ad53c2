"""Issue #27: a fleet's slots writing their events into one redis-server, one reader rebuilding them all.

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
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import redis
import trio

from bench.fleet_sim import SimulatedSlot, canonical_state
from bench.harness import FigureResult, Row
from kvagent._util.redis_target import StreamTarget
from kvagent.stream.reader import StreamFollower
from kvagent.stream.writer import StreamConfig

NAME = "fleet"
TITLE = "Fleet: slots' events into one redis-server, one reader rebuilding all"
STEP = 1000  # events a slot applies per turn (in coordinator-sized chunks of 128)


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


async def _rebuild(url: str, prefix: str) -> tuple[float, StreamFollower]:
    follower = StreamFollower(StreamTarget(url), prefix=prefix)
    started = time.perf_counter()
    await follower.catch_up()
    seconds = time.perf_counter() - started
    await follower.aclose()
    return seconds, follower


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _used_memory(client: redis.Redis) -> int:
    info: Any = client.info("memory")
    return int(info["used_memory"])


def run(result: FigureResult, *, quick: bool) -> None:
    binary = os.environ.get("KVAGENT_REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no redis-server: apt-get install redis-server (or set KVAGENT_REDIS_SERVER)")
    slots, processes = (8, 2) if quick else (16, 4)
    total = 200_000 if quick else 1_000_000
    per_slot = total // slots
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with tempfile.TemporaryDirectory(prefix="kvagent-fleet-") as tmp:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        server = subprocess.Popen(
            [*command, "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            client = redis.Redis(port=port)
            deadline = time.monotonic() + 20
            while True:  # an external process's startup: polling is the only option
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
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
                workdir=str(Path(tmp)),
            )
        finally:
            server.terminate()
            server.wait(timeout=10)


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
    seconds, follower = trio.run(_rebuild, url, prefix)
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
