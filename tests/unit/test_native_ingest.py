"""The compiled ingest core (kvagent/_native): which path runs, what it declines, and that it agrees.

The differential tests of tests/unit/test_fastpath.py and test_fast_path_batch.py run every check through
the native and the pure-Python path; here: the switch (``KVAGENT_NO_NATIVE``, CI builds the core), the
shapes the core must decline (the Python path then decides, with nothing changed before), and streams of
plain batches — the shape the core takes — with ranks, learned attention groups and session ids.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvagent import _native
from kvagent.model.errors import WireDecodeError
from kvagent.model.events import Stored, WorkerWithDpRank
from kvagent.vllm.normalize import AttachmentNormalizer, NormalizedBatch

WORKER = WorkerWithDpRank(7, 2)
BLOCK_SIZE = 4
needs_native = pytest.mark.skipif(not _native.NATIVE, reason=f"native core: {_native.REASON}")


def _normalizer(native: bool) -> AttachmentNormalizer:
    return AttachmentNormalizer(kv_block_size=BLOCK_SIZE, worker=WORKER, native=native)


def _store(hashes: list[int], parent: int | None = None, **fields: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(100, 100 + BLOCK_SIZE * len(hashes))),
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    event.update(fields)
    return event


def _remove(hashes: list[Any], **fields: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0, **fields}


def _payload(events: list[Any], rank: int | None = WORKER.dp_rank, ts: Any = 1.5) -> bytes:
    return bytes(msgpack.packb([ts, events, rank]))


def _outcome(normalizer: AttachmentNormalizer, payload: bytes) -> object:
    """What normalize_payload gives (token bytes included), the error it raises, and the learned state."""
    try:
        rank, normalized = normalizer.normalize_payload(payload)
    except WireDecodeError as error:
        result: object = ("error", str(error))
    else:
        result = (rank, _with_tokens(normalized))
    return result, dict(normalizer.framework._groups), dict(normalizer.framework._namespaces)


def _with_tokens(normalized: NormalizedBatch | None) -> object:
    if normalized is None:
        return None
    return (
        normalized,
        [e.data.token_bytes if isinstance(e.data, Stored) else None for e in normalized.events],
    )


# -- which path runs --------------------------------------------------------------------------------------


def test_ci_builds_the_native_core() -> None:
    """CI installs with a compiler: the core must be there (.ci/run sets KVAGENT_REQUIRE_NATIVE=1; its
    second, pure-Python pass sets KVAGENT_NO_NATIVE=1)."""
    required = os.environ.get("KVAGENT_REQUIRE_NATIVE") == "1" or os.environ.get("CI", "").lower() == "true"
    if not required or os.environ.get(_native.DISABLE_VARIABLE):
        pytest.skip("only in CI's native pass")
    assert _native.NATIVE, _native.REASON


def test_the_variable_forces_the_pure_python_path() -> None:
    code = "from kvagent import _native; print(_native.NATIVE, _native.core, _native.describe())"
    env = {**os.environ, _native.DISABLE_VARIABLE: "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    assert result.stdout.strip() == "False None no (disabled by KVAGENT_NO_NATIVE)"
    version = subprocess.run(
        [sys.executable, "-m", "kvagent", "--version"], capture_output=True, text=True, env=env, timeout=60
    )
    assert version.stdout.strip().endswith("native core: no (disabled by KVAGENT_NO_NATIVE)")


def test_asking_for_a_missing_core_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "core", None)
    with pytest.raises(ValueError, match="native ingest core is not available"):
        _normalizer(native=True)
    assert not _normalizer(native=False).native


# -- what the core declines -------------------------------------------------------------------------------

DECLINED: dict[str, list[Any]] = {
    "positional form": [["BlockStored", [1], None, [1, 2, 3, 4], BLOCK_SIZE]],
    "KVCR ownership": [_store([1], ownership="kvcr", medium="CPU")],
    "unknown ownership": [_store([1], ownership="other")],
    "LoRA": [_store([1], lora_name="adapter")],
    "salt": [_store([1], cache_salt="tenant")],
    "multimodal extra keys": [_store([1], extra_keys=[["00000000000000ab" + "0" * 48]])],
    "host medium": [_store([1], medium="CPU")],
    "remote locality": [_remove([1], locality="REMOTE")],
    "sliding window kind": [_store([1], kv_cache_spec_kind="sliding_window")],
    "unlearned group": [_remove([1], group_idx=1)],
    "duplicate hash": [_store([1, 1])],
    "parent in chain": [_store([1, 2], parent=2)],
    "missing tokens": [_store([1, 2], token_ids=[1, 2, 3, 4, 5])],
    "other block size": [_store([1], block_size=BLOCK_SIZE * 2)],
    "bool token": [_store([1], token_ids=[True, 1, 2, 3])],
    "negative hash": [_remove([-5])],
    "bytes hash": [_remove([b"\x01" * 8])],
    "unknown key": [_store([1], future_field=1)],
    "scoped clear": [{"type": "AllBlocksCleared", "medium": "GPU"}],
    "ignored tag": [{"type": "TierBlocksCleared"}],
    "unknown tag": [{"type": "Mystery"}],
    "no parent key": [{k: v for k, v in _store([1]).items() if k != "parent_block_hash"}],
    "empty store": [_store([])],
}


@needs_native
@pytest.mark.parametrize("shape", sorted(DECLINED))
def test_the_core_declines_what_is_not_plain_and_python_decides(shape: str) -> None:
    payload = _payload([_store([50]), DECLINED[shape][0]])
    assert _native.core is not None
    assert _native.core.normalize_payload(payload, BLOCK_SIZE, WORKER.dp_rank, {}) is None
    assert _outcome(_normalizer(True), payload) == _outcome(_normalizer(False), payload)


@needs_native
@pytest.mark.parametrize(
    "payload",
    [
        _payload([_store([1])], ts=3),  # an int ts (the decoders take it)
        _payload([_store([1])], ts=True),  # a bool ts (the decoders refuse it)
        _payload([_store([1])]) + b"\x00",  # trailing bytes
        bytes(msgpack.packb([1.5, [_store([1])], 2, "extra"])),  # an extra envelope element
        bytes(msgpack.packb({"ts": 1.5})),  # a map envelope
        _payload([_store([1])])[:-3],  # cut short
        _payload([_store([1])], rank=1 << 33),  # a rank beyond u32
    ],
    ids=["int ts", "bool ts", "trailing", "extra element", "map envelope", "truncated", "huge rank"],
)
def test_the_core_declines_odd_envelopes(payload: bytes) -> None:
    assert _native.core is not None
    assert _native.core.normalize_payload(payload, BLOCK_SIZE, WORKER.dp_rank, {}) is None
    assert _outcome(_normalizer(True), payload) == _outcome(_normalizer(False), payload)


@needs_native
def test_a_batch_of_another_rank_changes_nothing() -> None:
    """The rank comes last in the envelope: what the batch would teach is applied only once it is accepted."""
    normalizer = _normalizer(True)
    payload = _payload([_store([1], group_idx=3)], rank=WORKER.dp_rank + 1)
    assert normalizer.normalize_payload(payload) == (WORKER.dp_rank + 1, None)
    assert normalizer.framework._groups == {}
    rank, normalized = normalizer.normalize_payload(_payload([_store([1], group_idx=3)]))
    assert rank == WORKER.dp_rank and normalized is not None and normalized.blocks == 1
    assert normalizer.framework._groups == {(WORKER.dp_rank, 3): ("full_attention", None)}


@needs_native
def test_a_cache_namespace_sends_every_batch_to_python() -> None:
    normalizer = _normalizer(True)
    salted = _payload([_store([1], cache_salt="tenant")])
    assert _outcome(normalizer, salted) == _outcome(_normalizer(False), salted)
    assert normalizer.framework._namespaces  # from now on the core is not asked
    rank, normalized = normalizer.normalize_payload(_payload([_store([2], parent=1)]))
    assert normalized is not None and normalized.blocks is None  # the Python path counted nothing


# -- plain streams ----------------------------------------------------------------------------------------

_hash = st.integers(0, 2**64 - 1)
_group = st.sampled_from([None, 0, 0, 1, 2])
_kind = st.sampled_from([None, "", "full_attention", "mla_attention", "sink_full_attention"])


@st.composite
def _plain_event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["store", "store", "remove", "clear"]))
    if kind == "clear":
        return {"type": "AllBlocksCleared", **draw(st.sampled_from([{}, {"medium": ""}, {"locality": "LOCAL"}]))}
    hashes = draw(st.lists(_hash, min_size=1 if kind == "store" else 0, max_size=5, unique=True))
    optional: dict[str, Any] = {
        "group_idx": draw(_group),
        "kv_cache_spec_kind": draw(_kind),
        "medium": draw(st.sampled_from([None, "", "GPU", "DEVICE"])),
        "locality": draw(st.sampled_from([None, "LOCAL"])),
    }
    if kind == "remove":
        return {"type": "BlockRemoved", "block_hashes": hashes, **optional}
    extra = draw(st.integers(0, 3))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(hashes) * BLOCK_SIZE + extra,
                           max_size=len(hashes) * BLOCK_SIZE + extra))
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": draw(st.one_of(st.none(), _hash.filter(lambda h: h not in hashes))),
        "token_ids": tokens,
        "block_size": BLOCK_SIZE,
        "kv_cache_spec_sliding_window": draw(st.sampled_from([None, 32])),
        "session_id": draw(st.sampled_from([None, "s-1", "séance"])),
        "lora_name": draw(st.sampled_from([None, ""])),
        "cache_salt": draw(st.sampled_from([None, ""])),
        "extra_keys": draw(st.sampled_from([None, [], [None] * len(hashes)])),
        **optional,
    }


_plain_batch = st.tuples(
    st.floats(allow_nan=False),
    st.lists(_plain_event(), max_size=8),
    st.sampled_from([None, WORKER.dp_rank, WORKER.dp_rank, 0]),
)


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_plain_batch, min_size=1, max_size=8))
def test_plain_streams_agree_with_python(batches: list[tuple[Any, ...]]) -> None:
    native, python = _normalizer(True), _normalizer(False)
    for batch in batches:
        payload = bytes(msgpack.packb(list(batch)))
        assert _outcome(native, payload) == _outcome(python, payload)


@needs_native
def test_plain_batches_take_the_core() -> None:
    normalizer = _normalizer(True)
    events = [_store([1, 2], session_id="s"), _remove([1]), {"type": "AllBlocksCleared"}, _store([3], parent=2)]
    rank, normalized = normalizer.normalize_payload(_payload(events))
    assert normalized is not None and normalized.blocks == 4  # counted by the core
    assert [event.session_id for event in normalized.events] == ["s", None, None, None]
    assert _outcome(_normalizer(True), _payload(events)) == _outcome(_normalizer(False), _payload(events))


@needs_native
def test_chunk_blocks_counts_as_python_does() -> None:
    from kvagent.coordinator.machine import _chunk_blocks
    from kvagent.model.events import CLEARED, Cleared, PlacementEvent, Removed, ResidencyDomain, StorageTier

    def event(data: Any) -> PlacementEvent:
        return PlacementEvent(data, StorageTier.DEVICE, ResidencyDomain.WORKER, 0)

    assert _native.core is not None
    events = [event(Stored(None, (1, 2, 3), (4, 5, 6))), event(CLEARED), event(Removed((7, 8))), event(Removed(()))]
    assert _native.core.chunk_blocks(events) == _chunk_blocks(events) == 5
    assert _native.core.chunk_blocks([*events, event(Cleared())]) == -1  # not the CLEARED value: Python counts
    assert _native.core.chunk_blocks([]) == 0


@needs_native
@pytest.mark.parametrize(
    ("hashes", "parent", "native"),
    [
        (list(range(1, 301)), None, True),  # a long prompt's prefill: past the short chains' quadratic check
        ([*range(1, 301), 150], None, False),  # a repeated hash in a long chain
        (list(range(1, 301)), 150, False),  # the parent inside a long chain
        ([*range(1, 64), 7], None, False),  # a repeat in a short one
    ],
    ids=["long", "long repeat", "long parent inside", "short repeat"],
)
def test_long_chains(hashes: list[int], parent: int | None, native: bool) -> None:
    payload = _payload([_store(hashes, parent=parent)])
    assert _native.core is not None
    taken = _native.core.normalize_payload(payload, BLOCK_SIZE, WORKER.dp_rank, {}) is not None
    assert taken == native
    assert _outcome(_normalizer(True), payload) == _outcome(_normalizer(False), payload)


@needs_native
def test_mutated_plain_payloads_never_diverge() -> None:
    """Bytes changed, cut out or put in anywhere in plain batches: the core reads them in place, so every
    outcome (taken, declined to Python, refused) must be Python's, and nothing may read past the payload."""
    import random

    rng = random.Random(20261205)
    seeds = [_payload([_store([1, 2], session_id="s"), _remove([1]), _store([3], parent=2)]),
             _payload([{"type": "AllBlocksCleared"}, _store(list(range(10, 90)))])]
    taken = 0
    for _ in range(2000):
        mutated = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(mutated))
            choice = rng.random()
            if choice < 0.7:
                mutated[at] = rng.randrange(256)
            elif choice < 0.85:
                del mutated[at : at + rng.randint(1, 8)]
            else:
                mutated[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        payload = bytes(mutated)
        assert _native.core is not None
        taken += _native.core.normalize_payload(payload, BLOCK_SIZE, WORKER.dp_rank, {}) is not None
        assert _outcome(_normalizer(True), payload) == _outcome(_normalizer(False), payload)
    assert taken > 0  # some mutations stay plain (changed values), so the core's results were compared
