"""The bytes of a slot's event log in Redis/Valkey Streams (docs/fleet.md): keys, entries and snapshots.

One stream per (slot, publisher id): the publisher id and the outbound cursor together are never reused, so
an entry's stream id is derived from the cursor alone, ``<last cursor of the entry>-0``.  Redis refuses an
id equal to or below the stream's top, so an entry sent twice (a retried pipeline, an agent restarted from
its state file) is refused by Redis itself.  Cursors are u64 and a stream id is a pair of u64s
``(ms, seq)``: the whole cursor range fits the first half; the second half numbers the non-event entries
(status, heartbeat, snapshot marker) written after the event with that cursor (``<cursor>-*``).

Keys, all sharing one Redis Cluster hash tag ``{<prefix>:<slot>}`` so a slot's keys live on one shard::

    <prefix>:slots                         a set: every slot name that ever wrote (the directory)
    {<prefix>:<slot>}:head                 a hash: the slot's current publisher id, block size, streams
    {<prefix>:<slot>}:<publisher hex>:events     the stream
    {<prefix>:<slot>}:<publisher hex>:snapshot   the compacted snapshot (a tree dump at a cursor)

Entry fields (msgpack values are bytes; every entry has ``k``)::

    k=ev    from=<first cursor covered>  ev=<msgpack RouterEvents, wire/router_event.py>
    k=st    status=<AgentStatus JSON>          readiness and generation (written on every change)
    k=hb    ts=<unix ms>                       the writer is alive and has written every event up to <ms>
    k=snap  cursor=<C>                         the state was reset to the snapshot at C: reload it

Pure: imports only ``model`` and ``wire``.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import compress
from typing import Protocol

import attrs
import msgpack

from kvagent.model.errors import CodecError
from kvagent.model.events import (
    FLAG_DEAD,
    FLAG_PARENT,
    U64_MAX,
    MmExtraInfo,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.model.ids import CacheOwnerId
from kvagent.model.status import AgentStatus
from kvagent.wire.router_event import (
    decode_router_events,
    encode_router_events,
    mm_extra_info_from_wire,
    mm_extra_info_to_wire,
    state_source_from_wire,
    state_source_to_wire,
)

__all__ = [
    "FORMAT_VERSION",
    "EventsEntry",
    "HeartbeatEntry",
    "SlotHead",
    "SnapshotColumns",
    "SnapshotEntry",
    "SnapshotGroupLike",
    "SnapshotLike",
    "StatusEntry",
    "StreamEntry",
    "StreamKeys",
    "StreamSnapshot",
    "cursor_of_id",
    "decode_entry",
    "decode_head",
    "decode_snapshot",
    "encode_events_entry",
    "encode_head",
    "encode_heartbeat_entry",
    "encode_snapshot",
    "encode_snapshot_entry",
    "encode_status_entry",
    "event_entry_id",
    "slots_key",
]

FORMAT_VERSION = 1


def slots_key(prefix: str) -> str:
    return f"{prefix}:slots"


@attrs.frozen(slots=True)
class StreamKeys:
    """The keys of one slot's stream of one publisher id."""

    prefix: str
    slot: str
    publisher_id: int

    @property
    def tag(self) -> str:
        return "{" + f"{self.prefix}:{self.slot}" + "}"

    @property
    def head(self) -> str:
        return f"{self.tag}:head"

    @property
    def events(self) -> str:
        return f"{self.tag}:{self.publisher_id:016x}:events"

    @property
    def snapshot(self) -> str:
        return f"{self.tag}:{self.publisher_id:016x}:snapshot"


def head_key(prefix: str, slot: str) -> str:
    return StreamKeys(prefix, slot, 0).head


def event_entry_id(last_cursor: int) -> str:
    """The stream id of an events entry whose newest event has ``last_cursor``."""
    if not 0 < last_cursor <= U64_MAX:
        raise ValueError(f"cursor {last_cursor} is not a positive u64")
    return f"{last_cursor}-0"


