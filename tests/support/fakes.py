"""Test doubles for the vLLM listener: a recording coordinator and a replay ROUTER."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.coordinator.task import CoordinatorHandle
from kvagent.model.errors import KvAgentError
from kvagent.model.events import IngressChunk, SourceSignal
from kvagent.wire.vllm_events import END_SEQ


class RecordingCoordinator:
    """Stands in for :class:`CoordinatorHandle`: records admissions, quarantines and loss reports.

    Source signals are recorded in ``signals`` (and in ``quarantines`` / ``losses`` for what they carry);
    ``items`` is every admission in order. Nothing is ever queued: ``ingress_bytes`` is 0.
    """

    def __init__(self, *, closed: bool = False) -> None:
        self.chunks: list[IngressChunk] = []
        self.signals: list[SourceSignal] = []
        self.items: list[IngressChunk | SourceSignal] = []
        self.quarantines: list[tuple[int, str]] = []
        self.losses: list[tuple[int, int]] = []
        self.closed = closed
        self.ingress_bytes = 0
        self._changed = trio.Event()

    def as_handle(self) -> CoordinatorHandle:
        return cast(CoordinatorHandle, self)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def admit_nowait(self, item: IngressChunk | SourceSignal) -> None:
        if self.closed:
            raise KvAgentError("state-agent ingress coordinator is closed", code="internal")
        self.items.append(item)
        if isinstance(item, SourceSignal):
            self.signals.append(item)
            if item.lost_batches:
                self.losses.append((item.generation, item.lost_batches))
            if item.quarantine:
                self.quarantines.append((item.generation, item.reason))
        else:
            self.chunks.append(item)
        self._notify()

    async def wait_ingress_bytes_at_most(self, limit: int) -> None:
        await trio.lowlevel.checkpoint()

    async def quarantine(self, generation: int, reason: str) -> None:
        await trio.lowlevel.checkpoint()
        self.quarantines.append((generation, reason))
        self._notify()

    async def report_source_loss(self, generation: int, lost_batches: int) -> None:
        await trio.lowlevel.checkpoint()
        self.losses.append((generation, lost_batches))
        self._notify()

    def cursors(self) -> list[int]:
        """The source cursor of every final chunk, in admission order (one per raw batch)."""
        return [chunk.source_cursor for chunk in self.chunks if chunk.final]

    async def wait_for(self, predicate: Callable[[RecordingCoordinator], bool]) -> None:
        while not predicate(self):
            await self._changed.wait()


class ReplayRouter:
    """A real ROUTER serving fixed replay replies (DEALER-side frames) like vLLM's replay socket.

    ``first_available`` pretends older batches were evicted from the buffer; ``silent`` never answers;
    ``drop_seqs`` leaves some replies out (ROUTER HWM drops); ``hold`` delays every answer until it is set.
    """

    def __init__(
        self,
        replies: Sequence[list[bytes]],
        *,
        context: zmq.Context[Any] | None = None,
        first_available: int = 0,
        silent: bool = False,
        drop_seqs: frozenset[int] = frozenset(),
        hold: trio.Event | None = None,
    ) -> None:
        self.replies = list(replies)
        self.context = context if context is not None else zmq.Context.instance()
        self.first_available = first_available
        self.silent = silent
        self.drop_seqs = drop_seqs
        self.hold = hold
        self.requests: list[int] = []
        self.endpoint = ""
        self._changed = trio.Event()

    @staticmethod
    def _seq(reply: list[bytes]) -> int | None:
        seq_frame = reply[-2]
        return None if seq_frame == END_SEQ else int.from_bytes(seq_frame, "big")

    async def wait_for_requests(self, count: int) -> None:
        while len(self.requests) < count:
            await self._changed.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        with TrioSocket(router) as sock:
            task_status.started()
            while True:
                request = await sock.recv_multipart()
                if len(request) != 3 or request[1] != b"":
                    continue
                start = int.from_bytes(request[2], "big")
                self.requests.append(start)
                self._changed.set()
                self._changed = trio.Event()
                if self.silent:
                    continue
                if self.hold is not None:
                    await self.hold.wait()
                for reply in self.replies:
                    seq = self._seq(reply)
                    if seq is not None and (seq < max(start, self.first_available) or seq in self.drop_seqs):
                        continue
                    await sock.send_multipart([request[0], *reply])
