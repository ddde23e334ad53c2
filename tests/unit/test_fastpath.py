"""The ingest fast path agrees with the general decoder + normalizer (which define behaviour) on every input.

Every check runs twice (``native``): the payload path ``AttachmentNormalizer.normalize_payload`` — decode,
rank check and normalize — through the compiled core (kvagent/_native, skipped when it is not built) and
through pure Python, each against the general path.

Decoding: the private typed decoder (msgspec) against the private checked decoder, which defines behaviour.
Normalizing: each check runs two attachment normalizers in lockstep over the same stream, one through
``AttachmentNormalizer.normalize`` (the common shapes inline) and one through ``normalize_event`` for every
event (the general path), so learned state (attention groups, cache namespaces) is compared too, not only
single events.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvagent import _native
from kvagent.model.errors import WireDecodeError
from kvagent.model.events import Stored, WorkerWithDpRank
from kvagent.vllm.decode import RawBatch, _decode_checked, _decode_typed, decode, decode_payload
from kvagent.vllm.normalize import AttachmentNormalizer, NormalizedBatch
from tests.support.fuzz_decoder import normalize_each
from tests.support.vectors import load_live, load_structs

BLOCK_SIZE = 4
WORKER = WorkerWithDpRank(7, 0)


NATIVE = [
    pytest.param(True, id="native", marks=pytest.mark.skipif(not _native.NATIVE, reason=_native.REASON)),
    pytest.param(False, id="python"),
]


def _normalizer(block_size: int = BLOCK_SIZE, native: bool = False) -> AttachmentNormalizer:
    return AttachmentNormalizer(kv_block_size=block_size, worker=WORKER, image_token_id=32000, native=native)


def _with_tokens(batch: NormalizedBatch) -> list[object]:
    """The events with each Stored's token bytes (not part of Stored equality)."""
    return [(e, e.data.token_bytes if isinstance(e.data, Stored) else None) for e in batch.events]


class Lockstep:
    """The fast and the general path over one stream; every payload must give the same outcome.

    ``payload_path`` takes each payload through ``normalize_payload`` (natively with ``native``).
    """

    def __init__(self, block_size: int = BLOCK_SIZE, native: bool = False) -> None:
        self.fast = _normalizer(block_size)
        self.general = _normalizer(block_size)
        self.payload_path = _normalizer(block_size, native)
        self.payload_general = _normalizer(block_size)  # the general path, with the listener's rank check
        self.fast_hits = 0
        self.native_hits = 0

    def feed(self, payload: bytes) -> NormalizedBatch | None:
        try:
            expected_raw = _decode_checked(payload, True)
        except WireDecodeError as error:
            if _decode_typed(payload) is not None:
                # The one deliberate difference: msgspec skips keys it does not know, and their values,
                # without decoding them, so invalid UTF-8 there cannot fail the batch.
                assert "can't decode" in str(error), f"fast path accepted a payload the decoder refuses: {error}"
                return None
            with pytest.raises(WireDecodeError):
                self.payload_path.normalize_payload(payload)
            return None
        expected = normalize_each(self.general, expected_raw)
        self._feed_payload(payload, expected_raw)
        batch = _decode_typed(payload)
        if batch is None:
            # Declined: decode hands the same payload to the checked decoder.
            assert decode_payload(payload) == expected_raw
            batch = expected_raw
        else:
            self.fast_hits += 1
            assert batch == expected_raw
        assert self.fast.normalize(batch) == expected
        assert self.fast.framework._groups == self.general.framework._groups
        assert self.fast.framework._namespaces == self.general.framework._namespaces
        return expected

    def _feed_payload(self, payload: bytes, raw: RawBatch) -> None:
        try:
            got_rank, got = self.payload_path.normalize_payload(payload)
        except WireDecodeError:
            # Only the typed decoder's one deliberate difference can make decode refuse what the checked
            # decoder took; then decode_payload refuses it too.
            with pytest.raises(WireDecodeError):
                decode_payload(payload)
            return
        rank = raw.data_parallel_rank or 0
        assert got_rank == rank
        if rank != WORKER.dp_rank:
            assert got is None  # nothing normalized, nothing learned
        else:
            assert got is not None
            if got.blocks is not None:
                self.native_hits += 1
            expected = normalize_each(self.payload_general, raw)
            assert got == expected
            assert _with_tokens(got) == _with_tokens(expected)
        assert self.payload_path.framework._groups == self.payload_general.framework._groups
        assert self.payload_path.framework._namespaces == self.payload_general.framework._namespaces


