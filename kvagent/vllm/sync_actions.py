"""What :class:`kvagent.vllm.sequence.SourceSync` asks its shell to do, and its frozen counters.

Import these names from :mod:`kvagent.vllm.sequence` (which re-exports them); they live here so the phase
machine's module stays about the rules.  :class:`Apply` is emitted once per batch on the hot path, so it is a
``NamedTuple`` (immutable, and about three times cheaper to build than an attrs class); the other actions
are rare and are ordinary frozen attrs classes.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeAlias, TypeVar

import attrs

from kvagent.model.events import SourceState

__all__ = ["Action", "Apply", "CancelReplay", "M", "RequestReplay", "Signal", "SyncStatistics"]

M = TypeVar("M")


class Apply(NamedTuple, Generic[M]):
    """Normalize and admit ``message`` (batch ``seq``): it is the next batch of the engine's history."""

    message: M
    seq: int
    replayed: bool


@attrs.frozen(slots=True)
class Signal:
    """Send ``SourceSignal(generation, state, reset, lost_batches, reason)`` in order with the chunks."""

    state: SourceState | None = None
    reset: bool = False
    lost_batches: int = 0
    reason: str = ""


@attrs.frozen(slots=True)
class RequestReplay:
    """Ask the replay socket for every buffered batch with seq >= ``start``; answer with
    ``on_replay_reply`` per reply and ``on_replay_end`` once.  At most one is outstanding."""

    start: int


@attrs.frozen(slots=True)
class CancelReplay:
    """Abandon the outstanding request: its later replies must never reach the sync (reconnect the DEALER),
    and no ``on_replay_end`` follows."""


Action: TypeAlias = Apply[M] | Signal | RequestReplay | CancelReplay


@attrs.frozen(slots=True)
class SyncStatistics:
    """A snapshot of one :class:`SourceSync` (counters since it was created).

    Attributes:
        state: the source state last signalled (DISCONNECTED while the engine's connection is down).
        applied_seq: the last applied seq of the current incarnation (-1: none since the start or a reset).
        applied: batches applied (live and replayed).
        repaired_batches: batches applied from replay replies.
        held: live batches held now (reorder window, during a replay, or awaiting an identity check).
        held_bytes: their payload bytes.
        gaps: times the live stream skipped ahead of the next expected seq.
        late_batches: live batches that arrived after a successor and filled the hole in time.
        duplicates: batches dropped because that seq was already applied with the same bytes (live
            copies, replay overlap) or was verified to be a late batch of the same engine.
        stale_dropped: held live batches dropped because they came from an engine found to be replaced.
        lost_batches: batches of the engine's history that were never applied (sum of ``lost_batches``).
        history_losses: times history was found lost (a reset and DEGRADED followed).
        resets: Worker resets signalled.
        degradations: transitions to DEGRADED.
        restarts_seen: new engine incarnations confirmed.
        suspected_restarts: live seqs at or below the last applied with no digest to compare (checked by
            replay).
        ambiguous: restart suspicions the replay socket never answered (treated as a new engine).
        engine_disconnects, reconnects: connection drops and returns reported by the shell.
        replay_requests, replay_cancels: RequestReplay and CancelReplay actions emitted.
        replay_holes: answers with a hole mid-answer (re-requested from the hole).
        replay_attempts_without_progress: answers that applied nothing (timeouts, empty, errors).
        replay_stray: replies or ends with no request outstanding or below its start (ignored).
        shed_held_batches, shed_held_bytes: held batches dropped by :meth:`SourceSync.shed`.
        ingest_sheds: calls of :meth:`SourceSync.shed` (each leaves the history unproven until a later live batch
            applies in order, or a replay answer asked after it ends complete: docs/trust.md rule 8).
    """

    state: SourceState
    applied_seq: int
    applied: int
    repaired_batches: int
    held: int
    held_bytes: int
    gaps: int
    late_batches: int
    duplicates: int
    stale_dropped: int
    lost_batches: int
    history_losses: int
    resets: int
    degradations: int
    restarts_seen: int
    suspected_restarts: int
    ambiguous: int
    engine_disconnects: int
    reconnects: int
    replay_requests: int
    replay_cancels: int
    replay_holes: int
    replay_attempts_without_progress: int
    replay_stray: int
    shed_held_batches: int
    shed_held_bytes: int
    ingest_sheds: int
