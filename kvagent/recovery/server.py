"""The websocket recovery & control endpoint (protocol v1, docs/protocol.md): every slot of the process.

This module is the shell around the sessions: the handshake (path, token placement), the connection limiter,
the heartbeat and the per-connection lifecycle.  What a connection says is :mod:`kvagent.recovery.session`'s.

Every connection handler is wrapped: an exception escaping a trio-websocket handler would stop
``serve_websocket`` as a whole (landscape.md 4), so ``ConnectionClosed`` is quiet, a failing request gets an
``internal`` error response, and anything else is logged and closes only that connection with 1011.

The token is never logged, nor is a request body (it may carry a ``token`` field) or a URL query.
"""

from __future__ import annotations

from functools import partial
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
import structlog
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from kvagent.recovery.protocol import ServerStatistics, SlotDirectory
from kvagent.recovery.session import Session, SessionConfig

__all__ = ["RecoveryServerInfo", "ServerStats", "serve_recovery"]

log = structlog.get_logger(__name__)

CLOSE_INTERNAL_ERROR = 1011
HEARTBEAT_INTERVAL = 20.0
HEARTBEAT_TIMEOUT = 20.0


@attrs.frozen(slots=True)
class RecoveryServerInfo:
    host: str
    port: int


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

    def count_rejected(self, status_code: int) -> None:
        self.rejected[status_code] = self.rejected.get(status_code, 0) + 1

    def count_request(self, op: str) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1

    def count_error(self, code: str) -> None:
        self.request_errors[code] = self.request_errors.get(code, 0) + 1

    def count_request_seconds(self, seconds: float) -> None:
        self.request_seconds_sum += seconds

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(
            connections_open=self.connections_open,
            connections_total=self.connections_total,
            rejected=dict(self.rejected),
            requests=dict(self.requests),
            request_errors=dict(self.request_errors),
            request_seconds_sum=self.request_seconds_sum,
        )


@attrs.frozen(slots=True)
class _ServerConfig:
    session: SessionConfig
    registry: SlotDirectory
    stats: ServerStats
    heartbeat_interval: float


# --- handshake ----------------------------------------------------------------------------------------


def _bearer_token(request: WebSocketRequest) -> str | None:
    for key, value in request.headers:
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


async def _handle(config: _ServerConfig, limiter: trio.CapacityLimiter, request: WebSocketRequest) -> None:
    try:
        target = urlsplit(request.path)
        if _query_carries_token(target.query):
            # Query strings end up in proxy and access logs; refuse rather than accept a leaked token.
            log.warning("handshake_refused_token_in_query")
            config.stats.count_rejected(403)
            await request.reject(
                403, body=b"forbidden: send the token as Authorization: Bearer, not in the URL"
            )
            return
        known, slot = _slot_from_path(target.path)
        if not known or (slot is not None and config.registry.get(slot) is None):
            config.stats.count_rejected(404)
            await request.reject(404, body=b"unknown path: use /v1/slots or /v1/slots/<slot>")
            return
        try:
            limiter.acquire_on_behalf_of_nowait(request)
        except trio.WouldBlock:
            config.stats.count_rejected(503)
            await request.reject(503, body=b"too many connections")
            return
        try:
            ws = await request.accept()
            config.stats.connections_total += 1
            config.stats.connections_open += 1
            try:
                await _serve_connection(config, Session(ws, config.session, slot, _bearer_token(request)))
            finally:
                config.stats.connections_open -= 1
        finally:
            limiter.release_on_behalf_of(request)
    except ConnectionClosed:
        pass
    except Exception:
        log.exception("handshake_failed")


async def _serve_connection(config: _ServerConfig, session: Session) -> None:
    """One connection's lifetime: its session beside its heartbeat; a bug closes only this connection."""
    ws = session.ws
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_heartbeat, ws, config.heartbeat_interval)
            await session.run()
            nursery.cancel_scope.cancel()
    except* ConnectionClosed:
        pass
    except* Exception:
        log.exception("connection_failed", slot=session.slot, close_code=CLOSE_INTERNAL_ERROR)
        with trio.move_on_after(1, shield=True):
            await ws.aclose(CLOSE_INTERNAL_ERROR, "internal error")


async def _heartbeat(ws: WebSocketConnection, interval: float) -> None:
    """trio-websocket has no keepalive: ping, and drop a peer that stops answering."""
    while True:
        await trio.sleep(interval)
        with trio.move_on_after(HEARTBEAT_TIMEOUT) as scope:
            await ws.ping()
        if scope.cancelled_caught:
            log.info("peer_ping_timeout")
            await ws.aclose(1001, "ping timeout")
            return


async def serve_recovery(
    registry: SlotDirectory,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    max_connections: int = 256,
    max_message_size: int = 1 << 20,
    follow_buffer_events: int = 65536,
    heartbeat_interval: float = HEARTBEAT_INTERVAL,
    stats: ServerStats | None = None,
    task_status: trio.TaskStatus[RecoveryServerInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/v1/slots`` and ``/v1/slots/<name>`` until cancelled; ``started`` gets the bound port.

    ``stats`` (optional) is bumped in place; the metrics endpoint reads ``stats.statistics()``.
    """
    if follow_buffer_events <= 0:
        raise ValueError(f"follow_buffer_events must be positive, got {follow_buffer_events}")
    stats = ServerStats() if stats is None else stats
    config = _ServerConfig(
        SessionConfig(registry, token, stats, follow_buffer_events), registry, stats, heartbeat_interval
    )
    limiter = trio.CapacityLimiter(max_connections)
    async with trio.open_nursery() as nursery:
        websocket_server = await nursery.start(
            partial(
                serve_websocket,
                partial(_handle, config, limiter),
                host,
                port,
                None,
                max_message_size=max_message_size,
            )
        )
        log.info("recovery_server_listening", host=host, port=websocket_server.port)
        task_status.started(RecoveryServerInfo(host, websocket_server.port))
