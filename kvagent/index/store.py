"""Compact resident-block storage for one (residency owner, storage tier) of the recovery index.

A million resident blocks must fit in about 200 bytes each (with everything else ``kvagent serve`` holds), so
there is no Python object per block beyond the dict entry: ``slots`` maps a block hash to a *base row*, and
the row's block hash, parent hash and tokens hash live in ``array('Q')`` columns (8 bytes each) with a
one-byte flag column (root, has a parent, dead).  Multimodal info is rare, so it is kept in a sparse dict
keyed by row.

A base row is shared by up to ``_BASE_SPAN`` consecutive rows (a chain stored in one go, a run moved by
compaction): one int object for them all instead of one each (32 bytes a block).  A block's row is found
from its base with ``array.index`` at C speed, at most ``_BASE_SPAN`` rows on (hashes are unique among live
rows and dead rows hold 0, so only hash 0 needs the flags to tell its row from a dead one).

Rows are append-only: a new block always gets a new row at the end and a removed block's row is zeroed and
flagged dead (never reused); the columns are compacted (in order) when more than half of them are dead.  So
row order is always the dict's insertion order, and a tree dump is a copy of the columns (C speed) once a
C-speed check has confirmed that every resident parent sits in an earlier row; only when one does not (a
re-stored parent, a reparenting) does the dump fall back to the per-block :meth:`BlockStore.replay_order`.

:data:`NativeBlockStore` (kvagent/_native/_store.pyx, when built and not switched off) keeps the same rows,
dead rows and compaction steps, so every observable is identical, with a C hash table in place of the dict
(no Python object per block); :func:`new_block_store` is the one the index uses.
"""

from __future__ import annotations

import importlib
import itertools
import operator
import re
from array import array
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple, Protocol

from kvagent import _native
from kvagent.model.events import FLAG_DEAD, FLAG_PARENT, FLAG_ROOT, MmExtraInfo

__all__ = [
    "BlockStore",
    "NativeBlockStore",
    "ResidentStore",
    "StoreColumns",
    "native_store_class",
    "new_block_store",
]

# Below this many dead rows compaction is not worth the rebuild.
_COMPACT_MIN_FREE = 4096
# Live rows moved per store or remove while a compaction runs: a few tens of microseconds of work each.
_COMPACT_STEP_ROWS = 256
# Rows sharing one base row in the dict (bounds the scan that finds a row from its base).
_BASE_SPAN = 16


# bytes.translate table turning the flag column into a 0/1 "row is live" mask for itertools.compress.
_LIVE_MASK = bytes(0 if value == FLAG_DEAD else 1 for value in range(256))
_HAS_PARENT = bytes(1 if value == FLAG_PARENT else 0 for value in range(256))
_NONZERO = bytes(0 if value == 0 else 1 for value in range(256))
# A run of live rows in the flag column (every flag but FLAG_DEAD).
_LIVE_RUN = re.compile(b"[^%c]+" % FLAG_DEAD)


def _native_parents_first() -> Callable[..., bool] | None:
    """The compiled order check (kvagent/_native/_columns.pyx) when built, else None (the Python check)."""
    try:
        # Imported by name: kvagent._native is an optional build product (no package in the import layers).
        check: Callable[..., bool] = importlib.import_module("kvagent._native._columns").parents_first
    except (ImportError, AttributeError):
        return None
    return check


_PARENTS_FIRST = _native_parents_first()


class StoreColumns(NamedTuple):
    """A consistent copy of one store in parent-first row order (dead rows flagged, to be skipped).

    ``mm`` maps a row to its multimodal info.  ``live`` is the number of rows not flagged dead.
    """

    hashes: array[int]
    parents: array[int]
    tokens: array[int]
    flags: bytes
    mm: dict[int, MmExtraInfo]
    live: int

    def masks(self) -> tuple[bytes, bytes]:
        """(is live, has a parent): one 0/1 byte per row each, computed at C speed from the flags."""
        return self.flags.translate(_LIVE_MASK), self.flags.translate(_HAS_PARENT)


