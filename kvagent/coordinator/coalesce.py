"""Coalescing of one ingress chunk's placement events (agent-semantics.md 3.8 step 1, Dynamo batching.rs).

Adjacent events merge when they share the coalescing key and their data is compatible; the result keeps
stream order. The key is ``(exact residency owner, the agent's CacheOwnerId, tier)``; inside one chunk the
attached worker and the agent's owner are fixed, so the exact owner is implied by the domain and the key
reduces to ``(domain, tier)``, plus ``dp_rank`` and ``session_id`` which must also be equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvagent.model.events import (
    MAX_COALESCED_BLOCKS,
    Cleared,
    MmExtraInfo,
    PlacementEvent,
    Removed,
    Stored,
)

__all__ = ["coalesce"]


def coalesce(
    events: Sequence[PlacementEvent], *, max_blocks: int = MAX_COALESCED_BLOCKS
) -> list[PlacementEvent]:
    """Merge chain-continuing stores and adjacent removes; a Cleared is a barrier and stands alone."""
    output: list[PlacementEvent] = []
    append = output.append
    pending: PlacementEvent | None = None
    for event in events:
        data = event.data
        cls = type(data)
        if cls is Cleared:
            if pending is not None:
                append(pending)
                pending = None
            append(event)
            continue
        assert isinstance(data, Stored | Removed)
        if pending is not None:
            merged = _merge(pending, event)
            if merged is not None:
                if len(merged.data.block_hashes) >= max_blocks:
                    append(merged)
                    pending = None
                else:
                    pending = merged
                continue
            append(pending)
            pending = None
        if len(data.block_hashes) >= max_blocks:
            append(event)
        else:
            pending = event
    if pending is not None:
        append(pending)
    return output


def _merge(pending: PlacementEvent, event: PlacementEvent) -> PlacementEvent | None:
    old, new = pending.data, event.data
    cls = type(new)
    if (
        type(old) is not cls
        or pending.domain is not event.domain
        or pending.tier is not event.tier
        or pending.dp_rank != event.dp_rank
        or pending.session_id != event.session_id
    ):
        return None
    if cls is Removed:
        assert isinstance(old, Removed) and isinstance(new, Removed)
        return attrs.evolve(pending, data=Removed(old.block_hashes + new.block_hashes))
    assert isinstance(old, Stored) and isinstance(new, Stored)
    # Only a continuation of the pending chain merges: the new event's parent is its last block.
    if not old.block_hashes or new.parent_hash != old.block_hashes[-1]:
        return None
    return attrs.evolve(pending, data=_append_stored(old, new))


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
        # Tokens are republished only when every merged block has them (a partial list would misalign).
        token_bytes=(
            None if old.token_bytes is None or new.token_bytes is None else old.token_bytes + new.token_bytes
        ),
    )


def _mm_or_blank(data: Stored) -> tuple[MmExtraInfo | None, ...]:
    if data.mm_extra_infos is not None:
        return data.mm_extra_infos
    return (None,) * len(data.block_hashes)
