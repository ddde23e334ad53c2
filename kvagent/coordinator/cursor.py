"""Continuity of raw ZMQ sequences across the ingress chunks of one attachment (docs/spec/agent-semantics.md 3.5)."""

from __future__ import annotations

import enum

import attrs
import structlog

from kvagent.coordinator.counters import CoordinatorCounters
from kvagent.model.events import IngressChunk

__all__ = ["Continuity", "SourceContinuity", "SourceCursorTracker", "classify_chunk"]

log = structlog.get_logger(__name__)


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


class SourceContinuity:
    """The coordinator's view of one attachment's raw sequence: duplicates dropped, gaps counted (3.5)."""

    def __init__(self, counters: CoordinatorCounters) -> None:
        self._counters = counters
        self.tracker = SourceCursorTracker()
        # A duplicated non-final raw batch: its later chunks are dropped too.
        self._skipping_sequence: int | None = None

    def reset(self) -> None:
        """Forget the stream (a new attachment, an engine restart or a source reset)."""
        self.tracker = SourceCursorTracker()
        self._skipping_sequence = None

    def classify(self, chunk: IngressChunk) -> Continuity:
        if chunk.chunk_index == 0:
            self._skipping_sequence = None
        continuity = classify_chunk(self.tracker, self._skipping_sequence, chunk)
        if continuity is Continuity.DUPLICATE:
            self._skipping_sequence = None if chunk.final else chunk.source_cursor
            log.warning(
                "duplicate_source_batch_dropped",
                generation=chunk.generation,
                source_cursor=chunk.source_cursor,
                chunk_index=chunk.chunk_index,
            )
            self._counters.count_filtered("duplicate_source_chunk")
        return continuity

    def observe_lossy(self, chunk: IngressChunk, phase: str) -> None:
        """Advance past ``chunk``; a discontinuity is counted as dropped raw batches and accepted."""
        tracker = self.tracker
        if tracker.observe(chunk):
            return
        previous = tracker.completed
        missing = 1
        if previous is not None and chunk.source_cursor - (previous + 1) > 0:
            missing = chunk.source_cursor - (previous + 1)
        log.warning(
            "source_cursor_gap",
            generation=chunk.generation,
            source_cursor=chunk.source_cursor,
            previous_cursor=previous,
            chunk_index=chunk.chunk_index,
            phase=phase,
        )
        self._counters.dropped_events += missing
        tracker.accept_after_loss(chunk)
