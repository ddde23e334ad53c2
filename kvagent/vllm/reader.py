"""The listener's receiving side: the byte-counted inbox, and the reader task that owns the SUB socket.

The reader drains the SUB until ``zmq.Again`` (in slices of about a millisecond, so other tasks get their
turn during a flood) into the :class:`Inbox`, which also carries the replay client's replies and the
engine connection's ups and downs. Everything it holds is counted in payload bytes. When the bytes the
listener holds — the inbox, the live batches ``SourceSync`` holds back, the batches the processor has
taken but not yet admitted — pass the listener's share of the :class:`~kvagent.vllm.budget.IngestBudget`,
the reader **sheds**: it drops the queued live batches, tells ``SourceSync`` to drop the
ones it holds, and closes and re-opens the SUB, which also discards libzmq's queue (and the engine's send
queue for it), so a listener that cannot keep up reads fresh batches again instead of ever older ones.
The loss becomes a gap like any other, repaired from the replay socket or reported. Memory never grows.
With ``shed_after`` > 0 the reader first stops reading for up to that long (a burst then waits in libzmq's
queue and in the engine's send HWM) and sheds only if the processor has not made room by then.

libzmq's queue is bounded in messages (RCVHWM). Each SUB is opened with an RCVHWM fitted to the largest
message seen so far (:meth:`IngestBudget.rcvhwm`); it is never changed on a connected
socket: libzmq (4.3) applies a changed RCVHWM to the live pipe, whose writer then waits for a read report
at a multiple of the new low-water mark that the reader may already have passed, and the subscription is
wedged for good (every later batch dropped at the engine's PUB, and nothing arriving to show a gap:
issue #28). A re-fit takes effect at the next re-open (a shed).

A shed (and its re-open) loses batches the gate never sees: those in flight between the old SUB and the new
one. ``shed_held`` tells ``SourceSync``, which shows the source not ready until a batch received after the
shed has been applied in order, so a loss at the very end of a flood is never ready-while-wrong.

The SUB's monitor socket (``get_monitor_socket``) tells when the engine's connection drops
(``EVENT_DISCONNECTED``) and comes back (``EVENT_HANDSHAKE_SUCCEEDED``). A small task owns the monitor
socket and forwards these as :class:`LinkItem` s, in order with the data. The listener's own re-open after
shedding is not an engine reconnect: only a handshake after a reported disconnect is one.

The monitor also tells a dead endpoint: when no handshake ever succeeds within ``connect_warning_after``
seconds, nothing answers at the endpoint, and the reader logs ONE warning naming it and the usual cause (vLLM
binds its event PUB only for ``tcp://*:PORT``, ``::`` or ipc addresses and otherwise *connects* it, so two
connecting sockets never meet). ``last_live_at`` is when the SUB last received a live message (the slot's
staleness gauge and silence warning read it).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import structlog
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvagent._util.sync import Changed, checkpoint
from kvagent._util.zmqtrio import TrioSocket
from kvagent.coordinator.task import SLICE_SECONDS  # one slice length for every task on the loop
from kvagent.model.errors import ListenerError
from kvagent.vllm.budget import IngestBudget
from kvagent.vllm.connect_hint import diagnose_unreachable
from kvagent.vllm.replay import ReplayReply

__all__ = [
    "SLICE_SECONDS",
    "Inbox",
    "InboxItem",
    "LinkItem",
    "LiveItem",
    "LiveReader",
    "ReadPacing",
    "ReplayEndItem",
    "ReplyItem",
]

log = structlog.get_logger(__name__)

_CHECK_CLOCK_EVERY = 16  # messages between clock reads while draining
_NOBLOCK, _RCVMORE = int(zmq.NOBLOCK), int(zmq.RCVMORE)
_MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_monitor_ids = itertools.count()


class _Drained(enum.Enum):
    AGAIN = "again"  # libzmq's queue is empty
    SLICE_OVER = "slice over"
    FULL = "full"  # the listener holds more than its bound


class LiveItem(NamedTuple):
    frames: list[bytes]
    nbytes: int


class ReplyItem(NamedTuple):
    request: int
    reply: ReplayReply


class ReplayEndItem(NamedTuple):
    request: int
    complete: bool
    reason: str


class LinkItem(NamedTuple):
    connected: bool  # False: the engine's connection dropped; True: it is back


InboxItem = LiveItem | ReplyItem | ReplayEndItem | LinkItem


class Inbox:
    """What the processor has yet to take, in arrival order, with its payload bytes counted.

    Replies in flight are bounded separately (``reply_bytes_bound``): the replay client waits for room.
    """

    def __init__(self, reply_bytes_bound: int) -> None:
        self._items: collections.deque[InboxItem] = collections.deque()
        self.live_bytes = 0
        self.reply_bytes = 0
        self.reply_bytes_bound = reply_bytes_bound
        self._arrived = Changed()  # an item was put, or wake() was called
        self._room = Changed()  # a reply was taken and the replies in flight are within their bound
        self._space = Changed()  # an item was taken, or space_freed() was called

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self.live_bytes + self.reply_bytes

    def put_live(self, frames: list[bytes], nbytes: int) -> None:
        self._items.append(LiveItem(frames, nbytes))
        self.live_bytes += nbytes
        self._arrived.notify()

    def put_link(self, connected: bool) -> None:
        self._items.append(LinkItem(connected))
        self._arrived.notify()

    # ReplaySink
    def on_reply(self, request: int, reply: ReplayReply) -> None:
        self._items.append(ReplyItem(request, reply))
        self.reply_bytes += len(reply.payload)
        self._arrived.notify()

    def on_end(self, request: int, complete: bool, reason: str) -> None:
        self._items.append(ReplayEndItem(request, complete, reason))
        self._arrived.notify()

    async def wait_for_room(self) -> None:
        await self._room.wait_for(lambda: self.reply_bytes <= self.reply_bytes_bound)

    async def wait_for_space(self) -> None:
        """Return at the next :meth:`pop` or :meth:`space_freed` (the reader then checks its bound again)."""
        await self._space.wait(self._space.version)

    def space_freed(self) -> None:
        """Something the reader counts against its bound went down (an item taken, held batches applied)."""
        self._space.notify()

    def pop(self) -> InboxItem | None:
        if not self._items:
            return None
        self.space_freed()
        item = self._items.popleft()
        if type(item) is LiveItem:
            self.live_bytes -= item.nbytes
        elif type(item) is ReplyItem:
            self.reply_bytes -= len(item.reply.payload)
            if self.reply_bytes <= self.reply_bytes_bound:
                self._room.notify()
        return item

    async def wait(self) -> None:
        """Return once an item is queued (or :meth:`wake` was called)."""
        if self._items:
            return
        await self._arrived.wait(self._arrived.version)

    def wake(self) -> None:
        self._arrived.notify()

    def drop_live(self) -> int:
        """Drop every queued live batch (keeping replies and link changes, in order); returns the bytes freed."""
        freed = self.live_bytes
        self._items = collections.deque(item for item in self._items if type(item) is not LiveItem)
        self.live_bytes = 0
        return freed


class _Subscription:
    """One SUB socket connected and subscribed, with its monitor PAIR socket."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, topic: bytes, rcvhwm: int) -> None:
        sub = context.socket(zmq.SUB)
        self.sub = TrioSocket(sub)
        self.monitor: TrioSocket | None = None
        try:
            sub.setsockopt(zmq.RCVHWM, rcvhwm)
            sub.setsockopt(zmq.LINGER, 0)
            # A unique address: the default one is derived from the FD number, which a re-opened socket
            # may reuse while the old monitor is still bound.
            monitor = sub.get_monitor_socket(
                _MONITOR_EVENTS, f"inproc://kvagent-sub-monitor-{next(_monitor_ids)}"
            )
            monitor.setsockopt(zmq.LINGER, 0)
            self.monitor = TrioSocket(monitor)
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, topic)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sub.socket.disable_monitor()
            self.monitor.close()
        self.sub.close()


