"""The HTTP surface over real sockets: every route, readiness, dumps equal to the websocket's, streaming, bounds.

Slots are FakeSlots over real RecoveryIndexes (tests/support/recovery.py); the same slot is served by the
websocket server where a test compares the two surfaces.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
import msgpack
import pytest
import trio

from kvagent.agent.http_routes import serve_http
from kvagent.agent.metrics import MetricSources
from kvagent.cli.main import build_parser, serve_config_from_args
from kvagent.model.events import Removed, ResidencyDomain, RouterEvent, StorageTier, Stored
from kvagent.model.status import AttachmentStatus
from kvagent.recovery.http import HttpOptions, HttpRequest, HttpStats, Response, run_http_server
from tests.support.ids import WORKER
from tests.support.recovery import FakeSlot, raw_request, start_server
from tests.support.serve import serve

TIMEOUT = 30


@asynccontextmanager
async def http_surface(
    *slots: FakeSlot, options: HttpOptions | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, HttpStats, int]]:
    stats = HttpStats()
    sources = MetricSources(slots=lambda: slots)  # type: ignore[arg-type,return-value]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_http, sources, port=0, options=options, stats=stats))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            yield http, stats, port
        nursery.cancel_scope.cancel()


def fill(slot: FakeSlot, blocks: int, *, first_hash: int = 1, per_event: int = 64) -> None:
    """``blocks`` Worker blocks as chains of ``per_event`` (one Stored event per chain)."""
    for start in range(first_hash, first_hash + blocks, per_event):
        hashes = tuple(range(start, min(start + per_event, first_hash + blocks)))
        data = Stored(None, hashes, tuple(h + 7 for h in hashes))
        slot.apply(
            RouterEvent(WORKER.worker_id, StorageTier.DEVICE, ResidencyDomain.WORKER, slot.next_id, data, 0)
        )


def mixed_slot(name: str = "a") -> FakeSlot:
    """Worker chains, a removal, CacheOwner blocks on another tier: several dump groups."""
    slot = FakeSlot(name)
    slot.store_worker(10)
    slot.store_worker(11, parent=10)
    slot.store_worker(12, parent=11)
    slot.store_cache_owner(50)
    slot.store_cache_owner(51)
    removal = RouterEvent(
        WORKER.worker_id, StorageTier.DEVICE, ResidencyDomain.WORKER, slot.next_id, Removed((12,)), 0
    )
    slot.apply(removal)
    fill(slot, 300, first_hash=1000)
    return slot


def attached(slot: FakeSlot, state: str) -> None:
    slot.set_status(attachment=AttachmentStatus(1, WORKER, state == "ready", 0, state))


async def test_the_server_answers_with_the_callable_it_is_given_and_bounds_its_streams() -> None:
    """recovery/http.py knows no route: what it answers is its caller's, and it tells the caller when
    ``max_dumps`` streamed answers are being sent (the agent's routes refuse a dump then)."""
    asked: list[tuple[bytes, bool]] = []

    def slow_pieces() -> Iterator[bytes]:
        yield b"first,"
        yield b"x" * (4 << 20)  # more than the loopback buffers take: the stream stays open until read

    def answer(request: HttpRequest, *, streams_allowed: bool) -> Response:
        asked.append((request.target, streams_allowed))
        if request.target == b"/stream":
            return Response(200, b"text/plain", stream=slow_pieces(), route="stream")
        return Response(200, b"text/plain", b"echo " + request.target, route="echo")

    stats = HttpStats()
    options = HttpOptions(max_dumps=1, send_deadline=TIMEOUT)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(run_http_server, answer, options=options, stats=stats))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                echoed = await http.get("/any/path?q=1")
                assert (echoed.status_code, echoed.text) == (200, "echo /any/path?q=1")
                async with http.stream("GET", "/stream") as streaming:
                    assert streaming.status_code == 200
                    # The head came after the count went up; the 4 MiB piece is not taken yet.
                    assert stats.dumps_streaming == 1
                    await http.get("/while-streaming")
                    body = b"".join([chunk async for chunk in streaming.aiter_bytes()])
                assert body.startswith(b"first,") and len(body) == 6 + (4 << 20)
                await http.get("/after")
            nursery.cancel_scope.cancel()
    assert asked == [
        (b"/any/path?q=1", True),
        (b"/stream", True),
        (b"/while-streaming", False),
        (b"/after", True),
    ]
    assert stats.statistics().requests == {"echo": 3, "stream": 1}


