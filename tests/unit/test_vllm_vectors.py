"""Every vLLM 0.32.0 vector (tests/data/vectors), decoded and normalized, with its outcome asserted per case.

The byte-level examples of the wire reference are in test_decode.py; the pinned LocalBlockHash vector and the
empty chunking case in test_normalize.py.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import xxhash

from kvagent.model.errors import WireDecodeError
from kvagent.model.events import CLEARED, Removed, ResidencyDomain, StorageTier, Stored, WorkerWithDpRank
from kvagent.vllm.decode import (
    RawAllBlocksCleared,
    RawBlockRemoved,
    RawBlockStored,
    decode,
)
from kvagent.vllm.normalize import AttachmentNormalizer, bounded_ingress_chunks
from tests.support.vectors import load_live, load_structs

W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
DEV, HOST, DISK = StorageTier.DEVICE, StorageTier.HOST_PINNED, StorageTier.DISK
STRUCTS = load_structs()

# case -> ("error", message pattern) or ([(domain, tier, kind)], source fault, cache-owner fault, filtered)
EXPECTED: dict[str, Any] = {
    "gpu_chain_remove_clear": ([(W, DEV, "S"), (W, DEV, "S"), (W, DEV, "R"), (W, DEV, "C")], None, None, {}),
    "cpu_offload_framework": ([(W, HOST, "S"), (W, HOST, "R")], None, None, {}),
    "kvcr_tiers": ([(C, HOST, "S"), (C, DISK, "S"), (C, DISK, "R")], None, None, {}),
    "kvcr_clear": ([(C, DEV, "C")], None, None, {}),
    "kvcr_gpu_fault": ([(W, DEV, "S")], None, "KVCR ownership has an unsupported storage medium", {}),
    "unknown_ownership": ([], "unknown raw event ownership", None, {}),
    "remote_locality": ([(W, DEV, "S")], None, None, {"non_local_locality": 1}),
    "sliding_window_group": ([(W, DEV, "S")], None, None, {"non_main_attention_kind": 1}),
    "block_size_mismatch": ([(W, DEV, "S")], None, None, {}),
    "lora_store": ([(W, DEV, "S")], None, None, {}),
    "rank_1_batch": ([(W, DEV, "S")], None, None, {}),
    "many_events": ([(W, DEV, "S")] * 200, None, None, {}),
    "huge_event": ([(W, DEV, "S")], None, None, {}),
    "bytes_hashes": ([(W, DEV, "S")], None, None, {}),
    "negative_hash": ([(W, DEV, "S"), (W, DEV, "R")], None, None, {}),
    "legacy_array_events": ([(W, DEV, "S"), (W, DEV, "R"), (W, DEV, "C")], None, None, {}),
    "v0_9_envelope": ([(W, DEV, "S")], None, None, {}),
    "truncated_payload": ("error", "^payload is not valid msgpack"),
    "envelope_not_array": ("error", "^envelope: expected an array"),
    "events_not_list": ("error", "^envelope.events: expected a list, got int"),
    "unknown_tag": ("error", "unknown event tag"),
    "stored_missing_hashes": ("error", "^BlockStored.block_hashes: required field is missing"),
    "short_sequence_frame": ("error", "^sequence frame must be exactly 8 bytes, got 7"),
    "two_frames": ("error", r"^expected 3 frames \[topic, seq, payload\], got 2"),
}


def normalizer() -> AttachmentNormalizer:
    return AttachmentNormalizer(kv_block_size=16, worker=WorkerWithDpRank(1, 0))


def kind(data: object) -> str:
    return "C" if data is CLEARED else "R" if isinstance(data, Removed) else "S"


def test_every_case_has_an_expectation() -> None:
    assert sorted(STRUCTS) == sorted(EXPECTED)


@pytest.mark.parametrize("case", sorted(STRUCTS))
def test_struct_case(case: str) -> None:
    frames = STRUCTS[case][1]
    expected = EXPECTED[case]
    if expected[0] == "error":
        with pytest.raises(WireDecodeError, match=expected[1]):
            decode(frames)
        return
    placements, source_fault, owner_fault, filtered = expected
    result = normalizer().normalize(decode(frames).batch)
    assert [(e.domain, e.tier, kind(e.data)) for e in result.events] == placements
    assert (result.source_fault, result.cache_owner_fault, result.filtered) == (
        source_fault,
        owner_fault,
        filtered,
    )
    assert all(e.dp_rank == 0 for e in result.events)


def test_block_size_mismatch_truncates_and_counts_unpublished_blocks() -> None:
    message = decode(STRUCTS["block_size_mismatch"][1])
    raw = message.batch.events[0]
    assert isinstance(raw, RawBlockStored) and raw.block_size == 32
    result = normalizer().normalize(message.batch)
    stored = result.events[0].data
    assert isinstance(stored, Stored)
    assert (stored.block_hashes, stored.tokens_hashes) == ((), ())
    assert result.unpublished_blocks == len(raw.block_hashes) >= 1


def test_rank_1_batch_decodes_rank_1() -> None:
    batch = decode(STRUCTS["rank_1_batch"][1]).batch
    assert batch.data_parallel_rank == 1
    assert decode(STRUCTS["gpu_chain_remove_clear"][1]).batch.data_parallel_rank == 0


def test_many_events_split_into_128_and_72() -> None:
    many = normalizer().normalize(decode(STRUCTS["many_events"][1]).batch)
    assert [len(c) for c in bounded_ingress_chunks(many.events)] == [128, 72]


def test_huge_event_normalizes_and_is_split_across_chunks() -> None:
    huge = normalizer().normalize(decode(STRUCTS["huge_event"][1]).batch)
    stored = huge.events[0].data
    assert isinstance(stored, Stored) and len(stored.block_hashes) == 9000
    chunks = bounded_ingress_chunks(huge.events)
    assert [[len(e.data.block_hashes) for e in c] for c in chunks] == [[8192], [808]]
    assert tuple(h for c in chunks for e in c for h in e.data.block_hashes) == stored.block_hashes


def test_lora_store_seeds_the_local_hash_with_the_adapter_name() -> None:
    message = decode(STRUCTS["lora_store"][1])
    raw = message.batch.events[0]
    assert isinstance(raw, RawBlockStored) and raw.lora_name == "sql-adapter"
    stored = normalizer().normalize(message.batch).events[0].data
    assert isinstance(stored, Stored)
    seed = (1337 + xxhash.xxh3_64_intdigest(b"sql-adapter", seed=0)) % 2**64
    for i, tokens_hash in enumerate(stored.tokens_hashes):
        block = b"".join(t.to_bytes(4, "little") for t in raw.token_ids[16 * i : 16 * i + 16])
        assert tokens_hash == xxhash.xxh3_64_intdigest(block, seed=seed)
        assert tokens_hash != xxhash.xxh3_64_intdigest(block, seed=1337)


def test_hash_forms_fold_to_u64() -> None:
    raw = decode(STRUCTS["bytes_hashes"][1]).batch.events[0]
    wire_hashes = msgpack.unpackb(STRUCTS["bytes_hashes"][1][2], raw=False)[1][0]["block_hashes"]
    assert isinstance(raw, RawBlockStored)
    assert raw.block_hashes == tuple(int.from_bytes(h[-8:], "big") for h in wire_hashes)
    negative = decode(STRUCTS["negative_hash"][1]).batch
    wire = msgpack.unpackb(STRUCTS["negative_hash"][1][2], raw=False)[1]
    signed = [h for event in wire for h in event["block_hashes"]]
    assert any(h < 0 for h in signed)
    decoded = [
        h
        for event in negative.events
        if isinstance(event, RawBlockStored | RawBlockRemoved)
        for h in event.block_hashes
    ]
    assert decoded == [h & (2**64 - 1) for h in signed]


def test_live_capture_decodes_completely_and_replay_matches() -> None:
    sub, replay = load_live()
    counts = {"stored": 0, "removed": 0, "cleared": 0}
    payload_by_seq: dict[int, bytes] = {}
    for frames in sub:
        message = decode(frames)
        assert message.topic == b"kv-events" and message.batch.data_parallel_rank == 0
        payload_by_seq[message.seq] = frames[2]
        for event in message.batch.events:
            if isinstance(event, RawBlockStored):
                counts["stored"] += 1
                assert event.block_size == 32 and len(event.token_ids) == 32 * len(event.block_hashes)
            elif isinstance(event, RawBlockRemoved):
                counts["removed"] += 1
            else:
                assert isinstance(event, RawAllBlocksCleared)
                counts["cleared"] += 1
    assert counts == {"stored": 65, "removed": 17, "cleared": 1}
    assert list(payload_by_seq) == list(range(68))  # in order, no gap, no repeat
    assert decode(replay[-1], replay=True) is None  # the end marker
    replayed_seqs = []
    for frames in replay[:-1]:
        replayed = decode(frames, replay=True)
        assert replayed is not None and replayed.topic == b"kv-events"
        assert frames[3] == payload_by_seq[replayed.seq]
        replayed_seqs.append(replayed.seq)
    assert replayed_seqs == sorted(replayed_seqs) and replayed_seqs


def test_live_capture_normalizes_without_faults() -> None:
    sub, _ = load_live()
    attached = AttachmentNormalizer(kv_block_size=32, worker=WorkerWithDpRank(9, 0))
    stored_blocks = 0
    for frames in sub:
        result = attached.normalize(decode(frames).batch)
        assert (result.source_fault, result.cache_owner_fault, result.unpublished_blocks) == (None, None, 0)
        assert result.filtered == {}
        stored_blocks += sum(len(e.data.block_hashes) for e in result.events if isinstance(e.data, Stored))
    assert stored_blocks > 0
