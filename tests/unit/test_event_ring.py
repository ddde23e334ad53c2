"""The columnar outbound ring (issue #25) against a plain list of RouterEvents.

Hypothesis streams of every event shape (stores with and without parents, multimodal info, start positions,
removes, clears, CacheOwner routes, session ids, ids that jump) go into an :class:`EventRing` with small
capacities and segment sizes, so eviction crosses segment boundaries all the time.  After every append the
ring must answer every range exactly as the list model does (the same events, from every start around the
buffered ids), and the encoded answers (the compiled and the pure-Python encoders) must be the bytes of the
reference per-event encoder, also once framed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvagent.index.ring
from kvagent.index.recovery_index import EventsAnswer, RecoveryIndex
from kvagent.index.ring import EventRing, RingEvents
from kvagent.model.events import (
    CLEARED,
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
from kvagent.recovery import wire_columns
from kvagent.recovery.dump import EncodedRing
from kvagent.recovery.protocol import event_frames
from kvagent.wire.router_event import Encoding, encode_event, router_event_to_wire
from tests.support.ids import OWNER
from tests.support.recovery import OTHER_OWNER

W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
INFO = MmExtraInfo((MmObject(5, ((1, 2),)),))

_hash = st.sampled_from([0, 1, 2, 3, 17, 1 << 63, U64_MAX]) | st.integers(0, U64_MAX)
_route = st.tuples(
    st.sampled_from([7, 8]),
    st.sampled_from(list(StorageTier)),
    st.sampled_from([W, C]),
    st.sampled_from([0, 3]),
    st.sampled_from([None, OWNER, OTHER_OWNER]),
    st.sampled_from([None, "s", "séance"]),
)


@st.composite
def _data(draw: st.DrawFn) -> EventData:
    kind = draw(st.sampled_from(["store", "store", "remove", "clear"]))
    if kind == "clear":
        return CLEARED
    hashes = tuple(draw(st.lists(_hash, max_size=20)))
    if kind == "remove":
        return Removed(hashes)
    tokens = tuple(draw(st.lists(_hash, min_size=len(hashes), max_size=len(hashes))))
    infos = draw(st.none() | st.lists(st.none() | st.just(INFO), min_size=len(hashes), max_size=len(hashes)))
    start = draw(st.none() | st.integers(0, 1 << 20))
    return Stored(draw(st.none() | _hash), hashes, tokens, None if infos is None else tuple(infos), start)


@st.composite
def _streams(draw: st.DrawFn) -> list[RouterEvent]:
    events = []
    event_id = draw(st.integers(0, 5))
    for _ in range(draw(st.integers(0, 40))):
        event_id += draw(st.sampled_from([1, 1, 1, 2, 7]))
        worker, tier, domain, rank, source, session = draw(_route)
        events.append(RouterEvent(worker, tier, domain, event_id, draw(_data()), rank, source, session))
    return events


def _starts(events: list[RouterEvent]) -> Iterator[int]:
    if not events:
        yield from (0, 1)
        return
    yield from range(max(0, events[0].event_id - 2), events[-1].event_id + 3)


@pytest.fixture(params=["native", "python"])
def appends(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the compiled ring append (skipped when not built) and with RingSegment.append."""
    if request.param == "native":
        if kvagent.index.ring._NATIVE_APPEND is None:
            pytest.skip("kvagent._native._columns is not built")
    else:
        monkeypatch.setattr(kvagent.index.ring, "_NATIVE_APPEND", None)
    return str(request.param)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_streams(), st.integers(1, 9), st.integers(1, 5))
