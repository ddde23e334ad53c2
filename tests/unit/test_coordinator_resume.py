"""The coordinator of a restarted agent (issue #17): first id, the id lease, source progress, resumed attach.

A "crash" here is a second coordinator and index built from what the first one had applied (its dump and
ring), as the persistence layer restores them; the listener's verdicts arrive as SourceSignals.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvagent.coordinator.machine import SlotCoordinator
from kvagent.coordinator.task import CoordinatorHandle, StatusCell, open_coordinator
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import CoordinatorError
from kvagent.model.events import Cleared, IngressChunk, Removed, SourceSignal, SourceState, Stored
from kvagent.model.status import AgentStatus
from kvagent.testing import RecordingSink
from tests.support.coordinator import FIRST, SLOT_RANK, Slot, chunk, remove, store
from tests.support.ids import DEVICE, IDENTITY, OWNER, C, W, attachment_for

DEGRADED, DISCONNECTED, READY = SourceState.DEGRADED, SourceState.DISCONNECTED, SourceState.READY
RESUME = (11, 0xD16E57)


def digest_chunk(
    generation: int, cursor: int, events: list[object], *, digest: int, final: bool = True
) -> IngressChunk:
    base = chunk(generation, cursor, events, final=final)  # type: ignore[arg-type]
    return IngressChunk(
        base.generation, base.source_cursor, base.chunk_index, base.final, base.events, source_digest=digest
    )


class Restored:
    """A coordinator and index restored from ``before``'s applied state, next id ``first_id``."""

    def __init__(self, before: Slot, *, first_id: int, lease_end: int | None = None) -> None:
        self.index = RecoveryIndex(4, ring_capacity=32)
        dump = before.dump()
        self.index.restore(dump.events, (), snapshot_id=dump.last_event_id)
        self.index.skip_to(first_id - 1)
        self.sink = RecordingSink()
        self.status = StatusCell(AgentStatus(IDENTITY))
        self.withdrawals: list[int] = []
        self.core = SlotCoordinator(
            identity=IDENTITY,
            slot_rank=SLOT_RANK,
            index=self.index,
            sink=self.sink,
            on_status=self.status.set,
            request_withdrawal=self.withdrawals.append,
            first_outbound_id=first_id,
            lease_end=lease_end,
        )
        self.core.restore(next_generation=2, worker_blocks=self.index.resident_worker_blocks())

    def state(self) -> str:
        attachment = self.status.get().attachment
        assert attachment is not None
        return attachment.state

    def worker_blocks(self) -> set[int]:
        return {block for (owner, _tier, block) in self.index.resident_blocks() if owner == FIRST}


def before_crash() -> Slot:
    slot = Slot()
    generation = slot.core.attach(attachment_for(FIRST)).generation
    slot.core.handle_ingress(chunk(generation, 10, [store(W, None, 101, 11, tier=DEVICE)]))
    slot.core.handle_ingress(
        chunk(generation, 11, [store(W, 101, 102, 12, tier=DEVICE), store(C, None, 7, 70)])
    )
    assert slot.core.outbound_cursor == 4
    return slot


def test_a_restored_coordinator_shows_where_ids_continue_and_cache_owner_unready() -> None:
    restored = Restored(before_crash(), first_id=100)
    status = restored.status.get()
    assert (status.outbound_cursor, status.cache_owner_ready, status.attachment) == (99, False, None)


def test_a_resumed_attach_publishes_no_barrier_and_continues_at_the_first_id() -> None:
    restored = Restored(before_crash(), first_id=100)
    attachment = restored.core.attach(attachment_for(FIRST), resume=RESUME)
    assert attachment.generation == 2, "generations continue where the restore said"
    assert restored.sink.events == [], "no Worker reset barrier"
    assert (attachment.ready, attachment.ready_at_outbound_cursor) == (True, 99)
    assert restored.state() == "disconnected"
    assert not restored.status.get().cache_owner_ready, "CacheOwner unready until resynchronised"
    assert restored.core.source_progress() == (2, *RESUME)

    restored.core.handle_ingress(digest_chunk(2, 12, [store(W, 102, 103, 13, tier=DEVICE)], digest=77))
    assert [event.event_id for event in restored.sink.events] == [100]
    assert restored.worker_blocks() == {101, 102, 103}
    assert restored.core.source_progress() == (2, 12, 77)

    restored.core.handle_signal(SourceSignal(2, state=READY, reason="resumed"))
    assert restored.state() == "ready"
    assert restored.status.get().cache_owner_ready
    assert not any(isinstance(event.data, Cleared) for event in restored.sink.events)
    assert restored.core.counters.source_resets == 0
    assert restored.status.get().outbound_cursor == 100


