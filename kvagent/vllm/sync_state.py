"""The phases of :class:`kvagent.vllm.sequence.SourceSync` and the state each one owns (sans-IO, issue #35).

``SourceSync`` is an explicit phase machine, in the style of h11: at any time it is in exactly one
:class:`Phase`, it moves between them only through its transition methods, and a transition the table
:data:`TRANSITIONS` does not allow raises :class:`SyncProtocolError` (a bug in the sync, never an input
the engine or the network can cause). What belongs to one phase lives in that phase's object: the
outstanding replay request in :class:`ReplayRequest` (bootstrapping, repairing, awaiting an identity), the
proof owed after a shed in :class:`ShedProof`. Two facts are orthogonal to the phase, and are overlays on
any of them: the engine's connection being down (the shell's monitor says so), and a shed's proof being
owed (``ShedProof``: the source is not shown ready until it is given).
"""

from __future__ import annotations

import enum
from typing import Generic

import attrs

from kvagent.model.events import SourceState
from kvagent.vllm.sync_actions import M

__all__ = [
    "DEGRADED",
    "DISCONNECTED",
    "READY",
    "TRANSITIONS",
    "Phase",
    "ReplayPurpose",
    "ReplayRequest",
    "ShedProof",
    "SyncCounters",
    "SyncProtocolError",
]

READY, DEGRADED, DISCONNECTED = SourceState.READY, SourceState.DEGRADED, SourceState.DISCONNECTED


class SyncProtocolError(RuntimeError):
    """SourceSync was asked for a transition its phase does not allow (like h11's ``LocalProtocolError``).

    Inputs never cause it: every input is legal in every phase. It means the sync's own logic is wrong."""


class Phase(enum.Enum):
    """Where the applied history stands (docs/trust.md); the state shown follows from the verdicts."""

    UNANCHORED = "unanchored"
    """Nothing to continue from (a start without bootstrap, or a reset with no known continuation): the next
    live batch is accepted whatever its seq, and its seq says how much was lost (rules 6, 7)."""
    BOOTSTRAPPING = "bootstrapping"
    """The engine's history is being replayed from 0 before anything was applied (rule 7)."""
    LIVE = "live"
    """Live batches apply in order; some may be held within the reorder window (rules 1, 2)."""
    REPAIRING = "repairing"
    """A replay request fills a gap (or proves there is none); live batches are held meanwhile (rule 3)."""
    AWAITING_IDENTITY = "awaiting identity"
    """Same engine or a new one? The anchor's replayed bytes decide; live batches are deferred, in arrival
    order, until they do (rules 4, 6, and a resumed agent)."""
    AWAITING_NEW_ENGINE = "awaiting new engine"
    """A new engine is confirmed: its history is asked from 0; live batches are deferred (rule 5)."""


_P = Phase
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    _P.UNANCHORED: frozenset({_P.UNANCHORED, _P.LIVE, _P.BOOTSTRAPPING, _P.AWAITING_NEW_ENGINE}),
    # A request is outstanding in these two; everything else is decided after it is over (back to LIVE).
    _P.BOOTSTRAPPING: frozenset({_P.REPAIRING, _P.LIVE}),
    _P.REPAIRING: frozenset({_P.REPAIRING, _P.LIVE}),
    _P.LIVE: frozenset(Phase),
    _P.AWAITING_IDENTITY: frozenset(
        {_P.AWAITING_IDENTITY, _P.AWAITING_NEW_ENGINE, _P.LIVE, _P.REPAIRING, _P.UNANCHORED}
    ),
    _P.AWAITING_NEW_ENGINE: frozenset({_P.AWAITING_NEW_ENGINE, _P.LIVE, _P.REPAIRING, _P.UNANCHORED}),
}
"""The phases each phase may move to (itself included: a retry, or a verdict that changes nothing)."""

DEFERRING = frozenset({Phase.AWAITING_IDENTITY, Phase.AWAITING_NEW_ENGINE})
"""The phases whose live batches are deferred in arrival order until the engine's identity is settled."""


class ReplayPurpose(enum.Enum):
    """Why a replay request was made (decides what its first reply means)."""

    BOOTSTRAP = "bootstrap"  # nothing applied yet: the engine's history from 0
    NEW_ENGINE = "new engine"  # a confirmed new incarnation: its history from 0, after a reset
    ANCHOR = "anchor"  # from the last applied seq, whose kept digest proves (or disproves) the engine
    REPAIR = "repair"  # from the next expected seq (identity settled, or a hole re-requested)


@attrs.define(slots=True, eq=False)
class ReplayRequest(Generic[M]):
    """The outstanding replay request (at most one), and what its answer has shown so far.

    ``ahead`` holds replies received ahead of the seq awaited (an answer out of seq order), seq ->
    (seq, digest, nbytes, message); their bytes count in the sync's ``held_bytes``."""

    purpose: ReplayPurpose
    start: int
    after_shed: bool  # asked while a shed's proof was owed: its complete answer can give the proof
    first_pending: bool = True  # the answer's first seq is still to be interpreted
    progress: bool = False  # the answer applied something
    ended: bool = False  # the shell reported its end: settling the replies kept ahead (no CancelReplay)
    ahead: dict[int, tuple[int, int, int, M]] = attrs.field(factory=dict)


@attrs.define(slots=True, eq=False)
class ShedProof:
    """Owed after a shed: the listener dropped what it held and re-opened its SUB, losing the batches in
    flight, a loss no later input may ever show. Until the proof, READY is shown as DEGRADED.

    The proof is a live batch received since the shed (``proof_seq``, the first) applied in order, or a
    replay answer asked since the shed that ends complete with nothing held (``probe_at``: when to ask, set
    by ``verify_after_shed``; ``probing``: the request, or its retries, is that check)."""

    proof_seq: int | None = None
    ready_when_proven: bool = False  # READY was held back, and is shown at the proof
    probe_at: float | None = None
    probing: bool = False


@attrs.define(slots=True)
class SyncCounters:
    """The counters of :class:`~kvagent.vllm.sync_actions.SyncStatistics` that are plain increments."""

    gaps: int = 0
    late_batches: int = 0
    duplicates: int = 0
    stale_dropped: int = 0
    lost_batches: int = 0
    history_losses: int = 0
    resets: int = 0
    degradations: int = 0
    restarts_seen: int = 0
    suspected_restarts: int = 0
    ambiguous: int = 0
    engine_disconnects: int = 0
    reconnects: int = 0
    replay_requests: int = 0
    replay_cancels: int = 0
    replay_holes: int = 0
    replay_attempts_without_progress: int = 0
    replay_stray: int = 0
    shed_held_batches: int = 0
    shed_held_bytes: int = 0
    ingest_sheds: int = 0
