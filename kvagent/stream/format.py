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

    k=ec    c=<columnar events, format version 2: see EntryColumns>   (the writer's entries)
    k=ev    from=<first cursor covered>  ev=<msgpack RouterEvents, wire/router_event.py>   (version 1)
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
    CLEARED,
    DOMAIN_BY_VALUE,
    FLAG_DEAD,
    TIER_BY_VALUE,
    U32_MAX,
    U64_MAX,
    EventData,
    EventRoute,
    MmExtraInfo,
    MmObject,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    StoredExtra,
    resident_row_events,
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
    "ENTRY_COLUMN_BYTES",
    "FORMAT_VERSION",
    "KIND_CLEARED",
    "KIND_REMOVED",
    "KIND_STORED",
    "KIND_STORED_CHILD",
    "SNAPSHOT_VERSION",
    "EntryColumns",
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
    "chunk_events",
    "decode_snapshot",
    "entry_column_bytes",
    "pack_entry_columns",
    "unpack_entry_columns",
    "encode_events_entry",
    "encode_events_entry_v1",
    "entry_columns",
    "encode_head",
    "encode_heartbeat_entry",
    "encode_snapshot",
    "encode_snapshot_entry",
    "encode_status_entry",
    "event_entry_id",
    "slots_key",
]

# The head's ``version``: what the slot's events entries are.  1: ``k=ev`` entries, each event a named-map
# RouterEvent; 2: ``k=ec`` columnar entries (below).  A reader reads every version up to its own and refuses
# a newer one, naming both (decode_head).
FORMAT_VERSION = 2
OLDEST_FORMAT_VERSION = 1
# The snapshot's own ``v`` (its layout did not change with the entries).
SNAPSHOT_VERSION = 1


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
        head = SlotHead(
            slot=fields[b"slot"].decode(),
            publisher_id=int(fields[b"publisher_id"]),
            kv_block_size=int(fields[b"kv_block_size"]),
            cache_owner_id=fields[b"cache_owner_id"].decode(),
            version=int(fields[b"version"]),
        )
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise CodecError(f"stream head is malformed: {exc!r}") from None
    if not OLDEST_FORMAT_VERSION <= head.version <= FORMAT_VERSION:
        raise CodecError(
            f"slot {head.slot!r} writes stream format version {head.version}; this reader reads versions "
            f"{OLDEST_FORMAT_VERSION} to {FORMAT_VERSION} (upgrade the reader)"
        )
    return head


# --- entries --------------------------------------------------------------------------------------------


KIND_STORED = 0  # a Stored chain without a parent
KIND_STORED_CHILD = 1  # a Stored chain whose parent hash is the next one of ``parents``
KIND_REMOVED = 2
KIND_CLEARED = 3
# On the wire an event is one op byte, ``kind | route << 2 | count << 4``, when the entry has at most 4 routes
# (a slot's events have one or two: its worker and its CacheOwner): a count of 15 or more is written as 15
# and its value goes to the counts column.  An entry with more routes writes the kind alone in the op byte,
# a u16 route column and every count.
_NARROW_ROUTES = 4
_COUNT_ESCAPE = 15
_KIND_OF_OP = bytes(op & 3 for op in range(256))
_ROUTE_OF_OP = bytes(op >> 2 & 3 for op in range(256))
_COUNT_OF_OP = bytes(op >> 4 for op in range(256))
_IS_STORE_KIND = bytes((1, 1, 0, 0) + (0,) * 252)  # kind -> 1 for a Stored
_IS_CLEARED_KIND = bytes((0, 0, 0, 1) + (0,) * 252)


