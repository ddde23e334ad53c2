"""Encoding events straight from columns (issue #25): the byte templates and the pure-Python encoders.

Two encoders write runs of events into one buffer (``out``) and record where each event ends (``ends``,
absolute offsets into ``out``), so an answer is a slice of that buffer and a frame a cut at an event end:

- :func:`encode_ring_events`: buffered ring events (a segment's columns, :mod:`kvagent.index.ring`), as the
  msgpack of :func:`kvagent.wire.router_event.encode_event`;
- :func:`encode_dump_msgpack` / :func:`encode_dump_json`: a tree dump's one-block Stored events from block
  columns, as ``encode_event`` writes each of them (JSON events separated by commas).

The msgpack templates are the wire module's (``EVENT_TEMPLATES``, ``route_head``, ``route_tail``): one
definition of the bytes, whichever encoder writes them.

The compiled twin is ``kvagent/_native/_columns.pyx`` (same functions, same bytes); :data:`impl` is that
extension when it was built and importable, else this module.  Rows or events that carry multimodal info or
a ``start_position`` are never given to these functions: the callers encode them with the reference encoder.
"""

from __future__ import annotations

import importlib
import struct
from array import array
from itertools import compress
from types import ModuleType
from typing import NamedTuple

import msgpack

from kvagent import _native
from kvagent.index.ring import KIND_CLEARED, KIND_REMOVED, KIND_STORED_CHILD
from kvagent.model.events import FLAG_PARENT, FLAG_ROOT, EventRoute, ResidencyDomain, StorageTier
from kvagent.model.ids import CacheOwnerId
from kvagent.wire.router_event import (
    EVENT_TEMPLATES,
    FIXED_U64,
    NIL,
    EventTemplates,
    route_head,
    route_tail,
    state_source_to_wire,
)

__all__ = [
    "NATIVE",
    "DumpJsonTemplate",
    "DumpMsgpackTemplate",
    "dump_json_template",
    "dump_msgpack_template",
    "encode_dump_json",
    "encode_dump_msgpack",
    "encode_ring_events",
    "impl",
    "route_templates",
]

_packer = msgpack.Packer(use_bin_type=True)


def route_templates(route: EventRoute) -> tuple[bytes, bytes]:
    """(head, tail) of a ring route's events: the bytes before the event id and after the data."""
    worker_id, tier, domain, dp_rank, source, session_id = route
    optional = (source is not None) + (session_id is not None)
    return route_head(worker_id, tier, domain, optional), route_tail(dp_rank, source, session_id)


class DumpMsgpackTemplate(NamedTuple):
    """One dump route's fixed bytes: a row with a parent is head id mid parent blocks hash key tokens tail,
    a root row head id root_mid hash key tokens tail (ids and hashes as 8 big-endian bytes)."""

    head: bytes
    mid: bytes
    blocks: bytes
    key: bytes
    tail: bytes
    root_mid: bytes


def dump_msgpack_template(
    worker_id: int, tier: StorageTier, domain: ResidencyDomain, dp_rank: int, source: CacheOwnerId | None
) -> DumpMsgpackTemplate:
    stored_head, stored_blocks, block_head, block_mid, block_tail, _removed, _cleared = EVENT_TEMPLATES
    head = route_head(worker_id, tier, domain, source is not None)
    blocks = stored_blocks + _packer.pack_array_header(1) + block_head
    tail = block_tail + route_tail(dp_rank, source, None)
    return DumpMsgpackTemplate(head, stored_head + FIXED_U64, blocks, block_mid, tail, stored_head + NIL + blocks)


class DumpJsonTemplate(NamedTuple):
    """One dump route's JSON text around the row's numbers: p0 id p1 parent p2 hash p3 tokens p4 (ASCII)."""

    p0: bytes
    p1: bytes
    p2: bytes
    p3: bytes
    p4: bytes


def dump_json_template(
    worker_id: int, tier: StorageTier, domain: ResidencyDomain, dp_rank: int, source: CacheOwnerId | None
) -> DumpJsonTemplate:
    import json

    source_text = "" if source is None else f',"state_source":{json.dumps(state_source_to_wire(source))}'
    return DumpJsonTemplate(
        (
            f'{{"worker_id":{worker_id},"storage_tier":{json.dumps(tier.value)},'
            f'"residency_domain":{json.dumps(domain.value)},"event":{{"event_id":'
        ).encode(),
        b',"data":{"stored":{"parent_hash":',
        b',"start_position":null,"blocks":[{"block_hash":',
        b',"tokens_hash":',
        f',"mm_extra_info":null}}]}}}},"dp_rank":{dp_rank}}}{source_text}}}'.encode(),
    )


_U64 = struct.Struct(">Q")


