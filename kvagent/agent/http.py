"""The HTTP surface (``kvagent serve --http HOST:PORT``): metrics, health, readiness, slot status and dumps.

Routes (GET and HEAD; any other method is 405, an unknown path or slot 404, both with a JSON body)::

    /metrics                    Prometheus text (kvagent.agent.metrics)
    /healthz                    200 while the process serves
    /readyz                     200 iff every slot is attached and ready, else 503; JSON names each slot
    /v1/slots                   JSON list: each slot's name, state, readiness and status
    /v1/slots/{slot}/status     the websocket ``status`` op's status object
    /v1/slots/{slot}/dump       the tree dump as one JSON document (msgpack with Accept: application/msgpack)

``{slot}`` is percent-decoded.  h11 parses each request and frames each answer: a malformed request (a bad
request line, a missing or repeated ``Host`` on HTTP/1.1, conflicting lengths) is answered 400, a head
longer than ``max_request_bytes`` 431 (h11's ``max_incomplete_event_size``: the bytes buffered for one
head stay within it plus one read), HEAD gets GET's headers without the body, and a connection is kept
alive between requests unless the client asks to close, speaks HTTP/1.0 or sent a body (a body is never
read: no route takes one; the connection closes after the answer). The dump is the websocket dump's
content (the same events, ids from 0, the same header fields), taken at one point of the slot's outbound
stream (``last_event_id``: the index's snapshot is a copy of its columns, about 25 bytes a block) and
encoded piece by piece as the client takes it: HTTP/1.1 clients get it chunked (a truncated answer lacks
the final chunk), HTTP/1.0 ones until the close.

Bounds: each request head (the first, and each next one on a kept-alive connection) must arrive within
``request_timeout`` (a client trickling bytes is closed then too); a client that leaves a piece of an
answer untaken for ``send_deadline`` loses its connection; at most ``max_connections`` connections are
served (more get 503) and at most ``max_dumps`` dumps stream at once (more get 503 with Retry-After).
Accepting is :func:`kvagent._util.listen.accept_loop`'s, which survives descriptor exhaustion, so a scrape
still gets through while the websocket port is under attack.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from urllib.parse import unquote, urlsplit

import attrs
import h11
import structlog
import trio

from kvagent._util.listen import accept_loop, shed_pending_handshakes
from kvagent.agent.metrics import HttpStatistics, MetricSources, readiness, render_metrics
from kvagent.agent.slot import SlotAgent
from kvagent.index.recovery_index import DumpSnapshot, TreeDumpFailedAnswer
from kvagent.model.events import RESET_ALL
from kvagent.recovery.dump import dump_document, snapshot_header
from kvagent.wire.router_event import Encoding

__all__ = [
    "HttpOptions",
    "HttpRequest",
    "HttpStats",
    "Response",
    "answer_request",
    "parse_request",
    "serve_http",
]

log = structlog.get_logger(__name__)

JSON = b"application/json"
MSGPACK = b"application/msgpack"
_MSGPACK_TYPES = (b"application/msgpack", b"application/x-msgpack", b"application/vnd.msgpack")
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    503: b"Service Unavailable",
    505: b"HTTP Version Not Supported",
}
LINGER_SECONDS = 1.0  # how long a close waits for a client still sending (see _Connection.linger)
LINGER_BYTES = 1 << 20


@attrs.frozen(slots=True)
class HttpOptions:
    """The HTTP surface's bounds (docs/http.md)."""

    max_connections: int = 64
    max_request_bytes: int = 8192
    request_timeout: float = 5.0
    send_deadline: float = 10.0
    max_dumps: int = 2

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(HttpOptions):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"{field.name} must be positive, got {getattr(self, field.name)}")


class HttpStats:
    """Plain counters bumped in place; :meth:`statistics` snapshots them for ``/metrics``."""

    def __init__(self) -> None:
        self.connections_open = 0
        self.connections_total = 0
        self.connections_refused = 0
        self.requests: dict[str, int] = {}
        self.responses: dict[int, int] = {}
        self.request_timeouts = 0
        self.send_timeouts = 0
        self.dump_bytes = 0
        self.dumps_streaming = 0

    def count(self, route: str, status: int) -> None:
        self.requests[route] = self.requests.get(route, 0) + 1
        self.responses[status] = self.responses.get(status, 0) + 1

    def statistics(self) -> HttpStatistics:
        return HttpStatistics(
            connections_open=self.connections_open,
            connections_total=self.connections_total,
            connections_refused=self.connections_refused,
            requests=dict(self.requests),
            responses=dict(self.responses),
            request_timeouts=self.request_timeouts,
            send_timeouts=self.send_timeouts,
            dump_bytes=self.dump_bytes,
        )


