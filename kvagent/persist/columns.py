"""Every resident block in the state database (sans-IO): snapshots and the republish mirror as columns.

Runs of one-block Stored events that share a route become packed u64 arrays (about 25 bytes a block
instead of about 130 for a wire map), in chunks of bounded size; :func:`encode_dump_chunks` writes the same
bytes straight from the index's columns, without building an event per block. An event that is not part of
such a run (multi-block, multimodal) is kept as its wire map, so every event round-trips exactly. The mirror
is kept the same way, per tier, with its tokens.
"""

from __future__ import annotations

import struct
import sys
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import compress, islice
from typing import TypeAlias, cast

from kvagent import _native
from kvagent.index.recovery_index import DumpGroup, DumpSnapshot
from kvagent.index.ring import KIND_CLEARED, KIND_REMOVED, KIND_STORED_CHILD, RingRange, RingSegment
from kvagent.model.errors import CodecError
from kvagent.model.events import TIER_BY_VALUE, EventRoute, MmExtraInfo, RouterEvent, StorageTier, Stored
from kvagent.persist.codec import (
    BATCH_CLEARED,
    BATCH_REMOVED,
    BATCH_STORED,
    decode_event_row,
    encode_event_row,
    pack,
    route_fields,
    route_row,
    unpack,
)
from kvagent.persist.records import MirrorRow
from kvagent.wire.router_event import mm_extra_info_to_wire

__all__ = [
    "CHUNK_ROWS",
    "decode_mirror_chunk",
    "decode_snapshot_chunk",
    "encode_dump_chunks",
    "encode_mirror_chunks",
    "encode_ring_batch",
    "encode_snapshot_chunks",
]

CHUNK_ROWS = 8192  # blocks (or events) per snapshot/mirror row: rows of about 200 KiB
_NO_TOKENS = 0xFFFFFFFF  # the token length that stands for ``token_bytes is None``
_RUN = 0  # a run of one-block Stored events sharing a route
_EVENT = 1  # one event as a wire map


# --- u64 and token columns ----------------------------------------------------------------------------


def _u64s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def _from_u64s(blob: object, count: int, what: str) -> tuple[int, ...]:
    if type(blob) is not bytes or len(blob) != 8 * count:
        raise CodecError(f"{what} must be {count} packed u64 values")
    return struct.unpack(f"<{count}Q", blob)


def _tokens_column(tokens: Sequence[bytes | None]) -> tuple[bytes, bytes] | None:
    """(u32 lengths, concatenated bytes), or None when no row has tokens."""
    if all(t is None for t in tokens):
        return None
    lengths = [_NO_TOKENS if t is None else len(t) for t in tokens]
    return struct.pack(f"<{len(lengths)}I", *lengths), b"".join(t for t in tokens if t is not None)


def _from_tokens_column(column: object, count: int, what: str) -> list[bytes | None]:
    if column is None:
        return [None] * count
    if not isinstance(column, list) or len(column) != 2:
        raise CodecError(f"{what} must be [lengths, bytes]")
    raw_lengths, blob = column
    if type(raw_lengths) is not bytes or len(raw_lengths) != 4 * count or type(blob) is not bytes:
        raise CodecError(f"{what} lengths must be {count} packed u32 values")
    tokens: list[bytes | None] = []
    offset = 0
    for length in struct.unpack(f"<{count}I", raw_lengths):
        if length == _NO_TOKENS:
            tokens.append(None)
            continue
        tokens.append(blob[offset : offset + length])
        offset += length
    if offset != len(blob):
        raise CodecError(f"{what} bytes do not match their lengths")
    return tokens


def _parents_column(parents: Sequence[int | None]) -> tuple[bytes, bytes]:
    """(a flag byte a row, 1 when it has a parent; the parents as u64, 0 where absent)."""
    flags = bytes(0 if p is None else 1 for p in parents)
    return flags, _u64s([0 if p is None else p for p in parents])


def _from_parents_column(flags: object, values: object, count: int, what: str) -> list[int | None]:
    if type(flags) is not bytes or len(flags) != count or flags.strip(b"\x00\x01"):
        raise CodecError(f"{what} flags must be {count} bytes of 0 or 1")
    parents = _from_u64s(values, count, what)
    return [parent if flag else None for flag, parent in zip(flags, parents, strict=True)]


