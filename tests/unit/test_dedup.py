"""DedupFilter: RefCounted for Worker, SetLike for CacheOwner (docs/spec/agent-semantics.md 3.7)."""

from __future__ import annotations

from kvagent.coordinator.dedup import DedupFilter
from kvagent.model.events import CLEARED, PlacementEvent, Removed, ResidencyDomain, StorageTier, Stored

W = ResidencyDomain.WORKER
C = ResidencyDomain.CACHE_OWNER
HP = StorageTier.HOST_PINNED


def stored(
    *hashes: int, domain: ResidencyDomain = W, tier: StorageTier = HP, rank: int = 3
) -> PlacementEvent:
    return PlacementEvent(Stored(None, hashes, tuple(h + 1000 for h in hashes)), tier, domain, rank)


def removed(
    *hashes: int, domain: ResidencyDomain = W, tier: StorageTier = HP, rank: int = 3
) -> PlacementEvent:
    return PlacementEvent(Removed(hashes), tier, domain, rank)


def tracked(dedup: DedupFilter, dp_rank: int, tier: StorageTier, domain: ResidencyDomain) -> dict[int, int]:
    """A copy of the filter's reference counts of one state."""
    return dedup.reference_counts().get((dp_rank, tier, domain), {})


def cleared(domain: ResidencyDomain = W, rank: int = 3) -> PlacementEvent:
    return PlacementEvent(CLEARED, StorageTier.DEVICE, domain, rank)


def test_stores_always_pass_unchanged() -> None:
    dedup = DedupFilter()
    event = stored(1, 2)
    assert dedup.filter(event) is event
    assert dedup.filter(event) is event
    assert tracked(dedup, 3, HP, W) == {1: 2, 2: 2}


def test_two_stores_then_one_remove_publishes_nothing_and_the_second_remove_publishes() -> None:
    dedup = DedupFilter()
    dedup.filter(stored(7))
    dedup.filter(stored(7))
    assert dedup.filter(removed(7)) is None
    second = removed(7)
    assert dedup.filter(second) is second
    assert tracked(dedup, 3, HP, W) == {}


def test_partial_remove_keeps_only_hashes_whose_last_copy_went() -> None:
    dedup = DedupFilter()
    dedup.filter(stored(1, 2))
    dedup.filter(stored(2))
    result = dedup.filter(removed(1, 2))
    assert result is not None
    assert result.data == Removed((1,))
    assert result.tier is HP and result.domain is W and result.dp_rank == 3
    assert tracked(dedup, 3, HP, W) == {2: 1}


def test_untracked_remove_passes_through() -> None:
    dedup = DedupFilter()
    event = removed(42)
    assert dedup.filter(event) is event
    dedup.filter(stored(1))
    mixed = dedup.filter(removed(1, 43))
    assert mixed is not None and mixed.data == Removed((1, 43))


def test_empty_remove_yields_nothing_in_both_policies() -> None:
    dedup = DedupFilter()
    assert dedup.filter(removed()) is None
    assert dedup.filter(removed(domain=C)) is None


def test_state_is_per_rank_tier_and_domain() -> None:
    dedup = DedupFilter()
    dedup.filter(stored(5))
    dedup.filter(stored(5))
    # Same hash, other tier / rank: untracked there, so the remove passes.
    assert dedup.filter(removed(5, tier=StorageTier.DISK)) is not None
    assert dedup.filter(removed(5, rank=4)) is not None
    assert dedup.filter(removed(5)) is None


def test_clear_resets_only_that_rank_and_domain_on_every_tier() -> None:
    dedup = DedupFilter()
    for tier in (HP, StorageTier.DISK):
        dedup.filter(stored(9, tier=tier))
        dedup.filter(stored(9, tier=tier))
    dedup.filter(stored(9, rank=4))
    dedup.filter(stored(9, rank=4))
    clear = cleared()
    assert dedup.filter(clear) is clear
    # Rank 3 Worker state is gone on both tiers: the removes are untracked and pass.
    assert dedup.filter(removed(9)) is not None
    assert dedup.filter(removed(9, tier=StorageTier.DISK)) is not None
    # Rank 4 still counts two copies.
    assert dedup.filter(removed(9, rank=4)) is None


def test_cache_owner_clear_does_not_touch_worker_counts() -> None:
    dedup = DedupFilter()
    dedup.filter(stored(3))
    dedup.filter(stored(3))
    assert dedup.filter(cleared(C)) is not None
    assert dedup.filter(removed(3)) is None


def test_set_like_cache_owner_passes_removes_without_bookkeeping() -> None:
    dedup = DedupFilter()
    dedup.filter(stored(8, domain=C))
    dedup.filter(stored(8, domain=C))
    first = removed(8, domain=C)
    assert dedup.filter(first) is first
    assert dedup.filter(removed(8, domain=C)) is not None
    assert tracked(dedup, 3, HP, C) == {}


def test_reset_domain() -> None:
    dedup = DedupFilter()
    dedup.filter(stored(1))
    dedup.filter(stored(1))
    dedup.filter(stored(1, rank=4))
    dedup.filter(stored(1, rank=4))
    dedup.reset_domain(4, W)
    assert tracked(dedup, 4, HP, W) == {}
    assert tracked(dedup, 3, HP, W) == {1: 2}
