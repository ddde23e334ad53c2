"""The persistence task over a real SlotStore (SQLite in tmp_path) and a real RecoveryIndex.

Each test drives the index the way the coordinator does (apply, then a status with the new cursor), waits on
a real observable (the writer's statistics) under a fail_after bound, and checks what a second store opened
on the same file loads: the state equals the index's at the persisted id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio
import zmq

from kvagent import AttachmentConfig, MemoryDiscovery, SlotAgentConfig, open_slot_agent
from kvagent.index.recovery_index import DumpSnapshot
from kvagent.model.events import Removed, ResidencyDomain, RouterEvent, Stored
from kvagent.persist.store import (
    AttachmentProgress,
    LoadedSlot,
    MirrorRow,
    SlotIdentityRecord,
    SlotStore,
    StoreWriteError,
)
from kvagent.persist.writer import PersistenceOptions, PersistenceState, PersistenceWriter
from kvagent.publish.republisher import RepublishConfig
from kvagent.simulator.engine import FakeVllmEngine, block_stored
from tests.support.agent import is_store_of, wait_for_event
from tests.support.ids import IDENTITY, OWNER, WORKER
from tests.support.persist import load_state_file
from tests.support.recovery import FakeSlot

GUARD = 20
FIRST_LEASE = 1 << 20
DEFAULT_OPTIONS = PersistenceOptions()
Key = tuple[ResidencyDomain, object, int]


class Lease:
    def __init__(self) -> None:
        self.extensions: list[int] = []
        self.lease_blocked = False

    def set_lease_end(self, lease_end: int) -> None:
        self.extensions.append(lease_end)


def progress_at(seq: int) -> AttachmentProgress:
    return AttachmentProgress(WORKER.worker_id, 0, "tcp://127.0.0.1:5557", None, "", 1, seq, seq * 7 + 1)


def resident(events: Iterable[RouterEvent]) -> set[Key]:
    state: set[Key] = set()
    for event in events:
        data = event.data
        if isinstance(data, Stored):
            state.update((event.residency_domain, event.storage_tier, h) for h in data.block_hashes)
        elif isinstance(data, Removed):
            state.difference_update(
                (event.residency_domain, event.storage_tier, h) for h in data.block_hashes
            )
    return state


def index_state(slot: FakeSlot) -> set[Key]:
    domain = {True: ResidencyDomain.WORKER, False: ResidencyDomain.CACHE_OWNER}
    return {(domain[owner == WORKER], tier, h) for owner, tier, h in slot.index.resident_blocks()}


def loaded_state(loaded: LoadedSlot) -> set[Key]:
    return resident([*loaded.snapshot_events, *loaded.suffix_events])


def remove_worker(slot: FakeSlot, block_hash: int) -> None:
    event = RouterEvent(
        WORKER.worker_id,
        next(iter(slot.index.resident_blocks()))[1],
        ResidencyDomain.WORKER,
        slot.next_id,
        Removed((block_hash,)),
        WORKER.dp_rank,
        OWNER,
    )
    slot.apply(event)


@attrs.define
class Rig:
    slot: FakeSlot
    store: SlotStore
    writer: PersistenceWriter
    lease: Lease
    path: Path

    def step(self, block_hash: int) -> None:
        self.slot.store_worker(block_hash)

    async def wait(self, predicate: Callable[[PersistenceWriter], bool]) -> None:
        with trio.fail_after(GUARD):
            while True:  # polling the writer's statistics (a real observable), bounded
                if predicate(self.writer):
                    return
                await trio.sleep(0.01)

    async def settled(self) -> None:
        current = self.slot.index.current_event_id()
        await self.wait(lambda w: w.statistics().persisted_id >= current)


@asynccontextmanager
async def running_writer(
    tmp_path: Path,
    *,
    ring_capacity: int = 1024,
    options: PersistenceOptions = DEFAULT_OPTIONS,
    store_type: type[SlotStore] = SlotStore,
    start: bool = True,
    lease_end: int = FIRST_LEASE,
) -> AsyncIterator[Rig]:
    path = tmp_path / "slots" / "s0.sqlite3"
    path.parent.mkdir(parents=True)
    store = store_type.open(path)
    store.initialize(SlotIdentityRecord("s0", IDENTITY.publisher_id, str(OWNER)), lease_end, 1)
    slot = FakeSlot(ring_capacity=ring_capacity)
    lease = Lease()
    writer = PersistenceWriter(
        store,
        index=slot.index,
        wait_until=slot_wait(slot),
        progress=lambda: progress_at(slot.next_id - 1) if slot.next_id > 1 else None,
        lease=lease,
        persisted_id=0,
        first_id=1,
        lease_end=lease_end,
        options=options,
    )
    rig = Rig(slot, store, writer, lease, path)
    try:
        async with trio.open_nursery() as nursery:
            if start:
                await nursery.start(writer.run)
            yield rig
            nursery.cancel_scope.cancel()
    finally:
        store.close()


def slot_wait(slot: FakeSlot) -> Callable[[Callable[[], bool]], Awaitable[object]]:
    async def wait_until(predicate: Callable[[], bool]) -> object:
        return await slot.cell.wait_for(lambda _status: predicate())

    return wait_until


async def test_appends_trail_the_index_and_load_as_the_state_at_the_persisted_id(tmp_path: Path) -> None:
    async with running_writer(tmp_path) as rig:
        for block in range(100, 160):
            rig.step(block)
            if block % 7 == 0:
                await trio.lowlevel.checkpoint()  # let drains and writes interleave
        remove_worker(rig.slot, 105)
        await rig.settled()
        loaded = load_state_file(rig.path)
        stats = rig.writer.statistics()
        assert stats.state is PersistenceState.OK and stats.appends >= 1 and stats.lag_events == 0
        assert loaded.last_event_id == rig.slot.index.current_event_id()
        assert loaded_state(loaded) == index_state(rig.slot)
        assert loaded.attachment == progress_at(loaded.last_event_id)
        assert not loaded.clean


async def test_a_writer_started_after_events_were_applied_writes_a_snapshot_first(tmp_path: Path) -> None:
    async with running_writer(tmp_path, ring_capacity=8, start=False) as rig:
        for block in range(200, 240):  # 40 events (through an 8-event ring) before the writer runs
            rig.step(block)
        async with trio.open_nursery() as nursery:
            await nursery.start(rig.writer.run)
            await rig.settled()
            nursery.cancel_scope.cancel()
        loaded = load_state_file(rig.path)
        assert rig.writer.statistics().snapshots == 1
        assert loaded.snapshot_id == rig.slot.index.current_event_id()
        assert loaded_state(loaded) == index_state(rig.slot)


async def test_compaction_keeps_the_suffix_within_its_bound(tmp_path: Path) -> None:
    options = PersistenceOptions(compact_min_events=32, compact_factor=2)
    async with running_writer(tmp_path, options=options) as rig:
        for round_ in range(20):
            for block in range(10):  # the same 10 blocks stored and removed again: small resident state
                rig.step(1000 + block)
            for block in range(10):
                remove_worker(rig.slot, 1000 + block)
            rig.step(5000 + round_)
            await rig.settled()
            assert rig.store.suffix_length() <= 32 + 21
        loaded = load_state_file(rig.path)
        assert rig.writer.statistics().snapshots >= 2
        assert loaded_state(loaded) == index_state(rig.slot)


async def test_the_lease_is_extended_durably_before_half_of_it_is_used(tmp_path: Path) -> None:
    options = PersistenceOptions(lease_block=64)
    async with running_writer(tmp_path, options=options, lease_end=64) as rig:

        def lease_end() -> int:
            return rig.lease.extensions[-1] if rig.lease.extensions else 64

        for block in range(600):
            if rig.slot.next_id >= lease_end():  # the coordinator waits for the extension here
                await rig.wait(partial(lease_above, rig.slot.next_id, lease_end))
            rig.step(block)
        await rig.settled()
        current = rig.slot.index.current_event_id()
        assert rig.lease.extensions, "the lease was never extended"
        assert rig.lease.extensions == sorted(rig.lease.extensions)
        loaded = load_state_file(rig.path)
        assert loaded.lease_end == rig.lease.extensions[-1] > current


def lease_above(next_id: int, lease_end: Callable[[], int], _writer: PersistenceWriter) -> bool:
    return next_id < lease_end()


class FlakyStore(SlotStore):
    """A store whose appends and snapshots fail while ``failing`` is set (a full disk)."""

    failing = False

    def append_encoded(
        self, ids: Sequence[int], body: bytes, attachment: AttachmentProgress | None, **facts: bool
    ) -> None:
        # Every append ends here (``append`` encodes, then calls it; the writer encodes from the ring).
        if FlakyStore.failing:
            raise StoreWriteError("database or disk is full")
        super().append_encoded(ids, body, attachment, **facts)

    def write_snapshot(
        self,
        at_id: int,
        events: Iterable[RouterEvent] | DumpSnapshot,
        mirror: Iterable[MirrorRow],
        attachment: AttachmentProgress | None,
    ) -> None:
        if FlakyStore.failing:
            raise StoreWriteError("database or disk is full")
        super().write_snapshot(at_id, events, mirror, attachment)


async def test_a_full_disk_marks_persistence_failed_keeps_serving_and_recovers_with_a_snapshot(
    tmp_path: Path,
) -> None:
    options = PersistenceOptions(retry_initial=0.01, retry_max=0.05)
    async with running_writer(tmp_path, options=options, store_type=FlakyStore) as rig:
        rig.step(1)
        await rig.settled()
        FlakyStore.failing = True
        try:
            rig.step(2)
            await rig.wait(lambda w: w.state is PersistenceState.FAILED)
            assert rig.writer.statistics().status().state == "failed"
            rig.step(3)  # the slot keeps applying meanwhile
            assert rig.slot.index.current_event_id() == 3
        finally:
            FlakyStore.failing = False
        await rig.wait(lambda w: w.state is PersistenceState.OK and w.statistics().persisted_id == 3)
        stats = rig.writer.statistics()
        assert stats.failures >= 1 and stats.snapshots >= 1
        assert loaded_state(load_state_file(rig.path)) == index_state(rig.slot)


async def test_a_clean_close_records_the_next_id_without_a_jump(tmp_path: Path) -> None:
    async with running_writer(tmp_path) as rig:
        for block in range(10):
            rig.step(block)
        await rig.writer.close_clean()
    loaded = load_state_file(rig.path)
    assert loaded.clean and loaded.lease_end == 11 and loaded.last_event_id == 10


async def test_a_restarted_slot_keeps_its_publisher_ids_index_and_republish_mirror(tmp_path: Path) -> None:
    context: zmq.Context[Any] = zmq.Context()
    engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", block_size=16, context=context)
    config = SlotAgentConfig(
        name="s0",
        cache_owner_id=OWNER,
        kv_block_size=16,
        republish=RepublishConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"),
        state_path=tmp_path / "slots" / "s0.sqlite3",
    )
    try:
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                async with open_slot_agent(config, discovery=MemoryDiscovery(), zmq_context=context) as agent:
                    async with trio.open_nursery() as attaching:
                        attaching.start_soon(engine.wait_for_subscriber)
                        await agent.attach(
                            AttachmentConfig(
                                worker_id=17,
                                dp_rank=0,
                                endpoint=engine.endpoint,
                                topic="kv-events",
                                replay_endpoint=engine.replay_endpoint,
                            )
                        )
                    for block in range(1, 31):
                        await engine.publish_batch(
                            [block_stored([block], block - 1 or None, [block] * 16, 16)]
                        )
                    await wait_for_event(agent, is_store_of(30))
                    assert agent.republisher is not None
                    before = (
                        agent.identity.publisher_id,
                        agent.status().outbound_cursor,
                        agent.index.resident_blocks(),
                        agent.republisher.last_seq,
                        agent.republisher.state.resident_blocks(),
                    )
                # A clean stop, then the same slot again (not attached: nothing moves meanwhile).
                async with open_slot_agent(config, discovery=MemoryDiscovery(), zmq_context=context) as agent:
                    assert agent.republisher is not None
                    after = (
                        agent.identity.publisher_id,
                        agent.status().outbound_cursor,
                        agent.index.resident_blocks(),
                        agent.republisher.last_seq,
                        agent.republisher.state.resident_blocks(),
                    )
                    assert agent.persisted_attachment() is not None
                    persistence = agent.status().persistence
                    assert persistence is not None
                    assert (persistence.state, persistence.persisted_id) == ("ok", before[1])
                assert after == before
                assert before[4] == 30 and before[3] is not None
                nursery.cancel_scope.cancel()
    finally:
        context.destroy(linger=0)