def _array_header(count: int) -> bytes:
    header: bytes = _packer.pack_array_header(count)
    return header


def encode_ring_events(
    out: bytearray,
    ends: array[int],
    heads: list[bytes],
    tails: list[bytes],
    templates: EventTemplates,
    ids: array[int],
    routes: array[int],
    kinds: bytearray,
    parents: array[int],
    offsets: array[int],
    hashes: array[int],
    tokens: array[int],
    first: int,
    end: int,
) -> None:
    """Append events ``first`` to ``end - 1`` of a ring segment's columns to ``out`` (each as the msgpack
    named map), and each one's end offset to ``ends``.  None of them may carry extras."""
    stored_head, stored_blocks, block_head, block_mid, block_tail, removed_head, cleared = templates
    pack_u64 = _U64.pack
    for position in range(first, end):
        code = routes[position]
        kind = kinds[position]
        parts = [heads[code], pack_u64(ids[position])]
        if kind == KIND_CLEARED:
            parts.append(cleared)
        else:
            lo, hi = offsets[position], offsets[position + 1]
            if kind == KIND_REMOVED:
                parts += (removed_head, _array_header(hi - lo))
                parts += [FIXED_U64 + pack_u64(block) for block in hashes[lo:hi]]
            else:
                parts.append(stored_head)
                parts.append(FIXED_U64 + pack_u64(parents[position]) if kind == KIND_STORED_CHILD else NIL)
                parts += (stored_blocks, _array_header(hi - lo))
                for block, token in zip(hashes[lo:hi], tokens[lo:hi], strict=True):
                    parts += (block_head, pack_u64(block), block_mid, pack_u64(token), block_tail)
        parts.append(tails[code])
        out += b"".join(parts)
        ends.append(len(out))


def encode_dump_msgpack(
    out: bytearray,
    ends: array[int],
    template: DumpMsgpackTemplate,
    hashes: array[int],
    parents: array[int],
    tokens: array[int],
    flags: bytes,
    first: int,
    end: int,
    event_id: int,
) -> int:
    """Append the dump events of rows ``first`` to ``end - 1`` (flag 0 root, 1 with parent, 2 skipped),
    numbered from ``event_id``; returns the next id."""
    head, mid, blocks, key, tail, root_mid = template
    with_parent = struct.Struct(f">{len(head)}sQ{len(mid)}sQ{len(blocks)}sQ{len(key)}sQ{len(tail)}s").pack
    root = struct.Struct(f">{len(head)}sQ{len(root_mid)}sQ{len(key)}sQ{len(tail)}s").pack
    live = flags[first:end].translate(_LIVE)
    size = len(out)
    for row in compress(range(first, end), live):
        if flags[row]:
            row_bytes = with_parent(
                head, event_id, mid, parents[row], blocks, hashes[row], key, tokens[row], tail
            )
        else:
            row_bytes = root(head, event_id, root_mid, hashes[row], key, tokens[row], tail)
        out += row_bytes
        size += len(row_bytes)
        ends.append(size)
        event_id += 1
    return event_id


def encode_dump_json(
    out: bytearray,
    ends: array[int],
    template: DumpJsonTemplate,
    hashes: array[int],
    parents: array[int],
    tokens: array[int],
    flags: bytes,
    first: int,
    end: int,
    event_id: int,
) -> int:
    """:func:`encode_dump_msgpack` as JSON text (ASCII); events are separated by a comma (a comma is put
    before each event when ``out`` is not empty), ``ends`` excludes it."""
    p0, p1, p2, p3, p4 = (part.decode() for part in template)
    text = p0 + "%d" + p1 + "%s" + p2 + "%d" + p3 + "%d" + p4
    live = flags[first:end].translate(_LIVE)
    size = len(out)
    pieces: list[bytes] = []
    for row in compress(range(first, end), live):
        parent = parents[row] if flags[row] else "null"
        row_bytes = (text % (event_id, parent, hashes[row], tokens[row])).encode()
        if size:
            pieces.append(b",")
            size += 1
        pieces.append(row_bytes)
        size += len(row_bytes)
        ends.append(size)
        event_id += 1
    out += b"".join(pieces)
    return event_id


# The store's flag column (kvagent.index.store) -> 1 for a live row, 0 for a removed one.
_LIVE = bytes(1 if value in (FLAG_ROOT, FLAG_PARENT) else 0 for value in range(256))


def _load() -> ModuleType:
    """The compiled encoders (kvagent/_native/_columns.pyx) when built, else this module (the tests run
    both by setting :data:`impl`)."""
    return importlib.import_module(__name__) if _native.columns is None else _native.columns


impl = _load()
NATIVE = impl.__name__ != __name__
