"""The compiled block store and apply_run (kvagent/_native/_store.pyx) against the Python ones they replace.

Differential: the same random store / remove / overwrite / reparent / hash-0 sequences, with compaction
thresholds small enough to cross every step, go through ``BlockStore`` and the compiled store, and every
observable (length, membership, rows, ``get``, the order check, ``columns()``, ``replay_columns()``,
``replay_order()``) must be equal after every step; the same runs of events go through ``apply_run`` with
and without the compiled loop, and the results, failures, ring, stores, dumps and announcements must be
equal. The extension is imported directly, so these run in the ``KVAGENT_NO_NATIVE=1`` pass too (the
switch only decides what the agent uses).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvagent.index.store as index_store
from kvagent.index import recovery_index
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.index.store import BlockStore, ResidentStore, native_store_class
from kvagent.model.events import (
    CLEARED,
    U64_MAX,
    MmExtraInfo,
    MmObject,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from tests.support.ids import IDENTITY

try:
    from kvagent._native import _store as native_module
except ImportError:
    # CI builds the core (.ci/run sets KVAGENT_REQUIRE_NATIVE=1 for both passes): there it must be there.
    if os.environ.get("KVAGENT_REQUIRE_NATIVE") == "1" or os.environ.get("CI", "").lower() == "true":
        raise
    pytest.skip("the compiled store is not built", allow_module_level=True)
NativeStore: Any = native_store_class(native_module)
NATIVE_APPLY_RUN = recovery_index._native_apply_run(native_module)

INFO = MmExtraInfo((MmObject(5, ()),))
OTHER_INFO = MmExtraInfo((MmObject(7, ()),))


@contextmanager
def python_compaction(min_free: int, step_rows: int) -> Iterator[None]:
    saved = index_store._COMPACT_MIN_FREE, index_store._COMPACT_STEP_ROWS
    index_store._COMPACT_MIN_FREE, index_store._COMPACT_STEP_ROWS = min_free, step_rows
    try:
        yield
    finally:
        index_store._COMPACT_MIN_FREE, index_store._COMPACT_STEP_ROWS = saved


def tiny_native(min_free: int, step_rows: int) -> type[Any]:
    """The compiled store with the given compaction thresholds as its defaults (a class, as the index's
    compiled loop needs to recognise it)."""

    class Tiny(NativeStore):  # type: ignore[misc]
        __slots__ = ()

        def __new__(cls) -> Any:
            return NativeStore.__new__(cls, min_free, step_rows)

    return Tiny


def observables(store: ResidentStore, universe: range) -> dict[str, Any]:
    return {
        "len": len(store),
        "bool": bool(store),
        "hashes": list(store.hashes()),
        "contains": [h for h in universe if h in store],
        "rows": [store.row_of(h) for h in universe],
        "get": [store.get(h) for h in universe],
        "ordered": store.rows_parent_first(),
        "columns": store.columns(),
        "replay_columns": store.replay_columns(),
        "replay_order": list(store.replay_order()),
    }


_hash = st.integers(0, 40)
_op = st.one_of(
    st.tuples(
        st.just("store"),
        st.one_of(st.none(), _hash),
        st.lists(_hash, min_size=0, max_size=10),
        st.sampled_from(["none", "some", "all"]),
    ),
    st.tuples(st.just("remove"), st.none(), st.lists(_hash, min_size=0, max_size=8), st.just("none")),
    # A re-store of one resident block under a new parent (the reparenting the dump must order).
    st.tuples(st.just("reparent"), _hash, st.lists(_hash, min_size=1, max_size=1), st.just("none")),
)


def _infos(hashes: list[int], kind: str) -> tuple[MmExtraInfo | None, ...] | None:
    if kind == "none":
        return None
    if kind == "all":
        return tuple(OTHER_INFO for _ in hashes)
    return tuple(INFO if h % 3 == 0 else None for h in hashes)


@settings(max_examples=400, deadline=None)
@given(st.lists(_op, max_size=60), st.integers(0, 4), st.integers(1, 4))
def test_the_compiled_store_is_the_python_store_at_every_step(
    ops: list[Any], min_free: int, step_rows: int
) -> None:
    universe = range(42)
    native = tiny_native(min_free, step_rows)()
    with python_compaction(min_free, step_rows):
        python = BlockStore()
        for kind, parent, hashes, infos in ops:
            if kind == "remove":
                python.remove(tuple(hashes))
                native.remove(tuple(hashes))
            else:
                args = (parent, tuple(hashes), tuple(h + 1000 for h in hashes), _infos(hashes, infos))
                python.store(*args)
                native.store(*args)
            assert observables(native, universe) == observables(python, universe)
        # Removes of nothing drive a running compaction to its end in both.
        for _ in range(50):
            python.remove((10_000,))
            native.remove((10_000,))
            assert observables(native, universe) == observables(python, universe)


def test_big_hashes_hash_zero_and_a_table_that_grows_and_shrinks() -> None:
    python, native = BlockStore(), NativeStore()
    chain = (0, U64_MAX, 1 << 63, *range(5, 3000))
    for store in (python, native):
        store.store(U64_MAX - 1, chain, chain, None)
        store.remove(chain[3:2000])
        store.remove((0, U64_MAX + 1, -1))  # out-of-range values are no block hash
    universe = (0, 1, U64_MAX, 1 << 63, 1999, 2000, 2500)
    assert [native.get(h) for h in universe] == [python.get(h) for h in universe]
    assert native.columns() == python.columns()
    assert list(native.hashes()) == list(python.hashes())
    native.remove(tuple(native.hashes()))
    assert len(native) == 0 and not native and native.columns().live == 0


def test_a_value_the_store_cannot_hold_changes_nothing() -> None:
    native = NativeStore()
    native.store(None, (1, 2), (3, 4), None)
    before = native.columns()
    with pytest.raises(OverflowError):
        native.store(None, (5, -1), (6, 7), None)
    with pytest.raises(TypeError):
        native.store(None, (5, "x"), (6, 7), None)
    assert native.columns() == before and 5 not in native


# -- apply_run: the compiled loop against the Python one ----------------------------------------------------

DEVICE, HOST = StorageTier.DEVICE, StorageTier.HOST_PINNED
W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
OWNER = IDENTITY.cache_owner_id


@st.composite
def _event(draw: st.DrawFn, event_id: int, plain: bool) -> RouterEvent:
    kinds = (
        ["store", "store", "remove"] if plain else ["store", "remove", "bad", "owner", "clear", "tier", "odd"]
    )
    kind = draw(st.sampled_from(kinds))
    tier: Any = draw(st.sampled_from([DEVICE, DEVICE, HOST]))
    worker, rank = draw(st.sampled_from([(17, 0), (17, 0), (17, 1), (18, 0)]))
    domain, source = W, None
    data: Any
    hashes = tuple(draw(st.lists(st.integers(0, 12), max_size=4)))
    if kind == "store":
        infos = draw(st.sampled_from([None, tuple(INFO if h % 2 else None for h in hashes)]))
        data = Stored(
            draw(st.one_of(st.none(), st.integers(0, 12))), hashes, tuple(h + 100 for h in hashes), infos
        )
    elif kind == "remove":
        data = Removed(hashes)
    elif kind == "bad":  # refused by the store's checks: a failure, not a decline
        data = draw(
            st.sampled_from(
                [
                    Stored(None, (-1,), (6,)),
                    Stored(None, (U64_MAX + 1,), (6,)),
                    Stored(None, (5,), (-6,)),
                    Stored(None, (5, 6), (6,)),
                    Stored(U64_MAX + 1, (5,), (6,)),
                    Stored(None, (5,), (6,), (None, None)),
                ]
            )
        )
    elif kind == "odd":  # values the compiled loop hands to the Python methods
        data = draw(
            st.sampled_from(
                [Stored(True, (True, 3), (1, False)), Removed((True, 3)), Stored(None, (2**64 - 1,), (0,))]
            )
        )
    elif kind == "owner":
        data, domain, source, tier = Stored(None, (3,), (4,)), C, OWNER, HOST
    elif kind == "clear":
        data = CLEARED
    else:
        data, tier = Removed((1,)), "gpu"
    return RouterEvent(worker, tier, domain, event_id, data, rank, source)


def _index(native: bool, subscribed: bool, record: list[tuple[int, int]]) -> RecoveryIndex:
    index = RecoveryIndex(4, ring_capacity=9)
    if native:
        index._new_store = tiny_native(2, 2)
        index._native_apply_run = NATIVE_APPLY_RUN
    else:
        index._new_store = BlockStore
        index._native_apply_run = None
    if subscribed:
        index.subscribe(lambda event: record.append((event.event_id, len(index.resident_blocks()))))
    return index


def _state(index: RecoveryIndex) -> tuple[Any, ...]:
    return (
        index.resident_blocks(),
        index.current_event_id(),
        index.oldest_buffered_id(),
        index.ring_tail(0),
        index.dump_snapshot(),
        index._applied,
        index._ring.statistics(),
        [key for key in index._stores],
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_compiled_apply_run_is_the_python_one(data: st.DataObject) -> None:
    subscribed = data.draw(st.booleans())
    seen: list[list[tuple[int, int]]] = [[], []]
    with python_compaction(2, 2):
        python, native = _index(False, subscribed, seen[0]), _index(True, subscribed, seen[1])
        if data.draw(st.booleans()):
            for index in (python, native):
                index.skip_to(3)
        next_id = data.draw(st.integers(min_value=-1, max_value=5))
        for _ in range(data.draw(st.integers(min_value=1, max_value=10))):
            step = data.draw(st.sampled_from([1, 1, 1, 1, 0, 2]))
            plain = data.draw(st.booleans())
            events = []
            for _ in range(data.draw(st.integers(min_value=0, max_value=6))):
                events.append(data.draw(_event(next_id, plain)))
                next_id += step
            run: Any = tuple(events) if data.draw(st.booleans()) else events
            results = []
            for index in (python, native):
                failures = index.apply_run(run)
                results.append(
                    None
                    if failures is None
                    else [(position, type(error), str(error)) for position, error in failures]
                )
            assert results[1] == results[0]
            assert _state(native) == _state(python)
            assert seen[1] == seen[0]
            if results[0] is None:
                for index in (python, native):
                    for event in events:
                        try:
                            index.apply(event)
                        except Exception:  # noqa: BLE001, S112 - the same refusals on both, compared below
                            continue
                assert _state(native) == _state(python)


def test_a_run_apply_refuses_is_declined_by_both() -> None:
    python, native = _index(False, False, []), _index(True, False, [])
    first = [RouterEvent(17, DEVICE, W, 1, Stored(None, (1, 2), (3, 4)), 0)]
    for index in (python, native):
        assert index.apply_run(first) == []
    again = [RouterEvent(17, DEVICE, W, 1, Removed((1,)), 0)]  # an id already buffered
    for index in (python, native):
        assert index.apply_run(again) is None
    assert _state(native) == _state(python)


def test_the_compiled_loop_warns_where_the_python_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    warned: list[tuple[int, int]] = []
    monkeypatch.setattr(
        recovery_index,
        "log",
        type(
            "Log", (), {"warning": lambda *_a, **kw: warned.append((kw["expected_event_id"], kw["event_id"]))}
        )(),
    )
    native = _index(True, False, [])
    assert native.apply_run([RouterEvent(17, DEVICE, W, 1, Stored(None, (1,), (3,)), 0)]) == []
    events = [
        RouterEvent(17, DEVICE, W, 3, Stored(None, (-1,), (3,)), 0),  # skips id 2, then fails
        RouterEvent(17, DEVICE, W, 4, Stored(None, (2,), (3,)), 0),
    ]
    failures = native.apply_run(events)
    assert failures is not None and [position for position, _ in failures] == [0]
    assert warned == [(2, 3), (2, 4)]


def test_a_bare_clone_says_the_core_is_not_built(tmp_path: Path) -> None:
    # A copy of the package without the compiled modules, as a fresh clone is before any build.
    package = Path(recovery_index.__file__).parents[1]
    shutil.copytree(
        package, tmp_path / "kvagent", ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__")
    )
    code = "from kvagent import _native; print(_native.describe())"
    environment = {key: value for key, value in os.environ.items() if key != "KVAGENT_NO_NATIVE"}
    environment["PYTHONPATH"] = str(tmp_path)
    shown = subprocess.run(
        [sys.executable, "-c", code],
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert shown.stdout.strip() == "no (not built)"
