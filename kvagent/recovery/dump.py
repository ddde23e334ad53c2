"""Tree dumps and buffered answers on the recovery protocol, encoded without per-request, per-event work,
and the compact dump decoded again (docs/protocol.md).  Sans-IO.

- :class:`EncodedRing`: each ring event is encoded once per encoding and the bytes are reused by every
  ``events`` answer and every follower; entries are keyed by event id and checked by identity, so a cached
  encoding can never belong to another event.
- :func:`legacy_dump_parts`: the classic per-event dump encoding, produced from a :class:`DumpSnapshot`'s
  columns by the column encoders (kvagent.recovery.wire_columns).  It is a lazy generator, so the server encodes one
  frame's worth between two sends and never stalls the event loop for a whole dump.
- :func:`columns_frames`: the compact ``"dump_format": "columns"`` dump: raw little-endian u64 columns per
  (owner, tier) group, cut into frames of at most MAX_FRAME_BYTES; :func:`dump_columns_from_wire` reads
  one of its pieces back into :class:`DumpColumns`.
- :func:`dump_document`: the same per-event dump as ONE JSON object or msgpack map (the HTTP surface's
  ``/v1/slots/{slot}/dump``), produced lazily in pieces so a million blocks are never one buffer.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
import weakref
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from itertools import repeat
from operator import sub
from typing import cast

import attrs
import msgpack

from kvagent.index.recovery_index import DumpGroup, DumpSnapshot, RecoveryIndex
from kvagent.index.ring import RingEvents, RingRange, RingSegment
from kvagent.model.errors import KvAgentError, RecoveryClientError
from kvagent.model.events import (
    FLAG_DEAD,
    FLAG_PARENT,
    FLAG_ROOT,
    RESET_ALL,
    MmExtraInfo,
    ResetScope,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.model.ids import CacheOwnerId
from kvagent.model.status import AgentStatus
from kvagent.recovery import wire_columns
from kvagent.recovery.protocol import (
    CACHE_OWNER_SCOPE,
    MAX_FRAME_BYTES,
    EncodedRun,
    EncodedRuns,
    Fence,
    encode_frame,
)
from kvagent.recovery.wire_columns import route_templates
from kvagent.wire.router_event import (
    EVENT_TEMPLATES,
    Encoding,
    encode_event,
    mm_extra_info_from_wire,
    mm_extra_info_to_wire,
    state_source_from_wire,
    state_source_to_wire,
)

__all__ = [
    "DUMP_FORMATS",
    "DumpColumns",
    "EncodedRing",
    "columns_frames",
    "dump_columns_from_wire",
    "dump_document",
    "encoded_ring",
    "filter_snapshot",
    "legacy_dump_parts",
    "parse_dump_format",
    "snapshot_header",
]

DUMP_FORMATS = ("events", "columns")
COLUMN_FIELDS = ("block_hashes", "parent_hashes", "tokens_hashes")
_BYTES_PER_ROW = 8 * len(COLUMN_FIELDS) + 1  # three u64 columns and the flag byte
_FLAG_VALUES = bytes((FLAG_ROOT, FLAG_PARENT, FLAG_DEAD))

_Piece = tuple[DumpGroup, int, int, int]  # (group, first row, end row, event id of its first live row)


def parse_dump_format(request: Mapping[str, object]) -> str:
    value = request.get("dump_format", "events")
    if value not in DUMP_FORMATS:
        raise KvAgentError(f"dump_format must be one of {list(DUMP_FORMATS)}", code="bad_request")
    return str(value)


# --- the encoded ring ------------------------------------------------------------------------------


class _SegmentWire:
    """A ring segment's events encoded as msgpack, built lazily from its columns (positions < ``upto``)."""

    __slots__ = ("blob", "ends", "heads", "tails")

    def __init__(self) -> None:
        self.blob = bytearray()
        self.ends = array("I")
        self.heads: list[bytes] = []
        self.tails: list[bytes] = []

    def encode_through(self, segment: RingSegment, end: int) -> None:
        """Encode the segment's events up to position ``end`` (exclusive), those not encoded yet."""
        first = len(self.ends)
        if first >= end:
            return
        table = segment.route_table
        while len(self.heads) < len(table):
            head, tail = route_templates(table[len(self.heads)])
            self.heads.append(head)
            self.tails.append(tail)
        extras = (
            sorted(position for position in segment.extras if first <= position < end)
            if segment.extras
            else ()
        )
        for position in (*extras, end):
            if first < position:
                wire_columns.impl.encode_ring_events(
                    self.blob,
                    self.ends,
                    self.heads,
                    self.tails,
                    EVENT_TEMPLATES,
                    segment.ids,
                    segment.routes,
                    segment.kinds,
                    segment.parents,
                    segment.offsets,
                    segment.hashes,
                    segment.tokens,
                    first,
                    position,
                )
            if position < end:  # multimodal info or a start position: the reference encoder
                part = encode_event(Encoding.MSGPACK, segment.event(position))
                assert isinstance(part, bytes)
                self.blob += part
                self.ends.append(len(self.blob))
            first = position + 1

    def run(self, first: int, end: int) -> EncodedRun:
        ends = self.ends
        start = ends[first - 1] if first else 0
        with memoryview(self.blob) as view:  # one copy (a bytearray slice and bytes() would be two)
            blob = bytes(view[start : ends[end - 1]])
        return EncodedRun(blob, array("I", map(sub, ends[first:end], repeat(start))), 0)


