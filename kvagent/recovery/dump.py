"""Encoding tree dumps and buffered answers without per-request, per-event work (docs/protocol.md).

Three pieces, all sans-IO:

- :class:`EncodedRing`: each ring event is encoded once per encoding and the bytes are reused by every
  ``events`` answer and every follower; entries are keyed by event id and checked by identity, so a cached
  encoding can never belong to another event.
- :func:`legacy_dump_parts`: the classic per-event dump encoding, produced from a :class:`DumpSnapshot`'s
  columns with precomputed byte templates (msgpack: fixed-width uint64 ``0xcf`` fields, valid msgpack that
  decodes to the same map; JSON: byte-identical to ``json.dumps``).  It is a lazy generator, so the server
  encodes one frame's worth between two sends and never stalls the event loop for a whole dump.
- :func:`columns_frames`: the compact ``"dump_format": "columns"`` dump: raw little-endian u64 columns per
  (owner, tier) group, cut into frames of at most MAX_FRAME_BYTES.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import weakref
from array import array
from collections.abc import Iterator, Mapping, Sequence
from itertools import repeat
from typing import cast

import msgpack

from kvagent.index.recovery_index import DumpGroup, DumpSnapshot, RecoveryIndex
from kvagent.index.store import FLAG_DEAD, FLAG_PARENT
from kvagent.model.errors import KvAgentError
from kvagent.model.events import (
    RESET_ALL,
    Removed,
    ResetScope,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.model.status import AgentStatus
from kvagent.recovery.protocol import (
    CACHE_OWNER_SCOPE,
    MAX_FRAME_BYTES,
    Encoding,
    Fence,
    encode_event,
    encode_frame,
)
from kvagent.wire.router_event import mm_extra_info_to_wire, state_source_to_wire

__all__ = [
    "DUMP_FORMATS",
    "EncodedRing",
    "columns_frames",
    "encoded_ring",
    "fast_encode_event",
    "filter_snapshot",
    "legacy_dump_parts",
    "parse_dump_format",
]

DUMP_FORMATS = ("events", "columns")
COLUMN_FIELDS = ("block_hashes", "parent_hashes", "tokens_hashes")
_BYTES_PER_ROW = 8 * len(COLUMN_FIELDS) + 1  # three u64 columns and the flag byte

_Piece = tuple[DumpGroup, int, int, int]  # (group, first row, end row, event id of its first live row)


def parse_dump_format(request: Mapping[str, object]) -> str:
    value = request.get("dump_format", "events")
    if value not in DUMP_FORMATS:
        raise KvAgentError(f"dump_format must be one of {list(DUMP_FORMATS)}", code="bad_request")
    return str(value)


# --- one ring event, fast ----------------------------------------------------------------------------

_packer = msgpack.Packer(use_bin_type=True)
_pack = _packer.pack
# (worker_id, tier, domain, dp_rank, state_source, session_id) -> (bytes up to the event id, bytes after data)
_ROUTE_BYTES: dict[tuple[object, ...], tuple[bytes, bytes]] = {}
_ROUTE_BYTES_MAX = 4096
_U64 = struct.Struct(">BQ")
_BLOCK_HEAD = _packer.pack_map_header(3) + _pack("block_hash") + b"\xcf"
_BLOCK_MID = _pack("tokens_hash") + b"\xcf"
_BLOCK_TAIL = _pack("mm_extra_info") + _pack(None)
_BLOCK = struct.Struct(f">{len(_BLOCK_HEAD)}sQ{len(_BLOCK_MID)}sQ{len(_BLOCK_TAIL)}s")
_STORED_HEAD = b"".join(
    [_pack("data"), _packer.pack_map_header(1), _pack("stored"), _packer.pack_map_header(3), _pack("parent_hash")]
)
_START_POSITION = _pack("start_position")
_BLOCKS = _pack("blocks")
_REMOVED_HEAD = b"".join(
    [_pack("data"), _packer.pack_map_header(1), _pack("removed"), _packer.pack_map_header(1), _pack("block_hashes")]
)
_CLEARED = _pack("data") + _pack("cleared")


def _event_head(top_fields: int, worker_id: int, tier: StorageTier, domain: ResidencyDomain) -> bytes:
    """A wire event's msgpack bytes up to its event id, ending in the 0xcf marker of a fixed-width u64."""
    return b"".join(
        [
            _packer.pack_map_header(top_fields),
            _pack("worker_id"),
            _pack(worker_id),
            _pack("storage_tier"),
            _pack(tier.value),
            _pack("residency_domain"),
            _pack(domain.value),
            _pack("event"),
            _packer.pack_map_header(3),
            _pack("event_id"),
            b"\xcf",
        ]
    )


