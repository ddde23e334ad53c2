"""The column encoders (issue #25): compiled and pure Python write the reference bytes.

The reference is ``encode_event`` (pinned to ``router_event_to_wire``): of each live row's one-block Stored
event for a tree dump, of each event for the ring.  Both implementations of
kvagent/recovery/wire_columns.py run on the same Hypothesis columns: every flag, hashes at the u64 edges,
sub-ranges, an output buffer that already holds events, and chains long enough for every msgpack array
header size.
"""

from __future__ import annotations

from array import array
from types import ModuleType

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.index.ring import EventRing
from kvagent.model.events import (
    FLAG_DEAD,
    FLAG_PARENT,
    U64_MAX,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.recovery import wire_columns
from kvagent.wire.router_event import EVENT_TEMPLATES, Encoding, encode_event
from tests.support.ids import OWNER


def _implementations() -> list[ModuleType]:
    return [wire_columns, *([wire_columns.impl] if wire_columns.NATIVE else [])]


_u64 = st.sampled_from([0, 1, 9, 10, 99, 1 << 32, U64_MAX]) | st.integers(0, U64_MAX)
_rows = st.lists(st.tuples(_u64, _u64, _u64, st.sampled_from([0, 1, 2])), max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    _rows,
    st.data(),
    st.sampled_from([None, OWNER]),
    st.sampled_from(list(StorageTier)),
    st.integers(0, U64_MAX - 100),
    st.booleans(),
)
def test_dump_rows_are_the_reference_bytes(
    rows: list[tuple[int, int, int, int]],
    data: st.DataObject,
    source: object,
    tier: StorageTier,
    first_id: int,
    prefilled: bool,
) -> None:
    hashes, parents, tokens = (array("Q", [row[i] for row in rows]) for i in range(3))
    flags = bytes(row[3] for row in rows)
    first = data.draw(st.integers(0, len(rows)))
    end = data.draw(st.integers(first, len(rows)))
    domain = ResidencyDomain.CACHE_OWNER if source is not None else ResidencyDomain.WORKER
    route = (7, tier, domain, 3, source)
    live = [row for row in range(first, end) if flags[row] != FLAG_DEAD]
    events = [
        RouterEvent(
            7,
            tier,
            domain,
            first_id + number,
            Stored(parents[row] if flags[row] == FLAG_PARENT else None, (hashes[row],), (tokens[row],)),
            3,
            source,  # type: ignore[arg-type]
        )
        for number, row in enumerate(live)
    ]
    next_id = first_id + len(events)
    for encoding in Encoding:
        reference = [encode_event(encoding, event) for event in events]
        expected = [part.encode() if isinstance(part, str) else part for part in reference]
        for impl in _implementations():
            out = bytearray(b"x" if prefilled else b"")
            ends = array("I")
            if encoding is Encoding.JSON:
                json_template = wire_columns.dump_json_template(*route)  # type: ignore[arg-type]
                encoded_id = impl.encode_dump_json(
                    out, ends, json_template, hashes, parents, tokens, flags, first, end, first_id
                )
            else:
                template = wire_columns.dump_msgpack_template(*route)  # type: ignore[arg-type]
                encoded_id = impl.encode_dump_msgpack(
                    out, ends, template, hashes, parents, tokens, flags, first, end, first_id
                )
            assert encoded_id == next_id, impl.__name__
            separator = 1 if encoding is Encoding.JSON else 0
            start = len(b"x") if prefilled else 0
            parts = []
            for event_end in ends:
                if encoding is Encoding.JSON and start:
                    assert out[start : start + 1] == b","
                    start += separator
                parts.append(bytes(out[start:event_end]))
                start = event_end
            assert start == len(out) or not ends
            assert parts == expected, impl.__name__


@pytest.mark.parametrize("blocks", [0, 1, 15, 16, 65_535, 65_536])
def test_ring_events_of_every_array_header_size(blocks: int) -> None:
    ring = EventRing(8)
    hashes = tuple(range(U64_MAX - blocks + 1, U64_MAX + 1))
    events = [
        RouterEvent(7, StorageTier.DEVICE, ResidencyDomain.WORKER, 1, Stored(None, hashes, hashes), 0, OWNER),
        RouterEvent(7, StorageTier.DISK, ResidencyDomain.WORKER, 2, Stored(5, hashes, hashes), 0, None, "s"),
        RouterEvent(8, StorageTier.HOST_PINNED, ResidencyDomain.WORKER, 3, Removed(hashes), 1, OWNER),
    ]
    for event in events:
        ring.append(event)
    (segment,) = ring.segments()
    heads, tails = zip(*map(wire_columns.route_templates, segment.route_table), strict=True)
    for impl in _implementations():
        out, ends = bytearray(), array("I")
        impl.encode_ring_events(
            out,
            ends,
            list(heads),
            list(tails),
            EVENT_TEMPLATES,
            segment.ids,
            segment.routes,
            segment.kinds,
            segment.parents,
            segment.offsets,
            segment.hashes,
            segment.tokens,
            0,
            len(segment),
        )
        starts = [0, *ends[:-1]]
        parts = [bytes(out[start:end]) for start, end in zip(starts, ends, strict=True)]
        assert parts == [encode_event(Encoding.MSGPACK, event) for event in events], impl.__name__
        assert [msgpack.unpackb(part)["event"]["event_id"] for part in parts] == [1, 2, 3]
