"""RouterEvent bytes, both ways: the one module that writes and reads them (docs/spec/agent-semantics.md 8).

Dynamo's named-map msgpack encoding and its JSON twin use the same names and shapes: one builder
(:func:`router_event_to_wire`) produces both, one validator (:func:`router_event_from_wire`) reads both.
:func:`encode_router_events` writes a ``Vec<RouterEvent>`` byte-identical to Dynamo (golden vector 8.3);
:func:`encode_event` writes one event of a recovery frame, its msgpack from per-route byte templates with
fixed-width ``0xcf`` u64 fields (the same map, ten times cheaper); the column encoders
(kvagent/recovery/wire_columns.py) splice the same templates (:data:`EVENT_TEMPLATES`, :func:`route_head`,
:func:`route_tail`).  Decoding takes the common valid shapes on a fast
path; anything else goes through a field-by-field check that names the offending field.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import NamedTuple

import msgpack

from kvagent import _native
from kvagent.model.errors import CodecError, IdentityError
from kvagent.model.events import (
    CLEARED,
    DOMAIN_BY_VALUE,
    TIER_BY_VALUE,
    U32_MAX,
    U64_MAX,
    EventData,
    MmExtraInfo,
    MmObject,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.model.ids import CacheOwnerId

__all__ = [
    "EVENT_TEMPLATES",
    "FIXED_U64",
    "NIL",
    "Encoding",
    "EventTemplates",
    "checked_router_event_from_wire",
    "decode_router_events",
    "encode_event",
    "encode_router_events",
    "mm_extra_info_from_wire",
    "mm_extra_info_to_wire",
    "router_event_from_json",
    "router_event_from_wire",
    "router_event_to_json",
    "router_event_to_wire",
    "route_head",
    "route_tail",
    "state_source_from_wire",
    "state_source_to_wire",
]


class Encoding(enum.Enum):
    """A recovery frame's encoding: JSON in text frames, msgpack in binary frames."""

    JSON = "json"
    MSGPACK = "msgpack"


# --- state_source: the one place that fixes its wire form -------------------------------------------


def state_source_to_wire(owner: CacheOwnerId) -> str:
    """kvagent defines: a CacheOwnerId travels as its canonical text ``<32hex>:<32hex>/<16hex>/<32hex>``."""
    return str(owner)


def state_source_from_wire(value: object, field: str = "state_source") -> CacheOwnerId:
    if not isinstance(value, str):
        raise CodecError(f"{field} must be a CacheOwnerId string, got {type(value).__name__}")
    try:
        return CacheOwnerId.parse(value)
    except IdentityError as exc:
        raise CodecError(f"{field}: {exc}") from None


# --- the map form (msgpack and JSON) ----------------------------------------------------------------


def mm_extra_info_to_wire(info: MmExtraInfo | None) -> dict[str, object] | None:
    if info is None:
        return None
    return {
        "mm_objects": [
            {"mm_hash": obj.mm_hash, "offsets": [[start, end] for start, end in obj.offsets]}
            for obj in info.mm_objects
        ]
    }


def _data_to_wire(data: EventData) -> object:
    if isinstance(data, Stored):
        infos = data.mm_extra_infos
        if infos is None:
            blocks: list[dict[str, object]] = [
                {"block_hash": block_hash, "tokens_hash": tokens_hash, "mm_extra_info": None}
                for block_hash, tokens_hash in zip(data.block_hashes, data.tokens_hashes, strict=True)
            ]
        else:
            blocks = [
                {
                    "block_hash": block_hash,
                    "tokens_hash": tokens_hash,
                    "mm_extra_info": mm_extra_info_to_wire(info),
                }
                for block_hash, tokens_hash, info in zip(
                    data.block_hashes, data.tokens_hashes, infos, strict=True
                )
            ]
        return {
            "stored": {
                "parent_hash": data.parent_hash,
                "start_position": data.start_position,
                "blocks": blocks,
            }
        }
    if isinstance(data, Removed):
        return {"removed": {"block_hashes": list(data.block_hashes)}}
    return "cleared"


def router_event_to_wire(event: RouterEvent) -> dict[str, object]:
    """The 8.2 named map; ``state_source`` and ``session_id`` are omitted when None."""
    wire: dict[str, object] = {
        "worker_id": event.worker_id,
        "storage_tier": event.storage_tier.value,
        "residency_domain": event.residency_domain.value,
        "event": {
            "event_id": event.event_id,
            "data": _data_to_wire(event.data),
            "dp_rank": event.dp_rank,
        },
    }
    if event.state_source is not None:
        wire["state_source"] = state_source_to_wire(event.state_source)
    if event.session_id is not None:
        wire["session_id"] = event.session_id
    return wire


