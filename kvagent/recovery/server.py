"""The websocket recovery & control endpoint (protocol v1, docs/protocol.md): every slot of the process.

This module is the shell around the sessions: accepting (:mod:`kvagent._util.listen`: fd exhaustion and
the pre-handshake limit), the handshake (its deadline, the path, token placement), the connection limiter,
the heartbeat, each connection's lifecycle and the shutdown.  A connection is
:mod:`kvagent.recovery.websocket`'s Trio driver over the sans-IO :mod:`kvagent.recovery.wscore`; what a
connection says is :mod:`kvagent.recovery.session`'s.

A connection's failure never reaches the others: ``ConnectionClosed`` is quiet, a failing request gets an
``internal`` error response, and anything else is logged and closes only that connection with 1011.

Shutdown (cancelling :func:`serve_recovery`) stops accepting, drops the handshakes in progress and closes
every connection with 1001 "going away" (after the frame in flight, queued frames dropped); connections
whose close cannot complete within ``shutdown_timeout`` are aborted.

The token is never logged, nor is a request body (it may carry a ``token`` field) or a URL query.
"""

from __future__ import annotations

import socket
from functools import partial
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
import structlog
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import RejectConnection, RejectData, Request

from kvagent._util.latency import LatencyHistogram
from kvagent._util.listen import (
    PendingHandshakes,
    accept_loop,
    close_socket,
    default_pending_limit,
    shed_pending_handshakes,
)
from kvagent._util.sync import Changed
from kvagent.model.options import option, option_validator, positive
from kvagent.recovery.protocol import DEFAULT_HOST, DEFAULT_PORT, ServerStatistics, SlotDirectory
from kvagent.recovery.session import Session, SessionConfig
from kvagent.recovery.turns import AnswerTurns
from kvagent.recovery.websocket import (
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL_ERROR,
    CLOSE_PING_TIMEOUT,
    ConnectionClosed,
    HandshakeFailed,
    SendLimits,
    WebSocket,
    accept_response,
    read_request,
    send_all,
)

__all__ = ["RecoveryServerInfo", "ServerStats", "ServingOptions", "serve_recovery"]

log = structlog.get_logger(__name__)

HEARTBEAT_INTERVAL = 20.0
HEARTBEAT_TIMEOUT = 20.0
_positive = option_validator(positive)


@attrs.frozen(slots=True)
class RecoveryServerInfo:
    host: str
    port: int


@attrs.frozen(slots=True)
class ServingOptions:
    """The server's bounds (docs/protocol.md, "Limits and deadlines").

    ``max_pending_handshakes`` None means :func:`~kvagent._util.listen.default_pending_limit`: 128, but
    at most a quarter of the process's descriptor limit.  ``answer_turns`` and ``max_answer_wait`` are the
    fair-turn bounds of :mod:`kvagent.recovery.turns`.
    """

    max_connections: int = option(
        256, help="websocket connections served at once", flags=("--max-connections",), parse=int, check=positive
    )
    max_message_size: int = option(
        1 << 20, toml="max_message_bytes", help="the largest websocket message a client may send", check=positive
    )
    max_pending_handshakes: int | None = option(
        None,
        help="connections still in their handshake (oldest dropped first)",
        flags=("--max-pending-handshakes",),
        parse=int,
        check=positive,
        default_text="128, at most fd limit / 4",
    )
    handshake_timeout: float = option(
        5.0,
        help="seconds a connection may take to finish its websocket handshake",
        flags=("--handshake-timeout",),
        parse=float,
        check=positive,
    )
    send_deadline: float = option(
        10.0,
        help="seconds a client may leave a frame unaccepted before it is closed with 1013 overrun",
        flags=("--send-deadline",),
        parse=float,
        check=positive,
    )
    outbound_queue_bytes: int = option(
        1 << 20,
        help="per-connection bound of queued answer bytes",
        flags=("--outbound-queue-bytes",),
        parse=int,
        check=positive,
    )
    close_grace: float = attrs.field(default=2.0, validator=_positive)
    heartbeat_interval: float = attrs.field(default=HEARTBEAT_INTERVAL, validator=_positive)
    heartbeat_timeout: float = attrs.field(default=HEARTBEAT_TIMEOUT, validator=_positive)
    shutdown_timeout: float = option(
        10.0,
        help="seconds to close every client with 1001",
        flags=("--shutdown-timeout",),
        parse=float,
        check=positive,
    )
    answer_turns: int = attrs.field(default=4, validator=_positive)
    max_answer_wait: float = attrs.field(default=5.0, validator=_positive)

    @property
    def send_limits(self) -> SendLimits:
        return SendLimits(self.outbound_queue_bytes, self.send_deadline, self.close_grace)


