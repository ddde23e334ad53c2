"""The side-by-side figure's consumers through real processes: ``kvagent serve`` fed by the bench publisher,
and the whole figure end to end at a tiny scale (kvagent alone, as on a machine without Dynamo)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench import fig_peer
from bench.harness import FigureResult
from bench.peer_procs import ServeConsumer, cpu_seconds, rss_bytes
from bench.publisher import Publisher

BOUND = 120.0


def _wait(consumer: ServeConsumer, target: int) -> int:
    """Poll the consumer's cursor (a real observable of another process) within BOUND seconds."""
    deadline = time.monotonic() + BOUND
    applied = consumer.applied()
    while applied < target and time.monotonic() < deadline:
        time.sleep(0.05)
        applied = consumer.applied()
    return applied


def test_serve_consumer_applies_a_whole_burst_without_loss(tmp_path: Path) -> None:
    with Publisher(300) as publisher:
        publisher.request_subscriber_wait()
        consumer = ServeConsumer(publisher.endpoint, tmp_path)
        try:
            publisher.wait_subscribed(BOUND)
            base = consumer.applied()
            rss_idle = rss_bytes(consumer.process.pid)
            publisher.burst()
            publisher.wait_sent()
            assert _wait(consumer, base + publisher.stats.events) == base + publisher.stats.events
            details = consumer.details()
            metrics: dict[str, float] = details["metrics"]  # type: ignore[assignment]
            assert metrics['kvagent_ingest_sheds_total{slot="bench"}'] == 0
            assert metrics['kvagent_dropped_events_total{slot="bench"}'] == 0
            # Every store's 4 blocks are fresh; the removes each took one of them away again.
            stats = publisher.stats
            assert consumer.resident_blocks() == stats.stored_blocks - stats.removed_blocks
            assert cpu_seconds(consumer.process.pid) > 0
            assert rss_bytes(consumer.process.pid) > rss_idle // 2
        finally:
            consumer.stop()
        assert consumer.process.returncode is not None


@pytest.mark.slow
def test_the_figure_runs_kvagent_alone_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib", reason="the figure draws its plot with matplotlib (the bench extra)")
    tiny: dict[str, Any] = {
        "batches": 400, "repetitions": 1, "fill_blocks": 3_200, "window": 0.5, "rates": [2_000.0],
        "paced_repetitions": 1,
    }  # fmt: skip
    monkeypatch.setattr(fig_peer, "_plan", lambda quick: tiny)
    monkeypatch.setattr(fig_peer, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(fig_peer, "peer_choice", "none")
    result = FigureResult(fig_peer.NAME, fig_peer.TITLE)
    fig_peer.run(result, quick=True)
    rows = {row.label: row for row in result.rows}
    burst = rows["burst events/s"]
    assert burst.value is not None and burst.value > 0
    assert burst.baseline is None
    assert "no Dynamo" in burst.note and "--peer none" in burst.note
    assert rows["kvagent events lost"].value == 0
    assert rows["RSS / resident block"].value is not None
    assert rows["CPU @2k ev/s"].value is not None
    assert rows["RSS / resident block, default serve"].value is not None  # issue #34: serve as installed
    stages = result.extra["stages"]["us_per_event"]  # the per-stage breakdown, every stage measured
    assert set(stages) == {"read", "native ingest", "coordinator", "index", "ring", "persistence", "sinks"}
    assert all(value > 0 for value in stages.values())
    assert (tmp_path / "peer-curves.png").stat().st_size > 0
    json.dumps(result.to_json())  # what write_result stores must be plain JSON
