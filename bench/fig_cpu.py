"""Figure 5: CPU cost (% of one core) at a steady 10k events/s through the full pipeline."""

from __future__ import annotations

from bench.agent_run import run_agent
from bench.baselines import bare_loop
from bench.harness import FigureResult, Row, median
from bench.publisher import Publisher

NAME = "cpu"
TITLE = "CPU at 10k events/s (% of one core)"
RATE = 10_000.0
WARMUP = 1.0


def run(result: FigureResult, *, quick: bool) -> None:
    window = 5.0 if quick else 10.0
    repetitions = 1 if quick else 2
    seconds = WARMUP + window + 0.5
    batches = int(RATE / 8 * seconds) + 16
    result.params.update(rate_events_per_s=RATE, window_s=window, repetitions=repetitions)
    agent: list[float] = []
    bare: list[float] = []
    with Publisher(batches) as publisher:
        for _ in range(repetitions):
            bare.append(bare_loop(publisher, paced=(RATE, seconds), cpu_window=(WARMUP, window))["cpu_percent"])
            run = run_agent(publisher, paced=(RATE, seconds), cpu_window=(WARMUP, window), timeout=60)
            result.extra.setdefault("agent_runs", []).append(run)
            agent.append(run["cpu_percent"])
    result.rows.append(
        Row("agent CPU @10k ev/s", median(agent), "% core", "bare recv+unpackb @10k ev/s", median(bare),
            target="<= 10% of a core", higher_is_better=False, samples=agent, baseline_samples=bare)
    )
