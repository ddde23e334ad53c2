"""Normalization (docs/spec/agent-semantics.md 2.3-2.7): the seed's tests 9.1/9.2, preprocessing reasons, conversion, chunking."""

from __future__ import annotations

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.model.events import (
    CLEARED,
    IngressProtocol,
    MmExtraInfo,
    MmObject,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    StorageTier,
    Stored,
    WorkerWithDpRank,
    block_count,
)
from kvagent.model.hashing import block_hash_seed, local_block_hash, mm_block_hash
from kvagent.vllm.decode import (
    RawAllBlocksCleared,
    RawBatch,
    RawBlockRemoved,
    RawBlockStored,
    RawEagleBlockStored,
    RawEvent,
    RawIgnored,
    decode_payload,
)
from kvagent.vllm.normalize import (
    AttachmentNormalizer,
    NormalizedBatch,
    bounded_ingress_chunks,
    build_ingress_chunks,
    split_oversized_event,
)

W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
DEV, HOST, DISK, EXT = StorageTier.DEVICE, StorageTier.HOST_PINNED, StorageTier.DISK, StorageTier.EXTERNAL
TOKENS = (10, 11, 12, 13)


def raw_store(medium: str | None, ownership: str | None, block: int) -> RawBlockStored:
    return RawBlockStored((block,), None, TOKENS, 4, medium=medium, ownership=ownership)


def attach(**kwargs: object) -> AttachmentNormalizer:
    return AttachmentNormalizer(kv_block_size=4, worker=WorkerWithDpRank(17, 3), **kwargs)  # type: ignore[arg-type]


def run(normalizer: AttachmentNormalizer, *events: RawEvent) -> NormalizedBatch:
    return normalizer.normalize(RawBatch(1.0, events, 3))


# --- docs/spec/agent-semantics.md 9.1 and 9.2 -----------------------------------------------------------------


def test_raw_ownership_maps_domains_and_quarantines_unsupported_kvcr() -> None:
    normalizer = attach(ingress_protocol=IngressProtocol.VLLM_RESIDENCY_V1)
    first = run(
        normalizer,
        raw_store(None, None, 101),
        raw_store("CPU", None, 102),
        raw_store("CPU_PINNED", "kvcr", 103),
        raw_store("STORAGE", "kvcr", 104),
        RawAllBlocksCleared(ownership="kvcr"),
    )
    assert (first.source_fault, first.cache_owner_fault) == (None, None)
    assert [(e.domain, e.tier) for e in first.events] == [(W, DEV), (W, HOST), (C, HOST), (C, DISK), (C, DEV)]
    assert all(e.dp_rank == 3 for e in first.events)

    second = run(normalizer, raw_store("GPU", "kvcr", 105), raw_store(None, None, 106))
    assert second.cache_owner_fault == "KVCR ownership has an unsupported storage medium"
    assert second.source_fault is None
    assert [e.domain for e in second.events] == [W]

    third = run(normalizer, raw_store("CPU", "future_owner", 108))
    assert third.source_fault == "unknown raw event ownership"
    assert third.events == []


def named(event_type: str, **fields: object) -> dict[str, object]:
    return {"type": event_type, **fields}


def stored_map(
    hashes: list[int], parent: int | None, first: int, medium: str, **extra: object
) -> dict[str, object]:
    tokens = list(range(first, first + 4 * len(hashes)))
    fields = {"parent_block_hash": parent, "token_ids": tokens, "block_size": 4, "lora_id": None}
    return named("BlockStored", block_hashes=hashes, **fields, medium=medium, lora_name=None, **extra)