# JSON-safe as it is: the wire names, integers stay integers (u64 hashes are exact in Python JSON).
router_event_to_json = router_event_to_wire


def encode_router_events(events: Sequence[RouterEvent]) -> bytes:
    """A msgpack array of named maps, byte-identical to Dynamo's encoding (golden vector 8.3).

    The native core (kvagent/_native) writes the bytes itself when every event is of the plain shape (no
    multimodal info); anything else, or without it, :func:`encode_router_events_python`, which defines them.
    """
    native = _native.core
    if native is not None:
        payload = native.encode_router_events(events)
        if payload is not None:
            return payload
    return encode_router_events_python(events)


def encode_router_events_python(events: Sequence[RouterEvent]) -> bytes:
    """:func:`encode_router_events` through ``router_event_to_wire`` and msgpack-python."""
    try:
        payload: bytes = msgpack.packb([router_event_to_wire(event) for event in events], use_bin_type=True)
        return payload
    except (OverflowError, TypeError, ValueError) as exc:
        raise CodecError(f"router event cannot be encoded: {exc}") from exc


def _reference_encode(encoding: Encoding, event: RouterEvent) -> str | bytes:
    wire = router_event_to_wire(event)
    if encoding is Encoding.JSON:
        return json.dumps(wire, separators=(",", ":"))
    return msgpack.packb(wire, use_bin_type=True)  # type: ignore[no-any-return]


# --- byte templates ---------------------------------------------------------------------------------

_packer = msgpack.Packer(use_bin_type=True)
_pack: Callable[[object], bytes] = _packer.pack
_U64 = struct.Struct(">BQ")
FIXED_U64 = b"\xcf"  # the marker of a fixed-width u64: the template's number follows as 8 big-endian bytes
NIL = _pack(None)
_BLOCK_HEAD = _packer.pack_map_header(3) + _pack("block_hash") + FIXED_U64
_BLOCK_MID = _pack("tokens_hash") + FIXED_U64
_BLOCK_TAIL = _pack("mm_extra_info") + NIL
_BLOCK = struct.Struct(f">{len(_BLOCK_HEAD)}sQ{len(_BLOCK_MID)}sQ{len(_BLOCK_TAIL)}s")


def _data_head(variant: str, fields: int, first_field: str) -> bytes:
    """``"data": {variant: {`` a map of ``fields`` entries, up to the value of its first one."""
    variant_map: bytes = _packer.pack_map_header(1) + _pack(variant) + _packer.pack_map_header(fields)
    return _pack("data") + variant_map + _pack(first_field)


_STORED_HEAD = _data_head("stored", 3, "parent_hash")
_START_POSITION = _pack("start_position")
_BLOCKS = _pack("blocks")
_REMOVED_HEAD = _data_head("removed", 1, "block_hashes")
_CLEARED = _pack("data") + _pack("cleared")


class EventTemplates(NamedTuple):
    """The fixed bytes of an event's data, as :func:`encode_event` writes them (the column encoders' too)."""

    stored_head: bytes  # "data": {"stored": {"parent_hash":
    stored_blocks: bytes  # "start_position": nil, "blocks":
    block_head: bytes  # {"block_hash": 0xcf
    block_mid: bytes  # "tokens_hash": 0xcf
    block_tail: bytes  # "mm_extra_info": nil}
    removed_head: bytes  # "data": {"removed": {"block_hashes":
    cleared: bytes  # "data": "cleared"


EVENT_TEMPLATES = EventTemplates(
    _STORED_HEAD, _START_POSITION + NIL + _BLOCKS, _BLOCK_HEAD, _BLOCK_MID, _BLOCK_TAIL, _REMOVED_HEAD, _CLEARED
)


def route_head(worker_id: int, tier: StorageTier, domain: ResidencyDomain, optional_fields: int) -> bytes:
    """A wire event's msgpack bytes up to its event id, ending in the marker of a fixed-width u64."""
    route = [("worker_id", worker_id), ("storage_tier", tier.value), ("residency_domain", domain.value)]
    fields = [_pack(name) + _pack(value) for name, value in route]
    event = _pack("event") + _packer.pack_map_header(3) + _pack("event_id") + FIXED_U64
    return b"".join([_packer.pack_map_header(4 + optional_fields), *fields, event])


