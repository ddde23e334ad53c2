"""kvagent.wire.vllm_events: vLLM 0.32.0's encoding, pinned against vLLM's own bytes in tests/data/vectors."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import msgspec
import pytest

from kvagent.model.events import (
    CLEARED,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.vllm.decode import (
    RawAllBlocksCleared,
    RawBatch,
    RawBlockRemoved,
    RawBlockStored,
    decode,
    decode_payload,
)
from kvagent.vllm.normalize import AttachmentNormalizer
from kvagent.wire.vllm_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SnapshotBlock,
    encode_publication,
    encode_snapshot_batches,
    medium_of,
    token_ids,
)
from tests.support.vectors import load_live, load_structs

W = ResidencyDomain.WORKER
C = ResidencyDomain.CACHE_OWNER
DEV = StorageTier.DEVICE

# Cases whose map-form payload every field of which kvagent's decoder keeps (the rest are older layouts,
# folded hash forms, a KVCR clear with an ownership key, or deliberately broken bytes).
MAP_FORM_CASES = [
    "gpu_chain_remove_clear",
    "cpu_offload_framework",
    "kvcr_tiers",
    "kvcr_gpu_fault",
    "unknown_ownership",
    "remote_locality",
    "sliding_window_group",
    "block_size_mismatch",
    "lora_store",
    "rank_1_batch",
    "many_events",
    "huge_event",
]
# Cases holding only framework GPU/CPU stores, removes and clears without LoRA, groups or locality: what
# kvagent republishes is every field they carry, so kvagent's own pipeline must give back the same bytes.
REPUBLISHED_CASES = ["gpu_chain_remove_clear", "cpu_offload_framework"]


def reencoded(batch: RawBatch) -> bytes:
    """Every field kvagent's decoder read, written back through the 0.32.0 structs."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in batch.events:
        if isinstance(event, RawBlockStored):
            events.append(
                BlockStored(
                    event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                    event.lora_id, event.medium, event.lora_name, event.extra_keys, event.group_idx,
                    event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window, event.locality,
                    event.ownership, event.session_id,
                )
            )  # fmt: skip
        elif isinstance(event, RawBlockRemoved):
            events.append(
                BlockRemoved(
                    event.block_hashes, event.medium, event.group_idx, event.locality, event.ownership
                )
            )
        else:
            assert isinstance(event, RawAllBlocksCleared)
            events.append(AllBlocksCleared())
    return msgspec.msgpack.encode(KVEventBatch(batch.ts, events, batch.data_parallel_rank))


def test_structs_reencode_every_live_payload_byte_for_byte() -> None:
    sub, replay = load_live()
    payloads = [frames[2] for frames in sub] + [frames[3] for frames in replay if frames[2] != END_SEQ]
    assert len(payloads) == 136
    for payload in payloads:
        assert reencoded(decode_payload(payload)) == payload


@pytest.mark.parametrize("case", MAP_FORM_CASES)
def test_structs_reencode_vllm_struct_cases_byte_for_byte(case: str) -> None:
    frames = load_structs()[case][1]
    assert reencoded(decode(frames).batch) == frames[2]


def router_events(frames: list[bytes]) -> list[RouterEvent]:
    normalized = AttachmentNormalizer(kv_block_size=16, worker=WorkerWithDpRank(1, 0)).normalize(
        decode(frames).batch
    )
    return [
        RouterEvent(1, event.tier, event.domain, index, event.data, event.dp_rank)
        for index, event in enumerate(normalized.events)
    ]


@pytest.mark.parametrize("case", REPUBLISHED_CASES)
def test_kvagent_pipeline_republishes_vllm_bytes(case: str) -> None:
    frames = load_structs()[case][1]
    ts = decode(frames).batch.ts
    assert encode_publication(router_events(frames), ts=ts, dp_rank=0, block_size=16) == frames[2]


def test_live_capture_republished_payload_equals_the_engine_payload_minus_unkept_fields() -> None:
    """A live GPU store also carries extra_keys, group_idx and kv_cache_spec_kind, which kvagent drops."""
    sub, _ = load_live()
    for frames in sub:
        batch = decode(frames).batch
        normalizer = AttachmentNormalizer(kv_block_size=32, worker=WorkerWithDpRank(1, 0))
        events = [
            RouterEvent(1, event.tier, event.domain, index, event.data, 0)
            for index, event in enumerate(normalizer.normalize(batch).events)
        ]
        expected = msgpack.unpackb(frames[2], strict_map_key=False)
        for event in expected[1]:
            for key in ("extra_keys", "group_idx", "kv_cache_spec_kind"):
                event.pop(key, None)
        ours = encode_publication(events, ts=batch.ts, dp_rank=0, block_size=32)
        assert ours is not None
        assert msgpack.unpackb(ours, strict_map_key=False) == expected


def stored(
    *hashes: int, parent: int | None = None, tier: StorageTier = DEV, tokens: bool = True
) -> RouterEvent:
    token_bytes = struct.pack(f"<{2 * len(hashes)}I", *range(2 * len(hashes))) if tokens else None
    data = Stored(parent, hashes, tuple(h + 1000 for h in hashes), token_bytes=token_bytes)
    return RouterEvent(7, tier, W, 0, data, 0)