class BlockStore:
    __slots__ = (
        "_compact_read",
        "_compact_write",
        "_dead",
        "_flags",
        "_hashes",
        "_mm",
        "_parents",
        "_slots",
        "_tokens",
    )

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}
        self._hashes = array("Q")
        self._parents = array("Q")
        self._tokens = array("Q")
        self._flags = bytearray()
        self._dead = 0
        self._mm: dict[int, MmExtraInfo] = {}
        # The scan and destination rows of a compaction in progress; -1 when none runs.
        self._compact_read = self._compact_write = -1

    def _parts(
        self,
    ) -> tuple[dict[int, int], array[int], array[int], array[int], bytearray, dict[int, MmExtraInfo]]:
        """The row map and the columns (local names in the hot loops)."""
        return self._slots, self._hashes, self._parents, self._tokens, self._flags, self._mm

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def _row(self, block_hash: int, base: int | None) -> int:
        """The row of a resident block whose base row is ``base`` (-1 when ``base`` is None: not resident)."""
        if base is None:
            return -1
        hashes = self._hashes
        row = hashes.index(block_hash, base, base + _BASE_SPAN)
        if block_hash == 0:
            flags = self._flags
            while flags[row] == FLAG_DEAD:
                row = hashes.index(0, row + 1, base + _BASE_SPAN)
        return row

    def row_of(self, block_hash: int) -> int:
        """The row of ``block_hash``, or -1 when it is not resident."""
        return self._row(block_hash, self._slots.get(block_hash))

    def hashes(self) -> Iterator[int]:
        return iter(self._slots)

    def store(
        self,
        parent_hash: int | None,
        block_hashes: tuple[int, ...],
        tokens_hashes: tuple[int, ...],
        mm_extra_infos: tuple[MmExtraInfo | None, ...] | None,
    ) -> None:
        """Add (or overwrite) a chain: block i's parent is block i-1, block 0's is ``parent_hash``.

        The caller has validated lengths and u64 ranges, so nothing here can fail half-way.
        """
        slots, hashes, parents, tokens, flags, mm = self._parts()
        if self._compact_read >= 0:
            self._compact_step()
        count = len(block_hashes)
        if count and slots.keys().isdisjoint(block_hashes) and len(set(block_hashes)) == count:
            # The ingest hot path: a chain of new, distinct blocks is appended column by column (C speed).
            base = len(hashes)
            slots.update(zip(block_hashes, _bases(base, count), strict=True))
            hashes.extend(block_hashes)
            tokens.extend(tokens_hashes)
            parents.append(0 if parent_hash is None else parent_hash)
            parents.extend(block_hashes[:-1])
            flags.append(FLAG_ROOT if parent_hash is None else FLAG_PARENT)
            flags.extend(bytes((FLAG_PARENT,)) * (count - 1))
            if mm_extra_infos is not None:
                for index, info in enumerate(mm_extra_infos):
                    if info is not None:
                        mm[base + index] = info
            return
        parent = parent_hash
        for index, block_hash in enumerate(block_hashes):
            slot = self._row(block_hash, slots.get(block_hash))
            if slot < 0:
                slot = slots[block_hash] = len(hashes)
                hashes.append(block_hash)
                parents.append(0)
                tokens.append(0)
                flags.append(FLAG_ROOT)
            if parent is None:
                parents[slot] = 0
                flags[slot] = FLAG_ROOT
            else:
                parents[slot] = parent
                flags[slot] = FLAG_PARENT
            tokens[slot] = tokens_hashes[index]
            info = None if mm_extra_infos is None else mm_extra_infos[index]
            if info is None:
                if mm:
                    mm.pop(slot, None)
            else:
                mm[slot] = info
            parent = block_hash

    def remove(self, block_hashes: tuple[int, ...]) -> None:
        """Delete the given hashes; unknown hashes are ignored."""
        slots, hashes, parents, tokens, flags, mm = self._parts()
        dead = self._dead
        row_of = self._row
        for block_hash in block_hashes:
            base = slots.pop(block_hash, None)
            if base is not None:
                slot = row_of(block_hash, base)
                # Zeroed so a dump never carries a removed block's data and the order check never
                # follows a stale parent.
                hashes[slot] = parents[slot] = tokens[slot] = 0
                flags[slot] = FLAG_DEAD
                dead += 1
                if mm:
                    mm.pop(slot, None)
        self._dead = dead
        if not slots:
            # Drop the columns outright rather than keep dead rows for an empty store.
            self._hashes, self._parents, self._tokens = array("Q"), array("Q"), array("Q")
            self._flags, self._slots, self._mm, self._dead = bytearray(), {}, {}, 0
            self._compact_read = self._compact_write = -1
        elif self._compact_read >= 0:
            self._compact_step()
        elif dead > _COMPACT_MIN_FREE and dead > len(slots):
            self._compact_read = self._compact_write = self._flags.find(FLAG_DEAD)
            self._compact_step()

    def _compact_step(self) -> None:
        """Move up to ``_COMPACT_STEP_ROWS`` live rows down over dead ones; truncate once the scan is done.

        Compaction runs a little at every store and remove instead of all at once, so it never stalls the
        event loop (a full rebuild of a million rows takes a good fraction of a second). Rows only move down
        and keep their order, so row order stays the dict's order; every row between the write and the read
        position is dead (zeroed and flagged), and so is every row a move vacates. Whole runs of live rows
        move as array slices.
        """
        slots, hashes, parents, tokens, flags, mm = self._parts()
        read, write = self._compact_read, self._compact_write
        budget = _COMPACT_STEP_ROWS
        while budget > 0:
            run = _LIVE_RUN.search(flags, read)
            if run is None:
                # Every row from ``write`` on is dead: drop them.
                self._dead -= len(flags) - write
                del hashes[write:], parents[write:], tokens[write:], flags[write:]
                self._compact_read = self._compact_write = -1
                return
            start, end = run.span()
            end = min(end, start + budget)
            count = end - start
            if start != write:
                hashes[write : write + count] = hashes[start:end]
                parents[write : write + count] = parents[start:end]
                tokens[write : write + count] = tokens[start:end]
                flags[write : write + count] = flags[start:end]
                slots.update(zip(hashes[write : write + count], _bases(write, count), strict=True))
                if mm:
                    for row in range(start, end):
                        info = mm.pop(row, None)
                        if info is not None:
                            mm[row - start + write] = info
                vacated = max(write + count, start)
                if vacated < end:
                    zeros = array("Q", bytes(8 * (end - vacated)))
                    hashes[vacated:end] = zeros
                    parents[vacated:end] = zeros
                    tokens[vacated:end] = zeros
                    flags[vacated:end] = bytes((FLAG_DEAD,)) * (end - vacated)
            write += count
            read = end
            budget -= count
        self._compact_read, self._compact_write = read, write

    def get(self, block_hash: int) -> tuple[int | None, int, MmExtraInfo | None] | None:
        """(parent hash, tokens hash, mm info) of a resident block, or None."""
        slot = self.row_of(block_hash)
        if slot < 0:
            return None
        parent = self._parents[slot] if self._flags[slot] == FLAG_PARENT else None
        return parent, self._tokens[slot], self._mm.get(slot)

    def rows_parent_first(self) -> bool:
        """True when every resident parent sits in an earlier row than its children, checked at C speed.

        Most parents are the previous row (the chain stored in one go): those rows are found with a few
        big-integer operations over the raw columns (parent XOR previous row's hash is zero), and only the
        remaining rows with a parent (chain heads, overwrites) are looked up in the dict.
        """
        slots = self._slots
        rows = len(self._flags)
        if rows == 0:
            return True
        if _PARENTS_FIRST is not None:  # the same check in one compiled pass (about 100x faster)
            return _PARENTS_FIRST(self._hashes, self._parents, self._flags, slots, _BASE_SPAN)
        has_parent = self._flags.translate(_HAS_PARENT)
        if 0 in slots:
            # Dead rows hold 0 in both columns; a resident hash 0 would make their successors look linked.
            return self._parents_before(has_parent)
        width = 8 * (rows - 1)
        hashes, parents = self._hashes.tobytes(), self._parents.tobytes()
        diff = int.from_bytes(parents[8:], "little") ^ int.from_bytes(hashes[:-8], "little")
        nonzero = int.from_bytes(diff.to_bytes(width, "little").translate(_NONZERO), "little")
        # OR the 8 bytes of each word into its first byte (the bytes are 0/1, so no carries).
        nonzero |= nonzero >> 8
        nonzero |= nonzero >> 16
        nonzero |= nonzero >> 32
        unlinked = b"\x01" + nonzero.to_bytes(width, "little")[0::8]
        need = (int.from_bytes(unlinked, "little") & int.from_bytes(has_parent, "little")).to_bytes(
            rows, "little"
        )
        return not need.count(1) or self._parents_before(need)

    def _parents_before(self, rows_to_check: bytes | bytearray) -> bool:
        """True when each flagged row's parent is not resident or sits in an earlier row."""
        compress, repeat, add = itertools.compress, itertools.repeat, operator.add
        child_rows = list(compress(range(len(rows_to_check)), rows_to_check))
        parent_hashes = list(compress(self._parents, rows_to_check))
        # A parent's row is below its base + _BASE_SPAN (not resident: -1), so a parent whose base is far
        # enough back is settled by the base alone; the others are found exactly, all at C speed.
        bases = list(map(self._slots.get, parent_hashes, repeat(-_BASE_SPAN)))
        close = bytes(map(operator.ge, map(add, bases, repeat(_BASE_SPAN - 1)), child_rows))
        if not close.count(1):
            return True
        hashes, starts = list(compress(parent_hashes, close)), list(compress(bases, close))
        if 0 in hashes:  # hash 0 must be told from dead rows by its flags
            exact = map(self._row, hashes, starts)
        else:
            exact = map(self._hashes.index, hashes, starts, map(add, starts, repeat(_BASE_SPAN)))
        return not any(map(operator.ge, exact, compress(child_rows, close)))

    def columns(self) -> StoreColumns:
        """A parent-first copy of the store: the columns themselves when already ordered, else rebuilt."""
        if self.rows_parent_first():
            return StoreColumns(
                array("Q", self._hashes),
                array("Q", self._parents),
                array("Q", self._tokens),
                bytes(self._flags),
                dict(self._mm),
                len(self._slots),
            )
        return self.replay_columns()

    def replay_columns(self) -> StoreColumns:
        """The exact (slow, per-block) reference order of :meth:`replay_order`, as columns."""
        hashes, parents, tokens = array("Q"), array("Q"), array("Q")
        flags = bytearray()
        mm: dict[int, MmExtraInfo] = {}
        for row, (block_hash, parent, tokens_hash, info) in enumerate(self.replay_order()):
            hashes.append(block_hash)
            parents.append(0 if parent is None else parent)
            tokens.append(tokens_hash)
            flags.append(FLAG_ROOT if parent is None else FLAG_PARENT)
            if info is not None:
                mm[row] = info
        return StoreColumns(hashes, parents, tokens, bytes(flags), mm, len(hashes))

    def replay_order(self) -> Iterator[tuple[int, int | None, int, MmExtraInfo | None]]:
        """Every block as (hash, parent, tokens hash, mm info), a resident parent before its children.

        Dict order is insertion order, which is already parent-first for chains stored in one go; a block
        whose resident parent comes later (re-stored parent, reparenting) pulls its unemitted ancestors out
        first.  A parent cycle (only possible with adversarial input) is cut at the block where it closes.
        """
        slots, _hashes, parents, tokens, flags, mm = self._parts()
        # 0 = not yet emitted, 1 = emitted, 2 = on the ancestor chain being resolved.
        state = bytearray(len(parents))
        row_of = self._row
        for block_hash, base in slots.items():
            slot = row_of(block_hash, base)
            if state[slot]:
                continue
            if flags[slot] == FLAG_PARENT:
                parent_hash = parents[slot]
                parent_slot = self.row_of(parent_hash)
                if parent_slot >= 0 and not state[parent_slot]:
                    yield from self._emit_with_ancestors(block_hash, slot, state)
                    continue
                state[slot] = 1
                yield block_hash, parent_hash, tokens[slot], mm.get(slot) if mm else None
            else:
                state[slot] = 1
                yield block_hash, None, tokens[slot], mm.get(slot) if mm else None

    def _emit_with_ancestors(
        self, block_hash: int, slot: int, state: bytearray
    ) -> Iterator[tuple[int, int | None, int, MmExtraInfo | None]]:
        slots, _hashes, parents, tokens, flags, mm = self._parts()
        chain = [(block_hash, slot)]
        state[slot] = 2
        while flags[slot] == FLAG_PARENT:
            parent_hash = parents[slot]
            parent_slot = self.row_of(parent_hash)
            if parent_slot < 0 or state[parent_slot]:
                break  # not resident, already emitted, or a cycle closing on the chain
            chain.append((parent_hash, parent_slot))
            state[parent_slot] = 2
            slot = parent_slot
        for chain_hash, chain_slot in reversed(chain):
            state[chain_slot] = 1
            parent = parents[chain_slot] if flags[chain_slot] == FLAG_PARENT else None
            yield chain_hash, parent, tokens[chain_slot], mm.get(chain_slot) if mm else None


