"""The server side of one websocket connection, without I/O: framing, the queues and the close state machine.

:class:`WebSocketCore` is sans-IO in the sense of wsproto and hypercorn's ``protocol/``: it is fed the bytes
that arrived (:meth:`WebSocketCore.receive_data`) and asked for the bytes to write
(:meth:`WebSocketCore.outgoing`, :meth:`WebSocketCore.sent`); the time is passed in.  It imports neither
trio nor a socket, so every rule below is tested without either.  The Trio driver that owns the socket,
the tasks and the waiting is :mod:`kvagent.recovery.websocket`.

* **Inbound, bounded in bytes.**  Requests are reassembled from wsproto's message events and queued for
  the session.  The message limit counts *bytes* (a text message's UTF-8 length, not its characters); a
  message over it is dropped as it arrives and queued as :class:`MessageTooBig` (the session answers
  ``bad_request``; the connection stays usable).  Queued messages and the message being assembled count
  against ``inbound_bytes`` (each message also costs :data:`MESSAGE_OVERHEAD`, so a flood of empty
  frames is bounded too); :attr:`WebSocketCore.wants_data` turns false at the bound and the driver stops
  reading, which leaves the rest in the peer's TCP window.  Inbound memory per connection is therefore
  at most ``max(inbound_bytes_limit, max_message_size)`` plus one read.
* **Outbound, bounded in bytes.**  :meth:`WebSocketCore.queue_message` raises :class:`QueueFull` when the
  queued payload would pass ``queue_bytes`` (a message larger than the whole bound is admitted alone, into
  an empty queue).  Messages leave as frames of at most :data:`FRAGMENT_BYTES`, so a control frame (pong,
  ping, close) is never further than one frame behind, even in the middle of a 1 MiB answer.
* **Send deadline and close.**  A frame not fully written ``send_deadline`` seconds after it started is an
  overrun: the connection closes with 1013 ``overrun`` right after the frame in flight, queued messages
  dropped.  Every close has an abort time: the driver aborts the transport when the close cannot complete
  by then (``close_grace`` for an urgent close; a normal close also waits the send deadline first).
* **Extensions are refused.**  :func:`accept_response` accepts the upgrade with no extension: a client that
  offers ``permessage-deflate`` (or anything else) gets no ``Sec-WebSocket-Extensions`` header back, and a
  frame with a reserved bit set is then a protocol error (wsproto closes with 1002).
"""

from __future__ import annotations

import struct
from collections import deque

import attrs
from wsproto import WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

__all__ = [
    "CLOSE_ABNORMAL",
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_NORMAL",
    "CLOSE_PING_TIMEOUT",
    "CLOSE_PROTOCOL_ERROR",
    "CLOSE_TRY_AGAIN_LATER",
    "FRAGMENT_BYTES",
    "MESSAGE_OVERHEAD",
    "CloseReason",
    "ConnectionClosed",
    "MessageTooBig",
    "QueueFull",
    "SendLimits",
    "WebSocketCore",
    "accept_response",
    "frame_header",
    "utf8_length",
]

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server is shutting down
CLOSE_PROTOCOL_ERROR = 1002  # sent by wsproto: the peer broke the protocol (e.g. a reserved bit set)
CLOSE_ABNORMAL = 1006  # never sent: the transport ended without a close frame
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013  # follower overrun, or a peer that stopped reading ("overrun")
CLOSE_PING_TIMEOUT = 4000  # the peer did not answer a ping in time

FRAGMENT_BYTES = 64 << 10
MESSAGE_OVERHEAD = 64  # bytes a queued inbound message costs beyond its payload (object, queue slot)

_OP_CONTINUATION, _OP_TEXT, _OP_BINARY = 0x0, 0x1, 0x2


@attrs.frozen(slots=True)
class CloseReason:
    code: int
    reason: str | None = None


class ConnectionClosed(Exception):
    """The connection is closed or closing; ``reason`` says who closed it and why."""

    def __init__(self, reason: CloseReason) -> None:
        super().__init__(f"websocket closed: {reason.code} {reason.reason or ''}".rstrip())
        self.reason = reason


class MessageTooBig(Exception):
    """A request over the byte limit; it was discarded as it arrived and the connection stays usable."""

    def __init__(self, limit: int, *, binary: bool) -> None:
        super().__init__(f"request frame exceeds the {limit}-byte limit")
        self.limit = limit
        self.binary = binary


class QueueFull(Exception):
    """The outbound queue has no room for this message yet (the driver waits, or reports WouldBlock)."""


