"""SlotCoordinator.handle_signal: the listener's verdicts about its source (issue #14, docs/trust.md)."""

from __future__ import annotations

import pytest

from kvagent.model.errors import CoordinatorError
from kvagent.model.events import Cleared, IngressChunk, ResidencyDomain, SourceSignal, SourceState
from tests.support.coordinator import FIRST, Slot, chunk, store
from tests.support.ids import DEVICE, OWNER, C, W, attachment_for

DEGRADED, DISCONNECTED, READY = SourceState.DEGRADED, SourceState.DISCONNECTED, SourceState.READY


def worker_blocks(slot: Slot) -> set[int]:
    return {block for (owner, _tier, block) in slot.index.resident_blocks() if owner == FIRST}


def owner_blocks(slot: Slot) -> set[int]:
    return {block for (owner, _tier, block) in slot.index.resident_blocks() if owner == OWNER}


def state(slot: Slot) -> str:
    attachment = slot.current().attachment
    assert attachment is not None
    return attachment.state


def attached(slot: Slot) -> int:
    generation = slot.core.attach(attachment_for(FIRST)).generation
    slot.core.handle_ingress(chunk(generation, 10, [store(W, None, 101, 11, tier=DEVICE)]))
    slot.core.handle_ingress(chunk(generation, 11, [store(W, 101, 102, 12, tier=DEVICE), store(C, None, 7, 70)]))
    assert worker_blocks(slot) == {101, 102} and owner_blocks(slot) == {7}
    return generation


def test_a_reset_to_ready_publishes_a_barrier_and_moves_the_ready_cursor_to_it() -> None:
    slot = Slot()
    generation = attached(slot)
    before = slot.core.outbound_cursor
    slot.core.handle_signal(SourceSignal(generation, state=READY, reset=True, reason="engine restarted"))
    barrier = slot.sink.events[-1]
    assert isinstance(barrier.data, Cleared) and barrier.residency_domain is ResidencyDomain.WORKER
    assert barrier.event_id == before + 1
    status = slot.current()
    assert status.attachment is not None
    assert (status.attachment.state, status.attachment.ready) == ("ready", True)
    assert status.attachment.ready_at_outbound_cursor == barrier.event_id
    assert worker_blocks(slot) == set() and owner_blocks(slot) == {7}
    # The cursor was forgotten: the new engine's seq 0 is neither a restart nor a gap.
    slot.core.handle_ingress(chunk(generation, 0, [store(W, None, 201, 21, tier=DEVICE)]))
    assert worker_blocks(slot) == {201}
    counters = slot.core.counters
    assert (counters.source_resets, counters.restarts, counters.dropped_events) == (1, 0, 0)
    assert (counters.degradations, counters.resyncs) == (0, 0)
    assert slot.withdrawals == [generation]  # the ad names the old ready cursor


def test_the_reset_forgets_worker_dedup_so_a_block_stored_again_is_published() -> None:
    slot = Slot()
    generation = attached(slot)
    slot.core.handle_signal(SourceSignal(generation, state=READY, reset=True))
    published = len(slot.sink.events)
    slot.core.handle_ingress(chunk(generation, 0, [store(W, None, 101, 11, tier=DEVICE)]))
    assert len(slot.sink.events) == published + 1 and worker_blocks(slot) == {101}


def test_degraded_after_a_reset_withdraws_and_keeps_only_contiguous_history() -> None:
    slot = Slot()
    generation = attached(slot)
    ready_cursor = slot.current().attachment.ready_at_outbound_cursor  # type: ignore[union-attr]
    slot.core.handle_signal(
        SourceSignal(generation, state=DEGRADED, reset=True, lost_batches=4000, reason="replay exhausted")
    )
    assert state(slot) == "degraded"
    status = slot.current()
    assert status.attachment is not None and not status.attachment.ready
    assert status.attachment.ready_at_outbound_cursor == ready_cursor
    assert isinstance(slot.sink.events[-1].data, Cleared)
    assert slot.withdrawals == [generation]
    assert status.cache_owner_ready  # advisory CacheOwner: the loss is counted, not fatal
    # What the engine still holds applies from its oldest batch on, without a gap being counted.
    slot.core.handle_ingress(chunk(generation, 4012, [store(W, None, 301, 31, tier=DEVICE)]))
    slot.core.handle_ingress(chunk(generation, 4013, [store(W, 301, 302, 32, tier=DEVICE)]))
    assert worker_blocks(slot) == {301, 302}
    counters = slot.core.counters
    assert (counters.source_losses, counters.degradations, counters.dropped_events) == (4000, 1, 0)
    # A confirmed fresh engine replayed from 0 returns the slot to ready at a new barrier.
    slot.core.handle_signal(SourceSignal(generation, state=READY, reset=True, reason="engine restarted"))
    status = slot.current()
    assert status.attachment is not None and status.attachment.ready
    assert status.attachment.ready_at_outbound_cursor == slot.sink.events[-1].event_id
    assert counters.resyncs == 1 and slot.withdrawals == [generation]


