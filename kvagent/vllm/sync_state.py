"""The state and bookkeeping under :class:`kvagent.vllm.sequence.SourceSync` (sans-IO, issue #14).

:class:`SourceSyncBase` owns what the rules act on — the last applied seq, the ring of digests of the
last ``digest_memory`` applied seqs, the live batches held (by seq) or deferred (in arrival order), the
outstanding replay request, the state shown and the counters — and the primitives that keep them
consistent: apply a batch, hold or drop batches, request or cancel a replay, emit a Signal.  The decisions
(which rule applies to which input) are :class:`kvagent.vllm.sequence.SourceSync`'s.
"""

from __future__ import annotations

import collections
import enum
from typing import Generic

import attrs

from kvagent.model.events import SourceState
from kvagent.vllm.sync_actions import Action, Apply, CancelReplay, M, RequestReplay, Signal, SyncStatistics

__all__ = ["READY", "DEGRADED", "DISCONNECTED", "ReplayPurpose", "SourceSyncBase", "SyncCounters"]

READY, DEGRADED, DISCONNECTED = SourceState.READY, SourceState.DEGRADED, SourceState.DISCONNECTED


class ReplayPurpose(enum.Enum):
    """Why the outstanding replay request was made (decides what its first reply means)."""

    BOOTSTRAP = "bootstrap"  # nothing applied yet: the engine's history from 0
    NEW_ENGINE = "new engine"  # a confirmed new incarnation: its history from 0, after a reset
    ANCHOR = "anchor"  # from the last applied seq, whose kept digest proves (or disproves) the engine
    REPAIR = "repair"  # from the next expected seq (identity settled, or a hole re-requested)


@attrs.define(slots=True)
class SyncCounters:
    """The counters of :class:`SyncStatistics` that are plain increments."""

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


