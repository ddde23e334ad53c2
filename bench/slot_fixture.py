"""A recovery-only slot for figures 2–4: an index built directly, served by the real recovery server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bench.agent_run import WORKER_ID, owner

BLOCKS_PER_EVENT = 4


class BenchSlot:
    """The read side of a SlotSurface over a bare RecoveryIndex; control ops are refused."""

    def __init__(self, index: Any, name: str = "bench") -> None:
        from kvagent.model.ids import KvStateAgentIdentity
        from kvagent.model.status import AgentStatus

        self.name = name
        self.slot_rank = 0
        self.index = index
        self._status = AgentStatus(KvStateAgentIdentity(owner(), 42))

    def status(self) -> Any:
        import attrs

        # The index is the whole slot here, so its newest id is the slot's outbound cursor.
        return attrs.evolve(self._status, outbound_cursor=self.index.current_event_id())

    async def control_attach(self, **_: Any) -> Any:
        raise RuntimeError("the bench slot has no engine")

    async def control_detach(self, generation: int) -> int:
        raise RuntimeError("the bench slot has no engine")

    async def control_quarantine(self, generation: int, reason: str) -> None:
        raise RuntimeError("the bench slot has no engine")


def stored_events(blocks: int, *, first_id: int = 1, seed: int = 1) -> Iterator[Any]:
    """RouterEvents storing ``blocks`` fresh blocks as 4-block chains (the ingest trace's store shape)."""
    import random

    from kvagent.model.events import ResidencyDomain, RouterEvent, StorageTier, Stored

    rng = random.Random(seed)
    event_id = first_id
    for _ in range(0, blocks, BLOCKS_PER_EVENT):
        hashes = tuple(rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT))
        tokens = tuple(rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT))
        data = Stored(None, hashes, tokens)
        yield RouterEvent(WORKER_ID, StorageTier.DEVICE, ResidencyDomain.WORKER, event_id, data, 0)
        event_id += 1


def build_index(blocks: int, ring_capacity: int = 1024) -> Any:
    from kvagent.index.recovery_index import RecoveryIndex

    index = RecoveryIndex(16, ring_capacity)
    for event in stored_events(blocks):
        index.apply(event)
    return index