def test_disconnect_and_reconnect_of_the_same_engine_keeps_the_ready_cursor() -> None:
    slot = Slot()
    generation = attached(slot)
    ready_cursor = slot.current().attachment.ready_at_outbound_cursor  # type: ignore[union-attr]
    published = len(slot.sink.events)
    slot.core.handle_signal(SourceSignal(generation, state=DISCONNECTED, reason="monitor: disconnected"))
    assert state(slot) == "disconnected" and not slot.ready
    assert slot.withdrawals == [generation]
    # Batches queued before the drop still apply while disconnected.
    slot.core.handle_ingress(chunk(generation, 12, [store(W, 102, 103, 13, tier=DEVICE)]))
    assert worker_blocks(slot) == {101, 102, 103}
    slot.core.handle_signal(SourceSignal(generation, state=DISCONNECTED))  # unchanged: nothing counted
    slot.core.handle_signal(SourceSignal(generation, state=READY, reason="same engine"))
    assert state(slot) == "ready"
    assert slot.current().attachment.ready_at_outbound_cursor == ready_cursor  # type: ignore[union-attr]
    assert len(slot.sink.events) == published + 1  # no barrier
    counters = slot.core.counters
    assert (counters.disconnects, counters.resyncs, counters.source_resets) == (1, 1, 0)
    assert slot.withdrawals == [generation]  # withdrawn once, on leaving ready


def test_degraded_then_disconnected_withdraws_only_once() -> None:
    slot = Slot()
    generation = attached(slot)
    slot.core.handle_signal(SourceSignal(generation, state=DEGRADED, reset=True))
    slot.core.handle_signal(SourceSignal(generation, state=DISCONNECTED))
    assert state(slot) == "disconnected"
    assert (slot.core.counters.degradations, slot.core.counters.disconnects) == (1, 1)
    assert slot.withdrawals == [generation]


@pytest.mark.parametrize(
    "stale",
    [
        pytest.param(SourceSignal(2, state=DEGRADED, reset=True), id="other-generation"),
        pytest.param(SourceSignal(1, state=DEGRADED, reset=True, lost_batches=3), id="detaching"),
    ],
)
def test_a_signal_for_no_open_attachment_is_counted_and_ignored(stale: SourceSignal) -> None:
    slot = Slot()
    generation = attached(slot)
    if stale.generation == generation:
        slot.core.begin_detach(generation)
    before = (len(slot.sink.events), slot.current())
    slot.core.handle_signal(stale)
    assert (len(slot.sink.events), slot.current()) == before
    assert slot.core.counters.signals_ignored == 1
    assert slot.core.counters.source_losses == 0 and slot.withdrawals == []


def test_signals_before_attach_and_after_quarantine_are_ignored() -> None:
    slot = Slot()
    slot.core.handle_signal(SourceSignal(1, state=READY, reset=True))
    generation = attached(slot)
    assert slot.core.quarantine(generation, "operator") is True
    slot.core.handle_signal(SourceSignal(generation, state=READY, reset=True, quarantine=True))
    assert slot.core.counters.signals_ignored == 2
    assert slot.core.counters.quarantines == {"operator": 1}
    assert slot.core.counters.source_resets == 0