def test_worker_dedup_is_rebuilt_from_the_restored_blocks_once_each() -> None:
    restored = Restored(before_crash(), first_id=100)
    restored.core.attach(attachment_for(FIRST), resume=RESUME)
    # Stored again after the restart: two copies now (the restored one and this one).
    restored.core.handle_ingress(chunk(2, 12, [store(W, None, 101, 11, tier=DEVICE)]))
    restored.core.handle_ingress(chunk(2, 13, [remove(W, 101, tier=DEVICE)]))
    assert [type(event.data) for event in restored.sink.events] == [Stored], "one copy left: swallowed"
    restored.core.handle_ingress(chunk(2, 14, [remove(W, 101, tier=DEVICE)]))
    last = restored.sink.events[-1]
    assert isinstance(last.data, Removed) and last.data.block_hashes == (101,)
    assert restored.worker_blocks() == {102}


def test_a_resume_the_listener_refutes_resets_and_cache_owner_returns_with_ready() -> None:
    restored = Restored(before_crash(), first_id=100)
    restored.core.attach(attachment_for(FIRST), resume=RESUME)
    restored.core.handle_signal(SourceSignal(2, state=READY, reset=True, reason="engine restarted"))
    barrier = restored.sink.events[-1]
    assert isinstance(barrier.data, Cleared) and barrier.event_id == 100
    assert restored.worker_blocks() == set()
    assert {block for (owner, _t, block) in restored.index.resident_blocks() if owner == OWNER} == {7}
    assert restored.state() == "ready" and restored.status.get().cache_owner_ready
    assert restored.core.source_progress() is None, "nothing applied of the new engine yet"


def test_a_resume_into_lost_history_stays_degraded_with_cache_owner_unready_and_nothing_to_resume() -> None:
    restored = Restored(before_crash(), first_id=100)
    restored.core.attach(attachment_for(FIRST), resume=RESUME)
    restored.core.handle_signal(SourceSignal(2, state=DEGRADED, reset=True, lost_batches=5, reason="lost"))
    assert restored.state() == "degraded"
    assert not restored.status.get().cache_owner_ready
    restored.core.handle_ingress(digest_chunk(2, 20, [store(W, None, 201, 21, tier=DEVICE)], digest=5))
    assert restored.core.source_progress() is None, "a degraded state must never be resumed as ready"


def test_source_progress_follows_final_chunks_only_and_is_forgotten_by_resets() -> None:
    slot = Slot()
    assert slot.core.source_progress() is None
    generation = slot.core.attach(attachment_for(FIRST)).generation
    assert slot.core.source_progress() is None
    slot.core.handle_ingress(digest_chunk(generation, 0, [store(W, None, 1, 1)], digest=10))
    assert slot.core.source_progress() == (generation, 0, 10)
    slot.core.handle_ingress(digest_chunk(generation, 1, [store(W, None, 2, 2)], digest=11, final=False))
    assert slot.core.source_progress() == (generation, 0, 10), "a batch counts once its final chunk is in"
    ids = slot.core.outbound_cursor
    # Nothing to publish (an empty batch; a remove the dedup swallows): the batch is still applied.
    slot.core.handle_ingress(IngressChunk(generation, 1, 1, True, (store(W, None, 2, 2),), source_digest=11))
    slot.core.handle_ingress(digest_chunk(generation, 2, [], digest=12))
    assert slot.core.source_progress() == (generation, 2, 12)
    slot.core.handle_ingress(digest_chunk(generation, 3, [store(W, None, 2, 2)], digest=13))
    slot.core.handle_ingress(digest_chunk(generation, 4, [remove(W, 2)], digest=14))
    assert slot.core.outbound_cursor == ids + 2, "the remove was swallowed (two copies)"
    assert slot.core.source_progress() == (generation, 4, 14)
    slot.core.handle_signal(SourceSignal(generation, state=DISCONNECTED, reason="engine disconnected"))
    assert slot.core.source_progress() == (generation, 4, 14), "a disconnect loses nothing"
    slot.core.handle_signal(SourceSignal(generation, state=READY, reset=True, reason="engine restarted"))
    assert slot.core.source_progress() is None


def test_an_in_place_restart_forgets_the_progress() -> None:
    slot = Slot()
    generation = slot.core.attach(attachment_for(FIRST)).generation
    slot.core.handle_ingress(digest_chunk(generation, 5, [store(W, None, 1, 1)], digest=10, final=False))
    slot.core.handle_ingress(digest_chunk(generation, 2, [store(W, None, 2, 2)], digest=20, final=False))
    assert slot.core.counters.restarts == 1
    assert slot.core.source_progress() is None