def test_production_named_map_ownership_reaches_exact_local_recovery_owners() -> None:
    kvcr = {"locality": "LOCAL", "ownership": "kvcr"}
    events = [
        stored_map([101], None, 10, "CPU_PINNED", **kvcr),
        stored_map([102, 202], 101, 14, "STORAGE", **kvcr),
        named("BlockRemoved", block_hashes=[102], medium="STORAGE", **kvcr),
        stored_map([105], None, 22, "CPU_PINNED", **kvcr),
        named("BlockRemoved", block_hashes=[101], medium="CPU_PINNED", **kvcr),
        stored_map([106], None, 26, "CPU", locality="LOCAL"),
        stored_map([104], None, 30, "GPU"),
    ]
    normalizer = attach()
    result = normalizer.normalize(decode_payload(msgpack.packb([1.0, events, 3])))
    assert (result.source_fault, result.cache_owner_fault) == (None, None)
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
                    stored_map([108], None, 34, "GPU"),
                    named("AllBlocksCleared"),
                    named("AllBlocksCleared", ownership="kvcr"),
                ],
                3,
            ]
        )
    )
    result = normalizer.normalize(second)
    assert (result.source_fault, result.cache_owner_fault) == (None, None)
    assert [e.domain for e in result.events] == [W, W, C]
    assert result.events[1].data is CLEARED and result.events[2].data is CLEARED


# --- 2.3: order of checks, first fault of each kind ------------------------------------------------


def test_first_fault_of_each_kind_is_kept_and_good_events_survive() -> None:
    result = run(
        attach(),
        raw_store("GPU", "kvcr", 1),
        RawBlockStored((2,), None, TOKENS * 2, 8, medium="CPU", ownership="kvcr"),
        raw_store(None, "other", 3),
        raw_store(None, None, 4),
        raw_store(None, "another", 5),
        RawBlockStored((6,), None, TOKENS, 4, medium="CPU", ownership="kvcr", locality="REMOTE"),
    )
    assert result.source_fault == "unknown raw event ownership"
    assert result.cache_owner_fault == "KVCR ownership has an unsupported storage medium"
    assert [e.data.block_hashes for e in result.events if isinstance(e.data, Stored)] == [(4,)]


def test_kvcr_fault_strings() -> None:
    size = run(attach(), RawBlockStored((2,), None, TOKENS * 2, 8, medium="DISK", ownership="kvcr"))
    assert size.cache_owner_fault == "KVCR block size is incompatible"
    enrichment = run(
        attach(), RawBlockStored((2,), None, TOKENS, 4, medium="CPU", ownership="kvcr", locality="REMOTE")
    )
    assert enrichment.cache_owner_fault == "KVCR event enrichment failed"
    assert enrichment.filtered == {"non_local_locality": 1}
    no_medium = run(attach(), RawBlockRemoved((1,), ownership="kvcr"))
    assert no_medium.cache_owner_fault == "KVCR ownership has an unsupported storage medium"
    framework_only = run(attach(ingress_protocol=IngressProtocol.FRAMEWORK_V1), raw_store("CPU", "kvcr", 1))
    assert framework_only.source_fault == "KVCR event on framework-only raw protocol"
    assert framework_only.cache_owner_fault is None


# --- 2.4: residency preprocessing reasons ----------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (RawIgnored("TierBlocksCleared"), "ignored_event"),
        (RawAllBlocksCleared(medium="CPU"), "ambiguous_scoped_clear"),
        (RawBlockStored((1,), None, TOKENS, 4, locality="REMOTE"), "non_local_locality"),
        (RawBlockStored((1,), None, TOKENS, 4, medium="DISK", locality="SOMEWHERE"), "non_local_locality"),
        (RawBlockStored((1,), None, TOKENS, 4, medium="FS"), "unknown_medium"),
        (RawBlockRemoved((1,), medium="gpu"), "unknown_medium"),
        (RawBlockStored((1,), None, TOKENS, 4, kv_cache_spec_kind="mamba"), "non_main_attention_kind"),
        (RawBlockStored((1,), None, TOKENS, 4, kv_cache_spec_kind="linear"), "unknown_kind"),
        (RawBlockStored((1,), None, TOKENS, 4, group_idx=2), "unlearned_group_idx"),
        (RawBlockRemoved((1,), group_idx=1), "unlearned_group_idx"),
    ],
)
def test_framework_filter_reasons_are_counted(event: RawEvent, reason: str) -> None:
    result = run(attach(), event)
    assert (result.events, result.filtered) == ([], {reason: 1})
    assert (result.source_fault, result.cache_owner_fault) == (None, None)


def test_lower_tiers_bypass_group_filtering() -> None:
    result = run(
        attach(),
        RawBlockStored((1,), None, TOKENS, 4, medium="NVME", kv_cache_spec_kind="mamba", group_idx=5),
    )
    assert [(e.tier, e.domain) for e in result.events] == [(DISK, W)]
    external = run(attach(), RawBlockRemoved((1,), medium="REMOTE", group_idx=9))
    assert [(e.tier, e.data) for e in external.events] == [(EXT, Removed((1,)))]


