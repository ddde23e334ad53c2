"""The ``follow`` op: a backlog answer, then live events, with no gap and no duplicate at the hand-off.

The hand-off is exact because :func:`open_follow` computes the backlog from the index and registers the
live subscriber in one synchronous step: the coordinator applies events from another task, and without a
checkpoint in between no event can be applied after the snapshot but before the subscription (a gap) or
before the snapshot and again after it (a duplicate).

Memory per follower is bounded: the live buffer holds at most ``capacity`` events.  A follower that falls
further behind is *overrun*: the buffer is dropped, the client gets ``{"kind": "overrun", "last_sent": N}``
(N = the newest cursor it fully holds) and the connection is closed with 1013; it resumes with ``from = N``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from kvagent.index.recovery_index import (
    DumpSnapshot,
    EventsAnswer,
    RangeAnswer,
    RecoveryIndex,
    TooNewAnswer,
    TreeDumpAnswer,
    TreeDumpFailedAnswer,
)
from kvagent.model.errors import KvAgentError
from kvagent.model.events import RESET_ALL, RouterEvent
from kvagent.recovery.dump import (
    EncodedRing,
    columns_frames,
    encoded_ring,
    legacy_dump_parts,
    snapshot_header,
)
from kvagent.recovery.protocol import (
    Encoding,
    encode_frame,
    error_frame,
    event_frames,
    too_new_response,
)

__all__ = [
    "CLOSE_TRY_AGAIN_LATER",
    "LIVE_BATCH_EVENTS",
    "FollowSession",
    "LiveBuffer",
    "open_follow",
    "run_follow",
]

log = logging.getLogger(__name__)

RequestHandler = Callable[[str | bytes], Awaitable[None]]

CLOSE_TRY_AGAIN_LATER = 1013
LIVE_BATCH_EVENTS = 1024  # events drained into one live batch (then split by frame size)


class LiveBuffer:
    """Per-follower bounded queue fed synchronously by the index subscriber callback."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"follow buffer capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.overrun = False
        self._events: deque[RouterEvent] = deque()
        self._lot = trio.lowlevel.ParkingLot()

    def push(self, event: RouterEvent) -> None:
        """The index callback: never blocks, never raises, drops everything once overrun."""
        if self.overrun:
            return
        if len(self._events) >= self.capacity:
            self.overrun = True
            self._events.clear()  # the follower must resume from its cursor anyway; free the memory now
        else:
            self._events.append(event)
        self._lot.unpark_all()

    def drain(self, max_events: int) -> list[RouterEvent]:
        events = self._events
        count = min(max_events, len(events))
        return [events.popleft() for _ in range(count)]

    async def wait(self) -> None:
        """Return once events are buffered or the buffer is overrun."""
        while not self._events and not self.overrun:
            await self._lot.park()

    def __len__(self) -> int:
        return len(self._events)


@attrs.frozen(slots=True)
class FollowSession:
    backlog: RangeAnswer | DumpSnapshot
    buffer: LiveBuffer
    unsubscribe: Callable[[], None]


def open_follow(index: RecoveryIndex, from_cursor: int | None, capacity: int) -> FollowSession:
    """Backlog answer + live subscription, in one synchronous step (no checkpoint: see module docstring).

    ``from_cursor`` is the last id the follower holds; the backlog is ``range_or_snapshot(from + 1, None)``
    (a dump snapshot when it is None or older than the ring), or an empty events answer when it is caught
    up.  A dump snapshot is a copy, so it stays consistent while it is streamed and live events queue up.
    """
    start = None if from_cursor is None else from_cursor + 1
    backlog = index.range_or_snapshot(start, None)
    if isinstance(backlog, TooNewAnswer) and from_cursor == backlog.newest_available:
        backlog = EventsAnswer((), backlog.newest_available)
    buffer = LiveBuffer(capacity)
    unsubscribe = index.subscribe(buffer.push)
    return FollowSession(backlog, buffer, unsubscribe)


def backlog_header(request_id: int, answer: EventsAnswer | TreeDumpAnswer) -> dict[str, object]:
    header: dict[str, object] = {
        "id": request_id,
        "ok": True,
        "kind": "events" if isinstance(answer, EventsAnswer) else "tree_dump",
        "last_event_id": answer.last_event_id,
    }
    if isinstance(answer, TreeDumpAnswer):
        header["reset_scope"] = answer.reset_scope.to_json()
    return header