# --- snapshots: runs of one-block Stored events as columns -------------------------------------------


def _run_route(event: RouterEvent) -> tuple[object, ...] | None:
    """The key shared by a run's events, or None for an event that cannot be part of a run."""
    data = event.data
    if type(data) is not Stored or len(data.block_hashes) != 1:
        return None
    if data.mm_extra_infos is not None or data.start_position is not None:
        return None
    return route_row(event)


def _encode_run(route: tuple[object, ...], run: list[RouterEvent]) -> list[object]:
    blocks: list[Stored] = [event.data for event in run]  # type: ignore[misc]  # Stored by _run_route
    flags, parents = _parents_column([data.parent_hash for data in blocks])
    return [
        _RUN,
        list(route),
        run[0].event_id,
        len(run),
        _u64s([data.block_hashes[0] for data in blocks]),
        _u64s([data.tokens_hashes[0] for data in blocks]),
        flags,
        parents,
        _tokens_column([data.token_bytes for data in blocks]),
    ]


def _encode_runs(events: Iterable[RouterEvent]) -> list[object]:
    """Consecutive events with the same route and consecutive ids form one run; others stay maps."""
    items: list[object] = []
    run: list[RouterEvent] = []
    run_route: tuple[object, ...] | None = None
    for event in events:
        route = _run_route(event)
        if route is None or route != run_route or event.event_id != run[-1].event_id + 1:
            if run:
                items.append(_encode_run(run_route or (), run))  # run_route is set whenever run is
                run = []
            run_route = route
            if route is None:
                _, body, tokens = encode_event_row(event)
                items.append([_EVENT, body, tokens])
                continue
        run.append(event)
    if run:
        items.append(_encode_run(run_route or (), run))
    return items


def encode_snapshot_chunks(events: Iterable[RouterEvent], chunk_rows: int = CHUNK_ROWS) -> Iterator[bytes]:
    """The snapshot as row bodies of at most ``chunk_rows`` events each (in order)."""
    iterator = iter(events)
    while chunk := list(islice(iterator, chunk_rows)):
        yield pack(_encode_runs(chunk))


def _decode_run(item: list[object], out: list[RouterEvent]) -> None:
    if len(item) != 9:
        raise CodecError("snapshot run must have 9 fields")
    _, route, first_id, count, hashes, tokens_hashes, flags, parents, tokens = item
    if type(first_id) is not int or type(count) is not int or first_id < 0 or count < 1:
        raise CodecError("snapshot run has a bad first id or count")
    worker_id, tier, domain, dp_rank, source, session_id = route_fields(route)
    columns = zip(
        range(first_id, first_id + count),
        _from_u64s(hashes, count, "snapshot block hashes"),
        _from_u64s(tokens_hashes, count, "snapshot tokens hashes"),
        _from_parents_column(flags, parents, count, "snapshot parents"),
        _from_tokens_column(tokens, count, "snapshot tokens"),
        strict=True,
    )
    out.extend(
        RouterEvent(
            worker_id,
            tier,
            domain,
            event_id,
            Stored(parent, (block,), (tokens_hash,), token_bytes=token_bytes),
            dp_rank,
            source,
            session_id,
        )
        for event_id, block, tokens_hash, parent, token_bytes in columns
    )


def decode_snapshot_chunk(body: bytes) -> list[RouterEvent]:
    items = unpack(body, "snapshot row")
    if not isinstance(items, list):
        raise CodecError("snapshot row must be a list")
    events: list[RouterEvent] = []
    for item in items:
        if not isinstance(item, list) or not item:
            raise CodecError("snapshot item must be a non-empty list")
        if item[0] == _RUN:
            _decode_run(item, events)
        elif item[0] == _EVENT and len(item) == 3 and type(item[1]) is bytes:
            tokens = item[2]
            if tokens is not None and type(tokens) is not bytes:
                raise CodecError("snapshot event tokens must be bytes")
            events.append(decode_event_row(item[1], tokens))
        else:
            raise CodecError(f"snapshot item has an unknown kind {item[0]!r}")
    return events


# --- snapshots straight from the index's columns --------------------------------------------------------

_Slice: TypeAlias = Callable[[int, int], list[object]]


def _little_endian(values: array[int]) -> bytes:
    if sys.byteorder != "little":
        values = array("Q", values)
        values.byteswap()
    return values.tobytes()