def test_learned_groups_filter_later_events_across_batches() -> None:
    normalizer = attach()
    taught = run(
        normalizer,
        RawBlockStored((1,), None, TOKENS, 4, group_idx=0, kv_cache_spec_kind="full_attention"),
        RawBlockStored((2,), None, TOKENS, 4, group_idx=1, kv_cache_spec_kind="sliding_window"),
    )
    assert len(taught.events) == 1 and taught.filtered == {"non_main_attention_kind": 1}
    later = run(normalizer, RawBlockRemoved((2,), group_idx=1), RawBlockRemoved((1,), group_idx=0))
    assert [e.data for e in later.events] == [Removed((1,))]
    assert later.filtered == {"non_main_attention_group": 1}
    # The KVCR normalizer learned nothing from framework events.
    assert run(normalizer, RawBlockRemoved((2,), medium="CPU", group_idx=1, ownership="kvcr")).filtered == {
        "unlearned_group_idx": 1
    }


# --- 2.4.8: cache namespaces, 2.6: LocalBlockHash --------------------------------------------------

SALT = "dynamo-cache-salt:tenant-a"


def tokens_hash(result: NormalizedBatch, index: int = 0) -> int:
    data = result.events[index].data
    assert isinstance(data, Stored)
    return data.tokens_hashes[0]


def test_namespace_is_read_from_extra_keys_after_skipping_the_lora_name() -> None:
    normalizer = attach()
    lora_salt = RawBlockStored(
        (1,), None, TOKENS, 4, lora_name=SALT, extra_keys=([SALT, "dynamo-cache-salt:"],)
    )
    assert tokens_hash(run(normalizer, lora_salt)) == local_block_hash(TOKENS, block_hash_seed(SALT, None))
    salted = RawBlockStored((2,), None, TOKENS, 4, lora_name="ad", extra_keys=(["ad", SALT],))
    seed = (1337 + xxhash.xxh3_64_intdigest(b"ad", 0) + xxhash.xxh3_64_intdigest(b"tenant-a", 1)) % 2**64
    assert tokens_hash(run(normalizer, salted)) == local_block_hash(TOKENS, seed)
    sglang = RawBlockStored((3,), None, TOKENS, 4, cache_salt="tenant-b")
    assert tokens_hash(run(normalizer, sglang)) == local_block_hash(TOKENS, block_hash_seed(None, "tenant-b"))


def test_namespace_propagates_to_children_and_ambiguity_filters() -> None:
    normalizer = attach()
    seed = block_hash_seed(None, "tenant-a")
    run(normalizer, RawBlockStored((1,), None, TOKENS, 4, extra_keys=([SALT],)))
    child = run(normalizer, RawBlockStored((2,), 1, TOKENS, 4))
    assert tokens_hash(child) == local_block_hash(TOKENS, seed)
    grandchild = run(
        normalizer, RawBlockStored((3,), 2, TOKENS, 4, extra_keys=(["dynamo-cache-salt:other"],))
    )
    assert tokens_hash(grandchild) == local_block_hash(TOKENS, seed)  # the parent's namespace wins
    # The same hash stored unsalted becomes ambiguous: its children are filtered.
    run(normalizer, RawBlockStored((2,), None, TOKENS, 4))
    ambiguous = run(normalizer, RawBlockStored((4,), 2, TOKENS, 4))
    assert (ambiguous.events, ambiguous.filtered) == ([], {"ambiguous_cache_namespace": 1})
    # Removing a namespaced block forgets it: a later child is treated as unsalted (fail open).
    run(normalizer, RawBlockRemoved((1,)))
    orphan = run(normalizer, RawBlockStored((5,), 1, TOKENS, 4))
    assert tokens_hash(orphan) == local_block_hash(TOKENS)
    # A clear without a medium drops every entry, ambiguous ones included.
    run(normalizer, RawAllBlocksCleared())
    assert tokens_hash(run(normalizer, RawBlockStored((6,), 2, TOKENS, 4))) == local_block_hash(TOKENS)