class EncodedRing:
    """Per-index cache of encoded ring events, shared by every answer and every follower.

    msgpack: each ring segment's events are encoded once, lazily, from its columns (compiled encoder when
    built), and a range answer is a slice of that encoding; the encodings of the ``wire_segments`` segments
    encoded last are kept (the answers ask for the newest events again and again), older ones are dropped
    and rebuilt if asked for again.  An event that is no longer buffered (a follower's live event the ring
    evicted meanwhile) is encoded on its own.

    JSON (the text frames, not the hot path): event id → encoded text, as before: an index refuses
    non-increasing ids, so an id names one event forever; once the cache holds more than twice the ring,
    entries older than the ring's oldest event are dropped (amortised O(1) per insert).
    """

    def __init__(self, index: RecoveryIndex, wire_segments: int = 16) -> None:
        self._index = weakref.ref(index)
        self._limit = 2 * index.ring_capacity + 1024
        self._json: dict[int, str | bytes] = {}
        self._wire_segments = max(2, wire_segments)
        self._encoded: deque[RingSegment] = deque()  # segments holding a _SegmentWire, oldest first

    def encode(self, encoding: Encoding, events: Sequence[RouterEvent]) -> list[str | bytes] | EncodedRuns:
        """The encodings of ``events``, in order: runs of buffered msgpack, else a list of single events."""
        if not events:
            return []
        if encoding is Encoding.MSGPACK:
            ring_range = events.ring_range if isinstance(events, RingEvents) else self._buffered(events)
            if ring_range is not None:
                return EncodedRuns(self.runs(ring_range))
            return [encode_event(encoding, event) for event in events]
        return self._encode_json(events)

    def runs(self, ring_range: RingRange) -> list[EncodedRun]:
        """The msgpack of a ring range, one run per segment piece."""
        runs = []
        for segment, first, end in ring_range.pieces:
            wire = segment.wire
            if not isinstance(wire, _SegmentWire):
                wire = segment.wire = _SegmentWire()
                self._encoded.append(segment)
                if len(self._encoded) > self._wire_segments:
                    self._encoded.popleft().wire = None
            wire.encode_through(segment, end)
            runs.append(wire.run(first, end))
        return runs

    def _buffered(self, events: Sequence[RouterEvent]) -> RingRange | None:
        """The ring range holding exactly ``events`` (consecutive ids, all still buffered), else None."""
        index = self._index()
        first, last = events[0].event_id, events[-1].event_id
        if index is None or last - first + 1 != len(events):
            return None
        return index.ring_between(first, last)

    def _encode_json(self, events: Sequence[RouterEvent]) -> list[str | bytes]:
        cache = self._json
        first, last = events[0].event_id, events[-1].event_id
        if last - first + 1 == len(events):
            parts = list(map(cache.get, range(first, last + 1)))
        else:
            parts = [cache.get(event.event_id) for event in events]
        if None in parts:
            for position, part in enumerate(parts):
                if part is None:
                    event = events[position]
                    parts[position] = cache[event.event_id] = encode_event(Encoding.JSON, event)
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

    def statistics(self) -> dict[str, int]:
        """What the cache holds (tests, diagnostics): segments with an encoding, their bytes, JSON entries."""
        wires = [segment.wire for segment in self._encoded if isinstance(segment.wire, _SegmentWire)]
        return {
            "wire_segments": len(wires),
            "wire_bytes": sum(len(wire.blob) for wire in wires),
            "json_events": len(self._json),
        }


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


