"""The listener's reader over real ZMQ: the engine's connection watched through the SUB monitor, shedding."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing
import zmq

from kvagent.simulator.engine import FakeVllmEngine, block_stored
from kvagent.vllm.budget import IngestBudget
from kvagent.vllm.reader import Inbox, InboxItem, LinkItem, LiveItem, LiveReader, ReadPacing

GUARD = 10  # seconds: a hang guard only


class WatchedInbox(Inbox):
    """An inbox that remembers the most live bytes it ever held and wakes waiters on every item."""

    def __init__(self) -> None:
        super().__init__(reply_bytes_bound=1 << 20)
        self.most_live_bytes = 0
        self.changed = trio.Event()

    def put_live(self, frames: list[bytes], nbytes: int) -> None:
        super().put_live(frames, nbytes)
        self.most_live_bytes = max(self.most_live_bytes, self.live_bytes)
        self._notify()

    def put_link(self, connected: bool) -> None:
        super().put_link(connected)
        self._notify()

    def drop_live(self) -> int:
        freed = super().drop_live()
        self._notify()  # a shed
        return freed

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def take_all(self) -> list[InboxItem]:
        items = []
        while (item := self.pop()) is not None:
            items.append(item)
        return items

    async def next_link(self) -> LinkItem:
        while True:
            for item in self.take_all():
                if isinstance(item, LinkItem):
                    return item
            await self.changed.wait()


class Held:
    """Stands in for what SourceSync holds: bytes the reader must count and can have shed."""

    def __init__(self) -> None:
        self.bytes = 0
        self.shed_calls = 0

    def shed(self) -> int:
        self.shed_calls += 1
        freed, self.bytes = self.bytes, 0
        return freed


@asynccontextmanager
async def reading(
    engine: FakeVllmEngine,
    bound: int = 1 << 20,
    held: Held | None = None,
    shed_after: float = 0.0,
    coalesce_window: float = 0.0,
) -> AsyncIterator[tuple[LiveReader, WatchedInbox]]:
    inbox = WatchedInbox()
    held = held if held is not None else Held()
    reader = LiveReader(
        zmq.Context.instance(),
        endpoint=engine.endpoint,
        topic=engine.topic,
        rcvhwm=1000,
        inbox=inbox,
        # The listener's share is ``bound``: the total is twice it; the largest batch a quarter of it.
        budget=IngestBudget(total=2 * bound, max_payload_bytes=bound // 2),
        held_bytes=lambda: held.bytes,
        shed_held=held.shed,
        shed_after=shed_after,
        coalesce_window=coalesce_window,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.run)
        yield reader, inbox
        nursery.cancel_scope.cancel()


def store(n: int) -> list[dict[str, object]]:
    return [block_stored([n + 1], None, [n % 50_000] * 16, 16)]


async def test_a_killed_engine_is_reported_disconnected_and_its_revival_connected() -> None:
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine()
            await nursery.start(engine.run)
            async with reading(engine) as (reader, inbox):
                await engine.wait_for_subscriber()
                await engine.publish_batch(store(0))
                engine.kill()
                assert await inbox.next_link() == LinkItem(False)
                await engine.revive(restart=False)
                assert await inbox.next_link() == LinkItem(True)
                await engine.wait_for_subscriber()  # the SUB re-subscribed by itself
                await engine.publish_batch(store(1))
                assert (reader.engine_disconnects, reader.reconnects) == (1, 1)
            nursery.cancel_scope.cancel()


async def test_the_first_connection_is_not_a_reconnect() -> None:
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine()
            await nursery.start(engine.run)
            async with reading(engine) as (reader, inbox):
                await engine.wait_for_subscriber()
                await engine.publish_batch(store(0))
                while not inbox.live_bytes:
                    await inbox.changed.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert [type(item) for item in inbox.take_all()] == [LiveItem]
                assert (reader.engine_disconnects, reader.reconnects) == (0, 0)
            nursery.cancel_scope.cancel()


async def test_a_flood_is_shed_never_held_past_the_bound_and_reading_goes_on() -> None:
    payload_bytes = 4096
    bound = 16 * payload_bytes
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine()
            await nursery.start(engine.run)
            held = Held()
            held.bytes = 4 * payload_bytes  # SourceSync holds some batches: they count against the bound
            async with reading(engine, bound, held) as (reader, inbox):
                await engine.wait_for_subscriber()
                filler = b"x" * payload_bytes
                seq = 0
                while reader.ingest_sheds < 3:  # nobody takes from the inbox: only shedding keeps it bounded
                    await engine.wait_for_subscriber(1 + reader.ingest_sheds)  # each shed re-subscribes
                    await engine.publish_frames([engine.topic, seq.to_bytes(8, "big"), filler])
                    seq += 1
                    await trio.testing.wait_all_tasks_blocked()
                message_bytes = len(engine.topic) + 8 + payload_bytes
                assert inbox.most_live_bytes <= bound + message_bytes, "at most one message past the bound"
                assert held.shed_calls == reader.ingest_sheds and held.bytes == 0
                assert reader.ingest_shed_bytes >= 3 * (bound - 4 * payload_bytes)
                # The shed re-opened the SUB (a new subscription, no disconnect) and reading goes on.
                await engine.wait_for_subscriber(1 + reader.ingest_sheds)
                assert (reader.engine_disconnects, reader.reconnects) == (0, 0)
                sheds = reader.ingest_sheds
                inbox.take_all()
                await engine.publish_frames([engine.topic, seq.to_bytes(8, "big"), b"after"])
                while not inbox.live_bytes:
                    await inbox.changed.wait()
                assert reader.ingest_sheds == sheds
                assert [item.frames[2] for item in inbox.take_all() if isinstance(item, LiveItem)][-1] == b"after"
            nursery.cancel_scope.cancel()


async def test_a_re_open_while_the_engine_is_down_reports_its_return() -> None:
    payload_bytes = 4096
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine()
            await nursery.start(engine.run)
            held = Held()
            async with reading(engine, 8 * payload_bytes, held) as (reader, inbox):
                await engine.wait_for_subscriber()
                engine.kill()
                assert await inbox.next_link() == LinkItem(False)
                held.bytes = 9 * payload_bytes
                await engine.revive(restart=False)
                assert await inbox.next_link() == LinkItem(True)
                await engine.wait_for_subscriber()
                await engine.publish_frames([engine.topic, (0).to_bytes(8, "big"), b"x"])  # sheds at once
                while not reader.ingest_sheds:
                    await inbox.changed.wait()
                await engine.wait_for_subscriber(2)  # the re-opened SUB
                engine.kill()
                assert await inbox.next_link() == LinkItem(False), "the re-opened SUB's monitor watches on"
            nursery.cancel_scope.cancel()


async def test_over_the_bound_the_reader_pauses_and_resumes_without_loss_when_room_is_made() -> None:
    payload_bytes = 4096
    bound = 8 * payload_bytes
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine()
            await nursery.start(engine.run)
            async with reading(engine, bound, shed_after=GUARD) as (reader, inbox):
                await engine.wait_for_subscriber()
                for seq in range(20):  # more than the bound: the rest waits in libzmq's queue
                    await engine.publish_frames([engine.topic, seq.to_bytes(8, "big"), bytes(payload_bytes)])
                while not reader.pauses:
                    await inbox.changed.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert reader.ingest_sheds == 0
                message_bytes = len(engine.topic) + 8 + payload_bytes
                assert inbox.live_bytes <= bound + message_bytes
                seqs: list[int] = []
                while len(seqs) < 20:  # taking items makes room: reading resumes
                    item = inbox.pop()
                    if item is None:
                        await inbox.changed.wait()
                    elif isinstance(item, LiveItem):
                        seqs.append(int.from_bytes(item.frames[1], "big"))
                assert seqs == list(range(20)), "nothing was lost: a burst waits, it is not shed"
                assert reader.ingest_sheds == 0
            nursery.cancel_scope.cancel()


async def _live_count(inbox: WatchedInbox, count: int, taken: list[InboxItem]) -> None:
    while sum(isinstance(item, LiveItem) for item in taken) < count:
        taken += inbox.take_all()
        if sum(isinstance(item, LiveItem) for item in taken) < count:
            await inbox.changed.wait()


async def test_a_batch_after_quiet_is_read_at_once_and_followers_wait_out_the_window(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The coalesce window (virtual time here): the first batch is read at once, a batch that follows
    within the window stays in the SUB until the window is over, then everything queued is read together."""
    window = 5.0
    async with trio.open_nursery() as nursery:
        engine = FakeVllmEngine()
        await nursery.start(engine.run)
        async with reading(engine, coalesce_window=window) as (reader, inbox):
            await engine.wait_for_subscriber()
            taken: list[InboxItem] = []
            await engine.publish_batch(store(0))
            await _live_count(inbox, 1, taken)  # no clock movement needed: read at once
            await trio.testing.wait_all_tasks_blocked()
            assert reader.pacing.waits == 1  # ...and the reader now waits out the window
            for n in (1, 2, 3):
                await engine.publish_batch(store(n))
            subscription = reader._subscription
            assert subscription is not None
            # libzmq has the followers (a real observable, bounded by a real-time poll)...
            assert subscription.sub.socket.poll(GUARD * 1000, zmq.POLLIN) == zmq.POLLIN
            await trio.testing.wait_all_tasks_blocked()
            taken += inbox.take_all()
            assert sum(isinstance(item, LiveItem) for item in taken) == 1  # ...but they were not read yet
            # Read once the window is over. libzmq's I/O thread may not have queued every follower by then
            # (a loaded machine): the reader takes what is there and waits out one more window for the rest.
            for _window in range(3):
                mock_clock.jump(window)
                await trio.testing.wait_all_tasks_blocked()
                taken += inbox.take_all()
                if sum(isinstance(item, LiveItem) for item in taken) == 4:
                    break
                assert subscription.sub.socket.poll(GUARD * 1000, zmq.POLLIN) == zmq.POLLIN
            assert reader.messages == 4
            assert 2 <= reader.pacing.waits <= 4
            seqs = [int.from_bytes(item.frames[1], "big") for item in taken if isinstance(item, LiveItem)]
            assert seqs == sorted(seqs)
        nursery.cancel_scope.cancel()