def test_a_quarantine_signal_quarantines_after_the_rest_of_the_signal() -> None:
    slot = Slot()
    generation = attached(slot)
    slot.core.handle_signal(SourceSignal(generation, lost_batches=2, quarantine=True, reason="malformed frame"))
    assert state(slot) == "unready"
    assert slot.core.counters.quarantines == {"malformed frame": 1}
    assert slot.core.counters.source_losses == 2
    assert slot.withdrawals == [generation]
    with pytest.raises(CoordinatorError, match="ingress is closed"):
        slot.core.handle_ingress(chunk(generation, 12))
    unnamed = Slot()
    unnamed_generation = attached(unnamed)
    unnamed.core.handle_signal(SourceSignal(unnamed_generation, quarantine=True))
    assert unnamed.core.counters.quarantines == {"framework listener terminated": 1}


def test_stale_quarantine_leaves_the_current_attachment_alone() -> None:
    slot = Slot()
    first = attached(slot)
    slot.detach(first)
    second = slot.core.attach(attachment_for(FIRST)).generation
    assert slot.core.quarantine(first, "stale") is False
    assert slot.ready and state(slot) == "ready"
    assert slot.core.counters.quarantines == {} and slot.withdrawals == []
    assert slot.core.quarantine(second, "current") is True and slot.withdrawals == [second]


def test_strict_cache_owner_is_untrusted_after_loss_until_ready_again_after_a_reset() -> None:
    slot = Slot(strict_cache_owner=True)
    generation = attached(slot)
    slot.core.handle_signal(SourceSignal(generation, state=DEGRADED, lost_batches=5, reason="joined mid-stream"))
    assert not slot.current().cache_owner_ready
    slot.core.handle_signal(SourceSignal(generation, state=DISCONNECTED))
    slot.core.handle_signal(SourceSignal(generation, state=READY))  # no reset since the loss: still untrusted
    assert slot.ready and not slot.current().cache_owner_ready
    slot.core.handle_signal(SourceSignal(generation, state=DEGRADED, reset=True))
    assert not slot.current().cache_owner_ready  # reset, but not ready yet
    slot.core.handle_signal(SourceSignal(generation, state=READY, reason="resynchronised"))
    assert slot.ready and slot.current().cache_owner_ready
    # A signal is handled reset first, then its loss: a loss that comes with the reset needs another one.
    slot.core.handle_signal(SourceSignal(generation, state=READY, reset=True, lost_batches=3))
    assert slot.ready and not slot.current().cache_owner_ready
    slot.core.handle_signal(SourceSignal(generation, state=READY, reset=True))
    assert slot.current().cache_owner_ready
    assert slot.core.counters.source_losses == 8


def test_advisory_cache_owner_stays_ready_through_losses() -> None:
    slot = Slot()
    generation = attached(slot)
    slot.core.handle_signal(SourceSignal(generation, state=DEGRADED, reset=True, lost_batches=9))
    assert slot.current().cache_owner_ready and slot.core.counters.source_losses == 9


def test_signals_queued_behind_complete_detach_count_their_losses_only() -> None:
    slot = Slot()
    generation = attached(slot)
    slot.core.begin_detach(generation)
    queued: list[IngressChunk | SourceSignal] = [
        chunk(generation, 12, [store(C, None, 8, 80)]),
        SourceSignal(generation, state=DEGRADED, reset=True, lost_batches=6),
        chunk(generation, 13, [store(C, None, 9, 90)]),
    ]
    slot.core.complete_detach(generation, queued)
    counters = slot.core.counters
    assert (counters.signals_ignored, counters.source_losses, counters.source_resets) == (1, 6, 0)
    assert owner_blocks(slot) == {7, 8, 9}
    assert slot.current().attachment is None


def test_statistics_snapshot_carries_the_signal_counters() -> None:
    slot = Slot()
    generation = attached(slot)
    slot.core.handle_signal(SourceSignal(generation, state=DISCONNECTED))
    slot.core.handle_signal(SourceSignal(generation, state=DEGRADED, reset=True))
    slot.core.handle_signal(SourceSignal(generation, state=READY, reset=True))
    slot.core.handle_signal(SourceSignal(generation + 1))
    stats = slot.core.statistics()
    assert (stats.disconnects, stats.degradations, stats.resyncs) == (1, 1, 1)
    assert (stats.source_resets, stats.signals_ignored, stats.ingress_bytes) == (2, 1, 0)