def test_a_detach_barrier_leaves_nothing_to_resume_but_a_quarantine_keeps_the_progress() -> None:
    slot = Slot()
    generation = slot.core.attach(attachment_for(FIRST)).generation
    slot.core.handle_ingress(digest_chunk(generation, 0, [store(W, None, 1, 1)], digest=10))
    slot.core.quarantine(generation, "test")
    assert slot.core.source_progress() == (generation, 0, 10), "the applied state is still that batch's"
    slot.core.begin_detach(generation)
    slot.core.complete_detach(generation, [])
    assert slot.core.source_progress() is None


def test_a_fresh_attach_after_a_restore_publishes_its_barrier_at_the_first_id() -> None:
    restored = Restored(before_crash(), first_id=100)
    attachment = restored.core.attach(attachment_for(FIRST))
    assert attachment.ready_at_outbound_cursor == 100
    assert [type(event.data) for event in restored.sink.events] == [Cleared]
    assert restored.worker_blocks() == set()
    assert restored.status.get().cache_owner_ready and restored.state() == "ready"


def test_restore_is_refused_once_attached_and_the_first_id_is_checked() -> None:
    restored = Restored(before_crash(), first_id=100)
    restored.core.attach(attachment_for(FIRST), resume=RESUME)
    with pytest.raises(CoordinatorError):
        restored.core.restore(next_generation=5)
    with pytest.raises(ValueError):
        Restored(before_crash(), first_id=0)


# -- the outbound id lease ------------------------------------------------------------------------------


def test_ids_at_or_above_the_lease_end_are_never_stamped() -> None:
    restored = Restored(before_crash(), first_id=100, lease_end=102)
    restored.core.attach(attachment_for(FIRST), resume=RESUME)
    assert restored.core.ids_available() == 2
    restored.core.handle_ingress(chunk(2, 12, [store(W, None, 301, 1), store(W, None, 302, 2)]))
    assert restored.core.ids_available() == 0
    with pytest.raises(CoordinatorError, match="lease exhausted"):
        restored.core.handle_ingress(chunk(2, 13, [store(W, None, 303, 3)]))
    assert max(event.event_id for event in restored.sink.events) == 101
    assert not restored.core.trust.worker_failed and not restored.core.trust.source_failed
    restored.core.set_lease_end(101)
    assert restored.core.lease_end == 102, "the lease never moves back"
    restored.core.set_lease_end(200)
    restored.core.handle_ingress(chunk(2, 14, [store(W, None, 304, 4)]))
    assert restored.sink.events[-1].event_id == 102


def test_ids_needed_bounds_what_an_item_can_take() -> None:
    events = [store(W, None, block, block) for block in range(5)]
    assert SlotCoordinator.ids_needed(chunk(1, 1, events)) == 6, "five events and a restart barrier"
    assert SlotCoordinator.ids_needed(SourceSignal(1, reset=True)) == 1
    assert SlotCoordinator.ids_needed(SourceSignal(1, state=READY)) == 0
    assert Slot().core.ids_available() is None, "no lease: no bound"


def blocked(handle: CoordinatorHandle) -> bool:
    return handle.lease_blocked  # (a call: mypy would narrow the property across the awaits)


async def test_the_task_waits_for_the_lease_instead_of_crossing_it() -> None:
    restored = Restored(before_crash(), first_id=100, lease_end=103)
    handle, run = open_coordinator(restored.core)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            await handle.attach(attachment_for(FIRST), resume=RESUME)
            handle.admit_nowait(chunk(2, 12, [store(W, None, 301, 1)]))
            await restored.sink.wait_for_calls(1)
            assert (handle.outbound_cursor, handle.lease_blocked) == (100, False)
            # Two events may need three ids (a restart barrier too): more than the two left.
            handle.admit_nowait(chunk(2, 13, [store(W, None, 302, 2), store(W, None, 303, 3)]))
            while not blocked(handle):
                await handle.wait_progress()
            await trio.testing.wait_all_tasks_blocked()
            assert handle.outbound_cursor == 100, "nothing stamped while blocked"
            handle.set_lease_end(1 << 24)
            await restored.sink.wait_for_calls(2)
            assert [event.event_id for event in restored.sink.events] == [100, 101, 102]
            assert not blocked(handle)
            assert handle.source_progress() == (2, 13, 0)
            await handle.shutdown()


async def test_wait_progress_returns_after_each_drain() -> None:
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            generation = (await handle.attach(attachment_for(FIRST))).generation
            async with trio.open_nursery() as waiters:
                waiters.start_soon(handle.wait_progress)
                await trio.testing.wait_all_tasks_blocked()
                handle.admit_nowait(chunk(generation, 1, [store(W, None, 1, 1)]))
            assert handle.outbound_cursor == 2
            await handle.shutdown()
