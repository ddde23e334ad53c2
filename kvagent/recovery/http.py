"""The HTTP server beside the websocket server (``recovery/server.py``): h11 connections, the accept loop,
the deadlines and the bounds; what each request is answered is the caller's (:class:`Answer`).

``kvagent serve --http`` runs it with the agent's routes (``kvagent/agent/http_routes.py``: metrics,
readiness, slot status and dumps; docs/http.md). h11 parses each request and frames each answer: a
malformed request (a bad request line, a missing or repeated ``Host`` on HTTP/1.1, conflicting lengths) is
answered 400, a head longer than ``max_request_bytes`` 431 (h11's ``max_incomplete_event_size``: the bytes
buffered for one head stay within it plus one read), a version other than HTTP/1.0 and 1.1 505, HEAD gets
GET's headers without the body, and a connection is kept alive between requests unless the client asks to
close, speaks HTTP/1.0 or sent a body (a body is never read: the answerer sees only the head; the
connection closes after the answer). A :class:`Response` with a ``stream`` is encoded piece by piece as the
client takes it: HTTP/1.1 clients get it chunked (a truncated answer lacks the final chunk), HTTP/1.0 ones
until the close.

Bounds: each request head (the first, and each next one on a kept-alive connection) must arrive within
``request_timeout`` (a client trickling bytes is closed then too); a client that leaves a piece of an
answer untaken for ``send_deadline`` loses its connection; at most ``max_connections`` connections are
served (more get 503), and while ``max_dumps`` streamed answers are being sent the answerer is told
``streams_allowed=False`` (so it refuses a new one before doing its work). Accepting is
:func:`kvagent._util.listen.accept_loop`'s, which survives descriptor exhaustion, so a scrape still gets
through while the websocket port is under attack.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from typing import Protocol

import attrs
import h11
import structlog
import trio

from kvagent._util.listen import accept_loop, shed_pending_handshakes

__all__ = [
    "JSON",
    "Answer",
    "HttpOptions",
    "HttpRequest",
    "HttpStatistics",
    "HttpStats",
    "Response",
    "error_response",
    "json_response",
    "parse_request",
    "run_http_server",
]

log = structlog.get_logger(__name__)

JSON = b"application/json"
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
    """The HTTP server's bounds (docs/http.md); ``max_dumps`` bounds the streamed answers at once."""

    max_connections: int = 64
    max_request_bytes: int = 8192
    request_timeout: float = 5.0
    send_deadline: float = 10.0
    max_dumps: int = 2

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(HttpOptions):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"{field.name} must be positive, got {getattr(self, field.name)}")


@attrs.frozen(slots=True)
class HttpStatistics:
    """A snapshot of the HTTP surface's counters (:class:`HttpStats`).

    Attributes:
        connections_open: HTTP connections being served now.
        connections_total: HTTP connections accepted (refused ones included).
        connections_refused: connections answered 503 because ``max_connections`` were open.
        requests: requests by route (:attr:`Response.route`: the answerer's fixed names, ``other`` for the
            rest), so a client cannot grow the label set with made-up paths.
        responses: responses by HTTP status code.
        request_timeouts: connections closed because their request did not arrive within the deadline.
        send_timeouts: answers abandoned because the client did not take a piece within the send deadline.
        dump_bytes: body bytes of streamed answers sent (the agent's: ``/v1/slots/{slot}/dump``).
    """

    connections_open: int = 0
    connections_total: int = 0
    connections_refused: int = 0
    requests: Mapping[str, int] = attrs.field(factory=dict)
    responses: Mapping[int, int] = attrs.field(factory=dict)
    request_timeouts: int = 0
    send_timeouts: int = 0
    dump_bytes: int = 0


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


def json_response(status: int, value: object, route: str = "other", **headers: bytes) -> Response:
    body = json.dumps(value, separators=(",", ":")).encode()
    extra = tuple((name.replace("_", "-").encode(), text) for name, text in headers.items())
    return Response(status, JSON, body, headers=extra, route=route)


def error_response(status: int, code: str, message: str, route: str = "other", **headers: bytes) -> Response:
    return json_response(status, {"error": {"code": code, "message": message}}, route, **headers)


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


class Answer(Protocol):
    """What the server asks of its caller: the response to one parsed request (a stream's body is produced
    as the client takes it). ``streams_allowed`` is False while ``max_dumps`` streamed answers are being
    sent: a streamed answer must be refused then (503), before its work is done."""

    def __call__(self, request: HttpRequest, *, streams_allowed: bool) -> Response: ...


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
        self, stream: trio.SocketStream, answer: Answer, options: HttpOptions, stats: HttpStats
    ) -> None:
        self.stream = stream
        self.answer = answer
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
            streams_allowed = self.stats.dumps_streaming < self.options.max_dumps
            if event.http_version not in (b"1.0", b"1.1"):  # h11 reads any HTTP/x.y line
                body = True  # answered, then closed
                response = error_response(505, "bad_request", "only HTTP/1.0 and HTTP/1.1 are served")
            else:
                response = self.answer(request, streams_allowed=streams_allowed)
            await self.respond(response, close=body, head_only=request.method == b"HEAD")
            if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                return  # MUST_CLOSE (HTTP/1.0, Connection: close) or an unread body
            self.h11.start_next_cycle()
            first = False

    async def refuse_overload(self) -> None:
        """503 at once to a connection over ``max_connections`` (h11 lets a server answer before the
        request; its request is never read, so the close lingers)."""
        self.unread_input = True
        refusal = error_response(503, "overloaded", "too many HTTP connections", retry_after=b"1")
        with trio.move_on_after(REFUSAL_SECONDS):
            await self.respond(refusal, close=True)

    async def refuse_malformed(self, exc: h11.RemoteProtocolError) -> None:
        if exc.error_status_hint == 431:
            refusal = error_response(431, "too_large", "request head too large")
        else:
            refusal = error_response(exc.error_status_hint, "bad_request", f"malformed request: {exc}")
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


async def _handle(answer: Answer, options: HttpOptions, stats: HttpStats, stream: trio.SocketStream) -> None:
    stats.connections_total += 1
    stats.connections_open += 1
    connection = _Connection(stream, answer, options, stats)
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


async def run_http_server(
    answer: Answer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    options: HttpOptions | None = None,
    stats: HttpStats | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP on ``host:port`` with ``answer`` until cancelled; ``started`` gets the bound port."""
    options = options if options is not None else HttpOptions()
    stats = stats if stats is not None else HttpStats()
    handle = partial(_handle, answer, options, stats)
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