def legacy_dump_parts(
    encoding: Encoding, groups: Sequence[DumpGroup], chunk_rows: int = 16384
) -> EncodedRuns:
    """Each dump event encoded as in an ``events`` list (ids from 0), lazily, ``chunk_rows`` rows at a time.

    The runs come from the column encoders (compiled when built; kvagent/recovery/wire_columns.py), a
    buffer per chunk; iterating the result yields the single events.
    """
    return EncodedRuns(_dump_runs(encoding, groups, chunk_rows))


def dump_document(
    encoding: Encoding,
    header: Mapping[str, object],
    groups: Sequence[DumpGroup],
    *,
    chunk_rows: int = 512,
) -> Iterator[bytes]:
    """``{**header, "events": [...]}`` as one document, in pieces of ``chunk_rows`` events.

    The events are exactly :func:`legacy_dump_parts`' (what the websocket dump frames carry, ids from
    0).  The msgpack array header needs the count up front: it is the groups' live rows.  Each piece is
    encoded when it is asked for, so the caller holds one piece at a time (about 100 KiB).
    """
    if encoding is Encoding.JSON:
        head = json.dumps(dict(header), separators=(",", ":"))
        yield (head[:-1] + (',"events":[' if len(header) else '"events":[')).encode()
        separator = ""
        for run in _dump_runs(encoding, groups, chunk_rows):
            yield (separator + cast("str", run.blob)).encode()
            separator = ","
        yield b"]}"
        return
    packer = msgpack.Packer(use_bin_type=True)
    pieces = [packer.pack_map_header(len(header) + 1)]
    for key, value in header.items():
        pieces += (packer.pack(key), packer.pack(value))
    pieces += (packer.pack("events"), packer.pack_array_header(sum(g.columns.live for g in groups)))
    yield b"".join(pieces)
    for run in _dump_runs(encoding, groups, chunk_rows):
        yield bytes(run.blob)  # type: ignore[arg-type]  # msgpack runs are bytes-like


def _dump_runs(encoding: Encoding, groups: Sequence[DumpGroup], chunk_rows: int) -> Iterator[EncodedRun]:
    """:func:`legacy_dump_parts`' events, a run of at most ``chunk_rows`` rows at a time (none empty)."""
    impl = wire_columns.impl
    as_json = encoding is Encoding.JSON
    event_id = 0
    for group in groups:
        worker_id, tier, domain, dp_rank, source, columns = group
        hashes, parents, tokens, flags = columns.hashes, columns.parents, columns.tokens, columns.flags
        if as_json:
            template: tuple[bytes, ...] = wire_columns.dump_json_template(
                worker_id, tier, domain, dp_rank, source
            )
            encode_rows = impl.encode_dump_json
        else:
            template = wire_columns.dump_msgpack_template(worker_id, tier, domain, dp_rank, source)
            encode_rows = impl.encode_dump_msgpack
        special = sorted(columns.mm) if columns.mm else []
        rows = len(flags)
        for first in range(0, rows, chunk_rows):
            end = min(rows, first + chunk_rows)
            out = bytearray()
            ends = array("I")
            position = first
            for row in special[bisect_left(special, first) : bisect_left(special, end)]:
                event_id = encode_rows(
                    out, ends, template, hashes, parents, tokens, flags, position, row, event_id
                )
                if flags[row] != FLAG_DEAD:  # multimodal info: the reference encoder
                    parent = parents[row] if flags[row] == FLAG_PARENT else None
                    data = Stored(parent, (hashes[row],), (tokens[row],), (columns.mm[row],))
                    event = RouterEvent(worker_id, tier, domain, event_id, data, dp_rank, source)
                    part = encode_event(encoding, event)
                    if as_json and out:
                        out += b","
                    out += part.encode() if isinstance(part, str) else part
                    ends.append(len(out))
                    event_id += 1
                position = row + 1
            event_id = encode_rows(
                out, ends, template, hashes, parents, tokens, flags, position, end, event_id
            )
            if ends:
                yield EncodedRun(out.decode("ascii") if as_json else out, ends, 1 if as_json else 0)


# --- the compact columns dump -----------------------------------------------------------------------


def _le_bytes(column: array[int], first: int, end: int) -> bytes:
    piece = column[first:end]
    if sys.byteorder != "little":
        piece.byteswap()
    return piece.tobytes()


