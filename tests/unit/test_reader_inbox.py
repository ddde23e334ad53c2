"""The vLLM reader's inbox (kvagent/vllm/reader.py ``Inbox``): its three waits, in memory (no sockets)."""

from __future__ import annotations

import trio
import trio.testing

from kvagent.vllm.reader import Inbox, LinkItem, LiveItem, ReplyItem
from kvagent.vllm.replay import ReplayReply


async def test_wait_returns_at_once_with_an_item_queued_and_otherwise_sleeps_until_a_put_or_a_wake() -> None:
    inbox = Inbox(reply_bytes_bound=100)
    inbox.wake()  # a wake before the wait is not remembered: only an item is
    woken: list[str] = []

    async def waiter(name: str) -> None:
        await inbox.wait()
        woken.append(name)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, "put")
            await trio.testing.wait_all_tasks_blocked()
            assert woken == []
            inbox.put_link(True)
        assert woken == ["put"]
        await inbox.wait()  # an item is queued: at once
        assert inbox.pop() == LinkItem(True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, "wake")
            await trio.testing.wait_all_tasks_blocked()
            assert woken == ["put"]
            inbox.wake()
        assert woken == ["put", "wake"]


async def test_a_replay_waits_for_room_until_the_replies_in_flight_are_within_their_bound() -> None:
    inbox = Inbox(reply_bytes_bound=100)
    for seq in range(3):
        inbox.on_reply(1, ReplayReply(seq, b"", b"x" * 60))  # 180 bytes in flight
    done = trio.Event()

    async def replay() -> None:
        await inbox.wait_for_room()
        done.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(replay)
            await trio.testing.wait_all_tasks_blocked()
            assert type(inbox.pop()) is ReplyItem  # 120: still over
            await trio.testing.wait_all_tasks_blocked()
            assert not done.is_set()
            assert type(inbox.pop()) is ReplyItem  # 60: within
        assert done.is_set() and inbox.reply_bytes == 60
        await inbox.wait_for_room()  # within already: at once


async def test_the_reader_waiting_for_space_wakes_at_the_next_pop_or_space_freed() -> None:
    inbox = Inbox(reply_bytes_bound=100)
    inbox.put_live([b"abc"], 3)
    inbox.space_freed()  # before the wait: not remembered
    woken = 0

    async def reader() -> None:
        nonlocal woken
        await inbox.wait_for_space()
        woken += 1

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert woken == 0
            assert inbox.pop() == LiveItem([b"abc"], 3)
        assert woken == 1 and inbox.live_bytes == 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert woken == 1
            inbox.space_freed()
        assert woken == 2
