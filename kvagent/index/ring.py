"""The outbound event ring as columns (issue #25): no Python object per buffered event.

A ring of 200k RouterEvents was about a million live Python objects (the event, its data, two tuples, the
hash ints): every full garbage collection walked them all, and recovery latency grew with the ring. Here the
ring is a list of *segments*, each a handful of flat columns (``array`` and ``bytearray``) for up to
``segment_events`` consecutive events:

- ``ids`` (u64), ``routes`` (a per-segment code into ``route_table``: worker, tier, domain, rank, state
  source, session), ``kinds`` (one byte: see the ``KIND_*`` constants), ``parents`` (u64, 0 without one);
- ``offsets`` (u32, one more than the events): event i's block hashes are ``hashes[offsets[i]:offsets[i+1]]``
  and, for a store, its tokens hashes the same slice of ``tokens``;
- ``extras``: the rare Stored fields that are not columns (``start_position``, multimodal info), by position.

Segments only grow at the end and are dropped whole from the front, so the columns of a buffered event never
change: a :class:`RingRange` (the pieces of segments a range answer covers) is a consistent snapshot without
copying anything, and stays one while later events are applied.  Eviction is logical (``head``, the first
live position of the oldest segment), so the ring holds exactly ``capacity`` events whatever the segment
size.

The index stores no byte format (layer rule): each segment has one opaque ``wire`` slot where the recovery
layer keeps the segment's encoded events, built lazily from the columns and reused by every answer.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, overload

from kvagent import _native
from kvagent.model.events import (
    CLEARED,
    EventData,
    EventRoute,
    Removed,
    RouterEvent,
    Stored,
    StoredExtra,
)

__all__ = [
    "KIND_CLEARED",
    "KIND_REMOVED",
    "KIND_STORED",
    "KIND_STORED_CHILD",
    "EventRing",
    "RingEvents",
    "RingRange",
    "RingSegment",
    "segment_append",
]

KIND_STORED = 0  # a Stored chain without a parent
KIND_STORED_CHILD = 1  # a Stored chain whose parent hash is in ``parents``
KIND_REMOVED = 2
KIND_CLEARED = 3

# Events per segment: big enough that a ring of millions is a few hundred segments (a bisect over them),
# small enough that a segment's lazily built encoding is cheap to build and to drop.
MAX_SEGMENT_EVENTS = 4096


class RingSegment:
    """Up to ``size`` consecutive buffered events as columns (see the module docstring)."""

    __slots__ = (
        "extras",
        "hashes",
        "ids",
        "kinds",
        "offsets",
        "parents",
        "route_codes",
        "route_table",
        "routes",
        "size",
        "tokens",
        "wire",
    )

    def __init__(self, size: int) -> None:
        self.size = size
        self.ids = array("Q")
        self.routes = array("H")
        self.kinds = bytearray()
        self.parents = array("Q")
        self.offsets = array("I", (0,))
        self.hashes = array("Q")
        self.tokens = array("Q")
        self.extras: dict[int, StoredExtra] = {}
        self.route_table: list[EventRoute] = []
        # (worker_id, tier, domain, dp_rank, id(state_source), session_id) -> index in route_table
        self.route_codes: dict[tuple[object, ...], int] = {}
        # The recovery layer's encoded events of this segment (opaque here; dropped with the segment).
        self.wire: object = None

    def __len__(self) -> int:
        return len(self.kinds)

    def add_route(self, event: RouterEvent, key: tuple[object, ...]) -> int:
        """The code of a route not in the table yet (``key`` as :meth:`append` builds it)."""
        code = self.route_codes[key] = len(self.route_table)
        source, session = event.state_source, event.session_id
        self.route_table.append(
            EventRoute(event.worker_id, event.storage_tier, event.residency_domain, event.dp_rank, source, session)
        )
        return code

    def append(self, event: RouterEvent) -> None:
        """Buffer one applied event (its data already validated by the index).

        kvagent/_native/_columns.pyx has the same append compiled (``ring_append``); the ring uses it when
        the extension is built.
        """
        source = event.state_source
        # Keyed by the source's identity: hashing a CacheOwnerId per event costs more than the rest of the
        # append, and the route table holds the object, so its id cannot be reused while the segment lives.
        key = (
            event.worker_id,
            event.storage_tier,
            event.residency_domain,
            event.dp_rank,
            id(source),
            event.session_id,
        )
        code = self.route_codes.get(key)
        if code is None:
            code = self.add_route(event, key)
        data = event.data
        cls = type(data)
        if cls is Stored:
            parent = data.parent_hash  # type: ignore[union-attr]
            if parent is None:
                self.kinds.append(KIND_STORED)
                self.parents.append(0)
            else:
                self.kinds.append(KIND_STORED_CHILD)
                self.parents.append(parent)
            self.hashes.extend(data.block_hashes)
            self.tokens.extend(data.tokens_hashes)  # type: ignore[union-attr]
            if data.mm_extra_infos is not None or data.start_position is not None:  # type: ignore[union-attr]
                self.extras[len(self.ids)] = (data.start_position, data.mm_extra_infos)  # type: ignore[union-attr]
        elif cls is Removed:
            self.kinds.append(KIND_REMOVED)
            self.parents.append(0)
            hashes = data.block_hashes
            self.hashes.extend(hashes)
            self.tokens.frombytes(bytes(8 * len(hashes)))  # zeros: tokens share the offsets of hashes
        else:
            self.kinds.append(KIND_CLEARED)
            self.parents.append(0)
        self.ids.append(event.event_id)
        self.routes.append(code)
        self.offsets.append(len(self.hashes))

    def data(self, position: int) -> EventData:
        kind = self.kinds[position]
        if kind == KIND_CLEARED:
            return CLEARED
        first, end = self.offsets[position], self.offsets[position + 1]
        hashes = tuple(self.hashes[first:end])
        if kind == KIND_REMOVED:
            return Removed(hashes)
        parent = self.parents[position] if kind == KIND_STORED_CHILD else None
        start, infos = self.extras.get(position, (None, None))
        return Stored(parent, hashes, tuple(self.tokens[first:end]), infos, start)

    def event(self, position: int) -> RouterEvent:
        worker_id, tier, domain, dp_rank, source, session = self.route_table[self.routes[position]]
        data = self.data(position)
        return RouterEvent(worker_id, tier, domain, self.ids[position], data, dp_rank, source, session)


class RingRange(NamedTuple):
    """Buffered events as (segment, first position, end position) pieces, oldest first; immutable."""

    pieces: tuple[tuple[RingSegment, int, int], ...]
    length: int  # events in all

    def events(self) -> list[RouterEvent]:
        return [
            segment.event(position) for segment, first, end in self.pieces for position in range(first, end)
        ]

    def ids(self) -> Iterator[int]:
        for segment, first, end in self.pieces:
            yield from segment.ids[first:end]

    def select(self, keep: Callable[[EventRoute], bool]) -> RingRange | None:
        """The events whose route ``keep`` accepts, as a range, or None when the kept events are not one
        run per segment (the caller then takes them one by one)."""
        pieces: list[tuple[RingSegment, int, int]] = []
        for segment, first, end in self.pieces:
            table = segment.route_table
            kept = {code for code in range(len(table)) if keep(table[code])}
            if len(kept) == len(table):
                pieces.append((segment, first, end))
                continue
            if not kept:
                continue
            if set(segment.routes[first:end]) <= kept:
                pieces.append((segment, first, end))
                continue
            return None
        return RingRange(tuple(pieces), sum(end - first for _, first, end in pieces))


_EMPTY_RANGE = RingRange((), 0)


def _native_append() -> Callable[[RingSegment, RouterEvent], None] | None:
    """``ring_append`` of kvagent/_native/_columns.pyx when built, else None (RingSegment.append)."""
    if _native.columns is None:
        return None
    append: Callable[[RingSegment, RouterEvent], None] = _native.columns.ring_append
    return append


_NATIVE_APPEND = _native_append()


def segment_append() -> Callable[[RingSegment, RouterEvent], None]:
    """How :meth:`EventRing.append` appends to a segment: the compiled append when built, else Python's
    (kvagent/_native/_store.pyx's apply_run appends the same way)."""
    if _NATIVE_APPEND is None:
        append: Callable[[RingSegment, RouterEvent], None] = RingSegment.append
        return append
    return _NATIVE_APPEND


class RingEvents(Sequence[RouterEvent]):
    """A range of the ring as a read-only sequence of RouterEvents, decoded on first use (then kept).

    Equal to any sequence of the same events (a tuple in particular). Answer encoders read ``ring_range``
    and encode from the columns without building the events at all.
    """

    __slots__ = ("_events", "ring_range")

    def __init__(self, ring_range: RingRange) -> None:
        self.ring_range = ring_range
        self._events: tuple[RouterEvent, ...] | None = None

    def decoded(self) -> tuple[RouterEvent, ...]:
        events = self._events
        if events is None:
            events = self._events = tuple(self.ring_range.events())
        return events

    def __len__(self) -> int:
        return self.ring_range.length

    @overload
    def __getitem__(self, index: int) -> RouterEvent: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[RouterEvent, ...]: ...

    def __getitem__(self, index: int | slice) -> RouterEvent | tuple[RouterEvent, ...]:
        return self.decoded()[index]

    def __iter__(self) -> Iterator[RouterEvent]:
        return iter(self.decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RingEvents):
            return self.decoded() == other.decoded()
        if isinstance(other, tuple | list):
            return self.decoded() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.decoded())

    def __repr__(self) -> str:
        return f"RingEvents({self.decoded()!r})"