@pytest.mark.parametrize("native", NATIVE)
def test_live_capture_takes_the_fast_path_and_agrees(native: bool) -> None:
    lockstep = Lockstep(block_size=32, native=native)  # the capture's engine ran with block size 32
    payloads = [frames[2] for frames in load_live()[0]]
    for payload in payloads:
        assert lockstep.feed(payload) is not None
    assert lockstep.fast_hits == len(payloads) == 68
    assert lockstep.native_hits == (68 if native else 0)  # every live batch is plain


@pytest.mark.parametrize("native", NATIVE)
def test_struct_vectors_agree_whichever_path_takes_them(native: bool) -> None:
    cases = load_structs()
    assert cases
    for _note, frames in cases.values():
        Lockstep(block_size=16, native=native).feed(frames[-1])


def test_live_frames_use_the_fast_decoder_and_fall_back_for_other_forms() -> None:
    store = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": 4}
    seq = (5).to_bytes(8, "big")
    fast_payload = msgpack.packb([1.0, [store], 0])
    fast = decode([b"kv", seq, fast_payload])
    assert _decode_typed(fast_payload) == fast.batch and fast.seq == 5 and fast.topic == b"kv"
    positional = ["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU"]
    typed_payload = msgpack.packb([1.0, [positional], 0])
    typed = decode([b"kv", seq, typed_payload])
    assert _decode_typed(typed_payload) == typed.batch
    # One batch mixing both forms is legal (docs/spec/vllm-wire.md 0.4) but not typed: the checked decoder takes it.
    mixed = msgpack.packb([1.0, [store, positional], 0])
    general = decode([b"kv", seq, mixed])
    assert _decode_typed(mixed) is None and general.seq == 5
    assert typed.batch.events[0] == general.batch.events[1]
    with pytest.raises(WireDecodeError, match="token_ids"):
        decode([b"kv", seq, msgpack.packb([1.0, [{**store, "token_ids": [True]}], 0])])
    with pytest.raises(WireDecodeError, match="sequence frame"):
        decode([b"kv", b"\x00", msgpack.packb([1.0, [store], 0])])
    with pytest.raises(WireDecodeError, match="exceeds"):
        decode([b"kv", seq, msgpack.packb([1.0, [store], 0])], max_payload_bytes=8)


# --- generated streams ---------------------------------------------------------------------------------

_hash = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1), st.integers(-(2**63), -1))
_maybe_str = st.one_of(st.none(), st.sampled_from(["", "GPU", "CPU", "DISK", "kvcr", "LOCAL", "x"]))
_kind = st.one_of(
    st.none(), st.sampled_from(["", "full_attention", "sliding_window", "mamba", "weird_kind"])
)
_extra_entry = st.one_of(
    st.none(),
    st.just("dynamo-cache-salt:tenant-a"),
    st.just("lora-x"),
    st.just("00000000000000ab" + "0" * 48),
    st.lists(st.sampled_from(["dynamo-cache-salt:b", "00000000000000cd" + "0" * 48, 3]), max_size=2),
)