def _group_slicer(group: DumpGroup, first_id: int) -> tuple[_Slice, int]:
    """(the items of the group's dump events [start, end), the group's event count).

    Live rows become runs of packed columns; a row with multimodal info breaks the run and is written as
    one event map, exactly as :func:`_encode_runs` treats the tree dump's events.
    """
    worker_id, tier, domain, dp_rank, source, columns = group
    live, has_parent = columns.masks()
    every = len(columns.hashes) == columns.live
    hashes, parents, tokens = (
        column if every else array("Q", compress(column, live))
        for column in (columns.hashes, columns.parents, columns.tokens)
    )
    flags = has_parent if every else bytes(compress(has_parent, live))
    route = [worker_id, tier.value, domain.value, dp_rank, None if source is None else str(source), None]
    # (position among the live rows, info) of each live multimodal row, in order
    special = [(live.count(1, 0, row), info) for row, info in sorted(columns.mm.items()) if live[row]]
    positions = [position for position, _ in special]

    def run(start: int, end: int) -> list[object]:
        key_columns = (_little_endian(hashes[start:end]), _little_endian(tokens[start:end]))
        parent_columns = (flags[start:end], _little_endian(parents[start:end]))
        return [_RUN, route, first_id + start, end - start, *key_columns, *parent_columns, None]

    def event(position: int, info: MmExtraInfo) -> list[object]:
        parent = parents[position] if flags[position] else None
        data = Stored(parent, (hashes[position],), (tokens[position],), (info,))
        _, body, _ = encode_event_row(
            RouterEvent(worker_id, tier, domain, first_id + position, data, dp_rank, source)
        )
        return [_EVENT, body, None]

    def items(start: int, end: int) -> list[object]:
        found: list[object] = []
        for index in range(bisect_left(positions, start), bisect_left(positions, end)):
            position, info = special[index]
            if start < position:
                found.append(run(start, position))
            found.append(event(position, info))
            start = position + 1
        if start < end:
            found.append(run(start, end))
        return found

    return items, len(hashes)


def encode_dump_chunks(snapshot: DumpSnapshot, chunk_rows: int = CHUNK_ROWS) -> Iterator[bytes]:
    """The index's dump snapshot as row bodies: what :func:`encode_snapshot_chunks` makes of the tree dump's
    events (one-block Stored events numbered from 0), from the block columns without building them."""
    pending: list[object] = []
    filled = first_id = 0
    for group in snapshot.groups:
        items_for, count = _group_slicer(group, first_id)
        start = 0
        while start < count:
            end = min(count, start + chunk_rows - filled)
            pending.extend(items_for(start, end))
            filled += end - start
            start = end
            if filled == chunk_rows:
                yield pack(pending)
                pending, filled = [], 0
        first_id += count
    if pending:
        yield pack(pending)


# --- the republish mirror -------------------------------------------------------------------------------


def _encode_mirror_run(tier: StorageTier, rows: list[MirrorRow]) -> list[object]:
    flags, parents = _parents_column([row.parent_hash for row in rows])
    hashes = _u64s([row.block_hash for row in rows])
    return [tier.value, len(rows), hashes, flags, parents, _tokens_column([row.token_bytes for row in rows])]


def encode_mirror_chunks(rows: Iterable[MirrorRow], chunk_rows: int = CHUNK_ROWS) -> Iterator[bytes]:
    """The mirror as row bodies of at most ``chunk_rows`` blocks, each a list of per-tier runs (in order)."""
    iterator = iter(rows)
    while chunk := list(islice(iterator, chunk_rows)):
        runs: list[object] = []
        start = 0
        for end in range(1, len(chunk) + 1):
            if end == len(chunk) or chunk[end].tier is not chunk[start].tier:
                runs.append(_encode_mirror_run(chunk[start].tier, chunk[start:end]))
                start = end
        yield pack(runs)


