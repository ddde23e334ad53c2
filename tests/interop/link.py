"""A lossy link between a PUB and its subscribers: the way to make one consumer miss a range of a live stream."""

from __future__ import annotations

from typing import Any

import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket


class LossyLink:
    """SUB to ``upstream``, PUB on 127.0.0.1: forwards every message except the ones it is told to drop.

    A consumer connected to :attr:`endpoint` sees a seq gap exactly where the link dropped; its replay
    request goes to the publisher's own replay ROUTER, which the link does not touch.
    """

    def __init__(self, upstream: str, context: zmq.Context[Any]) -> None:
        self._sub = TrioSocket(context.socket(zmq.SUB))
        self._pub = TrioSocket(context.socket(zmq.PUB))
        for sock in (self._sub, self._pub):
            sock.socket.setsockopt(zmq.LINGER, 0)
        self._sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.upstream: str | None = upstream
        self._sub.socket.connect(upstream)
        self._pub.socket.bind("tcp://127.0.0.1:0")
        self.endpoint: str = self._pub.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.forwarded = 0
        self.dropped = 0
        self._to_drop = 0
        self._progress = trio.Event()

    def leave_upstream(self) -> None:
        """Disconnect from the publisher (and stop reconnecting): its consumer sees nothing until :meth:`join`."""
        if self.upstream is not None:
            self._sub.socket.disconnect(self.upstream)
            self.upstream = None

    def join(self, upstream: str) -> None:
        """Connect (again) to ``upstream``: the publisher sees a new subscription, as after a SUB's reconnect."""
        self.leave_upstream()
        self._sub.socket.connect(upstream)
        self.upstream = upstream

    def drop_next(self, count: int) -> None:
        self._to_drop += count

    async def wait_dropped(self, count: int) -> None:
        """Until ``count`` messages have been dropped in all (callers bound it with ``fail_after``)."""
        while self.dropped < count:
            await self._progress.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                frames = await self._sub.recv_multipart()
                if self._to_drop:
                    self._to_drop -= 1
                    self.dropped += 1
                else:
                    self._pub.try_send_multipart(frames)  # a PUB: drops at its HWM, as the real one does
                    self.forwarded += 1
                self._progress.set()
                self._progress = trio.Event()
        finally:
            self._sub.close()
            self._pub.close()
