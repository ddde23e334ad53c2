"""The recovery index fed from the live vLLM 0.32.0 capture (tests/data/vectors/vllm-0.32.0-live.jsonl).

The index side goes through kvagent's own wire decoder (and, in one test, the attachment normalizer); the
expected block sets are computed independently, from the raw msgpack payloads with plain set arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgpack
import pytest

from kvagent.index.recovery_index import RecoveryIndex, TreeDumpAnswer
from kvagent.model.events import (
    CLEARED,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.vllm.decode import (
    RawBlockRemoved,
    RawBlockStored,
    RawMessage,
    decode,
)
from kvagent.vllm.normalize import AttachmentNormalizer
from tests.support.vectors import load_live

WORKER = WorkerWithDpRank(11, 0)
BLOCK_SIZE = 32  # the capture's engine setting


@pytest.fixture(scope="module")
def capture() -> tuple[list[RawMessage], list[RawMessage], list[bytes]]:
    sub, replay = load_live()
    live = [decode(frames) for frames in sub]
    replayed = [m for m in (decode(frames, replay=True) for frames in replay) if m is not None]
    return live, replayed, [frames[2] for frames in sub]


def raw_to_router_events(messages: Iterable[RawMessage], first_id: int = 1) -> list[RouterEvent]:
    """Worker-domain RouterEvents, consecutive ids, straight from the decoded raw events."""
    events: list[RouterEvent] = []
    event_id = first_id
    for message in messages:
        rank = message.batch.data_parallel_rank or 0
        for raw in message.batch.events:
            if isinstance(raw, RawBlockStored):
                tier = StorageTier.from_medium(raw.medium)
                # tokens hashes play no part in residency; 0 keeps this test independent of hashing.
                data: Stored | Removed = Stored(
                    raw.parent_block_hash, raw.block_hashes, (0,) * len(raw.block_hashes)
                )
            elif isinstance(raw, RawBlockRemoved):
                tier = StorageTier.from_medium(raw.medium)
                data = Removed(raw.block_hashes)
            else:
                events.append(
                    RouterEvent(
                        WORKER.worker_id, StorageTier.DEVICE, ResidencyDomain.WORKER, event_id, CLEARED, rank
                    )
                )
                event_id += 1
                continue
            assert tier is not None
            events.append(RouterEvent(WORKER.worker_id, tier, ResidencyDomain.WORKER, event_id, data, rank))
            event_id += 1
    return events


def expected_from_payloads(payloads: list[bytes]) -> tuple[set[int], int]:
    """Resident hashes after the whole stream, from the raw msgpack maps; also the number of clears seen."""
    resident: set[int] = set()
    clears = 0
    for payload in payloads:
        _ts, raw_events, *_rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        for raw in raw_events:
            tag = raw["type"]
            if tag == "BlockStored":
                resident.update(raw["block_hashes"])
            elif tag == "BlockRemoved":
                resident.difference_update(raw["block_hashes"])
            else:
                assert tag == "AllBlocksCleared"
                resident.clear()
                clears += 1
    return resident, clears


def applied(events: Iterable[RouterEvent]) -> RecoveryIndex:
    index = RecoveryIndex(BLOCK_SIZE)
    for event in events:
        index.apply(event)
    return index


def hashes_of(index: RecoveryIndex) -> set[int]:
    return {block_hash for (_owner, _tier, block_hash) in index.resident_blocks()}


def test_live_stream_and_replay_converge(
    capture: tuple[list[RawMessage], list[RawMessage], list[bytes]],
) -> None:
    live, replayed, _payloads = capture
    from_live = applied(raw_to_router_events(live))
    from_replay = applied(raw_to_router_events(replayed))
    assert from_live.resident_blocks() == from_replay.resident_blocks()
    assert from_live.resident_block_count > 0
    assert {owner for (owner, _tier, _h) in from_live.resident_blocks()} == {WORKER}


def test_only_blocks_stored_after_the_reset_remain(
    capture: tuple[list[RawMessage], list[RawMessage], list[bytes]],
) -> None:
    live, _replayed, payloads = capture
    expected, clears = expected_from_payloads(payloads)
    assert clears == 1  # the capture holds exactly one reset (README)

    # Independently: the hashes stored after the clear, minus those removed after it.
    after_clear: set[int] = set()
    seen_clear = False
    for payload in payloads:
        for raw in msgpack.unpackb(payload, raw=False)[1]:
            if raw["type"] == "AllBlocksCleared":
                seen_clear = True
            elif seen_clear and raw["type"] == "BlockStored":
                after_clear.update(raw["block_hashes"])
            elif seen_clear:
                after_clear.difference_update(raw["block_hashes"])
    assert after_clear == expected and expected

    index = applied(raw_to_router_events(live))
    assert hashes_of(index) == expected
    assert index.current_event_id() == 65 + 17 + 1  # one id per raw event


def test_normalized_events_reach_the_same_resident_set(
    capture: tuple[list[RawMessage], list[RawMessage], list[bytes]],
) -> None:
    live, _replayed, payloads = capture
    normalizer = AttachmentNormalizer(kv_block_size=BLOCK_SIZE, worker=WORKER)
    placements: list[PlacementEvent] = []
    for message in live:
        normalized = normalizer.normalize(message.batch)
        assert normalized.source_fault is None and normalized.cache_owner_fault is None
        placements.extend(normalized.events)
    index = RecoveryIndex(BLOCK_SIZE)
    for event_id, placement in enumerate(placements, start=1):
        index.apply(
            RouterEvent(
                WORKER.worker_id,
                placement.tier,
                placement.domain,
                event_id,
                placement.data,
                placement.dp_rank,
                None,
                placement.session_id,
            )
        )
    assert hashes_of(index) == expected_from_payloads(payloads)[0]


def test_dump_of_the_live_state_replays_exactly(
    capture: tuple[list[RawMessage], list[RawMessage], list[bytes]],
) -> None:
    live, _replayed, _payloads = capture
    index = applied(raw_to_router_events(live))
    answer = index.events_in_range(None, None)
    assert isinstance(answer, TreeDumpAnswer) and answer.last_event_id == index.current_event_id()
    replica = RecoveryIndex(BLOCK_SIZE)
    for event_id, event in enumerate(answer.events, start=1):
        replica.apply(
            RouterEvent(
                event.worker_id,
                event.storage_tier,
                event.residency_domain,
                event_id,
                event.data,
                event.dp_rank,
            )
        )
    assert replica.resident_blocks() == index.resident_blocks()
    assert replica.tree_dump().events == answer.events  # same rows, same parents, same order
