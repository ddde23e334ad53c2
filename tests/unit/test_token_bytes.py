"""Stored.token_bytes: the tokens of exactly the published blocks travel from normalization to the outbound event.

Set by both normalization paths, sliced when an oversized event is split, concatenated when stores coalesce,
and never part of equality (every existing comparison of Stored values keeps its meaning).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.coordinator.coalesce import coalesce
from kvagent.model.events import (
    CLEARED,
    Cleared,
    MmExtraInfo,
    MmObject,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.publish.republish_state import RepublishState
from kvagent.vllm.decode import RawBatch, RawBlockStored, RawEagleBlockStored, decode_payload
from kvagent.vllm.normalize import AttachmentNormalizer, build_ingress_chunks, split_oversized_event
from tests.support.coordinator import FIRST, Slot, attachment_for
from tests.support.fuzz_decoder import normalize_each

BLOCK_SIZE = 4
W = ResidencyDomain.WORKER
DEV = StorageTier.DEVICE


def packed(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def normalizer() -> AttachmentNormalizer:
    return AttachmentNormalizer(kv_block_size=BLOCK_SIZE, worker=WorkerWithDpRank(7, 0), image_token_id=32000)


def only_stored(event: RawBlockStored) -> tuple[Stored, Stored]:
    """The Stored of ``event`` through the fast path and through the general path."""
    batch = RawBatch(1.0, (event,), 0)
    fast = normalizer().normalize(batch).events
    general = normalize_each(normalizer(), batch).events
    assert len(fast) == len(general) == 1
    assert isinstance(fast[0].data, Stored) and isinstance(general[0].data, Stored)
    return fast[0].data, general[0].data


def test_plain_store_carries_its_tokens_on_both_paths() -> None:
    tokens = tuple(range(100, 108))
    fast, general = only_stored(RawBlockStored((1, 2), None, tokens, BLOCK_SIZE, medium="GPU"))
    assert fast.token_bytes == general.token_bytes == packed(tokens)


def test_tokens_beyond_the_last_whole_block_are_not_carried() -> None:
    tokens = tuple(range(10))  # two whole blocks and two spare tokens
    fast, general = only_stored(RawBlockStored((1, 2), None, tokens, BLOCK_SIZE))
    assert fast.token_bytes == general.token_bytes == packed(tokens[:8])


def test_a_store_short_of_tokens_carries_the_tokens_of_its_published_blocks() -> None:
    tokens = tuple(range(6))  # block 2 is incomplete: only block 1 is published
    _, general = only_stored(RawBlockStored((1, 2), None, tokens, BLOCK_SIZE))
    assert general.block_hashes == (1,)
    assert general.token_bytes == packed(tokens[:4])


def test_eagle_overlap_token_is_not_republished() -> None:
    tokens = tuple(range(9))  # EAGLE: two blocks of 4 plus the overlap token
    _, general = only_stored(RawEagleBlockStored((1, 2), None, tokens, BLOCK_SIZE))
    assert general.block_hashes == (1, 2)
    assert general.token_bytes == packed(tokens[:8])


def test_lora_and_multimodal_stores_carry_raw_tokens() -> None:
    tokens = (32000, 32000, 5, 6, 7, 8, 9, 10)
    mm = "00000000000000ab" + "0" * 48
    lora, _ = only_stored(RawBlockStored((1, 2), None, tokens, BLOCK_SIZE, lora_name="adapter"))
    multimodal, _ = only_stored(RawBlockStored((3, 4), None, tokens, BLOCK_SIZE, extra_keys=([mm], None)))
    assert multimodal.mm_extra_infos is not None
    assert lora.token_bytes == multimodal.token_bytes == packed(tokens)


def test_token_bytes_are_not_part_of_equality_or_hash() -> None:
    with_tokens = Stored(None, (1,), (2,), token_bytes=b"\x00" * 16)
    without = Stored(None, (1,), (2,))
    assert with_tokens == without and hash(with_tokens) == hash(without)
    assert "token_bytes" not in repr(with_tokens)


def chain_data(hashes: Sequence[int], parent: int | None, tokens: bool = True) -> Stored:
    token_bytes = b"".join(packed([h] * BLOCK_SIZE) for h in hashes) if tokens else None
    return Stored(parent, tuple(hashes), tuple(h + 1000 for h in hashes), token_bytes=token_bytes)


def chain(hashes: Sequence[int], parent: int | None, tokens: bool = True) -> PlacementEvent:
    return PlacementEvent(chain_data(hashes, parent, tokens), DEV, W, 0)


def test_split_slices_tokens_with_the_blocks() -> None:
    event = chain(range(1, 11), None)
    parts = split_oversized_event(event, max_blocks=4)
    assert [len(part.data.block_hashes) for part in parts] == [4, 4, 2]
    for part in parts:
        assert isinstance(part.data, Stored)
        assert part.data.token_bytes == chain_data(part.data.block_hashes, None).token_bytes


def test_split_keeps_missing_tokens_missing() -> None:
    parts = split_oversized_event(chain(range(1, 6), None, tokens=False), max_blocks=2)
    assert all(isinstance(part.data, Stored) and part.data.token_bytes is None for part in parts)


def test_coalesce_concatenates_tokens_and_drops_them_when_a_side_lacks_them() -> None:
    (merged,) = coalesce([chain([1, 2], None), chain([3], 2)])
    assert isinstance(merged.data, Stored)
    assert merged.data.token_bytes == chain_data([1, 2, 3], None).token_bytes
    (partial,) = coalesce([chain([1, 2], None), chain([3], 2, tokens=False)])
    assert isinstance(partial.data, Stored) and partial.data.token_bytes is None


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=12),
    max_blocks=st.integers(1, 8),
    tokens=st.booleans(),
)
def test_split_then_coalesce_gives_back_the_tokens(sizes: list[int], max_blocks: int, tokens: bool) -> None:
    """Any chain split into parts and coalesced back carries exactly the tokens of its blocks, in order."""
    events: list[PlacementEvent] = []
    parent, next_hash = None, 1
    for size in sizes:
        hashes = list(range(next_hash, next_hash + size))
        events.extend(split_oversized_event(chain(hashes, parent, tokens), max_blocks=max_blocks))
        parent, next_hash = hashes[-1], next_hash + size
    merged = coalesce(events, max_blocks=1 << 30)
    assert len(merged) == 1 and isinstance(merged[0].data, Stored)
    expected = chain_data(range(1, next_hash), None, tokens)
    assert merged[0].data.block_hashes == expected.block_hashes
    assert merged[0].data.token_bytes == expected.token_bytes


# --- coalesce: the run-joining implementation against the pairwise merge it replaced ---------------------------


def pairwise_coalesce(events: Sequence[PlacementEvent], max_blocks: int) -> list[PlacementEvent]:
    """The previous coalesce, merging pending and next event at every step (the rules' direct reading)."""
    output: list[PlacementEvent] = []
    pending: PlacementEvent | None = None
    for event in events:
        if isinstance(event.data, Cleared):
            output.extend([pending, event] if pending is not None else [event])
            pending = None
            continue
        if pending is not None:
            merged = pairwise_merge(pending, event)
            if merged is not None:
                pending = merged
                if len(merged.data.block_hashes) >= max_blocks:
                    output.append(merged)
                    pending = None
                continue
            output.append(pending)
            pending = None
        if len(event.data.block_hashes) >= max_blocks:
            output.append(event)
        else:
            pending = event
    if pending is not None:
        output.append(pending)
    return output


def pairwise_merge(pending: PlacementEvent, event: PlacementEvent) -> PlacementEvent | None:
    old, new = pending.data, event.data
    if type(old) is not type(new) or (pending.domain, pending.tier, pending.dp_rank, pending.session_id) != (
        event.domain,
        event.tier,
        event.dp_rank,
        event.session_id,
    ):
        return None
    if isinstance(old, Removed):
        return attrs.evolve(pending, data=Removed(old.block_hashes + new.block_hashes))
    assert isinstance(old, Stored) and isinstance(new, Stored)
    if not old.block_hashes or new.parent_hash != old.block_hashes[-1]:
        return None
    mm = None
    if old.mm_extra_infos is not None or new.mm_extra_infos is not None:
        mm = (old.mm_extra_infos or (None,) * len(old.block_hashes)) + (
            new.mm_extra_infos or (None,) * len(new.block_hashes)
        )
    tokens = None if old.token_bytes is None or new.token_bytes is None else old.token_bytes + new.token_bytes
    data = Stored(
        old.parent_hash,
        old.block_hashes + new.block_hashes,
        old.tokens_hashes + new.tokens_hashes,
        mm,
        old.start_position,
        tokens,
    )
    return attrs.evolve(pending, data=data)


@st.composite
def placement_events(draw: st.DrawFn) -> PlacementEvent:
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
    domain = draw(st.sampled_from([W, ResidencyDomain.CACHE_OWNER]))
    tier = draw(st.sampled_from([DEV, StorageTier.HOST_PINNED]))
    session = draw(st.sampled_from([None, "s"]))
    if kind == "clear":
        return PlacementEvent(CLEARED, tier, domain, 0)
    hashes = tuple(draw(st.lists(st.integers(1, 6), max_size=3)))
    if kind == "remove":
        return PlacementEvent(Removed(hashes), tier, domain, 0)
    mm = None
    if draw(st.booleans()) and hashes:
        mm = tuple(draw(st.sampled_from([None, MmExtraInfo((MmObject(9, ()),))])) for _ in hashes)
    tokens = b"".join(packed([h] * BLOCK_SIZE) for h in hashes) if draw(st.booleans()) else None
    parent = draw(st.one_of(st.none(), st.integers(1, 6)))
    data = Stored(parent, hashes, hashes, mm, draw(st.sampled_from([None, 3])), tokens)
    return PlacementEvent(data, tier, domain, 0, session)


@settings(max_examples=500, deadline=None)
@given(events=st.lists(placement_events(), max_size=20), max_blocks=st.integers(1, 8))
def test_coalesce_equals_the_pairwise_merge(events: list[PlacementEvent], max_blocks: int) -> None:
    ours = coalesce(events, max_blocks=max_blocks)
    expected = pairwise_coalesce(events, max_blocks)
    assert ours == expected
    assert [e.data.token_bytes if isinstance(e.data, Stored) else None for e in ours] == [
        e.data.token_bytes if isinstance(e.data, Stored) else None for e in expected
    ]


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.integers(1, 5),
    spare=st.integers(0, 2 * BLOCK_SIZE),
    lora=st.booleans(),
)
def test_fast_and_general_paths_carry_the_same_tokens(blocks: int, spare: int, lora: bool) -> None:
    tokens = tuple(range(7, 7 + blocks * BLOCK_SIZE + spare))
    event = RawBlockStored(
        tuple(range(1, blocks + 1)), None, tokens, BLOCK_SIZE, lora_name="a" if lora else None
    )
    fast, general = only_stored(event)
    published = min(blocks, len(tokens) // BLOCK_SIZE)
    assert fast.token_bytes == general.token_bytes == packed(tokens[: published * BLOCK_SIZE])


def test_tokens_reach_the_sink_and_the_republished_payload() -> None:
    """Raw vLLM stores through normalization, chunking, the coordinator (coalesce, dedup) to its sink."""
    slot = Slot()
    attached = slot.core.attach(attachment_for(FIRST))
    raw = RawBatch(
        1.0,
        (
            RawBlockStored((1, 2), None, tuple(range(8)), BLOCK_SIZE),
            RawBlockStored((3,), 2, tuple(range(8, 12)), BLOCK_SIZE),  # coalesces with the first
            RawBlockStored((1, 2), None, tuple(range(8)), BLOCK_SIZE),  # a second physical copy
        ),
        FIRST.dp_rank,
    )
    normalized = AttachmentNormalizer(kv_block_size=BLOCK_SIZE, worker=FIRST).normalize(raw)
    for piece in build_ingress_chunks(attached.generation, 1, normalized):
        slot.core.handle_ingress(piece)
    stores = [e.data for e in slot.sink.events if isinstance(e.data, Stored)]
    assert [data.block_hashes for data in stores] == [(1, 2, 3), (1, 2)]
    assert [data.token_bytes for data in stores] == [packed(range(12)), packed(range(8))]
    state = RepublishState(dp_rank=FIRST.dp_rank, block_size=BLOCK_SIZE)
    published = state.publish(slot.sink.events)
    assert published is not None
    decoded = decode_payload(published[1])
    assert [e.token_ids for e in decoded.events if isinstance(e, RawBlockStored)] == [
        tuple(range(12)),
        tuple(range(8)),
    ]
    assert state.statistics().stores_without_tokens == 0
