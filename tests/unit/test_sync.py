"""The sync toolkit (kvagent/_util/sync.py): Changed, Request and ControlFirstInbox, in memory (no sockets)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from kvagent._util.sync import (
    Changed,
    ControlFirstInbox,
    Request,
    checkpoint,
    checkpoint_if_cancelled,
    shielded_checkpoint,
)

# -- Changed -----------------------------------------------------------------------------------------


async def test_a_change_between_looking_and_waiting_is_not_lost() -> None:
    changed = Changed()
    since = changed.version  # look...
    changed.notify()  # ...a change happens before the wait...
    with trio.fail_after(1):
        await changed.wait(since)  # ...and the wait returns at once


async def test_every_waiter_wakes_at_a_notify() -> None:
    changed = Changed()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await changed.wait(0)
        woken.append(n)

    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(waiter, n)
            await trio.testing.wait_all_tasks_blocked()
            assert woken == []
            changed.notify()
        assert sorted(woken) == [0, 1, 2]


async def test_wait_for_looks_again_after_each_change() -> None:
    changed = Changed()
    value = [0]
    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:

            async def bump() -> None:
                for _ in range(3):
                    await trio.testing.wait_all_tasks_blocked()
                    value[0] += 1
                    changed.notify()

            nursery.start_soon(bump)
            await changed.wait_for(lambda: value[0] == 3)
        assert value[0] == 3


async def test_a_version_never_reached_is_an_error() -> None:
    with pytest.raises(ValueError, match="never reached"):
        await Changed().wait(5)


# -- Request -----------------------------------------------------------------------------------------


async def test_a_reply_reaches_the_asker_and_later_replies_are_ignored() -> None:
    request: Request[int] = Request()
    request.reply(7)
    request.reply(8)
    request.fail(RuntimeError("late"))
    assert await request.wait() == 7 and request.replied() and not request.abandoned()


async def test_a_failure_is_raised_to_the_asker() -> None:
    request: Request[int] = Request()
    request.fail(KeyError("gone"))
    with pytest.raises(KeyError, match="gone"):
        await request.wait()


async def test_an_asker_cancelled_before_the_reply_abandons_the_request() -> None:
    request: Request[int] = Request()
    with trio.move_on_after(0.01):
        await request.wait()
    assert request.abandoned()
    request.reply(1)  # the serving task may still answer; nobody hears it


async def test_an_asker_cancelled_after_the_reply_has_not_abandoned_it() -> None:
    request: Request[int] = Request()
    request.reply(1)
    with trio.CancelScope() as scope:
        scope.cancel()
        await request.wait()  # the reply is there, but the wait checkpoints and is cancelled
    assert scope.cancelled_caught and not request.abandoned()


# -- ControlFirstInbox -------------------------------------------------------------------------------


async def test_control_requests_are_taken_before_items() -> None:
    inbox: ControlFirstInbox[str, int] = ControlFirstInbox(2)
    for item in range(5):
        inbox.put_nowait(item)
    inbox.send_control_nowait("attach")
    assert await inbox.receive(3) == "attach"
    assert await inbox.receive(3) == [0, 1, 2]
    inbox.send_control_nowait("detach")
    assert await inbox.receive(3) == "detach"
    assert await inbox.receive(3) == [3, 4]
    assert inbox.receive_nowait() is None


async def test_the_receiver_sleeps_until_something_arrives() -> None:
    inbox: ControlFirstInbox[str, int] = ControlFirstInbox(1)
    got: list[object] = []
    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                got.append(await inbox.receive(8))

            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            inbox.put_nowait(1)
            inbox.put_nowait(2)  # before the receiver runs: taken in the same receive
    assert got == [[1, 2]]


async def test_wait_returns_once_something_is_queued_or_the_inbox_closes() -> None:
    inbox: ControlFirstInbox[str, int] = ControlFirstInbox(1)
    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inbox.wait)
            await trio.testing.wait_all_tasks_blocked()
            inbox.put_nowait(1)
        assert inbox.items_queued == 1  # nothing was taken
        assert inbox.take_items_nowait() == [1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inbox.wait)
            await trio.testing.wait_all_tasks_blocked()
            inbox.close()


async def test_a_full_control_queue_makes_senders_wait_and_a_cancelled_sender_queues_nothing() -> None:
    inbox: ControlFirstInbox[str, int] = ControlFirstInbox(1)
    await inbox.send_control("first")
    with pytest.raises(trio.WouldBlock):
        inbox.send_control_nowait("second")
    with trio.move_on_after(0.01) as gave_up:
        await inbox.send_control("never")
    assert gave_up.cancelled_caught
    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inbox.send_control, "second")
            await trio.testing.wait_all_tasks_blocked()
            assert inbox.statistics().control_queued == 1
            assert await inbox.receive() == "first"  # room: the waiting sender gets in
    assert await inbox.receive() == "second"
    assert inbox.receive_nowait() is None


async def test_a_cancelled_send_before_queueing_queues_nothing() -> None:
    inbox: ControlFirstInbox[str, int] = ControlFirstInbox(4)
    with trio.CancelScope() as scope:
        scope.cancel()
        await inbox.send_control("never")
    assert inbox.statistics().control_queued == 0


async def test_close_refuses_sends_and_ends_the_receiver_once_drained() -> None:
    inbox: ControlFirstInbox[str, int] = ControlFirstInbox(2)
    inbox.put_nowait(1)
    inbox.send_control_nowait("queued")
    inbox.close()
    with pytest.raises(trio.ClosedResourceError):
        inbox.put_nowait(2)
    with pytest.raises(trio.ClosedResourceError):
        await inbox.send_control("late")
    assert inbox.take_control_nowait() == "queued"  # the owner refuses what was queued
    assert await inbox.receive(4) == [1]
    with pytest.raises(trio.EndOfChannel):
        await inbox.receive()
    assert inbox.statistics().closed


async def test_close_wakes_a_sleeping_receiver_and_refuses_waiting_senders() -> None:
    inbox: ControlFirstInbox[str, int] = ControlFirstInbox(1)
    inbox.send_control_nowait("full")
    assert await inbox.receive() == "full"
    inbox.send_control_nowait("full again")
    outcomes: list[str] = []
    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await inbox.send_control("refused")
                outcomes.append("refused")

            nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            inbox.close()
    assert outcomes == ["refused"]


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("control"), st.integers()),
            st.tuples(st.just("item"), st.integers()),
            st.tuples(st.just("take"), st.integers(min_value=1, max_value=4)),
        )
    )
)
def test_the_inbox_is_two_fifo_queues_with_control_first(operations: list[tuple[str, int]]) -> None:
    inbox: ControlFirstInbox[int, int] = ControlFirstInbox(3)
    control: list[int] = []
    items: list[int] = []
    for kind, value in operations:
        if kind == "control":
            if len(control) < 3:
                inbox.send_control_nowait(value)
                control.append(value)
            else:
                with pytest.raises(trio.WouldBlock):
                    inbox.send_control_nowait(value)
        elif kind == "item":
            inbox.put_nowait(value)
            items.append(value)
        else:
            taken = inbox.receive_nowait(value)
            if control:
                assert taken == control.pop(0)
            elif items:
                assert taken == items[:value]
                del items[:value]
            else:
                assert taken is None
        assert inbox.statistics().control_queued == len(control)
        assert inbox.items_queued == len(items)


# -- checkpoints -------------------------------------------------------------------------------------


async def test_checkpoint_can_be_cancelled_and_the_shielded_one_cannot() -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await shielded_checkpoint()
        reached = True
        await checkpoint()
        reached_after = True  # pragma: no cover - the checkpoint raised Cancelled
    assert reached and scope.cancelled_caught
    assert "reached_after" not in locals()


async def test_checkpoint_if_cancelled_raises_only_when_cancelled_and_otherwise_does_not_yield() -> None:
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await checkpoint_if_cancelled()  # not cancelled: no yield, so the other task has not run yet
        assert ran == []
    assert ran == ["other"]
    with trio.CancelScope() as scope:
        scope.cancel()
        await checkpoint_if_cancelled()
        reached_after = True  # pragma: no cover - it raised Cancelled
    assert scope.cancelled_caught
    assert "reached_after" not in locals()
