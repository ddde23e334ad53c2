"""coalesce(): the per-chunk merge rules of docs/spec/agent-semantics.md 3.8 step 1."""

from __future__ import annotations

from kvagent.coordinator.coalesce import coalesce
from kvagent.model.events import (
    CLEARED,
    MmExtraInfo,
    MmObject,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    StorageTier,
    Stored,
)

W = ResidencyDomain.WORKER
C = ResidencyDomain.CACHE_OWNER
HP = StorageTier.HOST_PINNED


def stored(
    *hashes: int,
    parent: int | None = None,
    domain: ResidencyDomain = W,
    tier: StorageTier = HP,
    rank: int = 3,
    session: str | None = None,
) -> PlacementEvent:
    data = Stored(parent, hashes, tuple(h + 1000 for h in hashes))
    return PlacementEvent(data, tier, domain, rank, session)


def removed(
    *hashes: int, domain: ResidencyDomain = W, tier: StorageTier = HP, rank: int = 3
) -> PlacementEvent:
    return PlacementEvent(Removed(hashes), tier, domain, rank)


def cleared(domain: ResidencyDomain = W) -> PlacementEvent:
    return PlacementEvent(CLEARED, StorageTier.DEVICE, domain, 3)


def test_chain_continuation_merges_blocks_in_order() -> None:
    out = coalesce([stored(1, 2), stored(3, parent=2), stored(4, parent=3)])
    assert out == [
        PlacementEvent(Stored(None, (1, 2, 3, 4), (1001, 1002, 1003, 1004)), HP, W, 3),
    ]


def test_merged_chain_keeps_first_parent() -> None:
    (merged,) = coalesce([stored(2, parent=1), stored(3, parent=2)])
    assert isinstance(merged.data, Stored)
    assert merged.data.parent_hash == 1


def test_non_chain_store_flushes_the_pending_one() -> None:
    events = [stored(1), stored(5, parent=4), stored(6)]
    assert coalesce(events) == events


def test_removes_always_merge() -> None:
    assert coalesce([removed(1), removed(9), removed(4)]) == [removed(1, 9, 4)]


def test_mixed_kinds_never_merge() -> None:
    events = [stored(1), removed(1), stored(2, parent=1)]
    assert coalesce(events) == events


def test_cleared_is_a_barrier() -> None:
    events = [removed(1), cleared(), removed(2), stored(7), cleared(C), cleared(C)]
    assert coalesce(events) == events


def test_key_domain_tier_rank_and_session_prevent_merges() -> None:
    base = stored(1)
    for other in (
        stored(2, parent=1, domain=C),
        stored(2, parent=1, tier=StorageTier.DISK),
        stored(2, parent=1, rank=4),
        stored(2, parent=1, session="s"),
    ):
        assert coalesce([base, other]) == [base, other]
    assert coalesce([removed(1), removed(2, rank=4)]) == [removed(1), removed(2, rank=4)]
    assert coalesce([stored(1, session="a"), stored(2, parent=1, session="a")]) == [stored(1, 2, session="a")]


def test_flush_when_the_merged_event_reaches_128_blocks() -> None:
    first = removed(*range(100))
    second = removed(*range(100, 128))
    third = removed(500)
    out = coalesce([first, second, third])
    assert out == [removed(*range(128)), third]


def test_an_event_of_128_blocks_is_emitted_at_once() -> None:
    big = stored(*range(1, 129))
    follow = stored(500, parent=128)
    # The big chain is not pending, so its continuation does not merge with it.
    assert coalesce([big, follow]) == [big, follow]
    assert coalesce([stored(1), big]) == [stored(1), big]


def test_small_max_blocks() -> None:
    out = coalesce([removed(1), removed(2), removed(3), removed(4), removed(5)], max_blocks=2)
    assert out == [removed(1, 2), removed(3, 4), removed(5)]


def test_mm_infos_are_padded_when_only_one_side_has_them() -> None:
    info = MmExtraInfo((MmObject(77, ((0, 4),)),))
    with_mm = PlacementEvent(Stored(None, (1,), (11,), (info,)), HP, W, 3)
    (merged,) = coalesce([with_mm, stored(2, parent=1)])
    assert isinstance(merged.data, Stored)
    assert merged.data.mm_extra_infos == (info, None)
    (plain,) = coalesce([stored(1), stored(2, parent=1)])
    assert isinstance(plain.data, Stored) and plain.data.mm_extra_infos is None


def test_empty_input() -> None:
    assert coalesce([]) == []
