"""Captured structlog lines with a wait for a matching one (an event per line: no polling, no sleeps)."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog
import trio

__all__ = ["LogWatch", "watch_logs"]

Entry = MutableMapping[str, Any]


class LogWatch:
    """The captured entries (contextvars merged in, as ``kvagent serve`` renders them) and waits on them."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self._added = trio.Event()

    def notify(self, logger: object, method: str, event: Entry) -> Entry:
        # A structlog processor: runs just before the capture appends the entry, in the same call.
        self._added.set()
        self._added = trio.Event()
        return event

    def named(self, name: str) -> list[Entry]:
        return [entry for entry in self.entries if entry["event"] == name]

    async def wait_for(self, name: str, count: int = 1) -> list[Entry]:
        """The entries named ``name`` once there are ``count`` of them (bound the wait with fail_after)."""
        while len(found := self.named(name)) < count:
            added = self._added
            await added.wait()
        return found


@contextmanager
def watch_logs() -> Iterator[LogWatch]:
    entries: list[Entry] = []
    watch = LogWatch(entries)
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars, watch.notify]
    ) as captured:
        watch.entries = captured
        yield watch
