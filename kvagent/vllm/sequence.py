"""Sans-IO synchronisation of one attachment's raw batch stream with the engine's history (issues #14, #35).

The engine numbers its batches 0, 1, 2, ... per process and starts again at 0 when it restarts, with no
epoch (docs/spec/vllm-wire.md §4, §10).  :class:`SourceSync` decides, from the live seqs, the replay answers and the
SUB monitor's connection events, which batches are applied in which order and what the attachment's state
is (``ready`` only while the applied history is exactly the engine's, docs/trust.md).  A seq alone cannot
tell a late batch from a restarted engine, so it keeps the payload digest of the last ``digest_memory``
applied seqs: a live seq at or below the last applied one is a duplicate only if its bytes match; without a
digest to compare, the replay socket is asked for the anchor (the last applied seq) and its bytes decide.

It is an explicit phase machine (:class:`~kvagent.vllm.sync_state.Phase`: unanchored, bootstrapping, live,
repairing, awaiting identity, awaiting new engine), in the style of h11: each input is a method, the phase
changes only in the transition methods (``_enter``, ``_ask``, ``_request_over``), a transition the phase does
not allow raises :class:`~kvagent.vllm.sync_state.SyncProtocolError`, and the state of a phase lives in its
object (the outstanding :class:`~kvagent.vllm.sync_state.ReplayRequest`, the
:class:`~kvagent.vllm.sync_state.ShedProof` owed after a shed). The engine's connection being down is an
overlay on any phase.

The shell feeds events in and executes the actions (:meth:`SourceSync.take_actions`) in order; time comes
in only through the ``now`` arguments.  The common case, a live seq equal to the last applied plus one with
nothing held, is a few attribute updates and one :class:`Apply`.  The actions live in
:mod:`kvagent.vllm.sync_actions` (re-exported here).

What the shell must guarantee (the SUB monitor and the SUB are separate sockets): ``on_disconnected`` comes
before any batch of a later connection, and the old connection's queued batches come before
``on_connected``.  Batches of the new connection may come before ``on_connected``: with replay, live batches
are held from the disconnect until the reconnect's identity check.
"""

from __future__ import annotations

import collections
from typing import Generic

import attrs

from kvagent.model.events import SourceState
from kvagent.vllm.sync_actions import (
    Action,
    Apply,
    CancelReplay,
    M,
    RequestReplay,
    Signal,
    SyncStatistics,
)
from kvagent.vllm.sync_state import (
    DEFERRING,
    DEGRADED,
    DISCONNECTED,
    READY,
    TRANSITIONS,
    Phase,
    ReplayPurpose,
    ReplayRequest,
    ShedProof,
    SyncCounters,
    SyncProtocolError,
)

__all__ = [
    "Action",
    "Apply",
    "CancelReplay",
    "Phase",
    "RequestReplay",
    "Signal",
    "SourceSync",
    "SyncProtocolError",
    "SyncStatistics",
]

_Ahead = dict[int, tuple[int, int, int, M]]


