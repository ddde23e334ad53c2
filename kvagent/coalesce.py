"""Coalescing of one ingress chunk's placement events (agent-semantics.md 3.8 step 1, Dynamo batching.rs).

Adjacent events merge when they share the coalescing key and their data is compatible; the result keeps
stream order. The key is ``(exact residency owner, the agent's CacheOwnerId, tier)``; inside one chunk the
attached worker and the agent's owner are fixed, so the exact owner is implied by the domain and the key
reduces to ``(domain, tier)``, plus ``dp_rank`` and ``session_id`` which must also be equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvagent.events import (
    MAX_COALESCED_BLOCKS,
    Cleared,
    MmExtraInfo,
    PlacementEvent,
    Removed,
    Stored,
    block_count,
)

__all__ = ["coalesce"]


def coalesce(
    events: Sequence[PlacementEvent], *, max_blocks: int = MAX_COALESCED_BLOCKS
) -> list[PlacementEvent]:
    """Merge chain-continuing stores and adjacent removes; a Cleared is a barrier and stands alone."""
    output: list[PlacementEvent] = []
    pending: PlacementEvent | None = None
    for event in events:
        if isinstance(event.data, Cleared):
            if pending is not None:
                output.append(pending)
                pending = None
            output.append(event)
            continue
        merged = _merge(pending, event) if pending is not None else None
        if merged is not None:
            pending = merged
            if block_count(merged.data) >= max_blocks:
                output.append(merged)
                pending = None
            continue
        if pending is not None:
            output.append(pending)
            pending = None
        if block_count(event.data) >= max_blocks:
            output.append(event)
        else:
            pending = event
    if pending is not None:
        output.append(pending)
    return output


def _merge(pending: PlacementEvent, event: PlacementEvent) -> PlacementEvent | None:
    if (
        pending.domain is not event.domain
        or pending.tier is not event.tier
        or pending.dp_rank != event.dp_rank
        or pending.session_id != event.session_id
    ):
        return None
    old, new = pending.data, event.data
    if isinstance(old, Removed) and isinstance(new, Removed):
        return attrs.evolve(pending, data=Removed(old.block_hashes + new.block_hashes))
    if isinstance(old, Stored) and isinstance(new, Stored):
        # Only a continuation of the pending chain merges: the new event's parent is its last block.
        if not old.block_hashes or new.parent_hash != old.block_hashes[-1]:
            return None
        return attrs.evolve(pending, data=_append_stored(old, new))
    return None


def _append_stored(old: Stored, new: Stored) -> Stored:
    mm_infos: tuple[MmExtraInfo | None, ...] | None = None
    if old.mm_extra_infos is not None or new.mm_extra_infos is not None:
        mm_infos = _mm_or_blank(old) + _mm_or_blank(new)
    return Stored(
        parent_hash=old.parent_hash,
        block_hashes=old.block_hashes + new.block_hashes,
        tokens_hashes=old.tokens_hashes + new.tokens_hashes,
        mm_extra_infos=mm_infos,
        start_position=old.start_position,
    )


def _mm_or_blank(data: Stored) -> tuple[MmExtraInfo | None, ...]:
    if data.mm_extra_infos is not None:
        return data.mm_extra_infos
    return (None,) * len(data.block_hashes)
