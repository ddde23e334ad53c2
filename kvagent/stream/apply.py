"""Apply a stream entry's event columns to a replica's index, without a RouterEvent per event (issue #36).

Sans-IO.  :func:`apply_entry` resolves the entry's routes to the index's stores once
(``RecoveryIndex.route_stores``), then hands the columns to :func:`run_ops`: the compiled loop of
``kvagent/_native/_stream.pyx`` when built, else :func:`run_ops_python`, its twin (tests/unit/test_stream_apply.py
pins the two to the same index state).  The loop stores and removes each event's blocks and stops at a
``Cleared``, which the index applies (``clear_route``) before the loop goes on.  The index then holds every
id up to the entry's last (``applied_directly``): a replica answers nothing from a ring, so it keeps none.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from itertools import compress
from typing import TypeAlias

from kvagent import _native
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.index.store import ResidentStore
from kvagent.model.events import CLEARED, RouterEvent, StoredExtra
from kvagent.stream.format import (
    KIND_CLEARED,
    KIND_REMOVED,
    KIND_STORED_CHILD,
    EntryColumns,
)

__all__ = ["RunOps", "apply_entry", "run_ops", "run_ops_python"]

_IS_STORE = bytes((1, 1, 0, 0)) + bytes(252)  # kind -> 1 for a Stored

# (stores by route code, kinds, route codes, counts, hashes, tokens, parents, extras, position, offsets
# (hashes, tokens, parents) at it) -> (the position of the next Cleared or the end, the offsets there)
RunOps: TypeAlias = Callable[
    [
        Sequence[ResidentStore | None],
        bytes,
        Sequence[int],
        Sequence[int],
        Sequence[int],
        Sequence[int],
        Sequence[int],
        dict[int, StoredExtra],
        int,
        tuple[int, int, int],
    ],
    tuple[int, tuple[int, int, int]],
]


def run_ops_python(
    stores: Sequence[ResidentStore | None],
    kinds: bytes,
    codes: Sequence[int],
    counts: Sequence[int],
    hashes: Sequence[int],
    tokens: Sequence[int],
    parents: Sequence[int],
    extras: dict[int, StoredExtra],
    position: int,
    offsets: tuple[int, int, int],
) -> tuple[int, tuple[int, int, int]]:
    """Store and remove the blocks of events ``position..`` up to the next Cleared (or the end)."""
    at, stored_at, parent_at = offsets
    end = len(kinds)
    while position < end:
        kind = kinds[position]
        if kind == KIND_CLEARED:
            break
        count = counts[position]
        store = stores[codes[position]]
        assert store is not None  # apply_entry resolves every route a Stored or Removed names
        if kind == KIND_REMOVED:
            store.remove(tuple(hashes[at : at + count]))
        else:
            parent = None
            if kind == KIND_STORED_CHILD:
                parent, parent_at = parents[parent_at], parent_at + 1
            extra = extras.get(position) if extras else None
            store.store(
                parent,
                tuple(hashes[at : at + count]),
                tuple(tokens[stored_at : stored_at + count]),
                None if extra is None else extra[1],
            )
            stored_at += count
        at += count
        position += 1
    return position, (at, stored_at, parent_at)


def _native_run_ops() -> RunOps | None:
    module, _ = _native._load_extension("_stream")  # the switch of every other compiled module
    if module is None:
        return None
    run: RunOps = module.run_ops
    return run


# The compiled loop when built and not switched off (KVAGENT_NO_NATIVE=1), else the Python one.
run_ops: RunOps = _native_run_ops() or run_ops_python


def _route_event(columns: EntryColumns, code: int) -> RouterEvent:
    worker_id, tier, domain, dp_rank, source, session = columns.routes[code]
    return RouterEvent(worker_id, tier, domain, 0, CLEARED, dp_rank, source, session)


def _start(columns: EntryColumns, after: int) -> int:
    """The position of the entry's first event with an id above ``after``."""
    if columns.ids is None:
        return min(len(columns), max(0, after + 1 - columns.first_id))
    return next((i for i, event_id in enumerate(columns.ids) if event_id > after), len(columns))


def _routes_by_last_use(columns: EntryColumns, position: int) -> list[int]:
    """The route codes a Stored or Removed from ``position`` on names, the one used last at the end."""
    kinds, codes = columns.kinds, columns.route_codes
    if len(columns.routes) <= 256 and KIND_CLEARED not in kinds:
        narrow = array("B", codes).tobytes()  # one byte a code: its last use is a search from the end
        last_use = {code: narrow.rfind(code, position) for code in range(len(columns.routes))}
    else:
        last_use = {
            code: i
            for i, (kind, code) in enumerate(zip(kinds, codes, strict=True))
            if kind != KIND_CLEARED and i >= position
        }
    return sorted((code for code, at in last_use.items() if at >= 0), key=last_use.__getitem__)


def apply_entry(
    index: RecoveryIndex, columns: EntryColumns, *, after: int, last: int, run: RunOps | None = None
) -> int:
    """Apply the entry's events with ids above ``after`` to ``index``; every id up to ``last`` then exists.

    Returns how many events were applied.  Raises IndexApplyError (the index then holds part of the entry:
    the caller starts over from a snapshot) on a route the index refuses.
    """
    run = run or run_ops
    kinds, codes, counts = columns.kinds, columns.route_codes, columns.counts
    position = _start(columns, after)
    # Offsets of the first event to apply in the hash, tokens and parent columns.
    head_kinds = kinds[:position]
    offsets = (
        sum(counts[:position]),
        sum(compress(counts[:position], head_kinds.translate(_IS_STORE))),
        head_kinds.count(KIND_STORED_CHILD),
    )
    # The routes the rest stores or removes on, by last use (the newest event names a CacheOwner's worker).
    used = _routes_by_last_use(columns, position)
    hashes, tokens, parents = columns.hashes, columns.tokens, columns.parents
    extras = columns.extras
    applied = len(columns) - position

    def resolve() -> list[ResidentStore | None]:
        stores: list[ResidentStore | None] = [None] * len(columns.routes)
        for code, store in zip(
            used, index.route_stores([_route_event(columns, c) for c in used]), strict=True
        ):
            stores[code] = store
        return stores

    stores = resolve()
    end = len(columns)
    while position < end:
        position, offsets = run(
            stores, kinds, codes, counts, hashes, tokens, parents, extras, position, offsets
        )
        if position < end:  # a Cleared: the index drops the owner's stores, so they are resolved again
            index.clear_route(_route_event(columns, codes[position]))
            stores = resolve()
            position += 1
    index.applied_directly(last)
    return applied
