"""Issue #17: end-to-end ingest with the slot's state persisted (SQLite) against the same ingest in memory.

Both sides run in the same process on the same trace, interleaved (the machine is shared and noisy), median
of 3. The persisted side also reports the CPU it spent, how long the writer trailed the stream, and the disk
bytes per resident block: live (database + WAL while serving) and after the clean stop (database alone,
the WAL checkpointed into it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.agent_run import run_agent
from bench.harness import FigureResult, Row, median
from bench.publisher import Publisher

NAME = "persistence"
TITLE = "Ingest with and without persistence (same run)"


def _file_bytes(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return sum(p.stat().st_size for p in (path, wal) if p.exists())


def run(result: FigureResult, *, quick: bool) -> None:
    batches = 10_000 if quick else 100_000
    repetitions = 3
    timeout = 120 if quick else 600
    memory: list[dict[str, Any]] = []
    persisted: list[dict[str, Any]] = []
    with Publisher(batches) as publisher, tempfile.TemporaryDirectory(prefix="kvagent-bench-") as tmp:
        result.params.update(batches=batches, repetitions=repetitions, events=publisher.stats.events)
        for repetition in range(repetitions):
            memory.append(run_agent(publisher, timeout=timeout))
            path = Path(tmp) / f"run{repetition}" / "bench.sqlite3"
            path.parent.mkdir()
            run = run_agent(publisher, timeout=timeout, state_path=path)
            run["closed_disk_bytes"] = _file_bytes(path)
            persisted.append(run)
    result.extra.update(memory_runs=memory, persisted_runs=persisted)
    off = [run["applied"] / run["seconds"] for run in memory]
    on = [run["applied"] / run["seconds"] for run in persisted]
    cpu_off = [1e6 * run["cpu_seconds"] / run["applied"] for run in memory]
    cpu_on = [1e6 * run["cpu_seconds"] / run["applied"] for run in persisted]
    live = [run["persistence"]["disk_bytes"] / max(1, run["resident_blocks"]) for run in persisted]
    closed = [run["closed_disk_bytes"] / max(1, run["resident_blocks"]) for run in persisted]
    trailing = [run["persisted_seconds"] - run["seconds"] for run in persisted]
    result.rows += [
        Row(
            "ingest, persistence on",
            median(on),
            "events/s",
            "persistence off",
            median(off),
            target=">= 0.85 (at most 15% lower)",
            samples=on,
            baseline_samples=off,
        ),
        Row(
            "CPU per 1M events, on",
            median(cpu_on),
            "CPU s",
            "persistence off",
            median(cpu_off),
            higher_is_better=False,
            samples=cpu_on,
            baseline_samples=cpu_off,
            note="process CPU, writer thread included",
        ),
        Row(
            "disk per resident block (live)",
            median(live),
            "bytes",
            higher_is_better=False,
            samples=live,
            note="database + WAL at the end of the burst",
        ),
        Row(
            "disk per resident block (stopped)",
            median(closed),
            "bytes",
            higher_is_better=False,
            samples=closed,
            note="database after the clean stop",
        ),
        Row(
            "writer trails the burst by",
            median(trailing),
            "s",
            higher_is_better=False,
            samples=trailing,
            note="last event applied -> on disk",
        ),
    ]
