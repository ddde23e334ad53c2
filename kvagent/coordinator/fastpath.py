"""The coordinator's batch-level fast path for the common chunk shape (issue #18).

Most chunks hold only Worker-domain stores and removes of the slot's own rank (no Cleared, no CacheOwner
event). For those, :func:`apply_plain_chunk` does in one loop what the general loop in
``SlotCoordinator._apply_locally`` does event by event: coalescing (skipped when no adjacent pair could
merge), dedup, outbound ids (the lease checked once for the whole chunk), RouterEvents, and one index
apply for the chunk (``RecoveryIndex.apply_run``).
Anything else — a barrier, another rank or domain, ids too close to the lease or to U64_MAX — returns
``None`` before touching any state, and the general loop, which defines the behaviour, takes the chunk.
``tests/unit/test_fast_path_batch.py`` pins the two to the same outbound events, index state and counters.

With the compiled core (kvagent/_native) the checks, coalescing, dedup and stamping are one native pass
(``stamp_plain_chunk`` of ``_ingest.pyx``); :func:`stamp_plain_chunk` here is its pure-Python twin, and
the same tests run both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from kvagent._native import IngestCore
from kvagent.coordinator.coalesce import coalesce
from kvagent.coordinator.dedup import DedupFilter
from kvagent.model.events import PlacementEvent, Removed, ResidencyDomain, RouterEvent, Stored
from kvagent.model.ids import CacheOwnerId

__all__ = ["apply_plain_chunk", "is_plain_chunk", "may_coalesce", "stamp_plain_chunk"]

log = structlog.get_logger(__name__)

_WORKER = ResidencyDomain.WORKER


def is_plain_chunk(events: Sequence[PlacementEvent], slot_rank: int) -> bool:
    """Only Worker-domain Stored/Removed of ``slot_rank``: no barrier, no CacheOwner, no rank to reject."""
    for event in events:
        cls = type(event.data)
        if (
            (cls is not Stored and cls is not Removed)
            or event.domain is not _WORKER
            or event.dp_rank != slot_rank
        ):
            return False
    return True


def may_coalesce(events: Sequence[PlacementEvent]) -> bool:
    """Whether :func:`coalesce` could merge any adjacent pair (conservative: True may still merge nothing).

    coalesce merges only an event into the run before it: two removes, or a store whose parent is the
    previous store's last block. When no adjacent pair qualifies every run is one event, returned as is,
    so the output is the input.
    """
    previous: object = None
    previous_data: object = None
    for event in events:
        data = event.data
        cls = type(data)
        if previous is cls:
            if cls is Removed:
                return True
            hashes = previous_data.block_hashes  # type: ignore[attr-defined]
            if hashes and data.parent_hash == hashes[-1]:  # type: ignore[union-attr]
                return True
        previous, previous_data = cls, data
    return False


def apply_plain_chunk(
    events: Sequence[PlacementEvent],
    *,
    slot_rank: int,
    worker_id: int,
    owner: CacheOwnerId,
    first_id: int,
    id_limit: int,
    dedup: DedupFilter,
    apply: Callable[[RouterEvent], None],
    apply_run: Callable[[Sequence[RouterEvent]], list[tuple[int, Exception]] | None] | None,
    output: list[RouterEvent],
    ids_taken: Callable[[int], None],
    native: IngestCore | None = None,
) -> int | None:
    """Apply a plain chunk (see :func:`is_plain_chunk`); returns how many removes dedup swallowed.

    ``apply_run`` (the index's batch apply, if it has one) applies the stamped events at once; when it
    declines, or is None, each goes through ``apply``. ``ids_taken(next_id)`` is told the next free outbound
    id once the loop ends, however it ends. ``None``: the chunk is not plain, or could need an id at or past
    ``id_limit`` (the lease end or U64_MAX), where the general loop raises at the exact event; nothing was
    touched. ``native`` (the compiled core, kvagent/_native) does the checks, coalescing, dedup and stamping
    in one pass instead of :func:`stamp_plain_chunk`.
    """
    done: tuple[list[RouterEvent], int] | None
    if native is not None:
        done = native.stamp_plain_chunk(
            events, slot_rank, worker_id, owner, first_id, id_limit, dedup, coalesce, ids_taken
        )
    else:
        done = stamp_plain_chunk(
            events,
            slot_rank=slot_rank,
            worker_id=worker_id,
            owner=owner,
            first_id=first_id,
            id_limit=id_limit,
            dedup=dedup.filter,
            ids_taken=ids_taken,
        )
    if done is None:
        return None
    stamped, swallowed = done
    failures = apply_run(stamped) if apply_run is not None and stamped else None
    if failures is None:
        failures = []
        for position, router_event in enumerate(stamped):
            try:
                apply(router_event)
            except Exception as refused:
                failures.append((position, refused))
    for position, error in failures:  # Stored/Removed are lossy: logged, published, the chunk goes on
        log.warning(
            "local_apply_failed",
            worker_id=worker_id,
            dp_rank=stamped[position].dp_rank,
            domain=_WORKER.value,
            error=str(error),
        )
    output.extend(stamped)
    return swallowed


def stamp_plain_chunk(
    events: Sequence[PlacementEvent],
    *,
    slot_rank: int,
    worker_id: int,
    owner: CacheOwnerId,
    first_id: int,
    id_limit: int,
    dedup: Callable[[PlacementEvent], PlacementEvent | None],
    ids_taken: Callable[[int], None],
) -> tuple[list[RouterEvent], int] | None:
    """(the RouterEvents, removes swallowed) of a plain chunk: coalesced, deduplicated and numbered.

    None, touching nothing, when the chunk is not plain or could need an id at or past ``id_limit``.
    """
    if not is_plain_chunk(events, slot_rank):
        return None
    merged = coalesce(events) if may_coalesce(events) else events
    if first_id + len(merged) > id_limit:
        return None
    event_id = first_id
    swallowed = 0
    stamped: list[RouterEvent] = []
    append = stamped.append
    try:
        for coalesced in merged:
            event = dedup(coalesced)
            if event is None:
                swallowed += 1
                continue
            append(
                RouterEvent(
                    worker_id,
                    event.tier,
                    _WORKER,
                    event_id,
                    event.data,
                    event.dp_rank,
                    owner,
                    event.session_id,
                )
            )
            event_id += 1
    finally:
        ids_taken(event_id)
    return stamped, swallowed
