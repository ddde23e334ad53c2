"""The #19 metrics: latency histograms (ingest apply per drain, recovery requests by op) and build info.

Rendered through ``render_metrics`` and read back with prometheus_client's own parser, so the exposition
is what a Prometheus server would scrape.
"""

from __future__ import annotations

import platform
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import kvagent
from kvagent._util.latency import DEFAULT_BUCKETS, LatencyHistogram
from kvagent.agent.metrics import MetricSources, render_metrics
from kvagent.recovery.client import connect_slot
from kvagent.recovery.server import ServerStats
from tests.support.agent import (
    TIMEOUT,
    XpubEngine,
    attach,
    batch,
    gpu_store,
    is_store_of,
    running_agent,
    wait_for_event,
)
from tests.support.recovery import TOKEN, FakeSlot, start_server


def samples(sources: MetricSources, family_name: str) -> list[Sample]:
    text = render_metrics(sources).decode()
    return [
        sample
        for family in text_string_to_metric_families(text)
        if family.name == family_name
        for sample in family.samples
    ]


def histogram(found: list[Sample], **labels: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative (le, count) buckets, _count, _sum) of the series with ``labels``."""
    mine = [s for s in found if all(s.labels.get(k) == v for k, v in labels.items())]
    buckets = sorted((float(s.labels["le"]), s.value) for s in mine if s.name.endswith("_bucket"))
    (count,) = [s.value for s in mine if s.name.endswith("_count")]
    (total,) = [s.value for s in mine if s.name.endswith("_sum")]
    return buckets, count, total


def test_build_info_is_one_with_the_versions() -> None:
    (info,) = samples(MetricSources(slots=lambda: []), "kvagent_build_info")
    assert info.value == 1.0
    assert info.labels == {"version": kvagent.__version__, "python": platform.python_version()}


async def test_ingest_apply_latency_counts_the_drains_of_a_slot() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_agent() as (agent, _discovery, _sink, context):
            sources = MetricSources(slots=lambda: [agent])
            family = "kvagent_ingest_apply_latency_seconds"
            _, before, _ = histogram(samples(sources, family), slot="s0")
            engine = XpubEngine(context)
            await attach(agent, engine)
            for block in range(1, 6):
                await engine.send_payload(batch([gpu_store([block])]))
            await wait_for_event(agent, is_store_of(5))
            buckets, count, total = histogram(samples(sources, family), slot="s0")
            assert before == 0 and count >= 1, "at least one drain applied the five batches"
            assert count <= agent.statistics().coordinator.ingress_chunks + 1
            assert buckets[-1] == (float("inf"), count)
            assert [c for _, c in buckets] == sorted(c for _, c in buckets), "cumulative"
            assert total > 0
            engine.close()


async def test_recovery_request_latency_is_a_histogram_by_op(nursery: trio.Nursery) -> None:
    stats = ServerStats()
    url = await start_server(nursery, FakeSlot("a"), stats=stats)
    with trio.fail_after(TIMEOUT):
        async with connect_slot(url, "a", token=TOKEN) as client:
            await client.status()
            await client.status()
            await client.recover()
    found = samples(
        MetricSources(slots=lambda: [], server=stats.statistics), "kvagent_recovery_request_latency_seconds"
    )
    _, status_count, status_sum = histogram(found, op="status")
    _, recover_count, _ = histogram(found, op="recover")
    assert (status_count, recover_count) == (2, 1)
    assert 0 < status_sum <= stats.request_seconds_sum
    assert {s.labels["op"] for s in found} == {"status", "recover"}


def test_an_observation_on_a_bound_falls_in_that_bucket() -> None:
    latency = LatencyHistogram((0.1, 1.0))
    for seconds in (0.1, 0.5, 1.0, 2.0):
        latency.observe(seconds)
    snapshot = latency.snapshot()
    assert snapshot.counts == (1, 2, 1)
    assert snapshot.cumulative() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert snapshot.sum == pytest.approx(3.6)
    with pytest.raises(ValueError, match="increasing"):
        LatencyHistogram((1.0, 0.5))


@given(st.lists(st.floats(min_value=0.0, max_value=100.0, allow_nan=False), max_size=200))
def test_cumulative_buckets_match_a_counting_model(observations: list[float]) -> None:
    latency = LatencyHistogram()
    for seconds in observations:
        latency.observe(seconds)
    snapshot = latency.snapshot()
    expected: list[tuple[str, Any]] = [
        (repr(bound), sum(1 for seconds in observations if seconds <= bound)) for bound in DEFAULT_BUCKETS
    ]
    expected.append(("+Inf", len(observations)))
    assert snapshot.cumulative() == expected
    assert snapshot.sum == pytest.approx(sum(observations))
