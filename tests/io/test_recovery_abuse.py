"""Abuse of the recovery endpoint: one bad client never costs another its service."""

from __future__ import annotations

import base64
import json
import os

import msgpack
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from kvagent.recovery.client import connect_slot
from tests.support.rawws import OP_TEXT, close_code, masked_frame, parse_frames
from tests.support.recovery import FakeSlot, start_server


@pytest.fixture
def slot() -> FakeSlot:
    slot = FakeSlot()
    for block in range(10):
        slot.store_worker(block)
    return slot


async def assert_served(url: str, slot: FakeSlot) -> None:
    async with connect_slot(url, "a") as client:
        assert await client.status() == slot.status()


@pytest.mark.parametrize("binary", [False, True])
async def test_oversized_frame_is_refused_as_bad_request(
    nursery: trio.Nursery, slot: FakeSlot, binary: bool
) -> None:
    """A request frame over max_message_size is discarded as it arrives and answered bad_request (id null);
    the connection stays usable, like after any other error response."""
    url = await start_server(nursery, slot, max_message_size=4096)
    request = {"id": 1, "op": "status", "pad": "x" * 200_000}
    with trio.fail_after(10):
        async with connect_slot(url, "a") as bystander, open_websocket_url(f"{url}/v1/slots/a") as ws:
            await ws.send_message(msgpack.packb(request) if binary else json.dumps(request))
            reply = await ws.get_message()
            assert isinstance(reply, bytes) == binary, "the refusal uses the frame's encoding"
            frame = msgpack.unpackb(reply) if isinstance(reply, bytes) else json.loads(reply)
            assert frame["ok"] is False and frame["id"] is None
            assert frame["error"]["code"] == "bad_request"
            assert "4096" in frame["error"]["message"]
            await ws.send_message(json.dumps({"id": 2, "op": "status"}))
            assert json.loads(await ws.get_message())["id"] == 2
            assert await bystander.status() == slot.status()
        await assert_served(url, slot)


@pytest.mark.parametrize(
    ("message", "expected_id", "code"),
    [
        ("{not json", None, "bad_request"),
        (b"\xc1\xc1\xc1", None, "bad_request"),  # 0xc1 is never valid msgpack
        (json.dumps([1, 2, 3]), None, "bad_request"),
        (json.dumps({"op": "status"}), None, "bad_request"),
        (json.dumps({"id": "7", "op": "status"}), None, "bad_request"),
        (json.dumps({"id": True, "op": "status"}), None, "bad_request"),
        (json.dumps({"id": 3}), 3, "bad_request"),
        (json.dumps({"id": 4, "op": "explode"}), 4, "unknown_op"),
        (msgpack.packb({"id": 5, "op": "nope"}), 5, "unknown_op"),
        (json.dumps({"id": 6, "op": "recover", "start": 1 << 70}), 6, "bad_request"),
        (json.dumps({"id": 7, "op": "recover", "start": -1, "end": 5}), 7, "bad_request"),
        (json.dumps({"id": 8, "op": "recover", "start": 1, "end": "all"}), 8, "bad_request"),
        (
            json.dumps({"id": 9, "op": "recover", "expected_identity": {"cache_owner_id": "x"}}),
            9,
            "bad_request",
        ),
        (json.dumps({"id": 10, "op": "follow", "from": 1.5}), 10, "bad_request"),
    ],
)
async def test_bad_requests_get_errors_and_the_connection_stays_open(
    nursery: trio.Nursery, slot: FakeSlot, message: str | bytes, expected_id: int | None, code: str
) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with open_websocket_url(f"{url}/v1/slots/a") as ws:
            await ws.send_message(message)
            reply = await ws.get_message()
            assert isinstance(reply, bytes) == isinstance(message, bytes), (
                "errors answer in the request encoding"
            )
            frame = msgpack.unpackb(reply) if isinstance(reply, bytes) else json.loads(reply)
            assert frame["ok"] is False
            assert frame["id"] == expected_id
            assert frame["error"]["code"] == code
            assert frame["error"]["message"]
            await ws.send_message(json.dumps({"id": 99, "op": "status"}))
            assert json.loads(await ws.get_message())["ok"] is True