def _route_bytes(event: RouterEvent) -> tuple[bytes, bytes]:
    key = (
        event.worker_id,
        event.storage_tier,
        event.residency_domain,
        event.dp_rank,
        event.state_source,
        event.session_id,
    )
    found = _ROUTE_BYTES.get(key)
    if found is None:
        top = 4 + (event.state_source is not None) + (event.session_id is not None)
        head = _event_head(top, event.worker_id, event.storage_tier, event.residency_domain)
        tail = _pack("dp_rank") + _pack(event.dp_rank)
        if event.state_source is not None:
            tail += _pack("state_source") + _pack(state_source_to_wire(event.state_source))
        if event.session_id is not None:
            tail += _pack("session_id") + _pack(event.session_id)
        if len(_ROUTE_BYTES) >= _ROUTE_BYTES_MAX:
            _ROUTE_BYTES.clear()  # routes are a handful per slot; this only bounds odd inputs
        found = _ROUTE_BYTES[key] = (head, tail)
    return found


def fast_encode_event(encoding: Encoding, event: RouterEvent) -> str | bytes:
    """:func:`encode_event`, but msgpack from byte templates (u64 fields fixed-width ``0xcf``).

    The result decodes to exactly ``router_event_to_wire(event)``; building that dict and packing it costs
    about ten times more, and every applied event is encoded once when clients recover or follow.
    """
    data = event.data
    cls = type(data)
    if encoding is not Encoding.MSGPACK or (cls is Stored and data.mm_extra_infos is not None):  # type: ignore[union-attr]
        return encode_event(encoding, event)
    try:
        head, tail = _route_bytes(event)
        if cls is Stored:
            assert isinstance(data, Stored)
            parent = b"\xc0" if data.parent_hash is None else _U64.pack(0xCF, data.parent_hash)
            hashes = data.block_hashes
            body = b"".join(
                [
                    _STORED_HEAD,
                    parent,
                    _START_POSITION,
                    _pack(data.start_position),
                    _BLOCKS,
                    _packer.pack_array_header(len(hashes)),
                    *map(
                        _BLOCK.pack,
                        repeat(_BLOCK_HEAD),
                        hashes,
                        repeat(_BLOCK_MID),
                        data.tokens_hashes,
                        repeat(_BLOCK_TAIL),
                    ),
                ]
            )
        elif cls is Removed:
            assert isinstance(data, Removed)
            hashes = data.block_hashes
            body = b"".join(
                [_REMOVED_HEAD, _packer.pack_array_header(len(hashes)), *map(_U64.pack, repeat(0xCF), hashes)]
            )
        else:
            body = _CLEARED
        return b"".join([head, event.event_id.to_bytes(8, "big"), body, tail])
    except (struct.error, OverflowError, TypeError, ValueError):
        return encode_event(encoding, event)  # out-of-range values: the reference path reports them


# --- the encoded ring ------------------------------------------------------------------------------


