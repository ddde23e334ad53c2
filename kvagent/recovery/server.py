"""The websocket recovery & control endpoint (protocol v1, docs/protocol.md): every slot of the process.

Every connection handler is wrapped: an exception escaping a trio-websocket handler would stop
``serve_websocket`` as a whole (landscape.md 4), so ``ConnectionClosed`` is quiet, a failing request gets an
``internal`` error response, and anything else is logged and closes only that connection with 1011.

The token is never logged, nor is a request body (it may carry a ``token`` field) or a URL query.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from kvagent.index.recovery_index import (
    DumpSnapshot,
    EventsAnswer,
    InvalidRangeAnswer,
    TooNewAnswer,
    TreeDumpAnswer,
    TreeDumpFailedAnswer,
)
from kvagent.model.errors import KvAgentError
from kvagent.model.events import U32_MAX, U64_MAX
from kvagent.model.status import AgentStatus
from kvagent.recovery.dump import (
    columns_frames,
    encoded_ring,
    filter_snapshot,
    legacy_dump_parts,
    parse_dump_format,
    snapshot_header,
)
from kvagent.recovery.follow import run_follow
from kvagent.recovery.protocol import (
    Encoding,
    Fence,
    SlotDirectory,
    SlotSurface,
    check_recovery_fence,
    check_status_fence,
    decode_frame,
    encode_frame,
    error_frame,
    event_frames,
    filter_answer,
    optional_uint,
    parse_fence,
    post_check,
    required_str,
    required_uint,
    too_new_response,
)

__all__ = ["RecoveryServerInfo", "ServerStats", "serve_recovery"]

log = logging.getLogger(__name__)

CONTROL_OPS = frozenset({"attach", "detach", "quarantine"})
SLOT_OPS = frozenset({"status", "recover", "follow"}) | CONTROL_OPS
KNOWN_OPS = SLOT_OPS | {"list"}
CLOSE_INTERNAL_ERROR = 1011
HEARTBEAT_INTERVAL = 20.0
HEARTBEAT_TIMEOUT = 20.0


@attrs.frozen(slots=True)
class RecoveryServerInfo:
    host: str
    port: int


class ServerStats:
    """Plain counters the server bumps in place; Prometheus reads them at scrape time (``collect_metrics``).

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

    def collect_metrics(self) -> Iterator[Metric]:
        """Metric families for kvagent.agent.metrics (pass this object in its ``extra`` list)."""
        yield GaugeMetricFamily(
            "kvagent_recovery_connections_open",
            "Open recovery websocket connections",
            value=self.connections_open,
        )
        yield CounterMetricFamily(
            "kvagent_recovery_connections",
            "Accepted recovery websocket connections",
            value=self.connections_total,
        )
        rejected = CounterMetricFamily(
            "kvagent_recovery_rejected", "Refused recovery handshakes, by HTTP status", labels=["status"]
        )
        for status_code, count in sorted(self.rejected.items()):
            rejected.add_metric([str(status_code)], count)
        yield rejected
        requests = CounterMetricFamily("kvagent_recovery_requests", "Recovery requests, by op", labels=["op"])
        for op, count in sorted(self.requests.items()):
            requests.add_metric([op], count)
        yield requests
        errors = CounterMetricFamily(
            "kvagent_recovery_request_errors", "Recovery error responses, by code", labels=["code"]
        )
        for code, count in sorted(self.request_errors.items()):
            errors.add_metric([code], count)
        yield errors
        yield CounterMetricFamily(
            "kvagent_recovery_request_seconds",
            "Seconds spent answering recovery requests (follow excluded)",
            value=self.request_seconds_sum,
        )


@attrs.frozen(slots=True)
class _ServerConfig:
    registry: SlotDirectory
    token: str | None
    stats: ServerStats
    follow_buffer_events: int
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
            log.warning("refused a websocket handshake carrying a token in its URL query")
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
                await _serve_connection(_Connection(ws, config, slot, _bearer_token(request)))
            finally:
                config.stats.connections_open -= 1
        finally:
            limiter.release_on_behalf_of(request)
    except ConnectionClosed:
        pass
    except Exception:
        log.exception("websocket handshake failed")


async def _serve_connection(connection: _Connection) -> None:
    ws = connection.ws
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_heartbeat, ws, connection.config.heartbeat_interval)
            await connection.run()
            nursery.cancel_scope.cancel()
    except* ConnectionClosed:
        pass
    except* Exception:
        log.exception("websocket connection failed; closing it with 1011", extra={"slot": connection.slot})
        with trio.move_on_after(1, shield=True):
            await ws.aclose(CLOSE_INTERNAL_ERROR, "internal error")


async def _heartbeat(ws: WebSocketConnection, interval: float) -> None:
    """trio-websocket has no keepalive: ping, and drop a peer that stops answering."""
    while True:
        await trio.sleep(interval)
        with trio.move_on_after(HEARTBEAT_TIMEOUT) as scope:
            await ws.ping()
        if scope.cancelled_caught:
            log.info("websocket peer stopped answering pings; closing it")
            await ws.aclose(1001, "ping timeout")
            return