class ServerStats:
    """Plain counters the server and its sessions bump in place; :meth:`statistics` snapshots them.

    ``requests`` is keyed by op, with every op the server does not know counted under ``"invalid"`` so a
    hostile client cannot grow the label set.  ``request_seconds_sum`` covers every op except ``follow``,
    whose duration is the lifetime of a stream, not the cost of a request.
    """

    def __init__(self) -> None:
        self.connections_open = 0
        self.connections_total = 0
        self.rejected: dict[int, int] = {}  # handshake rejections by HTTP status
        self.requests: dict[str, int] = {}
        self.request_errors: dict[str, int] = {}  # error responses by code
        self.request_seconds_sum = 0.0
        self.request_latency: dict[str, LatencyHistogram] = {}  # by op, the same bounded label set
        self.handshakes_pending = 0
        self.handshake_timeouts = 0
        self.handshakes_dropped = 0
        self.send_overruns = 0
        self.ping_timeouts = 0
        self.accept_capacity_errors = 0

    def count_rejected(self, status_code: int) -> None:
        self.rejected[status_code] = self.rejected.get(status_code, 0) + 1

    def count_request(self, op: str) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1

    def count_error(self, code: str) -> None:
        self.request_errors[code] = self.request_errors.get(code, 0) + 1

    def count_request_seconds(self, seconds: float, op: str = "invalid") -> None:
        self.request_seconds_sum += seconds
        histogram = self.request_latency.get(op)
        if histogram is None:
            histogram = self.request_latency[op] = LatencyHistogram()
        histogram.observe(seconds)

    def count_accept_capacity_error(self) -> None:
        self.accept_capacity_errors += 1

    def count_send_overrun(self) -> None:
        self.send_overruns += 1

    def count_handshake_dropped(self) -> None:
        self.handshakes_dropped += 1

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(
            connections_open=self.connections_open,
            connections_total=self.connections_total,
            rejected=dict(self.rejected),
            requests=dict(self.requests),
            request_errors=dict(self.request_errors),
            request_seconds_sum=self.request_seconds_sum,
            handshakes_pending=self.handshakes_pending,
            handshake_timeouts=self.handshake_timeouts,
            handshakes_dropped=self.handshakes_dropped,
            send_overruns=self.send_overruns,
            ping_timeouts=self.ping_timeouts,
            accept_capacity_errors=self.accept_capacity_errors,
            request_latency={op: histogram.snapshot() for op, histogram in self.request_latency.items()},
        )


# --- handshake ----------------------------------------------------------------------------------------


def _bearer_token(request: Request) -> str | None:
    for key, value in request.extra_headers:
        if key.lower() == b"authorization":
            scheme, _, credentials = bytes(value).decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and credentials.strip():
                return credentials.strip()
    return None


def _query_carries_token(query: str) -> bool:
    return any("token" in key.lower() for key, _ in parse_qsl(query, keep_blank_values=True))


def _slot_from_path(path: str) -> tuple[bool, str | None]:
    """(known path, slot name or None for ``/v1/slots``)."""
    parts = path.strip("/").split("/")
    if parts[:2] != ["v1", "slots"] or len(parts) > 3:
        return False, None
    if len(parts) == 2:
        return True, None
    slot = unquote(parts[2])
    return bool(slot), slot or None


def _rejection(connection: WSConnection, status: int, body: bytes) -> bytes:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    return connection.send(RejectConnection(status_code=status, headers=headers, has_body=True)) + (
        connection.send(RejectData(data=body))
    )


def _detach(stream: trio.SocketStream) -> socket.socket:
    """The accepted stream's socket as a plain non-blocking socket (the connection drives it directly)."""
    trio_socket = stream.socket
    family, kind, proto = trio_socket.family, trio_socket.type, trio_socket.proto
    sock = socket.socket(family, kind, proto, fileno=trio_socket.detach())
    sock.setblocking(False)
    return sock


@attrs.frozen(slots=True)
class _Admitted:
    """A handshake that was accepted: what the session needs, and the limiter slot to give back."""

    connection: WSConnection
    slot: str | None
    token: str | None


