"""Outbound events in the state database (sans-IO): one compact row per appended batch, and the wire map.

Suffix events are stored one row per appended batch, in a compact msgpack form of their own (routes once
per batch, hashes as msgpack ints, the Stored tokens inline): the RouterEvent wire map spells every field
name of every event and costs about five times as much to write, and appends share the interpreter with
ingest. The wire map (:mod:`kvagent.wire.router_event`) still serves the rare snapshot event that is not a
one-block Stored (see :mod:`kvagent.persist.columns`).

Every decoder raises :class:`~kvagent.model.errors.CodecError` on bytes it cannot read; the store turns that
into a refused state file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from kvagent.model.errors import CodecError, IdentityError
from kvagent.model.events import (
    CLEARED,
    DOMAIN_BY_VALUE,
    TIER_BY_VALUE,
    U64_MAX,
    EventData,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.model.ids import CacheOwnerId
from kvagent.wire.router_event import (
    Encoding,
    encode_event,
    mm_extra_info_from_wire,
    mm_extra_info_to_wire,
    router_event_from_wire,
)

__all__ = [
    "BATCH_CLEARED",
    "BATCH_REMOVED",
    "BATCH_STORED",
    "Route",
    "decode_batch",
    "decode_event_row",
    "encode_batch",
    "encode_event_row",
    "pack",
    "route_fields",
    "route_row",
    "unpack",
]

Route = tuple[int, StorageTier, ResidencyDomain, int, CacheOwnerId | None, str | None]
"""(worker_id, tier, domain, dp_rank, state_source, session_id): what a run or a batch's events share."""

