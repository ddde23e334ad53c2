"""Gap repair from vLLM's replay socket (ROUTER/DEALER), and the sans-IO sequence gate.

The engine's seq counts batches per publisher and per DP rank, starting at 0; it goes back to 0 when the
engine restarts (no epoch, no clear). :class:`SequenceGate` classifies every seq with two watermarks
(vllm-wire.md §9.2, llm-d-router PR #1887): the last seq *applied* and the last seq *seen live*. Keeping
them apart lets live copies of a replayed range count as duplicates while a live seq going backwards still
reads as an in-place restart.

:class:`ReplayClient` owns one DEALER (used only by the listener task) and runs one request at a time,
collecting replies into a :class:`ReplayAttempt` so a cancelled or abandoned attempt keeps what it got.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import attrs
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.model.errors import WireDecodeError
from kvagent.vllm.decode import RawMessage, decode_replay_reply

__all__ = ["ReplayAttempt", "ReplayClient", "SeqDecision", "SequenceGate"]

log = logging.getLogger(__name__)


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


@attrs.define
class ReplayAttempt:
    """What one replay request produced; filled in as replies arrive."""

    start: int
    messages: list[RawMessage] = attrs.Factory(list)
    complete: bool = False  # the end marker arrived
    error: str | None = None

    @property
    def first_seq(self) -> int | None:
        return self.messages[0].seq if self.messages else None


class ReplayClient:
    """One DEALER connected to the engine's replay ROUTER, owned by the listener task."""

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        *,
        inactivity_timeout: float = 5.0,
        max_payload_bytes: int,
    ) -> None:
        self.context = context
        self.endpoint = endpoint
        self.inactivity_timeout = inactivity_timeout
        self.max_payload_bytes = max_payload_bytes
        self.socket = self._connect()

    def _connect(self) -> TrioSocket:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint)
        return TrioSocket(dealer)

    def _reconnect(self) -> None:
        # Replies to an abandoned request may still be on their way; a fresh DEALER has a new identity,
        # so the ROUTER routes those stale replies nowhere instead of into the next attempt.
        self.socket.close()
        self.socket = self._connect()

    def close(self) -> None:
        self.socket.close()

    async def fetch(self, attempt: ReplayAttempt) -> None:
        """Request every buffered batch with ``seq >= attempt.start``; fills ``attempt`` oldest first.

        Ends at the end marker, a malformed reply, or ``inactivity_timeout`` without a reply. A reply
        below the requested start is ignored (it can only be a stray from an earlier request).
        """
        try:
            await self.socket.send_multipart([b"", attempt.start.to_bytes(8, "big")])
            while True:
                with trio.move_on_after(self.inactivity_timeout) as idle:
                    frames = await self.socket.recv_multipart()
                if idle.cancelled_caught:
                    attempt.error = "replay inactivity timeout"
                    return
                try:
                    message = decode_replay_reply(frames, max_payload_bytes=self.max_payload_bytes)
                except WireDecodeError as exc:
                    attempt.error = f"malformed replay reply: {exc}"
                    return
                if message is None:
                    attempt.complete = True
                    return
                if message.seq >= attempt.start:
                    attempt.messages.append(message)
        finally:
            if not attempt.complete:
                self._reconnect()