def _bases(first: int, count: int) -> Iterator[int]:
    """The base row of each of ``count`` consecutive rows from ``first``: one int per ``_BASE_SPAN`` rows."""
    if count <= _BASE_SPAN:
        return itertools.repeat(first, count)
    span = _BASE_SPAN
    groups = map(itertools.repeat, range(first, first + count, span), itertools.repeat(span))
    return itertools.islice(itertools.chain.from_iterable(groups), count)


class ResidentStore(Protocol):
    """What the index uses of a store: :class:`BlockStore` and the compiled :data:`NativeBlockStore`."""

    def __len__(self) -> int: ...

    def __contains__(self, block_hash: int) -> bool: ...

    def store(
        self,
        parent_hash: int | None,
        block_hashes: tuple[int, ...],
        tokens_hashes: tuple[int, ...],
        mm_extra_infos: tuple[MmExtraInfo | None, ...] | None,
    ) -> None: ...

    def remove(self, block_hashes: tuple[int, ...]) -> None: ...

    def row_of(self, block_hash: int) -> int: ...

    def hashes(self) -> Iterator[int]: ...

    def get(self, block_hash: int) -> tuple[int | None, int, MmExtraInfo | None] | None: ...

    def rows_parent_first(self) -> bool: ...

    def columns(self) -> StoreColumns: ...

    def replay_columns(self) -> StoreColumns: ...

    def replay_order(self) -> Iterator[tuple[int, int | None, int, MmExtraInfo | None]]: ...