class EncodedRing:
    """Per-index cache of encoded ring events: event id → encoded bytes, per encoding.

    An index refuses non-increasing ids, so within one index an id names one event forever and the cache
    needs no invalidation, only bounding: once it holds more than twice the ring, entries older than the
    ring's oldest event are dropped (amortised O(1) per insert).  A consecutive run of ids (the usual
    ring tail) is looked up at C speed with ``map(dict.get, range(...))``.
    """

    def __init__(self, index: RecoveryIndex) -> None:
        self._index = weakref.ref(index)
        self._limit = 2 * index.ring_capacity + 1024
        self._caches: dict[Encoding, dict[int, str | bytes]] = {Encoding.JSON: {}, Encoding.MSGPACK: {}}

    def encode(self, encoding: Encoding, events: Sequence[RouterEvent]) -> list[str | bytes]:
        """The encodings of ``events``, in order."""
        cache = self._caches[encoding]
        if not events:
            return []
        first, last = events[0].event_id, events[-1].event_id
        if last - first + 1 == len(events):
            parts = list(map(cache.get, range(first, last + 1)))
        else:
            parts = [cache.get(event.event_id) for event in events]
        if None in parts:
            for position, part in enumerate(parts):
                if part is None:
                    event = events[position]
                    parts[position] = cache[event.event_id] = fast_encode_event(encoding, event)
        if len(cache) > self._limit:
            self._prune(cache)
        return cast("list[str | bytes]", parts)  # every None was filled above

    def _prune(self, cache: dict[int, str | bytes]) -> None:
        index = self._index()
        oldest = None if index is None else index.oldest_buffered_id()
        if oldest is None:
            cache.clear()
            return
        stale = [event_id for event_id in cache if event_id < oldest]
        for event_id in stale:
            del cache[event_id]


_ENCODED_RINGS: weakref.WeakKeyDictionary[RecoveryIndex, EncodedRing] = weakref.WeakKeyDictionary()


def encoded_ring(index: RecoveryIndex) -> EncodedRing:
    """The one EncodedRing of ``index`` (shared by every connection serving it)."""
    ring = _ENCODED_RINGS.get(index)
    if ring is None:
        ring = _ENCODED_RINGS[index] = EncodedRing(index)
    return ring


# --- fencing a dump ---------------------------------------------------------------------------------


def filter_snapshot(
    snapshot: DumpSnapshot, status: AgentStatus, fence: Fence
) -> tuple[tuple[DumpGroup, ...], ResetScope]:
    """5.3 filtering of a dump by group (every event of a group shares domain and state_source)."""
    if not fence.fenced:
        return snapshot.groups, RESET_ALL
    owner = status.identity.cache_owner_id

    def own_cache_owner(group: DumpGroup) -> bool:
        return group.domain is ResidencyDomain.CACHE_OWNER and group.source == owner

    if fence.generation is not None:
        kept = tuple(g for g in snapshot.groups if g.domain is ResidencyDomain.WORKER or own_cache_owner(g))
        return kept, RESET_ALL
    return tuple(g for g in snapshot.groups if own_cache_owner(g)), CACHE_OWNER_SCOPE


# --- the per-event (legacy) dump encoding -----------------------------------------------------------


def _slow_part(encoding: Encoding, group: DumpGroup, event_id: int, row: int) -> str | bytes:
    columns = group.columns
    info = columns.mm.get(row)
    parent = columns.parents[row] if columns.flags[row] == FLAG_PARENT else None
    data = Stored(parent, (columns.hashes[row],), (columns.tokens[row],), None if info is None else (info,))
    event = RouterEvent(
        group.worker_id, group.tier, group.domain, event_id, data, group.dp_rank, group.source
    )
    return encode_event(encoding, event)


def _msgpack_templates(group: DumpGroup) -> tuple[struct.Struct, struct.Struct, tuple[bytes, ...]]:
    pack = msgpack.Packer(use_bin_type=True).pack
    packer = msgpack.Packer(use_bin_type=True)
    source = group.source
    head = _event_head(4 if source is None else 5, group.worker_id, group.tier, group.domain)
    data = b"".join(
        [pack("data"), packer.pack_map_header(1), pack("stored"), packer.pack_map_header(3), pack("parent_hash")]
    )
    blocks = b"".join(
        [
            pack("start_position"),
            pack(None),
            pack("blocks"),
            packer.pack_array_header(1),
            packer.pack_map_header(3),
            pack("block_hash"),
            b"\xcf",
        ]
    )
    tokens = pack("tokens_hash") + b"\xcf"
    tail = pack("mm_extra_info") + pack(None) + pack("dp_rank") + pack(group.dp_rank)
    if source is not None:
        tail += pack("state_source") + pack(state_source_to_wire(source))
    with_parent_mid = data + b"\xcf"
    root_mid = data + b"\xc0" + blocks
    with_parent = struct.Struct(
        f">{len(head)}sQ{len(with_parent_mid)}sQ{len(blocks)}sQ{len(tokens)}sQ{len(tail)}s"
    )
    root = struct.Struct(f">{len(head)}sQ{len(root_mid)}sQ{len(tokens)}sQ{len(tail)}s")
    return with_parent, root, (head, with_parent_mid, blocks, tokens, tail, root_mid)