async def test_without_a_window_the_reader_never_waits_between_batches() -> None:
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine()
            await nursery.start(engine.run)
            async with reading(engine) as (reader, inbox):
                await engine.wait_for_subscriber()
                taken: list[InboxItem] = []
                for n in range(5):
                    await engine.publish_batch(store(n))
                await _live_count(inbox, 5, taken)
                assert reader.pacing.waits == 0
            nursery.cancel_scope.cancel()


class RecordingPacing(ReadPacing):
    """The reader's own pacing, remembering each wait it chose."""

    def __init__(self, window: float) -> None:
        super().__init__(window)
        self.chosen: list[float] = []

    def wait_after(self, round_messages: int, messages: int, queue: int, now: float | None = None) -> float:
        wait = super().wait_after(round_messages, messages, queue, now)
        self.chosen.append(wait)
        return wait


async def test_the_coalesce_window_never_paces_a_burst_and_returns_after_it(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A burst that fills libzmq's queue while the reader waits is read on without waiting out the window
    again (the old reader waited a window per queue: a burst paced at one queue per window). Whatever the
    queue held when the window ended (half of it at least: libzmq's writer stops there), the rate it shows
    makes every later wait shorter than the window, or none at all. A lone batch
    after a quiet spell waits the whole window again. Virtual time: it moves by the test's jumps, or when
    every task has been blocked for 2 real seconds (the reader's waits, and a hang guard)."""
    window = 5.0
    mock_clock.autojump_threshold = 2.0
    with trio.fail_after(1000 * window):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine()
            await nursery.start(engine.run)
            async with reading(engine, coalesce_window=window) as (reader, inbox):
                pacing = reader.pacing = RecordingPacing(window)
                await engine.wait_for_subscriber()
                taken: list[InboxItem] = []
                await engine.publish_batch(store(0))
                await _live_count(inbox, 1, taken)
                await trio.testing.wait_all_tasks_blocked()
                assert pacing.chosen == [window]  # a lone batch, then the window
                burst = 4 * reader._current_rcvhwm  # four queues' worth, sent while the reader waits
                for n in range(1, burst + 1):
                    await engine.publish_batch(store(n))
                await _live_count(inbox, burst + 1, taken)
                during_burst = pacing.chosen[1:]
                assert all(wait < window for wait in during_burst), f"paced by the window: {during_burst}"
                mock_clock.jump(100 * window)  # quiet
                await engine.publish_batch(store(burst + 1))
                await _live_count(inbox, burst + 2, taken)
                await trio.testing.wait_all_tasks_blocked()
                assert pacing.chosen[-1] == window  # a steady stream is coalesced again
                seqs = [int.from_bytes(item.frames[1], "big") for item in taken if isinstance(item, LiveItem)]
                assert seqs == sorted(seqs) and len(seqs) == burst + 2
            nursery.cancel_scope.cancel()


def test_pacing_waits_the_window_below_half_a_queue_per_window_and_less_above() -> None:
    pacing = ReadPacing(0.02)
    assert pacing.wait_after(1, 1, queue=32, now=0.0) == 0.02  # no rate known yet: the window
    # 40 messages in the next 20 ms (2,000 a second): half a queue takes 8 ms, so the wait is 8 ms.
    assert pacing.wait_after(20, 41, queue=32, now=0.02) == 32 / (2 * 2000)
    assert pacing.wait_after(24, 65, queue=32, now=0.025) == 0.0  # 3/4 of a queue since the wait: read on
    assert pacing.wait_after(23, 88, queue=32, now=0.03) == 32 / (2 * 2000)  # less: the rate decides
    assert pacing.full_rounds == 1
    assert pacing.wait_after(1, 89, queue=32, now=10.0) == 0.02  # quiet for seconds: the window again
    assert ReadPacing(0.0).wait_after(1, 1, queue=32, now=0.0) == 0.0  # no window, no wait
    # 250 a second (the paced 2k-events/s stream): 5 per window, far below half a queue: the whole window.
    steady = ReadPacing(0.02)
    for step in range(10):
        wait = steady.wait_after(5, 5 * (step + 1), queue=32, now=0.02 * step)
    assert wait == 0.02 and steady.waits == 10
