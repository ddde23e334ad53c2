"""BlockStore against a dict model: state is exact after every store, remove and compaction step (rows found
from shared base rows included), and compaction finishes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import kvagent.index.store as index_store
from kvagent.index.store import BlockStore
from kvagent.model.events import FLAG_DEAD, FLAG_PARENT, MmExtraInfo, MmObject

INFO = MmExtraInfo((MmObject(5, ()),))


@contextmanager
def tiny_compaction(min_free: int = 2, step_rows: int = 2, base_span: int = 16) -> Iterator[None]:
    """Small compaction thresholds and base-row spans, so short examples cross every boundary."""
    saved = index_store._COMPACT_MIN_FREE, index_store._COMPACT_STEP_ROWS, index_store._BASE_SPAN
    index_store._COMPACT_MIN_FREE, index_store._COMPACT_STEP_ROWS = min_free, step_rows
    index_store._BASE_SPAN = base_span
    try:
        yield
    finally:
        index_store._COMPACT_MIN_FREE, index_store._COMPACT_STEP_ROWS, index_store._BASE_SPAN = saved


def check(store: BlockStore, model: dict[int, tuple[int | None, int, MmExtraInfo | None]]) -> None:
    """The store holds exactly the model, and its rows are consistent with its dict."""
    assert len(store) == len(model)
    for block_hash, expected in model.items():
        assert store.get(block_hash) == expected
    flags = store._flags
    assert len(flags) - store._dead == len(store)
    rows = [store.row_of(block_hash) for block_hash in store._slots]
    assert rows == sorted(rows), "row order must stay the dict's insertion order"
    for (block_hash, base), row in zip(store._slots.items(), rows, strict=True):
        assert store._hashes[row] == block_hash and flags[row] != FLAG_DEAD
        # A row is found from its (shared) base row by a bounded scan.
        assert base <= row < base + index_store._BASE_SPAN
    for row, value in enumerate(flags):
        if value == FLAG_DEAD:
            assert store._hashes[row] == store._parents[row] == store._tokens[row] == 0
            assert row not in store._mm
    if store._compact_read >= 0:
        assert all(flags[row] == FLAG_DEAD for row in range(store._compact_write, store._compact_read))
    # The C-speed order check agrees with the definition: every resident parent in an earlier row.
    parent_rows = {row: store.row_of(store._parents[row]) for row in rows if flags[row] == FLAG_PARENT}
    assert store.rows_parent_first() == all(parent < row for row, parent in parent_rows.items())


_hash = st.integers(0, 60)
_op = st.one_of(
    st.tuples(st.just("store"), st.one_of(st.none(), _hash), st.lists(_hash, min_size=1, max_size=12)),
    st.tuples(st.just("remove"), st.none(), st.lists(_hash, min_size=1, max_size=8)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_op, max_size=80), st.integers(1, 4), st.sampled_from([1, 2, 3, 16]))
def test_every_step_leaves_an_exact_store(ops: list[Any], step_rows: int, base_span: int) -> None:
    model: dict[int, tuple[int | None, int, MmExtraInfo | None]] = {}
    with tiny_compaction(step_rows=step_rows, base_span=base_span):
        store = BlockStore()
        for kind, parent, hashes in ops:
            if kind == "store":
                infos = tuple(INFO if h % 5 == 0 else None for h in hashes)
                store.store(parent, tuple(hashes), tuple(h + 1000 for h in hashes), infos)
                link = parent
                for block_hash, info in zip(hashes, infos, strict=True):
                    model[block_hash] = (link, block_hash + 1000, info)
                    link = block_hash
            else:
                store.remove(tuple(hashes))
                for block_hash in hashes:
                    model.pop(block_hash, None)
            check(store, model)
        # Removes of absent hashes still drive a running compaction to its end, which drops every dead row.
        while store._compact_read >= 0:
            store.remove((10_000,))
            check(store, model)


def test_a_fifo_eviction_workload_compacts_in_small_steps() -> None:
    with tiny_compaction(min_free=64, step_rows=16):
        store = BlockStore()
        model: dict[int, tuple[int | None, int, MmExtraInfo | None]] = {}
        compactions = longest_rows = 0
        for i in range(2_000):
            chain = (4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4)
            store.store(None, chain, chain, None)
            model.update({h: (None if n == 0 else chain[n - 1], h, None) for n, h in enumerate(chain)})
            if i >= 100:
                old = (4 * (i - 100) + 1, 4 * (i - 100) + 2, 4 * (i - 100) + 3, 4 * (i - 100) + 4)
                running = store._compact_read >= 0
                store.remove(old)
                for h in old:
                    del model[h]
                compactions += not running and store._compact_read >= 0
            longest_rows = max(longest_rows, len(store._flags))
        check(store, model)
        assert compactions > 10
        # Dead rows never pile up far beyond the trigger: memory stays proportional to the live blocks.
        assert longest_rows < 4 * len(model)


def test_hash_zero_is_found_past_the_zeroed_dead_rows_before_it() -> None:
    # Dead rows hold 0 in every column, so a resident hash 0 sharing a base row with removed blocks must
    # be told from them by its flags.
    store = BlockStore()
    store.store(None, (5, 6, 0, 7), (50, 60, 1, 70), None)
    store.remove((5, 6))
    assert store.get(0) == (6, 1, None)
    assert store.row_of(0) == 2
    store.remove((0,))
    assert store.get(0) is None and store.get(7) == (0, 70, None)
    check(store, {7: (0, 70, None)})


def test_a_parent_in_a_later_row_of_the_same_base_group_is_out_of_order() -> None:
    # Rows 0-2 share base row 0, so the parent's base alone cannot settle the order check.
    store = BlockStore()
    store.store(None, (1, 2, 3), (11, 12, 13), None)
    assert store.rows_parent_first()
    store.store(None, (3,), (13,), None)  # 3 becomes a root
    store.store(3, (2,), (12,), None)  # 2's parent is now 3, which sits in the row after it
    assert not store.rows_parent_first()
    columns = store.columns()
    order = list(columns.hashes)
    assert order.index(3) < order.index(2)