def cursor_of_id(entry_id: bytes | str) -> int:
    """The cursor half of a stream id: every event up to it is in the stream before this entry."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, sep, seq = text.partition("-")
    if not sep or not ms.isdigit() or not seq.isdigit():
        raise CodecError(f"stream id {text!r} is not <ms>-<seq>")
    return int(ms)


# --- the head: where a slot's current stream is --------------------------------------------------------


@attrs.frozen(slots=True)
class SlotHead:
    slot: str
    publisher_id: int
    kv_block_size: int
    cache_owner_id: str
    version: int = FORMAT_VERSION


def encode_head(head: SlotHead) -> dict[str, str]:
    return {
        "slot": head.slot,
        "publisher_id": str(head.publisher_id),
        "kv_block_size": str(head.kv_block_size),
        "cache_owner_id": head.cache_owner_id,
        "version": str(head.version),
    }


def decode_head(fields: Mapping[bytes, bytes]) -> SlotHead:
    try:
        return SlotHead(
            slot=fields[b"slot"].decode(),
            publisher_id=int(fields[b"publisher_id"]),
            kv_block_size=int(fields[b"kv_block_size"]),
            cache_owner_id=fields[b"cache_owner_id"].decode(),
            version=int(fields[b"version"]),
        )
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise CodecError(f"stream head is malformed: {exc!r}") from None


# --- entries --------------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class EventsEntry:
    """Every outbound event with a cursor in ``[first, last]`` (ids skipped by the agent carry none)."""

    first: int
    last: int
    events: tuple[RouterEvent, ...]


@attrs.frozen(slots=True)
class StatusEntry:
    cursor: int
    status: AgentStatus


@attrs.frozen(slots=True)
class HeartbeatEntry:
    cursor: int
    unix_ms: int


@attrs.frozen(slots=True)
class SnapshotEntry:
    """The slot's state was reset to the snapshot at ``cursor`` (the events before it are not in the stream)."""

    cursor: int


StreamEntry = EventsEntry | StatusEntry | HeartbeatEntry | SnapshotEntry


def encode_events_entry(first: int, events: Sequence[RouterEvent]) -> dict[str, bytes]:
    return {"k": b"ev", "from": str(first).encode(), "ev": encode_router_events(events)}


def encode_status_entry(status: AgentStatus) -> dict[str, bytes]:
    return {"k": b"st", "status": json.dumps(status.to_json(), separators=(",", ":")).encode()}


def encode_heartbeat_entry(unix_ms: int) -> dict[str, bytes]:
    return {"k": b"hb", "ts": str(unix_ms).encode()}


def encode_snapshot_entry(cursor: int) -> dict[str, bytes]:
    return {"k": b"snap", "cursor": str(cursor).encode()}


def _int_field(fields: Mapping[bytes, bytes], name: bytes) -> int:
    value = fields.get(name)
    if value is None or not value.isdigit():
        raise CodecError(f"stream entry field {name.decode()!r} must be a decimal integer, got {value!r}")
    return int(value)