async def _send_backlog_and_live(
    ws: WebSocketConnection,
    request_id: int,
    encoding: Encoding,
    session: FollowSession,
    index: RecoveryIndex,
    dump_format: str,
) -> None:
    answer = session.backlog
    buffer = session.buffer
    ring = encoded_ring(index)
    if isinstance(answer, DumpSnapshot):
        header = {"id": request_id, "ok": True, **snapshot_header(answer, RESET_ALL)}
        if dump_format == "columns":
            frames = columns_frames(encoding, header, answer.groups)
        else:
            frames = event_frames(encoding, header, legacy_dump_parts(encoding, answer.groups))
        # Encoded a frame at a time between sends: the loop (ingest, other clients) runs in between.
        for frame in frames:
            await ws.send_message(frame)
        await _send_live(ws, request_id, encoding, buffer, ring, answer.last_event_id)
        return
    if isinstance(answer, TooNewAnswer):
        await ws.send_message(encode_frame(encoding, too_new_response(request_id, answer)))
        return
    if isinstance(answer, TreeDumpFailedAnswer):
        # Never an empty dump in its place: the follower's cursor must not advance.
        message = f"worker tree dump failed: {answer.message}"
        await ws.send_message(error_frame(encoding, request_id, "internal", message))
        return
    if not isinstance(answer, EventsAnswer | TreeDumpAnswer):  # InvalidRange: impossible without an end
        raise KvAgentError(f"unexpected follow backlog {type(answer).__name__}", code="internal")
    header = backlog_header(request_id, answer)
    for frame in event_frames(encoding, header, ring.encode(encoding, answer.events)):
        await ws.send_message(frame)
    await _send_live(ws, request_id, encoding, buffer, ring, answer.last_event_id)


async def _send_live(
    ws: WebSocketConnection,
    request_id: int,
    encoding: Encoding,
    buffer: LiveBuffer,
    ring: EncodedRing,
    last_sent: int,
) -> None:
    # The client now holds a consistent state through last_sent; an overrun during the backlog is only
    # reported here, so last_sent is always a real cursor (never a point inside a tree dump).
    live_header = {"id": request_id, "ok": True, "kind": "live"}
    while True:
        if buffer.overrun:
            log.warning("follower overrun; closing it", extra={"last_sent": last_sent})
            await ws.send_message(
                encode_frame(
                    encoding, {"id": request_id, "ok": True, "kind": "overrun", "last_sent": last_sent}
                )
            )
            await ws.aclose(CLOSE_TRY_AGAIN_LATER, "follower fell behind; resume with from = last_sent")
            return
        # Events at or below the backlog's cursor were already delivered by it (none are expected).
        events = [event for event in buffer.drain(LIVE_BATCH_EVENTS) if event.event_id > last_sent]
        if not events:
            await buffer.wait()
            continue
        frames = event_frames(encoding, live_header, ring.encode(encoding, events), more_flag=False)
        for frame in frames:
            await ws.send_message(frame)
        last_sent = events[-1].event_id


async def _serve_requests_while_following(
    ws: WebSocketConnection, on_request: RequestHandler, cancel_scope: trio.CancelScope
) -> None:
    """Keep reading the connection during a follow: answer other requests, notice the close promptly."""
    try:
        while True:
            await on_request(await ws.get_message())
    except ConnectionClosed:
        cancel_scope.cancel()


async def run_follow(
    ws: WebSocketConnection,
    request_id: int,
    encoding: Encoding,
    index: RecoveryIndex,
    from_cursor: int | None,
    capacity: int,
    on_request: RequestHandler,
    dump_format: str = "events",
) -> None:
    """Serve one follow until the client leaves, the follower is overrun, or the backlog is unavailable.

    Other requests arriving meanwhile go to ``on_request`` (their answers interleave with live frames; every
    frame carries its request's id).
    """
    session = open_follow(index, from_cursor, capacity)
    failure: KvAgentError | None = None
    closed = False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_requests_while_following, ws, on_request, nursery.cancel_scope)
            await _send_backlog_and_live(ws, request_id, encoding, session, index, dump_format)
            nursery.cancel_scope.cancel()
    except* ConnectionClosed:
        closed = True  # the caller's next read sees the close and ends the connection quietly
    except* KvAgentError as group:
        failure = _first_agent_error(group)
    finally:
        session.unsubscribe()
    if failure is not None and not closed:
        await ws.send_message(error_frame(encoding, request_id, failure.code, failure.message))


def _first_agent_error(group: BaseExceptionGroup[KvAgentError]) -> KvAgentError:
    first = group.exceptions[0]
    return first if isinstance(first, KvAgentError) else _first_agent_error(first)