def route_tail(dp_rank: int, source: CacheOwnerId | None, session_id: str | None) -> bytes:
    """A wire event's msgpack bytes after its data: the rank and the optional top-level fields."""
    tail = _pack("dp_rank") + _pack(dp_rank)
    if source is not None:
        tail += _pack("state_source") + _pack(state_source_to_wire(source))
    if session_id is not None:
        tail += _pack("session_id") + _pack(session_id)
    return tail


# (worker_id, tier, domain, dp_rank, state_source, session_id) -> (head, tail) of the route's events
_ROUTES: dict[tuple[object, ...], tuple[bytes, bytes]] = {}
_ROUTES_MAX = 4096


def _route_bytes(event: RouterEvent) -> tuple[bytes, bytes]:
    source, session_id = event.state_source, event.session_id
    key = (event.worker_id, event.storage_tier, event.residency_domain, event.dp_rank, source, session_id)
    found = _ROUTES.get(key)
    if found is None:
        optional = (source is not None) + (session_id is not None)
        head = route_head(event.worker_id, event.storage_tier, event.residency_domain, optional)
        if len(_ROUTES) >= _ROUTES_MAX:
            _ROUTES.clear()  # routes are a handful per slot; this only bounds odd inputs
        found = _ROUTES[key] = (head, route_tail(event.dp_rank, source, session_id))
    return found


def _data_bytes(data: EventData) -> bytes:
    if type(data) is Stored:
        hashes, tokens = data.block_hashes, data.tokens_hashes
        if len(tokens) != len(hashes):
            raise ValueError("stored event has columns of different lengths")
        parent = NIL if data.parent_hash is None else _U64.pack(0xCF, data.parent_hash)
        rows = (repeat(_BLOCK_HEAD), hashes, repeat(_BLOCK_MID), tokens, repeat(_BLOCK_TAIL))
        blocks = map(_BLOCK.pack, *rows)
        head = [_STORED_HEAD, parent, _START_POSITION, _pack(data.start_position), _BLOCKS]
        return b"".join([*head, _packer.pack_array_header(len(hashes)), *blocks])
    if type(data) is Removed:
        hashes = data.block_hashes
        ids = map(_U64.pack, repeat(0xCF), hashes)
        return b"".join([_REMOVED_HEAD, _packer.pack_array_header(len(hashes)), *ids])
    return _CLEARED


def encode_event(encoding: Encoding, event: RouterEvent) -> str | bytes:
    """One event in a frame's encoding, ready to be spliced into an ``events`` list.

    JSON is ``json.dumps(router_event_to_wire(event))`` without spaces.  msgpack decodes to exactly
    ``router_event_to_wire(event)``: from templates, except for multimodal info and out-of-range values,
    which take the reference path (that reports them).
    """
    data = event.data
    with_info = type(data) is Stored and data.mm_extra_infos is not None
    if encoding is not Encoding.MSGPACK or with_info:
        return _reference_encode(encoding, event)
    try:
        head, tail = _route_bytes(event)
        return b"".join([head, event.event_id.to_bytes(8, "big"), _data_bytes(data), tail])
    except (struct.error, OverflowError, TypeError, ValueError):
        return _reference_encode(encoding, event)


# --- decoding ---------------------------------------------------------------------------------------


