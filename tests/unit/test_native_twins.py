"""Two tiers, pinned (issue #34): every public callable of a compiled module (kvagent/_native/*.pyx) has a
stub in its ``.pyi``, a pure-Python twin that defines its behaviour, and a differential test that runs both.

:data:`TWINS` is the one table. The compiled modules' public callables are read from their ``.pyx`` sources
(so a bare clone checks them too) and, when built, from the extension itself; a new compiled function without
a row, a row whose twin does not import, or a test that does not exist fails here.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
from pathlib import Path
from types import ModuleType

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvagent import _native
from kvagent.model.events import ResidencyDomain, RouterEvent, StorageTier, Stored

ROOT = Path(__file__).resolve().parents[2]
NATIVE_DIR = ROOT / "kvagent" / "_native"
# Every compiled module in the tree: a new .pyx is checked without anyone remembering to list it here.
MODULES = tuple(sorted(path.stem for path in NATIVE_DIR.glob("*.pyx")))
THIS = "tests/unit/test_native_twins.py"


@attrs.frozen
class Twin:
    """The Python code a compiled callable must agree with (None: it has no behaviour of its own, ``why``
    says what it is) and the tests (``path::function``) that run both and compare."""

    python: str | None
    tests: tuple[str, ...]
    why: str = ""


TWINS: dict[tuple[str, str], Twin] = {
    # _stream.pyx: a stream entry's event columns applied to a replica's stores (issue #36).
    ("_stream", "run_ops"): Twin(
        "kvagent.stream.apply.run_ops_python",
        ("tests/unit/test_stream_apply.py::test_native_and_python_loops_give_the_same_index_state",),
    ),
    # _ingest.pyx: the ingest pass, the coordinator's plain-chunk pass, the RouterEvent encoder.
    ("_ingest", "normalize_payload"): Twin(
        "kvagent.vllm.normalize.AttachmentNormalizer.normalize_payload",  # with native=False
        (
            "tests/unit/test_native_ingest.py::test_plain_streams_agree_with_python",
            "tests/unit/test_fastpath.py::test_generated_streams_agree",
        ),
    ),
    ("_ingest", "stamp_plain_chunk"): Twin(
        "kvagent.coordinator.fastpath.stamp_plain_chunk",
        ("tests/unit/test_fast_path_batch.py::test_generated_streams_agree",),
    ),
    ("_ingest", "chunk_blocks"): Twin(
        "kvagent.coordinator.machine._chunk_blocks",
        ("tests/unit/test_native_ingest.py::test_chunk_blocks_counts_as_python_does",),
    ),
    ("_ingest", "encode_router_events"): Twin(
        "kvagent.wire.router_event.encode_router_events_python",
        ("tests/unit/test_native_encode.py::test_native_bytes_are_the_python_bytes",),
    ),
    ("_ingest", "build_stored"): Twin(
        "kvagent.model.events.Stored", (f"{THIS}::test_build_stored_is_the_class_constructor",)
    ),
    ("_ingest", "build_router"): Twin(
        "kvagent.model.events.RouterEvent", (f"{THIS}::test_build_router_is_the_class_constructor",)
    ),
    ("_ingest", "configure"): Twin(
        None,
        ("tests/unit/test_native_ingest.py::test_plain_streams_agree_with_python",),
        why="hands the model's classes and their slot offsets to the module (kvagent/_native/__init__.py)",
    ),
    # _columns.pyx: the answer encoders, the store's order check, the ring append.
    ("_columns", "encode_ring_events"): Twin(
        "kvagent.recovery.wire_columns.encode_ring_events",
        ("tests/unit/test_event_ring.py::test_encoded_answers_are_the_reference_bytes",),
    ),
    ("_columns", "encode_dump_msgpack"): Twin(
        "kvagent.recovery.wire_columns.encode_dump_msgpack",
        ("tests/unit/test_wire_columns.py::test_dump_rows_are_the_reference_bytes",),
    ),
    ("_columns", "encode_dump_json"): Twin(
        "kvagent.recovery.wire_columns.encode_dump_json",
        ("tests/unit/test_wire_columns.py::test_dump_rows_are_the_reference_bytes",),
    ),
    ("_columns", "parents_first"): Twin(
        "kvagent.index.store.BlockStore.rows_parent_first",
        ("tests/io/test_dump_fast.py::test_columns_equal_the_reference_order",),
    ),
    ("_columns", "encode_batch_rows"): Twin(
        "kvagent.persist.columns.encode_ring_batch",  # its rows, written in Python for pieces with extras
        (
            "tests/unit/test_ring_retention.py::test_the_compiled_rows_write_every_int_width_as_msgpack_does",
            "tests/unit/test_ring_retention.py::test_a_retaining_ring_hands_back_every_event_after_an_id_and_encodes_it_as_encode_batch",
        ),
    ),
    ("_columns", "ring_append"): Twin(
        "kvagent.index.ring.RingSegment.append",
        ("tests/unit/test_event_ring.py::test_the_ring_answers_every_range_as_a_list_does",),
    ),
    # _store.pyx: the recovery index's block store and its apply_run loop.
    ("_store", "BlockTable"): Twin(
        "kvagent.index.store.BlockStore",
        ("tests/unit/test_native_store.py::test_the_compiled_store_is_the_python_store_at_every_step",),
    ),
    ("_store", "apply_run"): Twin(
        "kvagent.index.recovery_index.RecoveryIndex.apply_run",
        ("tests/unit/test_native_store.py::test_the_compiled_apply_run_is_the_python_one",),
    ),
    ("_store", "configure"): Twin(
        None,
        ("tests/unit/test_native_store.py::test_the_compiled_apply_run_is_the_python_one",),
        why="hands the index's classes and callbacks to the module (kvagent/index/recovery_index.py)",
    ),
    ("_store", "Scratch"): Twin(
        None,
        ("tests/unit/test_native_store.py::test_the_compiled_store_is_the_python_store_at_every_step",),
        why="BlockTable's u64 conversion buffer: public only because a cdef class is; no method of its own",
    ),
}

# The Python fast paths: Python code beside the general path that defines the behaviour, pinned to it the
# same way (coordinator/fastpath.py is both: the general loop's fast path and the compiled pass's twin).
PYTHON_FAST_PATHS: dict[str, Twin] = {
    "kvagent.coordinator.fastpath.apply_plain_chunk": Twin(
        "kvagent.coordinator.machine.SlotCoordinator._apply_locally",
        (
            "tests/unit/test_fast_path_batch.py::test_generated_streams_agree",
            "tests/unit/test_fast_path_batch.py::test_plain_chunks_take_the_fast_path_and_agree",
        ),
    ),
}

_PYX_CALLABLE = re.compile(r"^(?:def|cpdef(?: [\w.]+)?|cdef class|class) +([A-Za-z]\w*)\b", re.MULTILINE)


def pyx_public_callables(name: str) -> set[str]:
    """The public functions and classes a ``.pyx`` defines at module level."""
    return set(_PYX_CALLABLE.findall((NATIVE_DIR / f"{name}.pyx").read_text()))


def stub_names(name: str) -> set[str]:
    tree = ast.parse((NATIVE_DIR / f"{name}.pyi").read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def built_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"kvagent._native.{name}")
    except ImportError:
        return None


def resolve(dotted: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(dotted)


def functions_of(path: str) -> set[str]:
    """The module-level test functions of a test file."""
    tree = ast.parse((ROOT / path).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("name", MODULES)
def test_every_compiled_callable_has_a_stub_a_twin_and_a_test(name: str) -> None:
    compiled = pyx_public_callables(name)
    assert compiled, f"{name}.pyx defines nothing public: the reader is broken"
    assert compiled == stub_names(name), f"{name}.pyi and {name}.pyx disagree"
    listed = {callable_name for module, callable_name in TWINS if module == name}
    assert compiled - listed == set(), f"compiled in {name}.pyx without a row in TWINS"
    assert listed - compiled == set(), f"rows in TWINS for what {name}.pyx no longer defines"


@pytest.mark.parametrize("name", MODULES)
def test_the_built_extension_exports_what_its_source_defines(name: str) -> None:
    module = built_module(name)
    if module is None:
        pytest.skip(f"kvagent._native.{name} is not built")
    exported = {
        key
        for key, value in vars(module).items()
        if not key.startswith("_")
        and callable(value)
        and getattr(value, "__module__", None) == module.__name__
    }
    assert exported == pyx_public_callables(name)


ROWS = {f"{module}.{name}": twin for (module, name), twin in TWINS.items()} | PYTHON_FAST_PATHS


@pytest.mark.parametrize("row", sorted(ROWS))
def test_each_twin_imports_and_each_test_exists(row: str) -> None:
    twin = ROWS[row]
    if twin.python is None:
        assert twin.why, "a row without a Python twin says why"
    else:
        assert callable(resolve(twin.python))
    assert twin.tests
    for test in twin.tests:
        path, _, function = test.partition("::")
        assert (ROOT / path).is_file(), test
        assert function in functions_of(path), test


def test_the_fast_paths_are_there() -> None:
    for dotted in PYTHON_FAST_PATHS:
        assert callable(resolve(dotted))


def test_no_third_party_source_is_vendored() -> None:
    assert not list((ROOT / "kvagent").rglob("xxhash.h")), "XXH3 comes from libxxhash or the xxhash package"
    assert not list(NATIVE_DIR.glob("LICENSE*"))
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_ci_compiles_libxxhash_in() -> None:
    """CI installs libxxhash-dev (.ci/run): its native pass must hash with the library, not the fallback."""
    required = os.environ.get("KVAGENT_REQUIRE_NATIVE") == "1" or os.environ.get("CI", "").lower() == "true"
    module = built_module("_ingest")
    if not required or module is None:
        pytest.skip("only where CI requires the native core")
    assert module.XXH3_SOURCE == "libxxhash"


# --- the differential tests of the value builders ----------------------------------------------------------

needs_core = pytest.mark.skipif(not _native.NATIVE, reason=f"native core: {_native.REASON}")
_u64 = st.integers(0, (1 << 64) - 1)
_chains = st.integers(1, 6).flatmap(
    lambda n: st.tuples(st.lists(_u64, min_size=n, max_size=n), st.lists(_u64, min_size=n, max_size=n))
)


@needs_core
@given(st.none() | _u64, _chains, st.binary(max_size=64))
def test_build_stored_is_the_class_constructor(
    parent: int | None, chain: tuple[list[int], list[int]], token_bytes: bytes
) -> None:
    assert _native.core is not None
    ingest = importlib.import_module("kvagent._native._ingest")
    hashes, tokens = tuple(chain[0]), tuple(chain[1])
    built = ingest.build_stored(parent, hashes, tokens, token_bytes)
    expected = Stored(parent, hashes, tokens, None, None, token_bytes)
    assert type(built) is Stored and built == expected and hash(built) == hash(expected)
    assert built.token_bytes == token_bytes


@needs_core
@given(_u64, st.sampled_from(list(StorageTier)), st.sampled_from(list(ResidencyDomain)), _u64, _u64)
def test_build_router_is_the_class_constructor(
    worker: int, tier: StorageTier, domain: ResidencyDomain, event_id: int, rank: int
) -> None:
    ingest = importlib.import_module("kvagent._native._ingest")
    data = Stored(None, (1,), (2,), None, None, b"")
    built = ingest.build_router(worker, tier, domain, event_id, data, rank, None, "session")
    assert type(built) is RouterEvent
    assert built == RouterEvent(worker, tier, domain, event_id, data, rank, None, "session")
