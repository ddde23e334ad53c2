"""Sans-IO synchronisation of one attachment's raw batch stream with the engine's history (issue #14).

The engine numbers its batches 0, 1, 2, ... per process and starts again at 0 when it restarts, with no
epoch (docs/spec/vllm-wire.md §4, §10).  :class:`SourceSync` decides, from the live seqs, the replay answers and the
SUB monitor's connection events, which batches are applied in which order and what the attachment's state
is (``ready`` only while the applied history is exactly the engine's, docs/trust.md).  A seq alone cannot
tell a late batch from a restarted engine, so it keeps the payload digest of the last ``digest_memory``
applied seqs: a live seq at or below the last applied one is a duplicate only if its bytes match; without a
digest to compare, the replay socket is asked for the anchor (the last applied seq) and its bytes decide.

The shell feeds events in and executes the actions (:meth:`SourceSync.take_actions`) in order; time comes
in only through the ``now`` arguments.  The common case, a live seq equal to the last applied plus one with
nothing held, is a few attribute updates and one :class:`Apply`.  The state and its primitives live in
:mod:`kvagent.vllm.sync_state`, the actions in :mod:`kvagent.vllm.sync_actions` (re-exported here).

What the shell must guarantee (the SUB monitor and the SUB are separate sockets): ``on_disconnected`` comes
before any batch of a later connection, and the old connection's queued batches come before
``on_connected``.  Batches of the new connection may come before ``on_connected``: with replay, live batches
are held from the disconnect until the reconnect's identity check.
"""

from __future__ import annotations

import collections

from kvagent.vllm.sync_actions import (
    Action,
    Apply,
    CancelReplay,
    M,
    RequestReplay,
    Signal,
    SyncStatistics,
)
from kvagent.vllm.sync_state import DEGRADED, DISCONNECTED, READY, ReplayPurpose, SourceSyncBase

__all__ = [
    "Action",
    "Apply",
    "CancelReplay",
    "RequestReplay",
    "Signal",
    "SourceSync",
    "SyncStatistics",
]