def _piece(
    encoding: Encoding, group: DumpGroup, first: int, end: int, first_event_id: int
) -> dict[str, object]:
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


# --- reading the columns dump back ------------------------------------------------------------------


@attrs.frozen(slots=True, eq=False)
class DumpColumns:
    """One piece of a ``"dump_format": "columns"`` tree dump: rows of one (owner, tier), parents first.

    Row i is block ``block_hashes[i]`` with tokens hash ``tokens_hashes[i]`` and, when ``flags[i]`` is 1,
    parent ``parent_hashes[i]`` (0: a root; 2: a padding row to skip).  A router that rebuilds its own tree
    reads the arrays directly; :meth:`blocks` and :meth:`events` are conveniences.
    """

    worker_id: int
    storage_tier: StorageTier
    residency_domain: ResidencyDomain
    dp_rank: int
    state_source: CacheOwnerId | None
    first_event_id: int
    block_hashes: array[int]
    parent_hashes: array[int]
    tokens_hashes: array[int]
    flags: bytes
    mm_extra_infos: Mapping[int, MmExtraInfo]

    @property
    def live(self) -> int:
        """Rows that are blocks (not padding)."""
        return len(self.flags) - self.flags.count(FLAG_DEAD)

    def blocks(self) -> Iterator[tuple[int, int | None, int, MmExtraInfo | None]]:
        """(block hash, parent hash or None, tokens hash, mm info) of each block, in dump order."""
        mm = self.mm_extra_infos
        rows = zip(self.block_hashes, self.parent_hashes, self.tokens_hashes, self.flags, strict=True)
        for row, (block, parent, tokens, flag) in enumerate(rows):
            if flag != FLAG_DEAD:
                yield block, parent if flag == FLAG_PARENT else None, tokens, mm.get(row) if mm else None

    def events(self) -> Iterator[RouterEvent]:
        """The same blocks as the ``events`` dump format's one-block Stored events (same synthetic ids)."""
        event_id = self.first_event_id
        for block, parent, tokens, info in self.blocks():
            data = Stored(parent, (block,), (tokens,), None if info is None else (info,))
            yield RouterEvent(
                self.worker_id,
                self.storage_tier,
                self.residency_domain,
                event_id,
                data,
                self.dp_rank,
                self.state_source,
            )
            event_id += 1


def _blob(value: object, field: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):  # the JSON encoding carries the columns as base64
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            raise _bad(f"{field} is not base64") from None
    raise _bad(f"{field} must be bytes or a base64 string")


def _u64_column(value: object, field: str, rows: int) -> array[int]:
    blob = _blob(value, field)
    if len(blob) != 8 * rows:
        raise _bad(f"{field} has {len(blob)} bytes for {rows} rows")
    column = array("Q")
    column.frombytes(blob)
    if sys.byteorder != "little":
        column.byteswap()
    return column


def _bad(message: str) -> RecoveryClientError:
    return RecoveryClientError("bad_response", message)


def dump_columns_from_wire(piece: object) -> DumpColumns:
    """Validate one piece of a columns dump (C-speed: no per-row Python work)."""
    if not isinstance(piece, dict):
        raise _bad("a dump piece must be a map")
    try:
        rows = piece["rows"]
        if type(rows) is not int or rows < 0:
            raise _bad("dump rows must be a non-negative integer")
        flags = _blob(piece["flags"], "flags")
        if len(flags) != rows or flags.translate(None, _FLAG_VALUES):
            raise _bad("dump flags must be one 0/1/2 byte per row")
        mm: dict[int, MmExtraInfo] = {}
        for row, raw_info in piece.get("mm_extra_infos") or ():
            info = mm_extra_info_from_wire(raw_info)
            if info is not None and isinstance(row, int) and 0 <= row < rows:
                mm[row] = info
        source = piece.get("state_source")
        return DumpColumns(
            int(piece["worker_id"]),
            StorageTier(piece["storage_tier"]),
            ResidencyDomain(piece["residency_domain"]),
            int(piece["dp_rank"]),
            None if source is None else state_source_from_wire(source),
            int(piece["first_event_id"]),
            _u64_column(piece["block_hashes"], "block_hashes", rows),
            _u64_column(piece["parent_hashes"], "parent_hashes", rows),
            _u64_column(piece["tokens_hashes"], "tokens_hashes", rows),
            flags,
            mm,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(f"malformed dump columns: {exc!r}") from None
