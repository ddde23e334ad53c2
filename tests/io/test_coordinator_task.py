"""The coordinator's Trio shell: admission, control priority, the loop (agent-semantics.md 3.2, 9.3, 9.4)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvagent.coordinator.task import CoordinatorHandle, admit_ingress, open_coordinator, open_ingress_channel
from kvagent.model.errors import CoordinatorClosed, CoordinatorError
from kvagent.model.events import residency_owner
from tests.support.coordinator import FIRST, REPLACEMENT, Slot, chunk, store
from tests.support.ids import OWNER, C, W, attachment_for

# -- 9.3 ------------------------------------------------------------------------------------------


def test_listener_admission_does_not_wait_for_coordinator_progress() -> None:
    send, receive = open_ingress_channel()
    for cursor in range(1, 1025):
        admit_ingress(send, chunk(7, cursor))
    assert receive.receive_nowait().source_cursor == 1
    assert receive.statistics().current_buffer_used == 1023


def test_handle_admission_does_not_wait_for_a_coordinator_that_is_not_running() -> None:
    slot = Slot()
    assert slot.core.ingress_queue_depth() == 0
    handle, _run = open_coordinator(slot.core)
    for cursor in range(1, 1025):
        handle.admit_nowait(chunk(7, cursor))
    assert handle.ingress_backlog == 1024
    assert slot.core.ingress_queue_depth() == 1024
    assert handle.statistics().ingress_queue_depth == 1024
    assert slot.core.statistics().ingress_queue_depth == 0  # the bare machine has no queue


# -- 9.4 ------------------------------------------------------------------------------------------


async def test_one_stream_lifecycle_preserves_cache_owner_across_worker_reattach() -> None:
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            first = await handle.attach(attachment_for(FIRST, "tcp://framework-7"))
            assert first.ready_at_outbound_cursor == 1
            assert first.generation == 1

            handle.admit_nowait(chunk(1, 1, [store(W, None, 101, 11), store(C, None, 101, 11)]))
            handle.admit_nowait(chunk(1, 2, [store(C, 101, 102, 12)]))
            await slot.sink.wait_for_calls(3)
            await handle.quarantine(first.generation, "test interruption")
            attachment = slot.current().attachment
            assert attachment is not None and not attachment.ready
            await handle.begin_detach(first.generation)
            assert await handle.complete_detach(first.generation) == 5

            replacement = await handle.attach(attachment_for(REPLACEMENT, "tcp://framework-8"))
            assert replacement.ready_at_outbound_cursor == 6
            assert replacement.generation == 2
            attachment = slot.current().attachment
            assert attachment is not None and attachment.worker == REPLACEMENT

            events = slot.sink.events
            assert [event.event_id for event in events] == [1, 2, 3, 4, 5, 6]
            assert residency_owner(events[1]) == FIRST
            assert events[1].state_source == OWNER
            assert residency_owner(events[2]) == OWNER
            assert sum(event.residency_domain is C for event in events) == 2
            assert slot.sink.calls == 5, "each ingress chunk is published once rather than once per event"
            assert len(slot.owner_dump_events()) == 2
            assert slot.withdrawals == [1]

            await handle.shutdown()
    with pytest.raises(CoordinatorClosed, match="^state-agent ingress coordinator is closed$"):
        handle.admit_nowait(chunk(2, 1))
    with pytest.raises(CoordinatorClosed, match="^state-agent coordinator is closed$"):
        await handle.quarantine(2, "late")


# -- the Trio shell (3.2) ---------------------------------------------------------------------------


async def test_control_commands_win_over_queued_ingress() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    handle, run = open_coordinator(slot.core)
    handle.admit_nowait(chunk(1, 1, [store(W, None, 101, 11)]))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.quarantine, 1, "operator quarantine")
            await trio.testing.wait_all_tasks_blocked()
            await nursery.start(run)
            await handle.shutdown()
    # The quarantine closed ingress before the chunk was looked at: no id for it.
    assert slot.ids() == [1]
    assert slot.core.counters.quarantines == {"operator quarantine": 1}
    assert slot.core.counters.ingress_chunks == 1


async def test_ingress_errors_are_logged_and_the_loop_continues() -> None:
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            await handle.attach(attachment_for(FIRST))
            handle.admit_nowait(chunk(8, 1, [store(W, None, 1, 1)]))
            handle.admit_nowait(chunk(1, 1, [store(W, None, 2, 2)]))
            await slot.sink.wait_for_calls(2)
            with pytest.raises(CoordinatorError, match="^KV state agent already has an attachment$"):
                await handle.attach(attachment_for(REPLACEMENT))
            await handle.shutdown()
    assert slot.ids() == [1, 2]
    assert slot.core.counters.ingress_chunks == 2


async def test_many_chunks_are_processed_in_order_with_interleaved_control() -> None:
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            await handle.attach(attachment_for(FIRST))
            for cursor in range(1, 201):
                handle.admit_nowait(chunk(1, cursor, [store(W, None, cursor, cursor)]))
            await handle.begin_detach(1)
            # BeginDetach was handled before most of the backlog; CompleteDetach drains what is left.
            assert await handle.complete_detach(1) == slot.core.outbound_cursor
            await handle.shutdown()
    assert slot.ids() == sorted(slot.ids())
    assert slot.core.counters.ingress_chunks == 200


async def test_complete_detach_drains_the_queue_through_the_handle() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    slot.core.begin_detach(1)
    handle, run = open_coordinator(slot.core)
    handle.admit_nowait(chunk(1, 1, [store(W, None, 101, 11), store(C, None, 201, 21)]))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.complete_detach, 1)
            await trio.testing.wait_all_tasks_blocked()
            await nursery.start(run)
            await handle.shutdown()
    # CompleteDetach was handled first and drained the queued chunk: CacheOwner only.
    assert [(e.event_id, e.residency_domain) for e in slot.sink.events] == [(1, W), (2, C), (3, W)]


async def test_closed_control_channel_stops_the_loop_and_queued_commands_are_dropped() -> None:
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            handle.close()
    with pytest.raises(CoordinatorClosed):
        handle.admit_nowait(chunk(1, 1))

    other = Slot()
    handle, run = open_coordinator(other.core)
    outcomes: list[str] = []

    async def attach_and_record() -> None:
        try:
            await handle.attach(attachment_for(FIRST))
        except CoordinatorClosed as error:
            outcomes.append(str(error))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.shutdown)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(attach_and_record)
            await trio.testing.wait_all_tasks_blocked()
            await nursery.start(run)
    assert outcomes == ["state-agent attach was dropped"]
    assert other.sink.calls == 0


async def test_cancellation_stops_a_busy_loop() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    handle, run = open_coordinator(slot.core)
    for cursor in range(1, 1001):
        handle.admit_nowait(chunk(1, cursor, [store(W, None, cursor, cursor)]))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            nursery.cancel_scope.cancel()
    assert slot.core.counters.ingress_chunks < 1000
    await handle.shutdown()  # already gone: a no-op


def test_handle_type_is_exported() -> None:
    handle, _run = open_coordinator(Slot().core)
    assert isinstance(handle, CoordinatorHandle)