def _uint(value: object, field: str, maximum: int = U64_MAX) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CodecError(f"{field} must be an unsigned integer, got {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise CodecError(f"{field} must be between 0 and {maximum}, got {value}")
    return value


def _optional_uint(value: object, field: str, maximum: int = U64_MAX) -> int | None:
    return None if value is None else _uint(value, field, maximum)


def _map(value: object, field: str) -> dict[object, object]:
    if not isinstance(value, dict):
        raise CodecError(f"{field} must be a map, got {type(value).__name__}")
    return value


def _list(value: object, field: str) -> list[object]:
    if not isinstance(value, list | tuple):
        raise CodecError(f"{field} must be an array, got {type(value).__name__}")
    return list(value)


_ABSENT = object()


def _required(obj: dict[object, object], key: str, field: str) -> object:
    value = obj.get(key, _ABSENT)
    if value is _ABSENT:
        raise CodecError(f"{field}.{key} is missing")
    return value


def mm_extra_info_from_wire(value: object, field: str = "mm_extra_info") -> MmExtraInfo | None:
    """Validate one ``mm_extra_info`` value (nil or a map) from either encoding."""
    if value is None:
        return None
    info = _map(value, field)
    objects: list[MmObject] = []
    for index, raw_object in enumerate(_list(_required(info, "mm_objects", field), f"{field}.mm_objects")):
        obj_field = f"{field}.mm_objects[{index}]"
        obj = _map(raw_object, obj_field)
        mm_hash = _uint(_required(obj, "mm_hash", obj_field), f"{obj_field}.mm_hash")
        offsets: list[tuple[int, int]] = []
        for offset_index, raw_offset in enumerate(
            _list(_required(obj, "offsets", obj_field), f"{obj_field}.offsets")
        ):
            offset_field = f"{obj_field}.offsets[{offset_index}]"
            pair = _list(raw_offset, offset_field)
            if len(pair) != 2:
                raise CodecError(f"{offset_field} must be [start, end], got {len(pair)} elements")
            offsets.append((_uint(pair[0], offset_field), _uint(pair[1], offset_field)))
        objects.append(MmObject(mm_hash, tuple(offsets)))
    return MmExtraInfo(tuple(objects))


def _stored_from_wire(value: object, field: str) -> Stored:
    stored = _map(value, field)
    parent_hash = _optional_uint(stored.get("parent_hash"), f"{field}.parent_hash")
    start_position = _optional_uint(stored.get("start_position"), f"{field}.start_position", U32_MAX)
    block_hashes: list[int] = []
    tokens_hashes: list[int] = []
    infos: list[MmExtraInfo | None] = []
    for index, raw_block in enumerate(_list(_required(stored, "blocks", field), f"{field}.blocks")):
        block_field = f"{field}.blocks[{index}]"
        block = _map(raw_block, block_field)
        block_hashes.append(_uint(_required(block, "block_hash", block_field), f"{block_field}.block_hash"))
        tokens_hashes.append(
            _uint(_required(block, "tokens_hash", block_field), f"{block_field}.tokens_hash")
        )
        infos.append(mm_extra_info_from_wire(block.get("mm_extra_info"), f"{block_field}.mm_extra_info"))
    mm_extra_infos = tuple(infos) if any(info is not None for info in infos) else None
    return Stored(parent_hash, tuple(block_hashes), tuple(tokens_hashes), mm_extra_infos, start_position)


def _data_from_wire(value: object, field: str) -> EventData:
    if value == "cleared":
        return CLEARED
    if isinstance(value, str):
        raise CodecError(f"{field} must be 'cleared' or a stored/removed map, got {value!r}")
    data = _map(value, field)
    if len(data) != 1:
        raise CodecError(f"{field} must have exactly one variant key, got {sorted(map(str, data))}")
    ((variant, body),) = data.items()
    if variant == "stored":
        return _stored_from_wire(body, f"{field}.stored")
    if variant == "removed":
        removed = _map(body, f"{field}.removed")
        hashes_field = f"{field}.removed.block_hashes"
        hashes = _list(_required(removed, "block_hashes", f"{field}.removed"), hashes_field)
        return Removed(tuple(_uint(h, f"{hashes_field}[{i}]") for i, h in enumerate(hashes)))
    if variant == "cleared":
        return CLEARED
    raise CodecError(f"{field} has unknown variant {variant!r}")


# Parsed state_source strings: an agent's events all carry the same few owners.
_SOURCES: dict[str, CacheOwnerId] = {}
_SOURCES_MAX = 1024


def _fast_blocks(blocks: object) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if type(blocks) is not list:
        return None
    hashes: list[int] = []
    tokens: list[int] = []
    for block in blocks:
        if type(block) is not dict or block.get("mm_extra_info") is not None:
            return None
        block_hash, tokens_hash = block.get("block_hash"), block.get("tokens_hash")
        if type(block_hash) is not int or type(tokens_hash) is not int:
            return None
        if not (0 <= block_hash <= U64_MAX and 0 <= tokens_hash <= U64_MAX):
            return None
        hashes.append(block_hash)
        tokens.append(tokens_hash)
    return tuple(hashes), tuple(tokens)


def _fast_data(data: object) -> EventData | None:
    if data == "cleared":
        return CLEARED
    if type(data) is not dict or len(data) != 1:
        return None
    stored = data.get("stored")
    if type(stored) is dict:
        parent, start = stored.get("parent_hash"), stored.get("start_position")
        if parent is not None and not (type(parent) is int and 0 <= parent <= U64_MAX):
            return None
        if start is not None and not (type(start) is int and 0 <= start <= U32_MAX):
            return None
        columns = _fast_blocks(stored.get("blocks"))
        return None if columns is None else Stored(parent, columns[0], columns[1], None, start)
    removed = data.get("removed")
    if type(removed) is dict:
        hashes = removed.get("block_hashes")
        if type(hashes) is not list or not all(type(h) is int and 0 <= h <= U64_MAX for h in hashes):
            return None
        return Removed(tuple(hashes))
    return None


def _fast_event(obj: dict[object, object]) -> RouterEvent | None:
    """The common, valid shapes without building error texts; None sends the value down the checked path.

    Anything unusual (mm info, lists as tuples, a bad value anywhere) returns None, and the checked path
    then produces the same result or the precise error.
    """
    worker_id, tier, domain = obj.get("worker_id"), obj.get("storage_tier", "device"), obj.get(
        "residency_domain", "worker"
    )
    if type(worker_id) is not int or not 0 <= worker_id <= U64_MAX or type(tier) is not str:
        return None
    if type(domain) is not str:
        return None
    storage_tier, residency_domain = TIER_BY_VALUE.get(tier), DOMAIN_BY_VALUE.get(domain)
    inner = obj.get("event")
    if storage_tier is None or residency_domain is None or type(inner) is not dict:
        return None
    event_id, dp_rank = inner.get("event_id"), inner.get("dp_rank", 0)
    if type(event_id) is not int or not 0 <= event_id <= U64_MAX:
        return None
    if type(dp_rank) is not int or not 0 <= dp_rank <= U32_MAX:
        return None
    data = _fast_data(inner.get("data"))
    raw_source, session_id = obj.get("state_source"), obj.get("session_id")
    if data is None or (session_id is not None and type(session_id) is not str):
        return None
    source = None
    if raw_source is not None:
        if type(raw_source) is not str:
            return None
        source = _SOURCES.get(raw_source)
        if source is None:
            try:
                source = CacheOwnerId.parse(raw_source)
            except IdentityError:
                return None
            if len(_SOURCES) >= _SOURCES_MAX:
                _SOURCES.clear()
            _SOURCES[raw_source] = source
    return RouterEvent(worker_id, storage_tier, residency_domain, event_id, data, dp_rank, source, session_id)


def router_event_from_wire(value: object, field: str = "event") -> RouterEvent:
    """Validate one named map (msgpack-decoded or JSON-parsed) into a RouterEvent."""
    if type(value) is dict:
        event = _fast_event(value)
        if event is not None:
            return event
    return checked_router_event_from_wire(value, field)


def checked_router_event_from_wire(value: object, field: str = "event") -> RouterEvent:
    """:func:`router_event_from_wire` field by field, naming the offending field in its errors."""
    obj = _map(value, field)
    worker_id = _uint(_required(obj, "worker_id", field), f"{field}.worker_id")

    raw_tier = obj.get("storage_tier", StorageTier.DEVICE.value)
    tier = TIER_BY_VALUE.get(raw_tier) if isinstance(raw_tier, str) else None
    if tier is None:
        raise CodecError(f"{field}.storage_tier is unknown: {raw_tier!r}")

    # Absent means a legacy Worker event; an explicit null or an unknown name is an error.
    raw_domain = obj.get("residency_domain", ResidencyDomain.WORKER.value)
    domain = DOMAIN_BY_VALUE.get(raw_domain) if isinstance(raw_domain, str) else None
    if domain is None:
        raise CodecError(f"{field}.residency_domain must be 'worker' or 'cache_owner', got {raw_domain!r}")

    inner_field = f"{field}.event"
    inner = _map(_required(obj, "event", field), inner_field)
    event_id = _uint(_required(inner, "event_id", inner_field), f"{inner_field}.event_id")
    data = _data_from_wire(_required(inner, "data", inner_field), f"{inner_field}.data")
    dp_rank = _uint(inner.get("dp_rank", 0), f"{inner_field}.dp_rank", U32_MAX)

    raw_source = obj.get("state_source")
    state_source = None if raw_source is None else state_source_from_wire(raw_source, f"{field}.state_source")
    session_id = obj.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise CodecError(f"{field}.session_id must be a string, got {type(session_id).__name__}")
    return RouterEvent(worker_id, tier, domain, event_id, data, dp_rank, state_source, session_id)


def decode_router_events(payload: bytes) -> list[RouterEvent]:
    """Decode a msgpack array of RouterEvent maps, accepting legacy payloads (8.2)."""
    try:
        decoded = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise CodecError(f"payload is not valid msgpack: {exc}") from None
    return [
        router_event_from_wire(value, f"events[{index}]")
        for index, value in enumerate(_list(decoded, "events"))
    ]


# JSON parses into the same maps.
router_event_from_json = router_event_from_wire
