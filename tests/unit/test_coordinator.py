"""The SlotCoordinator core: pinned behaviours 9.2, 9.5, 9.6 and section 3 (the shell: test_coordinator_task)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from kvagent.coordinator.machine import SHUTDOWN_QUARANTINE
from kvagent.index.recovery_index import RecoveryIndex, TreeDumpAnswer
from kvagent.model.errors import CoordinatorError
from kvagent.model.events import (
    CLEARED,
    MAX_CHUNK_BLOCKS,
    Cleared,
    PlacementEvent,
    Removed,
    RouterEvent,
    Stored,
)
from kvagent.model.status import AgentStatus
from kvagent.vllm.normalize import NormalizedBatch, build_ingress_chunks
from tests.support.coordinator import (
    FIRST,
    REPLACEMENT,
    SLOT_RANK,
    Slot,
    chunk,
    cleared_count,
    remove,
    store,
)
from tests.support.ids import DEVICE, DISK, HP, OWNER, C, W, attachment_for

# -- 9.2 coordinator half ----------------------------------------------------------------------------


def test_production_named_map_ownership_reaches_exact_local_recovery_owners() -> None:
    slot = Slot()
    attached = slot.core.attach(attachment_for(FIRST))
    events = [
        PlacementEvent(Stored(None, (101,), (1,)), HP, C, 3),
        PlacementEvent(Stored(101, (102, 202), (2, 3)), DISK, C, 3),
        PlacementEvent(Removed((102,)), DISK, C, 3),
        PlacementEvent(Stored(None, (105,), (4,)), HP, C, 3),
        PlacementEvent(Removed((101,)), HP, C, 3),
        PlacementEvent(Stored(None, (106,), (5,)), HP, W, 3),
        PlacementEvent(Stored(None, (104,), (6,)), DEVICE, W, 3),
    ]
    slot.core.handle_ingress(chunk(attached.generation, 1, events))

    owner_events = slot.owner_dump_events()
    assert {event.storage_tier for event in owner_events} == {HP, DISK}
    owner_blocks = {
        (event.storage_tier, block)
        for event in owner_events
        if isinstance(event.data, Stored)
        for block in event.data.block_hashes
    }
    assert owner_blocks == {(HP, 105), (DISK, 202)}
    assert all(event.residency_domain is C for event in owner_events)
    # No two adjacent events coalesce: one id each after the attach barrier.
    assert slot.ids() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert slot.sink.calls == 2


# -- 9.5 ------------------------------------------------------------------------------------------


def test_detach_accepts_cache_owner_ingress_after_readiness_withdrawal() -> None:
    slot = Slot()
    attached = slot.core.attach(attachment_for(FIRST))
    assert (attached.generation, attached.ready_at_outbound_cursor) == (1, 1)
    slot.core.begin_detach(1)
    assert not slot.ready
    slot.core.handle_ingress(chunk(1, 1, [store(W, None, 101, 11), store(C, None, 201, 21)]))
    assert slot.core.complete_detach(1, []) == 4
    assert [(e.event_id, e.residency_domain, isinstance(e.data, Cleared)) for e in slot.sink.events] == [
        (1, W, True),
        (2, W, False),
        (3, C, False),
        (4, W, True),
    ]
    assert len(slot.owner_dump_events()) == 1

    replacement = slot.core.attach(attachment_for(FIRST, "tcp://framework-2"))
    assert (replacement.generation, replacement.ready_at_outbound_cursor) == (2, 5)
    slot.core.handle_ingress(chunk(2, 1, [store(C, None, 301, 31)], final=False))
    assert slot.core.outbound_cursor == 6
    assert slot.active_batch() == (1, 0)
    dropped_before = slot.core.counters.dropped_events
    assert slot.detach(2) == 7
    assert slot.core.counters.dropped_events == dropped_before + 1
    assert slot.active_batch() is None
    assert slot.current().cache_owner_ready
    assert slot.core.counters.dropped_events == 1


# -- 9.6 ------------------------------------------------------------------------------------------


def test_lossy_sequence_and_publication_failures_do_not_reuse_outbound_ids() -> None:
    slot = Slot()
    attached = slot.core.attach(attachment_for(FIRST))
    assert (attached.generation, attached.ready_at_outbound_cursor) == (1, 1)

    with pytest.raises(CoordinatorError, match="^ingress is closed for attachment generation 2$"):
        slot.core.handle_ingress(chunk(2, 1, [store(W, None, 99, 9)] * 129))
    assert slot.ready
    assert slot.withdrawals == []

    slot.sink.fail = True
    slot.core.handle_ingress(chunk(1, 1, [store(W, None, 101, 11)]))
    assert slot.index.current_event_id() == 2
    assert slot.current().outbound_cursor == 2
    assert slot.current().cache_owner_ready
    assert slot.ready
    assert slot.core.counters.publication_failures == 1

    slot.sink.fail = False
    slot.core.handle_ingress(chunk(1, 3, [store(W, 101, 102, 12)]))
    assert slot.current().outbound_cursor == 3
    assert slot.ready
    assert slot.core.counters.dropped_events == 1
    assert slot.ids() == [1, 3]
    assert slot.sink.calls == 3


# -- control commands (3.3) ----------------------------------------------------------------------


def test_attach_errors_and_stale_generations() -> None:
    slot = Slot()
    with pytest.raises(CoordinatorError, match="^KV state agent is not attached$"):
        slot.core.begin_detach(1)
    with pytest.raises(CoordinatorError, match="^KV state agent is not attached$"):
        slot.core.complete_detach(1, [])
    slot.core.attach(attachment_for(FIRST))
    with pytest.raises(CoordinatorError, match="^KV state agent already has an attachment$") as caught:
        slot.core.attach(attachment_for(REPLACEMENT))
    assert caught.value.code == "conflict"
    with pytest.raises(CoordinatorError, match="^stale attachment generation 5$") as stale:
        slot.core.begin_detach(5)
    assert stale.value.code == "generation_mismatch"
    with pytest.raises(CoordinatorError, match="^attachment must be unready before detach cleanup$"):
        slot.core.complete_detach(1, [])
    assert slot.ready and slot.ids() == [1]


def test_quarantine_of_a_stale_generation_does_nothing() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    before = slot.current()
    slot.core.quarantine(7, "late listener")
    assert slot.current() is before
    assert slot.withdrawals == []
    assert slot.core.counters.quarantines == {}
    slot.core.quarantine(1, "framework listener terminated")
    assert not slot.ready
    assert slot.withdrawals == [1]
    assert slot.core.counters.quarantines == {"framework listener terminated": 1}
    with pytest.raises(CoordinatorError, match="^ingress is closed for attachment generation 1$"):
        slot.core.handle_ingress(chunk(1, 1, [store(W, None, 1, 1)]))


def test_abort_attach_publishes_no_barrier() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.abort_attach(9)
    assert slot.current().attachment is not None
    slot.core.abort_attach(1)
    assert slot.current().attachment is None
    assert slot.sink.calls == 1
    assert slot.withdrawals == []
    again = slot.core.attach(attachment_for(FIRST))
    assert (again.generation, again.ready_at_outbound_cursor) == (2, 2)


def test_detach_drain_applies_only_cache_owner_and_discards_other_generations() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.begin_detach(1)
    queued = [
        chunk(1, 1, [store(W, None, 101, 11), store(C, None, 201, 21)]),
        chunk(9, 1, [store(C, None, 901, 91)]),
        chunk(1, 2, [store(C, 201, 202, 22)]),
    ]
    assert slot.core.complete_detach(1, queued) == 4
    assert [(e.event_id, e.residency_domain) for e in slot.sink.events] == [(1, W), (2, C), (3, C), (4, W)]
    assert slot.core.counters.events_filtered["detach_worker_dropped"] == 1
    assert slot.core.counters.events_filtered["stale_generation"] == 1
    assert slot.current().attachment is None


# -- failure paths (3.6, 3.8) ---------------------------------------------------------------------


def test_source_fault_fails_the_source_and_retires_the_worker_domain() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    with pytest.raises(CoordinatorError, match="^incompatible raw source: unknown raw event ownership$"):
        slot.core.handle_ingress(
            chunk(1, 1, [store(W, None, 101, 11)], source_fault="unknown raw event ownership")
        )
    assert slot.withdrawals == [1]
    assert slot.ids() == [1]
    assert not slot.ready and not slot.current().cache_owner_ready
    assert slot.core.counters.quarantines == {"unknown raw event ownership": 1}
    assert slot.detach(1) == 2
    with pytest.raises(CoordinatorError, match="^Worker domain is retired after a local/publish failure$"):
        slot.core.attach(attachment_for(REPLACEMENT))


def test_oversized_envelope_fails_the_source() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    with pytest.raises(CoordinatorError, match="^oversized ingress envelope$"):
        slot.core.handle_ingress(chunk(1, 1, [store(W, None, 99, 9)] * 129))
    assert slot.withdrawals == [1]
    assert slot.core.counters.quarantines == {"oversized ingress envelope": 1}
    assert slot.core.trust.source_failed and slot.core.trust.worker_failed
    big = PlacementEvent(Removed(tuple(range(8193))), HP, W, 3)
    other = Slot()
    other.core.attach(attachment_for(FIRST))
    with pytest.raises(CoordinatorError, match="^oversized ingress envelope$"):
        other.core.handle_ingress(chunk(1, 1, [big]))


def test_rank_mismatch_inside_a_chunk_fails_the_source_and_stops_the_chunk() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    events = [store(W, None, 101, 11), PlacementEvent(Stored(None, (102,), (12,)), HP, W, 4)]
    with pytest.raises(CoordinatorError, match="^ingress rank 4 does not match stable slot rank 3$"):
        slot.core.handle_ingress(chunk(1, 1, events))
    assert slot.core.counters.quarantines == {"ingress rank does not match stable slot": 1}
    assert slot.withdrawals == [1]
    # The first event was admitted locally and consumed id 2, but nothing of the chunk was published.
    assert slot.index.current_event_id() == 2
    assert slot.core.outbound_cursor == 2
    assert slot.sink.calls == 1


def test_cache_owner_fault_filters_cache_owner_forever_but_allows_a_new_attach() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    fault = "KVCR ownership has an unsupported storage medium"
    slot.core.handle_ingress(
        chunk(1, 1, [store(W, None, 101, 11), store(C, None, 201, 21)], cache_owner_fault=fault)
    )
    assert [(e.event_id, e.residency_domain) for e in slot.sink.events] == [(1, W), (2, W)]
    assert slot.withdrawals == [1]
    assert not slot.current().cache_owner_ready and not slot.ready
    with pytest.raises(CoordinatorError, match="^ingress is closed for attachment generation 1$"):
        slot.core.handle_ingress(chunk(1, 2, [store(W, None, 102, 12)]))
    assert slot.detach(1) == 3

    again = slot.core.attach(attachment_for(REPLACEMENT))
    assert again.generation == 2
    slot.core.handle_ingress(
        chunk(
            2, 1, [store(C, None, 301, 31, worker=REPLACEMENT), store(W, None, 302, 32, worker=REPLACEMENT)]
        )
    )
    assert [(e.event_id, e.residency_domain) for e in slot.sink.events][-1] == (5, W)
    assert slot.core.counters.events_filtered["cache_owner_failed"] == 2
    assert slot.owner_dump_events() == []
    assert not slot.current().cache_owner_ready


def test_local_barrier_failure_at_attach_retires_the_worker_domain() -> None:
    slot = Slot()
    slot.local.fail_clears = True
    with pytest.raises(
        CoordinatorError, match="^failed to establish Worker reset barrier before attach$"
    ) as caught:
        slot.core.attach(attachment_for(FIRST))
    assert isinstance(caught.value.__cause__, CoordinatorError)
    assert str(caught.value.__cause__) == "local reset barrier failed"
    assert slot.withdrawals == [1]
    assert slot.core.counters.quarantines == {
        "local reset barrier failed": 1,
        "attach reset transaction failed": 1,
    }
    # The id stays consumed though nothing was published.
    assert slot.sink.calls == 0
    assert slot.current().outbound_cursor == 1
    attachment = slot.current().attachment
    assert attachment is not None and attachment.generation == 1 and not attachment.ready
    slot.core.abort_attach(1)
    with pytest.raises(CoordinatorError, match="^Worker domain is retired after a local/publish failure$"):
        slot.core.attach(attachment_for(FIRST))


def test_barrier_publication_failure_at_attach() -> None:
    slot = Slot()
    slot.sink.fail = True
    with pytest.raises(
        CoordinatorError, match="^failed to establish Worker reset barrier before attach$"
    ) as caught:
        slot.core.attach(attachment_for(FIRST))
    assert str(caught.value.__cause__) == "failed to publish reset barrier"
    assert slot.withdrawals == [1]
    assert slot.core.counters.quarantines["reset barrier publication failed"] == 1
    assert slot.sink.calls == 1
    assert slot.index.current_event_id() == 1
    assert slot.current().outbound_cursor == 1
    assert slot.core.trust.worker_failed


def test_final_barrier_failure_keeps_the_attachment_and_retires_the_worker_domain() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.begin_detach(1)
    slot.sink.fail = True
    with pytest.raises(CoordinatorError, match="^failed to publish final Worker detach barrier$"):
        slot.core.complete_detach(1, [])
    assert slot.withdrawals == [1]
    assert slot.current().attachment is not None
    assert slot.core.trust.worker_failed
    assert slot.current().outbound_cursor == 2


def test_cache_owner_clear_publication_failure_fails_cache_owner_closed() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.sink.fail = True
    with pytest.raises(CoordinatorError, match="^failed to publish reset barrier$"):
        slot.core.handle_ingress(chunk(1, 1, [PlacementEvent(CLEARED, DEVICE, C, 3)]))
    assert slot.withdrawals == [1]
    assert not slot.current().cache_owner_ready
    assert not slot.core.trust.worker_failed
    assert slot.core.counters.quarantines == {"reset barrier publication failed": 1}


def test_ordinary_local_admit_failure_is_lossy_and_still_published() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.local.fail_ordinary = True
    slot.core.handle_ingress(chunk(1, 1, [store(W, None, 101, 11)]))
    assert slot.ids() == [1, 2]
    assert slot.ready and slot.withdrawals == []


def test_swallowed_removes_consume_no_id_but_refresh_status() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.handle_ingress(chunk(1, 1, [store(W, None, 7, 70)]))
    slot.core.handle_ingress(chunk(1, 2, [store(W, None, 7, 70)]))
    before = slot.current()
    slot.core.handle_ingress(chunk(1, 3, [remove(W, 7)]))
    assert slot.current() is not before
    assert slot.current().outbound_cursor == 3
    assert slot.sink.calls == 3
    slot.core.handle_ingress(chunk(1, 4, [remove(W, 7)]))
    assert slot.ids() == [1, 2, 3, 4]
    assert isinstance(slot.sink.events[-1].data, Removed)


def test_outbound_cursor_exhaustion_fails_the_source() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.lease.next_id = (1 << 64) - 1
    with pytest.raises(CoordinatorError, match="^state-agent outbound cursor exhausted$"):
        slot.core.handle_ingress(chunk(1, 1, [store(W, None, 1, 1)]))
    assert slot.core.counters.quarantines == {"state-agent outbound cursor exhausted": 1}
    assert slot.withdrawals == [1]


# -- source cursor and restart detection ------------------------------------------------------------


def test_engine_restart_in_place_resets_worker_residency_and_keeps_cache_owner() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.handle_ingress(chunk(1, 0, [store(W, None, 101, 11), store(C, None, 201, 21)]))
    slot.core.handle_ingress(chunk(1, 1, [store(W, None, 101, 11)]))
    slot.core.handle_ingress(chunk(1, 2, [store(W, None, 102, 12)]))
    assert cleared_count(slot.sink.events) == 1
    slot.core.handle_ingress(chunk(1, 0, [store(W, None, 301, 31)]))
    assert cleared_count(slot.sink.events) == 2
    assert slot.core.counters.restarts == 1
    assert slot.core.counters.dropped_events == 0
    resident = slot.index.resident_blocks()
    assert {(owner, block) for owner, _tier, block in resident} == {(FIRST, 301), (OWNER, 201)}
    # The dedup counts of the old incarnation are gone: one remove of 101 is no longer swallowed.
    slot.core.handle_ingress(chunk(1, 1, [remove(W, 101)]))
    assert isinstance(slot.sink.events[-1].data, Removed)
    assert slot.ready and slot.withdrawals == []


def test_duplicate_raw_batch_is_dropped_without_applying() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.handle_ingress(chunk(1, 5, [store(W, None, 101, 11)]))
    slot.core.handle_ingress(chunk(1, 5, [store(W, None, 101, 11)]))
    assert slot.ids() == [1, 2]
    assert slot.core.counters.events_filtered["duplicate_source_chunk"] == 1
    assert slot.core.counters.dropped_events == 0
    # A multi-chunk duplicate is dropped chunk by chunk.
    slot.core.handle_ingress(chunk(1, 6, [store(W, None, 1, 1)], final=False))
    slot.core.handle_ingress(chunk(1, 6, [store(W, None, 2, 2)], index=1))
    slot.core.handle_ingress(chunk(1, 6, [store(W, None, 3, 3)], final=False))
    slot.core.handle_ingress(chunk(1, 6, [store(W, None, 4, 4)], index=1))
    assert slot.ids() == [1, 2, 3, 4]
    slot.core.handle_ingress(chunk(1, 7, [store(W, None, 5, 5)]))
    assert slot.ids() == [1, 2, 3, 4, 5]
    assert slot.core.counters.dropped_events == 0
    assert slot.core.counters.events_filtered["duplicate_source_chunk"] == 3
    assert slot.core.counters.restarts == 0


def test_cursor_gaps_are_counted_and_accepted() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.handle_ingress(chunk(1, 10))
    slot.core.handle_ingress(chunk(1, 14))
    assert slot.core.counters.dropped_events == 3
    slot.core.handle_ingress(chunk(1, 15, index=2))
    assert slot.core.counters.dropped_events == 4
    slot.core.handle_ingress(chunk(1, 16, final=False))
    slot.core.handle_ingress(chunk(1, 17))
    assert slot.core.counters.dropped_events == 5
    assert slot.current().cache_owner_ready and slot.ready


def test_strict_cache_owner_source_loss_untrusts_cache_owner_until_next_attach() -> None:
    lenient = Slot()
    lenient.core.attach(attachment_for(FIRST))
    lenient.core.report_source_loss(1, 2)
    assert lenient.current().cache_owner_ready
    assert lenient.core.counters.source_losses == 2

    strict = Slot(strict_cache_owner=True)
    strict.core.attach(attachment_for(FIRST))
    strict.core.report_source_loss(5, 1)
    assert strict.current().cache_owner_ready
    strict.core.report_source_loss(1, 1)
    assert not strict.current().cache_owner_ready
    strict.detach(1)
    assert not strict.current().cache_owner_ready
    strict.core.attach(attachment_for(REPLACEMENT))
    assert strict.current().cache_owner_ready


def test_an_ingress_batch_publishes_one_status_at_its_end() -> None:
    slot = Slot()
    generation = slot.core.attach(attachment_for(FIRST)).generation
    barrier_cursor = slot.current().outbound_cursor
    published: list[AgentStatus] = []
    original_set = slot.status.set

    def recording_set(status: AgentStatus) -> None:
        published.append(status)
        original_set(status)

    slot.status.set = recording_set  # type: ignore[method-assign]
    with slot.core.ingress_batch():
        slot.core.handle_ingress(chunk(generation, 0, [store(W, None, 10, 110, tier=DEVICE)]))
        slot.core.handle_ingress(chunk(generation, 1, [store(W, 10, 11, 111, tier=DEVICE)]))
        assert slot.current().outbound_cursor == barrier_cursor  # deferred while the batch runs
        assert published == []
    assert [status.outbound_cursor for status in published] == [barrier_cursor + 2]
    assert slot.core.outbound_cursor == barrier_cursor + 2
    # A batch that moved nothing publishes nothing; outside a batch every chunk publishes at once.
    with slot.core.ingress_batch():
        pass
    slot.core.handle_ingress(chunk(generation, 2, [remove(W, 10, tier=DEVICE, rank=FIRST.dp_rank)]))
    assert [status.outbound_cursor for status in published] == [barrier_cursor + 2, barrier_cursor + 3]


def test_statistics_is_a_frozen_snapshot_of_the_counters() -> None:
    slot = Slot()
    generation = slot.core.attach(attachment_for(FIRST)).generation
    slot.core.handle_ingress(chunk(generation, 1, [store(W, None, 10, 110)]))
    slot.core.quarantine(generation, "operator quarantine")
    before = slot.core.statistics()
    assert (before.attachments, before.ingress_chunks, before.events_in) == (1, 1, 1)
    assert (before.publications, before.events_published, before.events_out_ids) == (2, 2, 2)
    assert before.quarantines == {"operator quarantine": 1}
    assert before.ingress_queue_depth == 0
    slot.core.counters.count_filtered("stale_generation")
    slot.core.counters.quarantines["operator quarantine"] += 1
    # Later counting changes neither the snapshot's scalars nor its labelled counters.
    assert before.events_filtered == {} and before.quarantines == {"operator quarantine": 1}
    assert slot.core.statistics().events_filtered == {"stale_generation": 1}


# -- one event larger than a chunk (issue #14) ------------------------------------------------------


def dumped_rows(answer: TreeDumpAnswer) -> set[tuple[int | None, int, int]]:
    rows: set[tuple[int | None, int, int]] = set()
    for event in answer.events:
        assert isinstance(event.data, Stored)
        rows.add((event.data.parent_hash, event.data.block_hashes[0], event.data.tokens_hashes[0]))
    return rows


def test_an_event_larger_than_a_chunk_is_split_and_applies_like_the_whole_event() -> None:
    hashes = tuple(range(50_000, 50_000 + MAX_CHUNK_BLOCKS + 1))
    whole_store = Stored(None, hashes, tuple(h * 3 for h in hashes))
    # Removes the first 4000 blocks, plus hashes no block has (ignored), 8193 in all.
    whole_remove = Removed(hashes[:4000] + tuple(range(1, MAX_CHUNK_BLOCKS - 3999 + 1)))
    events = [
        PlacementEvent(whole_store, DEVICE, W, SLOT_RANK),
        PlacementEvent(whole_remove, DEVICE, W, SLOT_RANK),
    ]
    slot = Slot()
    generation = slot.core.attach(attachment_for(FIRST)).generation
    chunks = build_ingress_chunks(generation, 0, NormalizedBatch(events))
    assert [[len(e.data.block_hashes) for e in c.events] for c in chunks] == [[8192], [1], [8192], [1]]
    for ingress in chunks:
        slot.core.handle_ingress(ingress)
    assert slot.ready and slot.core.counters.quarantines == {}

    reference = RecoveryIndex(4, ring_capacity=32)
    reference.apply(RouterEvent(FIRST.worker_id, DEVICE, W, 1, whole_store, SLOT_RANK))
    reference.apply(RouterEvent(FIRST.worker_id, DEVICE, W, 2, whole_remove, SLOT_RANK))
    assert slot.index.resident_blocks() == reference.resident_blocks()
    assert slot.index.resident_block_count == MAX_CHUNK_BLOCKS + 1 - 4000
    expected = reference.events_in_range(None, None)
    assert isinstance(expected, TreeDumpAnswer)
    assert dumped_rows(slot.dump()) == dumped_rows(expected)


def test_a_shutdown_quarantine_logs_at_info_any_other_at_warning() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    with capture_logs() as logs:
        slot.core.quarantine(1, SHUTDOWN_QUARANTINE)
    assert [(entry["event"], entry["log_level"]) for entry in logs] == [("ingress_quarantined", "info")]
    other = Slot()
    other.core.attach(attachment_for(FIRST))
    with capture_logs() as logs:
        other.core.quarantine(1, "framework listener terminated")
    assert [(entry["event"], entry["log_level"]) for entry in logs] == [("ingress_quarantined", "warning")]