def test_local_block_hash_pins() -> None:
    assert xxhash.xxh3_64_intdigest(b"test data", 1337) == 13226331709069118873
    assert local_block_hash([1, 2]) == xxhash.xxh3_64_intdigest(b"\x01\x00\x00\x00\x02\x00\x00\x00", 1337)
    assert block_hash_seed(None, None) == block_hash_seed("", "") == 1337
    assert block_hash_seed("a", None) == (1337 + xxhash.xxh3_64_intdigest(b"a", 0)) % 2**64
    assert mm_block_hash([1], [3, 2], 5) == xxhash.xxh3_64_intdigest(
        (1).to_bytes(4, "little") + (2).to_bytes(8, "little") + (3).to_bytes(8, "little"), 5
    )


# --- 2.5: conversion -----------------------------------------------------------------------------


def test_multi_block_store_hashes_each_block() -> None:
    tokens = tuple(range(100, 110))
    result = run(attach(), RawBlockStored((1, 2, 3), 9, tokens, 4))
    data = result.events[0].data
    assert data == Stored(9, (1, 2), (local_block_hash(tokens[0:4]), local_block_hash(tokens[4:8])))
    assert result.unpublished_blocks == 1  # the third block's tokens ran out


def test_duplicate_hashes_become_an_empty_remove() -> None:
    for event in (RawBlockStored((1, 1), None, TOKENS * 2, 4), RawBlockStored((1, 2), 2, TOKENS * 2, 4)):
        assert [e.data for e in run(attach(), event).events] == [Removed(())]


def test_eagle_blocks_cover_one_extra_token_with_the_same_stride() -> None:
    tokens = tuple(range(9))
    result = run(attach(), RawEagleBlockStored((1, 2), None, tokens, 4))
    data = result.events[0].data
    assert isinstance(data, Stored)
    assert data.tokens_hashes == (local_block_hash(tokens[0:5]), local_block_hash(tokens[4:9]))


def test_framework_block_size_mismatch_truncates() -> None:
    result = run(attach(), RawBlockStored((1, 2), None, TOKENS * 4, 8))
    assert [e.data for e in result.events] == [Stored(None, (), ())]
    assert (result.unpublished_blocks, result.cache_owner_fault) == (2, None)


def test_session_id_rides_along() -> None:
    result = run(attach(), RawBlockStored((1,), None, TOKENS, 4, session_id="req-7"))
    assert result.events[0] == PlacementEvent(
        Stored(None, (1,), (local_block_hash(TOKENS),)), DEV, W, 3, "req-7"
    )


MM_A = "00000000000000aa" + "0" * 48
MM_B = "00000000000000bb" + "0" * 48


def test_multimodal_blocks_follow_dynamos_identifier_rule() -> None:
    extra = ([(MM_B, 0), MM_A, "0x000000000000bb" + "0" * 48, "f" * 64], None)
    result = run(attach(), RawBlockStored((1, 2), None, TOKENS * 2, 4, extra_keys=extra))
    data = result.events[0].data
    assert isinstance(data, Stored)
    assert data.tokens_hashes == (mm_block_hash(TOKENS, [0xBB, 0xAA], 1337), local_block_hash(TOKENS))
    assert data.mm_extra_infos == (MmExtraInfo((MmObject(0xBB, ()), MmObject(0xAA, ()))), None)


def test_image_pad_normalization() -> None:
    image = 7
    block = (1, image, image, 2)
    result = run(
        attach(image_token_id=image), RawBlockStored((1,), None, block, 4, extra_keys=([MM_A, MM_B],))
    )
    assert tokens_hash(result) == local_block_hash([1, 1_000_000 + 0xAA, 1_000_000 + 0xAA, 2])
    runs = (image, 1, image, image)  # two runs: the second moves to the next MM object
    result = run(
        attach(image_token_id=image), RawBlockStored((1,), None, runs, 4, extra_keys=([MM_A, MM_B],))
    )
    assert tokens_hash(result) == local_block_hash([1_000_000 + 0xAA, 1, 1_000_000 + 0xBB, 1_000_000 + 0xBB])


# --- 2.7: chunking -------------------------------------------------------------------------------