def decode_entry(entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> StreamEntry:
    """One stream entry; raises CodecError naming what is wrong."""
    cursor = cursor_of_id(entry_id)
    kind = fields.get(b"k")
    if kind == b"ev":
        payload = fields.get(b"ev")
        if payload is None:
            raise CodecError("events entry has no 'ev' field")
        events = tuple(decode_router_events(payload))
        first = _int_field(fields, b"from")
        if first > cursor or any(not first <= event.event_id <= cursor for event in events):
            raise CodecError(f"events entry {entry_id!r} holds events outside [{first}, {cursor}]")
        return EventsEntry(first, cursor, events)
    if kind == b"st":
        try:
            status = AgentStatus.from_json(json.loads(fields[b"status"]))
        except (KeyError, ValueError) as exc:
            raise CodecError(f"status entry is malformed: {exc}") from None
        return StatusEntry(cursor, status)
    if kind == b"hb":
        return HeartbeatEntry(cursor, _int_field(fields, b"ts"))
    if kind == b"snap":
        return SnapshotEntry(_int_field(fields, b"cursor"))
    raise CodecError(f"stream entry {entry_id!r} has unknown kind {kind!r}")


# --- snapshots --------------------------------------------------------------------------------------------


class SnapshotColumns(Protocol):
    """One (owner, tier)'s rows, parents first (the index's ``StoreColumns``)."""

    @property
    def hashes(self) -> array[int]: ...
    @property
    def parents(self) -> array[int]: ...
    @property
    def tokens(self) -> array[int]: ...
    @property
    def flags(self) -> bytes: ...
    @property
    def mm(self) -> Mapping[int, MmExtraInfo]: ...


class SnapshotGroupLike(Protocol):
    @property
    def worker_id(self) -> int: ...
    @property
    def tier(self) -> StorageTier: ...
    @property
    def domain(self) -> ResidencyDomain: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def source(self) -> CacheOwnerId | None: ...
    @property
    def columns(self) -> SnapshotColumns: ...


class SnapshotLike(Protocol):
    """A consistent copy of a slot's resident state (the index's ``DumpSnapshot``)."""

    @property
    def groups(self) -> Sequence[SnapshotGroupLike]: ...
    @property
    def last_event_id(self) -> int: ...


def _le_bytes(column: array[int]) -> bytes:
    if sys.byteorder == "little":
        return column.tobytes()
    swapped = array(column.typecode, column)
    swapped.byteswap()
    return swapped.tobytes()


def _le_array(data: bytes, rows: int, field: str) -> array[int]:
    if len(data) != 8 * rows:
        raise CodecError(f"snapshot column {field} has {len(data)} bytes for {rows} rows")
    column = array("Q")
    column.frombytes(data)
    if sys.byteorder != "little":
        column.byteswap()
    return column


_LIVE = bytes(0 if flag == FLAG_DEAD else 1 for flag in range(256))  # flags -> 1 for a live row, 0 for padding


def _compacted(columns: SnapshotColumns) -> tuple[bytes, bytes, bytes, bytes, list[list[object]]]:
    """The live rows' columns (little-endian u64s, flags) and multimodal infos, padding rows dropped."""
    flags = bytes(columns.flags)
    mask = flags.translate(_LIVE)
    mm = sorted(columns.mm.items())
    infos: list[list[object]] = []
    if mask.count(0) == 0:
        hashes, parents, tokens = columns.hashes, columns.parents, columns.tokens
        infos.extend([row, mm_extra_info_to_wire(info)] for row, info in mm)
    else:
        hashes = array("Q", compress(columns.hashes, mask))
        parents = array("Q", compress(columns.parents, mask))
        tokens = array("Q", compress(columns.tokens, mask))
        flags = bytes(compress(flags, mask))
        live_before, scanned = 0, 0
        for row, info in mm:
            live_before += mask.count(1, scanned, row)
            scanned = row
            if mask[row]:
                infos.append([live_before, mm_extra_info_to_wire(info)])
    return _le_bytes(hashes), _le_bytes(parents), _le_bytes(tokens), flags, infos


def encode_snapshot(snapshot: SnapshotLike, status: AgentStatus) -> bytes:
    """The resident state as columns (25 bytes a block, plus multimodal info) with its cursor and status."""
    groups = []
    for group in snapshot.groups:
        hashes, parents, tokens, flags, infos = _compacted(group.columns)
        groups.append(
            {
                "worker_id": group.worker_id,
                "storage_tier": group.tier.value,
                "residency_domain": group.domain.value,
                "dp_rank": group.dp_rank,
                "state_source": None if group.source is None else state_source_to_wire(group.source),
                "rows": len(flags),
                "hashes": hashes,
                "parents": parents,
                "tokens": tokens,
                "flags": flags,
                "mm": infos,
            }
        )
    body = {
        "v": FORMAT_VERSION,
        "cursor": snapshot.last_event_id,
        "status": status.to_json(),
        "groups": groups,
    }
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


@attrs.frozen(slots=True)
class _Group:
    worker_id: int
    tier: StorageTier
    domain: ResidencyDomain
    dp_rank: int
    source: CacheOwnerId | None
    hashes: array[int]
    parents: array[int]
    tokens: array[int]
    flags: bytes
    mm: dict[int, MmExtraInfo]


@attrs.frozen(slots=True)
class StreamSnapshot:
    """A decoded snapshot: the state at ``cursor`` and the status the slot had then."""

    cursor: int
    status: AgentStatus
    groups: tuple[_Group, ...]

    @property
    def blocks(self) -> int:
        return sum(len(g.flags) - g.flags.count(FLAG_DEAD) for g in self.groups)

    def events(self) -> Iterator[RouterEvent]:
        """Every resident block as a one-block Stored event, parents first (ids are positions, from 0)."""
        event_id = 0
        for g in self.groups:
            mm = g.mm
            for row, (block, parent, tokens, flag) in enumerate(
                zip(g.hashes, g.parents, g.tokens, g.flags, strict=True)
            ):
                if flag == FLAG_DEAD:
                    continue
                info = mm.get(row) if mm else None
                data = Stored(
                    parent if flag == FLAG_PARENT else None,
                    (block,),
                    (tokens,),
                    None if info is None else (info,),
                )
                yield RouterEvent(g.worker_id, g.tier, g.domain, event_id, data, g.dp_rank, g.source)
                event_id += 1


def _decode_group(raw: object, field: str) -> _Group:
    if not isinstance(raw, dict):
        raise CodecError(f"{field} must be a map")
    try:
        rows = int(raw["rows"])
        tier = StorageTier(raw["storage_tier"])
        domain = ResidencyDomain(raw["residency_domain"])
        source_raw = raw["state_source"]
        source = None if source_raw is None else state_source_from_wire(source_raw, f"{field}.state_source")
        flags = bytes(raw["flags"])
        if len(flags) != rows or any(flag > FLAG_DEAD for flag in set(flags)):
            raise CodecError(f"{field}.flags must be {rows} bytes of 0, 1 or 2")
        mm: dict[int, MmExtraInfo] = {}
        for row, info in raw["mm"]:
            decoded = mm_extra_info_from_wire(info, f"{field}.mm")
            if decoded is not None:
                mm[int(row)] = decoded
        return _Group(
            worker_id=int(raw["worker_id"]),
            tier=tier,
            domain=domain,
            dp_rank=int(raw["dp_rank"]),
            source=source,
            hashes=_le_array(raw["hashes"], rows, f"{field}.hashes"),
            parents=_le_array(raw["parents"], rows, f"{field}.parents"),
            tokens=_le_array(raw["tokens"], rows, f"{field}.tokens"),
            flags=flags,
            mm=mm,
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"{field} is malformed: {exc!r}") from None


def decode_snapshot(payload: bytes) -> StreamSnapshot:
    """A snapshot written by :func:`encode_snapshot`; raises CodecError naming what is wrong."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CodecError(f"snapshot is not msgpack: {exc}") from None
    if not isinstance(body, dict) or body.get("v") != FORMAT_VERSION:
        raise CodecError(f"snapshot is not of format version {FORMAT_VERSION}")
    cursor = body.get("cursor")
    if not isinstance(cursor, int) or not 0 <= cursor <= U64_MAX:
        raise CodecError("snapshot cursor must be a u64")
    try:
        status = AgentStatus.from_json(body.get("status"))
    except ValueError as exc:
        raise CodecError(str(exc)) from None
    groups_raw = body.get("groups")
    if not isinstance(groups_raw, list):
        raise CodecError("snapshot groups must be a list")
    groups = tuple(_decode_group(raw, f"snapshot.groups[{i}]") for i, raw in enumerate(groups_raw))
    return StreamSnapshot(cursor, status, groups)


def chunk_events(events: Sequence[RouterEvent], max_events: int) -> Iterable[Sequence[RouterEvent]]:
    """``events`` in slices of at most ``max_events`` (one stream entry each)."""
    for start in range(0, len(events), max_events):
        yield events[start : start + max_events]
