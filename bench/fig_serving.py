"""Figure 6: recovery under load: 1, 16, 64 and 256 clients while the agent ingests 10k events/s.

Three kinds of process, so no side borrows another's interpreter:

* the publisher (bench/publisher.py): a fake vLLM engine pacing the pre-encoded trace at 10k events/s;
* the server: a real ``kvagent serve`` attached to it (listener, coordinator, index, websocket server);
* the clients (bench/serving_clients.py): N recovery clients, each asking for the last 200 events 5 times a
  second (an untimed ``status`` for the cursor, then the timed ``recover``).

Every run starts a fresh server, so repetitions are independent.  Per run the figure records the latency
of answered requests (p50 / p99 / max), how many were refused with an error frame, left hanging (no answer
and no error within 10 s) or cut by a close, the ingest loss (the server's final cursor against the events
the publisher sent: each raw event of the trace becomes exactly one outbound event), and the CPU of the
server and client processes.  The machine is a shared 2-core VM: all three processes share those cores.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import FigureResult, Row, median, percentile
from bench.publisher import Publisher
from bench.serve_process import ServeProcess, start_serve
from bench.serving_clients import client_process
from bench.trace import EVENTS_PER_BATCH

NAME = "serving"
TITLE = "Recovery under load: 1-256 clients at 5 req/s each, 10k events/s ingested (separate processes)"
CLIENT_COUNTS = (1, 16, 64, 256)
REFERENCE_COUNTS = (16, 64)
INGEST_RATE = 10_000
CLIENT_RATE = 5.0  # requests per second per client
BACKLOG = 200
CLIENTS_PER_PROCESS = 128  # 256 clients run in two client processes
WARMUP = 1.5  # handshakes and a first request per client before anything is recorded
SERVER_START_TIMEOUT = 60.0
DRAIN_TIMEOUT = 60.0


def _machine_busy_seconds() -> float:
    """CPU seconds spent by every process of the machine so far (all cores), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(endpoint: str, workdir: Path, extra: list[str], script: str | None = None) -> ServeProcess:
    """A ``kvagent serve`` process with one slot attached to the publisher, once it serves
    (bench/serve_process.py). ``script`` (a server variant) runs in place of ``-m kvagent``, as does
    ``KVAGENT_BENCH_SERVER_SCRIPT`` (a profiling or tracing wrapper) without one."""
    args = [
        "--slot", f"s0={endpoint}", "--topic", "kv-events", "--block-size", "16",
        "--listen", "127.0.0.1:0", "--discovery", "memory",
        "--token-file", str(workdir / "token"), "--status-interval", "3600",
        "--max-connections", "1024", *extra,
    ]
    entry = None if script is None else [script]
    return start_serve(args, workdir, entry=entry, timeout=SERVER_START_TIMEOUT)


def _cursor(url: str) -> int:
    import trio

    from kvagent.recovery.client import connect_slot

    async def read() -> int:
        async with connect_slot(url, "s0") as client:
            return (await client.status()).outbound_cursor

    return trio.run(read)


def _wait_cursor(url: str, target: int) -> int:
    started = time.monotonic()
    cursor = _cursor(url)
    while cursor < target and time.monotonic() - started < DRAIN_TIMEOUT:
        time.sleep(0.2)  # polling a separate process's progress
        cursor = _cursor(url)
    return cursor


def _merge(tallies: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"latencies": [], "refused_latencies": [], "kinds": {}, "refused": {}, "closed": {},
                              "hanging": 0, "connect_failures": 0, "issued": 0, "client_cpu_seconds": 0.0,
                              "stalled": 0}
    for tally in tallies:
        for key in ("latencies", "refused_latencies"):
            merged[key] += tally[key]
        for key in ("kinds", "refused", "closed"):
            for name, count in tally[key].items():
                merged[key][name] = merged[key].get(name, 0) + count
        for key in ("hanging", "connect_failures", "issued", "client_cpu_seconds", "stalled"):
            merged[key] += tally[key]
    return merged


