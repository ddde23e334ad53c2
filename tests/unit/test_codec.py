"""RouterEvent codec: the 464-byte golden vector (docs/spec/agent-semantics.md 8.3), legacy defaults, rejections, JSON."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.model.errors import CodecError
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
from kvagent.wire.router_event import (
    checked_router_event_from_wire,
    decode_router_events,
    encode_router_events,
    router_event_from_json,
    router_event_from_wire,
    router_event_to_json,
    router_event_to_wire,
)
from tests.support.ids import OWNER, OWNER_TEXT

GOLDEN_HEX = (
    "9384a9776f726b65725f696407ac73746f726167655f74696572a6646576696365b07265736964656e63795f646f6d61696e"
    "a6776f726b6572a56576656e7483a86576656e745f696401a46461746181a673746f72656483ab706172656e745f68617368"
    "cd0100ae73746172745f706f736974696f6e10a6626c6f636b739283aa626c6f636b5f68617368cf0123456789abcdefab74"
    "6f6b656e735f6861736811ad6d6d5f65787472615f696e666fc083aa626c6f636b5f686173680cab746f6b656e735f686173"
    "6816ad6d6d5f65787472615f696e666fc0a764705f72616e6b0084a9776f726b65725f696407ac73746f726167655f746965"
    "72ab686f73745f70696e6e6564b07265736964656e63795f646f6d61696ea6776f726b6572a56576656e7483a86576656e74"
    "5f696402a46461746181a772656d6f76656481ac626c6f636b5f6861736865739201cf0123456789abcdefa764705f72616e"
    "6b0185a9776f726b65725f696407ac73746f726167655f74696572a6646576696365b07265736964656e63795f646f6d6169"
    "6ea6776f726b6572a56576656e7483a86576656e745f696403a464617461a7636c6561726564a764705f72616e6b00aa7365"
    "7373696f6e5f6964a5732d303031"
)
GOLDEN = bytes.fromhex(GOLDEN_HEX)

W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER

GOLDEN_EVENTS = [
    RouterEvent(7, StorageTier.DEVICE, W, 1, Stored(256, (0x0123456789ABCDEF, 12), (17, 22), None, 16), 0),
    RouterEvent(7, StorageTier.HOST_PINNED, W, 2, Removed((1, 0x0123456789ABCDEF)), 1),
    RouterEvent(7, StorageTier.DEVICE, W, 3, CLEARED, 0, None, "s-001"),
]


def test_golden_vector_is_byte_identical() -> None:
    assert len(GOLDEN) == 464
    assert encode_router_events(GOLDEN_EVENTS) == GOLDEN


def test_golden_vector_decodes_to_the_same_events() -> None:
    assert decode_router_events(GOLDEN) == GOLDEN_EVENTS


def test_wire_map_field_order_and_omissions() -> None:
    wire = router_event_to_wire(GOLDEN_EVENTS[0])
    assert list(wire) == ["worker_id", "storage_tier", "residency_domain", "event"]
    assert list(wire["event"]) == ["event_id", "data", "dp_rank"]  # type: ignore[call-overload]
    cache_owner = RouterEvent(9, StorageTier.DISK, C, 4, Removed((5,)), 3, OWNER, "sess")
    wire = router_event_to_wire(cache_owner)
    assert list(wire) == [
        "worker_id",
        "storage_tier",
        "residency_domain",
        "event",
        "state_source",
        "session_id",
    ]
    assert wire["state_source"] == OWNER_TEXT  # canonical text form


def test_mm_extra_info_is_always_written_and_round_trips() -> None:
    info = MmExtraInfo((MmObject(2**64 - 1, ((0, 4), (8, 12))), MmObject(3, ())))
    event = RouterEvent(1, StorageTier.DEVICE, W, 5, Stored(None, (1, 2), (3, 4), (None, info), None), 0)
    wire = router_event_to_wire(event)
    blocks = wire["event"]["data"]["stored"]["blocks"]  # type: ignore[index]
    assert blocks[0]["mm_extra_info"] is None
    assert blocks[1]["mm_extra_info"] == {
        "mm_objects": [{"mm_hash": 2**64 - 1, "offsets": [[0, 4], [8, 12]]}, {"mm_hash": 3, "offsets": []}]
    }
    assert decode_router_events(encode_router_events([event])) == [event]


def _legacy_map(**overrides: object) -> dict[str, object]:
    wire = router_event_to_wire(RouterEvent(7, StorageTier.DEVICE, W, 1, Removed((1,)), 0))
    wire.update(overrides)
    return wire


def test_legacy_payload_defaults() -> None:
    legacy = {"worker_id": 7, "event": {"event_id": 9, "data": {"removed": {"block_hashes": [4]}}}}
    [event] = decode_router_events(msgpack.packb([legacy]))
    assert event == RouterEvent(7, StorageTier.DEVICE, W, 9, Removed((4,)), 0)
    assert event.state_source is None and event.session_id is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"residency_domain": None}, "residency_domain"),
        ({"residency_domain": "router"}, "residency_domain"),
        ({"residency_domain": 1}, "residency_domain"),
        ({"state_source": "owner"}, "state_source"),
        ({"state_source": 5}, "state_source"),
        ({"storage_tier": "gpu"}, "storage_tier"),
        ({"storage_tier": None}, "storage_tier"),
        ({"event": {"event_id": 1, "data": "cleared", "dp_rank": 2**32}}, "dp_rank"),
        ({"event": {"event_id": 1, "data": "cleared", "dp_rank": -1}}, "dp_rank"),
        ({"event": {"event_id": -1, "data": "cleared"}}, "event_id"),
        ({"event": {"event_id": True, "data": "cleared"}}, "event_id"),
        ({"event": {"data": "cleared"}}, "event_id"),
        ({"event": {"event_id": 1, "data": "wiped"}}, "data"),
        ({"event": {"event_id": 1, "data": {"stored": {"blocks": [{"block_hash": 1}]}}}}, "tokens_hash"),
        ({"worker_id": "7"}, "worker_id"),
        ({"session_id": 3}, "session_id"),
    ],
)
def test_rejections_name_the_field(overrides: dict[str, object], field: str) -> None:
    payload = msgpack.packb([_legacy_map(**overrides)])
    with pytest.raises(CodecError, match=field):
        decode_router_events(payload)


def test_dp_rank_at_u32_max_is_accepted() -> None:
    payload = msgpack.packb([_legacy_map(event={"event_id": 1, "data": "cleared", "dp_rank": 2**32 - 1})])
    assert decode_router_events(payload)[0].dp_rank == 2**32 - 1


def test_malformed_payloads_raise_codec_error() -> None:
    for payload in (b"\xc1", b"", msgpack.packb({"worker_id": 1}), msgpack.packb([1])):
        with pytest.raises(CodecError):
            decode_router_events(payload)


u64 = st.integers(0, 2**64 - 1)
mm_info = st.builds(
    MmExtraInfo,
    st.lists(
        st.builds(MmObject, u64, st.lists(st.tuples(u64, u64), max_size=2).map(tuple)), min_size=1, max_size=2
    ).map(tuple),
)


@st.composite
def router_events(draw: st.DrawFn) -> RouterEvent:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "stored":
        hashes = tuple(draw(st.lists(u64, min_size=1, max_size=4)))
        infos = draw(st.none() | st.lists(st.none() | mm_info, min_size=len(hashes), max_size=len(hashes)))
        if infos is not None and all(info is None for info in infos):
            infos = None  # the decoder normalizes an all-None list to None
        data: Stored | Removed = Stored(
            draw(st.none() | u64),
            hashes,
            tuple(draw(st.lists(u64, min_size=len(hashes), max_size=len(hashes)))),
            None if infos is None else tuple(infos),
            draw(st.none() | st.integers(0, 2**32 - 1)),
        )
    elif kind == "removed":
        data = Removed(tuple(draw(st.lists(u64, max_size=4))))
    domain = draw(st.sampled_from([W, C]))
    return RouterEvent(
        draw(u64),
        draw(st.sampled_from(list(StorageTier))),
        domain,
        draw(u64),
        CLEARED if kind == "cleared" else data,
        draw(st.integers(0, 2**32 - 1)),
        draw(st.none() | st.just(OWNER)),
        draw(st.none() | st.text(max_size=8)),
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(router_events(), max_size=5))
def test_msgpack_and_json_round_trip(events: list[RouterEvent]) -> None:
    assert decode_router_events(encode_router_events(events)) == events
    for event in events:
        text = json.dumps(router_event_to_json(event))
        assert router_event_from_json(json.loads(text)) == event


def test_json_form_shapes() -> None:
    assert router_event_to_json(GOLDEN_EVENTS[2])["event"] == {"event_id": 3, "data": "cleared", "dp_rank": 0}
    removed = router_event_to_json(GOLDEN_EVENTS[1])
    assert removed["event"]["data"] == {"removed": {"block_hashes": [1, 0x0123456789ABCDEF]}}  # type: ignore[index]
    with pytest.raises(CodecError, match="storage_tier"):
        router_event_from_json({**removed, "storage_tier": "tape"})
    with pytest.raises(CodecError):
        router_event_from_json([removed])


# The fast decode path must agree with the checked one on everything: valid events, and every value
# swapped for an odd one (wrong type, out of range, missing), where both must raise the same error.
_ODD_VALUES: list[object] = [None, True, -1, 2**64, 2**32, "x", 1.5, [], {}, [1], {"stored": {}}, "cleared"]


def _paths(wire: object) -> list[tuple[object, ...]]:
    paths: list[tuple[object, ...]] = []
    if isinstance(wire, dict):
        for key, value in wire.items():
            paths.append((key,))
            paths.extend((key, *rest) for rest in _paths(value))
    elif isinstance(wire, list):
        for index, value in enumerate(wire):
            paths.append((index,))
            paths.extend((index, *rest) for rest in _paths(value))
    return paths


def _replaced(wire: Any, path: tuple[object, ...], value: object) -> Any:
    copy = json.loads(json.dumps(wire))
    target = copy
    for step in path[:-1]:
        target = target[step]
    if value is _MISSING:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return copy


_MISSING = object()


def _outcome(decode: Any, wire: object) -> object:
    try:
        return decode(wire)
    except CodecError as exc:
        return ("error", str(exc))


@settings(max_examples=150, deadline=None)
@given(router_events(), st.data())
def test_fast_decode_agrees_with_the_checked_decoder(event: RouterEvent, data: st.DataObject) -> None:
    wire = json.loads(json.dumps(router_event_to_wire(event)))
    assert router_event_from_wire(wire) == checked_router_event_from_wire(wire) == event
    paths = _paths(wire)
    path = data.draw(st.sampled_from(paths))
    odd = data.draw(st.sampled_from([*_ODD_VALUES, _MISSING]))
    if odd is _MISSING and isinstance(path[-1], int):
        return  # list elements are not removable keys
    broken = _replaced(wire, path, odd)
    assert _outcome(router_event_from_wire, broken) == _outcome(checked_router_event_from_wire, broken)