def test_the_ring_answers_every_range_as_a_list_does(
    appends: str, events: list[RouterEvent], capacity: int, segment: int
) -> None:
    ring = EventRing(capacity, segment)
    model: list[RouterEvent] = []
    for event in events:
        ring.append(event)
        model = [*model, event][-capacity:]
        assert len(ring) == len(model)
        assert ring.oldest_id() == model[0].event_id and ring.newest_id() == model[-1].event_id
        assert ring.statistics()["segments"] <= capacity // segment + 2  # evicted segments are dropped
    for start in _starts(events):
        expected = [event for event in model if event.event_id >= start]
        tail = RingEvents(ring.tail(start))
        assert len(tail) == len(expected)
        assert tail == tuple(expected) and list(tail) == expected
        assert list(tail.ring_range.ids()) == [event.event_id for event in expected]
    for first in _starts(model):
        for last in range(first, first + 4):
            wanted = [event for event in model if first <= event.event_id <= last]
            found = ring.between(first, last)
            consecutive = len(wanted) == last - first + 1
            assert (found is not None) == consecutive
            if found is not None:
                assert found.events() == wanted


@pytest.fixture(params=["native", "python"])
def encoders(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the compiled encoders (skipped when not built) and with the pure-Python ones."""
    if request.param == "native":
        if not wire_columns.NATIVE:
            pytest.skip("kvagent._native._columns is not built")
    else:
        monkeypatch.setattr(wire_columns, "impl", wire_columns)
    return str(request.param)


def _valid(events: list[RouterEvent]) -> list[RouterEvent]:
    """The stream as an index accepts it: CacheOwner events never on the Device tier and always owned."""
    valid = []
    for event in events:
        domain, tier, source = event.residency_domain, event.storage_tier, event.state_source
        if domain is C and (source is None or (tier is StorageTier.DEVICE and event.data is not CLEARED)):
            continue
        valid.append(event)
    return valid


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_streams(), st.integers(1, 12), st.sampled_from([300, 700, 1 << 20]))
def test_encoded_answers_are_the_reference_bytes(
    encoders: str, events: list[RouterEvent], capacity: int, limit: int
) -> None:
    index = RecoveryIndex(16, ring_capacity=capacity)
    cache = EncodedRing(index, wire_segments=2)
    applied = []
    for event in _valid(events):
        index.apply(event)
        applied.append(event)
        # Asking after every apply: the segment encodings grow incrementally and get dropped and rebuilt.
        oldest = index.oldest_buffered_id()
        assert oldest is not None
        answer = index.events_in_range(max(oldest, event.event_id - 3), None)
        assert isinstance(answer, EventsAnswer)
        cache.encode(Encoding.MSGPACK, answer.events)
    model = applied[-capacity:]
    for start in _starts(model):
        answer = index.events_in_range(start, None)
        if not isinstance(answer, EventsAnswer):
            continue
        expected = [event for event in model if event.event_id >= start]
        for encoding in Encoding:
            parts = cache.encode(encoding, answer.events)
            assert list(parts) == [encode_event(encoding, event) for event in expected]
            header = {"id": 1, "ok": True, "kind": "events", "last_event_id": answer.last_event_id}
            try:
                frames = list(
                    event_frames(encoding, header, cache.encode(encoding, answer.events), limit=limit)
                )
            except Exception as exc:  # an event larger than the frame: refused the same way on both paths
                with pytest.raises(type(exc)):
                    list(
                        event_frames(
                            encoding, header, [encode_event(encoding, e) for e in expected], limit=limit
                        )
                    )
                continue
            assert all(len(frame) <= limit for frame in frames)
            reference = list(
                event_frames(encoding, header, [encode_event(encoding, e) for e in expected], limit=limit)
            )
            assert frames == reference  # the same cuts, the same bytes
            decoded = [_decode(frame) for frame in frames]
            assert [e for frame in decoded for e in frame["events"]] == [
                router_event_to_wire(e) for e in expected
            ]
        # A follower's live events (RouterEvent objects) still buffered: served from the segments too.
        if expected:
            live = cache.encode(Encoding.MSGPACK, list(expected))
            assert list(live) == [encode_event(Encoding.MSGPACK, event) for event in expected]


def _decode(frame: str | bytes) -> Any:
    return msgpack.unpackb(frame, strict_map_key=False) if isinstance(frame, bytes) else json.loads(frame)