@st.composite
def _store(draw: st.DrawFn) -> dict[str, Any]:
    hashes = draw(st.lists(_hash, min_size=0, max_size=4))
    block_size = draw(st.sampled_from([BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE, 2]))
    tokens = draw(
        st.lists(st.integers(0, 40_000), min_size=max(0, len(hashes) * BLOCK_SIZE - 2),
                 max_size=len(hashes) * BLOCK_SIZE + 2)
    )
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": draw(st.one_of(st.none(), _hash, st.sampled_from([*hashes, None]))),
        "token_ids": tokens,
        "block_size": block_size,
    }
    optional = {
        "lora_id": st.one_of(st.none(), st.integers(0, 3)),
        "medium": st.one_of(st.none(), st.sampled_from(["GPU", "", "CPU_PINNED", "DISK", "NVME", "TAPE"])),
        "lora_name": st.one_of(st.none(), st.just(""), st.just("lora-x")),
        "extra_keys": st.one_of(st.none(), st.lists(_extra_entry, max_size=4)),
        "group_idx": st.one_of(st.none(), st.integers(0, 2)),
        "kv_cache_spec_kind": _kind,
        "kv_cache_spec_sliding_window": st.one_of(st.none(), st.integers(1, 64)),
        "locality": st.one_of(st.none(), st.sampled_from(["LOCAL", "REMOTE"])),
        "ownership": st.one_of(st.none(), st.none(), st.sampled_from(["kvcr", "other"])),
        "session_id": st.one_of(st.none(), st.just("s1")),
        "cache_salt": st.one_of(st.none(), st.just(""), st.just("salt")),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            event[key] = draw(strategy)
    return event


@st.composite
def _remove(draw: st.DrawFn) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": draw(st.lists(_hash, max_size=3))}
    for key, strategy in {
        "medium": _maybe_str,
        "group_idx": st.one_of(st.none(), st.integers(0, 2)),
        "kv_cache_spec_kind": _kind,
        "locality": st.one_of(st.none(), st.sampled_from(["LOCAL", "REMOTE"])),
        "ownership": st.one_of(st.none(), st.none(), st.sampled_from(["kvcr", "other"])),
    }.items():
        if draw(st.booleans()):
            event[key] = draw(strategy)
    return event


_cleared = st.fixed_dictionaries(
    {"type": st.just("AllBlocksCleared")},
    optional={"medium": _maybe_str, "ownership": st.sampled_from([None, "kvcr"])},
)
_event = st.one_of(
    _store(), _store(), _remove(), _cleared, st.just({"type": "TierBlocksCleared", "tier": "CPU"})
)
_STORED_SLOTS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                 "locality", "ownership")
_REMOVED_SLOTS = ("block_hashes", "medium", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                  "locality", "ownership")


@st.composite
def _positional(draw: st.DrawFn) -> list[Any]:
    """The same events in vLLM's older positional form, cut after a random number of slots."""
    event = draw(_event)
    tag = event["type"]
    slots = {"BlockStored": _STORED_SLOTS, "BlockRemoved": _REMOVED_SLOTS, "AllBlocksCleared": ("ownership",)}
    values = [event.get(key) for key in slots.get(tag, ())]
    required = {"BlockStored": 4, "BlockRemoved": 1}.get(tag, 0)
    return [tag, *values[: draw(st.integers(required, len(values)))]]


_batch = st.tuples(
    st.one_of(st.floats(allow_nan=False), st.integers(0, 10)),
    st.one_of(st.lists(_event, max_size=6), st.lists(_positional(), max_size=6)),
    st.one_of(st.none(), st.just(0)),
)


@pytest.mark.parametrize("native", NATIVE)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_batch, min_size=1, max_size=6))
def test_generated_streams_agree(native: bool, batches: list[tuple[Any, ...]]) -> None:
    lockstep = Lockstep(native=native)
    for batch in batches:
        lockstep.feed(msgpack.packb(list(batch)))


@pytest.mark.parametrize("native", NATIVE)
def test_mutated_payloads_never_diverge(native: bool) -> None:
    rng = random.Random(20261202)
    store = {"type": "BlockStored", "block_hashes": [2**63 + 5, 7], "parent_block_hash": 3,
             "token_ids": list(range(1000, 1008)), "block_size": BLOCK_SIZE, "lora_id": None,
             "medium": "GPU", "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
             "kv_cache_spec_kind": "full_attention"}
    remove = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    seed = msgpack.packb([1.5, [store, remove, {"type": "AllBlocksCleared"}], 0])
    accepted = 0
    for _ in range(3000):
        payload = bytearray(seed)
        for _ in range(rng.randint(1, 3)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        if Lockstep(native=native).feed(bytes(payload)) is not None:
            accepted += 1
    assert accepted > 0  # some mutations stay valid (changed values), so both paths were compared