class _Server:
    def __init__(
        self, registry: SlotDirectory, session: SessionConfig, options: ServingOptions, stats: ServerStats
    ) -> None:
        self.registry = registry
        self.session = session
        self.options = options
        self.stats = stats
        self.limiter = trio.CapacityLimiter(options.max_connections)
        self._holding: set[socket.socket] = set()  # sockets holding a place in ``limiter``
        self.pending = PendingHandshakes(
            default_pending_limit(options.max_pending_handshakes), stats.count_handshake_dropped
        )
        self.connections: set[WebSocket] = set()
        self.stopping = False
        self._scope = trio.CancelScope(shield=True)  # outer cancellation waits for shutdown()
        self._listeners: list[trio.SocketListener] = []
        self._idle = Changed()  # the last connection ended

    async def run(self, listeners: list[trio.SocketListener], *, task_status: trio.TaskStatus[None]) -> None:
        self._listeners = listeners
        with self._scope:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(
                        partial(
                            accept_loop,
                            listener.accept,
                            self._handle,
                            nursery,
                            name="recovery",
                            shed=shed_pending_handshakes,
                            on_capacity_error=self.stats.count_accept_capacity_error,
                            room=self.pending.make_room,
                        )
                    )
                task_status.started()

    async def shutdown(self) -> None:
        """Stop accepting and close every connection with 1001; returns once they are all gone."""
        self.stopping = True
        for listener in self._listeners:
            await listener.aclose()
        self.pending.close_all()
        for ws in list(self.connections):
            ws.close(CLOSE_GOING_AWAY, "going away", urgent=True)
        if self.connections:
            await self._idle.wait(self._idle.version)  # the next time none is left

    def abort(self) -> None:
        self._scope.cancel()

    async def _handle(self, stream: trio.SocketStream) -> None:
        sock = _detach(stream)
        try:
            admitted = await self._handshake(sock)
            if admitted is not None:
                try:
                    await self._serve(sock, admitted)
                finally:
                    self._release_slot(sock)
        except Exception:
            log.exception("connection_handler_failed")
        finally:
            close_socket(sock)

    def _release_slot(self, sock: socket.socket) -> None:
        """Give the connection's place back, once: when the peer's close arrives or the connection ends.

        Released before the close reply is sent, so a client that has finished its close handshake
        never finds its own place still taken.
        """
        if sock in self._holding:
            self._holding.discard(sock)
            self.limiter.release_on_behalf_of(sock)

    async def _handshake(self, sock: socket.socket) -> _Admitted | None:
        """Read and answer the upgrade request within the handshake deadline; None when not upgraded."""
        connection = WSConnection(ConnectionType.SERVER)
        deadline = trio.current_time() + self.options.handshake_timeout
        admitted: _Admitted | None = None
        self.stats.handshakes_pending += 1
        try:
            with self.pending.admit(sock, deadline) as scope:
                request = await read_request(sock, connection)
                admitted = await self._answer(sock, connection, request)
        except HandshakeFailed as exc:
            if exc.reply:
                with trio.move_on_at(deadline):
                    await send_all(sock, exc.reply)
            return None
        except (OSError, trio.ClosedResourceError):
            admitted = None  # the peer left, or the socket was closed to make room
        finally:
            self.stats.handshakes_pending -= 1
        if scope.cancelled_caught or admitted is None:
            if scope.cancelled_caught and trio.current_time() >= deadline:
                self.stats.handshake_timeouts += 1
            if admitted is not None:
                self._release_slot(sock)
            return None
        return admitted

    async def _answer(
        self, sock: socket.socket, connection: WSConnection, request: Request
    ) -> _Admitted | None:
        target = urlsplit(request.target)
        if _query_carries_token(target.query):
            # Query strings end up in proxy and access logs; refuse rather than accept a leaked token.
            log.warning("handshake_refused_token_in_query")
            await self._reject(
                sock, connection, 403, b"forbidden: send the token as Authorization: Bearer, not in the URL"
            )
            return None
        known, slot = _slot_from_path(target.path)
        if not known or (slot is not None and self.registry.get(slot) is None):
            await self._reject(sock, connection, 404, b"unknown path: use /v1/slots or /v1/slots/<slot>")
            return None
        if self.stopping:
            await self._reject(sock, connection, 503, b"shutting down")
            return None
        try:
            self.limiter.acquire_on_behalf_of_nowait(sock)
        except trio.WouldBlock:
            await self._reject(sock, connection, 503, b"too many connections")
            return None
        self._holding.add(sock)
        try:
            await send_all(sock, accept_response(connection))  # every offered extension refused
        except BaseException:
            self._release_slot(sock)
            raise
        return _Admitted(connection, slot, _bearer_token(request))

    async def _reject(self, sock: socket.socket, connection: WSConnection, status: int, body: bytes) -> None:
        self.stats.count_rejected(status)
        await send_all(sock, _rejection(connection, status, body))

    # --- connections --------------------------------------------------------------------------------

    async def _serve(self, sock: socket.socket, admitted: _Admitted) -> None:
        options = self.options
        ws = WebSocket(
            sock,
            admitted.connection,
            max_message_size=options.max_message_size,
            limits=options.send_limits,
            on_overrun=self.stats.count_send_overrun,
            on_peer_close=partial(self._release_slot, sock),
        )
        session = Session(ws, self.session, admitted.slot, admitted.token)
        self.connections.add(ws)
        self.stats.connections_total += 1
        self.stats.connections_open += 1
        try:
            if self.stopping:
                ws.close(CLOSE_GOING_AWAY, "going away", urgent=True)
            await ws.run(partial(self._connection_body, ws, session))
        finally:
            self.connections.discard(ws)
            self.stats.connections_open -= 1
            if ws.overrun:
                log.info("peer_overrun", slot=session.slot, send_deadline=options.send_deadline)
            if not self.connections:
                self._idle.notify()

    async def _connection_body(self, ws: WebSocket, session: Session) -> None:
        """One connection's lifetime: its session beside its heartbeat; a bug closes only this connection."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._heartbeat, ws, session.slot)
                await session.run()
                nursery.cancel_scope.cancel()
        except* ConnectionClosed:
            pass
        except* Exception:
            log.exception("connection_failed", slot=session.slot, close_code=CLOSE_INTERNAL_ERROR)
            ws.close(CLOSE_INTERNAL_ERROR, "internal error", urgent=True)

    async def _heartbeat(self, ws: WebSocket, slot: str | None) -> None:
        """Ping, and drop a peer that stops answering; the ping goes out between frames of any answer."""
        while True:
            await trio.sleep(self.options.heartbeat_interval)
            try:
                with trio.fail_after(self.options.heartbeat_timeout):
                    await ws.ping()
            except trio.TooSlowError:
                self.stats.ping_timeouts += 1
                log.info("peer_ping_timeout", slot=slot)
                ws.close(CLOSE_PING_TIMEOUT, "ping timeout", urgent=True)
                return


async def serve_recovery(
    registry: SlotDirectory,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    max_connections: int = 256,
    max_message_size: int = 1 << 20,
    follow_buffer_events: int = 65536,
    heartbeat_interval: float = HEARTBEAT_INTERVAL,
    options: ServingOptions | None = None,
    stats: ServerStats | None = None,
    task_status: trio.TaskStatus[RecoveryServerInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/v1/slots`` and ``/v1/slots/<name>`` until cancelled; ``started`` gets the bound port.

    ``options`` carries every bound; without it, the keyword arguments ``max_connections``,
    ``max_message_size`` and ``heartbeat_interval`` fill the defaults.  ``stats`` (optional) is bumped in
    place; the metrics endpoint reads ``stats.statistics()``.
    """
    if follow_buffer_events <= 0:
        raise ValueError(f"follow_buffer_events must be positive, got {follow_buffer_events}")
    if options is None:
        options = ServingOptions(
            max_connections=max_connections,
            max_message_size=max_message_size,
            heartbeat_interval=heartbeat_interval,
        )
    stats = ServerStats() if stats is None else stats
    turns = AnswerTurns(options.answer_turns, options.max_answer_wait)
    session = SessionConfig(registry, token, stats, follow_buffer_events, turns)
    server = _Server(registry, session, options, stats)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run, listeners)
        log.info("recovery_server_listening", host=host, port=bound_port)
        task_status.started(RecoveryServerInfo(host, bound_port))
        try:
            await trio.sleep_forever()
        finally:
            with trio.move_on_after(options.shutdown_timeout, shield=True):
                await server.shutdown()
            server.abort()