class SourceSync(SourceSyncBase[M]):
    """The source synchronisation state machine of one attachment (docs/trust.md, rules 1-8).

    ``SourceSync(*, has_replay, reorder_window=8, reorder_wait=0.05, max_attempts_without_progress=3,
    digest_memory=4096, cold_bootstrap=True, resume=None)``; the state and its primitives are
    :class:`~kvagent.vllm.sync_state.SourceSyncBase`'s, the rules are here.
    """

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
                self._deferring = True
                self._request(ReplayPurpose.ANCHOR, strict=True)
            else:
                self._lose_history(None, "resumed without a replay socket: the engine cannot be checked")
        elif self._bootstrap:
            self._unanchored = False
            self._request(ReplayPurpose.BOOTSTRAP)
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
        if self._replay is None or seq < self._replay_start:
            self._c.replay_stray += 1
            return
        request = self._request_id
        if self._first_pending:
            if seq != self._replay_start:
                self._keep_ahead(seq, digest, nbytes, message)
                if len(self._ahead) <= self._window:
                    self._settle(now)  # the start may come next: a reorder within the answer
                    return
                seq, digest, nbytes, message = self._take_ahead(min(self._ahead))
            if not self._resolve_first(seq, digest, now):
                self._settle(now)
                return
        self._reply(request, seq, digest, nbytes, message, now)
        if self._refeed_after_reply:
            self._refeed_after_reply = False
            self._refeed(now)
        self._settle(now)

    def _resolve_first(self, seq: int, digest: int, now: float) -> bool:
        """Interpret the answer's first seq; False if that abandoned the request (a new engine, or done)."""
        self._first_pending = False
        request = self._request_id
        self._first_reply(seq, digest, now)
        return self._request_id == request

    def _reply(self, request: int, seq: int, digest: int, nbytes: int, message: M, now: float) -> None:
        expected = self._applied + 1
        if seq > expected:
            self._keep_ahead(seq, digest, nbytes, message)
            if len(self._ahead) > self._window:  # a hole mid-answer: the ROUTER's send HWM dropped replies
                self._hole(now)
            return
        if seq == expected:
            self._apply_reply(seq, digest, message, now)
        # seq < expected: the anchor itself, or a batch already applied from a live copy.
        self._drain_ahead(request, now)

    def _drain_ahead(self, request: int, now: float) -> None:
        """Apply the replies kept ahead that are now next (while the same request is outstanding)."""
        ahead = self._ahead
        while ahead and self._request_id == request:
            for stale in [kept for kept in ahead if kept <= self._applied]:
                self._take_ahead(stale)
            nxt = self._applied + 1
            if nxt not in ahead:
                return
            _, digest, _, message = self._take_ahead(nxt)
            self._apply_reply(nxt, digest, message, now)

    def _hole(self, now: float) -> None:
        self._c.replay_holes += 1
        self._cancel()
        self._retry(ReplayPurpose.REPAIR, now)

    def on_replay_end(self, complete: bool, now: float) -> None:
        """The outstanding request ended: its end marker (``complete``), or a timeout or error."""
        purpose = self._replay
        if purpose is None:
            self._c.replay_stray += 1
            return
        request = self._request_id
        if self._first_pending and self._ahead:
            # The requested start never came: the answer's lowest seq is its first. The request has ended
            # for the shell, so nothing decided now cancels it (no CancelReplay).
            self._ended = True
            try:
                seq, digest, nbytes, message = self._take_ahead(min(self._ahead))
                if self._resolve_first(seq, digest, now):
                    self._reply(request, seq, digest, nbytes, message, now)
                if self._refeed_after_reply:
                    self._refeed_after_reply = False
                    self._refeed(now)
            finally:
                self._ended = False
            if self._request_id != request:  # abandoned, finished or asked anew meanwhile
                self._settle(now)
                return
        hole = bool(self._ahead)  # replies after a seq the answer never carried
        self._clear_ahead()
        self._replay = None
        if hole:
            self._c.replay_holes += 1
            self._retry(ReplayPurpose.REPAIR, now)
        elif complete and self._first_pending:
            self._empty_answer(purpose, now)
        elif complete and not self._held and not self._progress:
            self._repair_done(now, caught_up=True)  # only the anchor came back: nothing newer to repair
        elif self._progress:
            # Cut short (a timeout, an error), or ended: the send HWM may have dropped the answer's tail
            # and let the end marker through, so ask again from the first missing seq until an answer
            # reaches the held batches or comes back empty.
            self._attempts = 0
            self._request(ReplayPurpose.REPAIR)
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
            self._restore = READY if self._ready_when_proven else self._state
        self._state = DISCONNECTED
        self._actions.append(Signal(state=DISCONNECTED, reason="engine disconnected"))
        if self._replay is not None:
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
        if self._has_replay and self._new_engine_pending:
            # Which engine sent what the lost connection delivered cannot be told: the replay has it all.
            self._drop_stale()
            self._request(ReplayPurpose.NEW_ENGINE)
        elif not self._ever_applied or self._unanchored:
            # Nothing to check the engine against: what the lost connection delivered may be another
            # engine's. A cold start (rule 7) or, after a reset, the next batch decides.
            self._drop_stale()
            if not self._ever_applied and self._bootstrap:
                self._unanchored = False
                self._request(ReplayPurpose.BOOTSTRAP)
            elif not self._ever_applied:
                self._unanchored = True
        elif self._has_replay:
            self._deferring = True
            self._request(ReplayPurpose.ANCHOR, strict=True)
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
        ready, until a live batch received after the shed has been applied in order (issue #28).
        """
        freed = self.held_bytes
        self._c.shed_held_batches += len(self._held) + len(self._deferred)  # (replies kept ahead: below)
        self._c.shed_held_bytes += freed
        self._c.shed_held_batches += len(self._ahead)
        self._held.clear()
        self._deferred.clear()
        self._ahead.clear()
        self.held_bytes = 0
        self._hold_since = None
        self._c.ingest_sheds += 1
        self._unproven, self._proof_seq, self._probe_at = True, None, None
        if self._disconnected:
            pass  # the reconnect shows what _restore holds, and _signal keeps READY back until the proof
        elif self._state is READY:
            self._signal(DEGRADED, reason="live batches shed: history unproven until a later batch applies in order")
            self._ready_when_proven = True
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
        if self._unproven and self._has_replay:
            self._probe_at = now + self._wait
        self._settle(now)

    # -- live batches ------------------------------------------------------------------------------------

    def _live(self, seq: int, digest: int, nbytes: int, message: M, now: float) -> None:
        if self._unproven and self._proof_seq is None:
            self._proof_seq = seq  # received on the SUB opened after the shed
        if self._deferring:
            self._defer(seq, digest, nbytes, message)
            return
        held_for_reconnect = self._disconnected and self._has_replay
        if self._unanchored and not held_for_reconnect:
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
        elif self._replay is not None or seq > applied + 1 or held_for_reconnect:
            # Held: a gap, a replay in flight, or the engine's identity to be checked at the reconnect (a
            # batch of a new connection received before its connect event must not pass as the old one's).
            if not self._held and self._replay is None and seq > applied + 1:
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
            self._deferring = True
            self._defer(seq, digest, nbytes, message)
            if not self._disconnected:
                self._request(ReplayPurpose.ANCHOR, strict=True)
        else:
            # A restart, or a batch so late its digest is forgotten: nothing can tell without replay. Reset and
            # continue from the next batch, without this one (if it is a late one, it is stale).
            self._c.suspected_restarts += 1
            self._drop_stale()
            self._lose_history(None, "seq went back: engine restarted or a batch arrived late")

    def _accept_first(self, seq: int, digest: int, message: M) -> None:
        """The first batch after a start without bootstrap, or after a reset with no known continuation."""
        self._unanchored = False
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

    def _apply_reply(self, seq: int, digest: int, message: M, now: float) -> None:
        had_held = bool(self._held)
        live_copy = self._held.pop(seq, None)
        if live_copy is not None:
            self.held_bytes -= live_copy[1]
            self._c.duplicates += 1
        self._apply(seq, digest, message, replayed=True)
        self._repaired += 1
        self._progress = True
        self._drain_held(now)
        if had_held and not self._held:
            # Contiguous up to (and through) the held batches: the live stream carries the rest.
            self._cancel()
            self._repair_done(now)

    # -- replay ------------------------------------------------------------------------------------------

    def _first_reply(self, seq: int, digest: int, now: float) -> None:
        """Interpret the first reply of an answer (which may abandon it, or end the repair)."""
        purpose, start = self._replay, self._replay_start
        if purpose is ReplayPurpose.ANCHOR:
            if seq == start:
                slot = seq % self._capacity
                if self._ring_seq[slot] != seq or self._ring_digest[slot] != digest:
                    self._new_engine_confirmed("engine restarted (replay anchor differs)")
                elif self._strict:
                    self._identity_confirmed(now)
                else:
                    self._replay = ReplayPurpose.REPAIR
                return
            if self._strict:
                self._new_engine_confirmed("engine restarted (replay anchor missing)")
                return
            # The engine just evicted the anchor (first reply start + 1), or no longer holds the gap.
            self._replay = ReplayPurpose.REPAIR
            if seq > start + 1:
                self._lose_history(seq, "gap no longer in the engine's replay buffer")
        elif purpose is ReplayPurpose.REPAIR:
            if seq > start:
                self._lose_history(seq, "gap no longer in the engine's replay buffer")
        elif purpose is ReplayPurpose.BOOTSTRAP:
            self._replay = ReplayPurpose.REPAIR
            lost = max(0, seq - self._loss_base)
            state = READY if seq == 0 else DEGRADED
            reason = "history before the replay buffer lost" if lost else "history complete from seq 0"
            self._signal(state, lost=lost, reason=reason)
            self._skip_to(seq)
        else:  # NEW_ENGINE
            self._replay = ReplayPurpose.REPAIR
            self._begin_incarnation(seq, "engine restarted")
            self._refeed_after_reply = True

    def _identity_confirmed(self, now: float) -> None:
        """The anchor matched: the same engine, so the suspect was a late batch. The deferred live batches
        are read again; after a reconnect the answer goes on as the repair of what the SUB missed."""
        self._strict = False
        self._deferring = False
        if self._restore is None:
            self._cancel()  # no reconnect: anything still missing shows as a gap among the live batches
        else:
            self._replay = ReplayPurpose.REPAIR
        self._trust_late = True
        try:
            self._refeed(now)
        finally:
            self._trust_late = False

    def _empty_answer(self, purpose: ReplayPurpose, now: float) -> None:
        """The end marker came first: the engine holds nothing at or after the requested start."""
        if purpose is ReplayPurpose.NEW_ENGINE:
            first = min((item[0] for item in self._deferred), default=0)
            self._begin_incarnation(first, "engine restarted")
            self._refeed(now)
        elif purpose is ReplayPurpose.ANCHOR and self._strict:
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
                self._repair_done(now, caught_up=True)

    def _retry(self, purpose: ReplayPurpose, now: float) -> None:
        """The next attempt after a cut answer: counted as without progress if it applied nothing."""
        if self._progress:
            self._attempts = 0
            self._request(ReplayPurpose.REPAIR)
        else:
            self._attempt_failed(purpose, now)

    def _attempt_failed(self, purpose: ReplayPurpose, now: float) -> None:
        self._c.replay_attempts_without_progress += 1
        if purpose is ReplayPurpose.BOOTSTRAP and self._applied >= 0:
            purpose = ReplayPurpose.REPAIR  # the empty answer anchored the history at 0 and some was applied
        self._attempts += 1
        if self._attempts < self._max_attempts:
            self._request(purpose, strict=self._strict)
            return
        self._attempts = 0
        if self._probing and not self._held:
            self._probing = False  # nothing to repair is known: a live batch in order may still prove the history
        elif purpose is ReplayPurpose.BOOTSTRAP:
            self._signal(DEGRADED, reason="replay unavailable: history unknown")
            self._unanchored = True
            self._refeed_held(now)
        elif purpose is ReplayPurpose.NEW_ENGINE:
            # The batches deferred since the request are the new engine's: continue from the oldest.
            first = min((item[0] for item in self._deferred), default=None)
            if first is None:
                self._new_engine_pending = self._deferring = False
                self._lose_history(None, "engine restarted; replay unavailable")
            else:
                self._begin_incarnation(first, "engine restarted; replay unavailable")
            self._refeed(now)
        elif self._strict:
            # Same engine or a new one: nobody can tell. Reset, and start over from the next live batch.
            self._c.ambiguous += 1
            self._drop_stale()
            self._deferring = False
            self._lose_history(None, "engine identity unknown: replay unavailable")
        else:
            self._lose_history(self._last_run_start(), "replay unavailable")
            self._drain_held(now)

    def _proven(self, now: float, reason: str = "live batches in order after a shed") -> None:
        """The history is complete again after the last shed (what the re-open lost was repaired, or counted
        lost by a reset): a live batch received since has been applied in order, or a replay answer asked
        since has ended complete with nothing held."""
        self._unproven, self._proof_seq, self._probe_at, self._probing = False, None, None, False
        if self._ready_when_proven:
            self._ready_when_proven = False
            self._signal(READY, reason=reason)

    def _repair_done(self, now: float, *, caught_up: bool = False) -> None:
        """The repair is over (``caught_up``: the answer ended complete with nothing newer held)."""
        self._attempts = 0
        if caught_up and self._unproven and self._request_after_shed and not self._held and not self._deferred:
            self._proven(now, "the replay proved the history complete after a shed")
        if self._restore is not None and not self._disconnected:
            self._show_restored()

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
        self._deferring = True
        self._new_engine_pending = True
        if not self._disconnected:
            self._request(ReplayPurpose.NEW_ENGINE)

    def _begin_incarnation(self, first: int, reason: str) -> None:
        """Reset to a new incarnation whose history continues at ``first`` (complete if it is 0)."""
        self._new_engine_pending = False
        self._deferring = False
        self._unanchored = False
        self._forget_digests()
        self._loss_base = 0
        self._applied = first - 1
        state = READY if first == 0 else DEGRADED
        self._signal(state, reset=True, lost=first, reason=reason)

    def _lose_history(self, next_start: int | None, reason: str) -> None:
        """History before ``next_start`` cannot be had: reset, DEGRADED, continue from there (or from the
        next live batch if None)."""
        self._c.history_losses += 1
        base = self._loss_base if self._unanchored else self._applied + 1
        lost = 0 if next_start is None else max(0, next_start - base)
        self._forget_digests()
        if next_start is None:
            self._unanchored = True
            self._loss_base = base
            self._applied = -1
        else:
            self._skip_to(next_start)
        self._signal(DEGRADED, reset=True, lost=lost, reason=reason)

    def _refeed_held(self, now: float) -> None:
        """Process the held batches again in seq order (after the sync became unanchored)."""
        items = sorted(self._held.items())
        self._held.clear()
        for seq, (digest, nbytes, message) in items:
            self.held_bytes -= nbytes
            self._live(seq, digest, nbytes, message, now)

    def _settle(self, now: float) -> None:
        """After every input: start a repair the reorder window or wait calls for, set deadline and _fast."""
        while self._held and self._replay is None and not self._deferring and not self._unanchored:
            if self._has_replay and self._disconnected:
                break  # the reconnect's identity check comes first
            if self._hold_since is None:
                self._hold_since = now
            if len(self._held) <= self._window and now < self._hold_since + self._wait:
                break
            self._hold_since = now
            if self._has_replay:
                self._request(ReplayPurpose.BOOTSTRAP if self._applied < 0 else ReplayPurpose.ANCHOR)
            else:
                self._lose_history(min(self._held), "seq gap and no replay socket")
                self._drain_held(now)
        if not self._held:
            self._hold_since = None
        if self._unproven and self._proof_seq is not None and self._applied >= self._proof_seq:
            self._proven(now)
        probe_at = self._probe_at
        if probe_at is not None and (
            self._held or self._replay is not None or self._deferring or self._unanchored or self._disconnected
        ):
            probe_at = None  # a repair or an identity check comes first (and may prove the history itself)
        if probe_at is not None and now >= probe_at:
            self._probe_at = probe_at = None
            self._request(ReplayPurpose.ANCHOR, probe=True)
        waiting = self._held and self._replay is None and not self._deferring and not self._unanchored
        waiting = waiting and not (self._has_replay and self._disconnected)
        self.deadline = None if not waiting or self._hold_since is None else self._hold_since + self._wait
        if probe_at is not None:
            self.deadline = probe_at
        self._fast = not (
            self._held
            or self._deferred
            or self._deferring
            or self._replay is not None
            or self._unanchored
            or self._disconnected
            or self._unproven
            or self._applied < 0  # the first apply goes the slow way (it records _ever_applied)
        )
