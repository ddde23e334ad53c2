"""RSS per resident block through a real ``kvagent serve`` process (issue #18), default configuration.

The publisher process paces the ingest trace (bench/trace.py) into one slot of a ``kvagent serve`` subprocess
(persistence on, as by default; no republish) at a rate the agent keeps up with, so nothing is shed and the
resident state is the trace's.  The figure is the serve process's RSS after the last event is applied and
persisted minus its RSS once attached, divided by the resident blocks it reports on ``/metrics``.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness import PAGE_SIZE
from bench.publisher import Publisher
from bench.serve_process import start_serve
from bench.trace import EVENTS_PER_BATCH

_RESIDENT = re.compile(r'^kvagent_resident_blocks\{[^}]*slot="bench"[^}]*\} (\S+)$', re.MULTILINE)


def process_rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_SIZE


class _Serve:
    """A ``kvagent serve`` process with one slot attached to ``endpoint`` (bench/serve_process.py) and its
    HTTP surface."""

    def __init__(self, endpoint: str, root: Path, extra: list[str]) -> None:
        args = [
            "--slot",
            f"bench={endpoint}",
            "--worker-id",
            "7",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--discovery",
            f"file:{root / 'discovery'}",
            "--token-file",
            str(root / "token"),
            "--state-dir",
            str(root / "state"),
            "--status-interval",
            "3600",
            *extra,
        ]
        self.serve = start_serve(args, root)
        self.process = self.serve.process
        assert self.serve.http_url is not None  # --http was given: its line precedes the serving line
        self.http_url = self.serve.http_url

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.http_url + path, timeout=30) as answer:
            return bytes(answer.read())

    def status(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.get("/v1/slots/bench/status"))
        return value

    def resident_blocks(self) -> int:
        found = _RESIDENT.search(self.get("/metrics").decode())
        if found is None:
            raise RuntimeError('kvagent_resident_blocks{slot="bench"} is not on /metrics')
        return int(float(found.group(1)))

    def wait_for(self, predicate: Any, limit: float, what: str) -> dict[str, Any]:
        """Poll the slot's status (a real observable) until ``predicate`` holds, at most ``limit`` s."""
        deadline = time.monotonic() + limit
        while True:
            status = self.status()
            if predicate(status):
                return status
            attachment = status.get("status", status).get("attachment") or {}
            lost = attachment.get("state") not in (None, "ready")
            if lost or time.monotonic() > deadline or self.process.poll() is not None:
                raise TimeoutError(f"{what}: last status {status}")
            time.sleep(0.05)

    def close(self) -> None:
        self.serve.stop()


def _cursor(status: dict[str, Any]) -> int:
    return int(status.get("status", status)["outbound_cursor"])


def _persisted(status: dict[str, Any]) -> bool:
    persistence = status.get("status", status).get("persistence")
    return persistence is None or persistence.get("state") == "off" or persistence.get("lag_events") == 0


def measure_serve(batches: int, rate: float, extra: list[str] | None = None) -> dict[str, Any]:
    """One run: RSS growth of the serve process per resident block after ``batches`` paced batches."""
    with Publisher(batches) as publisher, tempfile.TemporaryDirectory() as tmp:
        publisher.request_subscriber_wait()
        serve = _Serve(publisher.endpoint, Path(tmp), extra or [])
        try:
            publisher.wait_subscribed(60)
            base = _cursor(serve.wait_for(lambda s: _cursor(s) >= 0, 30, "status"))
            rss_before = process_rss(serve.process.pid)
            seconds = batches * EVENTS_PER_BATCH / rate
            started = time.perf_counter()
            publisher.paced(rate, seconds)
            sent, _, _ = publisher.wait_sent(seconds * 4 + 120)
            target = base + sent * EVENTS_PER_BATCH
            status = serve.wait_for(lambda s: _cursor(s) >= target, 300, "ingest")
            applied_seconds = time.perf_counter() - started
            serve.wait_for(_persisted, 120, "persistence")
            rss_after = process_rss(serve.process.pid)
            blocks = serve.resident_blocks()
            return {
                "batches_sent": sent,
                "events": sent * EVENTS_PER_BATCH,
                "lost_events": max(0, target - _cursor(status)),
                "seconds": applied_seconds,
                "rss_before": rss_before,
                "rss_after": rss_after,
                "resident_blocks": blocks,
                "bytes_per_block": (rss_after - rss_before) / max(1, blocks),
            }
        finally:
            serve.close()


if __name__ == "__main__":
    print(
        json.dumps(
            measure_serve(
                int(sys.argv[1]) if len(sys.argv) > 1 else 50_000,
                float(sys.argv[2]) if len(sys.argv) > 2 else 15_000.0,
            ),
            indent=2,
        )
    )
