"""The fast dump and answer paths agree with the slow reference ones.

- BlockStore.columns (a C-speed copy after a C-speed order check) against the per-block replay_order;
- the template-encoded per-event dump against router_event_to_wire / json.dumps of tree_dump();
- the columns dump format, framed and decoded by the real client, against tree_dump();
- the encoded-ring cache against fresh encodings;
- a streamed dump is a consistent snapshot while other tasks apply events and other clients are served.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio_websocket import open_websocket_url

import kvagent.index.store
from kvagent.index.recovery_index import DumpSnapshot, EventsAnswer, RecoveryIndex
from kvagent.index.store import BlockStore, StoreColumns
from kvagent.model.events import (
    CLEARED,
    FLAG_DEAD,
    FLAG_PARENT,
    MmExtraInfo,
    MmObject,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.recovery.client import connect_slot
from kvagent.recovery.dump import EncodedRing, columns_frames, dump_columns_from_wire, legacy_dump_parts
from kvagent.wire.router_event import Encoding, encode_event, router_event_to_wire
from tests.support.ids import OWNER, WORKER
from tests.support.recovery import OTHER_OWNER, FakeSlot, start_server

W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
DEVICE, HOST = StorageTier.DEVICE, StorageTier.HOST_PINNED
INFO = MmExtraInfo((MmObject(5, ((1, 2),)),))

# --- BlockStore.columns vs replay_order -------------------------------------------------------------

# An operation: ("store", parent or None, hashes) or ("remove", hashes).  Hashes come from a small range
# so re-stores, overwrites, reparenting, parents stored after their children and cycles all happen.
_hash = st.integers(0, 30)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.none() | _hash, st.lists(_hash, min_size=1, max_size=4, unique=True)),
        st.tuples(st.just("remove"), st.none(), st.lists(_hash, min_size=1, max_size=6)),
    ),
    max_size=60,
)


def _live(columns: StoreColumns) -> list[tuple[int, int | None, int, MmExtraInfo | None]]:
    rows = zip(columns.hashes, columns.parents, columns.tokens, columns.flags, strict=True)
    return [
        (block, parent if flag == FLAG_PARENT else None, tokens, columns.mm.get(row))
        for row, (block, parent, tokens, flag) in enumerate(rows)
        if flag != FLAG_DEAD
    ]


def _reference_parent_first(store: BlockStore) -> bool:
    """The order check written the obvious way over dict order."""
    position = {block: n for n, block in enumerate(store.hashes())}
    for n, block in enumerate(store.hashes()):
        found = store.get(block)
        assert found is not None
        parent = found[0]
        if parent is not None and position.get(parent, -1) >= n:
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(_ops, st.booleans())
def test_columns_equal_the_reference_order(ops: list[Any], tiny_compaction: bool) -> None:
    old = kvagent.index.store._COMPACT_MIN_FREE
    old_step = kvagent.index.store._COMPACT_STEP_ROWS
    kvagent.index.store._COMPACT_MIN_FREE = 2 if tiny_compaction else old
    kvagent.index.store._COMPACT_STEP_ROWS = 3 if tiny_compaction else old_step
    try:
        store = BlockStore()
        for kind, parent, hashes in ops:
            if kind == "store":
                infos = tuple(INFO if h % 7 == 0 else None for h in hashes)
                store.store(parent, tuple(hashes), tuple(h + 1000 for h in hashes), infos)
            else:
                store.remove(tuple(hashes))
    finally:
        kvagent.index.store._COMPACT_MIN_FREE = old
        kvagent.index.store._COMPACT_STEP_ROWS = old_step
    reference = list(store.replay_order())
    columns = store.columns()
    assert store.rows_parent_first() == _reference_parent_first(store)
    native = kvagent.index.store._PARENTS_FIRST
    kvagent.index.store._PARENTS_FIRST = None  # the pure-Python check agrees too (the compiled one when built)
    try:
        assert store.rows_parent_first() == _reference_parent_first(store)
    finally:
        kvagent.index.store._PARENTS_FIRST = native
    assert columns.live == len(store) == len(reference)
    if store.rows_parent_first():
        # The fast copy is exactly the reference order (dict order needs no reordering).
        assert _live(columns) == reference
    else:
        assert _live(columns) == _live(store.replay_columns()) == reference
    assert all(block == 0 for block, flag in zip(columns.hashes, columns.flags, strict=True) if flag == FLAG_DEAD)


def test_a_parent_stored_after_its_child_takes_the_exact_path() -> None:
    store = BlockStore()
    store.store(1, (2, 3), (20, 30), None)  # parent 1 not resident yet
    assert store.rows_parent_first()
    store.store(None, (1,), (10,), None)  # now resident, in a later row
    assert not store.rows_parent_first()
    assert [row[0] for row in _live(store.columns())] == [1, 2, 3]


def test_a_resident_hash_zero_falls_back_to_the_full_check() -> None:
    store = BlockStore()
    store.store(None, (5,), (50,), None)  # a root: its parent column holds 0
    store.store(None, (0,), (1,), None)
    assert store.rows_parent_first() and _live(store.columns()) == [(5, None, 50, None), (0, None, 1, None)]


# --- index-level dumps ------------------------------------------------------------------------------


def _mixed_index() -> RecoveryIndex:
    index = RecoveryIndex(16)
    events = [
        RouterEvent(7, HOST, W, 1, Stored(None, (1, 2, 3), (4, 5, 6), (None, INFO, None)), 0),
        RouterEvent(7, DEVICE, W, 2, Stored(3, (10, 11, 12), (4, 5, 6)), 1),
        RouterEvent(7, DEVICE, W, 3, Removed((11,)), 1),
        RouterEvent(9, HOST, C, 4, Stored(None, (20,), (21,)), 2, OWNER),
        RouterEvent(9, HOST, C, 5, Stored(20, (21, 22), (22, (1 << 64) - 1)), 2, OTHER_OWNER),
        RouterEvent(7, DEVICE, W, 6, Stored(None, (9,), (90,)), 1),
        RouterEvent(7, DEVICE, W, 7, Stored(9, (10,), (100,)), 1),  # reparented under a later block
    ]
    for event in events:
        index.apply(event)
    return index


def test_template_encoded_dump_equals_the_reference_encoding() -> None:
    index = _mixed_index()
    reference = [router_event_to_wire(event) for event in index.tree_dump().events]
    groups = index.dump_snapshot().groups
    packed = [msgpack.unpackb(part, strict_map_key=False) for part in legacy_dump_parts(Encoding.MSGPACK, groups, 2)]
    assert packed == reference
    texts = list(legacy_dump_parts(Encoding.JSON, groups, 2))
    assert texts == [json.dumps(wire, separators=(",", ":")) for wire in reference]


@pytest.mark.parametrize("encoding", [Encoding.MSGPACK, Encoding.JSON])
def test_columns_frames_round_trip_within_the_frame_limit(encoding: Encoding) -> None:
    index = _mixed_index()
    for event_id in range(8, 400):
        info = (INFO,) if event_id % 50 == 0 else None
        index.apply(RouterEvent(7, DEVICE, W, event_id, Stored(event_id - 1, (event_id,), (event_id,), info), 1))
    index.apply(RouterEvent(7, DEVICE, W, 400, Removed(tuple(range(100, 140))), 1))
    limit = 2048
    frames = list(columns_frames(encoding, {"id": 1, "ok": True}, index.dump_snapshot().groups, limit=limit))
    assert len(frames) > 3 and all(len(frame) <= limit for frame in frames)
    decoded = [msgpack.unpackb(f) if isinstance(f, bytes) else json.loads(f) for f in frames]
    assert [frame["more"] for frame in decoded] == [True] * (len(frames) - 1) + [False]
    pieces = [dump_columns_from_wire(piece) for frame in decoded for piece in frame["groups"]]
    assert [e for piece in pieces for e in piece.events()] == list(index.tree_dump().events)


def test_dump_snapshot_is_cached_until_the_next_apply() -> None:
    index = _mixed_index()
    first = index.dump_snapshot()
    assert index.dump_snapshot() is first and first.last_event_id == 7 and first.events == 9
    index.apply(RouterEvent(7, DEVICE, W, 8, Removed((404,)), 1))
    assert index.range_or_snapshot(8, None) == EventsAnswer((index.ring_tail(8)), 8)
    assert index._snapshot_cache is None  # a stale copy is released by the next query
    second = index.range_or_snapshot(None, None)
    assert isinstance(second, DumpSnapshot) and second is not first and second.last_event_id == 8


# --- the encoded ring -------------------------------------------------------------------------------


def test_cached_encodings_equal_fresh_ones_and_stay_bounded() -> None:
    slot = FakeSlot(ring_capacity=8)
    ring = EncodedRing(slot.index, wire_segments=2)
    for block in range(4):
        slot.store_worker(block)
    events = slot.index.ring_tail(1)
    for encoding in Encoding:
        first = ring.encode(encoding, events)
        assert list(map(_decode, first)) == [_decode(encode_event(encoding, event)) for event in events]
        cached = ring.statistics()
        again = ring.encode(encoding, events)
        assert list(again) == list(first)
        if encoding is Encoding.JSON:
            assert all(a is b for a, b in zip(first, again, strict=True))  # served from the cache
        else:
            assert cached["wire_bytes"] > 0 and ring.statistics() == cached  # the segment's encoding, reused
    for block in range(4, 2000):
        slot.store_worker(block)
        for encoding in Encoding:
            ring.encode(encoding, slot.index.ring_tail(slot.index.current_event_id()))
    stats = ring.statistics()
    assert stats["json_events"] <= 2 * 8 + 1024
    assert stats["wire_segments"] <= 2 and stats["wire_bytes"] <= 2 * 8 * 400  # two 8-event segments
    # A non-consecutive selection (a fenced, filtered answer) takes the per-event lookup.
    tail = slot.index.ring_tail(slot.index.current_event_id() - 5)
    picked = [tail[0], tail[2], tail[5]]
    for encoding in Encoding:
        assert list(ring.encode(encoding, picked)) == [encode_event(encoding, event) for event in picked]


def _decode(part: str | bytes) -> Any:
    return msgpack.unpackb(part, strict_map_key=False) if isinstance(part, bytes) else json.loads(part)


@pytest.mark.parametrize(
    "event",
    [
        RouterEvent(7, DEVICE, W, 1, Stored(None, (1, 2), (3, (1 << 64) - 1)), 0),
        RouterEvent(7, HOST, C, (1 << 64) - 1, Stored(5, (1,), (2,), None, 16), 3, OWNER, "session"),
        RouterEvent(7, HOST, W, 2, Stored(5, (1, 2), (2, 3), (None, INFO)), 3),  # mm: the reference path
        RouterEvent(8, DEVICE, W, 3, Removed((0, 1 << 63)), 1, OTHER_OWNER),
        RouterEvent(8, DEVICE, W, 4, CLEARED, 1, None, "s"),
    ],
)
def test_fast_event_encoding_decodes_to_the_reference_map(event: RouterEvent) -> None:
    assert _decode(encode_event(Encoding.MSGPACK, event)) == router_event_to_wire(event)
    assert encode_event(Encoding.JSON, event) == json.dumps(router_event_to_wire(event), separators=(",", ":"))


def test_ring_tail_matches_a_slice() -> None:
    slot = FakeSlot(ring_capacity=64)
    ring = [slot.store_worker(block) for block in range(100)][-64:]
    for start in (37, 50, 99, 100):
        assert slot.index.ring_tail(start) == tuple(e for e in ring if e.event_id >= start)


# --- over the websocket -----------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
async def test_columns_dump_round_trips_through_the_client(nursery: trio.Nursery, encoding: str) -> None:
    slot = FakeSlot()
    for block in range(1, 3000):
        slot.store_worker(block, parent=block - 1 if block % 4 else None)
    slot.store_cache_owner(900_000)
    url = await start_server(nursery, slot)
    async with connect_slot(url, "a", encoding=encoding) as client:
        compact = await client.recover(None, dump_format="columns")
        classic = await client.recover(None)
        raw = await client.recover(None, raw_events=True)
        buffered = await client.recover(slot.index.current_event_id() - 5, dump_format="columns")
        lazy = await client.recover(slot.index.current_event_id() - 5, lazy_events=True)
    assert compact.kind == classic.kind == "tree_dump" and compact.events == ()
    assert compact.last_event_id == classic.last_event_id == slot.index.current_event_id()
    assert compact.receipt == classic.receipt and compact.reset_scope == classic.reset_scope == "all"
    assert list(compact.all_events()) == list(classic.events) == list(slot.index.tree_dump().events)
    assert sum(piece.live for piece in compact.dump) == slot.index.resident_block_count
    assert list(raw.wire_events) == [router_event_to_wire(e) for e in classic.events]
    assert buffered.kind == "events" and len(buffered.events) == 6 and buffered.dump == ()
    assert lazy.events == () and list(lazy.all_events()) == list(buffered.events)
    assert lazy.last_event_id == buffered.last_event_id and lazy.receipt == buffered.receipt
    assert len(lazy.events_msgpack) == (1 if encoding == "msgpack" else 0)


async def test_streamed_dump_is_a_snapshot_while_others_apply_and_are_served(nursery: trio.Nursery) -> None:
    """A multi-frame dump yields between frames: an apply and another client's request complete while it is
    half sent, and the dump still describes exactly the state at the request."""
    slot = FakeSlot()
    for block in range(1, 20_000):
        slot.store_worker(block, parent=block - 1 if block % 4 else None)
    expected = list(slot.index.tree_dump().events)
    cursor = slot.index.current_event_id()
    url = await start_server(nursery, slot)
    async with open_websocket_url(f"{url}/v1/slots/a", max_message_size=4 << 20) as ws:
        await ws.send_message(msgpack.packb({"id": 1, "op": "recover", "start": None}))
        first = msgpack.unpackb(await ws.get_message(), strict_map_key=False)
        assert first["more"] is True and first["kind"] == "tree_dump"
        # The dump is half sent: ingest goes on and another client is answered meanwhile.
        slot.apply(RouterEvent(WORKER.worker_id, DEVICE, W, cursor + 1, Removed((1, 2, 3)), 0, OWNER))
        async with connect_slot(url, "a") as other:
            assert (await other.status()).outbound_cursor == cursor + 1
            assert (await other.recover(cursor + 1)).kind == "events"
        frames = [first]
        while frames[-1]["more"]:
            frames.append(msgpack.unpackb(await ws.get_message(), strict_map_key=False))
    assert {frame["last_event_id"] for frame in frames} == {cursor}
    events = [event for frame in frames for event in frame["events"]]
    assert events == [router_event_to_wire(event) for event in expected]
    assert len(events) == 19_999


async def test_follow_with_a_columns_dump_then_live_has_no_gap(nursery: trio.Nursery) -> None:
    slot = FakeSlot()
    for block in range(1, 500):
        slot.store_worker(block)
    url = await start_server(nursery, slot)
    seen: list[int] = []
    async with connect_slot(url, "a", encoding="msgpack") as client:
        backlog_blocks = 0
        async for item in client.follow(None, dump_format="columns"):
            if item.kind == "tree_dump":
                backlog_blocks += sum(piece.live for piece in item.dump)
                if not item.more:
                    assert item.last_event_id == 499 and backlog_blocks == 499
                    for block in range(1000, 1010):
                        slot.store_worker(block)
                continue
            seen.extend(event.event_id for event in item.events)
            if seen and seen[-1] == 509:
                break
    assert seen == list(range(500, 510))


async def test_unknown_dump_format_is_a_bad_request(nursery: trio.Nursery) -> None:
    slot = FakeSlot()
    slot.store_worker(1)
    url = await start_server(nursery, slot)
    async with open_websocket_url(f"{url}/v1/slots/a") as ws:
        await ws.send_message(json.dumps({"id": 4, "op": "recover", "start": None, "dump_format": "parquet"}))
        answer = json.loads(await ws.get_message())
    assert answer["id"] == 4 and answer["error"]["code"] == "bad_request"


async def test_a_failing_dump_is_reported_never_replaced(nursery: trio.Nursery) -> None:
    slot = FakeSlot()
    slot.store_worker(1)

    def broken() -> DumpSnapshot:
        raise RuntimeError("disk on fire")

    slot.index.dump_snapshot = broken  # type: ignore[method-assign]
    url = await start_server(nursery, slot)
    async with open_websocket_url(f"{url}/v1/slots/a") as ws:
        request = {"id": 1, "op": "recover", "start": None, "supports_tree_dump_failed": True}
        await ws.send_message(json.dumps(request))
        failed = json.loads(await ws.get_message())
        await ws.send_message(json.dumps({"id": 2, "op": "recover", "start": None, "dump_format": "columns"}))
        internal = json.loads(await ws.get_message())
        await ws.send_message(json.dumps({"id": 3, "op": "follow", "from": None}))
        follow = json.loads(await ws.get_message())
    assert (failed["kind"], failed["last_event_id"], failed["message"]) == ("tree_dump_failed", 1, "disk on fire")
    assert internal["error"] == {"code": "internal", "message": "worker tree dump failed: disk on fire"}
    assert follow["id"] == 3 and follow["error"]["code"] == "internal"
