"""RecoveryIndex.apply: owners are resolved once per route, and odd routes are still refused cleanly."""

from __future__ import annotations

from typing import Any

import pytest

from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import IndexApplyError
from kvagent.model.events import (
    CLEARED,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.model.ids import CacheOwnerId
from tests.support.ids import OWNER

OTHER_OWNER = CacheOwnerId.parse(
    "01010101010101010101010101010101:02020202020202020202020202020202/0000000000000003/05050505050505050505050505050505"
)
W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
HP, DEVICE = StorageTier.HOST_PINNED, StorageTier.DEVICE


def event(event_id: int, data: Any, *, domain: ResidencyDomain = W, tier: Any = DEVICE, worker: int = 7,
          rank: int = 0, source: CacheOwnerId | None = OWNER) -> RouterEvent:
    return RouterEvent(worker, tier, domain, event_id, data, rank, source)


def test_routes_keep_owners_and_tiers_apart() -> None:
    index = RecoveryIndex(4)
    index.apply(event(1, Stored(None, (1,), (11,))))
    index.apply(event(2, Stored(None, (2,), (12,)), worker=8))  # another worker of the same rank
    index.apply(event(3, Stored(None, (3,), (13,)), domain=C, tier=HP))
    index.apply(event(4, Stored(None, (4,), (14,)), domain=C, tier=HP, source=OTHER_OWNER))
    index.apply(event(5, Stored(None, (5,), (15,)), tier=HP))
    assert index.resident_blocks() == {
        (WorkerWithDpRank(7, 0), DEVICE, 1),
        (WorkerWithDpRank(8, 0), DEVICE, 2),
        (OWNER, HP, 3),
        (OTHER_OWNER, HP, 4),
        (WorkerWithDpRank(7, 0), HP, 5),
    }
    index.apply(event(6, Removed((3,)), domain=C, tier=HP, source=OTHER_OWNER))  # not that owner's block
    index.apply(event(7, CLEARED, domain=C, tier=HP, source=OTHER_OWNER))
    assert (OWNER, HP, 3) in index.resident_blocks()
    assert (OTHER_OWNER, HP, 4) not in index.resident_blocks()


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (event(1, Stored(None, (1,), (11,)), tier=["device"]), "unknown storage tier"),
        (event(1, Stored(None, (1,), (11,)), tier="device"), "unknown storage tier"),
        (event(1, Stored(None, (1,), (11,)), domain=C, tier=HP, source=None), "no state_source"),
        (event(1, Stored(None, (1,), (11,)), domain=C), "cannot target the Device tier"),
    ],
)
def test_a_refused_route_changes_nothing_and_is_not_remembered(bad: RouterEvent, reason: str) -> None:
    index = RecoveryIndex(4)
    for _ in range(2):  # the second time must be refused as well (nothing cached from the first)
        with pytest.raises(IndexApplyError, match=reason):
            index.apply(bad)
    assert index.current_event_id() == 0 and index.resident_block_count == 0
