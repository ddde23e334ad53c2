"""Columnar stream entries applied to a replica's index (kvagent/stream/apply.py, kvagent/_native/_stream.pyx).

The compiled loop and its Python twin give the same index state, and both give the state the events
themselves give through ``RecoveryIndex.apply``; version-1 entries written by the encoder of before issue #36
(tests/data/stream_v1_entries.msgpack) still rebuild the state they were written from.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack
import pytest

from kvagent import _native
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import CodecError, IndexApplyError
from kvagent.model.events import (
    CLEARED,
    MmExtraInfo,
    MmObject,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.stream.apply import RunOps, apply_entry, run_ops_python
from kvagent.stream.format import (
    EventsEntry,
    SlotHead,
    chunk_events,
    decode_entry,
    decode_head,
    encode_events_entry,
    encode_head,
    entry_column_bytes,
    pack_entry_columns,
    unpack_entry_columns,
)
from kvagent.stream.reader import SlotReplica
from tests.support.stream_sim import SimulatedSlot, canonical_state, slot_owner

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "stream_v1_entries.msgpack"
_stream = None if _native.DISABLED else pytest.importorskip("kvagent._native._stream")
LOOPS: list[tuple[str, RunOps]] = [("python", run_ops_python)]
if _stream is not None:
    LOOPS.append(("native", _stream.run_ops))


def _fields(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    return {key.encode(): value for key, value in fields.items()}


def _digest(index: RecoveryIndex) -> str:
    return hashlib.sha256("\n".join(sorted(map(repr, canonical_state(index)))).encode()).hexdigest()


def _rebuild(entries: list[tuple[str, dict[bytes, bytes]]], run: RunOps) -> RecoveryIndex:
    index = RecoveryIndex(16, ring_capacity=1)
    cursor = 0
    for entry_id, fields in entries:
        entry = decode_entry(entry_id, fields)
        assert isinstance(entry, EventsEntry)
        apply_entry(index, entry.columns, after=cursor, last=entry.last, run=run)
        cursor = entry.last
    return index


def _entries(slot: SimulatedSlot, count: int, max_events: int = 256) -> list[tuple[str, dict[bytes, bytes]]]:
    events = slot.make_events(count)
    for event in events:
        slot.index.apply(event)
    return [
        (f"{chunk[-1].event_id}-0", _fields(encode_events_entry(chunk[0].event_id, chunk)))
        for chunk in chunk_events(events, max_events)
    ]


@pytest.mark.parametrize(("name", "run"), LOOPS)
def test_columns_rebuild_the_state_apply_gives(name: str, run: RunOps) -> None:
    slot = SimulatedSlot.create(11, None, ring=1)
    entries = _entries(slot, 6000)  # chains, removes, clears, CacheOwner blocks, multimodal blocks
    rebuilt = _rebuild(entries, run)
    assert canonical_state(rebuilt) == canonical_state(slot.index)
    assert rebuilt.resident_block_count == slot.index.resident_block_count > 0
    assert rebuilt.current_event_id() == slot.index.current_event_id() == 6000
    assert rebuilt.tree_dump().last_event_id == 6000


def test_native_and_python_loops_give_the_same_index_state() -> None:
    if _stream is None:
        pytest.skip("the compiled core is switched off")
    slot = SimulatedSlot.create(12, None, ring=1)
    entries = _entries(slot, 4000, max_events=97)
    python, native = _rebuild(entries, run_ops_python), _rebuild(entries, _stream.run_ops)
    assert canonical_state(python) == canonical_state(native) == canonical_state(slot.index)
    assert python.dump_snapshot().groups == native.dump_snapshot().groups  # rows too, in the same order


def test_an_overlapping_entry_applies_only_its_new_events() -> None:
    slot = SimulatedSlot.create(13, None, ring=1)
    events = slot.make_events(300)
    for event in events:
        slot.index.apply(event)
    index = RecoveryIndex(16, ring_capacity=1)
    assert apply_entry(index, EventsEntry.of(1, 200, events[:200]).columns, after=0, last=200) == 200
    assert apply_entry(index, EventsEntry.of(120, 300, events[119:]).columns, after=200, last=300) == 100
    assert canonical_state(index) == canonical_state(slot.index) and index.current_event_id() == 300


def test_skipped_ids_and_ids_past_the_last_event() -> None:
    """Ids the agent skipped after a restart carry no event; the entry's last id may be past its last event."""
    stored = [
        RouterEvent(7, StorageTier.DEVICE, ResidencyDomain.WORKER, i, Stored(None, (i,), (i + 100,)), 0)
        for i in (1, 2, 50, 51)
    ]
    entry = decode_entry("60-0", _fields(encode_events_entry(1, stored)))
    assert isinstance(entry, EventsEntry) and entry.columns.ids is not None
    assert entry.events == tuple(stored)
    index = RecoveryIndex(16, ring_capacity=1)
    assert apply_entry(index, entry.columns, after=2, last=60) == 2  # 50 and 51: past the cursor
    assert {block for _, _, block in index.resident_blocks()} == {50, 51}
    assert index.current_event_id() == 60
    assert index.answers_with_dump(59, None) and not index.answers_with_dump(61, None)


