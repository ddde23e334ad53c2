"""Rows and the curve plot of the side-by-side figure (bench/fig_peer.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.dynamo_env import DynamoPython
from bench.harness import FigureResult, Row, median

JUDGED_RATES = ("2000", "10000")
# kvagent's counters that mean an event did not make it (bench/peer_procs.py ServeConsumer.details).
LOSS_COUNTERS = frozenset(
    {
        "kvagent_ingest_sheds_total",
        "kvagent_dropped_events_total",
        "kvagent_source_losses_total",
        "kvagent_lost_batches_total",
        "kvagent_gaps_total",
    }
)

Runs = list[dict[str, Any]]


def _median(runs: Runs, key: str) -> float | None:
    return median([run[key] for run in runs]) if runs else None


def kvagent_loss(runs: Runs) -> tuple[int, float]:
    """(events missing at the end, sum of loss counters) over kvagent runs: both must be 0."""
    missing = max((run["lost_events"] for run in runs), default=0)
    counters = 0.0
    for run in runs:
        metrics = run["details"].get("metrics", {})
        counters += sum(value for key, value in metrics.items() if key.split("{", 1)[0] in LOSS_COUNTERS)
    return int(missing), counters


def _every_kvagent_run(
    burst: dict[str, Runs], fills: dict[str, Any], paced: dict[str, dict[str, Runs]]
) -> Runs:
    runs = list(burst["kvagent"]) + list(burst.get("kvagent-python", [])) + [fills["kvagent"]]
    runs += [fills["kvagent-default"]] if "kvagent-default" in fills else []
    for rate_runs in paced["kvagent"].values():
        runs += rate_runs
    return runs


def foreign_note(*runs: Runs) -> str:
    """What other processes took meanwhile (median per consumer): a figure taken under load says so."""
    parts = [
        f"{name} {median([run['foreign_cores'] for run in group]):.2f}"
        for name, group in zip(("kvagent", "Dynamo"), runs, strict=False)
        if group
    ]
    return "other processes took cores: " + ", ".join(parts)


def _joined(*notes: str) -> str:
    return "; ".join(note for note in notes if note)


def _burst_rows(burst: dict[str, Runs], note: str) -> list[Row]:
    kvagent, bare, dynamo = burst["kvagent"], burst["bare"], burst.get("dynamo", [])
    note = _joined(note, foreign_note(kvagent, dynamo))
    rate = [run["events_per_s"] for run in kvagent]
    bare_rate = [run["events_per_s"] for run in bare]
    dynamo_rate = [run["events_per_s"] for run in dynamo]
    cpu = [run["cpu_us_per_event"] for run in kvagent]
    dynamo_cpu = [run["cpu_us_per_event"] for run in dynamo]
    rows = [
        Row(
            "burst events/s",
            _median(kvagent, "events_per_s"),
            "events/s",
            "Dynamo indexer --threads 1",
            _median(dynamo, "events_per_s"),
            target=">= 1.0x Dynamo (issue #25)",
            samples=rate,
            baseline_samples=dynamo_rate,
            note=note,
        ),
        Row(
            "burst CPU per event",
            _median(kvagent, "cpu_us_per_event"),
            "µs/event",
            "Dynamo indexer",
            _median(dynamo, "cpu_us_per_event"),
            higher_is_better=False,
            samples=cpu,
            baseline_samples=dynamo_cpu,
            note=note,
        ),
        Row(
            "burst events/s vs bare",
            _median(kvagent, "events_per_s"),
            "events/s",
            "bare recv+unpackb",
            _median(bare, "events_per_s"),
            samples=rate,
            baseline_samples=bare_rate,
        ),
    ]
    rows += _extra_burst_rows(burst, note)
    if dynamo:
        rows.append(
            Row(
                "Dynamo burst events/s vs bare",
                _median(dynamo, "events_per_s"),
                "events/s",
                "bare recv+unpackb",
                _median(bare, "events_per_s"),
                samples=dynamo_rate,
                baseline_samples=bare_rate,
                note="the kvagent column is Dynamo's figure here",
            )
        )
    return rows


def _extra_burst_rows(burst: dict[str, Runs], note: str) -> list[Row]:
    """Issue #25: the pure-Python path in the same run, and kvagent serve exactly as installed."""
    kvagent, dynamo = burst["kvagent"], burst.get("dynamo", [])
    python, default = burst.get("kvagent-python", []), burst.get("kvagent-default", [])
    rows: list[Row] = []
    if python:
        rows += [
            Row(
                "burst events/s, native vs pure Python",
                _median(kvagent, "events_per_s"),
                "events/s",
                "KVAGENT_NO_NATIVE=1",
                _median(python, "events_per_s"),
                samples=[run["events_per_s"] for run in kvagent],
                baseline_samples=[run["events_per_s"] for run in python],
                note="the same serve, the compiled core on and off",
            ),
            Row(
                "burst CPU per event, native vs pure Python",
                _median(kvagent, "cpu_us_per_event"),
                "µs/event",
                "KVAGENT_NO_NATIVE=1",
                _median(python, "cpu_us_per_event"),
                higher_is_better=False,
                samples=[run["cpu_us_per_event"] for run in kvagent],
                baseline_samples=[run["cpu_us_per_event"] for run in python],
            ),
        ]
    if default:
        lost = max(run["lost_events"] for run in default)
        rows += [
            Row(
                "burst events/s, default serve",
                _median(default, "events_per_s"),
                "events/s",
                "Dynamo indexer --threads 1",
                _median(dynamo, "events_per_s"),
                target=">= 1.5x Dynamo, zero loss (issue #34)",
                samples=[run["events_per_s"] for run in default],
                baseline_samples=[run["events_per_s"] for run in dynamo],
                note=_joined(
                    note,
                    "persistence on, default ingest budget, no replay socket (python -m kvagent.cli.main)",
                    f"events lost (max over runs): {lost}",
                ),
            ),
            Row(
                "burst CPU per event, default serve",
                _median(default, "cpu_us_per_event"),
                "µs/event",
                "Dynamo indexer",
                _median(dynamo, "cpu_us_per_event"),
                higher_is_better=False,
                target="<= 0.7x Dynamo (issue #34)",
                samples=[run["cpu_us_per_event"] for run in default],
                baseline_samples=[run["cpu_us_per_event"] for run in dynamo],
            ),
        ]
    return rows


