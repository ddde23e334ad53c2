"""The Trio driver of one server-side websocket connection: the socket, the tasks and the waiting.

Every protocol rule (framing, the byte-bounded queues, the send deadline, the close state machine) is
:class:`~kvagent.recovery.wscore.WebSocketCore`'s, which does no I/O; this module moves bytes between it and
a plain non-blocking socket and turns its states into waits:

* **Eager writes.**  :meth:`WebSocket.send_nowait` queues a message in the core (``trio.WouldBlock`` when
  the queue is full) and writes it at once when the socket takes it, so a small answer leaves in the task
  step that produced it; :meth:`WebSocket.send_message` waits for room.  Frame headers are written next to
  their payload slice (``sendmsg``), never copied into one buffer.
* **One writer task** finishes what the eager writes left, waiting for the socket under the core's write
  deadline (the send deadline, or the abort time of a close).  On an overrun the core starts the 1013
  close; when even that cannot be written by the abort time the socket is closed, not gracefully: nothing
  waits behind the blocked write.
* **The reader never writes.**  It feeds the core, which queues the pong (only the newest one), and reads
  only while the core wants data: the inbound bytes are bounded, the rest stays in the peer's TCP window.

The socket is a plain non-blocking socket driven with ``trio.lowlevel.wait_readable``/``wait_writable``
(trio's own socket layer has no synchronous try-send, which the eager write needs).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Awaitable, Callable

import trio
from wsproto import WSConnection
from wsproto.events import Request
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from kvagent._util.listen import close_socket
from kvagent._util.sync import Changed
from kvagent.recovery.wscore import (
    CLOSE_ABNORMAL,
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    CLOSE_PING_TIMEOUT,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TRY_AGAIN_LATER,
    FRAGMENT_BYTES,
    CloseReason,
    ConnectionClosed,
    MessageTooBig,
    QueueFull,
    SendLimits,
    WebSocketCore,
    accept_response,
)

__all__ = [
    "CLOSE_ABNORMAL",
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_NORMAL",
    "CLOSE_PING_TIMEOUT",
    "CLOSE_PROTOCOL_ERROR",
    "CLOSE_TRY_AGAIN_LATER",
    "FRAGMENT_BYTES",
    "CloseReason",
    "ConnectionClosed",
    "HandshakeFailed",
    "MessageTooBig",
    "SendLimits",
    "WebSocket",
    "accept_response",
    "read_request",
    "send_all",
]

RECEIVE_BYTES = 64 << 10

_TRANSPORT_ERRORS = (OSError, trio.ClosedResourceError)
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection


class HandshakeFailed(Exception):
    """The peer left, or sent something that is not a websocket upgrade request (``reply``: the 4xx)."""

    def __init__(self, message: str, reply: bytes = b"") -> None:
        super().__init__(message)
        self.reply = reply


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


class WebSocket:
    """One accepted connection.  :meth:`run` drives it; the session talks through the message methods."""

    def __init__(
        self,
        sock: socket.socket,
        connection: WSConnection,
        *,
        max_message_size: int,
        limits: SendLimits,
        inbound_bytes_limit: int | None = None,
        on_overrun: Callable[[], None] | None = None,
        on_peer_close: Callable[[], None] | None = None,
    ) -> None:
        self._sock = sock
        self.core = WebSocketCore(
            connection,
            max_message_size=max_message_size,
            limits=limits,
            inbound_bytes_limit=inbound_bytes_limit,
        )
        self._on_overrun = on_overrun
        self._on_peer_close = on_peer_close
        self._blocked = False  # the writer waits for the socket to become writable
        # Each wakes the tasks waiting on it to look again (kvagent._util.sync.Changed: no lost wakeups).
        self._space = Changed()  # room in the outbound queue (producers)
        self._writer_wake = Changed()  # something for the writer to do
        self._inbound = Changed()  # a request arrived (the session)
        self._reader_wake = Changed()  # the session took a request: room under the inbound bound (the reader)
        self._pong = Changed()  # a pong arrived, or the connection ended
        self._write_scope: trio.CancelScope | None = None
        self._finished = trio.Event()

    @property
    def closed(self) -> CloseReason | None:
        """Why the connection is closed or closing; None while it is open."""
        return self.core.close_reason

    @property
    def queued_bytes(self) -> int:
        return self.core.queued_bytes

    @property
    def overrun(self) -> bool:
        """The peer stopped accepting frames (send deadline)."""
        return self.core.overrun

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
            self._finish(abort=not self.core.close_complete)  # e.g. the server's shutdown timeout

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
        was_open = self.core.close_reason is None
        self.core.close(code, reason, now=trio.current_time(), urgent=urgent)
        if self.core.finished:
            self._finish()
            return
        if was_open:
            self._wake_all()
        self._deadline_moved()
        self._kick_writer()

    def _wake_all(self) -> None:
        """A close started or the transport ended: producers, the session and the reader look again."""
        self._space.notify()
        self._inbound.notify()
        self._reader_wake.notify()

    def _finish(self, *, abort: bool = False) -> None:
        """The end of the transport (idempotent): the socket closes and every waiter wakes.

        ``abort``: the close did not complete in time.  The socket is reset (SO_LINGER 0), so the kernel
        drops what it still buffers for a peer that does not read, instead of keeping it (and an orphan
        socket) while it retries.
        """
        if self._finished.is_set():
            return
        self.core.finish()
        if abort:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        close_socket(self._sock)
        self._finished.set()
        self._wake_all()
        self._writer_wake.notify()
        self._pong.notify()

    def _deadline_moved(self) -> None:
        if self._write_scope is not None:
            self._write_scope.deadline = min(self._write_scope.deadline, self.core.write_deadline)

    # --- sending ------------------------------------------------------------------------------------

    def send_nowait(self, message: str | bytes) -> None:
        """Queue a message and write what the socket takes now; ``trio.WouldBlock`` when the queue is full."""
        try:
            self.core.queue_message(message)
        except QueueFull:
            raise trio.WouldBlock from None
        self._kick_writer()

    async def send_message(self, message: str | bytes) -> None:
        """Queue a message, waiting for room; raises ConnectionClosed once the connection is closing.

        It returns without a schedule point when there is room, so a small answer is written in the step
        that produced it; a caller sending many frames in a row yields between them itself.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            since = self._space.version
            try:
                self.send_nowait(message)
                return
            except trio.WouldBlock:
                await self._space.wait(since)

    async def ping(self) -> None:
        """Send a ping and wait for its pong (bound it at the call site); ConnectionClosed if the
        connection ends first.  The ping goes out at the next frame boundary, ahead of queued messages."""
        since = self._pong.version
        self.core.start_ping(os.urandom(4))
        self._kick_writer()
        await self._pong.wait(since)
        if self.core.awaiting_pong or self.core.finished:  # woken by the end of the connection
            raise ConnectionClosed(self.core.close_reason or CloseReason(CLOSE_ABNORMAL))

    def _kick_writer(self) -> None:
        """Write eagerly unless the writer is waiting for the socket (it writes once the socket takes more).

        The writer task is woken only when it has something to do: a frame left half-written, or a close
        under way.  An answer the socket took whole costs no task switch.
        """
        if self._blocked or self._finished.is_set():
            return
        if self._pump() or self.core.close_reason is not None:
            self._writer_wake.notify()

    def _pump(self) -> bool:
        """Write until the socket would block; True when a frame is left half-written (wait writable)."""
        core = self.core
        queued = core.queued_bytes
        try:
            while True:
                buffers = core.outgoing(trio.current_time())
                if buffers is None:
                    return False
                try:
                    sent = self._sock.sendmsg(buffers)
                except BlockingIOError:
                    return True
                except OSError:
                    self._finish()
                    return False
                core.sent(sent, trio.current_time())
        finally:
            if core.queued_bytes < queued:  # room freed: producers try again
                self._space.notify()

    async def _writer(self) -> None:
        """Finish what the eager writes left, enforce the deadlines, then complete the close."""
        core = self.core
        while not self._finished.is_set():
            since = self._writer_wake.version
            if self._pump():
                await self._wait_writable()
            elif core.close_complete:
                self._finish()
            elif core.close_sent:
                await self._await_close_reply()
            else:
                await self._writer_wake.wait(since)

    async def _wait_writable(self) -> None:
        self._blocked = True
        try:
            with trio.CancelScope(deadline=self.core.write_deadline) as scope:
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
        was_open = self.core.close_reason is None
        if self.core.write_timed_out(trio.current_time()):
            self._finish(abort=True)  # not even the close could be written: abort the transport
            return
        if self.core.overrun and was_open and self._on_overrun is not None:
            self._on_overrun()
        if was_open:
            self._wake_all()

    async def _await_close_reply(self) -> None:
        # Our close frame is out: the peer has until the abort time (at most the close grace) to answer.
        with trio.move_on_at(self.core.abort_at) as waited:
            await self._writer_wake.wait_for(lambda: self.core.close_received or self._finished.is_set())
        self._finish(abort=waited.cancelled_caught)

    # --- receiving ----------------------------------------------------------------------------------

    async def get_message(self) -> str | bytes:
        """The next request; ConnectionClosed once closing, MessageTooBig for a discarded oversized one.

        Always a schedule point, as a channel's ``receive`` is: a client that pipelines many requests
        takes one per step, never the event loop for all of them.
        """
        core = self.core
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            since = self._inbound.version
            if core.close_reason is not None:
                raise ConnectionClosed(core.close_reason)
            message = core.next_message()
            if message is not None:
                break
            await self._inbound.wait(since)
            waited = True
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        self._reader_wake.notify()  # a reader stopped at the inbound bound: there may be room now
        if isinstance(message, MessageTooBig):
            raise message
        return message

    async def _reader(self) -> None:
        core = self.core
        try:
            while not core.close_received:
                since = self._reader_wake.version
                if not core.wants_data:
                    await self._reader_wake.wait(
                        since
                    )  # the inbound bound: the rest waits in the peer's window
                    continue
                try:
                    data = self._sock.recv(RECEIVE_BYTES)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(self._sock)
                    continue
                if not data:
                    break
                self._feed(data)
                await trio.lowlevel.checkpoint()  # a peer that floods us must not hold the loop
        except _TRANSPORT_ERRORS:
            pass
        if not core.close_received:
            # EOF or a broken transport; after the peer's close frame the writer finishes the handshake.
            self._finish()

    def _feed(self, data: bytes) -> None:
        core = self.core
        was_open = core.close_reason is None
        awaiting_pong = core.awaiting_pong
        core.receive_data(data, trio.current_time())
        if awaiting_pong and not core.awaiting_pong:
            self._pong.notify()
        if core.has_message:
            self._inbound.notify()
        if core.peer_closed and was_open:
            if self._on_peer_close is not None:
                self._on_peer_close()  # before the reply: the peer's close completes only after it
            self._wake_all()
            self._deadline_moved()
        if core.control_pending or core.close_received:  # a pong or close reply to send, or the writer waits
            self._kick_writer()
