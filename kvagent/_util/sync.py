"""The small synchronization toolkit every task of kvagent uses instead of hand-made futures and re-armed events.

- :class:`Changed`: a version number and a way to wait until it moves past one you saw.  Read the version,
  look at the state, then ``await changed.wait(version)``: a change in between is never lost, because
  :meth:`Changed.notify` bumps the version before it wakes anyone.  It replaces the "set the event, make a
  new one" pattern (``self._changed.set(); self._changed = trio.Event()``) and the ParkingLot variants.
- :class:`Request`: one request's one-shot reply, which the asker may stop waiting for.  A request whose
  asker left before it was answered is *abandoned*: the serving task skips it if it has not begun (so a
  cancelled call has done nothing), or finishes it for nobody.
- :class:`ControlFirstInbox`: a task's two inputs in one: a bounded queue of control requests, always taken
  first, and an unbounded queue of work items that senders put without waiting.  ``await inbox.receive(n)``
  gives the next control request, else up to ``n`` items, and sleeps only when both are empty.

- :func:`checkpoint` and :func:`shielded_checkpoint`: a yield to the scheduler (that may be cancelled, or
  not), named for what they are; :func:`checkpoint_if_cancelled`: a yield only when cancelled.

Everything here is plain Trio (``trio.Event``); ``trio.lowlevel`` stays in the socket and ZMQ adapters.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs
import trio

__all__ = [
    "Changed",
    "ControlFirstInbox",
    "InboxStatistics",
    "Request",
    "checkpoint",
    "checkpoint_if_cancelled",
    "shielded_checkpoint",
]

T = TypeVar("T")
C = TypeVar("C")
I = TypeVar("I")  # noqa: E741  (the item type of an inbox)


class Changed:
    """A "something changed" notification with a version, so no waiter misses a change.

    ``version`` only grows.  :meth:`notify` bumps it and wakes every waiter; :meth:`wait` returns at once if
    the version is already past ``since``.  A notify nobody waits for costs an increment (no allocation),
    so it fits a per-event path.
    """

    __slots__ = ("_event", "_version")

    def __init__(self) -> None:
        self._version = 0
        self._event: trio.Event | None = None  # made by the first waiter, set and dropped by the next notify

    @property
    def version(self) -> int:
        return self._version

    def notify(self) -> None:
        self._version += 1
        event, self._event = self._event, None
        if event is not None:
            event.set()

    async def wait(self, since: int) -> None:
        """Return once the version is past ``since``; at once, without a checkpoint, if it already is (as the
        park loops it replaces: a consumer that keeps finding work does not yield here)."""
        while self._version == since:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        if self._version < since:
            raise ValueError(f"version {since} was never reached (now {self._version})")

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, looking again after each change (not a poll); at once, without
        a checkpoint, if it already holds."""
        while True:
            since = self._version
            if predicate():
                return
            await self.wait(since)


class Request(Generic[T]):
    """One request's one-shot reply; subclass it to carry what is asked (add ``__slots__``).

    The serving task calls :meth:`reply` or :meth:`fail` once (later calls are ignored); the asker awaits
    :meth:`wait`.  If the asker is cancelled before the reply, the request is :meth:`abandoned`.
    """

    __slots__ = ("_abandoned", "_error", "_replied", "_result")

    def __init__(self) -> None:
        self._abandoned = False
        self._replied = trio.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

    # Methods, not properties: the answer changes while the serving task awaits, and a type checker would
    # carry a property's narrowing across that await.
    def abandoned(self) -> bool:
        """The asker stopped waiting before the reply."""
        return self._abandoned

    def replied(self) -> bool:
        return self._replied.is_set()

    def reply(self, result: T) -> None:
        if not self._replied.is_set():
            self._result = result
            self._replied.set()

    def fail(self, error: BaseException) -> None:
        if not self._replied.is_set():
            self._error = error
            self._replied.set()

    async def wait(self) -> T:
        """The reply (or the error it failed with); cancelled before it, the request is abandoned."""
        try:
            await self._replied.wait()
        except trio.Cancelled:
            self._abandoned = not self._replied.is_set()  # answered already: nobody is left unanswered
            raise
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set whenever no error was recorded


async def checkpoint() -> None:
    """Yield to the scheduler; raises Cancelled if cancelled (``trio.lowlevel.checkpoint``'s effect)."""
    await trio.sleep(0)  # noqa: ASYNC115  (trio.lowlevel stays in the socket and ZMQ adapters)


async def checkpoint_if_cancelled() -> None:
    """Raise Cancelled if cancelled, else return at once without yielding (``trio.lowlevel.
    checkpoint_if_cancelled``, in the form its documentation gives as equivalent): for a wait that usually
    need not wait, on a hot path, that must still let a cancelled caller out."""
    if trio.current_effective_deadline() == -math.inf:
        await checkpoint()


