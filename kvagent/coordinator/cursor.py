"""Continuity of raw ZMQ sequences across the ingress chunks of one attachment (agent-semantics 3.5)."""

from __future__ import annotations

import enum

import attrs

from kvagent.model.events import IngressChunk

__all__ = ["Continuity", "SourceCursorTracker", "classify_chunk"]


@attrs.define(slots=True)
class SourceCursorTracker:
    """Continuity of raw ZMQ sequences across the chunks of one attachment (3.5)."""

    completed: int | None = None
    active: tuple[int, int] | None = None

    def observe(self, chunk: IngressChunk) -> bool:
        """Whether ``chunk`` continues the stream; on success the tracker advances."""
        if chunk.chunk_index == 0:
            if self.active is not None or (
                self.completed is not None and chunk.source_cursor != self.completed + 1
            ):
                return False
        elif self.active != (chunk.source_cursor, chunk.chunk_index - 1):
            return False
        self.accept_after_loss(chunk)
        return True

    def accept_after_loss(self, chunk: IngressChunk) -> None:
        if chunk.final:
            self.completed = chunk.source_cursor
            self.active = None
        else:
            self.active = (chunk.source_cursor, chunk.chunk_index)

    def last_seen(self) -> int | None:
        """The highest raw sequence received so far (completed or partially received)."""
        if self.active is None:
            return self.completed
        if self.completed is None:
            return self.active[0]
        return max(self.completed, self.active[0])


class Continuity(enum.Enum):
    CONTINUES = "continues"
    DUPLICATE = "duplicate"
    RESTARTED = "restarted"


def classify_chunk(
    tracker: SourceCursorTracker, skipping_sequence: int | None, chunk: IngressChunk
) -> Continuity:
    """Whether ``chunk`` continues the stream, repeats a raw batch already taken, or shows an engine restart.

    ``skipping_sequence`` is the raw sequence of a duplicated multi-chunk batch whose later chunks are
    dropped too.
    """
    if chunk.chunk_index > 0:
        return Continuity.DUPLICATE if skipping_sequence == chunk.source_cursor else Continuity.CONTINUES
    if tracker.active is None and tracker.completed is not None and chunk.source_cursor == tracker.completed:
        return Continuity.DUPLICATE
    last_seen = tracker.last_seen()
    if last_seen is not None and chunk.source_cursor < last_seen:
        return Continuity.RESTARTED
    return Continuity.CONTINUES
