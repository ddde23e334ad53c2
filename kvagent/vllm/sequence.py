"""The sans-IO sequence gate of one attachment's raw stream (the listener repairs the gaps it finds).

The engine's seq counts batches per publisher and per DP rank, starting at 0; it goes back to 0 when the
engine restarts (no epoch, no clear). :class:`SequenceGate` classifies every seq with two watermarks
(vllm-wire.md §9.2, llm-d-router PR #1887): the last seq *applied* and the last seq *seen live*. Keeping
them apart lets live copies of a replayed range count as duplicates while a live seq going backwards still
reads as an in-place restart.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["SeqDecision", "SequenceGate"]


class SeqDecision(enum.Enum):
    APPLY = "apply"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


@attrs.define
class SequenceGate:
    """Tracks one attachment's raw stream; ``applied == -1`` means "nothing yet, expecting seq 0"."""

    applied: int | None = None
    live: int | None = None

    def expected(self) -> int | None:
        return None if self.applied is None else self.applied + 1

    def classify(self, seq: int) -> SeqDecision:
        """A live seq, which is also recorded as the newest seen on the wire."""
        previous_live, self.live = self.live, seq
        if previous_live is not None and seq <= previous_live:
            # Live seqs only go up within one publisher process; going back means it restarted.
            return SeqDecision.DUPLICATE if seq == previous_live else SeqDecision.RESTART
        return self.classify_replayed(seq)

    def classify_replayed(self, seq: int) -> SeqDecision:
        """A seq relative to what has been applied only (replies, or live copies of a replayed range)."""
        if self.applied is None or seq == self.applied + 1:
            return SeqDecision.APPLY
        if seq <= self.applied:
            return SeqDecision.DUPLICATE
        return SeqDecision.GAP

    def mark_applied(self, seq: int) -> None:
        self.applied = seq

    def expect(self, seq: int) -> None:
        """Make ``seq`` the next expected one (after a bootstrap, or after giving up on a hole)."""
        self.applied = seq - 1
