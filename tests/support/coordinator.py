"""The SlotCoordinator under test: one core with the seed fixtures, and the chunk/event builders.

Shared by tests/unit/test_coordinator.py (the machine) and tests/io/test_coordinator_task.py (its Trio shell).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvagent.coordinator.machine import SlotCoordinator
from kvagent.coordinator.task import StatusCell
from kvagent.index.recovery_index import RecoveryIndex, TreeDumpAnswer
from kvagent.model.errors import IndexApplyError
from kvagent.model.events import (
    Cleared,
    IngressChunk,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.model.status import AgentStatus
from kvagent.testing import RecordingSink
from tests.support.ids import HP, IDENTITY, OWNER, attachment_for

__all__ = [
    "FIRST",
    "REPLACEMENT",
    "SLOT_RANK",
    "FlakyIndex",
    "Slot",
    "attachment_for",
    "chunk",
    "cleared_count",
    "remove",
    "store",
]

# The slot sits at dp rank 3; FIRST and its REPLACEMENT are two workers on that rank.
SLOT_RANK = 3
FIRST = WorkerWithDpRank(17, 3)
REPLACEMENT = WorkerWithDpRank(29, 3)


def store(
    domain: ResidencyDomain,
    parent: int | None,
    block: int,
    local: int,
    *,
    worker: WorkerWithDpRank = FIRST,
    tier: StorageTier = HP,
) -> PlacementEvent:
    return PlacementEvent(Stored(parent, (block,), (local,)), tier, domain, worker.dp_rank)


def remove(
    domain: ResidencyDomain, *blocks: int, tier: StorageTier = HP, rank: int = SLOT_RANK
) -> PlacementEvent:
    return PlacementEvent(Removed(blocks), tier, domain, rank)


def chunk(
    generation: int,
    cursor: int,
    events: Sequence[PlacementEvent] = (),
    *,
    index: int = 0,
    final: bool = True,
    source_fault: str | None = None,
    cache_owner_fault: str | None = None,
) -> IngressChunk:
    return IngressChunk(generation, cursor, index, final, tuple(events), source_fault, cache_owner_fault)


class FlakyIndex:
    """The real RecoveryIndex, with injectable local-admit failures."""

    def __init__(self, inner: RecoveryIndex) -> None:
        self.inner = inner
        self.fail_clears = False
        self.fail_ordinary = False

    def apply(self, event: RouterEvent) -> None:
        is_clear = isinstance(event.data, Cleared)
        if (is_clear and self.fail_clears) or (not is_clear and self.fail_ordinary):
            raise IndexApplyError("injected local admit failure")
        self.inner.apply(event)

    def current_event_id(self) -> int:
        return self.inner.current_event_id()


class Slot:
    """One coordinator core with the seed test fixtures: owner, identity 41, rank 3, index (4, 32)."""

    def __init__(self, *, strict_cache_owner: bool = False) -> None:
        self.index = RecoveryIndex(4, ring_capacity=32)
        self.local = FlakyIndex(self.index)
        self.sink = RecordingSink()
        self.status = StatusCell(AgentStatus(IDENTITY))
        self.withdrawals: list[int] = []
        self.core = SlotCoordinator(
            identity=IDENTITY,
            slot_rank=SLOT_RANK,
            index=self.local,
            sink=self.sink,
            on_status=lambda status: self.status.set(status),  # late-bound: a test wraps set
            request_withdrawal=self.withdrawals.append,
            strict_cache_owner=strict_cache_owner,
        )

    # Methods rather than properties: mypy would narrow a property across the mutating calls in between.
    def current(self) -> AgentStatus:
        return self.status.get()

    def active_batch(self) -> tuple[int, int] | None:
        return self.core.cursor.active

    @property
    def ready(self) -> bool:
        attachment = self.current().attachment
        return attachment is not None and attachment.ready

    def ids(self) -> list[int]:
        return [event.event_id for event in self.sink.events]

    def detach(self, generation: int, queued: Sequence[IngressChunk] = ()) -> int:
        self.core.begin_detach(generation)
        return self.core.complete_detach(generation, queued)

    def dump(self) -> TreeDumpAnswer:
        answer = self.index.events_in_range(None, None)
        assert isinstance(answer, TreeDumpAnswer)
        return answer

    def owner_dump_events(self) -> list[RouterEvent]:
        return [event for event in self.dump().events if event.state_source == OWNER]


def cleared_count(events: Sequence[RouterEvent]) -> int:
    return sum(isinstance(event.data, Cleared) for event in events)