class SourceSync(Generic[M]):
    """The source synchronisation phase machine of one attachment (docs/trust.md, rules 1-8).

    ``_applied`` is the last applied seq of the current incarnation (-1: nothing since the start or the
    last reset).  Live batches ahead of the next seq are held (``_held``, by seq); while the engine's
    identity is in question they are deferred instead (``_deferred``, in arrival order).
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
        # Configuration.
        self._has_replay = has_replay
        self._window = reorder_window
        self._wait = reorder_wait
        self._max_attempts = max_attempts_without_progress
        self._capacity = digest_memory
        self._bootstrap = has_replay and cold_bootstrap
        # What the shell reads: when to call on_timer, the bytes held, the actions, the state shown.
        self.deadline: float | None = None
        self.held_bytes = 0
        self._actions: list[Action[M]] = []
        self._state = READY
        self._c = SyncCounters()
        self._applied_count = 0
        self._repaired = 0
        # The applied history. The digest of seq s (if kept) is _ring_digest[s % capacity] when
        # _ring_seq[s % capacity] == s.
        self._applied = -1
        self._ever_applied = False
        self._ring_seq = [-1] * digest_memory
        self._ring_digest = [0] * digest_memory
        # The phase and what belongs to it.
        self._phase = Phase.UNANCHORED
        self._loss_base = 0  # while UNANCHORED: the first seq whose absence counts as lost
        self._outstanding: ReplayRequest[M] | None = None
        self._request_id = 0  # changes with every request and cancel
        self._attempts = 0  # replay attempts without progress in a row
        self._held: dict[int, tuple[int, int, M]] = {}  # seq -> (digest, nbytes, message), seq > applied
        self._hold_since: float | None = None
        # Deferred while AWAITING_IDENTITY or AWAITING_NEW_ENGINE, and read again (in arrival order) once the
        # verdict is in: (seq, digest, nbytes, message).
        self._deferred: collections.deque[tuple[int, int, int, M]] = collections.deque()
        # Overlays on any phase: the engine's connection is down; a shed's proof is owed.
        self._disconnected = False
        self._restore: SourceState | None = None  # the state to show once a reconnect (or resume) is verified
        self._unproven: ShedProof | None = None
        self._resuming = resume is not None  # a restarted agent's resume point, not yet proven or refuted
        # Within one input: the deferred batches are read again after the reply that began a new engine's
        # history; a late batch received before the anchor proved the same engine is dropped as a duplicate.
        self._refeed_after_reply = False
        self._trust_late = False
        self._fast = False  # on_live may take the in-order shortcut (LIVE, nothing held or owed)
        if resume is not None:
            self._resume_at(*resume)

    def _resume_at(self, seq: int, digest: int) -> None:
        """Start as if batch ``seq`` (payload digest ``digest``) was the last applied, anchored; until the
        replay proves the same engine, the state shows DISCONNECTED and READY is what a proof restores."""
        self._enter(Phase.LIVE)
        self._applied = seq
        slot = seq % self._capacity
        self._ring_seq[slot] = seq
        self._ring_digest[slot] = digest
        self._ever_applied = True
        self._state = DISCONNECTED
        self._restore = READY

    # -- what the shell reads ----------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Where the applied history stands now (tests and diagnostics; the shell needs only the actions)."""
        return self._phase

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

    @property
    def _ahead(self) -> _Ahead[M]:
        """The outstanding answer's replies kept ahead of the seq awaited (empty without a request)."""
        request = self._outstanding
        return request.ahead if request is not None else {}

    # -- inputs ------------------------------------------------------------------------------------------

    def start(self, now: float) -> None:
        """Attach (rule 7): replay the engine's history from 0 first, if there is replay and bootstrap.

        Resumed (``resume=(seq, digest)``): ask the replay socket from ``seq``, strictly; the same bytes prove
        the same engine and the answer goes on as the repair of what was missed (no reset, READY once
        caught up), anything else takes the new-engine or lost-history path.  Without a replay socket the
        engine cannot be checked: a reset, and the next live batch starts the history anew.
        """
        if self._resuming:
            if self._has_replay:
                self._enter(Phase.AWAITING_IDENTITY)
                self._ask(ReplayPurpose.ANCHOR)
            else:
                self._lose_history(None, "resumed without a replay socket: the engine cannot be checked")
        elif self._bootstrap:
            self._ask(ReplayPurpose.BOOTSTRAP)
        self._settle(now)

    def on_live(self, seq: int, digest: int, nbytes: int, message: M, now: float) -> None:
        """A batch from the SUB socket (``digest`` of its payload frame, ``nbytes`` charged while held)."""
        if self._fast and seq == self._applied + 1:
            # The hot path (rule 1): nothing held, nothing pending; no allocation beyond the Apply.
            self._applied = seq
            slot = seq % self._capacity
            self._ring_seq[slot] = seq
            self._ring_digest[slot] = digest
            self._applied_count += 1
            self._actions.append(Apply(message, seq, False))
            return
        self._live(seq, digest, nbytes, message, now)
        self._settle(now)

    def on_replay_reply(self, seq: int, digest: int, nbytes: int, message: M, now: float) -> None:
        """One data reply of the outstanding request, in the order received.

        An answer may come out of seq order (an engine whose live batches were swapped buffered them in
        the order it sent them): a reply ahead of the one awaited is kept (at most ``reorder_window`` of
        them) until its predecessor comes. Only when more are ahead, or the answer ends without the awaited
        seq, is it a hole (re-asked) or, for the first seq of the answer, a verdict about the engine.
        """
        request = self._outstanding
        if request is None or seq < request.start:
            self._c.replay_stray += 1
            return
        request_id = self._request_id
        if request.first_pending:
            if seq != request.start:
                self._keep_ahead(seq, digest, nbytes, message)
                if len(request.ahead) <= self._window:
                    self._settle(now)  # the start may come next: a reorder within the answer
                    return
                seq, digest, nbytes, message = self._take_ahead(min(request.ahead))
            if not self._resolve_first(seq, digest, now):
                self._settle(now)
                return
        self._reply(request_id, seq, digest, nbytes, message, now)
        if self._refeed_after_reply:
            self._refeed_after_reply = False
            self._refeed(now)
        self._settle(now)

    def on_replay_end(self, complete: bool, now: float) -> None:
        """The outstanding request ended: its end marker (``complete``), or a timeout or error."""
        request = self._outstanding
        if request is None:
            self._c.replay_stray += 1
            return
        purpose = request.purpose
        request_id = self._request_id
        if request.first_pending and request.ahead:
            # The requested start never came: the answer's lowest seq is its first. The request has ended
            # for the shell, so nothing decided now cancels it (no CancelReplay).
            request.ended = True
            seq, digest, nbytes, message = self._take_ahead(min(request.ahead))
            if self._resolve_first(seq, digest, now):
                self._reply(request_id, seq, digest, nbytes, message, now)
            if self._refeed_after_reply:
                self._refeed_after_reply = False
                self._refeed(now)
            if self._request_id != request_id:  # abandoned, finished or asked anew meanwhile
                self._settle(now)
                return
        hole = bool(request.ahead)  # replies after a seq the answer never carried
        self._clear_ahead()
        self._request_over()
        if hole:
            self._c.replay_holes += 1
            self._retry(ReplayPurpose.REPAIR, now, progress=request.progress)
        elif complete and request.first_pending:
            self._empty_answer(request, now)
        elif complete and not self._held and not request.progress:
            self._repair_done(now, proof=request)  # only the anchor came back: nothing newer to repair
        elif request.progress:
            # Cut short (a timeout, an error), or ended: the send HWM may have dropped the answer's tail
            # and let the end marker through, so ask again from the first missing seq until an answer
            # reaches the held batches or comes back empty.
            self._attempts = 0
            self._ask(ReplayPurpose.REPAIR)
        else:
            self._attempt_failed(purpose, now)
        self._settle(now)

    def on_disconnected(self, now: float) -> None:
        """The SUB monitor saw the engine's connection drop (rule 6)."""
        if self._disconnected:
            return
        self._disconnected = True
        self._c.engine_disconnects += 1
        if self._restore is None:
            # A READY held back after a shed is what the reconnect restores (and _signal holds back again).
            proof = self._unproven
            self._restore = READY if proof is not None and proof.ready_when_proven else self._state
        self._state = DISCONNECTED
        self._actions.append(Signal(state=DISCONNECTED, reason="engine disconnected"))
        # The engine that would answer is gone or going; the reconnect asks again, and checks identity.
        self._cancel()
        self._settle(now)

    def on_connected(self, now: float) -> None:
        """The engine's connection is back (after :meth:`on_disconnected`; otherwise ignored)."""
        if not self._disconnected:
            return
        self._disconnected = False
        self._c.reconnects += 1
        self._cancel()
        if self._has_replay and self._phase is Phase.AWAITING_NEW_ENGINE:
            # Which engine sent what the lost connection delivered cannot be told: the replay has it all.
            self._drop_stale()
            self._ask(ReplayPurpose.NEW_ENGINE)
        elif not self._ever_applied or self._phase is Phase.UNANCHORED:
            # Nothing to check the engine against: what the lost connection delivered may be another
            # engine's. A cold start (rule 7) or, after a reset, the next batch decides.
            self._drop_stale()
            if not self._ever_applied and self._bootstrap:
                self._ask(ReplayPurpose.BOOTSTRAP)
            elif not self._ever_applied:
                self._enter(Phase.UNANCHORED)
        elif self._has_replay:
            self._enter(Phase.AWAITING_IDENTITY)
            self._ask(ReplayPurpose.ANCHOR)
        else:
            # Without replay a seq proves nothing here: a dropped connection is most often a restarted engine,
            # which numbers its batches from 0 again, and the SUB may miss its first ones, so its next seq can
            # be the last applied + 1 by chance. The history is reset and the next batch decides, as at a cold
            # start: from seq 0 it is the new engine's whole history (ready), else it joins mid-stream.
            self._drop_stale()
            self._restore = None
            self._lose_history(None, "reconnected without a replay socket: which engine answers cannot be told")
        self._settle(now)

    def on_timer(self, now: float) -> None:
        """Called by the shell at or after :attr:`deadline` (the reorder wait ran out)."""
        self._settle(now)

    def shed(self, now: float) -> int:
        """Drop every held live batch (byte pressure); they become a gap repaired later. Returns bytes.

        The shell also dropped its queued live batches and re-opened its SUB, losing those in flight: a loss
        no later input may ever show (the end of a flood). So the history is unproven, and the source not
        ready, until a live batch received after the shed has been applied in order (issue #28), or, once
        the shell calls :meth:`verify_after_shed`, a replay answer shows it (issue #35).
        """
        freed = self.held_bytes
        ahead = self._ahead
        self._c.shed_held_batches += len(self._held) + len(self._deferred) + len(ahead)
        self._c.shed_held_bytes += freed
        self._held.clear()
        self._deferred.clear()
        ahead.clear()
        self.held_bytes = 0
        self._hold_since = None
        self._c.ingest_sheds += 1
        owed = self._unproven
        self._unproven = ShedProof(
            ready_when_proven=owed is not None and owed.ready_when_proven,
            probing=owed is not None and owed.probing,
        )
        if self._outstanding is not None:
            self._outstanding.after_shed = False  # asked before this shed: its answer cannot prove it
        if self._disconnected:
            pass  # the reconnect shows what _restore holds, and _signal keeps READY back until the proof
        elif self._state is READY:
            self._signal(DEGRADED, reason="live batches shed: history unproven until a later batch applies in order")
            self._unproven.ready_when_proven = True
        self._settle(now)
        return freed

    def verify_after_shed(self, now: float) -> None:
        """Ask the replay socket whether the last shed lost anything, rather than wait for a live batch.

        With replay, once the reorder wait is over (the time the re-opened SUB gets to subscribe, as a gap
        gets to fill), the replay socket is asked from the last applied seq, as for a gap: an answer asked
        after the shed that ends complete, with nothing held, shows the applied history is the engine's
        whole history up to its newest batch, and the source is ready again (if the shed alone held it
        back). An answer that cannot show it (the anchor gone, no answer) leaves the proof to the next live
        batch in order. Without replay, or with nothing unproven, nothing to do.
        """
        if self._unproven is not None and self._has_replay:
            self._unproven.probe_at = now + self._wait
        self._settle(now)

    # -- transitions -------------------------------------------------------------------------------------

    def _enter(self, phase: Phase) -> None:
        """Move to ``phase``; every change of phase goes through here, and the table says what is legal."""
        if phase not in TRANSITIONS[self._phase]:
            raise SyncProtocolError(f"SourceSync: no transition from {self._phase.value} to {phase.value}")
        if phase is Phase.UNANCHORED and self._outstanding is not None:
            raise SyncProtocolError("SourceSync: unanchored with a replay request outstanding")
        self._phase = phase

    def _ask(self, purpose: ReplayPurpose, *, probe: bool = False) -> None:
        """Request a replay. BOOTSTRAP is bootstrapping; NEW_ENGINE only awaiting a new engine; ANCHOR while
        awaiting identity checks it (strictly: the anchor's bytes must come first), otherwise ANCHOR and
        REPAIR repair."""
        if self._outstanding is not None:
            raise SyncProtocolError("SourceSync: a replay request is already outstanding")
        phase = self._phase
        if purpose is ReplayPurpose.BOOTSTRAP:
            self._enter(Phase.BOOTSTRAPPING)
        elif purpose is ReplayPurpose.NEW_ENGINE:
            if phase is not Phase.AWAITING_NEW_ENGINE:
                raise SyncProtocolError(f"SourceSync: a new engine's history asked while {phase.value}")
        elif phase is Phase.AWAITING_NEW_ENGINE or (phase is Phase.AWAITING_IDENTITY and purpose is not ReplayPurpose.ANCHOR):
            raise SyncProtocolError(f"SourceSync: a {purpose.value} request while {phase.value}")
        elif phase is not Phase.AWAITING_IDENTITY:
            self._enter(Phase.REPAIRING)
        start = 0 if purpose in (ReplayPurpose.BOOTSTRAP, ReplayPurpose.NEW_ENGINE) else self._applied
        if purpose is ReplayPurpose.REPAIR:
            start += 1
        proof = self._unproven
        if proof is not None:
            proof.probing = probe or (proof.probing and self._phase is Phase.REPAIRING)
        self._outstanding = ReplayRequest(purpose, start, after_shed=proof is not None)
        self._request_id += 1
        self._c.replay_requests += 1
        self._actions.append(RequestReplay(start))

    def _request_over(self) -> None:
        """The outstanding request is done with (answered, abandoned or cancelled)."""
        self._outstanding = None
        if self._phase in (Phase.BOOTSTRAPPING, Phase.REPAIRING):
            self._enter(Phase.LIVE)

    def _cancel(self) -> None:
        request = self._outstanding
        if request is None:
            return
        self._clear_ahead()
        self._request_id += 1
        self._request_over()
        if not request.ended:  # an answer that has ended needs no cancel (and must get none)
            self._c.replay_cancels += 1
            self._actions.append(CancelReplay())

    # -- live batches ------------------------------------------------------------------------------------

    def _live(self, seq: int, digest: int, nbytes: int, message: M, now: float) -> None:
        proof = self._unproven
        if proof is not None and proof.proof_seq is None:
            proof.proof_seq = seq  # received on the SUB opened after the shed
        if self._phase in DEFERRING:
            self._defer(seq, digest, nbytes, message)
            return
        held_for_reconnect = self._disconnected and self._has_replay
        if self._phase is Phase.UNANCHORED and not held_for_reconnect:
            self._accept_first(seq, digest, message)
            return
        applied = self._applied
        if seq <= applied:
            self._live_behind(seq, digest, nbytes, message, now)
        elif seq in self._held:
            if self._held[seq][0] == digest:
                self._c.duplicates += 1
            else:  # two different batches with one seq: a new engine caught up with the held one
                self._new_engine_seen(seq, digest, nbytes, message, "engine restarted (seq reused)")
        elif self._outstanding is not None or seq > applied + 1 or held_for_reconnect:
            # Held: a gap, a replay in flight, or the engine's identity to be checked at the reconnect (a
            # batch of a new connection received before its connect event must not pass as the old one's).
            if not self._held and self._outstanding is None and seq > applied + 1:
                self._c.gaps += 1
            self._held[seq] = (digest, nbytes, message)
            self.held_bytes += nbytes
        else:
            if self._held:
                self._c.late_batches += 1
            self._apply(seq, digest, message)
            self._drain_held(now)

    def _live_behind(self, seq: int, digest: int, nbytes: int, message: M, now: float) -> None:
        """Rule 4: a live seq at or below the last applied one is a duplicate, a late batch or a restart."""
        slot = seq % self._capacity
        if self._ring_seq[slot] == seq:
            if self._ring_digest[slot] == digest:
                self._c.duplicates += 1
            else:
                self._new_engine_seen(seq, digest, nbytes, message, "engine restarted (batch bytes differ)")
        elif self._trust_late:
            self._c.duplicates += 1  # received before the anchor proved the same engine: a late batch
        elif self._has_replay:
            self._c.suspected_restarts += 1
            self._cancel()
            self._enter(Phase.AWAITING_IDENTITY)
            self._defer(seq, digest, nbytes, message)
            if not self._disconnected:
                self._ask(ReplayPurpose.ANCHOR)
        else:
            # A restart, or a batch so late its digest is forgotten: nothing can tell without replay. Reset and
            # continue from the next batch, without this one (if it is a late one, it is stale).
            self._c.suspected_restarts += 1
            self._drop_stale()
            self._lose_history(None, "seq went back: engine restarted or a batch arrived late")

    def _accept_first(self, seq: int, digest: int, message: M) -> None:
        """The first batch after a start without bootstrap, or after a reset with no known continuation."""
        self._enter(Phase.LIVE)
        if seq == 0 and self._ever_applied:
            self._c.restarts_seen += 1  # seq 0 again after a reset: only a new engine starts there
        lost = max(0, seq - self._loss_base)
        # Nothing was applied since the start or the last reset, so from seq 0 the history is complete.
        state = READY if seq == 0 else DEGRADED
        self._signal(state, lost=lost, reason="joined mid-stream" if seq else "history complete from seq 0")
        self._applied = seq - 1
        self._apply(seq, digest, message)

    def _refeed(self, now: float) -> None:
        """Process the deferred live batches again, in arrival order, now that identity is settled."""
        items, self._deferred = self._deferred, collections.deque()
        for seq, digest, nbytes, message in items:
            self.held_bytes -= nbytes
            self._live(seq, digest, nbytes, message, now)

    def _refeed_held(self, now: float) -> None:
        """Process the held batches again in seq order (after the sync became unanchored)."""
        items = sorted(self._held.items())
        self._held.clear()
        for seq, (digest, nbytes, message) in items:
            self.held_bytes -= nbytes
            self._live(seq, digest, nbytes, message, now)

    # -- replay answers ----------------------------------------------------------------------------------

    def _resolve_first(self, seq: int, digest: int, now: float) -> bool:
        """Interpret the answer's first seq; False if that abandoned the request (a new engine, or done)."""
        request = self._outstanding
        assert request is not None
        request.first_pending = False
        request_id = self._request_id
        self._first_reply(request, seq, digest, now)
        return self._request_id == request_id

    def _first_reply(self, request: ReplayRequest[M], seq: int, digest: int, now: float) -> None:
        """Interpret the first reply of an answer (which may abandon it, or end the repair)."""
        purpose, start = request.purpose, request.start
        if purpose is ReplayPurpose.ANCHOR:
            checking = self._phase is Phase.AWAITING_IDENTITY
            if seq == start:
                slot = seq % self._capacity
                if self._ring_seq[slot] != seq or self._ring_digest[slot] != digest:
                    self._new_engine_confirmed("engine restarted (replay anchor differs)")
                elif checking:
                    self._identity_confirmed(request, now)
                else:
                    request.purpose = ReplayPurpose.REPAIR
                return
            if checking:
                self._new_engine_confirmed("engine restarted (replay anchor missing)")
                return
            # The engine just evicted the anchor (first reply start + 1), or no longer holds the gap.
            request.purpose = ReplayPurpose.REPAIR
            if seq > start + 1:
                self._lose_history(seq, "gap no longer in the engine's replay buffer")
        elif purpose is ReplayPurpose.REPAIR:
            if seq > start:
                self._lose_history(seq, "gap no longer in the engine's replay buffer")
        elif purpose is ReplayPurpose.BOOTSTRAP:
            request.purpose = ReplayPurpose.REPAIR
            self._enter(Phase.REPAIRING)
            lost = max(0, seq - self._loss_base)
            state = READY if seq == 0 else DEGRADED
            reason = "history before the replay buffer lost" if lost else "history complete from seq 0"
            self._signal(state, lost=lost, reason=reason)
            self._skip_to(seq)
        else:  # NEW_ENGINE
            request.purpose = ReplayPurpose.REPAIR
            self._begin_incarnation(seq, "engine restarted")
            self._refeed_after_reply = True

    def _reply(self, request_id: int, seq: int, digest: int, nbytes: int, message: M, now: float) -> None:
        expected = self._applied + 1
        if seq > expected:
            self._keep_ahead(seq, digest, nbytes, message)
            if len(self._ahead) > self._window:  # a hole mid-answer: the ROUTER's send HWM dropped replies
                self._hole(now)
            return
        if seq == expected:
            self._apply_reply(seq, digest, message, now)
        # seq < expected: the anchor itself, or a batch already applied from a live copy.
        self._drain_ahead(request_id, now)

    def _drain_ahead(self, request_id: int, now: float) -> None:
        """Apply the replies kept ahead that are now next (while the same request is outstanding)."""
        while self._request_id == request_id and (ahead := self._ahead):
            for stale in [kept for kept in ahead if kept <= self._applied]:
                self._take_ahead(stale)
            nxt = self._applied + 1
            if nxt not in ahead:
                return
            _, digest, _, message = self._take_ahead(nxt)
            self._apply_reply(nxt, digest, message, now)

    def _apply_reply(self, seq: int, digest: int, message: M, now: float) -> None:
        had_held = bool(self._held)
        live_copy = self._held.pop(seq, None)
        if live_copy is not None:
            self.held_bytes -= live_copy[1]
            self._c.duplicates += 1
        self._apply(seq, digest, message, replayed=True)
        self._repaired += 1
        request = self._outstanding
        assert request is not None
        request.progress = True
        self._drain_held(now)
        if had_held and not self._held:
            # Contiguous up to (and through) the held batches: the live stream carries the rest.
            self._cancel()
            self._repair_done(now)

    def _hole(self, now: float) -> None:
        self._c.replay_holes += 1
        progress = self._outstanding is not None and self._outstanding.progress
        self._cancel()
        self._retry(ReplayPurpose.REPAIR, now, progress=progress)

    def _identity_confirmed(self, request: ReplayRequest[M], now: float) -> None:
        """The anchor matched: the same engine, so the suspect was a late batch. The deferred live batches
        are read again; after a reconnect the answer goes on as the repair of what the SUB missed."""
        if self._restore is None:
            self._cancel()  # no reconnect: anything still missing shows as a gap among the live batches
            self._enter(Phase.LIVE)
        else:
            request.purpose = ReplayPurpose.REPAIR
            self._enter(Phase.REPAIRING)
        self._trust_late = True
        try:
            self._refeed(now)
        finally:
            self._trust_late = False

    def _empty_answer(self, request: ReplayRequest[M], now: float) -> None:
        """The end marker came first: the engine holds nothing at or after the requested start."""
        purpose = request.purpose
        if purpose is ReplayPurpose.NEW_ENGINE:
            first = min((item[0] for item in self._deferred), default=0)
            self._begin_incarnation(first, "engine restarted")
            self._refeed(now)
        elif purpose is ReplayPurpose.ANCHOR and self._phase is Phase.AWAITING_IDENTITY:
            self._new_engine_confirmed("engine restarted (replay anchor missing)")
        elif purpose is ReplayPurpose.ANCHOR:
            self._attempt_failed(purpose, now)
        else:
            if purpose is ReplayPurpose.BOOTSTRAP and self._state is not READY:
                self._signal(READY, reason="history complete from seq 0")
            self._drain_held(now)
            if self._held:
                self._attempt_failed(purpose, now)
            else:
                self._repair_done(now, proof=request)

    def _retry(self, purpose: ReplayPurpose, now: float, *, progress: bool) -> None:
        """The next attempt after a cut answer: counted as without progress if it applied nothing."""
        if progress:
            self._attempts = 0
            self._ask(ReplayPurpose.REPAIR)
        else:
            self._attempt_failed(purpose, now)

    def _attempt_failed(self, purpose: ReplayPurpose, now: float) -> None:
        self._c.replay_attempts_without_progress += 1
        if purpose is ReplayPurpose.BOOTSTRAP and self._applied >= 0:
            purpose = ReplayPurpose.REPAIR  # the empty answer anchored the history at 0 and some was applied
        self._attempts += 1
        if self._attempts < self._max_attempts:
            self._ask(purpose)
            return
        self._attempts = 0
        proof = self._unproven
        if proof is not None and proof.probing and not self._held:
            proof.probing = False  # nothing to repair is known: a live batch in order may still prove the history
        elif purpose is ReplayPurpose.BOOTSTRAP:
            self._signal(DEGRADED, reason="replay unavailable: history unknown")
            self._enter(Phase.UNANCHORED)
            self._refeed_held(now)
        elif purpose is ReplayPurpose.NEW_ENGINE:
            # The batches deferred since the request are the new engine's: continue from the oldest.
            first = min((item[0] for item in self._deferred), default=None)
            if first is None:
                self._lose_history(None, "engine restarted; replay unavailable")
            else:
                self._begin_incarnation(first, "engine restarted; replay unavailable")
            self._refeed(now)
        elif self._phase is Phase.AWAITING_IDENTITY:
            # Same engine or a new one: nobody can tell. Reset, and start over from the next live batch.
            self._c.ambiguous += 1
            self._drop_stale()
            self._lose_history(None, "engine identity unknown: replay unavailable")
        else:
            self._lose_history(self._last_run_start(), "replay unavailable")
            self._drain_held(now)

    def _repair_done(self, now: float, *, proof: ReplayRequest[M] | None = None) -> None:
        """The repair is over; ``proof``: the request whose answer ended complete with nothing newer held."""
        self._attempts = 0
        owed = self._unproven
        if owed is not None and proof is not None and proof.after_shed and not self._held and not self._deferred:
            self._proven(now, "the replay proved the history complete after a shed")
        if self._restore is not None and not self._disconnected:
            self._show_restored()

    def _proven(self, now: float, reason: str = "live batches in order after a shed") -> None:
        """The history is complete again after the last shed (what the re-open lost was repaired, or counted
        lost by a reset): a live batch received since has been applied in order, or a replay answer asked
        since has ended complete with nothing held."""
        owed, self._unproven = self._unproven, None
        if owed is not None and owed.ready_when_proven:
            self._signal(READY, reason=reason)

    # -- verdicts ----------------------------------------------------------------------------------------

    def _new_engine_seen(self, seq: int, digest: int, nbytes: int, message: M, reason: str) -> None:
        """Rule 5 from a live batch ``seq`` of a confirmed new engine."""
        if seq == 0:
            self._c.restarts_seen += 1
            self._drop_stale()
            self._begin_incarnation(0, reason)
            self._apply(0, digest, message)
        elif self._has_replay:
            self._new_engine_confirmed(reason)  # this batch comes again in the replay from 0
        else:
            self._c.restarts_seen += 1
            self._drop_stale()
            self._begin_incarnation(seq, reason)
            self._apply(seq, digest, message)

    def _new_engine_confirmed(self, reason: str) -> None:
        """A new incarnation: drop every batch held or deferred so far (which engine sent one received
        around a reconnect cannot be told) and replay the new one's history from 0; the batches received
        from now on are the new engine's and wait for its first reply."""
        self._c.restarts_seen += 1
        self._drop_stale()
        self._enter(Phase.AWAITING_NEW_ENGINE)
        if not self._disconnected:
            self._ask(ReplayPurpose.NEW_ENGINE)

    def _begin_incarnation(self, first: int, reason: str) -> None:
        """Reset to a new incarnation whose history continues at ``first`` (complete if it is 0)."""
        self._enter(Phase.REPAIRING if self._outstanding is not None else Phase.LIVE)
        self._forget_digests()
        self._loss_base = 0
        self._applied = first - 1
        state = READY if first == 0 else DEGRADED
        self._signal(state, reset=True, lost=first, reason=reason)

    def _lose_history(self, next_start: int | None, reason: str) -> None:
        """History before ``next_start`` cannot be had: reset, DEGRADED, continue from there (or from the
        next live batch if None)."""
        self._c.history_losses += 1
        base = self._loss_base if self._phase is Phase.UNANCHORED else self._applied + 1
        lost = 0 if next_start is None else max(0, next_start - base)
        self._forget_digests()
        if next_start is None:
            self._enter(Phase.UNANCHORED)
            self._loss_base = base
            self._applied = -1
        else:
            self._skip_to(next_start)
        self._signal(DEGRADED, reset=True, lost=lost, reason=reason)

    # -- primitives --------------------------------------------------------------------------------------

    def _defer(self, seq: int, digest: int, nbytes: int, message: M) -> None:
        self._deferred.append((seq, digest, nbytes, message))
        self.held_bytes += nbytes

    def _keep_ahead(self, seq: int, digest: int, nbytes: int, message: M) -> None:
        ahead = self._ahead
        if seq not in ahead:
            ahead[seq] = (seq, digest, nbytes, message)
            self.held_bytes += nbytes

    def _take_ahead(self, seq: int) -> tuple[int, int, int, M]:
        item = self._ahead.pop(seq)
        self.held_bytes -= item[2]
        return item

    def _clear_ahead(self) -> None:
        ahead = self._ahead
        for item in ahead.values():
            self.held_bytes -= item[2]
        ahead.clear()

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

        While a shed's proof is owed, READY is shown as DEGRADED until the proof."""
        owed = self._unproven
        if owed is not None:
            if state is DEGRADED or reset or lost:
                owed.ready_when_proven = False
            if reset:
                owed.proof_seq = None  # the seqs start anew: the next live batch is the proof to wait for
            if state is READY:
                state, reason = DEGRADED, f"{reason}; unproven after a shed"
                owed.ready_when_proven = True
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

    def _settle(self, now: float) -> None:
        """After every input: start a repair the reorder window or wait calls for, or the check a shed
        asked for; set deadline and _fast."""
        while self._held and self._phase is Phase.LIVE:
            if self._has_replay and self._disconnected:
                break  # the reconnect's identity check comes first
            if self._hold_since is None:
                self._hold_since = now
            if len(self._held) <= self._window and now < self._hold_since + self._wait:
                break
            self._hold_since = now
            if self._has_replay:
                self._ask(ReplayPurpose.BOOTSTRAP if self._applied < 0 else ReplayPurpose.ANCHOR)
            else:
                self._lose_history(min(self._held), "seq gap and no replay socket")
                self._drain_held(now)
        if not self._held:
            self._hold_since = None
        owed = self._unproven
        if owed is not None and owed.proof_seq is not None and self._applied >= owed.proof_seq:
            self._proven(now)
            owed = None
        probe_at = owed.probe_at if owed is not None else None
        if probe_at is not None and (self._held or self._phase is not Phase.LIVE or self._disconnected):
            probe_at = None  # a repair or an identity check comes first (and may prove the history itself)
        if owed is not None and probe_at is not None and now >= probe_at:
            owed.probe_at = probe_at = None
            self._ask(ReplayPurpose.ANCHOR, probe=True)
        waiting = self._held and self._phase is Phase.LIVE and not (self._has_replay and self._disconnected)
        self.deadline = None if not waiting or self._hold_since is None else self._hold_since + self._wait
        if probe_at is not None:
            self.deadline = probe_at
        self._fast = self._phase is Phase.LIVE and not (
            self._held
            or self._deferred
            or self._disconnected
            or self._unproven is not None
            or self._applied < 0  # the first apply goes the slow way (it records _ever_applied)
        )
