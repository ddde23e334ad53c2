"""Outbound sinks: where the coordinator publishes each chunk's RouterEvents (one call per chunk)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvagent.model.errors import SinkError
from kvagent.model.events import RouterEvent

__all__ = ["EventSink", "NullSink", "SinkError"]


@runtime_checkable
class EventSink(Protocol):
    """Receives one batch per coordinator publication; must not block; raises on failure."""

    def publish(self, events: Sequence[RouterEvent]) -> None: ...


class NullSink:
    """Publishes nowhere: a slot without an event plane still runs its coordinator and index."""

    def publish(self, events: Sequence[RouterEvent]) -> None:
        return None