@attrs.frozen(slots=True, eq=True)
class EntryColumns:
    """An entry's events as columns (format version 2, docs/fleet.md "Entry format"), no object per event.

    Event i is ``kinds[i]`` (a ``KIND_*``) on route ``routes[route_codes[i]]`` with ``counts[i]`` block hashes,
    the next ones of ``hashes`` (a Stored's tokens hashes: as many, the next ones of ``tokens``; a Stored child's
    parent: the next one of ``parents``).  Its id is ``first_id + i``, or ``ids[i]`` when the ids are not
    consecutive (ids the agent skipped after a restart).  ``extras``: the rare Stored fields, by event.
    """

    routes: tuple[EventRoute, ...]
    kinds: bytes
    route_codes: array[int]  # u16
    counts: array[int]  # u32
    first_id: int
    ids: array[int] | None
    hashes: array[int]
    tokens: array[int]
    parents: array[int]
    extras: dict[int, StoredExtra]

    def __len__(self) -> int:
        return len(self.kinds)

    def event_id(self, position: int) -> int:
        return self.first_id + position if self.ids is None else self.ids[position]

    def events(self) -> tuple[RouterEvent, ...]:
        """The entry's events as RouterEvents (for consumers that want objects; the reader applies columns)."""
        events: list[RouterEvent] = []
        hashes, tokens, parents = self.hashes.tolist(), self.tokens.tolist(), self.parents.tolist()
        at = stored_at = parent_at = 0
        for position, (kind, code, count) in enumerate(
            zip(self.kinds, self.route_codes, self.counts, strict=True)
        ):
            data: EventData
            if kind == KIND_CLEARED:
                data = CLEARED
            elif kind == KIND_REMOVED:
                data = Removed(tuple(hashes[at : at + count]))
                at += count
            else:
                parent = None
                if kind == KIND_STORED_CHILD:
                    parent, parent_at = parents[parent_at], parent_at + 1
                start, infos = self.extras.get(position, (None, None))
                data = Stored(
                    parent,
                    tuple(hashes[at : at + count]),
                    tuple(tokens[stored_at : stored_at + count]),
                    infos,
                    start,
                )
                at += count
                stored_at += count
            worker_id, tier, domain, dp_rank, source, session = self.routes[code]
            events.append(
                RouterEvent(worker_id, tier, domain, self.event_id(position), data, dp_rank, source, session)
            )
        return tuple(events)


@attrs.frozen(slots=True)
class EventsEntry:
    """Every outbound event with a cursor in ``[first, last]`` (ids skipped by the agent carry none)."""

    first: int
    last: int
    columns: EntryColumns

    @property
    def events(self) -> tuple[RouterEvent, ...]:
        return self.columns.events()

    @classmethod
    def of(cls, first: int, last: int, events: Sequence[RouterEvent]) -> EventsEntry:
        return cls(first, last, entry_columns(events))


def entry_columns(events: Sequence[RouterEvent]) -> EntryColumns:
    """``events`` (ids increasing) as columns."""
    route_codes: dict[tuple[object, ...], int] = {}
    by_value: dict[EventRoute, int] = {}
    routes: list[EventRoute] = []
    kinds = bytearray()
    codes = array("H")
    counts: list[int] = []
    hashes: list[int] = []
    tokens: list[int] = []
    parents: list[int] = []
    extras: dict[int, StoredExtra] = {}
    ids = [event.event_id for event in events]
    for position, event in enumerate(events):
        source = event.state_source
        # Keyed by the source's identity: the events of a slot share one CacheOwnerId object per owner.
        key = (event.worker_id, event.storage_tier, event.residency_domain, event.dp_rank, id(source),
               event.session_id)  # fmt: skip
        code = route_codes.get(key)
        if code is None:
            route = EventRoute(event.worker_id, event.storage_tier, event.residency_domain, event.dp_rank,
                               source, event.session_id)  # fmt: skip
            # An equal route under another source object (producers that build one per event) is one route.
            code = route_codes[key] = by_value.setdefault(route, len(routes))
            if code == len(routes):
                routes.append(route)
        data = event.data
        cls = type(data)
        if cls is Stored:
            parent = data.parent_hash  # type: ignore[union-attr]
            if parent is None:
                kinds.append(KIND_STORED)
            else:
                kinds.append(KIND_STORED_CHILD)
                parents.append(parent)
            hashes.extend(data.block_hashes)
            tokens.extend(data.tokens_hashes)  # type: ignore[union-attr]
            counts.append(len(data.block_hashes))
            if data.mm_extra_infos is not None or data.start_position is not None:  # type: ignore[union-attr]
                extras[position] = (data.start_position, data.mm_extra_infos)  # type: ignore[union-attr]
        elif cls is Removed:
            kinds.append(KIND_REMOVED)
            hashes.extend(data.block_hashes)
            counts.append(len(data.block_hashes))
        else:
            kinds.append(KIND_CLEARED)
            counts.append(0)
        codes.append(code)
    first_id = ids[0] if ids else 0
    consecutive = not ids or ids[-1] - first_id == len(ids) - 1
    return EntryColumns(
        routes=tuple(routes),
        kinds=bytes(kinds),
        route_codes=codes,
        counts=array("I", counts),
        first_id=first_id,
        ids=None if consecutive else array("Q", ids),
        hashes=array("Q", hashes),
        tokens=array("Q", tokens),
        parents=array("Q", parents),
        extras=extras,
    )


def _route_to_wire(route: EventRoute) -> list[object]:
    source = None if route.state_source is None else state_source_to_wire(route.state_source)
    return [route.worker_id, route.tier.value, route.domain.value, route.dp_rank, source, route.session_id]