def _msgpack_rows(
    group: DumpGroup, first_row: int, end_row: int, event_id: int
) -> tuple[list[bytes], int]:
    hashes, parents, tokens, flags, mm, _live = group.columns
    with_parent, root, (head, mid, blocks, toks, tail, root_mid) = _msgpack_templates(group)
    pack_parent, pack_root = with_parent.pack, root.pack
    parts: list[bytes] = []
    append = parts.append
    for row in range(first_row, end_row):
        flag = flags[row]
        if flag == FLAG_DEAD:
            continue
        if mm and row in mm:
            append(_slow_part(Encoding.MSGPACK, group, event_id, row))  # type: ignore[arg-type]
        elif flag == FLAG_PARENT:
            append(pack_parent(head, event_id, mid, parents[row], blocks, hashes[row], toks, tokens[row], tail))
        else:
            append(pack_root(head, event_id, root_mid, hashes[row], toks, tokens[row], tail))
        event_id += 1
    return parts, event_id


def _json_rows(group: DumpGroup, first_row: int, end_row: int, event_id: int) -> tuple[list[str], int]:
    hashes, parents, tokens, flags, mm, _live = group.columns
    # json.dumps(router_event_to_wire(...), separators=(",", ":")) with the per-block numbers left open.
    source = "" if group.source is None else f',"state_source":{json.dumps(state_source_to_wire(group.source))}'
    template = (
        f'{{"worker_id":{group.worker_id},"storage_tier":{json.dumps(group.tier.value)},'
        f'"residency_domain":{json.dumps(group.domain.value)},"event":{{"event_id":%d,"data":{{"stored":'
        '{"parent_hash":%s,"start_position":null,"blocks":[{"block_hash":%d,"tokens_hash":%d,'
        f'"mm_extra_info":null}}]}}}},"dp_rank":{group.dp_rank}}}{source}}}'
    )
    parts: list[str] = []
    append = parts.append
    for row in range(first_row, end_row):
        flag = flags[row]
        if flag == FLAG_DEAD:
            continue
        if mm and row in mm:
            append(_slow_part(Encoding.JSON, group, event_id, row))  # type: ignore[arg-type]
        else:
            parent = str(parents[row]) if flag == FLAG_PARENT else "null"
            append(template % (event_id, parent, hashes[row], tokens[row]))
        event_id += 1
    return parts, event_id


def legacy_dump_parts(
    encoding: Encoding, groups: Sequence[DumpGroup], chunk_rows: int = 4096
) -> Iterator[str | bytes]:
    """Each dump event encoded as in an ``events`` list (ids from 0), lazily, ``chunk_rows`` at a time."""
    event_id = 0
    for group in groups:
        rows = len(group.columns.flags)
        for first in range(0, rows, chunk_rows):
            end = min(rows, first + chunk_rows)
            if encoding is Encoding.MSGPACK:
                parts, event_id = _msgpack_rows(group, first, end, event_id)
                yield from parts
            else:
                text_parts, event_id = _json_rows(group, first, end, event_id)
                yield from text_parts


# --- the compact columns dump -----------------------------------------------------------------------


def _le_bytes(column: array[int], first: int, end: int) -> bytes:
    piece = column[first:end]
    if sys.byteorder != "little":
        piece.byteswap()
    return piece.tobytes()