class ReadPacing:
    """How long the reader waits after a drain that received batches and emptied the SUB (sans-IO).

    Under a steady stream the reader, processor and coordinator should wake once per ``window`` with several
    batches instead of once per batch (docs/performance.md: paced CPU). A wait must never pace the engine,
    though: libzmq's queue holds ``queue`` (the RCVHWM) messages and the rest waits in the engine's send
    queue, so a reader that always waited the window would read at most one queue per window, whatever the
    engine sends (a default ``kvagent serve`` burst was paced to 65k events/s at 47% of a core). So:

    - a round (what was read since the last wait) of three quarters of the queue or more means the queue
      filled while the reader waited (libzmq's writer learns of reads only every half queue, so a full
      queue holds between half and all of it): no wait, read on;
    - otherwise the wait is the window, or the time the stream takes to fill half the queue at the rate
      measured over the last period of at least one window, whichever is shorter.

    A batch after a quiet spell is read at once (the reader waits for the socket, not here), and a burst
    waits at most one window, at its start.
    """

    __slots__ = ("_period_first_message", "_period_start", "_rate", "full_rounds", "waits", "waited_seconds", "window")

    def __init__(self, window: float) -> None:
        self.window = window
        self.waits = 0  # waits chosen
        self.full_rounds = 0  # rounds that found the queue (about) full, read on without a wait
        self.waited_seconds = 0.0  # their sum (chosen, not measured)
        self._rate = 0.0  # messages per second over the last whole period
        self._period_start: float | None = None
        self._period_first_message = 0

    def wait_after(self, round_messages: int, messages: int, queue: int, now: float | None = None) -> float:
        """The wait after a drain that emptied the SUB: ``round_messages`` read since the last wait,
        ``messages`` read in all, a ``queue`` of that many messages; ``now`` defaults to Trio's clock."""
        window = self.window
        if window <= 0:
            return 0.0
        now = trio.current_time() if now is None else now
        if self._period_start is None:
            self._period_start, self._period_first_message = now, messages
        elif (elapsed := now - self._period_start) >= window:
            self._rate = (messages - self._period_first_message) / elapsed
            self._period_start, self._period_first_message = now, messages
        if 4 * round_messages >= 3 * queue:
            self.full_rounds += 1
            return 0.0
        wait = window if self._rate <= 0 else min(window, queue / (2 * self._rate))
        self.waits += 1
        self.waited_seconds += wait
        return wait


