"""``follow``: backlog then live over a real websocket while events are applied to the real index."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import FollowOverrun, RecoveryClientError
from kvagent.model.events import RouterEvent
from kvagent.recovery.client import connect_slot
from kvagent.recovery.session import LiveBuffer, open_follow
from tests.support.recovery import FakeSlot, start_server

PRELOADED = 1500
BURST = 3000


def replay(events: list[RouterEvent], into: RecoveryIndex) -> None:
    """Apply events with fresh consecutive ids (tree-dump ids are synthetic)."""
    base = into.current_event_id()
    for offset, event in enumerate(events, start=1):
        into.apply(
            RouterEvent(
                event.worker_id,
                event.storage_tier,
                event.residency_domain,
                base + offset,
                event.data,
                event.dp_rank,
                event.state_source,
            )
        )


async def follow_until(
    url: str, from_: int | None, newest: int
) -> tuple[str, list[RouterEvent], list[RouterEvent], list[int]]:
    """Follow until ``newest``; returns (backlog kind, backlog events, every non-dump id received)."""
    backlog_kind = ""
    backlog: list[RouterEvent] = []
    live: list[RouterEvent] = []
    ids: list[int] = []
    async with connect_slot(url, "a") as client:
        async for item in client.follow(from_):
            if item.kind in ("events", "tree_dump"):
                backlog_kind = item.kind
                backlog.extend(item.events)
                if item.kind == "tree_dump" and not item.more:
                    assert item.last_event_id is not None
                    ids.append(item.last_event_id)  # the dump's watermark: live continues after it
            else:
                assert backlog_kind, "live frames only after the backlog"
                live.extend(item.events)
            if item.kind != "tree_dump":
                ids.extend(event.event_id for event in item.events)
            if ids and ids[-1] == newest:
                return backlog_kind, backlog, live, ids
    raise AssertionError("follow ended early")


@pytest.mark.parametrize(
    ("from_", "ring_capacity", "expected_kind"),
    [(None, 1024, "tree_dump"), (100, 1024, "tree_dump"), (800, 8192, "events"), (PRELOADED, 8192, "events")],
)
async def test_follow_across_a_burst_has_no_gap_and_no_duplicate(
    nursery: trio.Nursery, from_: int | None, ring_capacity: int, expected_kind: str
) -> None:
    slot = FakeSlot(ring_capacity=ring_capacity)
    for block in range(PRELOADED):
        slot.store_worker(block)
    # 100 is older than the 1024-event ring; with 8192 the cursor stays buffered through the burst.
    url = await start_server(nursery, slot)
    newest = PRELOADED + BURST

    async def burst() -> None:
        # Start applying as soon as the follow request is on its way, so the hand-off races the ingest.
        await trio.lowlevel.checkpoint()
        for block in range(PRELOADED, newest):
            slot.store_worker(block)
            if block % 37 == 0:
                await trio.lowlevel.checkpoint()

    with trio.fail_after(30):
        async with trio.open_nursery() as inner:
            inner.start_soon(burst)
            kind, backlog, live, ids = await follow_until(url, from_, newest)

    assert ids == list(range(ids[0], newest + 1)), "ids strictly consecutive, no gap, no duplicate"
    assert kind == expected_kind
    if kind == "tree_dump":
        # Dump + live converge to the slot's resident state.
        rebuilt = RecoveryIndex(16)
        replay(backlog, rebuilt)
        replay(live, rebuilt)
        assert rebuilt.resident_blocks() == slot.index.resident_blocks()
        assert ids[0] >= PRELOADED
    else:
        assert from_ is not None and ids[0] == from_ + 1


async def test_slow_follower_is_overrun_then_resumes(nursery: trio.Nursery) -> None:
    slot = FakeSlot()
    for block in range(50):
        slot.store_worker(block)
    url = await start_server(nursery, slot, follow_buffer_events=16)
    received: list[int] = []
    with trio.fail_after(20):
        async with connect_slot(url, "a") as client:
            with pytest.raises(FollowOverrun) as overrun:
                async for item in client.follow(10):
                    received.extend(event.event_id for event in item.events)
                    if item.kind == "events" and not item.more:
                        # 100 events in one synchronous step: more than the 16-event buffer.
                        for block in range(50, 150):
                            slot.store_worker(block)
            with pytest.raises(ConnectionClosed) as closed:
                await client.ws.get_message()
            assert closed.value.reason is not None and closed.value.reason.code == 1013
        assert overrun.value.last_sent == received[-1] == 50
        async with connect_slot(url, "a") as client:
            async for item in client.follow(overrun.value.last_sent):
                received.extend(event.event_id for event in item.events)
                if received[-1] == 150:
                    break
    assert received == list(range(11, 151))


async def test_follow_from_the_future_is_too_new(nursery: trio.Nursery) -> None:
    slot = FakeSlot()
    slot.store_worker(1)
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with connect_slot(url, "a") as client:
            with pytest.raises(RecoveryClientError) as info:
                async for _ in client.follow(5):
                    pass
            assert info.value.code == "too_new"
            assert (await client.status()).outbound_cursor == 1  # the connection is still usable


class WatchedIndex(RecoveryIndex):
    """Sets ``unsubscribed`` when a subscriber leaves."""

    def __init__(self) -> None:
        super().__init__(16)
        self.unsubscribed = trio.Event()

    def subscribe(self, callback: Callable[[RouterEvent], None]) -> Callable[[], None]:
        unsubscribe = super().subscribe(callback)

        def watched() -> None:
            unsubscribe()
            self.unsubscribed.set()

        return watched


async def test_requests_during_follow_are_answered_and_disconnect_unsubscribes(nursery: trio.Nursery) -> None:
    slot = FakeSlot()
    index = slot._index = WatchedIndex()  # noqa: SLF001
    slot.store_worker(1)
    url = await start_server(nursery, slot)
    with trio.fail_after(10):
        async with open_websocket_url(f"{url}/v1/slots/a") as ws:
            await ws.send_message(json.dumps({"id": 1, "op": "follow", "from": 0}))
            backlog = json.loads(await ws.get_message())
            assert (backlog["kind"], backlog["more"], len(backlog["events"])) == ("events", False, 1)
            await ws.send_message(json.dumps({"id": 2, "op": "status"}))
            status = json.loads(await ws.get_message())
            assert status == {"id": 2, "ok": True, "status": slot.status().to_json()}
            await ws.send_message(json.dumps({"id": 3, "op": "follow", "from": 0}))
            refusal = json.loads(await ws.get_message())
            assert refusal["id"] == 3 and refusal["error"]["code"] == "bad_request"
            slot.store_worker(2)
            live = json.loads(await ws.get_message())
            assert live["kind"] == "live" and [e["event"]["event_id"] for e in live["events"]] == [2]
        # The client left: the server's follower must drop its subscription (and its buffer).
        await index.unsubscribed.wait()


def test_open_follow_is_one_synchronous_step() -> None:
    index = RecoveryIndex(16, 8)
    slot = FakeSlot()
    slot._index = index  # noqa: SLF001
    for block in range(5):
        slot.store_worker(block)
    session = open_follow(index, 2, 4)
    assert [event.event_id for event in session.backlog.events] == [3, 4, 5]  # type: ignore[union-attr]
    slot.store_worker(99)
    assert [event.event_id for event in session.buffer.drain(10)] == [6]
    for block in range(5):
        slot.store_worker(100 + block)
    assert session.buffer.overrun and len(session.buffer) == 0
    session.unsubscribe()
    caught_up = open_follow(index, index.current_event_id(), 4)
    assert caught_up.backlog.events == ()  # type: ignore[union-attr]
    caught_up.unsubscribe()
    with pytest.raises(ValueError):
        LiveBuffer(0)
