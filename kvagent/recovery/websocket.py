"""The server side of one websocket connection (RFC 6455 over wsproto) with a bounded send path.

trio-websocket serialises every write (messages, pongs, the close frame) behind one lock around
``send_all``: a peer that stops reading blocks the close and the pings too, so it can hold its connection
slot for as long as the kernel keeps the socket.  Here the connection owns its send path:

* **Outbound queue bounded in bytes.**  :meth:`WebSocket.send_nowait` queues a message (``trio.WouldBlock``
  when the queue is full) and writes it at once when the socket takes it, so a small answer leaves in the
  task step that produced it; :meth:`WebSocket.send_message` waits for room.  A message larger than the
  whole bound is admitted alone, into an empty queue.
* **One writer.**  Messages go out as frames of at most :data:`FRAGMENT_BYTES`, so control frames (pong,
  ping, close) are never further than one frame behind, even in the middle of a 1 MiB answer.  Frame
  headers are written next to their payload slice (``sendmsg``), never copied into one buffer.
* **Send deadline.**  A frame the peer's TCP window has not taken within ``send_deadline`` seconds
  closes the connection with 1013 ``overrun``.  The close goes out right after the frame in flight; when
  even that cannot be written within ``close_grace`` the transport is aborted, so a peer that never reads
  costs at most ``send_deadline + close_grace`` seconds.
* **The reader never writes.**  It answers a ping by queueing the pong (only the newest one, RFC 6455
  5.5.3) and keeps reading while the writer is blocked; requests go to the session through a short queue.

The socket is a plain non-blocking socket driven with ``trio.lowlevel.wait_readable``/``wait_writable``
(trio's own socket layer has no synchronous try-send, which the eager write needs).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable

import attrs
import trio
from wsproto import WSConnection
from wsproto.events import (
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from kvagent._util.listen import close_socket

__all__ = [
    "CLOSE_ABNORMAL",
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_NORMAL",
    "CLOSE_PING_TIMEOUT",
    "CLOSE_TRY_AGAIN_LATER",
    "FRAGMENT_BYTES",
    "CloseReason",
    "ConnectionClosed",
    "HandshakeFailed",
    "MessageTooBig",
    "SendLimits",
    "WebSocket",
    "read_request",
    "send_all",
]

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server is shutting down
CLOSE_ABNORMAL = 1006  # never sent: the transport ended without a close frame
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013  # follower overrun, or a peer that stopped reading ("overrun")
CLOSE_PING_TIMEOUT = 4000  # the peer did not answer a ping in time

FRAGMENT_BYTES = 64 << 10
RECEIVE_BYTES = 64 << 10
INBOUND_MESSAGES = 8  # requests read ahead of the session before the reader stops reading

_OP_CONTINUATION, _OP_TEXT, _OP_BINARY = 0x0, 0x1, 0x2
_TRANSPORT_ERRORS = (OSError, trio.ClosedResourceError)


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
    """A request frame over the limit; it was discarded as it arrived and the connection stays usable."""

    def __init__(self, limit: int, *, binary: bool) -> None:
        super().__init__(f"request frame exceeds the {limit}-byte limit")
        self.limit = limit
        self.binary = binary


class HandshakeFailed(Exception):
    """The peer left, or sent something that is not a websocket upgrade request (``reply``: the 4xx)."""

    def __init__(self, message: str, reply: bytes = b"") -> None:
        super().__init__(message)
        self.reply = reply


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


# --- the socket -------------------------------------------------------------------------------------


async def send_all(sock: socket.socket, data: bytes) -> None:
    """Write everything (handshake responses); bounded by the caller's cancel scope."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


async def read_request(sock: socket.socket, connection: WSConnection) -> Request:
    """Read until the HTTP upgrade request is complete (h11 bounds its size); raises HandshakeFailed."""
    while True:
        for event in connection.events():
            if isinstance(event, Request):
                return event
        try:
            data = sock.recv(RECEIVE_BYTES)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            continue
        except OSError as exc:
            raise HandshakeFailed(f"connection failed: {exc.strerror}") from None
        if not data:
            raise HandshakeFailed("peer closed before the handshake")
        try:
            connection.receive_data(data)
        except RemoteProtocolError as exc:
            reply = b""
            if exc.event_hint is not None:
                try:
                    reply = connection.send(exc.event_hint)
                except LocalProtocolError:
                    reply = b""
            raise HandshakeFailed(f"bad upgrade request: {exc}", reply) from None
        except ValueError as exc:  # e.g. a request target that is not ASCII
            raise HandshakeFailed(f"bad upgrade request: {exc}") from None


