"""docs/metrics.md names every metric family the process exports, and nothing it does not."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvagent.agent.metrics import HttpStatistics, MetricSources, render_metrics
from kvagent.discovery.etcd import EtcdStatistics
from kvagent.publish.zmq_plane import EventPlaneStatistics
from kvagent.recovery.protocol import ServerStatistics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def exported_names() -> set[str]:
    """Every family (empty ones too: their HELP/TYPE lines are rendered) with every source present."""
    sources = MetricSources(
        slots=lambda: [],
        server=lambda: ServerStatistics(0, 0, {}, {}, {}, 0.0),
        event_plane=lambda: EventPlaneStatistics(0, 0, 0, 0, 0),
        etcd=lambda: EtcdStatistics(),
        http=lambda: HttpStatistics(),
    )
    text = render_metrics(sources).decode()
    return {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(text)
    }


def documented_names() -> set[str]:
    return set(re.findall(r"`(kvagent_[a-z0-9_]+)", DOC.read_text()))


def test_every_exported_family_is_documented() -> None:
    missing = exported_names() - documented_names()
    assert not missing, f"docs/metrics.md does not name {sorted(missing)}"


def test_every_documented_family_is_exported() -> None:
    unknown = documented_names() - exported_names()
    assert not unknown, f"docs/metrics.md names families kvagent does not export: {sorted(unknown)}"