def _paced_rows(paced: dict[str, dict[str, Runs]], note: str) -> list[Row]:
    rows = []
    for rate, runs in paced["kvagent"].items():
        dynamo = paced.get("dynamo", {}).get(rate, [])
        judged = rate in JUDGED_RATES
        rows.append(
            Row(
                f"CPU @{int(rate) // 1000}k ev/s",
                _median(runs, "cpu_percent"),
                "% core",
                "Dynamo indexer",
                _median(dynamo, "cpu_percent"),
                target="<= 1.0x Dynamo (issues #25, #34)" if judged else "",
                higher_is_better=False,
                samples=[run["cpu_percent"] for run in runs],
                baseline_samples=[run["cpu_percent"] for run in dynamo],
                note=_joined(
                    f"applied {_median(runs, 'events_per_s') or 0:.0f} events/s",
                    note,
                    foreign_note(runs, dynamo),
                ),
            )
        )
    return rows


def _prefix_closed_rows(closed: dict[str, Runs], note: str) -> list[Row]:
    kvagent, dynamo = closed["kvagent"], closed.get("dynamo", [])
    note = _joined(
        "trace variant: removes take leaves, distinct tokens (Dynamo applies every event)",
        note,
        foreign_note(kvagent, dynamo),
    )
    return [
        Row(
            "burst events/s, prefix-closed trace",
            _median(kvagent, "events_per_s"),
            "events/s",
            "Dynamo indexer --threads 1",
            _median(dynamo, "events_per_s"),
            samples=[run["events_per_s"] for run in kvagent],
            baseline_samples=[run["events_per_s"] for run in dynamo],
            note=note,
        ),
        Row(
            "burst CPU per event, prefix-closed trace",
            _median(kvagent, "cpu_us_per_event"),
            "µs/event",
            "Dynamo indexer",
            _median(dynamo, "cpu_us_per_event"),
            higher_is_better=False,
            samples=[run["cpu_us_per_event"] for run in kvagent],
            baseline_samples=[run["cpu_us_per_event"] for run in dynamo],
        ),
    ]


