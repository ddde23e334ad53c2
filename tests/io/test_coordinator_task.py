"""The coordinator's Trio shell: admission, control priority, the loop (docs/spec/agent-semantics.md 3.2, 9.3, 9.4)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import structlog.testing
import trio
import trio.testing

from kvagent._util.sync import ControlFirstInbox
from kvagent.coordinator.task import (
    CONTROL_CAPACITY,
    CoordinatorHandle,
    IngressItem,
    admit_ingress,
    open_coordinator,
)
from kvagent.model.errors import CoordinatorClosed, CoordinatorError
from kvagent.model.events import (
    Cleared,
    IngressChunk,
    PlacementEvent,
    SourceSignal,
    SourceState,
    residency_owner,
)
from tests.support.coordinator import FIRST, REPLACEMENT, Slot, chunk, store
from tests.support.ids import OWNER, C, W, attachment_for

# -- 9.3 ------------------------------------------------------------------------------------------


def test_listener_admission_does_not_wait_for_coordinator_progress() -> None:
    inbox = ControlFirstInbox[Any, IngressItem](CONTROL_CAPACITY)
    for cursor in range(1, 1025):
        admit_ingress(inbox, chunk(7, cursor))
    assert inbox.take_items_nowait(1) == [chunk(7, 1)]
    assert inbox.items_queued == 1023
    inbox.close()
    with pytest.raises(CoordinatorClosed, match="^state-agent ingress coordinator is closed$"):
        admit_ingress(inbox, chunk(7, 1025))


def test_handle_admission_does_not_wait_for_a_coordinator_that_is_not_running() -> None:
    slot = Slot()
    handle, _run = open_coordinator(slot.core)
    for cursor in range(1, 1025):
        handle.admit_nowait(chunk(7, cursor))
    assert handle.ingress_backlog == 1024
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


async def attach_and_record(handle: CoordinatorHandle, outcomes: list[str]) -> None:
    """Attach FIRST; if the coordinator refuses, record why in ``outcomes``."""
    try:
        await handle.attach(attachment_for(FIRST))
    except CoordinatorClosed as error:
        outcomes.append(str(error))


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

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.shutdown)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(attach_and_record, handle, outcomes)
            await trio.testing.wait_all_tasks_blocked()
            await nursery.start(run)
    assert outcomes == ["state-agent attach was dropped"]
    assert other.sink.calls == 0


async def test_a_stop_drops_queued_commands_refuses_callers_waiting_for_room_and_lets_go_of_ingress() -> None:
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    handle.admit_nowait(chunk(1, 1, [store(W, None, 101, 11)]))
    outcomes: list[str] = []

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.shutdown)  # first in the queue: the task stops there
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(CONTROL_CAPACITY):  # the rest of the queue, then one caller waiting for room
                nursery.start_soon(attach_and_record, handle, outcomes)
                await trio.testing.wait_all_tasks_blocked()
            assert outcomes == [] and handle.ingress_backlog == 1
            await nursery.start(run)
    assert outcomes.count("state-agent attach was dropped") == CONTROL_CAPACITY - 1
    assert outcomes.count("state-agent coordinator is closed") == 1  # refused while it waited for room
    assert handle.ingress_backlog == 0 and handle.ingress_bytes == 0
    assert slot.sink.calls == 0


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


# -- source signals and the ingress byte meter (issue #14) -------------------------------------------


def sized(generation: int, cursor: int, events: list[PlacementEvent], raw_bytes: int) -> IngressChunk:
    return attrs.evolve(chunk(generation, cursor, events), raw_bytes=raw_bytes)


async def test_signals_are_handled_in_order_with_the_chunks_around_them() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    handle, run = open_coordinator(slot.core)
    handle.admit_nowait(sized(1, 1, [store(W, None, 1, 1)], 10))
    handle.admit_nowait(sized(1, 2, [store(W, 1, 2, 2)], 10))
    handle.admit_nowait(SourceSignal(1, state=SourceState.DEGRADED, reset=True, lost_batches=897))
    handle.admit_nowait(sized(1, 900, [store(W, None, 9, 9)], 10))
    handle.admit_nowait(SourceSignal(1, quarantine=True, reason="malformed frame"))
    handle.admit_nowait(sized(1, 901, [store(W, 9, 10, 10)], 10))
    assert handle.ingress_bytes == 40 and handle.ingress_backlog == 6
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            await handle.wait_ingress_bytes_at_most(0)
            await handle.shutdown()
    kinds = [
        (e.event_id, "clear" if isinstance(e.data, Cleared) else e.data.block_hashes)
        for e in slot.sink.events
    ]
    assert kinds == [(1, "clear"), (2, (1,)), (3, (2,)), (4, "clear"), (5, (9,))]
    assert {block for (_owner, _tier, block) in slot.index.resident_blocks()} == {9}
    status = slot.current()
    assert status.attachment is not None and status.attachment.state == "unready"
    counters = slot.core.counters
    assert counters.quarantines == {"malformed frame": 1} and counters.source_losses == 897
    assert counters.ingress_chunks == 4  # the chunk after the quarantine found ingress closed
    assert slot.withdrawals == [1, 1]  # leaving ready, then the quarantine


async def test_ingress_bytes_wait_is_woken_by_the_coordinator() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    handle, run = open_coordinator(slot.core)
    for cursor, nbytes in ((1, 100), (2, 200), (3, 300)):
        handle.admit_nowait(sized(1, cursor, [store(W, None, cursor, cursor)], nbytes))
    handle.admit_nowait(SourceSignal(1, state=SourceState.DISCONNECTED))  # a signal carries no bytes
    assert handle.ingress_bytes == 600 and handle.statistics().ingress_bytes == 600
    released: list[int] = []

    async def wait_below(limit: int) -> None:
        await handle.wait_ingress_bytes_at_most(limit)
        released.append(handle.ingress_bytes)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await handle.wait_ingress_bytes_at_most(600)  # already true: returns at once
            nursery.start_soon(wait_below, 250)
            nursery.start_soon(wait_below, 0)
            await trio.testing.wait_all_tasks_blocked()
            assert released == []
            await nursery.start(run)
            await handle.wait_ingress_bytes_at_most(0)
            await trio.testing.wait_all_tasks_blocked()
            await handle.shutdown()
    # One drain handles all three chunks before either waiter runs again.
    assert released == [0, 0]
    assert handle.ingress_bytes == 0 and slot.core.counters.disconnects == 1


async def test_complete_detach_and_a_stopped_coordinator_release_queued_bytes() -> None:
    slot = Slot()
    slot.core.attach(attachment_for(FIRST))
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            await handle.begin_detach(1)
            handle.admit_nowait(sized(1, 1, [store(C, None, 5, 5)], 1000))
            handle.admit_nowait(SourceSignal(1, lost_batches=2))
            await handle.complete_detach(1)
            assert handle.ingress_bytes == 0
            assert (slot.core.counters.signals_ignored, slot.core.counters.source_losses) == (1, 2)
            await handle.attach(attachment_for(FIRST))
            await handle.shutdown()

    stopped = Slot()
    stopped.core.attach(attachment_for(FIRST))
    handle, run = open_coordinator(stopped.core)
    handle.admit_nowait(sized(1, 1, [store(W, None, 1, 1)], 500))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.wait_ingress_bytes_at_most, 0)
            await trio.testing.wait_all_tasks_blocked()
            handle.close()  # the task stops before it takes the chunk: its bytes are released, not handled
            await nursery.start(run)
    assert handle.ingress_bytes == 0 and stopped.core.counters.ingress_chunks == 0


def test_status_cell_signals_attachment_changes_but_not_cursor_advances() -> None:
    slot = Slot()
    changes = slot.status.attachment_changed
    seen = changes.version
    generation = slot.core.attach(attachment_for(FIRST)).generation
    assert changes.version > seen
    seen = changes.version
    slot.core.handle_ingress(chunk(generation, 1, [store(W, None, 5, 5)]))
    slot.core.handle_ingress(chunk(generation, 2, [store(W, 5, 6, 6)]))
    assert slot.current().outbound_cursor == 3 and changes.version == seen
    slot.core.handle_signal(SourceSignal(generation, state=SourceState.DISCONNECTED))
    assert changes.version > seen


def test_handle_type_is_exported() -> None:
    handle, _run = open_coordinator(Slot().core)
    assert isinstance(handle, CoordinatorHandle)


# -- cancellation and late ingress (issue #28) --------------------------------------------------------


async def test_a_command_whose_caller_left_before_it_ran_is_never_executed() -> None:
    """The caller of ``attach`` is cancelled while the command waits in the queue: nothing attaches
    (it used to attach all the same, with nobody left to start the listener)."""
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            caller = trio.CancelScope()

            async def attach_then_leave() -> None:
                with caller:
                    await handle.attach(attachment_for(FIRST))

            nursery.start_soon(attach_then_leave)
            await trio.testing.wait_all_tasks_blocked()  # queued, the task not yet running
            caller.cancel()
            await trio.testing.wait_all_tasks_blocked()
            await nursery.start(run)
            await handle.shutdown()
    assert caller.cancelled_caught
    assert slot.current().attachment is None
    assert slot.sink.calls == 0  # not even the reset barrier


async def test_a_command_executed_before_its_caller_is_cancelled_still_answers() -> None:
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            with trio.CancelScope() as caller:
                attached = await handle.attach(attachment_for(FIRST))
                caller.cancel()  # after the reply: the attach stands and its answer was delivered
            assert attached.generation == 1
            assert slot.current().is_open_generation(1)
            await handle.shutdown()


async def test_late_ingress_of_a_closed_generation_is_not_an_error() -> None:
    """Chunks admitted before a quarantine (the shutdown's, say) are handled after it: expected, logged at
    debug level; a chunk of a generation that was never attached is still an error."""
    slot = Slot()
    handle, run = open_coordinator(slot.core)
    with trio.fail_after(5), structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            await handle.attach(attachment_for(FIRST))
            handle.admit_nowait(chunk(1, 1, [store(W, None, 1, 1)]))
            handle.admit_nowait(chunk(9, 1, [store(W, None, 2, 2)]))  # never attached: a bug upstream
            # Commands win over queued ingress: the chunks are looked at after generation 1 closed.
            await handle.quarantine(1, "state-agent shutdown")
            while handle.ingress_backlog:
                await handle.wait_progress()
            await handle.shutdown()
    levels = [(entry["event"], entry["log_level"]) for entry in logs if "ingress" in entry["event"]]
    assert ("late_ingress_discarded", "debug") in levels
    assert [event for event, level in levels if level == "error"] == ["ingress_failed"]
    assert slot.core.counters.ingress_chunks == 2
