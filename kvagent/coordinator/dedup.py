"""Outbound dedup of placement events (agent-semantics.md 3.7, Dynamo publisher/dedup.rs).

vLLM does not deduplicate physical copies: the same block hash can be stored twice (two requests cached
the same prefix in different physical blocks) and each copy is removed on its own. The Worker domain is
therefore reference-counted per ``(dp_rank, tier)``: a remove is only forwarded when the last copy goes.
The CacheOwner domain is set-like: KVCR guarantees at most one residency per owner, tier and hash.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvagent.model.events import Cleared, PlacementEvent, Removed, ResidencyDomain, StorageTier, Stored

__all__ = ["DedupFilter"]

_StateKey = tuple[int, StorageTier, ResidencyDomain]
# Worker is reference-counted; every other domain is set-like (the agent creates CacheOwner events only
# from KVCR ownership, which is set-like by contract).
_WORKER = ResidencyDomain.WORKER


class DedupFilter:
    """Per ``(dp_rank, tier, domain)`` reference counts of stored block hashes."""

    def __init__(self) -> None:
        self._counts: dict[_StateKey, dict[int, int]] = {}

    def filter(self, event: PlacementEvent) -> PlacementEvent | None:
        """The event to emit, or None for a remove that has nothing left to remove (consumes no id)."""
        data = event.data
        cls = type(data)
        domain = event.domain
        if cls is Stored:
            assert isinstance(data, Stored)
            if domain is _WORKER and data.block_hashes:  # REF_COUNTED
                key = (event.dp_rank, event.tier, domain)
                counts = self._counts.get(key)
                if counts is None:
                    counts = self._counts[key] = {}
                get = counts.get
                for block_hash in data.block_hashes:
                    counts[block_hash] = get(block_hash, 0) + 1
            return event
        if cls is Cleared:
            self.reset_domain(event.dp_rank, domain)
            return event
        assert isinstance(data, Removed)
        if domain is not _WORKER:  # SET_LIKE
            return event if data.block_hashes else None
        surviving = self._surviving_removes(event.dp_rank, event.tier, domain, data)
        if not surviving:
            return None
        if len(surviving) == len(data.block_hashes):
            return event
        return attrs.evolve(event, data=Removed(tuple(surviving)))

    def _surviving_removes(
        self, dp_rank: int, tier: StorageTier, domain: ResidencyDomain, data: Removed
    ) -> list[int]:
        counts = self._counts.get((dp_rank, tier, domain))
        if counts is None:
            # Untracked hashes pass through: the agent may have missed the store (lossy stream).
            return list(data.block_hashes)
        surviving: list[int] = []
        for block_hash in data.block_hashes:
            count = counts.get(block_hash)
            if count is None:
                surviving.append(block_hash)
            elif count <= 1:
                del counts[block_hash]
                surviving.append(block_hash)
            else:
                counts[block_hash] = count - 1
        if not counts:
            del self._counts[(dp_rank, tier, domain)]
        return surviving

    def seed(self, domain: ResidencyDomain, blocks: Iterable[tuple[int, StorageTier, int]]) -> None:
        """Count each ``(dp_rank, tier, block hash)`` of ``domain`` once more (a restored index's blocks)."""
        counts_by_key = self._counts
        for dp_rank, tier, block_hash in blocks:
            key = (dp_rank, tier, domain)
            counts = counts_by_key.get(key)
            if counts is None:
                counts = counts_by_key[key] = {}
            counts[block_hash] = counts.get(block_hash, 0) + 1

    def reset_domain(self, dp_rank: int, domain: ResidencyDomain) -> None:
        """Forget every tier's counts of one rank and domain (what a Cleared does)."""
        for key in [key for key in self._counts if key[0] == dp_rank and key[2] is domain]:
            del self._counts[key]