@attrs.frozen(slots=True)
class Response:
    """An answer: a whole body, or (``stream``) pieces produced as the client takes them."""

    status: int
    content_type: bytes
    body: bytes = b""
    stream: Iterable[bytes] | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    route: str = "other"


def _json(status: int, value: object, route: str = "other", **headers: bytes) -> Response:
    body = json.dumps(value, separators=(",", ":")).encode()
    extra = tuple((name.replace("_", "-").encode(), text) for name, text in headers.items())
    return Response(status, JSON, body, headers=extra, route=route)


def _error(status: int, code: str, message: str, route: str = "other", **headers: bytes) -> Response:
    return _json(status, {"error": {"code": code, "message": message}}, route, **headers)


@attrs.frozen(slots=True)
class HttpRequest:
    method: bytes
    target: bytes
    version: bytes
    headers: Mapping[bytes, bytes]

    def wants_msgpack(self) -> bool:
        accept = self.headers.get(b"accept", b"").lower()
        return any(kind in accept for kind in _MSGPACK_TYPES)


def _request_of(event: h11.Request) -> HttpRequest:
    return HttpRequest(
        event.method,
        event.target,
        b"HTTP/" + event.http_version,
        {name: value for name, value in event.headers},
    )


def parse_request(head: bytes) -> HttpRequest | None:
    """The request line and headers (names lower-cased) of a head without its blank line, parsed by h11;
    None when h11 refuses it."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(head + b"\r\n\r\n")
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError:
        return None
    return _request_of(event) if isinstance(event, h11.Request) else None


# --- routes -------------------------------------------------------------------------------------------


def _slot_entry(agent: SlotAgent) -> dict[str, object]:
    status = agent.status()
    return {
        "name": agent.name,
        "state": status.state,
        "ready": status.state == "ready",
        "status": status.to_json(),
    }


def _dump(agent: SlotAgent, msgpack_wanted: bool) -> Response:
    """The slot's tree dump at one point of its stream, unfenced (the operator's full view), streamed."""
    # A copy of the columns (a stale cached one is released first): later applies do not change it.
    snapshot = agent.index.range_or_snapshot(None, None)
    if isinstance(snapshot, TreeDumpFailedAnswer):  # never an empty dump in its place
        return _error(500, "internal", f"worker tree dump failed: {snapshot.message}", "dump")
    if not isinstance(snapshot, DumpSnapshot):  # impossible: a range without a start is always a dump
        return _error(500, "internal", "the index answered a dump request with events", "dump")
    header = {"kind": "tree_dump", **snapshot_header(snapshot, RESET_ALL)}
    encoding = Encoding.MSGPACK if msgpack_wanted else Encoding.JSON
    pieces = dump_document(encoding, header, snapshot.groups)
    content_type = MSGPACK if msgpack_wanted else JSON
    return Response(
        200, content_type, stream=pieces, headers=_last_event_header(snapshot.last_event_id), route="dump"
    )


def _last_event_header(last_event_id: int) -> tuple[tuple[bytes, bytes], ...]:
    return ((b"x-kvagent-last-event-id", str(last_event_id).encode()),)


def _slot_route(
    sources: MetricSources, segments: list[str], request: HttpRequest, dumps_allowed: bool
) -> Response:
    """``/v1/slots/{slot}/status`` and ``/v1/slots/{slot}/dump``."""
    name, action = segments
    route = action if action in ("status", "dump") else "other"
    if route == "other":
        return _error(404, "not_found", "unknown path: use /v1/slots/{slot}/status or /dump")
    agent = next((agent for agent in sources.slots() if agent.name == name), None)
    if agent is None:
        return _error(404, "not_found", f"no slot named {name!r} is served here", route)
    if route == "status":
        return _json(200, agent.status().to_json(), route)
    if request.method == b"HEAD":  # the headers a GET would get, without taking a snapshot
        content_type = MSGPACK if request.wants_msgpack() else JSON
        headers = _last_event_header(agent.index.current_event_id())
        return Response(200, content_type, stream=(), headers=headers, route=route)
    if not dumps_allowed:  # refused before the snapshot is copied
        return _error(
            503, "overloaded", "too many dumps are streaming; retry shortly", route, retry_after=b"1"
        )
    return _dump(agent, request.wants_msgpack())


def answer_request(sources: MetricSources, request: HttpRequest, *, dumps_allowed: bool = True) -> Response:
    """The response to one parsed request (a dump's body is still to be produced).

    ``dumps_allowed`` False: a dump request is answered 503 (too many are streaming).
    """
    if request.method not in (b"GET", b"HEAD"):
        return _error(405, "method_not_allowed", "only GET and HEAD are served", allow=b"GET, HEAD")
    try:
        path = urlsplit(request.target.decode("ascii")).path
    except (UnicodeDecodeError, ValueError):
        return _error(400, "bad_request", "the request target is not a valid URL")
    if path == "/metrics":
        return Response(
            200, b"text/plain; version=0.0.4; charset=utf-8", render_metrics(sources), route="metrics"
        )
    if path == "/healthz":
        return Response(200, b"text/plain; charset=utf-8", b"ok\n", route="healthz")
    if path == "/readyz":
        states = None if sources.slot_states is None else sources.slot_states()
        ready, body = readiness(sources.slots(), states)
        return _json(200 if ready else 503, body, "readyz")
    segments = path.strip("/").split("/")
    if segments[:2] == ["v1", "slots"]:
        if len(segments) == 2:
            agents = sorted(sources.slots(), key=lambda agent: agent.name)
            return _json(200, [_slot_entry(agent) for agent in agents], "slots")
        if len(segments) == 4:
            # Split first, decode each segment after: an encoded '/' stays inside its segment.
            return _slot_route(sources, [unquote(segments[2]), segments[3]], request, dumps_allowed)
    return _error(404, "not_found", f"unknown path {path!r}")


# --- the connection -----------------------------------------------------------------------------------

RECEIVE_BYTES = 4096  # one read; h11's buffer holds at most max_request_bytes plus this
REFUSAL_SECONDS = 1.0  # how long a connection over the limit may take to take its refusal


def _head(response: Response, *, close: bool) -> h11.Response:
    headers = [(b"Content-Type", response.content_type), (b"Cache-Control", b"no-store")]
    if response.stream is None:
        headers.append((b"Content-Length", b"%d" % len(response.body)))
    if close:
        headers.append((b"Connection", b"close"))
    headers += response.headers
    # h11 picks the framing of a streamed body: chunked for HTTP/1.1, until the close for HTTP/1.0.
    return h11.Response(
        status_code=response.status, headers=headers, reason=_REASONS.get(response.status, b"")
    )


class _SendTimeout(Exception):
    """The client did not take a piece of the answer within the send deadline."""


class _Connection:
    """One accepted connection: requests parsed and answers framed by h11, one at a time, until it closes."""

    def __init__(
        self, stream: trio.SocketStream, sources: MetricSources, options: HttpOptions, stats: HttpStats
    ) -> None:
        self.stream = stream
        self.sources = sources
        self.options = options
        self.stats = stats
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=options.max_request_bytes)
        # The client may still be sending (a body, an oversized head): closing now would reset the
        # connection and lose the answer, so the close first drains what it sends (see linger()).
        self.unread_input = False

    async def next_request(self) -> h11.Request | None:
        """The next request's head, or None when the peer closed; raises h11.RemoteProtocolError."""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(RECEIVE_BYTES))
                continue
            if isinstance(event, h11.Request):
                return event
            return None  # ConnectionClosed (or PAUSED after a request that was not answered)

    def body_follows(self) -> bool:
        """Whether the request just received has a body (never read: no route takes one)."""
        try:
            return not isinstance(self.h11.next_event(), h11.EndOfMessage)
        except h11.RemoteProtocolError:
            return True

    async def linger(self) -> None:
        """Before closing with input pending: end our side, then drain the peer's (bounded) until it closes."""
        if not self.unread_input:
            return
        with trio.move_on_after(LINGER_SECONDS):
            await self.stream.send_eof()
            drained = 0
            while drained < LINGER_BYTES and (chunk := await self.stream.receive_some(65536)):
                drained += len(chunk)

    async def send(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if not data:
            return
        with trio.move_on_after(self.options.send_deadline) as waiting:
            await self.stream.send_all(data)
        if waiting.cancelled_caught:
            self.stats.send_timeouts += 1
            raise _SendTimeout

    async def serve(self) -> None:
        """Answer requests until the client closes, h11 says the connection must close, or a deadline."""
        first = True
        while True:
            with trio.move_on_after(self.options.request_timeout) as reading:
                try:
                    event = await self.next_request()
                except h11.RemoteProtocolError as exc:
                    self.unread_input = True
                    await self.refuse_malformed(exc)
                    return
            if reading.cancelled_caught:
                # An idle kept-alive connection is simply closed; a started or first head is a timeout.
                if first or self.h11.trailing_data[0]:
                    self.stats.request_timeouts += 1
                return
            if event is None:
                return
            request = _request_of(event)
            body = self.body_follows()
            self.unread_input = body
            dumps_allowed = self.stats.dumps_streaming < self.options.max_dumps
            if event.http_version not in (b"1.0", b"1.1"):  # h11 reads any HTTP/x.y line
                body = True  # answered, then closed
                response = _error(505, "bad_request", "only HTTP/1.0 and HTTP/1.1 are served")
            else:
                response = answer_request(self.sources, request, dumps_allowed=dumps_allowed)
            await self.respond(response, close=body, head_only=request.method == b"HEAD")
            if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                return  # MUST_CLOSE (HTTP/1.0, Connection: close) or an unread body
            self.h11.start_next_cycle()
            first = False

    async def refuse_overload(self) -> None:
        """503 at once to a connection over ``max_connections`` (h11 lets a server answer before the
        request; its request is never read, so the close lingers)."""
        self.unread_input = True
        refusal = _error(503, "overloaded", "too many HTTP connections", retry_after=b"1")
        with trio.move_on_after(REFUSAL_SECONDS):
            await self.respond(refusal, close=True)

    async def refuse_malformed(self, exc: h11.RemoteProtocolError) -> None:
        if exc.error_status_hint == 431:
            refusal = _error(431, "too_large", "request head too large")
        else:
            refusal = _error(exc.error_status_hint, "bad_request", f"malformed request: {exc}")
        await self.respond(refusal, close=True)

    async def respond(self, response: Response, *, close: bool = False, head_only: bool = False) -> None:
        self.stats.count(response.route, response.status)
        if response.stream is None or head_only:
            await self.send(_head(response, close=close))
            if not head_only:
                await self.send(h11.Data(data=response.body))
            await self.send(h11.EndOfMessage())
            return
        self.stats.dumps_streaming += 1
        try:
            await self.send(_head(response, close=close))
            await self.send_stream(response.stream)
        finally:
            self.stats.dumps_streaming -= 1

    async def send_stream(self, pieces: Iterable[bytes]) -> None:
        # Each piece is encoded in the step that sends it; send_all is a checkpoint, so the other
        # connections and ingest run between two pieces.
        iterator: Iterator[bytes] = iter(pieces)
        for piece in iterator:
            self.stats.dump_bytes += len(piece)
            await self.send(h11.Data(data=piece))
        await self.send(h11.EndOfMessage())


async def _handle(
    sources: MetricSources, options: HttpOptions, stats: HttpStats, stream: trio.SocketStream
) -> None:
    stats.connections_total += 1
    stats.connections_open += 1
    connection = _Connection(stream, sources, options, stats)
    try:
        if stats.connections_open > options.max_connections:
            stats.connections_refused += 1
            await connection.refuse_overload()
        else:
            await connection.serve()
        await connection.linger()
    except (trio.BrokenResourceError, trio.ClosedResourceError, _SendTimeout):
        pass
    except Exception:
        log.exception("http_request_failed")
    finally:
        stats.connections_open -= 1
        with trio.move_on_after(1, shield=True):
            await stream.aclose()


async def serve_http(
    sources: MetricSources,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    options: HttpOptions | None = None,
    stats: HttpStats | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP surface until cancelled; ``started`` gets the bound port.

    Unless ``sources`` already names an HTTP statistics source, ``/metrics`` includes this server's own.
    """
    options = options if options is not None else HttpOptions()
    stats = stats if stats is not None else HttpStats()
    if sources.http is None:
        sources = attrs.evolve(sources, http=stats.statistics)
    handle = partial(_handle, sources, options, stats)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(
                partial(
                    accept_loop, listener.accept, handle, nursery, name="http", shed=shed_pending_handshakes
                )
            )
        log.info("http_listening", host=host, port=bound_port)
        task_status.started(bound_port)


serve_metrics = serve_http  # the name before the surface grew beyond /metrics
