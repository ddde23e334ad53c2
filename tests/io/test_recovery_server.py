"""The websocket recovery endpoint over real trio-websocket connections on 127.0.0.1, port 0.

The slot surface is a fake, but its index is the real RecoveryIndex fed RouterEvents directly.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import attrs
import msgpack
import pytest
import trio
import trio.testing
from trio_websocket import ConnectionRejected, open_websocket_url

from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import RecoveryClientError
from kvagent.model.events import (
    CLEARED,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.model.ids import (
    KvStateAgentIdentity,
)
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.recovery.client import connect_slot
from kvagent.recovery.protocol import CACHE_OWNER_INCREMENTAL_UNSUPPORTED, MAX_FRAME_BYTES, ServerStatistics
from kvagent.recovery.server import ServerStats
from kvagent.wire.router_event import router_event_to_json
from tests.support.ids import IDENTITY, OWNER, WORKER
from tests.support.recovery import (
    OTHER_OWNER,
    TOKEN,
    FakeSlot,
    raw_request,
    start_server,
    structlog_via_stdlib,
)


@pytest.fixture
def slot() -> FakeSlot:
    slot = FakeSlot()
    slot.store_worker(100)
    slot.store_worker(101, parent=100)
    slot.store_cache_owner(500)
    slot.store_cache_owner(600, OTHER_OWNER)
    return slot


async def test_status_and_list(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot, FakeSlot("b"))
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            status = await client.status()
            assert status == slot.status()
            assert status.outbound_cursor == 4
        async with connect_slot(url, None) as client:
            slots = await client.list_slots()
        assert [entry["name"] for entry in slots] == ["a", "b"]
        assert slots[0]["status"] == slot.status().to_json()


async def test_status_fencing(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    other = KvStateAgentIdentity(OWNER, 42)
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            assert (await client.status(expected_identity=IDENTITY)).identity == IDENTITY
            with pytest.raises(RecoveryClientError) as info:
                await client.status(expected_identity=other)
            assert (info.value.code, info.value.message) == (
                "identity_mismatch",
                "KV state-agent status identity mismatch",
            )
            with pytest.raises(RecoveryClientError) as info:
                await client.status(generation=1)
            assert info.value.code == "generation_mismatch"
            slot.attach_ready(1)
            assert (await client.status(generation=1)).attachment is not None
            with pytest.raises(RecoveryClientError) as info:
                await client.status(generation=2)
            assert info.value.code == "generation_mismatch"


async def test_recover_tree_dump_equals_resident_set(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            result = await client.recover()
    assert result.kind == "tree_dump"
    assert result.last_event_id == 4
    assert result.reset_scope == "all"
    dumped = {(event.residency_domain, event.state_source, event.storage_tier) for event in result.events}
    assert len(result.events) == slot.index.resident_block_count == 4
    assert (ResidencyDomain.CACHE_OWNER, OTHER_OWNER, StorageTier.HOST_PINNED) in dumped
    rebuilt = RecoveryIndex(16)
    for offset, event in enumerate(result.events):
        rebuilt.apply(
            RouterEvent(
                event.worker_id,
                event.storage_tier,
                event.residency_domain,
                offset + 1,
                event.data,
                event.dp_rank,
                event.state_source,
            )
        )
    assert rebuilt.resident_blocks() == slot.index.resident_blocks()
    assert result.receipt == {
        "identity": IDENTITY.to_json(),
        "attachment_generation": None,
        "recovered_through_cursor": 4,
    }


async def test_recover_buffered_too_new_and_invalid_range(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            events = await client.recover(start=2)
            too_new = await client.recover(start=9, end=12)
            invalid = await client.recover(start=3, end=2)
    assert events.kind == "events"
    assert [event.event_id for event in events.events] == [2, 3, 4]
    assert events.events[0] == RouterEvent(
        17, StorageTier.DEVICE, ResidencyDomain.WORKER, 2, Stored(100, (101,), (102,)), 0, OWNER
    )
    assert events.receipt is not None and events.receipt["recovered_through_cursor"] == 4
    assert too_new.kind == "too_new"
    assert too_new.raw["requested_start"] == 9
    assert too_new.raw["requested_end"] == 12
    assert too_new.raw["newest_available"] == 4
    assert "receipt" not in too_new.raw
    assert invalid.kind == "invalid_range"
    assert (invalid.raw["start_id"], invalid.raw["end_id"]) == (3, 2)


async def test_recover_identity_and_generation_fencing(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            with pytest.raises(RecoveryClientError) as info:
                await client.recover(expected_identity=KvStateAgentIdentity(OWNER, 7), generation=1)
            assert info.value.code == "identity_mismatch"

            with pytest.raises(RecoveryClientError) as info:
                await client.recover(expected_identity=IDENTITY, generation=1)
            assert info.value.code == "generation_mismatch"  # no attachment yet

            slot.set_status(attachment=AttachmentStatus(1, WORKER, False, 0))
            with pytest.raises(RecoveryClientError) as info:
                await client.recover(expected_identity=IDENTITY, generation=1)
            assert info.value.code == "not_ready"

            slot.attach_ready(1)
            with pytest.raises(RecoveryClientError) as info:
                await client.recover(expected_identity=IDENTITY, generation=2)
            assert info.value.code == "generation_mismatch"
            with pytest.raises(RecoveryClientError) as info:
                await client.recover(expected_identity=IDENTITY, generation=1, worker_id=99)
            assert info.value.code == "generation_mismatch"

            fenced = await client.recover(start=1, expected_identity=IDENTITY, generation=1)
            assert fenced.kind == "events"
            # Worker events plus this owner's CacheOwner events; the other owner's event 4 is filtered out.
            assert [event.event_id for event in fenced.events] == [1, 2, 3]
            assert fenced.receipt == {
                "identity": IDENTITY.to_json(),
                "attachment_generation": 1,
                "recovered_through_cursor": 4,
            }
            dump = await client.recover(expected_identity=IDENTITY, generation=1)
            assert dump.reset_scope == "all"
            assert len(dump.events) == 3

            slot.set_status(cache_owner_ready=False)
            with pytest.raises(RecoveryClientError) as info:
                await client.recover(expected_identity=IDENTITY, generation=1)
            assert info.value.code == "not_ready"


async def test_cache_owner_only_recovery(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with connect_slot(url, "a", encoding="msgpack") as client:
            dump = await client.recover(expected_identity=IDENTITY)
            with pytest.raises(RecoveryClientError) as info:
                await client.recover(start=2, expected_identity=IDENTITY)
    assert dump.kind == "tree_dump"
    assert dump.reset_scope == {"domain": "cache_owner"}
    assert [(event.residency_domain, event.state_source) for event in dump.events] == [
        (ResidencyDomain.CACHE_OWNER, OWNER)
    ]
    assert dump.receipt == {
        "identity": IDENTITY.to_json(),
        "attachment_generation": None,
        "recovered_through_cursor": 4,
    }
    assert (info.value.code, info.value.message) == ("bad_request", CACHE_OWNER_INCREMENTAL_UNSUPPORTED)


class ShiftingSlot(FakeSlot):
    """Its attachment generation moves after ``stable_reads`` status reads: a re-attach mid-request."""

    def __init__(self, stable_reads: int) -> None:
        super().__init__(ring_capacity=8)
        self.stable_reads = stable_reads

    def status(self) -> AgentStatus:
        self.stable_reads -= 1
        if self.stable_reads < 0:
            return attrs.evolve(self.cell.get(), attachment=AttachmentStatus(2, WORKER, True, 0))
        return self.cell.get()


@pytest.mark.parametrize("stable_reads", [1, 2])
async def test_post_check_detects_change_during_recovery(nursery: trio.Nursery, stable_reads: int) -> None:
    # Reads: the fence check, the post-check after computing, the post-check before the final frame.
    slot = ShiftingSlot(stable_reads=10**9)
    for block in range(6000):  # a dump of more than one frame
        slot.store_worker(block)
    slot.attach_ready(1)
    slot.stable_reads = stable_reads
    url = await start_server(nursery, slot)
    request = {
        "id": 5,
        "op": "recover",
        "start": None,
        "expected_identity": IDENTITY.to_json(),
        "generation": 1,
    }
    with trio.fail_after(20):
        frames = await raw_request(f"{url}/v1/slots/a", request)
    assert len(frames) == (1 if stable_reads == 1 else 2)
    assert frames[-1]["ok"] is False
    assert frames[-1]["id"] == 5
    assert frames[-1]["error"]["message"].endswith("changed during recovery")


@pytest.mark.parametrize("binary", [False, True])
async def test_large_dump_streams_in_bounded_frames(nursery: trio.Nursery, binary: bool) -> None:
    slot = FakeSlot(ring_capacity=8)
    for block in range(12000):
        slot.store_worker(block, parent=block - 1 if block else None)
    url = await start_server(nursery, slot)
    with trio.fail_after(30):
        frames: list[dict[str, Any]] = []
        sizes: list[int] = []
        async with open_websocket_url(f"{url}/v1/slots/a", max_message_size=4 << 20) as ws:
            request = {"id": 9, "op": "recover", "start": None}
            await ws.send_message(msgpack.packb(request) if binary else json.dumps(request))
            while True:
                message = await ws.get_message()
                assert isinstance(message, bytes) == binary
                sizes.append(len(message))
                frame = msgpack.unpackb(message, strict_map_key=False) if binary else json.loads(message)
                frames.append(frame)
                if not frame["more"]:
                    break
    assert len(frames) > 1
    assert max(sizes) <= MAX_FRAME_BYTES
    assert all(frame["id"] == 9 and frame["ok"] and frame["kind"] == "tree_dump" for frame in frames)
    assert [frame["more"] for frame in frames] == [True] * (len(frames) - 1) + [False]
    events = [event for frame in frames for event in frame["events"]]
    assert events == [router_event_to_json(event) for event in slot.index.tree_dump().events]


async def test_msgpack_requests_get_msgpack_answers(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        (status,) = await raw_request(f"{url}/v1/slots/a", {"id": 1, "op": "status"}, binary=True)
        (events,) = await raw_request(
            f"{url}/v1/slots/a", {"id": 2, "op": "recover", "start": 3}, binary=True
        )
    assert status == {"id": 1, "ok": True, "status": slot.status().to_json()}
    assert events["kind"] == "events"
    assert [event["event"]["event_id"] for event in events["events"]] == [3, 4]


async def test_unknown_path_and_slot_are_rejected_404(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        for path in ("/v1/slots/missing", "/v2/slots/a", "/", "/v1/slots/a/extra"):
            with pytest.raises(ConnectionRejected) as info:
                async with open_websocket_url(url + path):
                    pass
            assert info.value.status_code == 404


async def test_cleared_slot_dump_is_empty_but_cursor_advances(nursery: trio.Nursery, slot: FakeSlot) -> None:
    slot.apply(RouterEvent(17, StorageTier.DEVICE, ResidencyDomain.WORKER, 5, CLEARED, 0, OWNER))
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            result = await client.recover()
    # The Worker clear drops the worker's blocks; CacheOwner residency stays.
    assert result.last_event_id == 5
    assert {event.residency_domain for event in result.events} == {ResidencyDomain.CACHE_OWNER}


# --- control ------------------------------------------------------------------------------------------


async def test_control_requires_token(
    nursery: trio.Nursery, slot: FakeSlot, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with structlog_via_stdlib():
        await _exercise_control_ops(nursery, slot)
    assert any(record.exc_info for record in caplog.records)  # the surface bug was logged
    # The only line allowed to show the URL is the test client's own trio-websocket "Connecting to" debug line.
    leaks = [
        record.getMessage()
        for record in caplog.records
        if ("wrong-token" in record.getMessage() or TOKEN in record.getMessage())
        and not record.getMessage().startswith("Connecting to ")
    ]
    assert leaks == []
    assert TOKEN not in "".join(str(record.exc_info) for record in caplog.records)


async def _exercise_control_ops(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot)
    attach: dict[str, Any] = {
        "worker_id": 17,
        "dp_rank": 0,
        "endpoint": "tcp://127.0.0.1:5557",
        "topic": "kv",
    }
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            with pytest.raises(RecoveryClientError) as info:
                await client.attach(**attach)
            assert info.value.code == "unauthorized"
            with pytest.raises(RecoveryClientError) as info:
                await client.detach(1)
            assert info.value.code == "unauthorized"
        async with connect_slot(url, "a", token="wrong-token") as client:
            with pytest.raises(RecoveryClientError) as info:
                await client.quarantine(1, "operator")
            assert info.value.code == "unauthorized"
        # A wrong token in the request body, too.
        (frame,) = await raw_request(
            f"{url}/v1/slots/a", {"id": 3, "op": "detach", "generation": 1, "token": "x"}
        )
        assert frame["error"]["code"] == "unauthorized"
        assert slot.control_calls == []

        with pytest.raises(ConnectionRejected) as rejected:
            async with open_websocket_url(f"{url}/v1/slots/a?token={TOKEN}"):
                pass
        assert rejected.value.status_code == 403

        async with connect_slot(url, "a", token=TOKEN) as client:
            attachment = await client.attach(**attach)
            assert attachment["generation"] == 7
            assert await client.detach(7) == 4
            with pytest.raises(RecoveryClientError) as info:
                await client.detach(7)
            assert info.value.code == "generation_mismatch"  # the surface's KvAgentError code
            await client.quarantine(7, "operator")
            with pytest.raises(RecoveryClientError) as info:
                await client.quarantine(7, "explode")
            assert info.value.code == "internal"
            assert (await client.status()).attachment is None  # the connection survived the failure
        # The token may also travel in the request body.
        (frame,) = await raw_request(
            f"{url}/v1/slots/a", {"id": 4, "op": "quarantine", "generation": 7, "reason": "r", "token": TOKEN}
        )
        assert frame == {"id": 4, "ok": True}
    assert slot.control_calls == [
        ("attach", 17, 0, "tcp://127.0.0.1:5557", "kv", None),
        ("detach", 7),
        ("detach", 7),
        ("quarantine", 7, "operator"),
        ("quarantine", 7, "explode"),
        ("quarantine", 7, "r"),
    ]


async def test_control_disabled_without_server_token(nursery: trio.Nursery, slot: FakeSlot) -> None:
    url = await start_server(nursery, slot, token=None)
    with trio.fail_after(10):
        async with connect_slot(url, "a", token="anything") as client:
            with pytest.raises(RecoveryClientError) as info:
                await client.detach(1)
    assert info.value.code == "unauthorized"
    assert slot.control_calls == []


async def test_server_stats_count_connections_rejections_and_requests(
    nursery: trio.Nursery, slot: FakeSlot
) -> None:
    stats = ServerStats()
    url = await start_server(nursery, slot, stats=stats)
    with trio.fail_after(10):
        with pytest.raises(ConnectionRejected):
            async with open_websocket_url(f"{url}/v1/nowhere"):
                pass
        with pytest.raises(ConnectionRejected):
            async with open_websocket_url(f"{url}/v1/slots/a?token=x"):
                pass
        async with connect_slot(url, "a") as client:
            assert stats.connections_open == 1
            await client.status()
            await client.recover()
            with pytest.raises(RecoveryClientError):
                await client.detach(1)
        (frame,) = await raw_request(f"{url}/v1/slots/a", {"id": 1, "op": "made-up-op-name"})
        assert frame["error"]["code"] == "unknown_op"
        # The handler decrements connections_open after the close handshake; wait for it without sleeping.
        while stats.connections_open:
            await trio.testing.wait_all_tasks_blocked()
    assert stats.connections_total == 2
    assert stats.rejected == {404: 1, 403: 1}
    assert stats.requests == {"status": 1, "recover": 1, "detach": 1, "invalid": 1}
    assert stats.request_errors == {"unauthorized": 1, "unknown_op": 1}
    assert stats.request_seconds_sum > 0
    snapshot = stats.statistics()
    assert snapshot == ServerStatistics(
        connections_open=0,
        connections_total=2,
        rejected={404: 1, 403: 1},
        requests={"status": 1, "recover": 1, "detach": 1, "invalid": 1},
        request_errors={"unauthorized": 1, "unknown_op": 1},
        request_seconds_sum=stats.request_seconds_sum,
    )
    stats.count_request("status")  # a snapshot is a copy: later counting does not change it
    assert snapshot.requests["status"] == 1


# --- kvagent.recovery.client.subscribe: event plane + websocket gap repair -------------------------------------


async def test_subscribe_repairs_event_plane_gaps(nursery: trio.Nursery) -> None:
    import zmq

    from kvagent._util.zmqtrio import TrioSocket
    from kvagent.recovery.client import SubscribeGapError, subscribe
    from kvagent.wire.event_plane import EVENT_PLANE_TOPIC
    from kvagent.wire.router_event import encode_router_events

    slot = FakeSlot(ring_capacity=16)
    events = [slot.store_worker(block) for block in range(30)]
    url = await start_server(nursery, slot)
    context: zmq.Context[Any] = zmq.Context.instance()
    xpub = context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscription, also a repeated one
    xpub.bind("tcp://127.0.0.1:0")
    endpoint = xpub.getsockopt_string(zmq.LAST_ENDPOINT)

    def message(batch: list[RouterEvent], publisher: int = IDENTITY.publisher_id) -> list[bytes]:
        return [
            EVENT_PLANE_TOPIC,
            publisher.to_bytes(8, "big"),
            batch[0].event_id.to_bytes(8, "big"),
            encode_router_events(batch),
        ]

    with TrioSocket(xpub) as plane, trio.fail_after(10):

        async def publish() -> None:
            while (await plane.recv_multipart())[0] != b"\x01" + EVENT_PLANE_TOPIC:
                pass  # an unsubscription of the previous SUB; wait until the new one is subscribed
            await plane.send_multipart(message(events[19:22]))  # ids 20..22: 16..19 missing after cursor 15
            await plane.send_multipart(message(events[24:27], publisher=999))  # another publisher: ignored
            await plane.send_multipart(message(events[21:23]))  # 22 is a duplicate, 23 new
            await plane.send_multipart(message(events[25:30]))  # 24..25 missing

        nursery.start_soon(publish)
        received: list[int] = []
        async with subscribe(url, "a", endpoint, from_cursor=15) as stream:
            async for event in stream:
                assert event == events[event.event_id - 1]
                received.append(event.event_id)
                if event.event_id == 30:
                    break
        assert received == list(range(16, 31))

        # A gap older than the ring (cursor 2, oldest buffered 15) cannot be repaired exactly once.
        nursery.start_soon(publish)
        with pytest.raises(SubscribeGapError):
            async with subscribe(url, "a", endpoint, from_cursor=2) as stream:
                async for _ in stream:
                    pass

        # A consumer cancelled while its own loop body waits (the iterator suspended at its yield) leaves
        # Trio's scope stack whole: the websocket's nursery belongs to the caller's `async with`, never to a
        # suspended generator (python-trio/trio#638; as a bare async generator this raised "Nursery stack
        # corrupted" when the consumer's task exited).
        nursery.start_soon(publish)
        first = trio.Event()

        async def consume_then_wait() -> None:
            async with subscribe(url, "a", endpoint, from_cursor=15) as stream:
                async for _ in stream:
                    first.set()
                    await trio.sleep_forever()

        async with trio.open_nursery() as consumers:
            consumers.start_soon(consume_then_wait)
            await first.wait()
            consumers.cancel_scope.cancel()