@attrs.frozen(slots=True)
class SendLimits:
    """The send path's bounds: queued bytes, how long one frame may wait, and the close handshake's grace."""

    queue_bytes: int = 1 << 20
    send_deadline: float = 10.0
    close_grace: float = 2.0

    def __attrs_post_init__(self) -> None:
        if self.queue_bytes <= 0 or self.send_deadline <= 0 or self.close_grace <= 0:
            raise ValueError(f"send limits must be positive, got {self}")


def frame_header(opcode: int, length: int, fin: bool) -> bytes:
    """An unmasked (server to client) RFC 6455 frame header."""
    first = (0x80 if fin else 0) | opcode
    if length < 126:
        return bytes((first, length))
    if length < 1 << 16:
        return struct.pack("!BBH", first, 126, length)
    return struct.pack("!BBQ", first, 127, length)


def utf8_length(text: str) -> int:
    """The bytes ``text`` takes on the wire (``isascii`` is O(1) on CPython, so ASCII costs no encode)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def accept_response(connection: WSConnection) -> bytes:
    """The 101 answer to the upgrade request, refusing every extension the client offered.

    wsproto negotiates only the extensions the server passes here; the empty list is explicit, so no
    ``Sec-WebSocket-Extensions`` header is ever sent and frames stay uncompressed (a compressed answer
    would trade CPU on the serving path for bandwidth that loopback and the LAN do not need, and
    ``permessage-deflate`` is a decompression bomb on the inbound side).
    """
    return connection.send(AcceptConnection(extensions=[]))


class _Outgoing:
    """A queued message: its opcode, its payload and how much of it is already framed."""

    __slots__ = ("framed", "opcode", "payload")

    def __init__(self, opcode: int, payload: bytes) -> None:
        self.opcode = opcode
        self.payload = memoryview(payload)
        self.framed = 0


class WebSocketCore:
    """One accepted connection's protocol state; the driver moves bytes and keeps time.

    ``max_message_size`` is the request limit in bytes; ``inbound_bytes_limit`` (default: the message
    limit) is how many bytes of requests may wait for the session before reading stops.
    """

    def __init__(
        self,
        connection: WSConnection,
        *,
        max_message_size: int,
        limits: SendLimits,
        inbound_bytes_limit: int | None = None,
    ) -> None:
        if max_message_size <= 0:
            raise ValueError(f"max_message_size must be positive, got {max_message_size}")
        self._ws = connection
        self.max_message_size = max_message_size
        self.limits = limits
        self.inbound_bytes_limit = max_message_size if inbound_bytes_limit is None else inbound_bytes_limit
        # Inbound.
        self._inbound: deque[str | bytes | MessageTooBig] = deque()
        self._inbound_sizes: deque[int] = deque()
        self.inbound_bytes = 0  # queued messages (with their overhead) + the message being assembled
        self._parts: list[str | bytes | bytearray] = []
        self._part_bytes = 0
        self._discarding = False
        # Outbound: control frames first, then queued messages; ``_frame`` is the frame being written.
        self._pong: bytes | None = None
        self._ping: bytes | None = None
        self._ping_payload: bytes | None = None
        self._messages: deque[_Outgoing] = deque()
        self.queued_bytes = 0
        self._frame: list[memoryview] = []
        self._frame_payload = 0
        self.frame_started = 0.0
        # Closing.
        self.close_reason: CloseReason | None = None
        self._close_frame: bytes | None = None
        self.close_urgent = False
        self.close_sent = False
        self.close_received = False
        self.peer_closed = False  # the peer started the close (its frame came before any close of ours)
        self.abort_at = float("inf")
        self.finished = False
        self.overrun = False  # the peer stopped accepting frames (send deadline)

    # --- inbound ------------------------------------------------------------------------------------

    @property
    def wants_data(self) -> bool:
        """Whether the driver should read: not after the peer's close, nor with the inbound bound reached.

        With no complete request queued it always reads (the session waits for one, and the message being
        assembled is bounded by the message limit), so inbound memory is at most
        ``max(inbound_bytes_limit, max_message_size)`` plus one read.
        """
        if self.close_received or self.finished:
            return False
        return self.inbound_bytes < self.inbound_bytes_limit or not self._inbound

    @property
    def has_message(self) -> bool:
        return bool(self._inbound)

    def receive_data(self, data: bytes | None, now: float) -> None:
        """Bytes from the peer (None: end of stream).  Answers pings, notes pongs and the peer's close."""
        self._ws.receive_data(data)
        for event in self._ws.events():
            self._on_event(event, now)

    def next_message(self) -> str | bytes | MessageTooBig | None:
        """The oldest complete request (or the note of a discarded one); None when none is queued."""
        if not self._inbound:
            return None
        self.inbound_bytes -= self._inbound_sizes.popleft()
        return self._inbound.popleft()

    def _on_event(self, event: Event, now: float) -> None:
        if isinstance(event, TextMessage | BytesMessage):
            self._on_data(event.data, event.message_finished)
        elif isinstance(event, Ping):
            if self.close_reason is None:
                self._pong = self._ws.send(event.response())  # only the newest (RFC 6455 5.5.3)
        elif isinstance(event, Pong):
            if self._ping_payload is not None and bytes(event.payload) == self._ping_payload:
                self._ping_payload = None
        elif isinstance(event, CloseConnection):
            self._on_close(event, now)

    def _on_data(self, data: str | bytes | bytearray, finished: bool) -> None:
        size = utf8_length(data) if isinstance(data, str) else len(data)
        if not self._discarding:
            self._part_bytes += size
            if self._part_bytes > self.max_message_size:
                self._discarding = True  # dropped as it arrives: the rest of it is never held
                self.inbound_bytes -= self._part_bytes - size
                self._parts = []
            else:
                self._parts.append(data)
                self.inbound_bytes += size
        if not finished:
            return
        message: str | bytes | MessageTooBig
        held = 0 if self._discarding else self._part_bytes
        if self._discarding:
            message = MessageTooBig(self.max_message_size, binary=not isinstance(data, str))
        elif isinstance(data, str):
            message = "".join(self._parts)  # type: ignore[arg-type]
        else:
            message = b"".join(self._parts)  # type: ignore[arg-type]
        self._parts = []
        self._part_bytes = 0
        self._discarding = False
        if self.close_reason is not None:  # closing: requests are no longer read
            self.inbound_bytes -= held
            return
        self._inbound.append(message)
        self._inbound_sizes.append(held + MESSAGE_OVERHEAD)
        self.inbound_bytes += MESSAGE_OVERHEAD

    def _on_close(self, event: CloseConnection, now: float) -> None:
        if self.close_reason is None:
            # The peer started the close (or broke the protocol: wsproto reports that as a close with the
            # error's code): answer at once, dropping whatever was still queued.
            self.close_reason = CloseReason(event.code, event.reason or None)
            self.peer_closed = True
            try:
                self._close_frame = self._ws.send(event.response())
            except LocalProtocolError:  # no reply can be sent: the close is complete as it is
                self._close_frame = None
                self.close_sent = True
            self.close_urgent = True
            self._closing()
            self._discard_messages()
            self.abort_at = min(self.abort_at, now + self.limits.close_grace)
        self.close_received = True

    # --- outbound -----------------------------------------------------------------------------------

    def queue_message(self, message: str | bytes) -> None:
        """Queue a message; QueueFull when it does not fit yet, ConnectionClosed once closing."""
        if self.close_reason is not None:
            raise ConnectionClosed(self.close_reason)
        if isinstance(message, str):
            opcode, payload = _OP_TEXT, message.encode()
        else:
            opcode, payload = _OP_BINARY, message
        if self.queued_bytes and self.queued_bytes + len(payload) > self.limits.queue_bytes:
            raise QueueFull
        self._messages.append(_Outgoing(opcode, payload))
        self.queued_bytes += len(payload)

    def start_ping(self, payload: bytes) -> None:
        """Queue a ping (ahead of messages); :attr:`awaiting_pong` until its pong comes back."""
        if self.close_reason is not None:
            raise ConnectionClosed(self.close_reason)
        self._ping_payload = payload
        self._ping = self._ws.send(Ping(payload=payload))

    @property
    def awaiting_pong(self) -> bool:
        return self._ping_payload is not None

    @property
    def control_pending(self) -> bool:
        """A pong, a ping or a close frame waits to be written (the driver wakes its writer)."""
        return self._pong is not None or self._ping is not None or self._close_frame is not None

    def outgoing(self, now: float) -> list[memoryview] | None:
        """The buffers of the frame to write next (the rest of the frame in flight first); None: nothing."""
        if self._frame:
            return self._frame
        if self.finished:
            return None
        frame = self._next_frame()
        if frame is None:
            return None
        self._frame = frame
        self.frame_started = now
        return frame

    def sent(self, count: int, now: float) -> None:
        """``count`` bytes of :meth:`outgoing`'s buffers were written."""
        frame = self._frame
        while count and frame:
            head = frame[0]
            if len(head) <= count:
                count -= len(head)
                frame.pop(0)
            else:
                frame[0] = head[count:]
                count = 0
        if not frame:
            self.queued_bytes -= self._frame_payload
            self._frame_payload = 0
            if (
                self.close_sent
                and self._close_frame is None
                and self.abort_at > now + self.limits.close_grace
            ):
                # Our close frame is out: the peer gets the close grace to answer it.
                self.abort_at = now + self.limits.close_grace

    def _next_frame(self) -> list[memoryview] | None:
        """The next frame, control frames first; None when there is nothing to write."""
        if self.close_sent:
            return None
        if self._close_frame is not None and (self.close_urgent or not self._messages):
            frame, self._close_frame = self._close_frame, None
            self.close_sent = True
            return [memoryview(frame)]
        if self._pong is not None:
            control, self._pong = self._pong, None
            return [memoryview(control)]
        if self._ping is not None:
            control, self._ping = self._ping, None
            return [memoryview(control)]
        if not self._messages:
            return None
        item = self._messages[0]
        first = item.framed
        end = min(len(item.payload), first + FRAGMENT_BYTES)
        item.framed = end
        last = end == len(item.payload)
        if last:
            self._messages.popleft()
        opcode = item.opcode if first == 0 else _OP_CONTINUATION
        self._frame_payload = end - first
        return [memoryview(frame_header(opcode, end - first, last)), item.payload[first:end]]

    @property
    def write_deadline(self) -> float:
        """When the frame in flight must be written by (then :meth:`write_timed_out`)."""
        return min(self.frame_started + self.limits.send_deadline, self.abort_at)

    def write_timed_out(self, now: float) -> bool:
        """The frame in flight missed its deadline: True when the transport must be aborted now.

        Otherwise the close was started or hurried (an overrun sets :attr:`overrun`) and the frame in flight
        waits on, until the abort time.
        """
        if now >= self.abort_at:
            return True
        if self.close_reason is None:
            self.overrun = True
            self.close(CLOSE_TRY_AGAIN_LATER, "overrun", now=now, urgent=True)
        else:  # a normal close stuck behind the peer's window: hurry it
            self.hurry(now)
        self.frame_started = now  # the frame in flight now waits for the abort time
        return False

    # --- closing ------------------------------------------------------------------------------------

    def close(self, code: int, reason: str | None = None, *, now: float, urgent: bool = False) -> None:
        """Start the close handshake (idempotent; a later urgent close hurries an earlier one).

        Not urgent: queued messages go out first, then the close frame; the abort time is the send deadline
        plus the close grace.  Urgent: queued messages are dropped, the close frame follows the frame in
        flight, and the abort time is the close grace.
        """
        if self.close_reason is not None:
            if urgent:
                self.hurry(now)
            return
        self.close_reason = CloseReason(code, reason)
        try:
            self._close_frame = self._ws.send(CloseConnection(code=code, reason=reason))
        except LocalProtocolError:  # wsproto already closed: nothing can be sent any more
            self.finish()
            return
        self._closing()
        self.close_urgent = urgent
        if urgent:
            self._discard_messages()
        grace = self.limits.close_grace + (0 if urgent else self.limits.send_deadline)
        self.abort_at = min(self.abort_at, now + grace)

    def hurry(self, now: float) -> None:
        """Make a close under way urgent: queued messages dropped, abort after the close grace from now."""
        if self.close_reason is None or self.close_sent or self.close_urgent:
            return
        self.close_urgent = True
        self._discard_messages()
        self.abort_at = min(self.abort_at, now + self.limits.close_grace)

    def _closing(self) -> None:
        self._pong = self._ping = None

    def finish(self) -> None:
        """The transport ended (idempotent): nothing more is read or written."""
        if self.finished:
            return
        self.finished = True
        if self.close_reason is None:
            self.close_reason = CloseReason(CLOSE_ABNORMAL, "connection lost")
        self._closing()
        self._discard_messages()
        self._frame = []
        self._frame_payload = 0
        self.queued_bytes = 0
        self._ping_payload = None

    def _discard_messages(self) -> None:
        # The frame in flight is finished (a frame cannot be cut); the rest of its message is dropped.
        self._messages.clear()
        self.queued_bytes = self._frame_payload if self._frame else 0

    @property
    def close_complete(self) -> bool:
        """Both close frames have passed: the driver closes the transport."""
        return self.close_sent and self.close_received and not self._frame