def decode_mirror_chunk(body: bytes) -> list[MirrorRow]:
    runs = unpack(body, "mirror row")
    if not isinstance(runs, list):
        raise CodecError("mirror row must be a list")
    rows: list[MirrorRow] = []
    for run in runs:
        if not isinstance(run, list) or len(run) != 6:
            raise CodecError("mirror run must have 6 fields")
        tier_name, count, hashes, flags, parents, tokens = run
        tier = TIER_BY_VALUE.get(tier_name)
        if tier is None or type(count) is not int or count < 1:
            raise CodecError(f"mirror run has a bad tier or count: {tier_name!r}, {count!r}")
        columns = zip(
            _from_u64s(hashes, count, "mirror block hashes"),
            _from_parents_column(flags, parents, count, "mirror parents"),
            _from_tokens_column(tokens, count, "mirror tokens"),
            strict=True,
        )
        rows.extend(MirrorRow(tier, block, parent, token_bytes) for block, parent, token_bytes in columns)
    return rows


# --- suffix batches straight from the ring's columns (issue #34) ---------------------------------------


def _route_index(route: EventRoute, indexes: dict[EventRoute, int], rows: list[tuple[object, ...]]) -> int:
    """The batch's index of ``route`` (a new route row at its first use, as ``codec.encode_batch``)."""
    index = indexes.get(route)
    if index is None:
        index = indexes[route] = len(rows)
        worker_id, tier, domain, dp_rank, source, session = route
        rows.append((worker_id, tier.value, domain.value, dp_rank, None if source is None else str(source), session))
    return index


def _array_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x90 | count,))
    if count < 65536:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def _rows(segment: RingSegment, first: int, end: int, route_map: array[int]) -> Iterator[list[object]]:
    """The rows of ``codec.encode_batch`` (tokens left out) for events first..end of ``segment``."""
    ids, routes, kinds, parents = segment.ids, segment.routes, segment.kinds, segment.parents
    offsets, hashes, tokens, extras = segment.offsets, segment.hashes, segment.tokens, segment.extras
    for position in range(first, end):
        kind = kinds[position]
        event_id, route = ids[position], route_map[routes[position]]
        if kind == KIND_CLEARED:
            yield [event_id, route, BATCH_CLEARED]
            continue
        low, high = offsets[position], offsets[position + 1]
        if kind == KIND_REMOVED:
            yield [event_id, route, BATCH_REMOVED, hashes[low:high].tolist()]
            continue
        start, infos = extras.get(position, (None, None))
        yield [
            event_id,
            route,
            BATCH_STORED,
            parents[position] if kind == KIND_STORED_CHILD else None,
            hashes[low:high].tolist(),
            tokens[low:high].tolist(),
            None,
            start,
            None if infos is None else [mm_extra_info_to_wire(info) for info in infos],
        ]


def _native_rows() -> Callable[..., None] | None:
    """``encode_batch_rows`` of kvagent/_native/_columns.pyx when built (the same row bytes), else None."""
    module = _native.columns
    return None if module is None else cast("Callable[..., None]", module.encode_batch_rows)


_NATIVE_ROWS = _native_rows()


def encode_ring_batch(applied: RingRange) -> tuple[bytes, array[int]]:
    """(the body, the ids) of ``codec.encode_batch(applied.events(), tokens=False)``, byte for byte, read
    from the ring's columns: no RouterEvent, Stored or tuple per event (the persistence writer's append).

    The rows of a piece without extras are written by the compiled ``encode_batch_rows`` when it is built;
    otherwise (and for pieces with a start position or multimodal info) each row is packed here.
    """
    route_index: dict[EventRoute, int] = {}
    route_rows: list[tuple[object, ...]] = []
    body = bytearray()
    count = 0
    ids_out: array[int] = array("Q")
    native = _NATIVE_ROWS
    for segment, first, end in applied.pieces:
        if end <= first:
            continue
        table = segment.route_table
        route_map = array("I", bytes(4 * len(table)))
        for code in dict.fromkeys(segment.routes[first:end]):  # first use order, as encode_batch numbers them
            route_map[code] = _route_index(table[code], route_index, route_rows)
        ids_out.extend(segment.ids[first:end])
        extras = segment.extras
        if native is not None and not (extras and any(first <= position < end for position in extras)):
            native(
                body, route_map, segment.ids, segment.routes, segment.kinds, segment.parents, segment.offsets,
                segment.hashes, segment.tokens, first, end,
            )  # fmt: skip
        else:
            for row in _rows(segment, first, end, route_map):
                body += pack(row)
        count += end - first
    return b"\x92" + pack(route_rows) + _array_header(count) + bytes(body), ids_out