def _piece(encoding: Encoding, group: DumpGroup, first: int, end: int, first_event_id: int) -> dict[str, object]:
    columns = group.columns
    blobs: dict[str, bytes] = {
        "block_hashes": _le_bytes(columns.hashes, first, end),
        "parent_hashes": _le_bytes(columns.parents, first, end),
        "tokens_hashes": _le_bytes(columns.tokens, first, end),
        "flags": columns.flags[first:end],
    }
    piece: dict[str, object] = {
        "worker_id": group.worker_id,
        "storage_tier": group.tier.value,
        "residency_domain": group.domain.value,
        "dp_rank": group.dp_rank,
    }
    if group.source is not None:
        piece["state_source"] = state_source_to_wire(group.source)
    piece["first_event_id"] = first_event_id
    piece["rows"] = end - first
    for key, blob in blobs.items():
        piece[key] = base64.b64encode(blob).decode("ascii") if encoding is Encoding.JSON else blob
    mm = columns.mm
    piece["mm_extra_infos"] = (
        [[row - first, mm_extra_info_to_wire(info)] for row, info in sorted(mm.items()) if first <= row < end]
        if mm
        else []
    )
    return piece


def _live_rows(flags: bytes, first: int, end: int) -> int:
    return end - first - flags.count(FLAG_DEAD, first, end)


def columns_frames(
    encoding: Encoding,
    header: Mapping[str, object],
    groups: Sequence[DumpGroup],
    *,
    limit: int = MAX_FRAME_BYTES,
) -> Iterator[str | bytes]:
    """The ``columns`` dump as frames of at most ``limit`` bytes; always at least one frame.

    A frame holds pieces (row ranges) of one or more groups, in dump order.  Rows are sized up front
    (25 bytes raw, a third more in base64) and a frame that still comes out too large (multimodal info)
    is rebuilt with half the rows.
    """
    row_bytes = _BYTES_PER_ROW * 4 // 3 + 1 if encoding is Encoding.JSON else _BYTES_PER_ROW
    base = {**header, "format": "columns"}
    overhead = len(encode_frame(encoding, {**base, "groups": [], "more": False})) + 512
    budget_rows = max(1, (limit - overhead) // row_bytes)
    # Each frame's (group, first row, end row, first event id) pieces, in dump order.
    frames: list[list[_Piece]] = []
    current: list[_Piece] = []
    room = budget_rows
    event_id = 0
    for group in groups:
        flags = group.columns.flags
        rows, position = len(flags), 0
        while position < rows:
            if room == 0:
                frames.append(current)
                current, room = [], budget_rows
            take = min(rows - position, room)
            current.append((group, position, position + take, event_id))
            event_id += _live_rows(flags, position, position + take)
            position += take
            room -= take
    frames.append(current)

    def build(batch: list[_Piece], more: bool) -> Iterator[str | bytes]:
        frame = encode_frame(
            encoding, {**base, "groups": [_piece(encoding, *item) for item in batch], "more": more}
        )
        if len(frame) <= limit:
            yield frame
            return
        rows = sum(end - first for _, first, end, _ in batch)
        if rows <= 1:
            raise KvAgentError(
                f"one dump row needs {len(frame)} bytes, more than the {limit}-byte frame limit",
                code="too_large",
            )
        head, tail = _split_rows(batch, rows // 2)
        yield from build(head, True)
        yield from build(tail, more)

    last = len(frames) - 1
    for number, batch in enumerate(frames):
        yield from build(batch, number < last)


def _split_rows(batch: list[_Piece], rows: int) -> tuple[list[_Piece], list[_Piece]]:
    head: list[_Piece] = []
    tail: list[_Piece] = []
    for group, first, end, first_id in batch:
        if rows >= end - first:
            head.append((group, first, end, first_id))
            rows -= end - first
        elif rows > 0:
            cut = first + rows
            head.append((group, first, cut, first_id))
            tail.append((group, cut, end, first_id + _live_rows(group.columns.flags, first, cut)))
            rows = 0
        else:
            tail.append((group, first, end, first_id))
    return head, tail


def snapshot_header(snapshot: DumpSnapshot, scope: ResetScope) -> dict[str, object]:
    return {"kind": "tree_dump", "last_event_id": snapshot.last_event_id, "reset_scope": scope.to_json()}