def _route_from_wire(raw: object) -> EventRoute:
    if not isinstance(raw, list) or len(raw) != 6:
        raise CodecError("entry route must be [worker_id, tier, domain, dp_rank, state_source, session_id]")
    worker_id, tier_name, domain_name, dp_rank, source_raw, session = raw
    tier, domain = TIER_BY_VALUE.get(tier_name), DOMAIN_BY_VALUE.get(domain_name)
    if tier is None or domain is None:
        raise CodecError(f"entry route has unknown tier {tier_name!r} or domain {domain_name!r}")
    if not isinstance(worker_id, int) or not 0 <= worker_id <= U64_MAX:
        raise CodecError("entry route worker_id must be a u64")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank <= U32_MAX:
        raise CodecError("entry route dp_rank must be a u32")
    if session is not None and not isinstance(session, str):
        raise CodecError("entry route session_id must be a string or nil")
    source = None if source_raw is None else state_source_from_wire(source_raw, "entry route state_source")
    if domain is ResidencyDomain.CACHE_OWNER and source is None:
        raise CodecError("a CacheOwner entry route has no state_source")
    return EventRoute(worker_id, tier, domain, dp_rank, source, session)


def _le_column(typecode: str, data: object, rows: int | None, field: str) -> array[int]:
    """A little-endian column of ``rows`` items (None: as many as the bytes hold)."""
    column = array(typecode)
    size = column.itemsize
    if not isinstance(data, bytes) or len(data) % size or (rows is not None and len(data) != rows * size):
        raise CodecError(f"entry column {field} must be {rows if rows is not None else 'whole'} {size}-byte items")
    column.frombytes(data)
    if sys.byteorder != "little" and size > 1:
        column.byteswap()
    return column


def pack_entry_columns(first: int, columns: EntryColumns) -> bytes:
    """The ``c`` field of a ``k=ec`` entry, msgpack ``[2, from, first_id, routes, ops, wide_routes, counts, ids,
    hashes, tokens, parents, extras]``: ``ops`` a byte an event (see _NARROW_ROUTES), ``wide_routes`` nil or
    the u16 route codes, ``counts`` the u32 counts the op bytes do not hold, ``ids`` nil when the ids are
    consecutive from ``first_id``, else u64s; the hash columns u64s; all little-endian."""
    extras = [
        [position, start, None if infos is None else [_mm_to_compact(info) for info in infos]]
        for position, (start, infos) in sorted(columns.extras.items())
    ]
    if len(columns.routes) <= _NARROW_ROUTES:
        ops = bytes(
            kind | code << 2 | (count if count < _COUNT_ESCAPE else _COUNT_ESCAPE) << 4
            for kind, code, count in zip(columns.kinds, columns.route_codes, columns.counts, strict=True)
        )
        wide_routes = None
        counts = array("I", (count for count in columns.counts if count >= _COUNT_ESCAPE))
    else:
        ops, wide_routes, counts = columns.kinds, _le_bytes(columns.route_codes), columns.counts
    body = [
        2,
        first,
        columns.first_id,
        [_route_to_wire(route) for route in columns.routes],
        ops,
        wide_routes,
        _le_bytes(counts),
        None if columns.ids is None else _le_bytes(columns.ids),
        _le_bytes(columns.hashes),
        _le_bytes(columns.tokens),
        _le_bytes(columns.parents),
        extras,
    ]
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def _narrow_counts(ops: bytes, escaped: array[int]) -> array[int]:
    """The counts of narrow op bytes, escaped ones taken in order from ``escaped``."""
    inline = ops.translate(_COUNT_OF_OP)
    counts = array("I", iter(inline))  # iter: a bytes initializer would be read as raw items
    at, used = inline.find(_COUNT_ESCAPE), 0
    while at >= 0:
        if used == len(escaped):
            raise CodecError("entry counts column is shorter than its escaped counts")
        counts[at], used = escaped[used], used + 1
        at = inline.find(_COUNT_ESCAPE, at + 1)
    if used != len(escaped) or any(count < _COUNT_ESCAPE for count in escaped):
        raise CodecError("entry counts column does not match its escaped counts")
    return counts