def add_rows(
    result: FigureResult,
    burst: dict[str, Runs],
    closed: dict[str, Runs],
    fills: dict[str, Any],
    paced: dict[str, dict[str, Runs]],
    dynamo: DynamoPython,
) -> None:
    note = "" if dynamo.python else f"no Dynamo: {dynamo.note}"
    kvagent_fill, dynamo_fill = fills["kvagent"], fills.get("dynamo")
    missing, counters = kvagent_loss(_every_kvagent_run(burst, fills, paced) + closed["kvagent"])
    result.rows += _burst_rows(burst, note)
    result.rows += _prefix_closed_rows(closed, note)
    result.rows.append(
        Row(
            "RSS / resident block",
            kvagent_fill["bytes_per_block"],
            "B",
            "Dynamo indexer",
            None if dynamo_fill is None else dynamo_fill["bytes_per_block"],
            target="<= 200 B at 1M blocks (issue #25)",
            higher_is_better=False,
            note=f"{kvagent_fill['resident_blocks']} blocks resident; RSS delta of the process over a stores-only burst",
        )
    )
    default_fill = fills.get("kvagent-default")
    if default_fill is not None:
        result.rows.append(
            Row(
                "RSS / resident block, default serve",
                default_fill["bytes_per_block"],
                "B",
                "Dynamo indexer",
                None if dynamo_fill is None else dynamo_fill["bytes_per_block"],
                target="<= 200 B (issue #34: persistence on, default budget)",
                higher_is_better=False,
                note=f"{default_fill['resident_blocks']} blocks resident; kvagent serve as installed",
            )
        )
    result.rows += _paced_rows(paced, note)
    result.rows.append(
        Row(
            "kvagent events lost",
            float(missing),
            "events",
            target="0",
            higher_is_better=False,
            note=f"max over every kvagent run; shed/drop/loss/gap counters summed: {counters:.0f}",
        )
    )


def print_breakdown(stages: dict[str, Any], burst: dict[str, Runs]) -> None:
    """The per-stage breakdown (bench/stages.py) beside serve's measured burst CPU per event."""
    from bench.stages import format_breakdown

    serve = _median(burst.get("kvagent-default", []), "cpu_us_per_event")
    print(format_breakdown(stages, serve), flush=True)
    if serve is not None:
        print("   (serve, measured: the default kvagent serve burst, median CPU per event)", flush=True)


def _curve(runs_by_rate: dict[str, Runs], burst: Runs, key: str) -> list[float | None]:
    points = [_median(runs, key) for runs in runs_by_rate.values()]
    return [*points, _median(burst, key)]


def plot_curves(
    result: FigureResult, burst: dict[str, Runs], paced: dict[str, dict[str, Runs]], path: Path
) -> None:
    """Applied rate and CPU against offered load (the paced rates, then the burst) for every consumer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(paced["kvagent"])
    labels = [f"{int(rate) // 1000}k" for rate in rates] + ["burst"]
    fig, (rate_ax, cpu_ax) = plt.subplots(1, 2, figsize=(11, 4.4))
    styles = {"kvagent": ("#2b6cb0", "o"), "dynamo": ("#c05621", "s"), "bare": ("#718096", "^")}
    for name, runs_by_rate in paced.items():
        color, marker = styles[name]
        shown = "Dynamo indexer (--threads 1)" if name == "dynamo" else "kvagent serve"
        rate_ax.plot(
            labels, _curve(runs_by_rate, burst[name], "events_per_s"), marker=marker, color=color, label=shown
        )
        cpu_ax.plot(
            labels, _curve(runs_by_rate, burst[name], "cpu_percent"), marker=marker, color=color, label=shown
        )
    rate_ax.plot(
        labels,
        [None] * len(rates) + [_median(burst["bare"], "events_per_s")],
        marker="^",
        color=styles["bare"][0],
        linestyle="none",
        label="bare recv+unpackb",
    )
    rate_ax.plot(
        labels[:-1], [float(rate) for rate in rates], linestyle=":", color="#a0aec0", label="offered"
    )
    rate_ax.set_yscale("log")
    rate_ax.set_ylabel("events/s applied")
    cpu_ax.set_ylabel("CPU, % of one core")
    for ax in (rate_ax, cpu_ax):
        ax.set_xlabel("offered load (events/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    trace = result.params.get("trace", {})
    foreign = [run["foreign_cores"] for runs in paced.values() for group in runs.values() for run in group]
    foreign += [run["foreign_cores"] for name in paced for run in burst[name]]
    fig.suptitle(
        f"{result.title}\n{trace.get('events', '?')} events a burst; median of "
        f"{result.params.get('repetitions', '?')}; shared 2-core machine, other processes took "
        f"{median(foreign) if foreign else 0:.2f} cores (median over runs)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