async def test_routes_answer_and_unknown_ones_are_json_404_or_405() -> None:
    slot, other = mixed_slot("a"), FakeSlot("ä b")
    attached(slot, "ready")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, slot)
            async with http_surface(slot, other) as (http, stats, _):
                assert (await http.get("/healthz")).status_code == 200
                listing = (await http.get("/v1/slots")).json()
                assert [(s["name"], s["state"], s["ready"]) for s in listing] == [
                    ("a", "ready", True),
                    ("ä b", "detached", False),
                ]
                assert listing[0]["status"] == slot.status().to_json()
                [frame] = await raw_request(f"{url}/v1/slots/a", {"id": 1, "op": "status"})
                response = await http.get("/v1/slots/a/status")
                assert (response.status_code, response.json()) == (200, frame["status"])
                decoded = await http.get("/v1/slots/%C3%A4%20b/status")  # percent-decoded slot name
                assert decoded.json() == other.status().to_json()
                for path in ("/v1/slots/nope/status", "/v1/slots/nope/dump", "/v1/slots/a/other", "/x"):
                    missing = await http.get(path)
                    assert missing.status_code == 404, path
                    assert missing.json()["error"]["code"] == "not_found"
                refused = await http.post("/v1/slots/a/dump", content=b"{}")
                assert (refused.status_code, refused.headers["allow"]) == (405, "GET, HEAD")
                assert refused.headers["connection"] == "close"  # its body is never read
                assert stats.requests == {"healthz": 1, "slots": 1, "status": 3, "dump": 1, "other": 3}
            nursery.cancel_scope.cancel()


async def test_metrics_include_the_surface_s_own_counters() -> None:
    with trio.fail_after(TIMEOUT):
        async with http_surface() as (http, _, _):
            await http.get("/healthz")
            await http.get("/nothing")
            metrics = await http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = set(metrics.text.splitlines())
    assert 'kvagent_http_requests_total{route="healthz"} 1.0' in samples
    assert 'kvagent_http_responses_total{status="404"} 1.0' in samples
    assert "kvagent_http_connections_open 1.0" in samples  # the scrape's own connection


async def test_readyz_names_the_slot_that_is_not_ready_until_all_are() -> None:
    a, b = FakeSlot("a"), FakeSlot("b")
    with trio.fail_after(TIMEOUT):
        async with http_surface(a, b) as (http, _, _):
            response = await http.get("/readyz")
            assert response.status_code == 503
            assert response.json()["slots"]["a"] == {
                "ready": False,
                "state": "detached",
                "reason": "no engine is attached",
            }
            attached(a, "ready")
            attached(b, "degraded")
            response = await http.get("/readyz")
            assert response.status_code == 503
            slots = response.json()["slots"]
            assert slots["a"] == {"ready": True, "state": "ready", "reason": None}
            assert (slots["b"]["ready"], slots["b"]["state"]) == (False, "degraded")
            assert "history was lost" in slots["b"]["reason"]
            attached(b, "ready")
            response = await http.get("/readyz")
            assert (response.status_code, response.json()["ready"]) == (200, True)


@pytest.mark.parametrize("binary", [False, True])
async def test_dump_is_the_websocket_dump(binary: bool) -> None:
    slot = mixed_slot()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, slot)
            frames = await raw_request(f"{url}/v1/slots/a", {"id": 1, "op": "recover"}, binary=binary)
            async with http_surface(slot) as (http, _, _):
                headers = {"accept": "application/msgpack"} if binary else {}
                response = await http.get("/v1/slots/a/dump", headers=headers)
            nursery.cancel_scope.cancel()
    assert response.status_code == 200
    assert response.headers["content-type"] == ("application/msgpack" if binary else "application/json")
    assert response.headers["transfer-encoding"] == "chunked"
    document = msgpack.unpackb(response.content, strict_map_key=False) if binary else response.json()
    events = [event for frame in frames for event in frame["events"]]
    assert len(events) == slot.index.resident_block_count == 304
    assert document == {
        "kind": "tree_dump",
        "last_event_id": frames[0]["last_event_id"],
        "reset_scope": frames[0]["reset_scope"],
        "events": events,
    }
    assert response.headers["x-kvagent-last-event-id"] == str(slot.index.current_event_id())


