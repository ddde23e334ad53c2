"""The ring's retention for the persistence writer, and the suffix batch encoded from its columns (issue #34).

The writer no longer subscribes to the index (which made every apply call back once per event): the ring
keeps the segments it evicts until the writer has written them, and the writer encodes its append straight
from their columns. Against a plain list of the applied events: a retaining ring hands back exactly the
events after any id, however many were evicted, and ``encode_ring_batch`` writes the bytes of
``codec.encode_batch(events, tokens=False)`` (which ``decode_batch`` reads back), with the compiled row
encoder (kvagent/_native/_columns.pyx) and without it.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvagent.index.recovery_index import RecoveryIndex
from kvagent.index.ring import EventRing, RingRange
from kvagent.model.events import ResidencyDomain, RouterEvent, StorageTier, Stored
from kvagent.persist import columns
from kvagent.persist.codec import decode_batch, encode_batch
from kvagent.persist.columns import encode_ring_batch
from tests.unit.test_event_ring import _streams, appends  # noqa: F401  (a fixture, used by name)


def _both_encoders(found: RingRange) -> list[tuple[bytes, Any]]:
    """encode_ring_batch with the compiled row encoder (when built) and with the pure-Python rows."""
    results = []
    native = columns._NATIVE_ROWS
    try:
        for rows in {native, None}:
            columns._NATIVE_ROWS = rows
            results.append(encode_ring_batch(found))
    finally:
        columns._NATIVE_ROWS = native
    return results


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_streams(), st.integers(1, 9), st.integers(1, 5), st.lists(st.booleans(), min_size=40, max_size=40))
def test_a_retaining_ring_hands_back_every_event_after_an_id_and_encodes_it_as_encode_batch(
    appends: str,  # noqa: F811
    events: list[RouterEvent],
    capacity: int,
    segment: int,
    writes: list[bool],
) -> None:
    ring = EventRing(capacity, segment)
    ring.retain(True)
    released = -1
    for position, event in enumerate(events):
        ring.append(event)
        if writes[position]:  # the writer takes what was applied since its last write, then releases it
            expected = [applied for applied in events[: position + 1] if applied.event_id > released]
            found = ring.applied_after(released)
            assert found.events() == expected
            for body, ids in _both_encoders(found):
                assert list(ids) == [applied.event_id for applied in expected]
                assert body == encode_batch(expected, tokens=False)
                assert decode_batch(body) == expected
            released = event.event_id
            ring.release_through(released)
    assert ring.applied_after(released).events() == [event for event in events if event.event_id > released]
    # Range answers never see what is retained: the ring still holds exactly its capacity.
    assert len(ring) == min(capacity, len(events))
    ring.retain(False)
    assert ring.retained_events() == 0


def test_retained_segments_are_released_once_written_and_dropped_when_retention_stops() -> None:
    ring = EventRing(4, 2)
    ring.retain(True)
    events = [
        RouterEvent(7, StorageTier.DEVICE, ResidencyDomain.WORKER, event_id, Stored(None, (event_id,), (1,)), 0)
        for event_id in range(1, 21)
    ]
    for event in events:
        ring.append(event)
    assert ring.oldest_id() == 17  # range answers: the last four
    assert ring.retained_events() == 16
    assert [event.event_id for event in ring.applied_after(0).events()] == list(range(1, 21))
    ring.release_through(9)  # segments (9, 10) and later stay: 10 is not written yet
    assert ring.retained_events() == 8
    assert [event.event_id for event in ring.applied_after(9).events()] == list(range(10, 21))
    ring.retain(False)
    assert ring.retained_events() == 0
    ring.append(RouterEvent(7, StorageTier.DEVICE, ResidencyDomain.WORKER, 21, Stored(None, (21,), (1,)), 0))
    assert ring.retained_events() == 0


@pytest.mark.parametrize("native", [True, False])
def test_the_index_apply_run_retains_what_it_evicts(native: bool) -> None:
    """The compiled apply_run's bulk ring append keeps evicted segments as EventRing.append does."""
    index = RecoveryIndex(16, ring_capacity=8)
    if not native:
        index._native_apply_run = None
    elif index._native_apply_run is None:
        pytest.skip("kvagent._native._store is not built")
    index.retain_applied(True)
    events = [
        RouterEvent(7, StorageTier.DEVICE, ResidencyDomain.WORKER, event_id, Stored(None, (event_id,), (3,)), 0)
        for event_id in range(1, 101)
    ]
    for first in range(0, 100, 10):
        assert index.apply_run(events[first : first + 10]) == []
    assert index.oldest_buffered_id() == 93
    assert index.applied_after(40).events() == events[40:]
    assert index.retained_applied_events() >= 60
    index.release_applied_through(100)
    assert index.applied_after(92).events() == events[92:]  # what the ring holds is still there
    assert index.retained_applied_events() == 0


def test_the_compiled_rows_write_every_int_width_as_msgpack_does() -> None:
    """Ids, routes, parents and hashes around every msgpack int width (fixint, 8, 16, 32, 64 bits)."""
    widths = [0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1]
    ring = EventRing(1 << 10)
    ring.retain(True)
    events = []
    for number, value in enumerate(widths):
        worker = 7 + number % 3  # a few routes
        data = Stored(value if number % 2 else None, tuple(widths[: number + 10]), tuple(widths[: number + 10]))
        events.append(RouterEvent(worker, StorageTier.DEVICE, ResidencyDomain.WORKER, value, data, 0))
    events.sort(key=lambda event: event.event_id)
    for event in events:
        ring.append(event)
    for body, ids in _both_encoders(ring.applied_after(-1)):
        assert list(ids) == [event.event_id for event in events]
        assert body == encode_batch(events, tokens=False)
