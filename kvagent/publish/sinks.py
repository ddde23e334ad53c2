"""Outbound sinks: where the coordinator publishes each chunk's RouterEvents (one call per chunk)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import trio

from kvagent.model.errors import SinkError
from kvagent.model.events import RouterEvent

__all__ = ["EventSink", "FanoutSink", "NullSink", "RecordingSink", "SinkError"]


@runtime_checkable
class EventSink(Protocol):
    """Receives one batch per coordinator publication; must not block; raises on failure."""

    def publish(self, events: Sequence[RouterEvent]) -> None: ...


class NullSink:
    def publish(self, events: Sequence[RouterEvent]) -> None:
        return None


class FanoutSink:
    """Publishes to every sink; every sink is tried, and the first failure is raised afterwards."""

    def __init__(self, sinks: Sequence[EventSink]) -> None:
        self.sinks = list(sinks)

    def publish(self, events: Sequence[RouterEvent]) -> None:
        first_error: Exception | None = None
        for sink in self.sinks:
            try:
                sink.publish(events)
            except Exception as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise SinkError(str(first_error)) from first_error


class RecordingSink:
    """Test sink: counts every call (failed ones too) and records the events of successful ones."""

    def __init__(self) -> None:
        self.calls = 0
        self.events: list[RouterEvent] = []
        self.fail = False
        self._changed = trio.Event()

    def publish(self, events: Sequence[RouterEvent]) -> None:
        self.calls += 1
        self._changed.set()
        self._changed = trio.Event()
        if self.fail:
            raise SinkError("injected publication failure")
        self.events.extend(events)

    async def wait_for_calls(self, count: int) -> None:
        while self.calls < count:
            await self._changed.wait()
