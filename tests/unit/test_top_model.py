"""``kvagent top``'s block counts per tier, pinned to the agent's own index (Hypothesis).

top keeps residency from a slot's follow stream (a tree dump, then live events) in a few sets; the
RecoveryIndex is the definition. Any event stream applied to both must give the same blocks per tier,
and a tree dump of the index fed to a fresh model must give them too (what top does when it connects).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.cli.top import SlotResidency, SlotRow, TopState, render_table, sparkline
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.events import (
    CLEARED,
    EventData,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from tests.support.ids import OWNER

TIERS = (StorageTier.DEVICE, StorageTier.HOST_PINNED, StorageTier.DISK)
hashes = st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True).map(tuple)
data: st.SearchStrategy[EventData] = st.one_of(
    st.builds(
        lambda h, p: Stored(parent_hash=p, block_hashes=h, tokens_hashes=h),
        hashes,
        st.none() | st.integers(1, 12),
    ),
    st.builds(Removed, hashes),
    st.just(CLEARED),
)
# (data, tier, worker id, dp rank, CacheOwner domain?)
shapes = st.tuples(data, st.sampled_from(TIERS), st.integers(1, 2), st.integers(0, 1), st.booleans())


def router_event(event_id: int, shape: tuple[EventData, StorageTier, int, int, bool]) -> RouterEvent:
    payload, tier, worker_id, dp_rank, cache_owner = shape
    if cache_owner and tier is StorageTier.DEVICE:
        tier = StorageTier.HOST_PINNED  # CacheOwner residency never targets the Device tier
    return RouterEvent(
        worker_id=worker_id,
        storage_tier=tier,
        residency_domain=ResidencyDomain.CACHE_OWNER if cache_owner else ResidencyDomain.WORKER,
        event_id=event_id,
        data=payload,
        dp_rank=dp_rank,
        state_source=OWNER if cache_owner else None,
    )


def index_by_tier(index: RecoveryIndex) -> dict[StorageTier, int]:
    counts = Counter(event.storage_tier for event in index.tree_dump().events)
    return {tier: count for tier, count in counts.items() if count}


def nonzero(counts: dict[StorageTier, int]) -> dict[StorageTier, int]:
    return {tier: count for tier, count in counts.items() if count}


@settings(max_examples=300, deadline=None)
@given(st.lists(shapes, max_size=40))
def test_live_events_give_the_index_blocks_per_tier(
    stream: list[tuple[EventData, StorageTier, int, int, bool]],
) -> None:
    index = RecoveryIndex(16, 1024)
    model = SlotResidency()
    for event_id, shape in enumerate(stream, start=1):
        event = router_event(event_id, shape)
        index.apply(event)
        model.apply(event, live=True)
        assert nonzero(model.by_tier()) == index_by_tier(index)
    assert sum(model.by_tier().values()) == index.resident_block_count
    # What top does on connecting: a fresh model from the index's tree dump.
    fresh = SlotResidency()
    for event in index.tree_dump().events:
        fresh.apply(event, live=False)
    assert nonzero(fresh.by_tier()) == index_by_tier(index)
    assert fresh.resets == 0


# --- the table's rows ---------------------------------------------------------------------------------


def event(
    event_id: int, data: Stored | Removed | object, *, tier: StorageTier = StorageTier.DEVICE
) -> RouterEvent:
    return RouterEvent(
        worker_id=7,
        storage_tier=tier,
        residency_domain=ResidencyDomain.WORKER,
        event_id=event_id,
        data=data,  # type: ignore[arg-type]
        dp_rank=0,
    )


def stored(*hashes: int) -> Stored:
    return Stored(parent_hash=None, block_hashes=hashes, tokens_hashes=hashes)


def test_residency_counts_blocks_per_tier_through_removes_and_clears() -> None:
    residency = SlotResidency()
    residency.apply(event(1, stored(1, 2, 3)), live=False)
    residency.apply(event(2, stored(10, 11), tier=StorageTier.HOST_PINNED), live=False)
    residency.apply(event(3, stored(3)), live=True)  # already resident: still one block
    assert residency.by_tier() == {StorageTier.DEVICE: 3, StorageTier.HOST_PINNED: 2}
    residency.apply(event(4, Removed((2, 99))), live=True)  # 99 was never resident
    assert residency.by_tier()[StorageTier.DEVICE] == 2
    residency.apply(event(5, CLEARED), live=True)  # a Worker clear drops every tier of the rank
    assert sum(residency.by_tier().values()) == 0
    assert residency.resets == 1 and residency.last_event_id == 5


def test_rates_come_from_cursor_growth_and_a_restart_is_no_sample() -> None:
    row = SlotRow("s")
    row.sample({"outbound_cursor": 100}, now=10.0)
    row.sample({"outbound_cursor": 150}, now=10.5)
    row.sample({"outbound_cursor": 3}, now=11.0)  # the agent restarted: cursor went back
    row.sample({"outbound_cursor": 13}, now=12.0)
    assert list(row.rates) == [100.0, 10.0]
    assert sparkline([0, 0]) == "▁▁"
    assert sparkline([1, 8]) == "▂█"


def test_a_degraded_slot_shows_why() -> None:
    state = TopState("ws://x")
    attachment = {
        "generation": 2,
        "state": "degraded",
        "ready": False,
        "worker": {"worker_id": 1, "dp_rank": 0},
    }
    state.apply_list([{"name": "s", "status": {"attachment": attachment, "outbound_cursor": 5}}], now=1.0)
    table = render_table(state)
    cells = [str(column._cells[0]) for column in table.columns]
    assert cells[:4] == ["s", "degraded", "2", "5"]
    assert "history lost" in cells[-1]
