"""The native core's RouterEvent encoder writes exactly the bytes of the Python encoder (which defines them).

``encode_router_events`` uses the compiled encoder (kvagent/_native) when it is built and every event is
of the plain shape; the Python encoder (``router_event_to_wire`` + msgpack-python) defines the bytes, and
takes every event the native one declines.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent import _native
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
from kvagent.wire.router_event import decode_router_events, encode_router_events, encode_router_events_python
from tests.support.ids import IDENTITY

pytestmark = pytest.mark.skipif(not _native.NATIVE, reason=f"native core: {_native.REASON}")

# Every msgpack integer width and sign, around each boundary.
_edges = [0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
_int = st.one_of(st.sampled_from(_edges), st.integers(0, 2**64 - 1))
_signed = st.one_of(
    _int, st.sampled_from([-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)])
)
_hashes = st.lists(_int, max_size=5).map(tuple)


@st.composite
def _data(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
    if kind == "cleared":
        return CLEARED
    hashes = draw(_hashes)
    if kind == "removed":
        return Removed(hashes)
    tokens = tuple(draw(st.lists(_int, min_size=len(hashes), max_size=len(hashes))))
    return Stored(draw(st.one_of(st.none(), _int)), hashes, tokens, None, draw(st.one_of(st.none(), _int)))


_event = st.builds(
    RouterEvent,
    _signed,
    st.sampled_from(list(StorageTier)),
    st.sampled_from(list(ResidencyDomain)),
    _int,
    _data(),
    _signed,
    st.sampled_from([None, IDENTITY.cache_owner_id]),
    st.one_of(st.none(), st.text(max_size=40), st.text(min_size=200, max_size=300)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_event, max_size=20))
def test_native_bytes_are_the_python_bytes(events: list[RouterEvent]) -> None:
    assert _native.core is not None
    native = _native.core.encode_router_events(events)
    assert native is not None  # every generated event is of the plain shape
    assert native == encode_router_events_python(events)
    try:
        decoded = decode_router_events(native)
    except CodecError:
        return  # negative worker ids or ranks: encodable, refused by the decoder
    assert decoded == events


def test_long_lists_and_strings_take_the_wide_headers() -> None:
    hashes = tuple(range(70_000))
    events = [
        RouterEvent(1, StorageTier.DEVICE, ResidencyDomain.WORKER, 5, Removed(hashes), 0, None, "x" * 70_000),
        RouterEvent(1, StorageTier.DISK, ResidencyDomain.WORKER, 6, Stored(None, hashes[:20], hashes[:20]), 0),
    ]
    assert _native.core is not None
    assert _native.core.encode_router_events(events) == encode_router_events_python(events)


@pytest.mark.parametrize(
    "odd",
    [
        Stored(None, (1,), (2,), (MmExtraInfo((MmObject(3, ((0, 1),)),)),)),  # multimodal: Python's encoder
        Stored(None, (1, 2), (2,)),  # lengths differ: Python raises
        Removed((2**64,)),  # beyond u64: Python raises
        Removed((True,)),  # not an int
    ],
    ids=["mm", "lengths", "u65", "bool"],
)
def test_the_native_encoder_declines_and_python_decides(odd: Any) -> None:
    events = [RouterEvent(1, StorageTier.DEVICE, ResidencyDomain.WORKER, 5, odd, 0)]
    assert _native.core is not None
    assert _native.core.encode_router_events(events) is None
    try:
        expected: object = encode_router_events_python(events)
    except CodecError as error:
        expected = str(error)
    try:
        got: object = encode_router_events(events)
    except CodecError as error:
        got = str(error)
    assert got == expected


def test_surrogates_decline() -> None:
    events = [RouterEvent(1, StorageTier.DEVICE, ResidencyDomain.WORKER, 5, CLEARED, 0, None, "\ud800")]
    assert _native.core is not None
    assert _native.core.encode_router_events(events) is None
    with pytest.raises(CodecError):
        encode_router_events(events)
