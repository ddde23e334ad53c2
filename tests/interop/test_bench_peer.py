"""The bench's Dynamo consumer (bench/peer_procs.py) against the real indexer: it sees a whole burst."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.peer_procs import DynamoConsumer
from bench.publisher import Publisher
from bench.trace import BLOCKS_PER_STORE

BOUND = 120.0


def _wait(consumer: DynamoConsumer, target: int) -> int:
    """Poll the indexer's applied counter (a real observable of another process) within BOUND seconds."""
    deadline = time.monotonic() + BOUND
    applied = consumer.applied()
    while applied < target and time.monotonic() < deadline:
        time.sleep(0.05)
        applied = consumer.applied()
    return applied


@contextmanager
def burst_applied(
    dynamo: str, tmp_path: Path, batches: int, **trace: Any
) -> Iterator[tuple[Publisher, DynamoConsumer]]:
    """A fresh indexer that has applied one whole burst of the trace (checked), for the test to inspect."""
    with Publisher(batches, **trace) as publisher:
        publisher.request_subscriber_wait()
        consumer = DynamoConsumer(dynamo, publisher.endpoint, tmp_path)
        try:
            publisher.wait_subscribed(BOUND)
            assert consumer.applied() == 0
            publisher.burst()
            publisher.wait_sent()
            assert _wait(consumer, publisher.stats.events) == publisher.stats.events
            yield publisher, consumer
        finally:
            consumer.stop()


def test_dynamo_consumer_counts_every_event_of_a_burst(dynamo: str, tmp_path: Path) -> None:
    with burst_applied(dynamo, tmp_path, 300) as (publisher, consumer):
        outcomes = consumer.details()
        assert sum(outcomes.values()) == publisher.stats.events  # type: ignore[arg-type]


def test_dynamo_resident_blocks_on_a_stores_only_burst(dynamo: str, tmp_path: Path) -> None:
    # 2,000 batches: enough roots that random token windows would repeat (a repeated prefix is one node to
    # Dynamo's content-keyed tree, and the stores under the other copy's hashes would be refused).
    with burst_applied(dynamo, tmp_path, 2_000, removes=False) as (publisher, consumer):
        # Every parent is resident in a stores-only trace, so every store is applied "ok".
        assert consumer.resident_blocks() == publisher.stats.events * BLOCKS_PER_STORE


def test_dynamo_applies_every_event_of_the_prefix_closed_trace(dynamo: str, tmp_path: Path) -> None:
    with burst_applied(dynamo, tmp_path, 2_000, prefix_closed=True) as (publisher, consumer):
        stats = publisher.stats
        assert consumer.details() == {
            '{event_type="stored",status="ok"}': stats.stores,
            '{event_type="removed",status="ok"}': stats.removes,
        }
