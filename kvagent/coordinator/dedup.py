"""Outbound dedup of placement events (docs/spec/agent-semantics.md 3.7, Dynamo publisher/dedup.rs).

vLLM does not deduplicate physical copies: the same block hash can be stored twice (two requests cached
the same prefix in different physical blocks) and each copy is removed on its own. The Worker domain is
therefore reference-counted per ``(dp_rank, tier)``: a remove is only forwarded when the last copy goes.
The CacheOwner domain is set-like: KVCR guarantees at most one residency per owner, tier and hash.

Almost every resident hash has exactly one copy, so a state keeps those in a set (16 bytes a hash where a
dict of counts takes about 42 at a million) and only the hashes with two or more copies in a dict of
counts; a hash is in one or the other.  A chain of hashes that are all new is then added at C speed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import attrs

from kvagent.model.events import Cleared, PlacementEvent, Removed, ResidencyDomain, StorageTier, Stored

__all__ = ["DedupFilter"]

_StateKey = tuple[int, StorageTier, ResidencyDomain]
# Worker is reference-counted; every other domain is set-like (the agent creates CacheOwner events only
# from KVCR ownership, which is set-like by contract).
_WORKER = ResidencyDomain.WORKER


class _Copies:
    """The stored hashes of one ``(dp_rank, tier, domain)``: single copies in ``ones``, more in ``extra``."""

    __slots__ = ("extra", "ones")

    def __init__(self) -> None:
        self.ones: set[int] = set()
        self.extra: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.ones) or bool(self.extra)

    def add(self, hashes: tuple[int, ...]) -> None:
        """One more copy of each hash (a hash listed twice gets two)."""
        ones, extra = self.ones, self.extra
        if ones.isdisjoint(hashes) and (not extra or extra.keys().isdisjoint(hashes)):
            before = len(ones)
            ones.update(hashes)
            if len(ones) - before != len(hashes):
                self.recount_repeats(hashes)
            return
        for block_hash in hashes:
            count = extra.get(block_hash)
            if count is not None:
                extra[block_hash] = count + 1
            elif block_hash in ones:
                ones.remove(block_hash)
                extra[block_hash] = 2
            else:
                ones.add(block_hash)

    def recount_repeats(self, hashes: tuple[int, ...]) -> None:
        """After new ``hashes`` went into ``ones`` at once: a hash the chain lists twice gets its real count.

        (The native core's dedup calls it too: kvagent/_native/_ingest.pyx.)
        """
        for block_hash, copies in Counter(hashes).items():
            if copies > 1:
                self.ones.remove(block_hash)
                self.extra[block_hash] = copies

    def drop(self, hashes: tuple[int, ...]) -> list[int]:
        """One copy less of each hash; returns the hashes whose last copy went (or that were never seen)."""
        ones, extra = self.ones, self.extra
        if not extra or extra.keys().isdisjoint(hashes):
            ones.difference_update(hashes)
            return list(hashes)
        surviving: list[int] = []
        for block_hash in hashes:
            count = extra.get(block_hash)
            if count is None:
                ones.discard(block_hash)
                surviving.append(block_hash)
            elif count > 2:
                extra[block_hash] = count - 1
            else:
                del extra[block_hash]
                ones.add(block_hash)
        return surviving

    def counts(self) -> dict[int, int]:
        return {**dict.fromkeys(self.ones, 1), **self.extra}


class DedupFilter:
    """Per ``(dp_rank, tier, domain)`` reference counts of stored block hashes."""

    def __init__(self) -> None:
        self._states: dict[_StateKey, _Copies] = {}

    def filter(self, event: PlacementEvent) -> PlacementEvent | None:
        """The event to emit, or None for a remove that has nothing left to remove (consumes no id)."""
        data = event.data
        cls = type(data)
        domain = event.domain
        if cls is Stored:
            assert isinstance(data, Stored)
            if domain is _WORKER and data.block_hashes:  # REF_COUNTED
                key = (event.dp_rank, event.tier, domain)
                state = self._states.get(key)
                if state is None:
                    state = self._states[key] = _Copies()
                state.add(data.block_hashes)
            return event
        if cls is Cleared:
            self.reset_domain(event.dp_rank, domain)
            return event
        assert isinstance(data, Removed)
        if domain is not _WORKER:  # SET_LIKE
            return event if data.block_hashes else None
        key = (event.dp_rank, event.tier, domain)
        state = self._states.get(key)
        if state is None:
            # Untracked hashes pass through: the agent may have missed the store (lossy stream).
            return event if data.block_hashes else None
        surviving = state.drop(data.block_hashes)
        if not state:
            del self._states[key]
        if not surviving:
            return None
        if len(surviving) == len(data.block_hashes):
            return event
        return attrs.evolve(event, data=Removed(tuple(surviving)))

    def seed(self, domain: ResidencyDomain, blocks: Iterable[tuple[int, StorageTier, int]]) -> None:
        """Count each ``(dp_rank, tier, block hash)`` of ``domain`` once more (a restored index's blocks)."""
        states = self._states
        for dp_rank, tier, block_hash in blocks:
            key = (dp_rank, tier, domain)
            state = states.get(key)
            if state is None:
                state = states[key] = _Copies()
            if block_hash in state.ones or block_hash in state.extra:
                state.add((block_hash,))
            else:
                state.ones.add(block_hash)  # the usual case: a restored index holds each hash once

    def reset_domain(self, dp_rank: int, domain: ResidencyDomain) -> None:
        """Forget every tier's counts of one rank and domain (what a Cleared does)."""
        for key in [key for key in self._states if key[0] == dp_rank and key[2] is domain]:
            del self._states[key]

    def reference_counts(self) -> dict[_StateKey, dict[int, int]]:
        """A copy of every state's counts: ``(dp_rank, tier, domain)`` → block hash → copies (for tests)."""
        return {key: state.counts() for key, state in self._states.items()}