def test_cache_owner_routes_clears_and_rare_fields_round_trip() -> None:
    source = slot_owner(14)
    info = MmExtraInfo((MmObject(5, ((0, 4), (8, 12))), MmObject(6, ((1, 2),))))
    events = [
        RouterEvent(1, StorageTier.HOST_PINNED, ResidencyDomain.CACHE_OWNER, 1, Stored(None, (1, 2), (3, 4)), 2, source),
        RouterEvent(9, StorageTier.DEVICE, ResidencyDomain.WORKER, 2, Stored(1, (5,), (6,), (info,), 3), 0, None, "s"),
        RouterEvent(9, StorageTier.DEVICE, ResidencyDomain.WORKER, 3, Stored(5, tuple(range(10, 40)), tuple(range(40, 70))), 0),
        RouterEvent(9, StorageTier.DEVICE, ResidencyDomain.WORKER, 4, Removed(tuple(range(20, 40))), 0),
        RouterEvent(4, StorageTier.DEVICE, ResidencyDomain.CACHE_OWNER, 5, CLEARED, 3, source),
        RouterEvent(1, StorageTier.HOST_PINNED, ResidencyDomain.CACHE_OWNER, 6, Stored(2, (7,), (8,)), 2, source),
    ]  # fmt: skip
    entry = decode_entry("6-0", _fields(encode_events_entry(1, events)))
    assert isinstance(entry, EventsEntry) and entry.events == tuple(events)
    expected = RecoveryIndex(16)
    for event in events:
        expected.apply(event)
    for _, run in LOOPS:
        index = RecoveryIndex(16, ring_capacity=1)
        assert apply_entry(index, entry.columns, after=0, last=6, run=run) == 6
        assert canonical_state(index) == canonical_state(expected)


def test_more_routes_than_an_op_byte_names() -> None:
    events = [
        RouterEvent(w, StorageTier.DEVICE, ResidencyDomain.WORKER, w, Stored(None, (w,), (w,)), w % 3)
        for w in range(1, 301)
    ]
    entry = decode_entry("300-0", _fields(encode_events_entry(1, events)))
    assert isinstance(entry, EventsEntry) and len(entry.columns.routes) == 300
    assert entry.events == tuple(events)


