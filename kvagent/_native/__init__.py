"""Whether the compiled core (``kvagent/_native/_ingest.pyx``, ``_columns.pyx``, ``_store.pyx``) is used, and
why not.

``NATIVE`` is True when the extension was built (``pip install .`` with a C compiler), imports, and fits the
model's value classes; ``REASON`` says why not otherwise. ``KVAGENT_NO_NATIVE=1`` forces the pure-Python
path (tests and CI run both; the differential tests pin them to the same results). ``core`` is the
configured module (None without it): the decode+normalize pass of ``vllm/normalize.py`` and the plain-chunk
pass of ``coordinator/fastpath.py`` call it and fall back to Python for anything it declines. ``columns``
(the ring's append and the answer encoders) and ``store`` (the recovery index's block store and its
``apply_run``) are the other two extensions, or None; the same switch turns them off.

The one module beside ``kvagent.cli`` that reads the environment: the switch must hold for every embedder
and test process, before anything ingests (tests/unit/test_layers.py names it).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Protocol, cast

import attrs

from kvagent.model.events import (
    CLEARED,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)

__all__ = ["DISABLED", "NATIVE", "REASON", "IngestCore", "columns", "core", "describe", "store"]

DISABLE_VARIABLE = "KVAGENT_NO_NATIVE"
# Read once at import: the switch must hold for the whole process (see the module docstring).
DISABLED: bool = os.environ.get(DISABLE_VARIABLE, "") not in ("", "0")


class IngestCore(Protocol):
    """What the callers use of the compiled module (its stubs: _ingest.pyi)."""

    def normalize_payload(
        self, payload: bytes, block_size: int, rank: int, groups: dict[Any, Any]
    ) -> tuple[int | None, list[PlacementEvent], int, list[tuple[Any, Any]]] | None: ...

    def stamp_plain_chunk(
        self,
        events: Sequence[PlacementEvent],
        slot_rank: int,
        worker_id: int,
        owner: object,
        first_id: int,
        id_limit: int,
        dedup: Any,
        coalesce: Callable[[Sequence[PlacementEvent]], Sequence[PlacementEvent]],
        ids_taken: Callable[[int], None],
    ) -> tuple[list[RouterEvent], int] | None: ...

    def chunk_blocks(self, events: Sequence[PlacementEvent]) -> int: ...

    def encode_router_events(self, events: Sequence[RouterEvent]) -> bytes | None: ...


def _load() -> tuple[IngestCore | None, str]:
    if DISABLED:
        return None, f"disabled by {DISABLE_VARIABLE}"
    if importlib.util.find_spec("kvagent._native._ingest") is None:
        return None, "not built"  # a bare clone, or an install without a C compiler
    try:
        from kvagent._native import _ingest
    except ImportError as exc:
        return None, f"extension does not load ({exc})"
    classes = (Stored, Removed, PlacementEvent, RouterEvent)
    try:
        fields = tuple(tuple(field.name for field in attrs.fields(cls)) for cls in classes)
        _ingest.configure(*classes, StorageTier.DEVICE, ResidencyDomain.WORKER, CLEARED, fields)
        # The values it builds from slots must be the ones the classes build.
        stored = _ingest.build_stored(None, (1, 2), (3, 4), b"\0" * 8)
        expected = Stored(None, (1, 2), (3, 4), None, None, b"\0" * 8)
        routed = _ingest.build_router(7, StorageTier.DEVICE, ResidencyDomain.WORKER, 5, stored, 0, None, "s")
        if (
            stored != expected
            or stored.token_bytes != expected.token_bytes
            or routed != RouterEvent(7, StorageTier.DEVICE, ResidencyDomain.WORKER, 5, expected, 0, None, "s")
        ):
            return None, "extension does not build the model's values exactly"
    except TypeError as exc:
        return None, f"extension does not fit the model's value classes ({exc})"
    return cast(IngestCore, _ingest), ""


core, REASON = _load()
NATIVE: bool = core is not None


def _load_extension(name: str) -> tuple[ModuleType | None, str]:
    """A compiled module beside ``_ingest`` (the same switch turns it off), or None and why not."""
    if DISABLED:
        return None, f"disabled by {DISABLE_VARIABLE}"
    if importlib.util.find_spec(f"kvagent._native.{name}") is None:
        return None, "not built"
    try:
        # By name: the modules are optional build products (their callers type what they use of them).
        return importlib.import_module(f"kvagent._native.{name}"), ""
    except ImportError as exc:
        return None, f"does not load ({exc})"


# The compiled columnar ring append and answer encoders (``_columns.pyx``), or None: their pure-Python
# twins (``index/ring.py``, ``recovery/wire_columns.py``).
columns, _COLUMNS_REASON = _load_extension("_columns")
# The recovery index's block store and apply_run loop (``_store.pyx``), or None: ``index/store.py``'s
# BlockStore and ``RecoveryIndex.apply_run`` in Python.
store, _STORE_REASON = _load_extension("_store")


def describe() -> str:
    """``yes`` (every extension runs), ``yes, without ...`` or ``no (reason)``: what ``kvagent --version``
    and the serve log say."""
    if not NATIVE:
        return f"no ({REASON})"
    missing = [
        f"{name} ({reason})"
        for name, module, reason in (("columns", columns, _COLUMNS_REASON), ("store", store, _STORE_REASON))
        if module is None
    ]
    return "yes" if not missing else "yes, without " + ", ".join(missing)
