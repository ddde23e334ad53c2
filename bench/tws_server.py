"""The recovery server's connections on trio-websocket, as issue #26 item 4's design card draws them; the
``serving`` figure runs it side by side with kvagent's own connection (:func:`bench.fig_serving.compare`,
``python -m bench.fig_serving OUT.json``; the decision is in docs/performance.md).

Run as a script it is ``kvagent`` (same arguments) with :meth:`_Server._handle` replaced by
:func:`handle_with_trio_websocket`:

* the handshake is trio-websocket's (``wrap_server_stream`` on a stream we own, then ``request.accept()``
  or ``request.reject()``), under ``trio.fail_after(handshake_timeout)``;
* one writer task per connection, fed by a channel bounded in bytes (:class:`TrioWebsocketConnection`);
  each send is ``send_message`` under a cancel scope with the send deadline (``fail_after``'s deadline,
  caught where it happens: the writer knows the frame is cut);
* on overrun the raw TCP stream is aborted (SO_LINGER 0 and close), never a graceful close that would
  queue behind the blocked send; an urgent close (1001, 4000, 1011) gives the send in flight
  ``close_grace`` and then does the same;
* the heartbeat is the server's own (``ping`` under a deadline).

What it cannot keep of the pinned behaviour (trio-websocket 0.12.2): an oversized request closes the
connection with 1009 (the message limit is ``len()`` of the text, and the library has no "discard and
carry on"); its reader answers pings itself through the send lock, so a peer that stops reading also
stops the reader; a send cut by the deadline leaves no way to send the 1013; a protocol error closes the
stream without the 1002.  Under the serving tests it passes 55 of 61.  This module is the measured
alternative, not the production server.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import trio
import trio_websocket

from kvagent.recovery import server as server_module
from kvagent.recovery.session import Session
from kvagent.recovery.websocket import (
    CLOSE_ABNORMAL,
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_TRY_AGAIN_LATER,
    CloseReason,
    ConnectionClosed,
    SendLimits,
)

INBOUND_MESSAGES = 8


class TrioWebsocketConnection:
    """The connection interface the session and the server use, over a trio-websocket connection."""

    def __init__(
        self,
        connection: trio_websocket.WebSocketConnection,
        stream: trio.SocketStream,
        limits: SendLimits,
        on_overrun: Callable[[], None],
    ) -> None:
        self._connection = connection
        self._stream = stream
        self._limits = limits
        self._on_overrun = on_overrun
        self._send, self._receive = trio.open_memory_channel[str | bytes](math.inf)
        self._queued_bytes = 0
        self._space = trio.Event()
        self._close_reason: CloseReason | None = None
        self._urgent = False
        self._send_scope: trio.CancelScope | None = None
        self._done = trio.Event()
        self.overrun = False

    @property
    def closed(self) -> CloseReason | None:
        if self._close_reason is None and self._connection.closed is not None:
            reason = self._connection.closed
            return CloseReason(reason.code, reason.reason)
        return self._close_reason

    async def run(self, body: Callable[[], Awaitable[None]]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer)
                with contextlib.suppress(ConnectionClosed):
                    await body()
                self.close(CLOSE_NORMAL)
                await self._done.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._abort()

    # --- sending: a byte-bounded channel into one writer --------------------------------------------

    def send_nowait(self, message: str | bytes) -> None:
        reason = self.closed
        if reason is not None:
            raise ConnectionClosed(reason)
        size = len(message)
        if self._queued_bytes and self._queued_bytes + size > self._limits.queue_bytes:
            raise trio.WouldBlock
        self._queued_bytes += size
        self._send.send_nowait(message)

    async def send_message(self, message: str | bytes) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                self.send_nowait(message)
                return
            except trio.WouldBlock:
                if self._space.is_set():
                    self._space = trio.Event()
                await self._space.wait()

    async def _writer(self) -> None:
        try:
            async for message in self._receive:  # close() closes the channel: the rest drains, then ends
                if self._urgent:
                    continue  # an urgent close drops what is queued
                with trio.CancelScope(deadline=trio.current_time() + self._limits.send_deadline) as scope:
                    self._send_scope = scope
                    await self._connection.send_message(message)
                self._send_scope = None
                if scope.cancelled_caught:
                    if self._close_reason is None:
                        self.overrun = True
                        self._on_overrun()
                        self._close_reason = CloseReason(CLOSE_TRY_AGAIN_LATER, "overrun")
                    return  # the frame is cut: nothing more can be framed on this stream (finally aborts)
                self._queued_bytes -= len(message)
                self._space.set()
            reason = self._close_reason or CloseReason(CLOSE_NORMAL)
            with trio.move_on_after(self._limits.close_grace):
                await self._connection.aclose(reason.code, reason.reason)
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._abort()

    def close(self, code: int, reason: str | None = None, *, urgent: bool = False) -> None:
        if self._close_reason is None:
            self._close_reason = CloseReason(code, reason)
        if urgent and not self._urgent:
            self._urgent = True
            if self._send_scope is not None:  # the send in flight gets the close grace, then the abort
                deadline = trio.current_time() + self._limits.close_grace
                self._send_scope.deadline = min(self._send_scope.deadline, deadline)
        self._send.close()
        self._space.set()

    def _abort(self) -> None:
        """Abort the raw stream: RST, no close handshake; every task on it wakes."""
        if self._done.is_set():
            return
        if self._close_reason is None:
            self._close_reason = CloseReason(CLOSE_ABNORMAL, "connection lost")
        sock = self._stream.socket
        if sock.fileno() != -1:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        self._done.set()
        self._space.set()

    # --- receiving, ping ----------------------------------------------------------------------------

    async def get_message(self) -> str | bytes:
        reason = self._close_reason
        if reason is not None:
            raise ConnectionClosed(reason)
        try:
            return await self._connection.get_message()
        except trio_websocket.ConnectionClosed as exc:
            got = exc.reason
            raise ConnectionClosed(
                CloseReason(got.code, got.reason) if got is not None else CloseReason(CLOSE_ABNORMAL)
            ) from None

    async def ping(self) -> None:
        try:
            await self._connection.ping()
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            raise ConnectionClosed(self.closed or CloseReason(CLOSE_ABNORMAL)) from None


async def handle_with_trio_websocket(self: Any, stream: trio.SocketStream) -> None:
    """``_Server._handle`` on trio-websocket: handshake under its deadline, then the session."""
    try:
        async with trio.open_nursery() as nursery:  # trio-websocket's reader task runs in it
            try:
                await _handshake_and_serve(self, stream, nursery)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _handshake_and_serve(self: Any, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
    options = self.options
    try:
        with trio.fail_after(options.handshake_timeout):
            request = await trio_websocket.wrap_server_stream(
                nursery,
                stream,
                message_queue_size=INBOUND_MESSAGES,
                max_message_size=options.max_message_size,
            )
            target = urlsplit(request.path)
            known, slot = server_module._slot_from_path(target.path)
            if server_module._query_carries_token(target.query):
                self.stats.count_rejected(403)
                await request.reject(403, body=b"forbidden: token in the URL")
                return
            if not known or (slot is not None and self.registry.get(slot) is None):
                self.stats.count_rejected(404)
                await request.reject(404, body=b"unknown path")
                return
            if self.stopping:
                self.stats.count_rejected(503)
                await request.reject(503, body=b"shutting down")
                return
            try:
                self.limiter.acquire_on_behalf_of_nowait(stream)
            except trio.WouldBlock:
                self.stats.count_rejected(503)
                await request.reject(503, body=b"too many connections")
                return
            try:
                connection = await request.accept()
            except BaseException:
                self.limiter.release_on_behalf_of(stream)
                raise
    except trio.TooSlowError:
        self.stats.handshake_timeouts += 1
        return
    except (
        trio_websocket.HandshakeError,
        trio_websocket.ConnectionClosed,
        OSError,
        trio.BrokenResourceError,
    ):
        return
    token = None
    for key, value in request.headers:
        if key.lower() == b"authorization" and value.lower().startswith(b"bearer "):
            token = value[7:].decode("latin-1").strip()
    ws = TrioWebsocketConnection(connection, stream, options.send_limits, self.stats.count_send_overrun)
    session = Session(ws, self.session, slot, token)  # type: ignore[arg-type]
    self.connections.add(ws)
    self.stats.connections_total += 1
    self.stats.connections_open += 1
    try:
        if self.stopping:
            ws.close(CLOSE_GOING_AWAY, "going away", urgent=True)
        await ws.run(partial(self._connection_body, ws, session))
    finally:
        self.limiter.release_on_behalf_of(stream)
        self.connections.discard(ws)
        self.stats.connections_open -= 1
        if not self.connections:
            self._idle.set()
            self._idle = trio.Event()


def install() -> None:
    server_module._Server._handle = handle_with_trio_websocket  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from kvagent.cli.main import main

    sys.exit(main())