class SourceSyncBase(Generic[M]):
    """State and primitives of one attachment's source synchronisation (see the module docstring).

    ``_applied`` is the last applied seq of the current incarnation (-1: nothing since the start or the
    last reset).  While ``_unanchored`` the next live batch is accepted whatever its seq (a start without
    bootstrap, or after a reset that left no known place to continue).
    """

    def __init__(
        self,
        *,
        has_replay: bool,
        reorder_window: int = 8,
        reorder_wait: float = 0.05,
        max_attempts_without_progress: int = 3,
        digest_memory: int = 4096,
        cold_bootstrap: bool = True,
        resume: tuple[int, int] | None = None,
    ) -> None:
        if reorder_window < 0 or reorder_wait < 0 or max_attempts_without_progress < 1 or digest_memory < 1:
            raise ValueError("reorder_window/wait >= 0, max_attempts_without_progress and digest_memory >= 1")
        if resume is not None and resume[0] < 0:
            raise ValueError(f"resume seq must be >= 0, got {resume[0]}")
        self._has_replay = has_replay
        self._window = reorder_window
        self._wait = reorder_wait
        self._max_attempts = max_attempts_without_progress
        self._capacity = digest_memory
        self._bootstrap = has_replay and cold_bootstrap
        self.deadline: float | None = None
        self.held_bytes = 0
        self._actions: list[Action[M]] = []
        self._state = READY
        self._applied = -1
        self._applied_count = 0
        self._repaired = 0
        # The digest of seq s (if kept) is _ring_digest[s % capacity] when _ring_seq[s % capacity] == s.
        self._ring_seq = [-1] * digest_memory
        self._ring_digest = [0] * digest_memory
        self._fast = False  # on_live may take the in-order shortcut (nothing held, pending or awaited)
        self._held: dict[int, tuple[int, int, M]] = {}  # seq -> (digest, nbytes, message), seq > applied
        self._hold_since: float | None = None
        # Live batches received while the engine's identity is in question, in arrival order.
        self._deferred: collections.deque[tuple[int, int, int, M]] = collections.deque()
        self._deferring = False
        # Replies of the outstanding answer received ahead of the seq awaited (an answer out of seq order):
        # seq -> (seq, digest, nbytes, message); their bytes count in held_bytes.
        self._ahead: dict[int, tuple[int, int, int, M]] = {}
        self._ended = False  # on_replay_end is settling the kept replies of an answer that has ended
        self._unanchored = True
        self._loss_base = 0  # while unanchored: the first seq whose absence counts as lost
        self._ever_applied = False
        self._new_engine_pending = False  # confirmed new incarnation, waiting for its replay from 0
        self._disconnected = False
        self._restore: SourceState | None = None  # the state to show once a reconnect is verified
        self._trust_late = False
        self._replay: ReplayPurpose | None = None
        self._replay_start = 0
        self._strict = False  # the anchor must be answered exactly (restart suspected, or reconnected)
        self._first_pending = False
        self._progress = False
        self._attempts = 0
        self._refeed_after_reply = False
        self._request_id = 0  # changes with every request and cancel
        # After a shed (the listener dropped what it held and re-opened its SUB, losing what was in flight):
        # the history is unproven until a live batch received since then has been applied in order
        # (``_proof_seq``: the first such batch's seq). Meanwhile READY shows as DEGRADED, and becomes READY
        # at the proof if nothing else degraded the source (``_ready_when_proven``).
        self._unproven = False
        self._proof_seq: int | None = None
        self._ready_when_proven = False
        # With replay, the shed also asks the replay socket (once the reorder wait is over, as for a gap): an
        # answer requested after the shed that ends complete, with nothing held, proves the history exact.
        self._probe_at: float | None = None
        self._request_after_shed = False  # the outstanding request was made while unproven
        self._probing = False  # the outstanding repair is that probe (its failure leaves the proof to a live batch)
        self._c = SyncCounters()
        # A restarted agent's resume point (seq, digest of its payload): what it applied before it stopped.
        self._resuming = resume is not None
        if resume is not None:
            self._resume_at(*resume)

    def _resume_at(self, seq: int, digest: int) -> None:
        """Start as if batch ``seq`` (payload digest ``digest``) was the last applied, anchored; until the
        replay proves the same engine, the state shows DISCONNECTED and READY is what a proof restores."""
        self._applied = seq
        slot = seq % self._capacity
        self._ring_seq[slot] = seq
        self._ring_digest[slot] = digest
        self._ever_applied = True
        self._unanchored = False
        self._state = DISCONNECTED
        self._restore = READY

    def take_actions(self) -> list[Action[M]]:
        """The actions emitted since the last call, in order."""
        actions, self._actions = self._actions, []
        return actions

    def statistics(self) -> SyncStatistics:
        c = self._c
        return SyncStatistics(
            state=self._state,
            applied_seq=self._applied,
            applied=self._applied_count,
            repaired_batches=self._repaired,
            held=len(self._held) + len(self._deferred) + len(self._ahead),
            held_bytes=self.held_bytes,
            **attrs.asdict(c),
        )

    def _defer(self, seq: int, digest: int, nbytes: int, message: M) -> None:
        self._deferred.append((seq, digest, nbytes, message))
        self.held_bytes += nbytes

    def _keep_ahead(self, seq: int, digest: int, nbytes: int, message: M) -> None:
        if seq not in self._ahead:
            self._ahead[seq] = (seq, digest, nbytes, message)
            self.held_bytes += nbytes

    def _take_ahead(self, seq: int) -> tuple[int, int, int, M]:
        item = self._ahead.pop(seq)
        self.held_bytes -= item[2]
        return item

    def _clear_ahead(self) -> None:
        for item in self._ahead.values():
            self.held_bytes -= item[2]
        self._ahead.clear()

    def _drain_held(self, now: float) -> None:
        held = self._held
        drained = False
        while (seq := self._applied + 1) in held:
            digest, nbytes, message = held.pop(seq)
            self.held_bytes -= nbytes
            self._apply(seq, digest, message)
            drained = True
        if drained and held:
            self._hold_since = now  # progress: the next hole gets a full reorder wait

    def _apply(self, seq: int, digest: int, message: M, replayed: bool = False) -> None:
        self._applied = seq
        slot = seq % self._capacity
        self._ring_seq[slot] = seq
        self._ring_digest[slot] = digest
        self._applied_count += 1
        self._ever_applied = True
        self._actions.append(Apply(message, seq, replayed))

    def _request(self, purpose: ReplayPurpose, *, strict: bool = False, probe: bool = False) -> None:
        if self._replay is not None:
            raise RuntimeError("SourceSync: a replay request is already outstanding")
        start = 0 if purpose in (ReplayPurpose.BOOTSTRAP, ReplayPurpose.NEW_ENGINE) else self._applied
        if purpose is ReplayPurpose.REPAIR:
            start += 1
        self._clear_ahead()
        self._replay, self._replay_start, self._strict = purpose, start, strict
        self._first_pending, self._progress = True, False
        self._request_after_shed = self._unproven
        repair = purpose is ReplayPurpose.REPAIR or (purpose is ReplayPurpose.ANCHOR and not strict)
        self._probing = probe or (self._probing and repair)
        self._request_id += 1
        self._c.replay_requests += 1
        self._actions.append(RequestReplay(start))

    def _cancel(self) -> None:
        self._clear_ahead()
        if self._replay is not None:
            self._replay = None
            self._request_id += 1
            if not self._ended:  # an answer that has ended needs no cancel (and must get none)
                self._c.replay_cancels += 1
                self._actions.append(CancelReplay())

    def _drop_stale(self) -> None:
        self._cancel()
        self._c.stale_dropped += len(self._held) + len(self._deferred)
        self._held.clear()
        self._deferred.clear()
        self.held_bytes = 0
        self._hold_since = None

    def _skip_to(self, seq: int) -> None:
        """Continue the history at ``seq``: held batches before it can no longer be applied in order."""
        for held in [held for held in self._held if held < seq]:
            self.held_bytes -= self._held.pop(held)[1]
        self._applied = seq - 1

    def _last_run_start(self) -> int | None:
        """The first seq of the last contiguous run of held batches (None if nothing is held)."""
        if not self._held:
            return None
        seq = max(self._held)
        while seq - 1 in self._held:
            seq -= 1
        return seq

    def _forget_digests(self) -> None:
        self._ring_seq = [-1] * self._capacity

    def _signal(self, state: SourceState | None, *, reset: bool = False, lost: int = 0, reason: str = "") -> None:
        """Emit a Signal. While disconnected a new state is remembered for after the reconnect instead.

        While the history is unproven after a shed, READY is shown as DEGRADED until the proof."""
        if state is DEGRADED or reset or lost:
            self._ready_when_proven = False
        if reset:
            self._proof_seq = None  # the seqs start anew: the next live batch is the proof to wait for
        if state is READY and self._unproven:
            state, reason = DEGRADED, f"{reason}; unproven after a shed"
            self._ready_when_proven = True
        if state is not None:
            if self._disconnected:
                self._restore, state = state, None
            else:
                self._restore = None
                if state is self._state and not reset and not lost:
                    return
        if state is None and not reset and not lost:
            return
        if state is DEGRADED and self._state is not DEGRADED:
            self._c.degradations += 1
        if state is not None:
            self._state = state
            self._resuming = False
        self._c.resets += reset
        self._c.lost_batches += lost
        self._actions.append(Signal(state=state, reset=reset, lost_batches=lost, reason=reason))

    def _show_restored(self) -> None:
        restore, self._restore = self._restore, None
        if self._resuming:
            reason = "resumed: the engine's replay continues the applied history"
        else:
            reason = "engine reconnected"
        if restore is not None and restore is not self._state:
            self._signal(restore, reason=reason)
