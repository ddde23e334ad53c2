"""The seed's normalization tests (agent-semantics 9.1 and 9.2), and decoder robustness under Hypothesis."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.model.errors import WireDecodeError
from kvagent.model.events import IngressProtocol, ResidencyDomain, StorageTier, WorkerWithDpRank
from kvagent.vllm.decode import RawAllBlocksCleared, RawBatch, RawBlockStored, decode_frames, decode_payload
from kvagent.vllm.normalize import AttachmentNormalizer, preprocess_legacy
from tests.support.vectors import load_live, load_structs

W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
DEV, HOST, DISK = StorageTier.DEVICE, StorageTier.HOST_PINNED, StorageTier.DISK


def raw_store(medium: str | None, ownership: str | None, block: int) -> RawBlockStored:
    return RawBlockStored((block,), None, (10, 11, 12, 13), 4, medium=medium, ownership=ownership)


def worker_normalizer() -> AttachmentNormalizer:
    return AttachmentNormalizer(
        kv_block_size=4, worker=WorkerWithDpRank(17, 3), ingress_protocol=IngressProtocol.VLLM_RESIDENCY_V1
    )


def test_raw_ownership_maps_domains_and_quarantines_unsupported_kvcr() -> None:
    normalizer = worker_normalizer()
    first = normalizer.normalize(
        RawBatch(
            1.0,
            (
                raw_store(None, None, 101),
                raw_store("CPU", None, 102),
                raw_store("CPU_PINNED", "kvcr", 103),
                raw_store("STORAGE", "kvcr", 104),
                RawAllBlocksCleared(ownership="kvcr"),
            ),
            3,
        )
    )
    assert first.source_fault is None and first.cache_owner_fault is None
    assert [(e.domain, e.tier) for e in first.events] == [(W, DEV), (W, HOST), (C, HOST), (C, DISK), (C, DEV)]

    second = normalizer.normalize(
        RawBatch(2.0, (raw_store("GPU", "kvcr", 105), raw_store(None, None, 106)), 3)
    )
    assert second.cache_owner_fault == "KVCR ownership has an unsupported storage medium"
    assert second.source_fault is None
    assert [e.domain for e in second.events] == [W]

    assert preprocess_legacy(raw_store("CPU", "kvcr", 107)) == "unsupported_ownership"

    third = normalizer.normalize(RawBatch(3.0, (raw_store("CPU", "future_owner", 108),), 3))
    assert third.source_fault == "unknown raw event ownership"


def named(event_type: str, **fields: object) -> dict[str, object]:
    return {"type": event_type, **fields}


def test_production_named_map_ownership_reaches_exact_local_recovery_owners() -> None:
    def stored(
        hashes: list[int], parent: int | None, first_token: int, medium: str, **extra: object
    ) -> dict[str, object]:
        tokens = list(range(first_token, first_token + 4 * len(hashes)))
        return named(
            "BlockStored",
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=4,
            lora_id=None,
            medium=medium,
            lora_name=None,
            **extra,
        )

    kvcr = {"locality": "LOCAL", "ownership": "kvcr"}
    events = [
        stored([101], None, 10, "CPU_PINNED", **kvcr),
        stored([102, 202], 101, 14, "STORAGE", **kvcr),
        named("BlockRemoved", block_hashes=[102], medium="STORAGE", **kvcr),
        stored([105], None, 22, "CPU_PINNED", **kvcr),
        named("BlockRemoved", block_hashes=[101], medium="CPU_PINNED", **kvcr),
        stored([106], None, 26, "CPU", locality="LOCAL"),
        stored([104], None, 30, "GPU"),
    ]
    batch = decode_payload(msgpack.packb([1.0, events, 3]))
    normalizer = worker_normalizer()
    result = normalizer.normalize(batch)
    assert result.cache_owner_fault is None and result.source_fault is None
    assert [(e.domain, e.tier) for e in result.events] == [
        (C, HOST),
        (C, DISK),
        (C, DISK),
        (C, HOST),
        (C, HOST),
        (W, HOST),
        (W, DEV),
    ]
    second = decode_payload(
        msgpack.packb(
            [
                2.0,
                [
                    stored([108], None, 34, "GPU"),
                    named("AllBlocksCleared"),
                    named("AllBlocksCleared", ownership="kvcr"),
                ],
                3,
            ]
        )
    )
    result2 = normalizer.normalize(second)
    assert result2.source_fault is None and result2.cache_owner_fault is None
    assert [e.domain for e in result2.events] == [W, W, C]


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=20), children, max_size=6)
    ),
    max_leaves=40,
)


envelopes = st.tuples(
    st.floats(allow_nan=False),
    st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(
                    ["BlockStored", "BlockRemoved", "AllBlocksCleared", "TierBlocksCleared"]
                )
            },
            optional={
                "block_hashes": st.lists(
                    st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=1), max_size=4
                ),
                "parent_block_hash": st.none() | st.integers(0, 2**64 - 1),
                "token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=40),
                "block_size": st.integers(0, 20),
                "medium": st.none()
                | st.sampled_from(["GPU", "CPU", "CPU_PINNED", "STORAGE", "DISK", "FS", ""]),
                "ownership": st.none() | st.sampled_from(["kvcr", "future_owner"]),
                "locality": st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
                "group_idx": st.none() | st.integers(0, 3),
                "kv_cache_spec_kind": st.none() | st.sampled_from(["full_attention", "sliding_window", "x"]),
                "extra_keys": st.none()
                | st.lists(st.none() | st.lists(st.text(max_size=70), max_size=3), max_size=4),
                "lora_name": st.none() | st.text(max_size=8),
            },
        )
        | msgpack_values,
        max_size=8,
    ),
    st.none() | st.integers(0, 4),
).map(list)


@settings(max_examples=300, deadline=None)
@given(msgpack_values | envelopes)
def test_random_msgpack_only_raises_the_typed_error(value: object) -> None:
    payload = msgpack.packb(value)
    try:
        batch = decode_payload(payload)
    except WireDecodeError:
        return
    worker_normalizer().normalize(batch)  # never raises on anything the decoder accepted


SEEDS = [frames for (_note, frames) in load_structs().values() if len(frames) == 3] + load_live()[0][:10]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(SEEDS),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
    st.integers(0, 10_000),
)
def test_mutated_vectors_only_raise_the_typed_error(
    frames: list[bytes], flips: list[tuple[int, int]], cut: int
) -> None:
    payload = bytearray(frames[2])
    for position, value in flips:
        if payload:
            payload[position % len(payload)] = value
    if cut and payload:
        payload = payload[: cut % (len(payload) + 1)]
    try:
        message = decode_frames([frames[0], frames[1], bytes(payload)])
    except WireDecodeError:
        return
    worker_normalizer().normalize(message.batch)