# --- requests -------------------------------------------------------------------------------------------


class _Connection:
    def __init__(
        self, ws: WebSocketConnection, config: _ServerConfig, slot: str | None, header_token: str | None
    ) -> None:
        self.ws = ws
        self.config = config
        self.slot = slot
        self._header_token = header_token
        self._following = False

    async def run(self) -> None:
        while True:
            await self.handle(await self.ws.get_message())

    async def handle(self, message: str | bytes) -> None:
        """Answer one request frame; only ConnectionClosed (and cancellation) escapes."""
        encoding = Encoding.MSGPACK if isinstance(message, bytes) else Encoding.JSON
        request_id: int | None = None
        stats = self.config.stats
        op_label = "invalid"
        started = trio.current_time()
        try:
            encoding, request = decode_frame(message)
            request_id = _request_id(request)
            assert isinstance(request, dict)
            op = _op(request)
            op_label = op if op in KNOWN_OPS else "invalid"
            stats.count_request(op_label)
            await self.dispatch(request_id, op, request, encoding)
        except KvAgentError as exc:
            log.info("request failed", extra={"slot": self.slot, "code": exc.code})
            stats.count_error(exc.code)
            await self.ws.send_message(error_frame(encoding, request_id, exc.code, exc.message))
        except ConnectionClosed:
            raise
        except Exception:
            log.exception("request failed unexpectedly", extra={"slot": self.slot})
            stats.count_error("internal")
            await self.ws.send_message(error_frame(encoding, request_id, "internal", "internal error"))
        finally:
            if op_label != "follow":
                stats.request_seconds_sum += trio.current_time() - started

    def surface(self) -> SlotSurface:
        surface = None if self.slot is None else self.config.registry.get(self.slot)
        if surface is None:
            raise KvAgentError(f"slot {self.slot!r} is no longer served here", code="not_ready")
        return surface

    async def send(self, encoding: Encoding, value: Mapping[str, object]) -> None:
        await self.ws.send_message(encode_frame(encoding, value))

    async def dispatch(self, request_id: int, op: str, request: dict[str, Any], encoding: Encoding) -> None:
        if op == "list":
            await self.send(encoding, {"id": request_id, "ok": True, "slots": self.list_slots()})
            return
        if op not in SLOT_OPS:
            raise KvAgentError(f"unknown op {op!r}", code="unknown_op")
        if self.slot is None:
            raise KvAgentError(f"op {op!r} needs a slot path /v1/slots/<slot>", code="bad_request")
        if op in CONTROL_OPS:
            self.authorize(request)
            result = await self.control(op, request)
            await self.send(encoding, {"id": request_id, "ok": True, **result})
        elif op == "status":
            status = self.surface().status()
            check_status_fence(status, parse_fence(request))
            await self.send(encoding, {"id": request_id, "ok": True, "status": status.to_json()})
        elif op == "recover":
            await self.recover(request_id, request, encoding)
        else:
            await self.follow(request_id, request, encoding)

    async def follow(self, request_id: int, request: Mapping[str, Any], encoding: Encoding) -> None:
        if self._following:
            raise KvAgentError("this connection is already following; open another one", code="bad_request")
        surface = self.surface()
        from_cursor = optional_uint(request, "from")
        dump_format = parse_dump_format(request)
        self._following = True
        try:
            await run_follow(
                self.ws,
                request_id,
                encoding,
                surface.index,
                from_cursor,
                self.config.follow_buffer_events,
                self.handle,
                dump_format,
            )
        finally:
            self._following = False

    def list_slots(self) -> list[dict[str, object]]:
        registry = self.config.registry
        slots: list[dict[str, object]] = []
        for name in registry.names():
            surface = registry.get(name)
            if surface is not None:
                slots.append({"name": name, "status": surface.status().to_json()})
        return slots

    def authorize(self, request: Mapping[str, Any]) -> None:
        expected = self.config.token
        offered = request.get("token", self._header_token)
        if expected is None:
            raise KvAgentError("control ops are disabled: the server has no token", code="unauthorized")
        if not isinstance(offered, str):
            raise KvAgentError("control ops require a bearer token", code="unauthorized")
        if not hmac.compare_digest(offered.encode(), expected.encode()):
            raise KvAgentError("invalid bearer token", code="unauthorized")

    async def control(self, op: str, request: Mapping[str, Any]) -> dict[str, object]:
        surface = self.surface()
        if op == "attach":
            replay = request.get("replay_endpoint")
            if replay is not None and not isinstance(replay, str):
                raise KvAgentError("replay_endpoint must be null or a string", code="bad_request")
            attachment = await surface.control_attach(
                worker_id=required_uint(request, "worker_id"),
                dp_rank=required_uint(request, "dp_rank", U32_MAX),
                endpoint=required_str(request, "endpoint"),
                topic=required_str(request, "topic", ""),
                replay_endpoint=replay,
            )
            return {"attachment": attachment.to_json()}
        generation = required_uint(request, "generation")
        if op == "detach":
            return {"cursor": await surface.control_detach(generation)}
        reason = required_str(request, "reason")
        if not reason:
            raise KvAgentError("reason must be a non-empty string", code="bad_request")
        await surface.control_quarantine(generation, reason)
        return {}

    async def recover(self, request_id: int, request: Mapping[str, Any], encoding: Encoding) -> None:
        surface = self.surface()
        start = optional_uint(request, "start")
        end = optional_uint(request, "end")
        supports_failed = request.get("supports_tree_dump_failed", False) is True
        dump_format = parse_dump_format(request)
        fence = parse_fence(request)
        before = surface.status()
        check_recovery_fence(before, fence, surface.slot_rank)
        result = surface.index.range_or_snapshot(start, end)
        if isinstance(result, DumpSnapshot):
            await self.send_dump(surface, request_id, result, before, fence, encoding, dump_format)
            return
        answer = filter_answer(result, before, fence)
        post_check(before, surface.status(), fence)

        if isinstance(answer, TooNewAnswer):
            await self.send(encoding, too_new_response(request_id, answer))
            return
        if isinstance(answer, InvalidRangeAnswer):
            await self.send(
                encoding,
                {
                    "id": request_id,
                    "ok": True,
                    "kind": "invalid_range",
                    "start_id": answer.start_id,
                    "end_id": answer.end_id,
                },
            )
            return
        if isinstance(answer, TreeDumpFailedAnswer):
            if not supports_failed:
                raise KvAgentError(f"worker tree dump failed: {answer.message}", code="internal")
            await self.send(
                encoding,
                {
                    "id": request_id,
                    "ok": True,
                    "kind": "tree_dump_failed",
                    "last_event_id": answer.last_event_id,
                    "message": answer.message,
                },
            )
            return
        await self.send_events_answer(surface, request_id, answer, before, fence, encoding)

    async def send_events_answer(
        self,
        surface: SlotSurface,
        request_id: int,
        answer: EventsAnswer | TreeDumpAnswer,
        before: AgentStatus,
        fence: Fence,
        encoding: Encoding,
    ) -> None:
        header: dict[str, object] = {
            "id": request_id,
            "ok": True,
            "kind": "events" if isinstance(answer, EventsAnswer) else "tree_dump",
            "last_event_id": answer.last_event_id,
        }
        if isinstance(answer, TreeDumpAnswer):
            header["reset_scope"] = answer.reset_scope.to_json()
        header["receipt"] = {
            "identity": before.identity.to_json(),
            "attachment_generation": fence.generation,
            "recovered_through_cursor": answer.last_event_id,
        }
        parts = encoded_ring(surface.index).encode(encoding, answer.events)
        await self.send_answer_frames(surface, event_frames(encoding, header, parts), before, fence)

    async def send_dump(
        self,
        surface: SlotSurface,
        request_id: int,
        snapshot: DumpSnapshot,
        before: AgentStatus,
        fence: Fence,
        encoding: Encoding,
        dump_format: str,
    ) -> None:
        groups, scope = filter_snapshot(snapshot, before, fence)
        post_check(before, surface.status(), fence)
        header: dict[str, object] = {"id": request_id, "ok": True, **snapshot_header(snapshot, scope)}
        header["receipt"] = {
            "identity": before.identity.to_json(),
            "attachment_generation": fence.generation,
            "recovered_through_cursor": snapshot.last_event_id,
        }
        if dump_format == "columns":
            frames = columns_frames(encoding, header, groups)
        else:
            frames = event_frames(encoding, header, legacy_dump_parts(encoding, groups))
        await self.send_answer_frames(surface, frames, before, fence)

    async def send_answer_frames(
        self, surface: SlotSurface, frames: Iterator[str | bytes], before: AgentStatus, fence: Fence
    ) -> None:
        # The answer is an immutable snapshot; frames are encoded lazily while sending, so a big dump
        # never holds the event loop for more than one frame.  The final frame (the one that completes
        # the answer) goes out only if the fence still holds (5.3 post-check).
        pending = next(frames)
        for frame in frames:
            await self.ws.send_message(pending)
            pending = frame
        post_check(before, surface.status(), fence)
        await self.ws.send_message(pending)


def _request_id(request: object) -> int:
    if not isinstance(request, dict):
        raise KvAgentError("request must be an object", code="bad_request")
    request_id = request.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id <= U64_MAX:
        raise KvAgentError("request id must be an integer in [0, 2^64 - 1]", code="bad_request")
    return request_id


def _op(request: dict[str, Any]) -> str:
    op = request.get("op")
    if not isinstance(op, str):
        raise KvAgentError("op must be a string", code="bad_request")
    return op


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

    ``stats`` (optional) is bumped in place for the metrics endpoint; see :class:`ServerStats`.
    """
    if follow_buffer_events <= 0:
        raise ValueError(f"follow_buffer_events must be positive, got {follow_buffer_events}")
    config = _ServerConfig(
        registry, token, ServerStats() if stats is None else stats, follow_buffer_events, heartbeat_interval
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
        log.info("recovery server listening", extra={"host": host, "port": websocket_server.port})
        task_status.started(RecoveryServerInfo(host, websocket_server.port))