def native_store_class(module: ModuleType) -> type[ResidentStore]:
    """:class:`BlockStore`'s interface over the compiled ``BlockTable`` of ``module`` (kvagent._native._store).

    The table keeps the rows; the column copies are wrapped here as :class:`StoreColumns`.
    """
    table: Any = module.BlockTable

    class NativeStore(table):  # type: ignore[misc]
        """BlockStore with its rows in C (kvagent/_native/_store.pyx): identical observables."""

        __slots__ = ()

        def __init__(
            self, min_free: int = _COMPACT_MIN_FREE, step_rows: int = _COMPACT_STEP_ROWS
        ) -> None:  # the table's __cinit__ takes the thresholds
            pass

        def columns(self) -> StoreColumns:
            """A parent-first copy of the store: the columns themselves when already ordered, else rebuilt."""
            if self.rows_parent_first():
                return StoreColumns(*self.column_copies())
            return self.replay_columns()

        def replay_columns(self) -> StoreColumns:
            """The exact reference order of :meth:`replay_order`, as columns."""
            return StoreColumns(*self.replay_column_copies())

        def replay_order(self) -> Iterator[tuple[int, int | None, int, MmExtraInfo | None]]:
            """BlockStore.replay_order: every block, a resident parent before its children."""
            entry = self.row_entry
            for row in self.replay_rows():
                yield entry(row)

    NativeStore.__name__ = NativeStore.__qualname__ = "NativeBlockStore"
    store_class: type[ResidentStore] = NativeStore
    return store_class


def _native_store_class() -> type[ResidentStore] | None:
    module = _native.store
    return None if module is None else native_store_class(module)


# The compiled store when built and not switched off (KVAGENT_NO_NATIVE=1), else None.
NativeBlockStore: type[ResidentStore] | None = _native_store_class()
# What the index makes a store with.
new_block_store: Callable[[], ResidentStore] = BlockStore if NativeBlockStore is None else NativeBlockStore
