"""Accepting connections under pressure: fd exhaustion, and connections that never finish their handshake.

``trio.serve_listeners`` logs every failed ``accept`` and retries after 100 ms; under an fd exhaustion that
is thousands of log lines while nothing else can open a socket either.  :func:`accept_loop` logs one line
when an episode starts and one when it is over (a quiet second later), frees descriptors held by
connections still in their handshake (``shed``) before backing off, and backs off exponentially up to
:data:`BACKOFF_MAX`, so it recovers by itself within that once descriptors are free again.

:class:`PendingHandshakes` bounds the connections not yet upgraded: each has a deadline, and when the table
is full the oldest is dropped to make room once it has had a short protection period (a slow or idle
half-open socket loses to a client that is actually talking, which completes its handshake in
milliseconds).
"""

from __future__ import annotations

import errno
import resource
import socket
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import structlog
import trio

from kvagent._util.sync import Changed, checkpoint

__all__ = [
    "BACKOFF_MAX",
    "CAPACITY_ERRNOS",
    "PendingHandshakes",
    "accept_loop",
    "close_socket",
    "default_pending_limit",
    "shed_pending_handshakes",
]

log = structlog.get_logger(__name__)

CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
BACKOFF_MIN = 0.005
BACKOFF_MAX = 0.25
SHED_FRACTION = 8  # on fd exhaustion, drop 1/8 of the pending handshakes (at least one)
EPISODE_QUIET = 1.0  # seconds without a capacity failure that end an episode

T = TypeVar("T")


def default_pending_limit(configured: int | None = None) -> int:
    """The pre-handshake limit: as configured, else 128, but never more than a quarter of RLIMIT_NOFILE.

    The quarter leaves the descriptors that established connections, the ZMQ sockets and ``/metrics``
    need even while half-open connections hold every pending slot.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = 128 if soft == resource.RLIM_INFINITY else max(8, soft // 4)
    return cap if configured is None else configured


_TABLES: weakref.WeakSet[PendingHandshakes] = weakref.WeakSet()


def shed_pending_handshakes() -> int:
    """Free descriptors held by half-open connections of every server in the process (any listener's
    ``accept`` may be the one that runs out); how many connections were dropped."""
    return sum(table.shed() for table in list(_TABLES))


class PendingHandshakes:
    """Connections accepted but not yet upgraded: bounded in number, oldest dropped first.

    Each connection is protected for ``protect`` seconds after it was accepted: when every pending
    connection is younger than that, :meth:`make_room` waits instead of dropping one.  A client gets at
    least that long to send its upgrade request, and a flood that reconnects as fast as it is dropped
    cannot churn the table faster than ``limit / protect`` connections a second.
    """

    def __init__(self, limit: int, on_evict: Callable[[], None] | None = None, protect: float = 0.25) -> None:
        if limit <= 0:
            raise ValueError(f"the pre-handshake limit must be positive, got {limit}")
        self.limit = limit
        self.protect = protect
        self._on_evict = on_evict  # counts each connection dropped to make room or to free descriptors
        self._entries: OrderedDict[int, tuple[socket.socket, trio.CancelScope, float]] = OrderedDict()
        self._next_key = 0
        self._left = Changed()  # a pending connection finished, failed or was dropped
        _TABLES.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    async def make_room(self) -> None:
        """Return once a new connection fits: drop the oldest once it is past its protection."""
        while len(self._entries) >= self.limit:
            _, _, admitted = next(iter(self._entries.values()))
            wait = admitted + self.protect - trio.current_time()
            if wait <= 0:
                self._evict_oldest()
                break
            left = self._left.version
            with trio.move_on_after(wait):
                await self._left.wait(left)
        await checkpoint()

    @contextmanager
    def admit(self, sock: socket.socket, deadline: float) -> Iterator[trio.CancelScope]:
        """Track ``sock`` for its handshake; the scope ends at ``deadline`` or when the entry is evicted."""
        while len(self._entries) >= self.limit:  # another listener filled it since make_room()
            self._evict_oldest()
        key = self._next_key
        self._next_key += 1
        with trio.CancelScope(deadline=deadline) as scope:
            self._entries[key] = (sock, scope, trio.current_time())
            try:
                yield scope
            finally:
                if self._entries.pop(key, None) is not None:
                    self._left.notify()

    def shed(self) -> int:
        """Drop the oldest eighth (at least one, if any) to free descriptors; how many were dropped."""
        count = min(len(self._entries), max(1, len(self._entries) // SHED_FRACTION))
        for _ in range(count):
            self._evict_oldest()
        return count

    def close_all(self) -> None:
        while self._entries:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, (sock, scope, _) = self._entries.popitem(last=False)
        if self._on_evict is not None:
            self._on_evict()
        close_socket(sock)  # the descriptor is free now, not when the handler next runs
        scope.cancel()


class _Episode:
    """Capacity failures of ``accept`` with less than :data:`EPISODE_QUIET` seconds between them.

    Shedding lets the next accept succeed, so failures come and go within an attack; they are one episode
    (one warning, one recovery line) until accept has gone a quiet period without failing.
    """

    def __init__(self, name: str, exc: OSError) -> None:
        self.name = name
        self.started = self.last_failure = trio.current_time()
        self.failures = 0
        log.warning(
            "accept_out_of_descriptors",
            listener=name,
            error=errno.errorcode.get(exc.errno or 0, str(exc.errno)),
        )

    @property
    def over(self) -> bool:
        return trio.current_time() - self.last_failure >= EPISODE_QUIET

    def end(self) -> None:
        log.info(
            "accept_recovered",
            listener=self.name,
            failures=self.failures,
            seconds=round(self.last_failure - self.started, 3),
        )


async def accept_loop(
    accept: Callable[[], Awaitable[T]],
    handle: Callable[[T], Awaitable[None]],
    nursery: trio.Nursery,
    *,
    name: str,
    shed: Callable[[], int] | None = None,
    on_capacity_error: Callable[[], None] | None = None,
    room: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Accept until the listener is closed, starting ``handle`` for each connection in ``nursery``.

    ``room`` (optional) is awaited before each accept: while it waits, new connections stay in the
    kernel's listen queue.
    """
    backoff = BACKOFF_MIN
    episode: _Episode | None = None
    while True:
        if room is not None:
            await room()
        try:
            connection = await accept()
        except trio.ClosedResourceError:
            return
        except OSError as exc:
            if exc.errno not in CAPACITY_ERRNOS:
                raise
            if episode is not None and episode.over:
                episode.end()
                episode = None
            if episode is None:
                episode = _Episode(name, exc)
            episode.failures += 1
            episode.last_failure = trio.current_time()
            if on_capacity_error is not None:
                on_capacity_error()
            if shed is not None and shed():
                await trio.lowlevel.checkpoint()  # the shed handlers close and free their descriptors
                continue
            await trio.sleep(backoff)  # a back-off, not synchronization
            backoff = min(2 * backoff, BACKOFF_MAX)
            continue
        backoff = BACKOFF_MIN
        if episode is not None and episode.over:
            episode.end()
            episode = None
        nursery.start_soon(handle, connection)


def close_socket(sock: socket.socket) -> None:
    """Close now (idempotent); a task waiting on the socket wakes with ClosedResourceError."""
    if sock.fileno() != -1:
        trio.lowlevel.notify_closing(sock)
        sock.close()
