"""The slot's local recovery index (docs/spec/agent-semantics.md 4; Dynamo's ``LocalKvIndexer``).

It keeps the full resident state per exact (residency owner, storage tier) and a ring of the last outbound
RouterEvents, and answers range queries with either the buffered tail or a tree dump.  Everything is
synchronous: the coordinator applies an event and, on return, the state (a ``Cleared`` included) is final.
Filtering answers per requester (5.3) is the recovery server's job, not the index's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import TypeAlias

import attrs
import structlog

from kvagent import _native
from kvagent._util.gcutil import gc_paused
from kvagent.index.answers import (
    DumpGroup,
    DumpSnapshot,
    EventsAnswer,
    InvalidRangeAnswer,
    RangeAnswer,
    TooNewAnswer,
    TreeDumpAnswer,
    TreeDumpFailedAnswer,
)
from kvagent.index.ring import EventRing, RingEvents, RingRange, RingSegment, segment_append
from kvagent.index.store import ResidentStore, new_block_store
from kvagent.model.errors import IndexApplyError
from kvagent.model.events import (
    RESET_ALL,
    U64_MAX,
    Cleared,
    EventRoute,
    Removed,
    ResidencyDomain,
    ResidencyOwner,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
    residency_owner,
    resident_row_events,
)
from kvagent.model.ids import CacheOwnerId

__all__ = [
    "DumpGroup",
    "DumpSnapshot",
    "EventsAnswer",
    "IndexApplyError",
    "InvalidRangeAnswer",
    "RangeAnswer",
    "RecoveryIndex",
    "TooNewAnswer",
    "TreeDumpAnswer",
    "TreeDumpFailedAnswer",
]

log = structlog.get_logger(__name__)

DEFAULT_RING_CAPACITY = 1024  # Dynamo's WORKER_KV_INDEXER_BUFFER_SIZE

StoreKey = tuple[ResidencyOwner, StorageTier]
_MAX_ROUTES = 4096  # distinct routes seen by one index are a handful; the bound only guards odd inputs
_CACHE_OWNER = ResidencyDomain.CACHE_OWNER
_WORKER = ResidencyDomain.WORKER
_DEVICE = StorageTier.DEVICE


ApplyRun: TypeAlias = Callable[["RecoveryIndex", Sequence[RouterEvent]], "list[tuple[int, Exception]] | None"]


def _warn_non_consecutive(expected_event_id: int, event_id: int) -> None:
    log.warning("non_consecutive_event_id", expected_event_id=expected_event_id, event_id=event_id)


def _native_apply_run(module: ModuleType | None) -> ApplyRun | None:
    """``apply_run`` of kvagent/_native/_store.pyx (configured with this module's classes), or None."""
    if module is None:
        return None
    module.configure(
        RouterEvent,
        Stored,
        Removed,
        _WORKER,
        _warn_non_consecutive,
        RingSegment,
        segment_append(),
        (IndexApplyError, TypeError),
    )
    apply_run: ApplyRun = module.apply_run
    return apply_run


# The compiled apply_run when built and not switched off (KVAGENT_NO_NATIVE=1), else None.
_NATIVE_APPLY_RUN = _native_apply_run(_native.store)


def _check_u64(values: tuple[int, ...], what: str) -> None:
    if values and (min(values) < 0 or max(values) > U64_MAX):
        raise IndexApplyError(f"{what} must be u64 values")


def _validate_stored(data: Stored) -> None:
    count = len(data.block_hashes)
    if len(data.tokens_hashes) != count:
        raise IndexApplyError(
            f"stored event has {count} block hashes but {len(data.tokens_hashes)} tokens hashes"
        )
    if data.mm_extra_infos is not None and len(data.mm_extra_infos) != count:
        raise IndexApplyError(
            f"stored event has {count} block hashes but {len(data.mm_extra_infos)} mm_extra_infos"
        )
    _check_u64(data.block_hashes, "block hashes")
    _check_u64(data.tokens_hashes, "tokens hashes")
    if data.parent_hash is not None and not 0 <= data.parent_hash <= U64_MAX:
        raise IndexApplyError("parent hash must be a u64 value")


class RecoveryIndex:
    """Resident blocks per (owner, tier), the outbound event ring, range answers and tree dumps."""

    # (applies counted when it was taken, snapshot): the query side's cache, valid while nothing applies.
    _snapshot_cache: tuple[int, DumpSnapshot] | None = None

    def __init__(self, kv_block_size: int, ring_capacity: int = DEFAULT_RING_CAPACITY) -> None:
        if kv_block_size <= 0:
            raise ValueError(f"kv_block_size must be positive, got {kv_block_size}")
        if ring_capacity <= 0:
            raise ValueError(f"ring_capacity must be positive, got {ring_capacity}")
        self.kv_block_size = kv_block_size
        self.ring_capacity = ring_capacity
        # The outbound ring as columns (index/ring.py): no Python object per buffered event.
        self._ring = EventRing(ring_capacity)
        self._stores: dict[StoreKey, ResidentStore] = {}
        # How a store is made, and the compiled apply_run loop (None: the Python one); both compiled when
        # kvagent/_native/_store.pyx is built, and tests set them per index to compare the two.
        self._new_store: Callable[[], ResidentStore] = new_block_store
        self._native_apply_run: ApplyRun | None = _NATIVE_APPLY_RUN
        # The (worker_id, dp_rank) of the newest event that touched each CacheOwner: dump entries carry it.
        self._cache_owner_workers: dict[CacheOwnerId, tuple[int, int]] = {}
        self._subscribers: dict[object, Callable[[RouterEvent], None]] = {}
        self._subscriber_snapshot: tuple[Callable[[RouterEvent], None], ...] = ()
        self._dump_cache: TreeDumpAnswer | None = None
        self._applied = 0  # successful applies, so a streaming dump can tell that state moved under it
        # (domain, worker_id, dp_rank, state_source, tier) -> store key: owners are resolved and validated
        # once per route, not once per event (building and hashing an owner object costs more than a store).
        self._routes: dict[tuple[object, ...], StoreKey] = {}
        # Ids in (_gap_floor, _gap_end] exist and carry no event (a restore, or ids skipped after a crash,
        # issue #17): a range from inside it is answered from the ring, not with a dump, while the ring still
        # reaches back to the first event after it. _gap_end is also the newest id when the ring is older.
        self._gap_floor = 0
        self._gap_end = 0

    # --- apply -------------------------------------------------------------------------------------

    def apply(self, event: RouterEvent) -> None:
        """Apply, buffer and announce one event; raises IndexApplyError (changing nothing) if invalid."""
        if type(event) is not RouterEvent:
            raise IndexApplyError(f"expected a RouterEvent, got {type(event).__name__}")
        data = event.data
        cls = type(data)
        if cls is not Stored and cls is not Removed and cls is not Cleared:
            raise IndexApplyError(f"unknown event data {cls.__name__}")
        event_id = event.event_id
        if not 0 <= event_id <= U64_MAX:
            raise IndexApplyError(f"event id {event_id} is not a u64")
        key = self._store_key(event)
        if event.residency_domain is _CACHE_OWNER and event.storage_tier is _DEVICE and cls is not Cleared:
            raise IndexApplyError("CacheOwner residency cannot target the Device tier")
        ring = self._ring
        if ring or self._gap_end:
            newest = ring.newest_id() if ring else 0
            if newest < self._gap_end:
                newest = self._gap_end
            if event_id <= newest:
                # Ids only grow (3.10); a smaller one would break the ring's binary search.
                raise IndexApplyError(f"KV event id {event_id} does not follow newest buffered id {newest}")
            if event_id != newest + 1:
                log.warning("non_consecutive_event_id", expected_event_id=newest + 1, event_id=event_id)

        if type(data) is Stored:
            self._store(key, data)
        elif cls is Removed:
            self._remove(key, data)  # type: ignore[arg-type]
        else:
            self._clear(key[0])

        if event.residency_domain is _CACHE_OWNER:
            self._cache_owner_workers[key[0]] = (event.worker_id, event.dp_rank)  # type: ignore[index]
        ring.append(event)
        self._applied += 1
        self._dump_cache = None
        self._announce(event)

    def apply_run(self, events: Sequence[RouterEvent]) -> list[tuple[int, Exception]] | None:
        """Apply Worker-domain Stored/Removed events with consecutive ids, as :meth:`apply` one by one would.

        The event, id and route checks run once for the run instead of once an event. Returns the events
        whose store or remove raised, as (position, error): each is left out of the ring, as when apply()
        raises. None when an event is not of that shape or its id would be refused: nothing changed, and
        the caller applies them one by one (which refuses each where it happens).

        The compiled loop (kvagent/_native/_store.pyx) does the same in one pass; it declines (None, nothing
        changed) anything but the plain shape, and this method then decides.
        """
        native = self._native_apply_run
        if native is not None:
            native_failures = native(self, events)
            if native_failures is not None:
                return native_failures
        keys = self._run_keys(events)
        if keys is None:
            return None
        ring = self._ring
        newest = ring.newest_id() if ring else 0
        if newest < self._gap_end:
            newest = self._gap_end
        failures: list[tuple[int, Exception]] = []
        subscribers = self._subscriber_snapshot
        for position, (event, key) in enumerate(zip(events, keys, strict=True)):
            if event.event_id != newest + 1 and (ring or self._gap_end):
                log.warning("non_consecutive_event_id", expected_event_id=newest + 1, event_id=event.event_id)
            data = event.data
            try:
                if type(data) is Stored:
                    self._store(key, data)
                else:
                    self._remove(key, data)  # type: ignore[arg-type]
            except Exception as error:  # as apply() raising: not buffered, not announced
                failures.append((position, error))
                continue
            ring.append(event)
            newest = event.event_id
            self._applied += 1
            if subscribers:
                self._announce(event)
        self._dump_cache = None
        return failures

    def _run_keys(self, events: Sequence[RouterEvent]) -> list[StoreKey] | None:
        """The store key of every event of an :meth:`apply_run`, or None (see there)."""
        if not events or events[0].event_id < 0 or events[-1].event_id > U64_MAX:
            return None
        ring = self._ring
        if ring or self._gap_end:
            newest = ring.newest_id() if ring else 0
            if events[0].event_id <= max(newest, self._gap_end):
                return None
        keys: list[StoreKey] = []
        expected = events[0].event_id
        routes = self._routes
        for event in events:
            cls = type(event.data)
            if type(event) is not RouterEvent or event.residency_domain is not _WORKER:
                return None
            if event.event_id != expected or (cls is not Stored and cls is not Removed):
                return None
            expected += 1
            try:
                key = routes.get((_WORKER, event.worker_id, event.dp_rank, None, event.storage_tier))
                if key is None:
                    key = self._store_key(event)
            except (IndexApplyError, TypeError):  # an unhashable or unknown field: apply() refuses it
                return None
            keys.append(key)
        return keys

    # --- blocks applied by a reader of event columns (a stream replica: kvagent/stream/apply.py) -------------

    def route_stores(self, routes: Sequence[RouterEvent]) -> list[ResidentStore]:
        """The store of each route (an event standing for its route, its data ignored), created when absent,
        for a reader that stores and removes blocks itself and then calls :meth:`applied_directly`.

        Such an index keeps no ring of those events: it answers ranges from before the last id with a dump.
        A CacheOwner route names its owner's worker and rank in dumps, the last route listed winning.
        """
        stores: list[ResidentStore] = []
        for event in routes:
            key = self._store_key(event)
            if event.residency_domain is _CACHE_OWNER:
                if event.storage_tier is _DEVICE:
                    raise IndexApplyError("CacheOwner residency cannot target the Device tier")
                self._cache_owner_workers[key[0]] = (event.worker_id, event.dp_rank)  # type: ignore[index]
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = self._new_store()
            stores.append(store)
        return stores

    def clear_route(self, route: RouterEvent) -> None:
        """A Cleared on ``route`` (see :meth:`apply`), for the same reader; stores it got before may be gone."""
        key = self._store_key(route)
        self._clear(key[0])
        if route.residency_domain is _CACHE_OWNER:
            self._cache_owner_workers[key[0]] = (route.worker_id, route.dp_rank)  # type: ignore[index]

    def applied_directly(self, last_event_id: int) -> None:
        """Blocks were stored and removed through :meth:`route_stores`: every id up to ``last_event_id``
        is applied. Emptied stores go, cached dumps are forgotten, and the ring starts over after it."""
        if not 0 <= last_event_id <= U64_MAX:
            raise ValueError(f"event id {last_event_id} is not a u64")
        for key in [key for key, store in self._stores.items() if not store]:
            del self._stores[key]
        newest = max(last_event_id, self.current_event_id())
        self._ring = EventRing(self.ring_capacity)
        self._gap_floor = self._gap_end = newest
        self._applied += 1
        self._dump_cache = self._snapshot_cache = None

    def _remove(self, key: StoreKey, data: Removed) -> None:
        store = self._stores.get(key)
        if store is not None:
            store.remove(data.block_hashes)
            if not store:
                del self._stores[key]

    def _store_key(self, event: RouterEvent) -> StoreKey:
        domain = event.residency_domain
        # A Worker route does not depend on state_source (every outbound event carries the agent's owner).
        source = event.state_source if domain is _CACHE_OWNER else None
        route = (domain, event.worker_id, event.dp_rank, source, event.storage_tier)
        try:
            key = self._routes.get(route)
        except TypeError:  # an unhashable field: not one of the value types the route needs
            raise IndexApplyError(
                f"unknown storage tier or residency domain in event {event.event_id}"
            ) from None
        return self._route(event, route) if key is None else key

    def _store(self, key: StoreKey, data: Stored) -> None:
        hashes, tokens, parent = data.block_hashes, data.tokens_hashes, data.parent_hash
        if (
            len(tokens) != len(hashes)
            or (data.mm_extra_infos is not None and len(data.mm_extra_infos) != len(hashes))
            or (
                hashes
                and (min(hashes) < 0 or max(hashes) > U64_MAX or min(tokens) < 0 or max(tokens) > U64_MAX)
            )
            or (parent is not None and not 0 <= parent <= U64_MAX)
        ):
            _validate_stored(data)  # raises, naming what is wrong
        store = self._stores.get(key)
        if store is None:
            store = self._stores[key] = self._new_store()
        store.store(parent, hashes, tokens, data.mm_extra_infos)

    def _announce(self, event: RouterEvent) -> None:
        for callback in self._subscriber_snapshot:
            try:
                callback(event)
            except Exception as exc:
                # The event is applied; a broken follower must not make the coordinator treat it as failed.
                log.exception("index_subscriber_failed", event_id=event.event_id, error=str(exc))

    def _route(self, event: RouterEvent, route: tuple[object, ...]) -> StoreKey:
        """The (exact owner, tier) an event's residency lives under, validated once per distinct route."""
        if not isinstance(event.storage_tier, StorageTier):
            raise IndexApplyError(f"unknown storage tier {event.storage_tier!r}")
        domain = event.residency_domain
        if domain is not ResidencyDomain.WORKER and domain is not ResidencyDomain.CACHE_OWNER:
            raise IndexApplyError(f"unsupported residency domain {domain!r}")
        owner = residency_owner(event)
        if owner is None:
            raise IndexApplyError("CacheOwner residency event has no state_source")
        if len(self._routes) >= _MAX_ROUTES:
            self._routes.clear()
        key = self._routes[route] = (owner, event.storage_tier)
        return key

    def _clear(self, owner: ResidencyOwner) -> None:
        """A Worker clear drops every Worker owner of the event's rank; a CacheOwner clear drops that owner."""
        if isinstance(owner, WorkerWithDpRank):
            rank = owner.dp_rank
            doomed = [
                key for key in self._stores if isinstance(key[0], WorkerWithDpRank) and key[0].dp_rank == rank
            ]
        else:
            doomed = [key for key in self._stores if key[0] == owner]
        for key in doomed:
            del self._stores[key]

    # --- subscribers -------------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[RouterEvent], None]) -> Callable[[], None]:
        """Call ``callback`` synchronously after every successful apply; returns an idempotent unsubscribe."""
        token = object()
        self._subscribers[token] = callback
        self._subscriber_snapshot = tuple(self._subscribers.values())

        def unsubscribe() -> None:
            if self._subscribers.pop(token, None) is not None:
                self._subscriber_snapshot = tuple(self._subscribers.values())

        return unsubscribe

    # --- ring queries ------------------------------------------------------------------------------

    def current_event_id(self) -> int:
        ring = self._ring
        if ring:
            newest = ring.newest_id()
            if newest > self._gap_end:
                return newest
        return self._gap_end

    def oldest_buffered_id(self) -> int | None:
        return self._ring.oldest_id()

    def events_in_range(self, start: int | None, end: int | None) -> RangeAnswer:
        """4.4, checked in order: InvalidRange, TreeDump, TooNew, Events (start through newest)."""
        if start is not None and end is not None and end < start:
            return InvalidRangeAnswer(start, end)
        if not self._ring_covers(start):
            try:
                return self.tree_dump()
            except Exception as exc:  # 4.5: any failure becomes TreeDumpFailed, never an empty dump
                log.exception("index_tree_dump_failed", error=str(exc))
                return TreeDumpFailedAnswer(self.current_event_id(), str(exc))
        assert start is not None  # _ring_covers(None) is False
        newest = self.current_event_id()
        if start > newest:
            return TooNewAnswer(start, end, newest)
        return EventsAnswer(RingEvents(self._ring.tail(start)), newest)

    def answers_with_dump(self, start: int | None, end: int | None) -> bool:
        """Whether a range from ``start`` is answered with a tree dump (heavy work), without building it."""
        return not self._ring_covers(start) and not (start is not None and end is not None and end < start)

    def _ring_covers(self, start: int | None) -> bool:
        """Every event from ``start`` on is in the ring (ids of the gap count as present and empty)."""
        if start is None:
            return False
        oldest = self._ring.oldest_id()
        if oldest is not None and start >= oldest:
            return True
        if not self._gap_floor < start <= self._gap_end + 1:
            return False
        return oldest is None or oldest <= self._gap_end + 1

    def range_or_snapshot(self, start: int | None, end: int | None) -> RangeAnswer | DumpSnapshot:
        """:meth:`events_in_range`, except that a tree dump comes as an unencoded :class:`DumpSnapshot`.

        For servers that encode the dump themselves (from the columns, off the per-event objects).
        """
        cached = self._snapshot_cache
        if cached is not None and cached[0] != self._applied:
            # Stale: release the copy now rather than hold a whole dump until the next one.
            self._snapshot_cache = None
        if self.answers_with_dump(start, end):
            try:
                return self.dump_snapshot()
            except Exception as exc:  # 4.5: any failure becomes TreeDumpFailed, never an empty dump
                log.exception("index_tree_dump_failed", error=str(exc))
                return TreeDumpFailedAnswer(self.current_event_id(), str(exc))
        return self.events_in_range(start, end)

    def ring_tail(self, start: int) -> tuple[RouterEvent, ...]:
        """The buffered events with id >= ``start``, oldest first (decoded from the ring's columns)."""
        return RingEvents(self._ring.tail(start)).decoded()

    def ring_range(self, start: int) -> RingRange:
        """The buffered events with id >= ``start`` as column pieces (a snapshot: later applies and
        evictions leave it as it is); encoders read it without building events."""
        return self._ring.tail(start)

    def ring_between(self, first_id: int, last_id: int) -> RingRange | None:
        """The buffered events with ids first_id..last_id, when all of them (consecutive ids) are buffered."""
        return self._ring.between(first_id, last_id)

    # --- the applied events for one trailing reader (the persistence writer, issue #34) -------------

    def retain_applied(self, on: bool) -> None:
        """Keep (True) the ring's segments past their eviction until :meth:`release_applied_through`, so a
        reader that trails the ring reads every applied event from its columns (no subscription, which
        would make every apply call back per event); False drops what is kept."""
        self._ring.retain(on)

    def applied_after(self, event_id: int) -> RingRange:
        """Every applied event with id above ``event_id`` the ring holds or retains, as column pieces."""
        return self._ring.applied_after(event_id)

    def release_applied_through(self, event_id: int) -> None:
        self._ring.release_through(event_id)

    def retained_applied_events(self) -> int:
        """Events kept past their eviction from the ring (see :meth:`retain_applied`)."""
        return self._ring.retained_events()

    # --- restore (issue #17) ----------------------------------------------------------------------

    def restore(
        self,
        snapshot_events: Iterable[RouterEvent],
        suffix_events: Iterable[RouterEvent],
        *,
        snapshot_id: int | None = None,
    ) -> None:
        """A restarted agent's persisted state: a tree dump taken at outbound id ``snapshot_id`` (its events'
        own ids are dump positions, ignored), then the outbound events after it, with their original ids.

        Only into an empty index with no subscribers (nobody is told): the state and ring are as if the
        events had been applied, and :meth:`current_event_id` is the newest suffix id (else ``snapshot_id``,
        else 0).  Raises IndexApplyError on an event that does not apply.
        """
        if self._ring or self._stores or self._subscribers or self._gap_end:
            raise RuntimeError("restore needs an empty index with no subscribers")
        with gc_paused():
            self._restore_snapshot(snapshot_events)
        if snapshot_id:
            self._gap_floor = self._gap_end = snapshot_id
        self._applied += 1
        self._dump_cache = self._snapshot_cache = None
        for event in suffix_events:
            self.apply(event)

    def _restore_snapshot(self, events: Iterable[RouterEvent]) -> None:
        """Apply a dump's one-block stores, a chain at a time: a dump lists each chain's blocks in a row, so
        consecutive blocks of one route, each the child of the one before, are one store (as when live)."""
        first: RouterEvent | None = None  # the first event of the chain being gathered
        hashes: list[int] = []
        tokens: list[int] = []
        for event in events:
            data = event.data
            if (
                first is not None
                and type(data) is Stored
                and data.parent_hash == hashes[-1]
                and len(data.block_hashes) == 1
                and data.mm_extra_infos is None
                and event.storage_tier is first.storage_tier
                and event.worker_id == first.worker_id
                and event.dp_rank == first.dp_rank
                and event.residency_domain is first.residency_domain
                and event.state_source == first.state_source
            ):
                hashes.append(data.block_hashes[0])
                tokens.append(data.tokens_hashes[0])
                continue
            if first is not None:
                self._restore_chain(first, hashes, tokens)
                first = None
            if type(data) is Stored and len(data.block_hashes) == 1 and data.mm_extra_infos is None:
                first, hashes, tokens = event, [data.block_hashes[0]], [data.tokens_hashes[0]]
            else:
                self._restore_state(event)
        if first is not None:
            self._restore_chain(first, hashes, tokens)

    def _restore_chain(self, first: RouterEvent, hashes: list[int], tokens: list[int]) -> None:
        parent = first.data.parent_hash if type(first.data) is Stored else None
        self._restore_state(attrs.evolve(first, data=Stored(parent, tuple(hashes), tuple(tokens))))

    def _restore_state(self, event: RouterEvent) -> None:
        data = event.data
        key = self._store_key(event)
        if type(data) is Stored:
            self._store(key, data)
        elif type(data) is Removed:
            store = self._stores.get(key)
            if store is not None:
                store.remove(data.block_hashes)
                if not store:
                    del self._stores[key]
        elif type(data) is Cleared:
            self._clear(key[0])
        else:
            raise IndexApplyError(f"unknown event data {type(data).__name__}")
        if event.residency_domain is _CACHE_OWNER:
            self._cache_owner_workers[key[0]] = (event.worker_id, event.dp_rank)  # type: ignore[index]

    def skip_to(self, event_id: int) -> None:
        """Ids up to ``event_id`` exist and carry no event (a crash skipped them): the next applied id must
        be above it, and a range from any start in (current, event_id + 1] is answered with the events after
        it, no dump.  A no-op unless ``event_id`` is above :meth:`current_event_id`."""
        current = self.current_event_id()
        if event_id <= current:
            return
        if event_id > U64_MAX:
            raise ValueError(f"event id {event_id} is not a u64")
        ring = self._ring
        # Contiguous with the gap already known (a restore with no suffix): one gap from its floor.
        self._gap_floor = self._gap_floor if not ring or ring.newest_id() <= self._gap_end else current
        self._gap_end = event_id
        self._dump_cache = self._snapshot_cache = None

    # --- state views -------------------------------------------------------------------------------

    def resident_blocks(self) -> frozenset[tuple[ResidencyOwner, StorageTier, int]]:
        return frozenset(
            (owner, tier, block_hash)
            for (owner, tier), store in self._stores.items()
            for block_hash in store.hashes()
        )

    def resident_worker_blocks(self) -> Iterator[tuple[int, StorageTier, int]]:
        """``(dp_rank, tier, block hash)`` of every resident Worker block (a restored coordinator's dedup)."""
        for (owner, tier), store in list(self._stores.items()):
            if isinstance(owner, WorkerWithDpRank):
                rank = owner.dp_rank
                for block_hash in store.hashes():
                    yield rank, tier, block_hash

    @property
    def resident_block_count(self) -> int:
        return sum(len(store) for store in self._stores.values())

    # --- tree dumps --------------------------------------------------------------------------------

    def tree_dump(self) -> TreeDumpAnswer:
        """Every resident block as a one-block Stored event, parents first; reset scope All (4.5).

        The dump is cached until the next apply.
        """
        cached = self._dump_cache
        if cached is None:
            snapshot = self.dump_snapshot()
            events: list[RouterEvent] = []
            with gc_paused():
                for worker_id, tier, domain, dp_rank, source, columns in snapshot.groups:
                    route = EventRoute(worker_id, tier, domain, dp_rank, source, None)
                    events += resident_row_events(
                        route, columns.hashes, columns.parents, columns.tokens, columns.flags, columns.mm, len(events)
                    )
            cached = self._dump_cache = TreeDumpAnswer(tuple(events), snapshot.last_event_id, RESET_ALL)
        return cached

    def dump_snapshot(self) -> DumpSnapshot:
        """A consistent copy of every store's columns in parent-first order; cached until the next apply.

        Ordered stores are copied at C speed (about 10 ns a block); see BlockStore.columns.
        """
        cached = self._snapshot_cache
        if cached is not None and cached[0] == self._applied:
            return cached[1]
        groups = tuple(
            DumpGroup(worker_id, tier, domain, dp_rank, source, store.columns())
            for worker_id, tier, domain, dp_rank, source, store in self._dump_groups()
        )
        snapshot = DumpSnapshot(groups, self.current_event_id(), sum(g.columns.live for g in groups))
        self._snapshot_cache = (self._applied, snapshot)
        return snapshot

    def _dump_groups(
        self,
    ) -> Iterator[tuple[int, StorageTier, ResidencyDomain, int, CacheOwnerId | None, ResidentStore]]:
        """(worker_id, tier, domain, dp_rank, state_source, store) for each (owner, tier)."""
        for (owner, tier), store in list(self._stores.items()):
            if isinstance(owner, WorkerWithDpRank):
                yield owner.worker_id, tier, ResidencyDomain.WORKER, owner.dp_rank, None, store
            else:
                worker_id, dp_rank = self._cache_owner_workers[owner]
                yield worker_id, tier, ResidencyDomain.CACHE_OWNER, dp_rank, owner, store
