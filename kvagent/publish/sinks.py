"""Outbound sinks: where the coordinator publishes each chunk's RouterEvents (one call per chunk)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvagent.model.errors import SinkError
from kvagent.model.events import RouterEvent

__all__ = ["EventSink", "FanoutSink", "NullSink", "SinkError"]


@runtime_checkable
class EventSink(Protocol):
    """Receives one batch per coordinator publication; must not block; raises on failure."""

    def publish(self, events: Sequence[RouterEvent]) -> None: ...


class NullSink:
    """Publishes nowhere: a slot without an event plane still runs its coordinator and index."""

    def publish(self, events: Sequence[RouterEvent]) -> None:
        return None


class FanoutSink:
    """Publishes each batch to every sink in order; one failing sink does not starve the others.

    The first failure is raised once every sink has had the batch (the coordinator counts it; a failed
    reset barrier retires its domain), so the event plane and a republisher never diverge silently.
    """

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    def publish(self, events: Sequence[RouterEvent]) -> None:
        failure: Exception | None = None
        for sink in self.sinks:
            try:
                sink.publish(events)
            except Exception as exc:
                if failure is None:
                    failure = exc
        if failure is not None:
            raise failure