def unpack_entry_columns(payload: bytes, cursor: int) -> tuple[int, EntryColumns]:
    """(first cursor, columns) of a ``k=ec`` entry whose id has ``cursor``; checked so that a reader can apply
    the columns without looking at each event again (every count, offset, route and id is consistent)."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CodecError(f"columnar entry is not msgpack: {exc}") from None
    if not isinstance(body, list) or len(body) != 12 or body[0] != 2:
        raise CodecError("columnar entry is not of format version 2")
    (_, first, first_id, routes_raw, ops, wide_routes, counts_raw, ids_raw, hashes_raw, tokens_raw,
     parents_raw, extras_raw) = body  # fmt: skip
    if not isinstance(first, int) or not 0 < first <= cursor:
        raise CodecError(f"columnar entry starts at {first!r}, not within its id's cursor {cursor}")
    if not isinstance(routes_raw, list) or not isinstance(ops, bytes) or not isinstance(first_id, int):
        raise CodecError("columnar entry head is malformed")
    routes = tuple(_route_from_wire(raw) for raw in routes_raw)
    rows = len(ops)
    if wide_routes is None:
        kinds = ops.translate(_KIND_OF_OP)
        codes = array("H", iter(ops.translate(_ROUTE_OF_OP)))  # iter: a bytes initializer is raw items
        counts = _narrow_counts(ops, _le_column("I", counts_raw, None, "counts"))
    else:
        kinds, codes = ops, _le_column("H", wide_routes, rows, "wide_routes")
        counts = _le_column("I", counts_raw, rows, "counts")
    hashes = _le_column("Q", hashes_raw, None, "hashes")
    tokens = _le_column("Q", tokens_raw, None, "tokens")
    parents = _le_column("Q", parents_raw, None, "parents")
    ids = None if ids_raw is None else _le_column("Q", ids_raw, rows, "ids")
    if ids is not None and any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise CodecError("entry ids must increase")
    if rows:
        if max(kinds) > KIND_CLEARED or max(codes) >= len(routes):
            raise CodecError("an entry op names a kind or route the entry does not have")
        low, high = (first_id, first_id + rows - 1) if ids is None else (ids[0], ids[-1])
        if not first <= low or not high <= cursor:
            raise CodecError(f"columnar entry holds events outside [{first}, {cursor}]")
        if sum(compress(counts, kinds.translate(_IS_STORE_KIND))) != len(tokens):
            raise CodecError("entry tokens column does not match its Stored events' counts")
        if sum(counts) != len(hashes):
            raise CodecError("entry hashes column does not match its events' counts")
        if kinds.count(KIND_STORED_CHILD) != len(parents):
            raise CodecError("entry parents column does not match its Stored children")
        if any(compress(counts, kinds.translate(_IS_CLEARED_KIND))):
            raise CodecError("a Cleared event of an entry has blocks")
        if _cache_owner_device(routes, kinds, codes):
            raise CodecError("CacheOwner residency cannot target the Device tier")
    elif hashes or tokens or parents:
        raise CodecError("an entry without events has block columns")
    extras = _extras_from_wire(extras_raw, kinds, counts)
    return first, EntryColumns(routes, kinds, codes, counts, first_id, ids, hashes, tokens, parents, extras)


def _cache_owner_device(routes: tuple[EventRoute, ...], kinds: bytes, codes: array[int]) -> bool:
    """Whether a Stored or Removed names a CacheOwner route on the Device tier (apply() refuses those)."""
    bad = {
        code
        for code, route in enumerate(routes)
        if route.domain is ResidencyDomain.CACHE_OWNER and route.tier is StorageTier.DEVICE
    }
    return bool(bad) and any(
        code in bad and kind != KIND_CLEARED for kind, code in zip(kinds, codes, strict=True)
    )


def _mm_to_compact(info: MmExtraInfo | None) -> list[object] | None:
    """A block's multimodal info as ``[[mm_hash, [start, end, start, end, ...]], ...]`` (no field names)."""
    if info is None:
        return None
    return [[obj.mm_hash, [bound for pair in obj.offsets for bound in pair]] for obj in info.mm_objects]


def _mm_from_compact(raw: object) -> MmExtraInfo | None:
    if raw is None:
        return None
    objects = []
    if isinstance(raw, list):
        for obj in raw:
            if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[1], list) and len(obj[1]) % 2 == 0):
                break
            mm_hash, bounds = obj
            if (
                type(mm_hash) is not int
                or not 0 <= mm_hash <= U64_MAX
                or not all(type(bound) is int and 0 <= bound <= U64_MAX for bound in bounds)
            ):
                break
            objects.append(MmObject(mm_hash, tuple(zip(bounds[::2], bounds[1::2], strict=True))))
        else:
            return MmExtraInfo(tuple(objects))
    raise CodecError("entry extra mm_extra_info must be [[mm_hash, [start, end, ...]], ...] of u64s")


