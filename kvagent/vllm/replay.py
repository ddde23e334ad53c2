"""Gap repair from vLLM's replay socket (ROUTER/DEALER), and the sans-IO sequence gate.

The engine's seq counts batches per publisher and per DP rank, starting at 0; it goes back to 0 when the
engine restarts (no epoch, no clear). The gate classifies every live seq; the replay client fetches a
missing range before the live batch that exposed it is applied, so a late replayed ``Stored(A)`` can never
resurrect a block that a newer live ``Removed(A)`` deleted. Live messages that arrive while a replay runs
wait in the SUB socket's own queue (bounded by RCVHWM) and are read, in order, afterwards.
"""

from __future__ import annotations

import enum
import logging

import attrs
import trio

from kvagent.vllm.wire import RawMessage, WireDecodeError, decode_replay_reply
from kvagent.zmqtrio import TrioSocket

__all__ = ["ReplayClient", "ReplayOutcome", "SeqDecision", "SequenceGate"]

log = logging.getLogger(__name__)


class SeqDecision(enum.Enum):
    APPLY = "apply"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


@attrs.define
class SequenceGate:
    """Tracks the last applied seq of one attachment's raw stream."""

    last: int | None = None
    # After a replay, live copies of the replayed seqs are duplicates until a newer live seq arrives.
    overlap_until: int | None = None

    def expected(self) -> int | None:
        return None if self.last is None else self.last + 1

    def classify(self, seq: int) -> SeqDecision:
        if self.overlap_until is not None:
            if seq <= self.overlap_until:
                return SeqDecision.DUPLICATE
            self.overlap_until = None
        if self.last is None or seq == self.last + 1:
            return SeqDecision.APPLY
        if seq > self.last + 1:
            return SeqDecision.GAP
        if seq == self.last:
            return SeqDecision.DUPLICATE
        return SeqDecision.RESTART

    def applied(self, seq: int) -> None:
        self.last = seq

    def replayed_through(self, seq: int) -> None:
        self.last = seq if self.last is None else max(self.last, seq)
        self.overlap_until = self.last


@attrs.frozen(slots=True)
class ReplayOutcome:
    messages: tuple[RawMessage, ...]
    first_seq: int | None
    complete: bool  # the end marker arrived before the inactivity timeout
    error: str | None = None


class ReplayClient:
    """A DEALER owned by the listener task; one request at a time."""

    def __init__(
        self, socket: TrioSocket, *, inactivity_timeout: float = 5.0, max_payload_bytes: int
    ) -> None:
        self.socket = socket
        self.inactivity_timeout = inactivity_timeout
        self.max_payload_bytes = max_payload_bytes

    def _drain_stale(self) -> None:
        import zmq

        while True:
            try:
                self.socket.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    async def fetch(self, start_seq: int, *, stop_before: int | None = None) -> ReplayOutcome:
        """Every buffered batch with ``start_seq <= seq`` (and ``< stop_before`` if given), oldest first."""
        self._drain_stale()  # replies to an earlier, timed-out request must not be mistaken for these
        await self.socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        messages: list[RawMessage] = []
        first: int | None = None
        while True:
            with trio.move_on_after(self.inactivity_timeout):
                frames = await self.socket.recv_multipart()
                try:
                    message = decode_replay_reply(frames, max_payload_bytes=self.max_payload_bytes)
                except WireDecodeError as exc:
                    return ReplayOutcome(tuple(messages), first, False, str(exc))
                if message is None:
                    return ReplayOutcome(tuple(messages), first, True)
                if first is None:
                    first = message.seq
                if message.seq >= start_seq and (stop_before is None or message.seq < stop_before):
                    messages.append(message)
                continue
            return ReplayOutcome(tuple(messages), first, False, "replay inactivity timeout")
