"""Figure 1: end-to-end ingest with zero loss, against a bare recv+unpack loop on the same stream."""

from __future__ import annotations

from typing import Any

from bench.agent_run import run_agent
from bench.baselines import bare_loop
from bench.harness import FigureResult, Row, median
from bench.publisher import Publisher

NAME = "ingest"
TITLE = "End-to-end ingest (burst, zero loss)"


def run(result: FigureResult, *, quick: bool) -> None:
    batches = 10_000 if quick else 100_000
    repetitions = 3
    with Publisher(batches) as publisher:
        stats = publisher.stats
        result.params.update(batches=batches, repetitions=repetitions)
        result.params["trace"] = {
            "batches": stats.batches, "events": stats.events, "stores": stats.stores, "removes": stats.removes,
            "stored_blocks": stats.stored_blocks, "removed_blocks": stats.removed_blocks,
            "payload_bytes": stats.payload_bytes,
        }
        bare: list[float] = []
        hashed: list[float] = []
        minimal: list[float] = []
        agent_runs: list[dict[str, Any]] = []
        for _ in range(repetitions):
            # Interleaved so that drifting machine load hits both sides alike.
            bare.append(bare_loop(publisher)["events_per_s"])
            hashed.append(bare_loop(publisher, hash_blocks=True)["events_per_s"])
            minimal.append(bare_loop(publisher, minimal=True)["events_per_s"])
            agent_runs.append(run_agent(publisher, timeout=600 if not quick else 120))
    rates = [run["applied"] / run["seconds"] for run in agent_runs]
    lost = max(run["lost_events"] + run["dropped_events"] + run["listener"].get("lost_batches", 0) * 8
               for run in agent_runs)
    blocks_per_event = stats.blocks / stats.events
    agent_rate, bare_rate, hashed_rate = median(rates), median(bare), median(hashed)
    minimal_rate = median(minimal)
    result.extra["agent_runs"] = agent_runs
    result.rows += [
        Row("ingest events/s", agent_rate, "events/s", "bare recv+unpackb", bare_rate,
            target=">= 225k events/s and >= 40% of bare", samples=rates, baseline_samples=bare),
        Row("ingest blocks/s", agent_rate * blocks_per_event, "blocks/s", "bare recv+unpackb",
            bare_rate * blocks_per_event, samples=[r * blocks_per_event for r in rates]),
        Row("ingest vs bare decode+xxh3", agent_rate, "events/s", "bare decode + xxh3 per block", hashed_rate,
            samples=rates, baseline_samples=hashed),
        Row("vs minimal consumer", agent_rate, "events/s",
            "msgspec decode + xxh3 + dict state, no objects", minimal_rate, samples=rates,
            baseline_samples=minimal, note="the pure-Python floor; see docs/performance.md"),
        Row("minimal consumer alone", minimal_rate, "events/s", "bare recv+unpackb", bare_rate,
            samples=minimal, baseline_samples=bare),
        Row("events lost", float(lost), "events", target="0", higher_is_better=False,
            note="max over repetitions"),
    ]