# --- the connection ---------------------------------------------------------------------------------


class _Outgoing:
    """A queued message: its opcode, its payload and how much of it is already framed."""

    __slots__ = ("framed", "opcode", "payload")

    def __init__(self, opcode: int, payload: bytes) -> None:
        self.opcode = opcode
        self.payload = memoryview(payload)
        self.framed = 0


class WebSocket:
    """One accepted connection.  :meth:`run` drives it; the session talks through the message methods."""

    def __init__(
        self,
        sock: socket.socket,
        connection: WSConnection,
        *,
        max_message_size: int,
        limits: SendLimits,
        on_overrun: Callable[[], None] | None = None,
        on_peer_close: Callable[[], None] | None = None,
    ) -> None:
        self._sock = sock
        self._on_overrun = on_overrun
        self._on_peer_close = on_peer_close
        self._ws = connection
        self._max_message_size = max_message_size
        self._limits = limits
        # Inbound: the reader assembles messages and hands them over through a short queue.
        self._inbound_send, self._inbound = trio.open_memory_channel[str | bytes | MessageTooBig](
            INBOUND_MESSAGES
        )
        self._parts: list[str | bytes | bytearray] = []
        self._part_bytes = 0
        self._discarding = False
        # Outbound: control frames, queued messages, the frame being written.
        self._pong: bytes | None = None
        self._ping: bytes | None = None
        self._ping_payload: bytes | None = None
        self._pong_received = trio.Event()
        self._messages: deque[_Outgoing] = deque()
        self._queued_bytes = 0
        self._frame: list[memoryview] = []
        self._frame_payload = 0
        self._frame_started = 0.0
        self._blocked = False  # the writer waits for the socket to become writable
        self._space = trio.lowlevel.ParkingLot()
        self._writer_lot = trio.lowlevel.ParkingLot()
        self._write_scope: trio.CancelScope | None = None
        # Closing.
        self._close_reason: CloseReason | None = None
        self._close_frame: bytes | None = None
        self._close_urgent = False
        self._close_sent = False
        self._close_received = trio.Event()
        self._abort_at = float("inf")
        self._finished = trio.Event()
        self.overrun = False  # the peer stopped accepting frames (send deadline)

    @property
    def closed(self) -> CloseReason | None:
        """Why the connection is closed or closing; None while it is open."""
        return self._close_reason

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    # --- lifecycle ----------------------------------------------------------------------------------

    async def run(self, body: Callable[[], Awaitable[None]]) -> None:
        """Run the reader, the writer and ``body`` until the transport is closed.

        When ``body`` returns (or raises ConnectionClosed) the connection is closed normally (1000) unless
        a close is already under way.  Whatever happens, the socket is closed on the way out.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader)
                nursery.start_soon(self._writer)
                nursery.start_soon(self._run_body, body)
                await self._finished.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._finish()

    async def _run_body(self, body: Callable[[], Awaitable[None]]) -> None:
        with contextlib.suppress(ConnectionClosed):
            await body()
        self.close(CLOSE_NORMAL)

    def close(self, code: int, reason: str | None = None, *, urgent: bool = False) -> None:
        """Start the close handshake (idempotent; a later urgent close can hurry an earlier one).

        Not urgent: queued messages go out first, then the close frame.  Urgent: queued messages are
        dropped and the close frame follows the frame in flight.  Either way the transport is aborted if
        the close cannot be completed in time (urgent: ``close_grace``; otherwise the send deadline too).
        """
        now = trio.current_time()
        if self._close_reason is not None:
            if urgent and not self._close_urgent and not self._close_sent:
                self._close_urgent = True
                self._discard_messages()
                self._set_abort_at(now + self._limits.close_grace)
                self._kick_writer()
            return
        self._close_reason = CloseReason(code, reason)
        try:
            self._close_frame = self._ws.send(CloseConnection(code=code, reason=reason))
        except LocalProtocolError:  # wsproto already closed: nothing can be sent any more
            self._finish()
            return
        self._close_urgent = urgent
        if urgent:
            self._discard_messages()
        grace = self._limits.close_grace + (0 if urgent else self._limits.send_deadline)
        self._set_abort_at(now + grace)
        self._closing()

    def _closing(self) -> None:
        """A close started: producers and the session wake with ConnectionClosed; the writer moves on."""
        self._pong = self._ping = None
        self._inbound_send.close()
        self._space.unpark_all()
        self._kick_writer()

    def _finish(self) -> None:
        """The end of the transport (idempotent): the socket closes and every waiter wakes."""
        if self._finished.is_set():
            return
        if self._close_reason is None:
            self._close_reason = CloseReason(CLOSE_ABNORMAL, "connection lost")
        self._discard_messages()
        self._frame = []
        close_socket(self._sock)
        self._finished.set()
        self._closing()
        self._pong_received.set()

    def _set_abort_at(self, when: float) -> None:
        self._abort_at = min(self._abort_at, when)
        if self._write_scope is not None:
            self._write_scope.deadline = min(self._write_scope.deadline, self._abort_at)

    # --- sending ------------------------------------------------------------------------------------

    def send_nowait(self, message: str | bytes) -> None:
        """Queue a message and write what the socket takes now; ``trio.WouldBlock`` when the queue is full."""
        if self._close_reason is not None:
            raise ConnectionClosed(self._close_reason)
        if isinstance(message, str):
            opcode, payload = _OP_TEXT, message.encode()
        else:
            opcode, payload = _OP_BINARY, message
        if self._queued_bytes and self._queued_bytes + len(payload) > self._limits.queue_bytes:
            raise trio.WouldBlock
        self._messages.append(_Outgoing(opcode, payload))
        self._queued_bytes += len(payload)
        self._kick_writer()

    async def send_message(self, message: str | bytes) -> None:
        """Queue a message, waiting for room; raises ConnectionClosed once the connection is closing.

        It returns without a schedule point when there is room, so a small answer is written in the step
        that produced it; a caller sending many frames in a row yields between them itself.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                self.send_nowait(message)
                return
            except trio.WouldBlock:
                await self._space.park()

    async def ping(self) -> None:
        """Send a ping and wait for its pong (bound it at the call site); ConnectionClosed if the
        connection ends first.  The ping goes out at the next frame boundary, ahead of queued messages."""
        if self._close_reason is not None:
            raise ConnectionClosed(self._close_reason)
        payload = os.urandom(4)
        self._ping_payload = payload
        self._pong_received = trio.Event()
        self._ping = self._ws.send(Ping(payload=payload))
        self._kick_writer()
        await self._pong_received.wait()
        if self._ping_payload is not None:  # woken by the end of the connection, not by the pong
            raise ConnectionClosed(self._close_reason or CloseReason(CLOSE_ABNORMAL))

    def _kick_writer(self) -> None:
        """Write eagerly unless the writer is waiting for the socket; otherwise let it look again."""
        if not self._blocked and not self._finished.is_set():
            self._pump()
        self._writer_lot.unpark_all()

    def _discard_messages(self) -> None:
        # The frame in flight is finished (a frame cannot be cut); the rest of its message is dropped.
        dropped = sum(len(item.payload) - item.framed for item in self._messages)
        self._messages.clear()
        self._queued_bytes = self._frame_payload if self._frame else 0
        if dropped:
            self._space.unpark_all()

    def _next_frame(self) -> list[memoryview] | None:
        """The next frame to write, control frames first; None when there is nothing to write."""
        if self._close_sent:
            return None
        if self._close_frame is not None and (self._close_urgent or not self._messages):
            frame, self._close_frame = self._close_frame, None
            self._close_sent = True
            return [memoryview(frame)]
        for name in ("_pong", "_ping"):
            control: bytes | None = getattr(self, name)
            if control is not None:
                setattr(self, name, None)
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

    def _pump(self) -> bool:
        """Write until the socket would block; True when a frame is left half-written (wait writable)."""
        while True:
            if not self._frame:
                frame = self._next_frame()
                if frame is None:
                    return False
                self._frame = frame
                self._frame_started = trio.current_time()
            try:
                sent = self._sock.sendmsg(self._frame)
            except BlockingIOError:
                return True
            except OSError:
                self._finish()
                return False
            self._advance(sent)

    def _advance(self, sent: int) -> None:
        frame = self._frame
        while sent and frame:
            head = frame[0]
            if len(head) <= sent:
                sent -= len(head)
                frame.pop(0)
            else:
                frame[0] = head[sent:]
                sent = 0
        if not frame:
            self._queued_bytes -= self._frame_payload
            self._frame_payload = 0
            if self._queued_bytes < self._limits.queue_bytes:
                self._space.unpark_all()

    async def _writer(self) -> None:
        """Finish what the eager writes left, enforce the send deadline, then complete the close."""
        while not self._finished.is_set():
            if self._pump():
                await self._wait_writable()
            elif self._close_sent:
                await self._await_close_reply()
                return
            else:
                await self._writer_lot.park()

    async def _wait_writable(self) -> None:
        deadline = min(self._frame_started + self._limits.send_deadline, self._abort_at)
        self._blocked = True
        try:
            with trio.CancelScope(deadline=deadline) as scope:
                self._write_scope = scope
                await trio.lowlevel.wait_writable(self._sock)
        except _TRANSPORT_ERRORS:
            self._finish()
            return
        finally:
            self._blocked = False
            self._write_scope = None
        if not scope.cancelled_caught:
            return
        if trio.current_time() >= self._abort_at:
            self._finish()  # not even the close could be written: abort the transport
        else:
            if self._close_reason is None:
                self.overrun = True
                if self._on_overrun is not None:
                    self._on_overrun()
                self.close(CLOSE_TRY_AGAIN_LATER, "overrun", urgent=True)
            else:  # a normal close stuck behind the peer's window: hurry it
                self.close(self._close_reason.code, self._close_reason.reason, urgent=True)
            self._frame_started = trio.current_time()  # the frame in flight now waits for the abort time

    async def _await_close_reply(self) -> None:
        # Our close frame is out: the peer gets the close grace to answer it, whatever was waited before.
        with trio.move_on_at(min(self._abort_at, trio.current_time() + self._limits.close_grace)):
            await self._close_received.wait()
        self._finish()

    # --- receiving ----------------------------------------------------------------------------------

    async def get_message(self) -> str | bytes:
        """The next request; ConnectionClosed once closing, MessageTooBig for a discarded oversized one."""
        if self._close_reason is not None:
            raise ConnectionClosed(self._close_reason)
        try:
            message = await self._inbound.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise ConnectionClosed(self._close_reason or CloseReason(CLOSE_ABNORMAL)) from None
        if isinstance(message, MessageTooBig):
            raise message
        return message

    async def _reader(self) -> None:
        try:
            while not self._close_received.is_set():
                try:
                    data = self._sock.recv(RECEIVE_BYTES)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(self._sock)
                    continue
                if not data:
                    break
                self._ws.receive_data(data)
                for event in self._ws.events():
                    await self._on_event(event)
                await trio.lowlevel.checkpoint()  # a peer that floods us must not hold the loop
        except _TRANSPORT_ERRORS:
            pass
        if not self._close_received.is_set():
            # EOF or a broken transport; after the peer's close frame the writer finishes the handshake.
            self._finish()

    async def _on_event(self, event: Event) -> None:
        if isinstance(event, TextMessage | BytesMessage):
            await self._on_data(event.data, event.message_finished)
        elif isinstance(event, Ping):
            if self._close_reason is None:
                self._pong = self._ws.send(event.response())
                self._kick_writer()
        elif isinstance(event, Pong):
            if self._ping_payload is not None and bytes(event.payload) == self._ping_payload:
                self._ping_payload = None
                self._pong_received.set()
        elif isinstance(event, CloseConnection):
            self._on_close(event)

    def _on_close(self, event: CloseConnection) -> None:
        if self._close_reason is None:
            # The peer started the close (or broke the protocol: wsproto reports that as a close with
            # the error's code): answer at once, dropping whatever was still queued.
            self._close_reason = CloseReason(event.code, event.reason or None)
            if self._on_peer_close is not None:
                self._on_peer_close()  # before the reply: the peer's close completes only after it
            try:
                self._close_frame = self._ws.send(event.response())
            except LocalProtocolError:
                self._close_frame = None
            self._close_urgent = True
            self._discard_messages()
            self._set_abort_at(trio.current_time() + self._limits.close_grace)
            self._closing()
        self._close_received.set()
        self._kick_writer()

    async def _on_data(self, data: str | bytes | bytearray, finished: bool) -> None:
        if not self._discarding:
            self._parts.append(data)
            self._part_bytes += len(data)
            if self._part_bytes > self._max_message_size:
                self._discarding = True
                self._parts = []
        if not finished:
            return
        message: str | bytes | MessageTooBig
        if self._discarding:
            message = MessageTooBig(self._max_message_size, binary=not isinstance(data, str))
        elif isinstance(data, str):
            message = "".join(self._parts)  # type: ignore[arg-type]
        else:
            message = b"".join(self._parts)  # type: ignore[arg-type]
        self._parts = []
        self._part_bytes = 0
        self._discarding = False
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            await self._inbound_send.send(message)  # (when closing, requests are no longer read)
