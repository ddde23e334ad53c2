"""Shared harness: figure results, medians of repetitions, JSON + PNG output and the summary table.

Every figure reports a measured value next to a baseline measured in the same run (the machine is shared
and noisy, so absolute numbers alone say little); the ratio is what the targets are judged against.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@attrs.define
class Row:
    """One measured quantity: the value, its unit, the baseline it is compared with, and the target."""

    label: str
    value: float | None
    unit: str
    baseline_label: str = ""
    baseline: float | None = None
    target: str = ""
    higher_is_better: bool = True
    samples: list[float] = attrs.Factory(list)
    baseline_samples: list[float] = attrs.Factory(list)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.baseline:
            return None
        return self.value / self.baseline


@attrs.define
class FigureResult:
    name: str
    title: str
    rows: list[Row] = attrs.Factory(list)
    params: dict[str, Any] = attrs.Factory(dict)
    extra: dict[str, Any] = attrs.Factory(dict)
    error: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "params": self.params,
            "error": self.error,
            "seconds": round(self.seconds, 3),
            "rows": [
                {**attrs.asdict(row), "ratio": row.ratio} for row in self.rows
            ],
            "extra": self.extra,
        }


def median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm (pages × page size)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_SIZE


def run_figure(name: str, title: str, body: Callable[[FigureResult], None]) -> FigureResult:
    """Run one figure; any failure is recorded as ``error: ...`` instead of ending the whole run."""
    result = FigureResult(name, title)
    started = time.perf_counter()
    try:
        body(result)
    except BaseException as exc:  # noqa: BLE001  # fail soft: KeyboardInterrupt is re-raised below
        if isinstance(exc, KeyboardInterrupt):
            raise
        result.error = f"{type(exc).__name__}: {exc}"
        result.extra["traceback"] = traceback.format_exc()
    result.seconds = time.perf_counter() - started
    write_result(result)
    return result


def write_result(result: FigureResult) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{result.name}.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    try:
        plot(result)
    except Exception as exc:  # a plotting problem must not hide the numbers
        result.extra["plot_error"] = f"{type(exc).__name__}: {exc}"


def plot(result: FigureResult) -> None:
    """A bar pair per row: the measured value and its same-run baseline (log scale when they differ a lot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in result.rows if row.value is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 4.2))
    if result.error or not rows:
        ax.text(0.5, 0.5, result.error or "no data", ha="center", va="center", wrap=True)
        ax.set_axis_off()
    else:
        positions = range(len(rows))
        width = 0.38
        values = [row.value or 0.0 for row in rows]
        baselines = [row.baseline or 0.0 for row in rows]
        ax.bar([p - width / 2 for p in positions], values, width, label="kvagent", color="#2b6cb0")
        ax.bar([p + width / 2 for p in positions], baselines, width, label="baseline", color="#a0aec0")
        ax.set_xticks(list(positions))
        ax.set_xticklabels([f"{row.label}\n({row.unit})" for row in rows], fontsize=8)
        positive = [v for v in values + baselines if v > 0]
        if positive and max(positive) / min(positive) > 50:
            ax.set_yscale("log")
        for p, row in zip(positions, rows, strict=True):
            if row.ratio is not None:
                ax.annotate(f"×{row.ratio:.2f}", (p, max(row.value or 0, row.baseline or 0)),
                            ha="center", va="bottom", fontsize=8)
        ax.legend(fontsize=8)
    ax.set_title(result.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"{result.name}.png", dpi=110)
    plt.close(fig)


def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    magnitude = abs(value)
    if value == int(value) and magnitude < 1e4:
        return str(int(value))
    if magnitude >= 1e6:
        return f"{value / 1e6:.2f}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.1f}k"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.4f}"


def table(results: Sequence[FigureResult]) -> str:
    """A Markdown table of every row of every figure (pasted into docs/performance.md)."""
    lines = [
        "| figure | measure | kvagent | baseline | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        if result.error:
            lines.append(f"| {result.name} | — | error: {result.error} | | | |")
            continue
        for row in result.rows:
            ratio = "—" if row.ratio is None else f"{row.ratio:.2f}"
            baseline = f"{fmt(row.baseline)} ({row.baseline_label})" if row.baseline_label else fmt(row.baseline)
            value = f"{fmt(row.value)} {row.unit}" + (f" [{row.note}]" if row.note else "")
            lines.append(f"| {result.name} | {row.label} | {value} | {baseline} | {ratio} | {row.target} |")
    return "\n".join(lines)