def test_publication_decodes_back_with_kvagents_decoder() -> None:
    events = [
        stored(1, 2, tier=StorageTier.HOST_PINNED),
        stored(3, parent=2, tier=StorageTier.DISK),
        RouterEvent(7, StorageTier.EXTERNAL, W, 0, Removed((1, (1 << 64) - 1)), 0),
        RouterEvent(7, DEV, W, 0, CLEARED, 0),
    ]
    batch = decode_payload(encode_publication(events, ts=12.5, dp_rank=3, block_size=2) or b"")
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    first, second, removed, cleared = batch.events
    assert isinstance(first, RawBlockStored) and isinstance(second, RawBlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ((1, 2), None, (0, 1, 2, 3))
    assert (first.medium, second.medium, second.parent_block_hash) == ("CPU", "STORAGE", 2)
    assert isinstance(removed, RawBlockRemoved) and removed.block_hashes == (1, (1 << 64) - 1)
    assert removed.medium == "EXTERNAL"
    assert isinstance(cleared, RawAllBlocksCleared)


@pytest.mark.parametrize("tier", list(StorageTier))
def test_every_medium_reads_back_as_its_tier(tier: StorageTier) -> None:
    assert StorageTier.from_medium(medium_of(tier)) is tier


def test_noops_and_other_domains_are_skipped() -> None:
    cache_owner = RouterEvent(7, StorageTier.HOST_PINNED, C, 0, Stored(None, (5,), (6,)), 0)
    empty_store = RouterEvent(7, DEV, W, 0, Stored(None, (), ()), 0)
    empty_remove = RouterEvent(7, DEV, W, 0, Removed(()), 0)
    assert (
        encode_publication([cache_owner, empty_store, empty_remove], ts=1.0, dp_rank=0, block_size=2) is None
    )
    payload = encode_publication([cache_owner, stored(9), empty_remove], ts=1.0, dp_rank=0, block_size=2)
    assert [event["block_hashes"] for event in msgpack.unpackb(payload)[1]] == [[9]]


def test_store_without_tokens_is_published_with_empty_token_ids() -> None:
    payload = encode_publication([stored(4, tokens=False)], ts=1.0, dp_rank=0, block_size=2)
    assert msgpack.unpackb(payload)[1][0]["token_ids"] == []


def test_ts_is_always_float64_even_from_an_int_clock() -> None:
    payload = encode_publication([stored(4)], ts=5, dp_rank=0, block_size=2)
    assert payload is not None and payload[:2] == b"\x93\xcb"


def test_token_ids_round_trip() -> None:
    assert token_ids(None) == [] and token_ids(b"") == []
    values = [0, 1, 2**32 - 1, 70000]
    assert list(token_ids(struct.pack("<4I", *values))) == values


def snapshot_events(payloads: Sequence[bytes]) -> list[dict[str, Any]]:
    return [event for payload in payloads for event in msgpack.unpackb(payload, strict_map_key=False)[1]]


def block(tier: StorageTier, block_hash: int, parent: int | None, tokens: bool = True) -> SnapshotBlock:
    return tier, block_hash, parent, struct.pack("<2I", block_hash, block_hash + 1) if tokens else None


def test_empty_snapshot_is_one_payload_holding_only_the_clear() -> None:
    payloads = list(encode_snapshot_batches([], ts=1.0, dp_rank=2, block_size=2))
    assert len(payloads) == 1
    assert msgpack.unpackb(payloads[0]) == [1.0, [{"type": "AllBlocksCleared"}], 2]


def test_snapshot_merges_chains_and_splits_runs_that_do_not_continue() -> None:
    host = StorageTier.HOST_PINNED
    blocks = [
        block(DEV, 1, None),
        block(DEV, 2, 1),
        block(DEV, 3, 2),
        block(DEV, 4, 2),  # a sibling: a new store
        block(host, 5, 4),  # same parent chain, other tier: a new store
        block(host, 6, 5, tokens=False),  # tokens unknown: not merged with a block that has them
        block(host, 7, 6, tokens=False),
    ]
    events = snapshot_events(list(encode_snapshot_batches(blocks, ts=1.0, dp_rank=0, block_size=2)))
    assert events[0] == {"type": "AllBlocksCleared"}
    shape = [(e["block_hashes"], e["parent_block_hash"], e["medium"], e["token_ids"]) for e in events[1:]]
    assert shape == [
        ([1, 2, 3], None, "GPU", [1, 2, 2, 3, 3, 4]),
        ([4], 2, "GPU", [4, 5]),
        ([5], 4, "CPU", [5, 6]),
        ([6, 7], 5, "CPU", []),
    ]


def test_snapshot_payloads_hold_at_most_max_blocks() -> None:
    blocks = [block(DEV, h, h - 1 if h > 1 else None) for h in range(1, 1001)]
    payloads = list(encode_snapshot_batches(blocks, ts=1.0, dp_rank=0, block_size=2, max_blocks=64))
    counts = [sum(len(e.get("block_hashes", [])) for e in snapshot_events([p])) for p in payloads]
    assert max(counts) <= 64 and sum(counts) == 1000
    events = snapshot_events(payloads)
    assert events[0] == {"type": "AllBlocksCleared"}
    chain = [h for e in events[1:] for h in e["block_hashes"]]
    assert chain == list(range(1, 1001))
    # A run cut at a payload boundary continues in the next payload under its real parent.
    parents = [e["parent_block_hash"] for e in events[1:]]
    assert parents[0] is None and all(
        p == e["block_hashes"][0] - 1 for p, e in zip(parents[1:], events[2:], strict=True)
    )


def test_snapshot_rejects_a_zero_payload_bound() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        list(encode_snapshot_batches([], ts=1.0, dp_rank=0, block_size=2, max_blocks=0))