async def test_http_10_client_gets_the_dump_delimited_by_the_close() -> None:
    slot = mixed_slot()
    with trio.fail_after(TIMEOUT):
        async with http_surface(slot) as (_, _, port):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET /v1/slots/a/dump HTTP/1.0\r\n\r\n")
            received = b""
            while chunk := await stream.receive_some(65536):
                received += chunk
    head, body = received.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"chunked" not in head.lower()
    assert len(json.loads(body)["events"]) == 304


async def _open_stalled(port: int, path: bytes) -> trio.SocketStream:
    """A client with a small receive buffer that sends its request and then reads nothing."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    return stream


def _body_size(slot: FakeSlot) -> int:
    from kvagent.agent.http_routes import _dump

    response = _dump(slot, False)  # type: ignore[arg-type]
    assert response.stream is not None
    return sum(map(len, response.stream))


async def test_a_large_dump_streams_and_is_one_point_of_the_stream() -> None:
    """The first bytes arrive long before the body is encoded; blocks applied meanwhile are not in it."""
    slot = FakeSlot("big", ring_capacity=16)
    fill(slot, 100_000)
    total = _body_size(slot)
    last_event_id = slot.index.current_event_id()
    with trio.fail_after(TIMEOUT):
        async with http_surface(slot) as (_, stats, port):
            stream = await _open_stalled(port, b"/v1/slots/big/dump")
            received = await stream.receive_some(65536)
            assert received.startswith(b"HTTP/1.1 200 OK")
            # The server cannot be further ahead than what the socket buffers hold: it encodes as it sends.
            assert stats.dump_bytes < total // 3
            fill(slot, 1_000, first_hash=10_000_000)  # applied while the dump streams
            slot.apply(
                RouterEvent(
                    WORKER.worker_id,
                    StorageTier.DEVICE,
                    ResidencyDomain.WORKER,
                    slot.next_id,
                    Removed((1,)),
                    0,
                )
            )
            while chunk := await stream.receive_some(1 << 20):
                received += chunk
    body = _unchunk(received.split(b"\r\n\r\n", 1)[1])
    document = json.loads(body)
    assert document["last_event_id"] == last_event_id
    hashes = {event["event"]["data"]["stored"]["blocks"][0]["block_hash"] for event in document["events"]}
    assert hashes == set(range(1, 100_001))
    assert stats.dump_bytes == total


def _unchunk(data: bytes) -> bytes:
    """A chunked body, which must end with its last (empty) chunk."""
    pieces: list[bytes] = []
    while True:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            assert data == b"\r\n"
            return b"".join(pieces)
        pieces.append(data[:size])
        assert data[size : size + 2] == b"\r\n"
        data = data[size + 2 :]


async def test_a_stalled_dump_client_blocks_no_one_and_is_dropped_at_the_send_deadline() -> None:
    big, small = FakeSlot("big", ring_capacity=16), mixed_slot("small")
    fill(big, 100_000)
    attached(small, "ready")
    options = HttpOptions(send_deadline=0.5, max_dumps=2)
    with trio.fail_after(TIMEOUT):
        async with http_surface(big, small, options=options) as (http, stats, port):
            stalled = await _open_stalled(port, b"/v1/slots/big/dump")
            assert (await stalled.receive_some(4096)).startswith(b"HTTP/1.1 200 OK")
            # While it stalls: other requests, and another dump, are answered in full.
            assert (await http.get("/v1/slots/small/status")).status_code == 200
            assert (await http.get("/readyz")).status_code == 503  # "big" is detached
            dump = await http.get("/v1/slots/small/dump")
            assert len(dump.json()["events"]) == 304
            # It reads nothing more: the server gives up at the send deadline (polled, bounded) and closes.
            with trio.fail_after(10):
                while stats.send_timeouts == 0:  # noqa: ASYNC110  # polling a real observable, bounded
                    await trio.sleep(0.05)
            received = b""
            while chunk := await stalled.receive_some(1 << 20):
                received += chunk
            assert not received.endswith(b"0\r\n\r\n")  # truncated: no last chunk
            assert stats.send_timeouts == 1
            assert stats.dumps_streaming == 0


async def test_dumps_beyond_max_dumps_are_refused_with_retry_after() -> None:
    big = FakeSlot("big", ring_capacity=16)
    fill(big, 100_000)
    with trio.fail_after(TIMEOUT):
        async with http_surface(big, options=HttpOptions(max_dumps=1)) as (http, _, port):
            stalled = await _open_stalled(port, b"/v1/slots/big/dump")
            assert (await stalled.receive_some(4096)).startswith(b"HTTP/1.1 200 OK")
            refused = await http.get("/v1/slots/big/dump")
            assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
            assert refused.json()["error"]["code"] == "overloaded"
            assert (await http.get("/v1/slots/big/status")).status_code == 200  # only dumps are limited
            await stalled.aclose()


async def _exchange(port: int, request: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(request)
    received = b""
    while chunk := await stream.receive_some(65536):
        received += chunk
    return received


async def test_oversized_malformed_and_silent_requests_are_bounded() -> None:
    options = HttpOptions(max_request_bytes=1024, request_timeout=0.3, max_connections=2)
    with trio.fail_after(TIMEOUT):
        async with http_surface(FakeSlot(), options=options) as (_, stats, port):
            huge = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096 + b"\r\n\r\n"
            assert (await _exchange(port, huge)).startswith(b"HTTP/1.1 431 ")
            assert (await _exchange(port, b"NONSENSE\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
            assert await _exchange(port, b"GET /healthz HTTP/1.1\r\n") == b""  # never finished: closed
            assert stats.request_timeouts == 1
            silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
            with trio.fail_after(5):  # the third connection is over the limit: refused, not queued
                answer = await _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 503 ")
            assert stats.connections_refused == 1
            for stream in silent:
                await stream.aclose()


def _answers(received: bytes) -> list[tuple[bytes, dict[bytes, bytes], bytes]]:
    """The (status line, headers, body) of each Content-Length-framed answer in ``received``."""
    answers = []
    while received:
        head, received = received.split(b"\r\n\r\n", 1)
        status, *lines = head.split(b"\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(b":") for line in lines)}
        length = int(headers.get(b"content-length", b"0"))
        answers.append((status, headers, received[:length]))
        received = received[length:]
    return answers


async def test_head_gets_the_headers_of_get_without_a_body_and_takes_no_snapshot() -> None:
    slot = mixed_slot()
    with trio.fail_after(TIMEOUT):
        async with http_surface(slot) as (http, stats, port):
            get = await http.get("/v1/slots/a/status")
            received = await _exchange(
                port,
                b"HEAD /v1/slots/a/status HTTP/1.1\r\nHost: x\r\n\r\n"
                b"HEAD /v1/slots/a/dump HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            )
    status_head, dump_head = received.split(b"\r\n\r\n")[:2]
    assert received.endswith(b"\r\n\r\n")  # two heads and not one byte of a body
    assert status_head.startswith(b"HTTP/1.1 200 OK")
    assert f"content-length: {len(get.content)}".encode() in status_head.lower()
    assert dump_head.startswith(b"HTTP/1.1 200 OK")
    assert f"x-kvagent-last-event-id: {slot.index.current_event_id()}".encode() in dump_head.lower()
    assert stats.dump_bytes == 0 and stats.requests["dump"] == 1


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"GET /healthz HTTP/1.1\r\n\r\n", id="no-host-on-1.1"),
        pytest.param(b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", id="two-hosts"),
        pytest.param(b"GET /healthz\r\n\r\n", id="no-version"),
        pytest.param(b"GET /healthz HTTP/1.1 extra\r\nHost: x\r\n\r\n", id="extra-word"),
        pytest.param(b"GET /he lthz HTTP/1.1\r\nHost: x\r\n\r\n", id="space-in-target"),
        pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", id="tls-hello"),
        pytest.param(b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n", id="bad-header-name"),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            id="conflicting-lengths",
        ),
    ],
)
async def test_a_malformed_request_is_a_json_400_and_the_connection_closes(request_bytes: bytes) -> None:
    with trio.fail_after(TIMEOUT):
        async with http_surface(FakeSlot()) as (_, stats, port):
            received = await _exchange(port, request_bytes)
    [(status, headers, body)] = _answers(received)
    assert status.startswith(b"HTTP/1.1 400 ")
    assert headers[b"connection"] == b"close"
    assert json.loads(body)["error"]["code"] == "bad_request"
    assert stats.responses == {400: 1}


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", b"HTTP/1.1 505 HTTP Version Not Supported"),
        (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"HTTP/1.1 501 Not Implemented",
        ),
    ],
)
async def test_what_http_11_cannot_serve_is_refused_and_closed(request_bytes: bytes, status: bytes) -> None:
    with trio.fail_after(TIMEOUT):
        async with http_surface(FakeSlot()) as (_, _, port):
            [(line, headers, body)] = _answers(await _exchange(port, request_bytes))
    assert (line, headers[b"connection"]) == (status, b"close")
    assert json.loads(body)["error"]["code"] == "bad_request"


async def test_http_10_needs_no_host_and_a_kept_alive_connection_answers_pipelined_requests() -> None:
    with trio.fail_after(TIMEOUT):
        async with http_surface(FakeSlot()) as (_, stats, port):
            old = _answers(await _exchange(port, b"GET /healthz HTTP/1.0\r\n\r\n"))
            pipelined = _answers(
                await _exchange(
                    port,
                    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                )
            )
    assert [(status, body) for status, _, body in old] == [(b"HTTP/1.1 200 OK", b"ok\n")]
    assert [status for status, _, _ in pipelined] == [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 200 OK",
    ]
    assert [b"connection" in headers for _, headers, _ in pipelined] == [False, False, True]
    assert stats.connections_total == 2


async def test_a_client_reuses_its_connection() -> None:
    with trio.fail_after(TIMEOUT):
        async with http_surface() as (http, stats, _):
            for path in ("/healthz", "/readyz", "/v1/slots", "/metrics"):
                await http.get(path)
    assert stats.connections_total == 1
    assert sum(stats.responses.values()) == 4


async def _endless_head(port: int, sent: list[int]) -> bytes:
    """A request whose header never ends (sent until the server closes); what came back meanwhile."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = b""

    async def send_forever() -> None:
        await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        try:
            while True:
                await stream.send_all(b"a" * 16384)
                sent[0] += 16384
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_forever)
        try:
            while chunk := await stream.receive_some(65536):
                received += chunk
        except trio.BrokenResourceError:
            pass  # reset once the server stopped draining
        nursery.cancel_scope.cancel()
    await stream.aclose()
    return received


