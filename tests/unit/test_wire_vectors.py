"""Every vLLM 0.32.0 vector, decoded and normalized, with its expected outcome asserted case by case."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import xxhash

from kvagent.model.errors import ChunkingError, WireDecodeError
from kvagent.model.events import (
    CLEARED,
    IngressProtocol,
    Removed,
    ResidencyDomain,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.vllm.decode import (
    RawAllBlocksCleared,
    RawBlockRemoved,
    RawBlockStored,
    decode_frames,
    decode_payload,
    decode_replay_reply,
    is_replay_end_marker,
)
from kvagent.vllm.normalize import AttachmentNormalizer, bounded_ingress_chunks
from tests.support.vectors import load_live, load_structs

W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
DEV, HOST, DISK = StorageTier.DEVICE, StorageTier.HOST_PINNED, StorageTier.DISK
STRUCTS = load_structs()

# case -> expected: ("error", message fragment) or (placements [(domain, tier, kind)], source fault, owner fault)
EXPECTED: dict[str, Any] = {
    "gpu_chain_remove_clear": ([(W, DEV, "S"), (W, DEV, "S"), (W, DEV, "R"), (W, DEV, "C")], None, None),
    "cpu_offload_framework": ([(W, HOST, "S"), (W, HOST, "R")], None, None),
    "kvcr_tiers": ([(C, HOST, "S"), (C, DISK, "S"), (C, DISK, "R")], None, None),
    "kvcr_clear": ([(C, DEV, "C")], None, None),
    "kvcr_gpu_fault": ([(W, DEV, "S")], None, "KVCR ownership has an unsupported storage medium"),
    "unknown_ownership": ([], "unknown raw event ownership", None),
    "remote_locality": ([(W, DEV, "S")], None, None),
    "sliding_window_group": ([(W, DEV, "S")], None, None),
    "block_size_mismatch": ([(W, DEV, "S")], None, None),
    "lora_store": ([(W, DEV, "S")], None, None),
    "rank_1_batch": ([(W, DEV, "S")], None, None),
    "many_events": ([(W, DEV, "S")] * 200, None, None),
    "huge_event": ([(W, DEV, "S")], None, None),
    "bytes_hashes": ([(W, DEV, "S")], None, None),
    "negative_hash": ([(W, DEV, "S"), (W, DEV, "R")], None, None),
    "legacy_array_events": ([(W, DEV, "S"), (W, DEV, "R"), (W, DEV, "C")], None, None),
    "v0_9_envelope": ([(W, DEV, "S")], None, None),
    "truncated_payload": ("error", "not valid msgpack"),
    "envelope_not_array": ("error", "envelope"),
    "events_not_list": ("error", "envelope.events"),
    "unknown_tag": ("error", "unknown event tag"),
    "stored_missing_hashes": ("error", "BlockStored.block_hashes"),
    "short_sequence_frame": ("error", "8 bytes"),
    "two_frames": ("error", "3 frames"),
}


def normalizer() -> AttachmentNormalizer:
    return AttachmentNormalizer(
        kv_block_size=16, worker=WorkerWithDpRank(1, 0), ingress_protocol=IngressProtocol.VLLM_RESIDENCY_V1
    )


def kind(data: object) -> str:
    return "C" if data is CLEARED else "R" if isinstance(data, Removed) else "S"


def test_every_case_has_an_expectation() -> None:
    assert set(STRUCTS) == set(EXPECTED)


@pytest.mark.parametrize("case", sorted(STRUCTS))
def test_struct_case(case: str) -> None:
    _note, frames = STRUCTS[case]
    expected = EXPECTED[case]
    if expected[0] == "error":
        with pytest.raises(WireDecodeError, match=expected[1]):
            decode_frames(frames)
        return
    placements, source_fault, owner_fault = expected
    message = decode_frames(frames)
    result = normalizer().normalize(message.batch)
    assert [(e.domain, e.tier, kind(e.data)) for e in result.events] == placements
    assert result.source_fault == source_fault
    assert result.cache_owner_fault == owner_fault


def test_filtered_and_truncated_cases_are_counted() -> None:
    remote = normalizer().normalize(decode_frames(STRUCTS["remote_locality"][1]).batch)
    assert remote.filtered == {"non_local_locality": 1}
    sliding = normalizer().normalize(decode_frames(STRUCTS["sliding_window_group"][1]).batch)
    assert sliding.filtered == {"non_main_attention_kind": 1}
    mismatch = normalizer().normalize(decode_frames(STRUCTS["block_size_mismatch"][1]).batch)
    stored = mismatch.events[0].data
    assert isinstance(stored, Stored) and stored.block_hashes == ()
    assert mismatch.unpublished_blocks >= 1


def test_rank_1_batch_carries_its_rank() -> None:
    assert decode_frames(STRUCTS["rank_1_batch"][1]).batch.data_parallel_rank == 1


def test_chunking_bounds() -> None:
    many = normalizer().normalize(decode_frames(STRUCTS["many_events"][1]).batch)
    assert [len(c) for c in bounded_ingress_chunks(many.events)] == [128, 72]
    huge = normalizer().normalize(decode_frames(STRUCTS["huge_event"][1]).batch)
    with pytest.raises(ChunkingError, match="one ingress event exceeds the block bound"):
        bounded_ingress_chunks(huge.events)
    assert bounded_ingress_chunks([]) == [()]


def test_lora_changes_the_local_hash_seed() -> None:
    message = decode_frames(STRUCTS["lora_store"][1])
    raw = message.batch.events[0]
    assert isinstance(raw, RawBlockStored) and raw.lora_name
    stored = normalizer().normalize(message.batch).events[0].data
    assert isinstance(stored, Stored)
    seed = (1337 + xxhash.xxh3_64_intdigest(raw.lora_name.encode(), 0)) % (1 << 64)
    tokens = b"".join(t.to_bytes(4, "little") for t in raw.token_ids[:16])
    assert stored.tokens_hashes[0] == xxhash.xxh3_64_intdigest(tokens, seed)
    assert stored.tokens_hashes[0] != xxhash.xxh3_64_intdigest(tokens, 1337)


def test_hash_forms_fold_to_u64() -> None:
    raw = decode_frames(STRUCTS["bytes_hashes"][1]).batch.events[0]
    assert isinstance(raw, RawBlockStored)
    payload = msgpack.unpackb(STRUCTS["bytes_hashes"][1][2], raw=False)
    first = payload[1][0]["block_hashes"][0]
    assert isinstance(first, bytes) and raw.block_hashes[0] == int.from_bytes(first[-8:], "big")
    negative = decode_frames(STRUCTS["negative_hash"][1]).batch.events[0]
    assert isinstance(negative, RawBlockStored)
    assert all(0 <= h < 1 << 64 for h in negative.block_hashes)


def test_pinned_local_block_hash_vector() -> None:
    assert xxhash.xxh3_64_intdigest(b"test data", 1337) == 13226331709069118873


H = 15760518052499183552


def test_byte_level_examples_of_the_wire_reference() -> None:
    v09 = bytes.fromhex(
        "92cb41d954fc402000009196ab426c6f636b53746f72656491cfdab89baa7b5857c0c0940102030404c0"
    )
    batch = decode_payload(v09)
    assert batch.ts == 1700000000.5 and batch.data_parallel_rank is None
    assert batch.events == (RawBlockStored((H,), None, (1, 2, 3, 4), 4),)
    legacy = bytes.fromhex(
        "93cb41d954fc40200000939cab426c6f636b53746f72656491cfdab89baa7b5857c0c0940102030404c0a3475055"
        "c0c0c0c0c094ac426c6f636b52656d6f76656491cfdab89baa7b5857c0a3475055c091b0416c6c426c6f636b73436c"
        "656172656400"
    )
    batch = decode_payload(legacy)
    assert batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, RawBlockStored) and stored.medium == "GPU" and stored.block_hashes == (H,)
    assert removed == RawBlockRemoved((H,), "GPU", None)
    assert cleared == RawAllBlocksCleared()
    mapped = bytes.fromhex(
        "93cb41d954fc40200000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfdab89b"
        "aa7b5857c0b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73"
        "697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391"
        "c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84"
        "a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfdab89baa7b5857c0a66d65646975"
        "6da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
    )
    assert len(mapped) == 275
    stored, removed, cleared = decode_payload(mapped).events
    assert isinstance(stored, RawBlockStored)
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.extra_keys) == (0, "full_attention", (None,))
    assert removed == RawBlockRemoved((H,), "GPU", 0)
    assert isinstance(cleared, RawAllBlocksCleared)


def test_live_capture_decodes_completely() -> None:
    sub, replay = load_live()
    counts = {"stored": 0, "removed": 0, "cleared": 0}
    payload_by_seq: dict[int, bytes] = {}
    for frames in sub:
        message = decode_frames(frames)
        payload_by_seq[message.seq] = frames[2]
        for event in message.batch.events:
            if isinstance(event, RawBlockStored):
                counts["stored"] += 1
                assert event.block_size == 32 and len(event.token_ids) == 32 * len(event.block_hashes)
            elif isinstance(event, RawBlockRemoved):
                counts["removed"] += 1
            else:
                counts["cleared"] += 1
    assert counts == {"stored": 65, "removed": 17, "cleared": 1}
    assert sorted(payload_by_seq) == list(range(68))
    assert is_replay_end_marker(replay[-1]) and decode_replay_reply(replay[-1]) is None
    for frames in replay[:-1]:
        replayed = decode_replay_reply(frames)
        assert replayed is not None and frames[3] == payload_by_seq[replayed.seq]


def test_malformed_replay_replies_are_typed_errors() -> None:
    with pytest.raises(WireDecodeError):
        decode_replay_reply([b"", b"kv", (1).to_bytes(8, "big"), b""])
    with pytest.raises(WireDecodeError):
        decode_replay_reply([b"", b"", b"\xff" * 8, b"x"])
    with pytest.raises(WireDecodeError):
        decode_replay_reply([b"x"])