class LiveReader:
    """Owns the SUB (re-opened after every shed) and feeds the inbox; see the module docstring."""

    def __init__(
        self,
        context: zmq.Context[Any],
        *,
        endpoint: str,
        topic: bytes,
        rcvhwm: int,
        inbox: Inbox,
        budget: IngestBudget,
        held_bytes: Callable[[], int],
        shed_held: Callable[[], int],
        shed_after: float = 0.0,
        connect_warning_after: float = 3.0,
        coalesce_window: float = 0.0,
        replay_endpoint: str | None = None,
    ) -> None:
        self.context = context
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint  # probed only for the unreachable hint
        self.topic = topic
        self.rcvhwm = rcvhwm
        self.inbox = inbox
        self.budget = budget
        self.bytes_bound = budget.listener_bytes
        self.shed_after = shed_after
        self.connect_warning_after = connect_warning_after
        self.coalesce_window = coalesce_window
        self.pacing = ReadPacing(coalesce_window)
        # trio.current_time() of the last drain that received a live message (None: none yet).
        self.last_live_at: float | None = None
        self.connect_warnings = 0
        self._handshake = trio.Event()  # set at the first successful handshake with the engine
        self._live = Changed()  # a drain received a live message (see wait_for_live)
        self._held_bytes = held_bytes  # bytes held past the inbox (SourceSync, the processor's batch)
        self._shed_held = shed_held  # drops what SourceSync holds; returns the bytes freed
        self.messages = 0
        self.pauses = 0
        self.ingest_sheds = 0
        self.ingest_shed_bytes = 0
        self.engine_disconnects = 0
        self.reconnects = 0
        self._engine_connected: bool | None = None  # None: never connected yet
        self._largest_message = 0
        self._current_rcvhwm = rcvhwm
        self._subscription: _Subscription | None = None
        self._monitor_scope = trio.CancelScope()

    def open(self) -> None:
        """Connect the first SUB (before the listener reports itself started)."""
        self._current_rcvhwm = self._rcvhwm()
        self._subscription = _Subscription(self.context, self.endpoint, self.topic, self._current_rcvhwm)

    def close(self) -> None:
        self._monitor_scope.cancel()
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._subscription is None:
            self.open()
        try:
            async with trio.open_nursery() as nursery:
                self._start_monitor(nursery)
                nursery.start_soon(self._warn_if_never_connected)
                task_status.started()
                await self._read(nursery)
        finally:
            self.close()

    async def _read(self, nursery: trio.Nursery) -> None:
        round_start = self.messages  # the message count when the reader last waited
        while True:
            subscription = self._subscription
            assert subscription is not None
            received = self.messages
            outcome = self._drain(subscription.sub)
            if self.messages != received:
                self.last_live_at = trio.current_time()  # once per drain, not per message
                self._live.notify()
            if outcome is _Drained.SLICE_OVER:
                await checkpoint()  # let the processor and others run
            elif outcome is _Drained.AGAIN and self.messages != received and (
                wait := self.pacing.wait_after(self.messages - round_start, self.messages, self._current_rcvhwm)
            ):
                # Something arrived and the queue is empty: the next batches of a steady stream are read
                # together after the wait, so the whole pipeline wakes once per wait, not once per batch.
                await trio.sleep(wait)
                round_start = self.messages
            elif outcome is _Drained.FULL:
                await self._wait_for_room_or_shed()
                if self._subscription is not subscription:
                    self._start_monitor(nursery)  # shed: a new socket, a new monitor
                round_start = self.messages
            else:
                try:
                    await subscription.sub.wait_readable()
                except zmq.ZMQError as exc:
                    raise ListenerError(f"ZMQ receive failed: {exc}") from exc
                round_start = self.messages

    def _over_bound(self) -> bool:
        return self.inbox.nbytes + self._held_bytes() > self.bytes_bound

    def _drain(self, sub: TrioSocket) -> _Drained:
        """Receive until zmq.Again, the slice is over, or the listener holds more than its bound."""
        # recv_multipart's own loop, without its per-frame option lookup through pyzmq's enum layer (about
        # 1 us a message): libzmq delivers a message's frames together, so the rest never blocks.
        socket = sub.socket
        recv_frame, more = socket.recv, socket.get
        put = self.inbox.put_live
        clock = time.perf_counter
        slice_end = clock() + SLICE_SECONDS
        for count in itertools.count(1):
            if self._over_bound():
                return _Drained.FULL
            try:
                frames = [recv_frame(_NOBLOCK)]
                while more(_RCVMORE):
                    frames.append(recv_frame(_NOBLOCK))
            except zmq.Again:
                return _Drained.AGAIN
            except zmq.ZMQError as exc:
                raise ListenerError(f"ZMQ receive failed: {exc}") from exc
            nbytes = sum(map(len, frames))
            put(frames, nbytes)
            self.messages += 1
            if nbytes > self._largest_message:
                self._largest_message = nbytes  # fits the RCVHWM of the next SUB opened (never this one)
            if count % _CHECK_CLOCK_EVERY == 0 and clock() >= slice_end:
                return _Drained.SLICE_OVER
        raise AssertionError("unreachable")

    async def _wait_for_room_or_shed(self) -> None:
        """Over the bound: stop reading, and shed unless the processor makes room within ``shed_after``."""
        self.pauses += 1
        with trio.move_on_after(self.shed_after):
            while self._over_bound():
                await self.inbox.wait_for_space()
        if self._over_bound():
            self._shed()
            # What is still over the bound are batches the processor has taken: it is admitting them.
            while self._over_bound():
                await self.inbox.wait_for_space()

    def _rcvhwm(self) -> int:
        """libzmq's queue in messages, so that it holds about its share of the budget in the largest seen."""
        return self.budget.rcvhwm(self.rcvhwm, self._largest_message)

    def _shed(self) -> None:
        freed = self.inbox.drop_live() + self._shed_held()
        self.ingest_sheds += 1
        self.ingest_shed_bytes += freed
        log.warning("vllm_listener_shed", freed_bytes=freed, bound=self.bytes_bound, ingest_sheds=self.ingest_sheds)
        # Close and re-open: libzmq's queue goes with the old socket. What was lost is a gap for SourceSync.
        self._monitor_scope.cancel()
        old = self._subscription
        self._subscription = None
        if old is not None:
            old.close()
        self._current_rcvhwm = self._rcvhwm()  # set before connecting: see the module docstring
        self._subscription = _Subscription(self.context, self.endpoint, self.topic, self._current_rcvhwm)
        self.inbox.wake()

    # -- the engine connection ------------------------------------------------------------------------

    def _start_monitor(self, nursery: trio.Nursery) -> None:
        subscription = self._subscription
        assert subscription is not None and subscription.monitor is not None
        self._monitor_scope = trio.CancelScope()
        nursery.start_soon(self._watch_monitor, subscription.monitor, self._monitor_scope)

    async def _watch_monitor(self, monitor: TrioSocket, scope: trio.CancelScope) -> None:
        with scope:
            while True:
                frames = await monitor.recv_multipart()
                self._on_monitor_event(parse_monitor_message(frames)["event"])

    @property
    def engine_connected(self) -> bool:
        """Whether the SUB has a working connection to the engine now (a handshake, and no drop since)."""
        return bool(self._engine_connected)

    async def wait_connected(self) -> None:
        """Return once a handshake with the engine has succeeded (at once if one already has)."""
        await self._handshake.wait()

    async def wait_for_live(self) -> None:
        """Return at the next drain that receives a live message (the slot's silence watch waits here)."""
        await self._live.wait(self._live.version)

    async def _warn_if_never_connected(self) -> None:
        """One WARNING when no engine handshake succeeds in time, and one INFO if it succeeds later."""
        if self.endpoint.startswith("inproc://"):
            return  # no TCP connection, no monitor events: nothing to tell
        with trio.move_on_after(self.connect_warning_after):
            await self._handshake.wait()
            return
        self.connect_warnings += 1
        reason, hint = await diagnose_unreachable(self.endpoint, self.replay_endpoint)
        log.warning(
            "vllm_endpoint_unreachable",
            endpoint=self.endpoint,
            waited_s=self.connect_warning_after,
            reason=reason,
            hint=hint,
            retrying=True,
        )
        await self._handshake.wait()
        log.info("vllm_endpoint_connected", endpoint=self.endpoint)

    def _on_monitor_event(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            if self._engine_connected:
                self._engine_connected = False
                self.engine_disconnects += 1
                log.warning("vllm_engine_disconnected", endpoint=self.endpoint)
                self.inbox.put_link(False)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if self._engine_connected is False:
                self.reconnects += 1
                log.info("vllm_engine_reconnected", endpoint=self.endpoint)
                self.inbox.put_link(True)
            # The first connection, or the listener's own re-open of a SUB while the engine stayed up.
            self._engine_connected = True
            self._handshake.set()