def _extras_from_wire(raw: object, kinds: bytes, counts: array[int]) -> dict[int, StoredExtra]:
    if not isinstance(raw, list):
        raise CodecError("entry extras must be a list")
    extras: dict[int, StoredExtra] = {}
    for item in raw:
        if not isinstance(item, list) or len(item) != 3:
            raise CodecError("an entry extra must be [position, start_position, mm_extra_infos]")
        position, start, infos_raw = item
        if not isinstance(position, int) or not 0 <= position < len(kinds) or kinds[position] > 1:
            raise CodecError(f"entry extra names {position!r}, not a Stored event of the entry")
        if start is not None and (not isinstance(start, int) or not 0 <= start <= U64_MAX):
            raise CodecError("entry extra start_position must be a u64 or nil")
        infos = None
        if infos_raw is not None:
            if not isinstance(infos_raw, list) or len(infos_raw) != counts[position]:
                raise CodecError("entry extra mm_extra_infos must hold one per block")
            infos = tuple(_mm_from_compact(info) for info in infos_raw)
        extras[position] = (start, infos)
    return extras


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
    """The columnar (version 2) entry of the events with cursors ``first..<its id>``."""
    return {"k": b"ec", "c": pack_entry_columns(first, entry_columns(events))}


def encode_events_entry_v1(first: int, events: Sequence[RouterEvent]) -> dict[str, bytes]:
    """A version-1 entry: the event plane's named-map msgpack RouterEvents."""
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
    if kind == b"ec":
        payload = fields.get(b"c")
        if payload is None:
            raise CodecError("columnar events entry has no 'c' field")
        first, columns = unpack_entry_columns(payload, cursor)
        return EventsEntry(first, cursor, columns)
    if kind == b"ev":
        payload = fields.get(b"ev")
        if payload is None:
            raise CodecError("events entry has no 'ev' field")
        events = tuple(decode_router_events(payload))
        first = _int_field(fields, b"from")
        if first > cursor or any(not first <= event.event_id <= cursor for event in events):
            raise CodecError(f"events entry {entry_id!r} holds events outside [{first}, {cursor}]")
        if any(b.event_id <= a.event_id for a, b in zip(events, events[1:], strict=False)):
            raise CodecError(f"events entry {entry_id!r} holds event ids that do not increase")
        return EventsEntry(first, cursor, entry_columns(events))
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
        "v": SNAPSHOT_VERSION,
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
            route = EventRoute(g.worker_id, g.tier, g.domain, g.dp_rank, g.source, None)
            events = resident_row_events(route, g.hashes, g.parents, g.tokens, g.flags, g.mm, event_id)
            yield from events
            event_id += len(events)


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
    if not isinstance(body, dict) or body.get("v") != SNAPSHOT_VERSION:
        raise CodecError(f"snapshot is not of format version {SNAPSHOT_VERSION}")
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


# The columns of one entry at most, estimated (entry_column_bytes): Redis allocates each big entry's listpack
# on its own and the allocator rounds it up to a size class (jemalloc's are 25% apart above 8 KiB, so an entry
# of 9 KiB occupies 10 KiB); entries cut just under the 8 KiB class, head and Redis's own bytes included,
# waste almost none of it (docs/fleet.md, "Entry format").
ENTRY_COLUMN_BYTES = 7800


def entry_column_bytes(event: RouterEvent) -> int:
    """About what ``event`` adds to a columnar entry: its op byte, 8 bytes a hash, tokens hash and
    parent, and its multimodal info (the routes are written once an entry: ENTRY_COLUMN_BYTES leaves room)."""
    data = event.data
    blocks = len(data.block_hashes)
    if type(data) is Stored:
        cost = 1 + 16 * blocks + (0 if data.parent_hash is None else 8)
        infos = data.mm_extra_infos
        if infos is not None:  # rare: ~16 bytes an object, ~8 more an event and a block
            cost += 8 + sum(8 if info is None else 4 + 16 * len(info.mm_objects) for info in infos)
        return cost
    return 1 + 8 * blocks


def chunk_events(
    events: Sequence[RouterEvent], max_events: int, max_bytes: int | None = ENTRY_COLUMN_BYTES
) -> Iterable[Sequence[RouterEvent]]:
    """``events`` in slices of at most ``max_events`` and, but for a single event, about ``max_bytes`` of
    columns (None: no byte bound), one stream entry each."""
    if max_bytes is None:
        for start in range(0, len(events), max_events):
            yield events[start : start + max_events]
        return
    start, size = 0, 0
    for position, event in enumerate(events):
        cost = entry_column_bytes(event)
        if position > start and (position - start >= max_events or size + cost > max_bytes):
            yield events[start:position]
            start, size = position, 0
        size += cost
    if start < len(events):
        yield events[start:]