async def shielded_checkpoint() -> None:
    """Yield to the scheduler without being cancelled (``trio.lowlevel.cancel_shielded_checkpoint``)."""
    with trio.CancelScope(shield=True):
        await trio.sleep(0)  # noqa: ASYNC115


@attrs.frozen(slots=True)
class InboxStatistics:
    """An inbox at one instant: requests and items waiting, and whether it is closed."""

    control_queued: int
    control_capacity: int
    items_queued: int
    closed: bool


class ControlFirstInbox(Generic[C, I]):
    """A task's inbox: control requests (bounded, taken first) and work items (unbounded, never waited for).

    One task receives; any number send.  After :meth:`close`, sends raise ``trio.ClosedResourceError`` and
    :meth:`receive` raises ``trio.EndOfChannel`` once nothing is left; :meth:`take_control_nowait` then
    hands back what was queued, so the owner can refuse it.
    """

    def __init__(self, control_capacity: int) -> None:
        if control_capacity < 1:
            raise ValueError("control_capacity must be at least 1")
        self._capacity = control_capacity
        self._control: deque[C] = deque()
        self._items: deque[I] = deque()
        self._closed = False
        self._arrived = Changed()  # a request or item arrived, or the inbox closed
        self._room = Changed()  # a control request was taken

    # --- senders ---------------------------------------------------------------------------------------
    async def send_control(self, request: C) -> None:
        """Queue ``request``, waiting for room; cancelled while waiting, it is not queued."""
        await checkpoint()  # first, as a channel's send: cancelled here, nothing is queued
        while True:
            since = self._room.version
            if self._closed:
                raise trio.ClosedResourceError("the inbox is closed")
            if len(self._control) < self._capacity:
                break
            await self._room.wait(since)
        self._control.append(request)
        self._arrived.notify()

    def send_control_nowait(self, request: C) -> None:
        """Queue ``request`` now; ``trio.WouldBlock`` if the control queue is full."""
        if self._closed:
            raise trio.ClosedResourceError("the inbox is closed")
        if len(self._control) >= self._capacity:
            raise trio.WouldBlock
        self._control.append(request)
        self._arrived.notify()

    def put_nowait(self, item: I) -> None:
        """Queue a work item; never waits (the receiver bounds its senders some other way, e.g. by bytes)."""
        if self._closed:
            raise trio.ClosedResourceError("the inbox is closed")
        self._items.append(item)
        if len(self._items) == 1:  # the receiver can only be asleep on an empty inbox
            self._arrived.notify()

    # --- the receiver ----------------------------------------------------------------------------------
    async def receive(self, max_items: int = 1) -> C | list[I]:
        """The next control request if any, else up to ``max_items`` work items (a non-empty list)."""
        while True:
            since = self._arrived.version
            taken = self.receive_nowait(max_items)
            if taken is not None:
                return taken
            if self._closed:
                raise trio.EndOfChannel
            await self._arrived.wait(since)

    async def wait(self) -> None:
        """Return once something is queued or the inbox is closed, taking nothing (for a receiver that takes
        with :meth:`take_control_nowait` / :meth:`take_items_nowait` and decides itself what to do at close)."""
        await self._arrived.wait_for(lambda: bool(self._control or self._items) or self._closed)

    def receive_nowait(self, max_items: int = 1) -> C | list[I] | None:
        """As :meth:`receive`, but None instead of waiting."""
        if self._control:
            return self.take_control_nowait()
        if self._items:
            items = self._items
            count = min(max_items, len(items))
            return [items.popleft() for _ in range(count)]
        return None

    def take_control_nowait(self) -> C | None:
        """The oldest control request, or None."""
        if not self._control:
            return None
        request = self._control.popleft()
        self._room.notify()
        return request

    def take_items_nowait(self, max_items: float = math.inf) -> list[I]:
        """Up to ``max_items`` queued work items (possibly none)."""
        items = self._items
        count = int(min(max_items, len(items)))
        return [items.popleft() for _ in range(count)]

    def close(self) -> None:
        """No more sends; the receiver still takes what is queued (senders waiting for room are refused)."""
        if not self._closed:
            self._closed = True
            self._arrived.notify()
            self._room.notify()

    # --- looking ---------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def items_queued(self) -> int:
        return len(self._items)

    def statistics(self) -> InboxStatistics:
        return InboxStatistics(
            control_queued=len(self._control),
            control_capacity=self._capacity,
            items_queued=len(self._items),
            closed=self._closed,
        )