async def test_a_header_that_never_ends_is_answered_431_with_bounded_reading() -> None:
    """An unbounded parser would wait for the end of the head forever; this one answers at the bound."""
    options = HttpOptions(max_request_bytes=2048, request_timeout=10)
    sent = [0]
    with trio.fail_after(TIMEOUT):
        async with http_surface(FakeSlot(), options=options) as (_, stats, _port):
            received = await _endless_head(_port, sent)
    assert received.startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
    assert json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_large"
    assert stats.responses == {431: 1} and stats.request_timeouts == 0
    # The server read the bound, answered, then drained at most LINGER_BYTES before closing.
    assert sent[0] < 64 << 20


async def _trickle(port: int, closed: trio.Event) -> bytes:
    """A slow-loris client: a request head that keeps growing by one header line at a time."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    received = b""

    async def trickle() -> None:
        try:
            for index in range(10_000):
                await stream.send_all(b"X-%d: y\r\n" % index)
                await trio.sleep(0.02)  # the attacker's pace, not synchronization
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        try:
            while chunk := await stream.receive_some(4096):
                received += chunk
        except trio.BrokenResourceError:
            pass
        closed.set()
        nursery.cancel_scope.cancel()
    await stream.aclose()
    return received


async def test_a_slow_loris_is_closed_at_the_request_deadline_while_others_are_served() -> None:
    options = HttpOptions(request_timeout=0.5, max_request_bytes=1 << 20)
    slot = mixed_slot()
    attached(slot, "ready")
    closed = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with (
            http_surface(slot, options=options) as (http, stats, port),
            trio.open_nursery() as nursery,
        ):
            result: list[bytes] = []

            async def loris() -> None:
                result.append(await _trickle(port, closed))

            nursery.start_soon(loris)
            served = 0
            while not closed.is_set():  # the good client is answered all along
                assert (await http.get("/v1/slots/a/status")).status_code == 200
                served += 1
    assert result == [b""]  # closed without an answer, although bytes kept coming
    assert stats.request_timeouts == 1
    assert served > 0


async def test_bad_clients_do_not_affect_a_good_one() -> None:
    """Malformed, oversized, endless, trickling, silent and stalled clients at once; a good client's
    requests and a dump are all answered in full meanwhile."""
    big, small = FakeSlot("big", ring_capacity=16), mixed_slot("small")
    fill(big, 100_000)
    options = HttpOptions(request_timeout=1.0, max_request_bytes=2048, send_deadline=2.0)
    closed = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with (
            http_surface(big, small, options=options) as (http, stats, port),
            trio.open_nursery() as nursery,
        ):
            stalled = await _open_stalled(port, b"/v1/slots/big/dump")
            silent = await trio.open_tcp_stream("127.0.0.1", port)
            nursery.start_soon(_trickle, port, closed)
            nursery.start_soon(_endless_head, port, [0])
            nursery.start_soon(_exchange, port, b"NONSENSE\r\n\r\n")
            for _ in range(5):
                assert (await http.get("/v1/slots/small/status")).status_code == 200
                assert (await http.get("/healthz")).text == "ok\n"
                dump = await http.get("/v1/slots/small/dump")
                assert len(dump.json()["events"]) == 304
            await closed.wait()
            await silent.aclose()
            await stalled.aclose()
    assert stats.responses[200] >= 15 and stats.responses[400] == 1 and stats.responses[431] == 1
    assert stats.connections_open == 0


@pytest.mark.parametrize("option", ["--http", "--metrics"])
def test_http_option_and_its_older_name(option: str) -> None:
    args = build_parser().parse_args(["serve", "--slot", "s0", option, "127.0.0.1:9464"])
    config = serve_config_from_args(args)
    assert config.http_listen == "127.0.0.1:9464"


def test_http_on_the_command_line_overrides_metrics_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kvagent.toml"
    path.write_text('metrics = "127.0.0.1:9100"\n[[slots]]\nname = "s0"\n')
    file_only = serve_config_from_args(build_parser().parse_args(["serve", "--config", str(path)]))
    assert file_only.http_listen == "127.0.0.1:9100"
    args = build_parser().parse_args(["serve", "--config", str(path), "--http", "127.0.0.1:9200"])
    assert serve_config_from_args(args).http_listen == "127.0.0.1:9200"


async def test_kvagent_serve_http_readyz_names_an_unattached_slot(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with serve(tmp_path, "--slot", "s0", "--http", "127.0.0.1:0") as agent:
            line = await agent.log.wait_for(lambda text: "HTTP surface on http://" in text)
            base = line.split("HTTP surface on ", 1)[1].strip()
            async with httpx.AsyncClient(base_url=base) as http:
                ready = await http.get("/readyz")
                status = await http.get("/v1/slots/s0/status")
    assert ready.status_code == 503
    assert ready.json()["slots"]["s0"]["state"] == "detached"
    assert status.json()["attachment"] is None
