"""DedupFilter against a plain reference-count model (one dict of counts per state, the definition)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.coordinator.dedup import DedupFilter
from kvagent.model.events import CLEARED, PlacementEvent, Removed, ResidencyDomain, StorageTier, Stored

W = ResidencyDomain.WORKER
C = ResidencyDomain.CACHE_OWNER
_Key = tuple[int, StorageTier, ResidencyDomain]


class CountModel:
    """docs/spec/agent-semantics.md 3.7 spelled out: Worker counts copies per (rank, tier); CacheOwner is set-like."""

    def __init__(self) -> None:
        self.counts: dict[_Key, dict[int, int]] = {}

    def filter(self, event: PlacementEvent) -> tuple[int, ...] | str | None:
        """What the filter must emit: the removed hashes kept, "store"/"clear", or None (swallowed)."""
        key = (event.dp_rank, event.tier, event.domain)
        data = event.data
        if isinstance(data, Stored):
            if event.domain is W and data.block_hashes:
                counts = self.counts.setdefault(key, {})
                for block_hash in data.block_hashes:
                    counts[block_hash] = counts.get(block_hash, 0) + 1
            return "store"
        if data is CLEARED:
            for doomed in [k for k in self.counts if k[0] == event.dp_rank and k[2] is event.domain]:
                del self.counts[doomed]
            return "clear"
        assert isinstance(data, Removed)
        kept: list[int] = []
        for block_hash in data.block_hashes:
            count = self.counts.get(key, {}).get(block_hash) if event.domain is W else None
            if count is None or count == 1:
                kept.append(block_hash)
                if count == 1:
                    del self.counts[key][block_hash]
            else:
                self.counts[key][block_hash] = count - 1
        if key in self.counts and not self.counts[key]:
            del self.counts[key]
        return tuple(kept) if kept else None


_hash = st.integers(0, 12)
_event = st.builds(
    lambda kind, hashes, tier, domain, rank: PlacementEvent(
        Stored(None, tuple(hashes), tuple(hashes))
        if kind == "store"
        else Removed(tuple(hashes))
        if kind == "remove"
        else CLEARED,
        StorageTier.DEVICE if kind == "clear" else tier,
        domain,
        rank,
    ),
    st.sampled_from(["store", "store", "remove", "remove", "clear"]),
    st.lists(_hash, max_size=6),
    st.sampled_from([StorageTier.HOST_PINNED, StorageTier.DISK]),
    st.sampled_from([W, W, W, C]),
    st.integers(0, 1),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_event, max_size=60), st.lists(st.tuples(st.integers(0, 1), _hash), max_size=8))
def test_the_filter_emits_and_counts_what_the_model_does(events: list[PlacementEvent], seeded: Any) -> None:
    dedup, model = DedupFilter(), CountModel()
    blocks = [(rank, StorageTier.HOST_PINNED, block_hash) for rank, block_hash in seeded]
    dedup.seed(W, blocks)
    for block_hash_rank, tier, block_hash in blocks:
        model.filter(PlacementEvent(Stored(None, (block_hash,), (block_hash,)), tier, W, block_hash_rank))
    for event in events:
        expected = model.filter(event)
        emitted = dedup.filter(event)
        if isinstance(expected, str):  # a store or a clear passes as it is
            assert emitted is event
        elif expected is None:
            assert emitted is None
        else:
            assert isinstance(event.data, Removed)
            assert emitted is not None and emitted.data == Removed(expected)
            assert (emitted.tier, emitted.domain, emitted.dp_rank) == (
                event.tier,
                event.domain,
                event.dp_rank,
            )
            if expected == event.data.block_hashes:
                assert emitted is event
        assert dedup.reference_counts() == model.counts
