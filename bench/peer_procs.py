"""The two consumers of the side-by-side figure, each in a process of its own, and how to read them.

* :class:`ServeConsumer`: a real ``kvagent serve`` (one slot attached to the publisher, its HTTP surface on a
  free port); progress is the slot's ``outbound_cursor`` (``/v1/slots/bench/status``; every raw event of the
  trace becomes exactly one outbound event, see bench/trace.py).
* :class:`DynamoConsumer`: Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from ai-dynamo-runtime,
  in a venv of its own, see bench/dynamo_env.py) with the publisher registered as worker 7 through
  ``--workers``; progress is the sum of its ``dynamo_kvrouter_kv_cache_events_applied`` counter over every
  outcome (one per raw event it processed, ``ok`` or not).

Both are read from outside only: CPU time from ``/proc/PID/task/*/schedstat`` (nanoseconds, every thread),
RSS from ``/proc/PID/statm``, progress over HTTP with a kept-alive connection.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from bench.serve_process import start_serve
from bench.trace import BLOCKS_PER_STORE

WORKER_ID = 7
SLOT = "bench"
START_TIMEOUT = 90.0  # the first start of Dynamo's 200 MB extension module on a loaded machine
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
DYNAMO_APPLIED = "dynamo_kvrouter_kv_cache_events_applied"


def free_port() -> int:
    """A port free on 127.0.0.1 now (for programs that cannot report the port they bound)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of ``pid`` (ns resolution), or utime+stime ticks when schedstat is absent."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as schedstat:
                    total += int(schedstat.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended meanwhile
        return total / 1e9
    except FileNotFoundError:
        pass
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_SIZE


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has spent so far (all cores), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


class ForeignLoad:
    """How many cores OTHER processes took while a run measured (the machine is shared: say so per run).

    Started and read around the measured span; ``ours`` are the pids of the run (consumer, publisher, this
    bench process), whose CPU is subtracted from the machine's.
    """

    def __init__(self, *ours: int | None) -> None:
        self.ours = [pid for pid in ours if pid]
        self._busy, self._ours, self._wall = machine_busy_seconds(), self._our_cpu(), time.perf_counter()

    def _our_cpu(self) -> float:
        total = 0.0
        for pid in self.ours:
            try:
                total += cpu_seconds(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
        return total

    def cores(self) -> float:
        wall = time.perf_counter() - self._wall
        other = machine_busy_seconds() - self._busy - (self._our_cpu() - self._ours)
        return max(0.0, other / max(wall, 1e-9))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → ``{"name{labels}": value}`` (comments skipped)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match:
            values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return values


def metric_sum(values: dict[str, float], name: str) -> float:
    return sum(value for key, value in values.items() if key == name or key.startswith(name + "{"))


class HttpProbe:
    """GETs on one kept-alive connection to 127.0.0.1:port (reconnecting when the server closed it)."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.port = port
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def get(self, path: str) -> tuple[int, bytes]:
        for attempt in range(2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self._conn.request("GET", path)
                answer = self._conn.getresponse()
                body = answer.read()
                if answer.getheader("connection", "").lower() == "close":
                    self.close()
                return answer.status, body
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Consumer(Protocol):
    name: str
    process: subprocess.Popen[bytes]

    def applied(self) -> int: ...

    def details(self) -> dict[str, object]: ...

    def resident_blocks(self) -> int: ...

    def stop(self) -> None: ...


def _wait_until(ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path) -> None:
    """Poll ``ready`` (a real observable of the child) until true; fail with the child's log if it died."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{_tail(log)}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.05)  # polling another process's start-up
    process.kill()
    raise RuntimeError(f"{what} did not become ready in {START_TIMEOUT:.0f} s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ServeConsumer:
    """``kvagent serve --slot bench=ENDPOINT`` in memory (``--state-dir none``), the way the figure runs it.

    ``KVAGENT_BENCH_SERVE_ARGS`` adds arguments (e.g. ``--state-dir /tmp/x`` to include persistence);
    ``KVAGENT_BENCH_SERVER_SCRIPT`` runs a script in place of ``-m kvagent.cli.main`` (a profiler wrapper).

    ``native=False`` runs it with ``KVAGENT_NO_NATIVE=1`` (the pure-Python ingest path, issue #25's "before").
    ``default=True`` runs the command as installed (issue #25's target): ``python -m kvagent.cli.main``, not
    the never-shedding bench entry, with persistence on (a state directory of its own), the default ingest
    budget and no replay socket; a shed then shows as loss.
    """

    name = "kvagent"

    def __init__(self, endpoint: str, workdir: Path, *, native: bool = True, default: bool = False) -> None:
        self.port = free_port()
        self.log = workdir / "serve.log"
        script = os.environ.get("KVAGENT_BENCH_SERVER_SCRIPT")
        extra = os.environ.get("KVAGENT_BENCH_SERVE_ARGS", "").split()
        if default:
            state_dir = Path(tempfile.mkdtemp(prefix="state-", dir=workdir))
            entry = ["-m", "kvagent.cli.main"]
        else:
            state_dir = None
            entry = [script] if script else ["-m", "bench.serve_entry"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not native:
            env["KVAGENT_NO_NATIVE"] = "1"
        command = [
            sys.executable,
            *entry,
            "serve",
            "--slot",
            f"{SLOT}={endpoint}",
            "--worker-id",
            str(WORKER_ID),
            "--block-size",
            "16",
            "--listen",
            "127.0.0.1:0",
            "--http",
            f"127.0.0.1:{self.port}",
            "--discovery",
            "memory",
            "--state-dir",
            "none" if state_dir is None else str(state_dir),
            "--token-file",
            str(workdir / "token"),
            "--status-interval",
            "3600",
            *extra,
        ]
        # Up at its own "serving" line, its output drained to serve.log (bench/serve_process.py).
        self.serve = start_serve(command[len(entry) + 2 :], workdir, entry=entry, env=env)
        self.process = self.serve.process
        self.http = HttpProbe(self.port)

    def status(self) -> dict[str, object]:
        code, body = self.http.get(f"/v1/slots/{SLOT}/status")
        if code != 200:
            raise RuntimeError(f"/v1/slots/{SLOT}/status answered {code}: {body[:200]!r}")
        value: dict[str, object] = json.loads(body)
        return value

    def applied(self) -> int:
        cursor = self.status()["outbound_cursor"]
        assert isinstance(cursor, int)
        return cursor

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.http.get("/metrics")[1].decode())

    def details(self) -> dict[str, object]:
        """The loss-related and size counters of the slot (from /metrics) and its state."""
        values = self.metrics()
        wanted = ("shed", "lost", "dropped", "loss", "quarantine", "resident_blocks", "gap")
        picked = {
            key: value
            for key, value in values.items()
            if key.startswith("kvagent_") and any(word in key for word in wanted)
        }
        return {"state": self.status().get("attachment"), "metrics": picked}

    def resident_blocks(self) -> int:
        return int(metric_sum(self.metrics(), "kvagent_resident_blocks"))

    def stop(self) -> None:
        self.http.close()
        self.serve.stop()


class DynamoConsumer:
    """``python -m dynamo.indexer --threads N --workers 7=ENDPOINT`` of the python that has Dynamo installed."""

    name = "dynamo"

    def __init__(self, python: str, endpoint: str, workdir: Path, *, threads: int = 1) -> None:
        self.port = free_port()
        self.log = workdir / "dynamo.log"
        command = [
            python,
            "-m",
            "dynamo.indexer",
            "--port",
            str(self.port),
            "--threads",
            str(threads),
            "--block-size",
            "16",
            "--workers",
            f"{WORKER_ID}={endpoint}",
        ]
        env = {**os.environ, "NO_COLOR": "1", "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # its own venv only: kvagent's worktree must not shadow anything there
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir
            )
        self.http = HttpProbe(self.port)
        _wait_until(lambda: self.http.get("/health")[0] == 200, self.process, "dynamo.indexer", self.log)

    def counters(self) -> dict[str, float]:
        values = parse_metrics(self.http.get("/metrics")[1].decode())
        return {key: value for key, value in values.items() if key.startswith(DYNAMO_APPLIED)}

    def applied(self) -> int:
        return int(metric_sum(self.counters(), DYNAMO_APPLIED))

    def resident_blocks(self) -> int:
        """Blocks its applied stores added: exact for a stores-only trace of fresh hashes (the memory phase)."""
        stored = self.counters().get(f'{DYNAMO_APPLIED}{{event_type="stored",status="ok"}}', 0.0)
        return int(stored) * BLOCKS_PER_STORE

    def details(self) -> dict[str, object]:
        """Its applied counter by event type and outcome (only the non-zero ones)."""
        return {key.removeprefix(DYNAMO_APPLIED): value for key, value in self.counters().items() if value}

    def stop(self) -> None:
        self.http.close()
        _stop(self.process)
