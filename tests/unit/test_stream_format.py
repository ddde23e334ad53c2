"""The stream's bytes (kvagent/stream/format.py) and the sans-IO replica (SlotReplica), without Redis."""

from __future__ import annotations

import msgpack
import pytest

from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import CodecError
from kvagent.model.events import U64_MAX
from kvagent.stream.format import (
    EventsEntry,
    HeartbeatEntry,
    SlotHead,
    SnapshotEntry,
    StatusEntry,
    StreamKeys,
    cursor_of_id,
    decode_entry,
    decode_head,
    decode_snapshot,
    encode_events_entry,
    encode_events_entry_v1,
    encode_head,
    encode_heartbeat_entry,
    encode_snapshot,
    encode_snapshot_entry,
    encode_status_entry,
    event_entry_id,
)
from kvagent.stream.reader import SlotReplica
from tests.support.stream_sim import SimulatedSlot, canonical_state


def _b(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    return {key.encode(): value for key, value in fields.items()}


def test_entry_ids_span_the_whole_cursor_range() -> None:
    assert event_entry_id(1) == "1-0"
    assert event_entry_id(U64_MAX) == f"{U64_MAX}-0"
    assert cursor_of_id(f"{U64_MAX}-7".encode()) == U64_MAX
    for bad in (0, U64_MAX + 1, -1):
        with pytest.raises(ValueError):
            event_entry_id(bad)
    with pytest.raises(CodecError):
        cursor_of_id("12")


def test_keys_share_one_cluster_hash_tag() -> None:
    keys = StreamKeys("kv", "gpu0", 0xAB)
    assert keys.events == "{kv:gpu0}:00000000000000ab:events"
    assert keys.snapshot.startswith("{kv:gpu0}:") and keys.head == "{kv:gpu0}:head"


def test_snapshot_round_trip_rebuilds_the_same_state() -> None:
    slot = SimulatedSlot.create(5, None)
    slot.step(2900)  # chains, removes (dead rows), clears, CacheOwner blocks
    while not any(e.data.mm_extra_infos for e in slot.index.tree_dump().events):  # type: ignore[union-attr]
        slot.step(10)  # until a multimodal block is resident too
    slot.set_ready(2, ready=True)
    payload = encode_snapshot(slot.index.dump_snapshot(), slot.status.get())
    snapshot = decode_snapshot(payload)
    assert snapshot.cursor == slot.index.current_event_id() and snapshot.status == slot.status.get()
    assert snapshot.blocks == slot.index.resident_block_count
    rebuilt = RecoveryIndex(16)
    rebuilt.restore(snapshot.events(), (), snapshot_id=snapshot.cursor)
    assert canonical_state(rebuilt) == canonical_state(slot.index)
    assert len(payload) < 40 * slot.index.resident_block_count + 4096  # columns, not named maps


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"v": 99}), "format version"),
        (msgpack.packb({"v": 1, "cursor": -1}), "cursor"),
    ],
)
def test_snapshot_errors_name_the_problem(payload: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode_snapshot(payload)


def test_snapshot_with_a_short_column_is_refused() -> None:
    slot = SimulatedSlot.create(6, None)
    slot.step(50)
    body = msgpack.unpackb(encode_snapshot(slot.index.dump_snapshot(), slot.status.get()))
    body["groups"][0]["hashes"] = body["groups"][0]["hashes"][:-1]
    with pytest.raises(CodecError, match="hashes"):
        decode_snapshot(msgpack.packb(body, use_bin_type=True))


def test_entries_round_trip() -> None:
    slot = SimulatedSlot.create(7, None)
    events = slot.make_events(10)
    entry = decode_entry("10-0", _b(encode_events_entry(1, events)))
    assert entry == EventsEntry.of(1, 10, events) and entry.events == tuple(events)
    old = decode_entry("10-0", _b(encode_events_entry_v1(1, events)))  # version 1: read as well
    assert old == entry
    slot.set_ready(3, ready=False)
    status = decode_entry("10-1", _b(encode_status_entry(slot.status.get())))
    assert status == StatusEntry(10, slot.status.get())
    assert decode_entry("10-2", _b(encode_heartbeat_entry(123))) == HeartbeatEntry(10, 123)
    assert decode_entry("10-3", _b(encode_snapshot_entry(10))) == SnapshotEntry(10)
    head = SlotHead("s", 5, 16, "x")
    assert decode_head({k.encode(): v.encode() for k, v in encode_head(head).items()}) == head


def test_entry_errors() -> None:
    slot = SimulatedSlot.create(8, None)
    events = slot.make_events(3)
    with pytest.raises(CodecError, match="outside"):
        decode_entry("2-0", _b(encode_events_entry(1, events)))  # event 3 past the entry's id
    with pytest.raises(CodecError, match="unknown kind"):
        decode_entry("1-0", {b"k": b"zz"})
    with pytest.raises(CodecError, match="'from'"):
        decode_entry("3-0", {b"k": b"ev", b"ev": encode_events_entry_v1(1, events)["ev"]})
    with pytest.raises(CodecError, match="outside"):
        decode_entry("2-0", _b(encode_events_entry_v1(1, events)))
    with pytest.raises(CodecError, match="'c'"):
        decode_entry("3-0", {b"k": b"ec"})
    with pytest.raises(CodecError, match="head"):
        decode_head({b"slot": b"s"})


def _replica() -> SlotReplica:
    replica = SlotReplica(SlotHead("s", 1, 16, "x"), "p")
    replica.load(None)
    return replica


def test_replica_applies_skips_and_asks_for_its_snapshot() -> None:
    slot = SimulatedSlot.create(9, None)
    events = slot.make_events(20)
    replica = _replica()
    assert replica.apply("10-0", EventsEntry.of(1, 10, events[:10]))
    assert replica.cursor == 10 and replica.position == "10-0"
    assert replica.apply("10-0", EventsEntry.of(1, 10, events[:10]))  # already held: skipped
    assert replica.events == 10
    assert not replica.apply("20-0", EventsEntry.of(12, 20, events[11:]))  # a gap: reload
    assert replica.gaps == 1 and replica.cursor == 10 and replica.position == "10-0"
    assert replica.apply("10-1", SnapshotEntry(10))  # a reset to what it holds: nothing to do
    assert not replica.apply("30-1", SnapshotEntry(30))  # a reset past it: reload
    assert replica.apply("20-0", EventsEntry.of(5, 20, events[4:]))  # overlapping: the new part
    assert replica.cursor == 20 and replica.events == 20
    assert replica.status is None  # no status seen yet: not ready, not "empty and ready"
    slot.set_ready(1, ready=True)
    assert replica.apply("20-1", StatusEntry(20, slot.status.get())) and replica.ready
    assert replica.apply("20-2", HeartbeatEntry(20, 99)) and replica.heartbeat_unix_ms == 99