def test_version_1_entries_of_the_fixture_still_rebuild_their_state() -> None:
    body = msgpack.unpackb(FIXTURE.read_bytes(), raw=False)
    head = decode_head({k.encode(): v.encode() for k, v in body["head"].items()})
    assert head.version == 1
    entries = [(entry_id, _fields({k: bytes(v) for k, v in fields.items()})) for entry_id, fields in body["entries"]]
    assert all(fields[b"k"] == b"ev" for _, fields in entries)
    for _, run in LOOPS:
        index = _rebuild(entries, run)
        assert index.resident_block_count == body["blocks"]
        assert _digest(index) == body["state_sha256"]
    replica = SlotReplica(head, "p")
    replica.load(None)
    for entry_id, fields in entries:
        assert replica.apply(entry_id, decode_entry(entry_id, fields))
    assert replica.cursor == 600 and _digest(replica.index) == body["state_sha256"]


def test_a_newer_head_is_refused_naming_both_versions() -> None:
    fields = {k.encode(): v.encode() for k, v in encode_head(SlotHead("s", 1, 16, "x", version=3)).items()}
    with pytest.raises(CodecError, match="version 3.*versions 1 to 2"):
        decode_head(fields)


def test_entries_are_cut_under_the_byte_budget() -> None:
    slot = SimulatedSlot.create(15, None)
    events = slot.make_events(3000)
    chunks = list(chunk_events(events, 256, 2000))
    assert [e for chunk in chunks for e in chunk] == events
    assert all(sum(map(entry_column_bytes, chunk)) <= 2000 or len(chunk) == 1 for chunk in chunks)
    assert all(len(chunk) <= 256 for chunk in chunks) and len(chunks) > 3000 // 256
    assert [len(c) for c in chunk_events(events, 256, None)] == [256] * 11 + [184]


def _body(events: list[RouterEvent]) -> list[object]:
    payload = encode_events_entry(1, events)["c"]
    body: list[object] = msgpack.unpackb(payload)
    return body


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (0, 3, "version 2"),
        (8, b"\0" * 8, "hashes"),  # one hash short of the counts
        (9, b"", "tokens"),
        (10, b"", "parents"),
        (6, b"\x01\0\0\0", "escaped counts"),
        (3, [], "route"),
        (11, [[99, None, None]], "extra"),
    ],
)
def test_malformed_columnar_entries_are_refused(field: int, value: object, message: str) -> None:
    slot = SimulatedSlot.create(16, None)
    events = slot.make_events(40)
    body = _body(events)
    if field == 8:
        value = body[8][:-8]  # type: ignore[index]
    body[field] = value
    with pytest.raises(CodecError, match=message):
        unpack_entry_columns(msgpack.packb(body, use_bin_type=True), 40)


def test_pack_and_unpack_are_inverse() -> None:
    slot = SimulatedSlot.create(17, None)
    events = slot.make_events(500)
    entry = EventsEntry.of(1, 500, events)
    assert unpack_entry_columns(pack_entry_columns(1, entry.columns), 500) == (1, entry.columns)


def test_a_cache_owner_store_on_the_device_tier_is_refused() -> None:
    source = slot_owner(18)
    bad = RouterEvent(1, StorageTier.DEVICE, ResidencyDomain.CACHE_OWNER, 1, Stored(None, (1,), (2,)), 0, source)
    with pytest.raises(CodecError, match="Device"):
        decode_entry("1-0", _fields(encode_events_entry(1, [bad])))
    index = RecoveryIndex(16, ring_capacity=1)
    with pytest.raises(IndexApplyError, match="Device"):
        index.route_stores([bad])


def test_stores_emptied_by_an_entry_are_dropped() -> None:
    route = (9, StorageTier.DEVICE, ResidencyDomain.WORKER)
    events = [
        RouterEvent(*route, 1, Stored(None, (1, 2), (3, 4)), 0),
        RouterEvent(*route, 2, Removed((1, 2)), 0),
    ]
    index = RecoveryIndex(16, ring_capacity=1)
    apply_entry(index, EventsEntry.of(1, 2, events).columns, after=0, last=2)
    assert index.resident_block_count == 0 and index.dump_snapshot().groups == ()
