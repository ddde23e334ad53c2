"""The replay client: one DEALER to the engine's replay ROUTER, streaming replies as they arrive.

vLLM answers a request ``[b"", start_seq8]`` with every buffered batch from ``start_seq`` on and an end
marker (docs/spec/vllm-wire.md §9.1). Its ROUTER drops silently past its send HWM (1000 messages), mid-answer and
possibly the end marker, so an answer is never trusted to be complete: the sans-IO
:class:`~kvagent.vllm.sequence.SourceSync` checks every reply and asks again from the first hole.

Replies are never collected here: each one goes to the :class:`ReplaySink` as it arrives (the listener's
inbox, which feeds ``SourceSync.on_replay_reply``), so memory stays bounded whatever the answer's length;
the client stops reading while the sink is full (the ROUTER then drops, and the hole is asked again).

An attempt ends at the end marker (complete), a malformed reply, an idle timeout (long before the first
reply — the engine scans its buffer first — short after it), or its total time bound (all incomplete).
:meth:`ReplayClient.cancel` abandons the outstanding request: the DEALER is dropped and a fresh one
connected, whose new identity makes the ROUTER route the abandoned answer's stale replies nowhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import structlog
import trio
import zmq

from kvagent._util.sync import Changed
from kvagent._util.zmqtrio import TrioSocket
from kvagent.model.errors import WireDecodeError
from kvagent.vllm.decode import split_replay_frames

__all__ = ["ReplayClient", "ReplayReply", "ReplaySink", "ReplayTimeouts", "parse_replay_reply"]

log = structlog.get_logger(__name__)

_positive = attrs.validators.gt(0.0)


@attrs.frozen(slots=True)
class ReplayTimeouts:
    """Bounds of one replay attempt, in seconds."""

    first_reply: float = attrs.field(default=5.0, validator=_positive)  # request → first reply
    idle: float = attrs.field(default=0.5, validator=_positive)  # between replies once they started
    total: float = attrs.field(default=60.0, validator=_positive)  # the whole attempt


@attrs.frozen(slots=True)
class ReplayReply:
    """One data reply as the DEALER sees it (``topic`` is empty in the pre-0.26 and SGLang layouts)."""

    seq: int
    topic: bytes
    payload: bytes


def parse_replay_reply(frames: Sequence[bytes], *, max_payload_bytes: int) -> ReplayReply | None:
    """A reply's seq and raw payload (not decoded), or None for the end marker.

    Raises WireDecodeError for anything else, following Dynamo: a data reply with an empty payload, an end
    marker with a non-empty one, and a frame layout that is neither ``[b"", seq, payload]`` nor
    ``[b"", topic, seq, payload]``.
    """
    reply = split_replay_frames(frames)
    if reply is None:
        return None
    topic, seq, payload = reply
    if len(payload) > max_payload_bytes:
        raise WireDecodeError(f"ZMQ payload exceeds {max_payload_bytes} bytes")
    return ReplayReply(seq, bytes(topic), payload)


class ReplaySink(Protocol):
    """Where the client streams an attempt's outcome; ``request`` is the id :meth:`ReplayClient.request` gave."""

    def on_reply(self, request: int, reply: ReplayReply) -> None: ...

    def on_end(self, request: int, complete: bool, reason: str) -> None: ...

    async def wait_for_room(self) -> None:
        """Return once the sink can take another reply (bounds the replies in flight)."""


class ReplayClient:
    """One DEALER connected to the engine's replay ROUTER, owned by the :meth:`run` task.

    :meth:`request` and :meth:`cancel` are called from the listener's processor task; they only hand the
    request over (or cancel it), the socket itself is touched by :meth:`run` alone.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        sink: ReplaySink,
        *,
        max_payload_bytes: int,
        timeouts: ReplayTimeouts = ReplayTimeouts(),
    ) -> None:
        self.context = context
        self.endpoint = endpoint
        self.sink = sink
        self.max_payload_bytes = max_payload_bytes
        self.timeouts = timeouts
        self.requests = 0
        self.replies = 0
        self.reconnects = 0
        self._request_id = 0
        self._pending: tuple[int, int] | None = None  # (request id, start seq) not yet sent
        self._attempt = trio.CancelScope()  # the running attempt (a fresh, unused scope when idle)
        self._requested = Changed()  # a request was made
        self._socket = self._connect()

    @property
    def current_request(self) -> int:
        """The id of the newest request; replies tagged with any other id are stale."""
        return self._request_id

    def request(self, start: int) -> int:
        """Ask for every buffered batch from ``start`` on; abandons any outstanding request first."""
        self.cancel()
        self._pending = (self._request_id, start)
        self.requests += 1
        self._requested.notify()
        return self._request_id

    def cancel(self) -> None:
        """Abandon the outstanding request: no more replies or end for it reach the sink."""
        self._request_id += 1
        self._pending = None
        self._attempt.cancel()

    def _connect(self) -> TrioSocket:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint)
        return TrioSocket(dealer)

    def _reconnect(self) -> None:
        # Replies to an abandoned request may still be on their way; a fresh DEALER has a new identity,
        # so the ROUTER routes those stale replies nowhere instead of into the next attempt.
        self._socket.close()
        self._socket = self._connect()
        self.reconnects += 1

    def close(self) -> None:
        self._socket.close()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve requests one at a time until cancelled; closes the DEALER on the way out."""
        task_status.started()
        try:
            while True:
                while (pending := self._pending) is None:
                    await self._requested.wait(self._requested.version)  # no await since the look
                request, start = pending
                self._pending = None
                self._attempt = trio.CancelScope()
                complete = False
                with self._attempt:
                    complete = await self._attempt_once(request, start)
                if not complete:
                    self._reconnect()
        finally:
            self.close()

    async def _attempt_once(self, request: int, start: int) -> bool:
        """One request streamed into the sink; True when the end marker arrived."""
        timeouts = self.timeouts
        with trio.move_on_after(timeouts.total):
            await self._socket.send_multipart([b"", start.to_bytes(8, "big")])
            timeout = timeouts.first_reply
            while True:
                await self.sink.wait_for_room()
                with trio.move_on_after(timeout) as idle:
                    frames = await self._socket.recv_multipart()
                if idle.cancelled_caught:
                    self._end(request, False, "replay idle timeout")
                    return False
                timeout = timeouts.idle
                try:
                    reply = parse_replay_reply(frames, max_payload_bytes=self.max_payload_bytes)
                except WireDecodeError as exc:
                    log.warning("vllm_replay_reply_malformed", start=start, error=str(exc))
                    self._end(request, False, f"malformed replay reply: {exc}")
                    return False
                if reply is None:
                    self._end(request, True, "")
                    return True
                if request == self._request_id:
                    self.replies += 1
                    self.sink.on_reply(request, reply)
        self._end(request, False, "replay total timeout")
        return False

    def _end(self, request: int, complete: bool, reason: str) -> None:
        if request == self._request_id:
            self.sink.on_end(request, complete, reason)