def unpack(body: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise CodecError(f"{what} is not valid msgpack: {exc}") from None


def pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def route_fields(
    route: object,
) -> tuple[int, StorageTier, ResidencyDomain, int, CacheOwnerId | None, str | None]:
    if not isinstance(route, list) or len(route) != 6:
        raise CodecError("snapshot run route must have 6 fields")
    worker_id, tier_name, domain_name, dp_rank, source, session_id = route
    tier, domain = TIER_BY_VALUE.get(tier_name), DOMAIN_BY_VALUE.get(domain_name)
    if tier is None or domain is None:
        raise CodecError(f"snapshot run has an unknown tier or domain: {tier_name!r}, {domain_name!r}")
    for value, what in ((worker_id, "worker_id"), (dp_rank, "dp_rank")):
        if type(value) is not int or not 0 <= value <= U64_MAX:
            raise CodecError(f"snapshot run {what} must be a u64")
    if session_id is not None and type(session_id) is not str:
        raise CodecError("snapshot run session_id must be a string")
    if source is not None and type(source) is not str:
        raise CodecError("snapshot run state_source must be a string")
    try:
        owner = None if source is None else CacheOwnerId.parse(source)
    except IdentityError as exc:
        raise CodecError(f"snapshot run state_source: {exc}") from None
    return worker_id, tier, domain, dp_rank, owner, session_id


# --- suffix events: one row per appended batch ---------------------------------------------------------

_STORED, _REMOVED, _CLEARED = 0, 1, 2
BATCH_STORED, BATCH_REMOVED, BATCH_CLEARED = _STORED, _REMOVED, _CLEARED  # columns.encode_ring_batch writes them too


def encode_batch(events: Sequence[RouterEvent], *, tokens: bool = True) -> bytes:
    """One appended batch as ``[routes, events]``: each distinct route (worker, tier, domain, rank, source,
    session) once, each event as ``[id, route index, kind, ...data]`` with its hashes as msgpack ints.

    A persist-only form, about five times cheaper to write than the wire map (which spells every field name
    of every event): appends run beside ingest, under the same interpreter lock. ``tokens`` False leaves the
    Stored tokens out (only the republish mirror needs them; they are most of a store's bytes).
    """
    routes: dict[tuple[object, ...], int] = {}
    route_rows: list[list[object]] = []
    rows: list[list[object]] = []
    for event in events:
        source, session = event.state_source, event.session_id
        key = (event.worker_id, event.storage_tier, event.residency_domain, event.dp_rank, source, session)
        index = routes.get(key)
        if index is None:
            index = routes[key] = len(route_rows)
            route_rows.append([*route_row(event)])
        data = event.data
        if type(data) is Stored:
            infos = data.mm_extra_infos
            wire_infos = None if infos is None else [mm_extra_info_to_wire(info) for info in infos]
            rows.append(
                [
                    event.event_id,
                    index,
                    _STORED,
                    data.parent_hash,
                    data.block_hashes,
                    data.tokens_hashes,
                    data.token_bytes if tokens else None,
                    data.start_position,
                    wire_infos,
                ]
            )
        elif type(data) is Removed:
            rows.append([event.event_id, index, _REMOVED, data.block_hashes])
        else:
            rows.append([event.event_id, index, _CLEARED])
    return pack([route_rows, rows])


def route_row(event: RouterEvent) -> tuple[object, ...]:
    source = None if event.state_source is None else str(event.state_source)
    domain = event.residency_domain.value
    return (event.worker_id, event.storage_tier.value, domain, event.dp_rank, source, event.session_id)


def _u64_tuple(values: Any) -> tuple[int, ...]:
    hashes: tuple[int, ...] = tuple(values)  # a TypeError for a non-sequence is the caller's to catch
    if hashes and not (min(hashes) >= 0 and max(hashes) <= U64_MAX):
        raise CodecError("hashes must be u64 values")
    return hashes


def _batch_data(row: list[Any]) -> EventData:
    kind = row[2]
    if kind == _STORED and len(row) == 9:
        _, _, _, parent, hashes, tokens_hashes, token_bytes, start, infos = row
        mm = None if infos is None else tuple(mm_extra_info_from_wire(info) for info in infos)
        if token_bytes is not None and type(token_bytes) is not bytes:
            raise CodecError("token bytes must be bytes")
        if parent is not None and not 0 <= parent <= U64_MAX:
            raise CodecError("parent hash must be a u64")
        return Stored(parent, _u64_tuple(hashes), _u64_tuple(tokens_hashes), mm, start, token_bytes)
    if kind == _REMOVED and len(row) == 4:
        return Removed(_u64_tuple(row[3]))
    if kind == _CLEARED and len(row) == 3:
        return CLEARED
    raise CodecError(f"unknown event kind {kind!r}")


def decode_batch(body: bytes) -> list[RouterEvent]:
    """The events of one :func:`encode_batch` row; CodecError if it is not one."""
    value = unpack(body, "event batch")
    try:
        route_rows, rows = value
        routes = [route_fields(route) for route in route_rows]
        events = []
        for row in rows:
            event_id = row[0]
            if type(event_id) is not int or not 0 <= event_id <= U64_MAX:
                raise CodecError("event id must be a u64")
            worker_id, tier, domain, dp_rank, source, session = routes[row[1]]
            data = _batch_data(row)
            events.append(RouterEvent(worker_id, tier, domain, event_id, data, dp_rank, source, session))
    except (TypeError, ValueError, IndexError, KeyError) as exc:  # CodecError is a ValueError
        raise CodecError(f"event batch does not decode: {exc}") from None
    return events


# --- odd events in a snapshot: the wire map -------------------------------------------------------------


def encode_event_row(event: RouterEvent) -> tuple[int, bytes, bytes | None]:
    """(event id, the wire map's msgpack bytes, the Stored tokens or None)."""
    body = encode_event(Encoding.MSGPACK, event)
    assert isinstance(body, bytes)  # msgpack encoding is bytes by construction
    data = event.data
    tokens = data.token_bytes if type(data) is Stored else None
    return event.event_id, body, tokens


def decode_event_row(body: bytes, tokens: bytes | None) -> RouterEvent:
    event = router_event_from_wire(unpack(body, "event row"), "event row")
    if tokens is None:
        return event
    data = event.data
    if type(data) is not Stored:
        raise CodecError(f"event {event.event_id} carries tokens but is not a Stored event")
    # Built directly: attrs.evolve costs several times a constructor call, and loads decode millions.
    with_tokens = Stored(
        data.parent_hash,
        data.block_hashes,
        data.tokens_hashes,
        data.mm_extra_infos,
        data.start_position,
        tokens,
    )
    return RouterEvent(
        event.worker_id,
        event.storage_tier,
        event.residency_domain,
        event.event_id,
        with_tokens,
        event.dp_rank,
        event.state_source,
        event.session_id,
    )
