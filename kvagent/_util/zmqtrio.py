"""pyzmq on Trio: a socket owned by one task, waiting on ``zmq.FD`` the way libzmq requires.

Rules (pyzmq's documentation of zmq.FD, verified): ``zmq.FD`` is edge-triggered relative to ``zmq.EVENTS`` — any libzmq
call can consume the notification — so ``zmq.EVENTS`` is re-read immediately before every wait and every
wakeup drains until ``zmq.Again``.  Receives are batched per checkpoint (a checkpoint per message costs about
half the throughput).  Only one task may wait on a socket (two raise ``trio.BusyResourceError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import trio
import zmq

__all__ = ["TrioSocket", "open_context"]


class TrioSocket:
    """Non-blocking wrapper around a ``zmq.Socket`` for use by a single owner task."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.socket = sock
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._closed = False

    async def _wait(self, flag: int) -> None:
        while True:
            if self._closed:
                # Closed by its owner while this task was already rescheduled: a cancellation that came too
                # late to abort the wait is raised here, at the next checkpoint; else the close is an error.
                await trio.lowlevel.checkpoint_if_cancelled()
                raise trio.ClosedResourceError("the ZMQ socket was closed")
            # Re-read EVENTS right before waiting: a previous call may already have consumed the edge.
            if cast(int, self.socket.getsockopt(zmq.EVENTS)) & flag:
                return
            if flag == zmq.POLLIN:
                await trio.lowlevel.wait_readable(self._fd)
            else:
                await trio.lowlevel.wait_writable(self._fd)

    async def wait_readable(self) -> None:
        """Return once a receive would not block (EVENTS re-read before every wait)."""
        await self._wait(zmq.POLLIN)

    async def wait_signalled(self) -> None:
        """Return at libzmq's next signal on ``zmq.FD``: any change of ``zmq.EVENTS`` (a blocked outbound pipe
        turning writable as well as a message arriving), not only a readable message. The caller re-reads
        ``zmq.EVENTS`` / retries its sends afterwards; the signal is an edge, so it may also have been spent."""
        await trio.lowlevel.wait_readable(self._fd)

    async def recv_multipart(self) -> list[bytes]:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                frames: list[bytes] = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await self._wait(zmq.POLLIN)
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return frames

    async def recv_multipart_batch(self, max_messages: int = 256) -> list[list[bytes]]:
        """At least one message, and every message already queued up to ``max_messages``."""
        await trio.lowlevel.checkpoint_if_cancelled()
        batch: list[list[bytes]] = []
        recv = self.socket.recv_multipart
        while True:
            try:
                while len(batch) < max_messages:
                    batch.append(recv(zmq.NOBLOCK))
            except zmq.Again:
                pass
            if batch:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            await self._wait(zmq.POLLIN)

    async def send_multipart(self, frames: list[bytes]) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                await self._wait(zmq.POLLOUT)
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return

    def try_send_multipart(self, frames: list[bytes]) -> bool:
        """Send without waiting; False when the socket would block (for PUB: the HWM dropped it).

        Not ``*_nowait``: in trio that name raises ``WouldBlock``; here a refused send is a reported drop.
        """
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Wake any task still waiting on the FD before libzmq closes it (only possible inside a run).
        with contextlib.suppress(RuntimeError):
            trio.lowlevel.notify_closing(self._fd)
        self.socket.close(linger=0)

    def __enter__(self) -> TrioSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def open_context(io_threads: int = 1) -> Iterator[zmq.Context[Any]]:
    """A private ``zmq.Context`` destroyed with linger 0 on exit, so shutdown never waits on unsent frames.

    ``destroy`` closes any socket still open; close sockets through :meth:`TrioSocket.close` first when a
    task may be waiting on them, so Trio is told before the FD goes away.
    """
    context: zmq.Context[Any] = zmq.Context(io_threads)
    try:
        yield context
    finally:
        context.destroy(linger=0)