async def test_huge_valid_ranges_are_answered(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            too_new = await client.recover(start=(1 << 64) - 1, end=(1 << 64) - 1)
            invalid = await client.recover(start=(1 << 64) - 1, end=0)
            everything = await client.recover(start=1, end=(1 << 64) - 1)
    assert too_new.kind == "too_new"
    assert invalid.kind == "invalid_range"
    assert [event.event_id for event in everything.events] == list(range(1, 11))


async def test_abrupt_disconnect_mid_dump_keeps_the_server_serving(nursery: trio.Nursery) -> None:
    slot = FakeSlot(ring_capacity=8)
    for block in range(20000):
        slot.store_worker(block)
    url = await start_server(nursery, slot)
    with trio.fail_after(20):
        for _ in range(3):
            async with open_websocket_url(f"{url}/v1/slots/a") as ws:
                await ws.send_message(json.dumps({"id": 1, "op": "recover", "start": None}))
                first = json.loads(await ws.get_message())
                assert first["more"] is True
                # Drop the TCP connection under the websocket without a close handshake.
                await ws._stream.aclose()  # noqa: SLF001 - simulating a crashed peer
        await assert_served(url, slot)


async def test_connection_limit_rejects_excess_with_503(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot, max_connections=8)
    admitted = 0
    rejected = 0
    release = trio.Event()
    all_tried = trio.Event()
    attempts = 40

    async def attempt() -> None:
        nonlocal admitted, rejected
        try:
            async with connect_slot(url, "a") as client:
                admitted += 1
                assert await client.status() == slot.status()
                if admitted + rejected == attempts:
                    all_tried.set()
                await release.wait()
        except ConnectionRejected as exc:
            assert exc.status_code == 503
            rejected += 1
            if admitted + rejected == attempts:
                all_tried.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as clients:
            for _ in range(attempts):
                clients.start_soon(attempt)
            await all_tried.wait()
            assert (admitted, rejected) == (8, 32)
            release.set()
        await assert_served(url, slot)  # capacity is released when connections end


async def _upgrade(url: str, extra_header: str = "") -> tuple[trio.SocketStream, bytes, bytes]:
    """A raw upgrade (with ``extra_header``): the stream, the response head and what followed it."""
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    await stream.send_all(
        (
            f"GET /v1/slots/a HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra_header}\r\n"
        ).encode()
    )
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(4096)
        assert chunk, "closed during the handshake"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    return stream, head, rest


async def test_an_offered_permessage_deflate_is_declined_and_a_compressed_frame_is_a_protocol_error(
    nursery: trio.Nursery, slot: FakeSlot
) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        offer = "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n"
        stream, head, rest = await _upgrade(url, offer)
        assert b" 101 " in head.split(b"\r\n", 1)[0]
        assert b"sec-websocket-extensions" not in head.lower()
        # RSV1 set: a compressed message, which nothing negotiated.  The server closes with 1002.
        frame = bytearray(masked_frame(OP_TEXT, json.dumps({"id": 1, "op": "status"}).encode()))
        frame[0] |= 0x40
        await stream.send_all(bytes(frame))
        data = rest
        while True:
            try:
                chunk = await stream.receive_some(1 << 16)
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                break
            data += chunk
        frames, _ = parse_frames(data)
        code = close_code(frames)
        assert code is not None and code[0] == 1002
        await stream.aclose()
    await assert_served(url, slot)


async def test_the_request_limit_counts_utf8_bytes(nursery: trio.Nursery, slot: FakeSlot) -> None:
    """A text request under the limit in characters but over it in bytes is refused as too big."""
    limit = 4096
    url = await start_server(nursery, slot, max_message_size=limit)
    request = json.dumps({"id": 1, "op": "status", "pad": "é" * 3000}, ensure_ascii=False)
    assert len(request) < limit < len(request.encode())
    with trio.fail_after(10):
        async with open_websocket_url(f"{url}/v1/slots/a") as ws:
            await ws.send_message(request)
            frame = json.loads(await ws.get_message())
            assert frame["ok"] is False and frame["id"] is None
            assert frame["error"]["code"] == "bad_request" and str(limit) in frame["error"]["message"]
            await ws.send_message(
                json.dumps({"id": 2, "op": "status", "pad": "é" * 1000}, ensure_ascii=False)
            )
            assert json.loads(await ws.get_message())["id"] == 2