def _run_clients(url: str, clients: int, seconds: float, lite: bool, stalled: int = 0) -> dict[str, Any]:
    """The clients, spread over processes of at most CLIENTS_PER_PROCESS each; their tallies merged."""
    ctx = multiprocessing.get_context("spawn")
    processes = []
    shares = [clients // ((clients + CLIENTS_PER_PROCESS - 1) // CLIENTS_PER_PROCESS)] * (
        (clients + CLIENTS_PER_PROCESS - 1) // CLIENTS_PER_PROCESS
    )
    shares[0] += clients - sum(shares)
    for number, share in enumerate(shares):
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=client_process,
            args=(child, url, share, CLIENT_RATE, WARMUP, seconds, BACKLOG, lite, stalled if number == 0 else 0),
        )
        process.start()
        child.close()
        processes.append((process, parent))
    tallies = []
    for process, parent in processes:
        if not parent.poll(seconds + WARMUP + 120):
            process.kill()
            raise RuntimeError("a client process did not report")
        status, value = parent.recv()
        process.join()
        if status != "ok":
            raise RuntimeError(value)
        tallies.append(value)
    return _merge(tallies)


def one_run(
    publisher: Publisher, clients: int, seconds: float, workdir: Path, lite: bool = True, *,
    stalled: int = 0, script: str | None = None, extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A fresh server, paced ingest, N clients (and ``stalled`` never-reading followers); the tally plus
    loss and CPU figures.  ``script``: a server variant run in place of ``kvagent``."""
    publisher.request_subscriber_wait()
    server = start_server(publisher.endpoint, workdir, list(extra), script)
    try:
        publisher.wait_subscribed(SERVER_START_TIMEOUT)
        base = _cursor(server.ws_url)
        publish_seconds = seconds + WARMUP + 3
        publisher.paced(INGEST_RATE, publish_seconds)
        ours_before = _cpu_seconds(server.process.pid) + _cpu_seconds(publisher.pid or 0)
        cpu_before = _cpu_seconds(server.process.pid)
        busy_before = _machine_busy_seconds()
        started = time.monotonic()
        tally = _run_clients(server.ws_url, clients, seconds, lite, stalled)
        elapsed = time.monotonic() - started
        server_cpu = (_cpu_seconds(server.process.pid) - cpu_before) / elapsed
        ours = _cpu_seconds(server.process.pid) + _cpu_seconds(publisher.pid or 0) - ours_before
        # Whatever else ran on the machine meanwhile (other users of the shared cores), in cores.
        other_cpu = (_machine_busy_seconds() - busy_before - ours - tally["client_cpu_seconds"]) / elapsed
        sent, first, last = publisher.wait_sent()
        target = base + sent * EVENTS_PER_BATCH
        cursor = _wait_cursor(server.ws_url, target)
    finally:
        server.stop()
    tally.update(
        clients=clients,
        events_sent=sent * EVENTS_PER_BATCH,
        publish_rate=sent * EVENTS_PER_BATCH / max(last - first, 1e-9),
        events_lost=max(0, target - cursor),
        server_cpu_share=server_cpu,
        other_cpu_cores=max(0.0, other_cpu),
        client_cpu_share=tally["client_cpu_seconds"] / seconds,
    )
    return tally


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    ms = 1000.0
    latencies = run["latencies"]
    refused = sum(run["refused"].values())
    closed = sum(run["closed"].values())
    return {
        "p50_ms": percentile(latencies, 50) * ms if latencies else None,
        "p99_ms": percentile(latencies, 99) * ms if latencies else None,
        "max_ms": max(latencies) * ms if latencies else None,
        "issued": run["issued"],
        "answered": len(latencies),
        "refused": refused,
        "hanging": run["hanging"],
        "closed": closed,
        "stalled": run["stalled"],
        "kinds": run["kinds"],
        "refused_by_code": run["refused"],
        "closed_by_code": run["closed"],
        "events_lost": run["events_lost"],
        "server_cpu_share": run["server_cpu_share"],
        "other_cpu_cores": run["other_cpu_cores"],
        "client_cpu_share": run["client_cpu_share"],
        "publish_rate": run["publish_rate"],
    }


def run(result: FigureResult, *, quick: bool) -> None:
    seconds = 4.0 if quick else 8.0
    repetitions = 1 if quick else 3
    # KVAGENT_BENCH_CLIENTS=64,256 narrows the sweep (for profiling one point).
    chosen = os.environ.get("KVAGENT_BENCH_CLIENTS")
    counts = tuple(int(n) for n in chosen.split(",")) if chosen else CLIENT_COUNTS
    # The lite client (bench/lite_ws.py) at every count; the reference client (trio-websocket) where its
    # own CPU still fits beside the server on the 2 shared cores.
    sweeps = [("lite", counts)] + ([] if quick or chosen else [("reference", REFERENCE_COUNTS)])
    result.params.update(
        clients=list(counts), ingest_rate=INGEST_RATE, client_rate=CLIENT_RATE, backlog=BACKLOG,
        seconds=seconds, repetitions=repetitions, warmup=WARMUP, cores=os.cpu_count(),
        clients_per_process=CLIENTS_PER_PROCESS, reference_counts=list(REFERENCE_COUNTS),
    )
    batches = int(INGEST_RATE / EVENTS_PER_BATCH * (seconds + WARMUP + 4))
    with Publisher(batches) as publisher, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for client_kind, sweep in sweeps:
            for clients in sweep:
                runs = []
                for _ in range(repetitions):
                    runs.append(summarize(one_run(publisher, clients, seconds, workdir, client_kind == "lite")))
                    print(f"   {client_kind} {clients} clients: {json.dumps(runs[-1])}", flush=True)
                result.extra[f"{client_kind}_clients_{clients}"] = runs
                _rows(result, clients, runs, client_kind)


def _rows(result: FigureResult, clients: int, runs: list[dict[str, Any]], client_kind: str) -> None:
    def med(key: str) -> float | None:
        values = [run[key] for run in runs if run[key] is not None]
        return median(values) if values else None

    unanswered = max(run["hanging"] + run["closed"] for run in runs)
    refused = max(run["refused"] for run in runs)
    target = ""
    if clients == 64 and client_kind == "lite":
        target = "p99 <= 20 ms, every request answered"
    elif clients == 256:
        target = "every request answered or refused"
    note = (f"median of {len(runs)}; issued {med('issued'):.0f}, refused {refused} (max), "
            f"hanging/closed {unanswered} (max), lost {max(run['events_lost'] for run in runs)} events; "
            f"server CPU {100 * (med('server_cpu_share') or 0):.0f}%, clients {100 * (med('client_cpu_share') or 0):.0f}%, "
            f"other processes {med('other_cpu_cores') or 0:.2f} cores")
    label = f"{clients} clients" + ("" if client_kind == "lite" else " (reference client)")
    result.rows += [
        Row(f"recover p50, {label}", med("p50_ms"), "ms", higher_is_better=False,
            samples=[run["p50_ms"] for run in runs if run["p50_ms"] is not None]),
        Row(f"recover p99, {label}", med("p99_ms"), "ms", higher_is_better=False, target=target,
            samples=[run["p99_ms"] for run in runs if run["p99_ms"] is not None], note=note),
        Row(f"recover max, {label}", med("max_ms"), "ms", higher_is_better=False,
            samples=[run["max_ms"] for run in runs if run["max_ms"] is not None]),
        Row(f"unanswered, {label}", float(unanswered), "requests", higher_is_better=False,
            target="0", note="no answer and no error frame within 10 s, or cut by a close (max of runs)"),
    ]