def placement(blocks: int) -> PlacementEvent:
    return PlacementEvent(Removed(tuple(range(blocks))), DEV, W, 0)


def chunk_blocks(chunk: tuple[PlacementEvent, ...]) -> int:
    return sum(block_count(e.data) for e in chunk)


def test_chunk_bounds() -> None:
    assert bounded_ingress_chunks([]) == [()]
    assert [len(c) for c in bounded_ingress_chunks([placement(1)] * 257)] == [128, 128, 1]
    sizes = [chunk_blocks(c) for c in bounded_ingress_chunks([placement(5000)] * 3)]
    assert sizes == [5000, 5000, 5000]
    assert [len(c) for c in bounded_ingress_chunks([placement(8192), placement(0), placement(1)])] == [2, 1]
    # One event with more blocks than a chunk holds is split across chunks, not refused.
    split = bounded_ingress_chunks([placement(1), placement(8193)])
    assert [[block_count(e.data) for e in c] for c in split] == [[1], [8192], [1]]
    assert [h for c in split[1:] for e in c for h in e.data.block_hashes] == list(range(8193))


def test_an_oversized_store_splits_into_a_chain_and_keeps_its_fields() -> None:
    mm = MmExtraInfo((MmObject(0xAB, ((0, 4),)),))
    hashes = tuple(range(1000, 1000 + 2 * 8192 + 5))
    infos = tuple(mm if h % 3 == 0 else None for h in hashes)
    locals_ = tuple(h + 7 for h in hashes)
    event = PlacementEvent(Stored(42, hashes, locals_, infos, 16), HOST, C, 3, session_id="s")
    parts = split_oversized_event(event)
    assert [len(p.data.block_hashes) for p in parts] == [8192, 8192, 5]
    stored = [p.data for p in parts]
    assert all(isinstance(d, Stored) for d in stored)
    assert [d.parent_hash for d in stored] == [42, hashes[8191], hashes[2 * 8192 - 1]]  # type: ignore[union-attr]
    assert [d.start_position for d in stored] == [16, None, None]  # type: ignore[union-attr]
    assert tuple(h for d in stored for h in d.block_hashes) == hashes
    assert tuple(h for d in stored for h in d.tokens_hashes) == locals_  # type: ignore[union-attr]
    assert tuple(i for d in stored for i in d.mm_extra_infos) == infos  # type: ignore[union-attr]
    assert {(p.tier, p.domain, p.dp_rank, p.session_id) for p in parts} == {(HOST, C, 3, "s")}
    small = PlacementEvent(Stored(None, (1,), (2,)), DEV, W, 0)
    assert split_oversized_event(small) == (small,)
    assert split_oversized_event(PlacementEvent(CLEARED, DEV, W, 0)) == (PlacementEvent(CLEARED, DEV, W, 0),)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20000), max_size=300))
def test_chunking_invariants(sizes: list[int]) -> None:
    events = [placement(n) for n in sizes]
    chunks = bounded_ingress_chunks(events)
    flat = [e for c in chunks for e in c]
    assert flat == [part for e in events for part in split_oversized_event(e)]
    # Each event's parts, taken together, are exactly its blocks.
    position = 0
    for event in events:
        parts = max(1, -(-block_count(event.data) // 8192))
        joined = tuple(h for part in flat[position : position + parts] for h in part.data.block_hashes)
        assert joined == event.data.block_hashes
        position += parts
    assert all(len(c) <= 128 and chunk_blocks(c) <= 8192 for c in chunks)
    assert all(c for c in chunks) or chunks == [()]


def test_build_ingress_chunks_puts_faults_on_chunk_0_and_marks_the_last_final() -> None:
    normalized = NormalizedBatch([placement(1)] * 200, "source", "owner")
    chunks = build_ingress_chunks(4, 77, normalized)
    assert [(c.generation, c.source_cursor, c.chunk_index, c.final) for c in chunks] == [
        (4, 77, 0, False),
        (4, 77, 1, True),
    ]
    assert [(c.source_fault, c.cache_owner_fault) for c in chunks] == [("source", "owner"), (None, None)]
    (empty,) = build_ingress_chunks(1, 0, NormalizedBatch([]))
    assert (empty.events, empty.final, empty.chunk_index) == ((), True, 0)