class EventRing:
    """The last ``capacity`` applied events, as column segments (see the module docstring)."""

    __slots__ = ("_count", "_firsts", "_head", "_retired", "_segment_events", "_segments", "_tail", "capacity")

    def __init__(self, capacity: int, segment_events: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"ring capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._segment_events = segment_events or max(1, min(MAX_SEGMENT_EVENTS, capacity))
        self._segments: list[RingSegment] = []
        self._tail: RingSegment | None = None  # the newest segment, the one appends go to
        self._firsts: list[int] = []  # each segment's first id (its physical first event), for bisect
        self._head = 0  # first live position of the oldest segment
        self._count = 0
        # Segments evicted from the ring but kept for a reader that has not taken them yet (the persistence
        # writer, see :meth:`retain`); None: nobody retains, evicted segments are dropped.
        self._retired: list[RingSegment] | None = None

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def newest_id(self) -> int:
        """The newest buffered id; only when the ring is not empty."""
        return self._segments[-1].ids[-1]

    def oldest_id(self) -> int | None:
        if not self._count:
            return None
        return self._segments[0].ids[self._head]

    def append(self, event: RouterEvent) -> None:
        # Once per applied event: no Python-level call but the append itself (len of the kinds column,
        # not RingSegment.__len__).
        segment = self._tail
        if segment is None or len(segment.kinds) >= self._segment_events:
            segment = self._tail = RingSegment(self._segment_events)
            self._segments.append(segment)
            self._firsts.append(event.event_id)
        if _NATIVE_APPEND is None:
            segment.append(event)
        else:
            _NATIVE_APPEND(segment, event)
        self._count += 1
        if self._count > self.capacity:
            self._evict_one()

    def _evict_one(self) -> None:
        self._count -= 1
        self._head += 1
        if self._head >= len(self._segments[0].kinds):
            if self._retired is not None:
                self._retired.append(self._segments[0])
            del self._segments[0], self._firsts[0]
            self._head = 0

    # --- retention: the applied events as columns, for one reader that trails the ring (issue #34) ---

    def retain(self, on: bool) -> None:
        """Keep (True) every segment evicted from now on until :meth:`release_through` passes it, or stop
        keeping them and drop those kept (False). Range answers never see retained segments."""
        self._retired = [] if on else None

    @property
    def retaining(self) -> bool:
        return self._retired is not None

    def retained_events(self) -> int:
        """Events in the retained segments (evicted from the ring, not yet released)."""
        return 0 if self._retired is None else sum(len(segment.kinds) for segment in self._retired)

    def release_through(self, event_id: int) -> None:
        """Drop the retained segments whose events all have ids at or below ``event_id``."""
        retired = self._retired
        if retired:
            keep = 0
            while keep < len(retired) and retired[keep].ids[-1] <= event_id:
                keep += 1
            del retired[:keep]

    def applied_after(self, event_id: int) -> RingRange:
        """Every event with id above ``event_id`` the ring holds or retains (evicted ones included, while
        retained), oldest first. Complete only while retaining since the reader's last ``event_id``."""
        pieces: list[tuple[RingSegment, int, int]] = []
        count = 0
        for segment in [*(self._retired or ()), *self._segments]:
            ids = segment.ids
            end = len(segment.kinds)
            if not end or ids[end - 1] <= event_id:
                continue
            first = bisect.bisect_right(ids, event_id, 0, end)
            pieces.append((segment, first, end))
            count += end - first
        return RingRange(tuple(pieces), count)

    def tail(self, start: int) -> RingRange:
        """The buffered events with id >= ``start``, oldest first."""
        if not self._count:
            return _EMPTY_RANGE
        segments, head = self._segments, self._head
        number = max(0, bisect.bisect_right(self._firsts, start) - 1)
        first_segment = segments[number]
        lo = head if number == 0 else 0
        position = bisect.bisect_left(first_segment.ids, start, lo)
        pieces: list[tuple[RingSegment, int, int]] = []
        count = 0
        if position < len(first_segment):
            pieces.append((first_segment, position, len(first_segment)))
            count += len(first_segment) - position
        for segment in segments[number + 1 :]:
            pieces.append((segment, 0, len(segment)))
            count += len(segment)
        return RingRange(tuple(pieces), count)

    def between(self, first_id: int, last_id: int) -> RingRange | None:
        """The buffered events with ids in [first_id, last_id], if every one of them is buffered and they
        are exactly ``last_id - first_id + 1`` events (consecutive ids); else None."""
        oldest = self.oldest_id()
        if oldest is None or first_id < oldest or last_id > self.newest_id():
            return None
        whole = self.tail(first_id)
        wanted = last_id - first_id + 1
        pieces: list[tuple[RingSegment, int, int]] = []
        for segment, first, end in whole.pieces:
            take = min(end - first, wanted - sum(e - f for _, f, e in pieces))
            if take <= 0:
                break
            pieces.append((segment, first, first + take))
        found = RingRange(tuple(pieces), sum(e - f for _, f, e in pieces))
        if found.length != wanted or not pieces:
            return None
        last_segment, _, last_end = pieces[-1]
        if pieces[0][0].ids[pieces[0][1]] != first_id or last_segment.ids[last_end - 1] != last_id:
            return None
        return found

    def segments(self) -> Sequence[RingSegment]:
        return tuple(self._segments)

    def statistics(self) -> dict[str, Any]:
        """Sizes for tests and diagnostics: segments held and buffered events."""
        return {"segments": len(self._segments), "events": self._count, "head": self._head}
