"""Compact resident-block storage for one (residency owner, storage tier) of the recovery index.

A million resident blocks must fit in about 200 bytes each, so there is no Python object per block beyond
the dict entry: ``slots`` maps a block hash to a row number, and the row's parent hash and tokens hash live in
``array('Q')`` columns (8 bytes each) with a one-byte "has a parent" column.  Freed rows go on a free list and
are reused; the columns are compacted when more than half of them are free.  Multimodal info is rare, so it
is kept in a sparse dict keyed by row.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from kvagent.events import MmExtraInfo

__all__ = ["BlockStore"]

# Below this many free rows compaction is not worth the rebuild.
_COMPACT_MIN_FREE = 4096


class BlockStore:
    __slots__ = ("_free", "_has_parent", "_mm", "_parents", "_slots", "_tokens")

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}
        self._parents = array("Q")
        self._tokens = array("Q")
        self._has_parent = bytearray()
        self._free: list[int] = []
        self._mm: dict[int, MmExtraInfo] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def hashes(self) -> Iterator[int]:
        return iter(self._slots)

    def store(
        self,
        parent_hash: int | None,
        block_hashes: tuple[int, ...],
        tokens_hashes: tuple[int, ...],
        mm_extra_infos: tuple[MmExtraInfo | None, ...] | None,
    ) -> None:
        """Add (or overwrite) a chain: block i's parent is block i-1, block 0's is ``parent_hash``.

        The caller has validated lengths and u64 ranges, so nothing here can fail half-way.
        """
        slots, parents, tokens, has_parent, free, mm = (
            self._slots,
            self._parents,
            self._tokens,
            self._has_parent,
            self._free,
            self._mm,
        )
        parent = parent_hash
        for index, block_hash in enumerate(block_hashes):
            slot = slots.get(block_hash)
            if slot is None:
                if free:
                    slot = free.pop()
                else:
                    slot = len(parents)
                    parents.append(0)
                    tokens.append(0)
                    has_parent.append(0)
                slots[block_hash] = slot
            if parent is None:
                parents[slot] = 0
                has_parent[slot] = 0
            else:
                parents[slot] = parent
                has_parent[slot] = 1
            tokens[slot] = tokens_hashes[index]
            info = None if mm_extra_infos is None else mm_extra_infos[index]
            if info is None:
                if mm:
                    mm.pop(slot, None)
            else:
                mm[slot] = info
            parent = block_hash

    def remove(self, block_hashes: tuple[int, ...]) -> None:
        """Delete the given hashes; unknown hashes are ignored."""
        slots, free, mm = self._slots, self._free, self._mm
        for block_hash in block_hashes:
            slot = slots.pop(block_hash, None)
            if slot is not None:
                free.append(slot)
                if mm:
                    mm.pop(slot, None)
        if not slots:
            # Drop the columns outright rather than keep a free list for an empty store.
            self._parents, self._tokens, self._has_parent = array("Q"), array("Q"), bytearray()
            self._slots, self._free, self._mm = {}, [], {}
        elif len(free) > _COMPACT_MIN_FREE and len(free) > len(slots):
            self._compact()

    def _compact(self) -> None:
        old_parents, old_tokens, old_has_parent, old_mm = (
            self._parents,
            self._tokens,
            self._has_parent,
            self._mm,
        )
        parents, tokens = array("Q"), array("Q")
        has_parent = bytearray()
        mm: dict[int, MmExtraInfo] = {}
        slots: dict[int, int] = {}
        for new_slot, (block_hash, slot) in enumerate(self._slots.items()):
            slots[block_hash] = new_slot
            parents.append(old_parents[slot])
            tokens.append(old_tokens[slot])
            has_parent.append(old_has_parent[slot])
            if old_mm and slot in old_mm:
                mm[new_slot] = old_mm[slot]
        self._slots, self._parents, self._tokens, self._has_parent = slots, parents, tokens, has_parent
        self._mm, self._free = mm, []

    def get(self, block_hash: int) -> tuple[int | None, int, MmExtraInfo | None] | None:
        """(parent hash, tokens hash, mm info) of a resident block, or None."""
        slot = self._slots.get(block_hash)
        if slot is None:
            return None
        parent = self._parents[slot] if self._has_parent[slot] else None
        return parent, self._tokens[slot], self._mm.get(slot)

    def replay_order(self) -> Iterator[tuple[int, int | None, int, MmExtraInfo | None]]:
        """Every block as (hash, parent, tokens hash, mm info), a resident parent before its children.

        Dict order is insertion order, which is already parent-first for chains stored in one go; a block
        whose resident parent comes later (re-stored parent, reparenting) pulls its unemitted ancestors out
        first.  A parent cycle (only possible with adversarial input) is cut at the block where it closes.
        """
        slots, parents, tokens, has_parent, mm = (
            self._slots,
            self._parents,
            self._tokens,
            self._has_parent,
            self._mm,
        )
        # 0 = not yet emitted, 1 = emitted, 2 = on the ancestor chain being resolved.
        state = bytearray(len(parents))
        for block_hash, slot in slots.items():
            if state[slot]:
                continue
            if has_parent[slot]:
                parent_hash = parents[slot]
                parent_slot = slots.get(parent_hash)
                if parent_slot is not None and not state[parent_slot]:
                    yield from self._emit_with_ancestors(block_hash, slot, state)
                    continue
                state[slot] = 1
                yield block_hash, parent_hash, tokens[slot], mm.get(slot) if mm else None
            else:
                state[slot] = 1
                yield block_hash, None, tokens[slot], mm.get(slot) if mm else None

    def _emit_with_ancestors(
        self, block_hash: int, slot: int, state: bytearray
    ) -> Iterator[tuple[int, int | None, int, MmExtraInfo | None]]:
        slots, parents, tokens, has_parent, mm = (
            self._slots,
            self._parents,
            self._tokens,
            self._has_parent,
            self._mm,
        )
        chain = [(block_hash, slot)]
        state[slot] = 2
        while has_parent[slot]:
            parent_hash = parents[slot]
            parent_slot = slots.get(parent_hash)
            if parent_slot is None or state[parent_slot]:
                break  # not resident, already emitted, or a cycle closing on the chain
            chain.append((parent_hash, parent_slot))
            state[parent_slot] = 2
            slot = parent_slot
        for chain_hash, chain_slot in reversed(chain):
            state[chain_slot] = 1
            parent = parents[chain_slot] if has_parent[chain_slot] else None
            yield chain_hash, parent, tokens[chain_slot], mm.get(chain_slot) if mm else None
