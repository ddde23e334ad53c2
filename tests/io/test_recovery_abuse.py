"""Abuse of the recovery endpoint: one bad client never costs another its service."""

from __future__ import annotations

import json

import msgpack
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from kvagent.recovery.client import connect_slot
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
