"""One websocket connection of the recovery endpoint: its requests, its answers and its follow stream.

A :class:`Session` owns the connection's websocket. It reads request frames, answers ``list``, ``status``
and the control ops itself, and writes every ``recover`` and ``follow`` answer through one
:class:`AnswerWriter` (header, receipt, lazily encoded frames, the post-check before the final frame).
While a ``follow`` streams, the same session keeps reading the connection and answering other requests;
their answers interleave with live frames, and every frame carries its request's id.

The follow hand-off is exact because :func:`open_follow` computes the backlog from the index and registers
the live subscriber in one synchronous step: the coordinator applies events from another task, and without a
checkpoint in between no event can be applied after the snapshot but before the subscription (a gap) or
before the snapshot and again after it (a duplicate).

Memory per follower is bounded: the live buffer holds at most ``capacity`` events.  A follower that falls
further behind is *overrun*: the buffer is dropped, the client gets ``{"kind": "overrun", "last_sent": N}``
(N = the newest cursor it fully holds) and the connection is closed with 1013; it resumes with ``from = N``.

Neither the token nor a request body (it may carry a ``token`` field) is ever logged.
"""

from __future__ import annotations

import hmac
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import attrs
import structlog
import trio

from kvagent._util.sync import Changed
from kvagent.index.recovery_index import (
    DumpGroup,
    DumpSnapshot,
    EventsAnswer,
    InvalidRangeAnswer,
    RangeAnswer,
    RecoveryIndex,
    TooNewAnswer,
    TreeDumpFailedAnswer,
)
from kvagent.model.errors import KvAgentError
from kvagent.model.events import RESET_ALL, U32_MAX, ResetScope, RouterEvent
from kvagent.model.status import AgentStatus
from kvagent.recovery.dump import (
    EncodedRing,
    columns_frames,
    encoded_ring,
    filter_snapshot,
    legacy_dump_parts,
    parse_dump_format,
    snapshot_header,
)
from kvagent.recovery.protocol import (
    CONTROL_OPS,
    KNOWN_OPS,
    SLOT_OPS,
    Encoding,
    Fence,
    SlotDirectory,
    SlotSurface,
    check_recovery_fence,
    check_status_fence,
    decode_frame,
    encode_frame,
    error_frame,
    event_frames,
    filter_answer,
    frame_encoding,
    optional_uint,
    parse_fence,
    parse_request,
    post_check,
    range_header,
    receipt,
    request_op,
    required_str,
    required_uint,
    single_frame_answer,
)
from kvagent.recovery.turns import AnswerTurns, Turn
from kvagent.recovery.websocket import CLOSE_TRY_AGAIN_LATER, ConnectionClosed, MessageTooBig, WebSocket

__all__ = [
    "CLOSE_TRY_AGAIN_LATER",
    "LIVE_BATCH_EVENTS",
    "AnswerWriter",
    "FollowSession",
    "LiveBuffer",
    "RequestCounters",
    "Session",
    "SessionConfig",
    "open_follow",
]

log = structlog.get_logger(__name__)

LIVE_BATCH_EVENTS = 1024  # events drained into one live batch (then split by frame size)


class RequestCounters(Protocol):
    """Where a session counts its requests (the server's ``ServerStats``)."""

    def count_request(self, op: str) -> None: ...

    def count_error(self, code: str) -> None: ...

    def count_request_seconds(self, seconds: float, op: str = "invalid") -> None: ...


@attrs.frozen(slots=True)
class SessionConfig:
    """What every session of one server shares."""

    registry: SlotDirectory
    token: str | None
    counters: RequestCounters
    follow_buffer_events: int
    turns: AnswerTurns = attrs.field(factory=AnswerTurns)


# --- follow state -----------------------------------------------------------------------------------


class LiveBuffer:
    """Per-follower bounded queue fed synchronously by the index subscriber callback."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"follow buffer capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.overrun = False
        self._events: deque[RouterEvent] = deque()
        self._changed = Changed()  # an event was pushed, or the buffer overran

    def push(self, event: RouterEvent) -> None:
        """The index callback: never blocks, never raises, drops everything once overrun."""
        if self.overrun:
            return
        if len(self._events) >= self.capacity:
            self.overrun = True
            self._events.clear()  # the follower must resume from its cursor anyway; free the memory now
        else:
            self._events.append(event)
        self._changed.notify()

    def drain(self, max_events: int) -> list[RouterEvent]:
        events = self._events
        count = min(max_events, len(events))
        return [events.popleft() for _ in range(count)]

    async def wait(self) -> None:
        """Return once events are buffered or the buffer is overrun."""
        await self._changed.wait_for(lambda: bool(self._events) or self.overrun)

    def __len__(self) -> int:
        return len(self._events)


@attrs.frozen(slots=True)
class FollowSession:
    """One follow's starting point: the backlog answer and the live buffer subscribed right after it."""

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


# --- answers ----------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class _Fencing:
    """What a ``recover`` answer vouches for: its receipt, and the 5.3 post-check before its final frame."""

    surface: SlotSurface
    before: AgentStatus
    fence: Fence

    def check(self) -> None:
        post_check(self.before, self.surface.status(), self.fence)

    def receipt(self, recovered_through: int) -> dict[str, object]:
        return receipt(self.before, self.fence, recovered_through)


@attrs.frozen(slots=True)
class AnswerWriter:
    """Writes the answer to one request in that request's encoding; ``recover`` and ``follow`` share it.

    A ``recover`` writer is fenced: its headers carry a receipt and its final frame goes out only if the
    fence still holds.  A ``follow`` writer is not (its backlog is the unfenced full view).

    ``turn`` is the request's answer turn (:mod:`kvagent.recovery.turns`): a light answer writes its first
    frame without it; every later frame (and all of a heavy answer) is computed while it is held; it is
    let go while the peer's queue has no room.
    """

    ws: WebSocket
    encoding: Encoding
    request_id: int
    turn: Turn
    fencing: _Fencing | None = None

    async def send(self, value: Mapping[str, object]) -> None:
        await self._put(encode_frame(self.encoding, value))

    async def _put(self, frame: str | bytes) -> None:
        try:
            self.ws.send_nowait(frame)
            return
        except trio.WouldBlock:
            pass
        # The peer reads slower than we answer: wait for room without holding a turn.
        held = self.turn.held
        self.turn.release()
        await self.ws.send_message(frame)
        if held:
            await self.turn.acquire()

    async def pass_turn(self) -> None:
        """Between two frames: let the others (and ingest) take theirs; the next frame is heavy work."""
        await self.turn.pass_on()

    async def range_answer(
        self, answer: RangeAnswer, ring: EncodedRing, *, supports_failed: bool
    ) -> int | None:
        """Any index answer; returns the cursor the client now holds through, or None for a no-event answer."""
        if isinstance(answer, TreeDumpFailedAnswer) and not supports_failed:
            # Never an empty dump in its place: the client's cursor must not advance.
            raise KvAgentError(f"worker tree dump failed: {answer.message}", code="internal")
        if isinstance(answer, TooNewAnswer | InvalidRangeAnswer | TreeDumpFailedAnswer):
            await self.send(single_frame_answer(self.request_id, answer))
            return None
        header = self._with_receipt(range_header(self.request_id, answer), answer.last_event_id)
        await self._send_frames(
            event_frames(self.encoding, header, ring.encode(self.encoding, answer.events))
        )
        return answer.last_event_id

    async def dump(
        self, snapshot: DumpSnapshot, groups: tuple[DumpGroup, ...], scope: ResetScope, dump_format: str
    ) -> int:
        """A tree dump of ``groups`` (a filtered view of ``snapshot``) in the requested dump format."""
        header = {"id": self.request_id, "ok": True, **snapshot_header(snapshot, scope)}
        header = self._with_receipt(header, snapshot.last_event_id)
        if dump_format == "columns":
            frames = columns_frames(self.encoding, header, groups)
        else:
            frames = event_frames(self.encoding, header, legacy_dump_parts(self.encoding, groups))
        await self._send_frames(frames)
        return snapshot.last_event_id

    async def live(self, events: list[RouterEvent], ring: EncodedRing) -> None:
        header = {"id": self.request_id, "ok": True, "kind": "live"}
        await self._send_frames(
            event_frames(self.encoding, header, ring.encode(self.encoding, events), more_flag=False)
        )

    def _with_receipt(self, header: dict[str, object], recovered_through: int) -> dict[str, object]:
        if self.fencing is not None:
            header["receipt"] = self.fencing.receipt(recovered_through)
        return header

    async def _send_frames(self, frames: Iterable[str | bytes]) -> None:
        # Frames are encoded lazily, one per task step: a multi-frame answer yields between frames, so it
        # never holds the event loop for more than one frame (ingest and the other connections take turns
        # in between), while a one-frame answer is written in the step that computed it.  A fenced
        # answer's final frame (the one that completes it) goes out only if the fence still holds (5.3
        # post-check).
        iterator: Iterator[str | bytes] = iter(frames)
        pending = next(iterator)
        for frame in iterator:  # computing the next frame is this turn's work
            await self._put(pending)
            await self.pass_turn()
            pending = frame
        if self.fencing is not None:
            self.fencing.check()
        await self._put(pending)


# --- the session ------------------------------------------------------------------------------------


class Session:
    """One websocket connection: reads requests until the peer leaves, answers each in its own encoding."""

    def __init__(
        self, ws: WebSocket, config: SessionConfig, slot: str | None, header_token: str | None
    ) -> None:
        self.ws = ws
        self.config = config
        self.slot = slot
        self._header_token = header_token
        self._following = False

    async def run(self) -> None:
        """Serve requests until the connection closes (ConnectionClosed escapes)."""
        while True:
            try:
                message = await self.ws.get_message()
            except MessageTooBig as exc:
                await self._refuse_oversized(exc)
                continue
            await self._handle(message)

    async def _refuse_oversized(self, exc: MessageTooBig) -> None:
        # The frame was discarded as it arrived, so its id is unknown; the connection stays usable.
        self.config.counters.count_request("invalid")
        self.config.counters.count_error("bad_request")
        encoding = Encoding.MSGPACK if exc.binary else Encoding.JSON
        await self.ws.send_message(error_frame(encoding, None, "bad_request", str(exc)))

    async def _handle(self, message: str | bytes) -> None:
        """Answer one request frame; only ConnectionClosed (and cancellation) escapes."""
        encoding = frame_encoding(message)
        request_id: int | None = None
        counters = self.config.counters
        op_label = "invalid"
        started = trio.current_time()
        turn = self.config.turns.turn()
        try:
            encoding, value = decode_frame(message)  # bounded by the frame size and nesting limits
            request_id, request = parse_request(value)
            op = request_op(request)
            op_label = op if op in KNOWN_OPS else "invalid"
            counters.count_request(op_label)
            await self._dispatch(op, request, AnswerWriter(self.ws, encoding, request_id, turn))
        except KvAgentError as exc:
            log.info("request_failed", slot=self.slot, code=exc.code)
            counters.count_error(exc.code)
            await self.ws.send_message(error_frame(encoding, request_id, exc.code, exc.message))
        except ConnectionClosed:
            raise
        except Exception:
            log.exception("request_failed_unexpectedly", slot=self.slot)
            counters.count_error("internal")
            await self.ws.send_message(error_frame(encoding, request_id, "internal", "internal error"))
        finally:
            turn.release()
            if op_label != "follow":
                counters.count_request_seconds(trio.current_time() - started, op_label)

    async def _dispatch(self, op: str, request: Mapping[str, Any], writer: AnswerWriter) -> None:
        request_id = writer.request_id
        if op == "list":
            await writer.send({"id": request_id, "ok": True, "slots": self._list_slots()})
            return
        if op not in SLOT_OPS:
            raise KvAgentError(f"unknown op {op!r}", code="unknown_op")
        if self.slot is None:
            raise KvAgentError(f"op {op!r} needs a slot path /v1/slots/<slot>", code="bad_request")
        if op in CONTROL_OPS:
            self._authorize(request)
            result = await self._control(op, request)
            await writer.send({"id": request_id, "ok": True, **result})
        elif op == "status":
            status = self._surface().status()
            check_status_fence(status, parse_fence(request))
            await writer.send({"id": request_id, "ok": True, "status": status.to_json()})
        elif op == "recover":
            await self._recover(request, writer)
        else:
            await self._follow(request, writer)

    def _surface(self) -> SlotSurface:
        surface = None if self.slot is None else self.config.registry.get(self.slot)
        if surface is None:
            raise KvAgentError(f"slot {self.slot!r} is no longer served here", code="not_ready")
        return surface

    def _list_slots(self) -> list[dict[str, object]]:
        registry = self.config.registry
        slots: list[dict[str, object]] = []
        for name in registry.names():
            surface = registry.get(name)
            if surface is not None:
                slots.append({"name": name, "status": surface.status().to_json()})
        return slots

    # --- control ops --------------------------------------------------------------------------------

    def _authorize(self, request: Mapping[str, Any]) -> None:
        expected = self.config.token
        offered = request.get("token", self._header_token)
        if expected is None:
            raise KvAgentError("control ops are disabled: the server has no token", code="unauthorized")
        if not isinstance(offered, str):
            raise KvAgentError("control ops require a bearer token", code="unauthorized")
        if not hmac.compare_digest(offered.encode(), expected.encode()):
            raise KvAgentError("invalid bearer token", code="unauthorized")

    async def _control(self, op: str, request: Mapping[str, Any]) -> dict[str, object]:
        surface = self._surface()
        if op == "attach":
            replay = request.get("replay_endpoint")
            if replay is not None and not isinstance(replay, str):
                raise KvAgentError("replay_endpoint must be null or a string", code="bad_request")
            attachment = await surface.control_attach(
                worker_id=required_uint(request, "worker_id"),
                dp_rank=required_uint(request, "dp_rank", U32_MAX),
                endpoint=required_str(request, "endpoint"),
                topic=required_str(request, "topic", ""),
                replay_endpoint=replay,
            )
            return {"attachment": attachment.to_json()}
        generation = required_uint(request, "generation")
        if op == "detach":
            return {"cursor": await surface.control_detach(generation)}
        reason = required_str(request, "reason")
        if not reason:
            raise KvAgentError("reason must be a non-empty string", code="bad_request")
        await surface.control_quarantine(generation, reason)
        return {}

    # --- recover ------------------------------------------------------------------------------------

    async def _recover(self, request: Mapping[str, Any], writer: AnswerWriter) -> None:
        surface = self._surface()
        start = optional_uint(request, "start")
        end = optional_uint(request, "end")
        supports_failed = request.get("supports_tree_dump_failed", False) is True
        dump_format = parse_dump_format(request)
        fence = parse_fence(request)
        before = surface.status()
        check_recovery_fence(before, fence, surface.slot_rank)
        if _is_dump(surface.index, start, end) and await self.config.turns.admit(writer.turn):
            # Heavy work waited for its turn (or was refused as overloaded): the wait was a schedule
            # point, so the status the answer vouches for is read again.
            before = surface.status()
            check_recovery_fence(before, fence, surface.slot_rank)
        result = surface.index.range_or_snapshot(start, end)
        fencing = _Fencing(surface, before, fence)
        writer = attrs.evolve(writer, fencing=fencing)
        if isinstance(result, DumpSnapshot):
            groups, scope = filter_snapshot(result, before, fence)
            fencing.check()
            await writer.dump(result, groups, scope, dump_format)
            return
        answer = filter_answer(result, before, fence)
        fencing.check()
        await writer.range_answer(answer, encoded_ring(surface.index), supports_failed=supports_failed)

    # --- follow -------------------------------------------------------------------------------------

    async def _follow(self, request: Mapping[str, Any], writer: AnswerWriter) -> None:
        """Serve one follow until the client leaves, the follower is overrun, or the backlog is unavailable."""
        if self._following:
            raise KvAgentError("this connection is already following; open another one", code="bad_request")
        surface = self._surface()
        from_cursor = optional_uint(request, "from")
        dump_format = parse_dump_format(request)
        if _is_dump(surface.index, None if from_cursor is None else from_cursor + 1, None):
            await self.config.turns.admit(writer.turn)  # heavy: or refused as overloaded
        follow = open_follow(surface.index, from_cursor, self.config.follow_buffer_events)
        self._following = True
        failure: KvAgentError | None = None
        closed = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_while_following, nursery.cancel_scope)
                await self._stream_follow(writer, follow, encoded_ring(surface.index), dump_format)
                nursery.cancel_scope.cancel()
        except* ConnectionClosed:
            closed = True  # the next read in run() sees the close and ends the connection quietly
        except* KvAgentError as group:
            failure = _first_agent_error(group)
        finally:
            follow.unsubscribe()
            self._following = False
        if failure is not None and not closed:
            raise failure  # answered like any failed request

    async def _read_while_following(self, cancel_scope: trio.CancelScope) -> None:
        """Keep reading the connection during a follow: answer other requests, notice the close promptly."""
        try:
            await self.run()
        except ConnectionClosed:
            cancel_scope.cancel()

    async def _stream_follow(
        self, writer: AnswerWriter, follow: FollowSession, ring: EncodedRing, dump_format: str
    ) -> None:
        backlog = follow.backlog
        if isinstance(backlog, DumpSnapshot):
            last_sent: int | None = await writer.dump(backlog, backlog.groups, RESET_ALL, dump_format)
        elif isinstance(backlog, InvalidRangeAnswer):  # impossible: a follow's range has no end
            raise KvAgentError("unexpected follow backlog InvalidRangeAnswer", code="internal")
        else:
            last_sent = await writer.range_answer(backlog, ring, supports_failed=False)
        if last_sent is not None:
            await self._send_live(writer, follow.buffer, ring, last_sent)

    async def _send_live(
        self, writer: AnswerWriter, buffer: LiveBuffer, ring: EncodedRing, last_sent: int
    ) -> None:
        # The client now holds a consistent state through last_sent; an overrun during the backlog is only
        # reported here, so last_sent is always a real cursor (never a point inside a tree dump).
        while True:
            if buffer.overrun:
                log.warning("follower_overrun", slot=self.slot, last_sent=last_sent)
                await writer.send(
                    {"id": writer.request_id, "ok": True, "kind": "overrun", "last_sent": last_sent}
                )
                self.ws.close(CLOSE_TRY_AGAIN_LATER, "follower fell behind; resume with from = last_sent")
                return
            # Events at or below the backlog's cursor were already delivered by it (none are expected).
            events = [event for event in buffer.drain(LIVE_BATCH_EVENTS) if event.event_id > last_sent]
            if not events:
                await self._wait_live(writer, buffer)
                continue
            await writer.live(events, ring)
            last_sent = events[-1].event_id

    @staticmethod
    async def _wait_live(writer: AnswerWriter, buffer: LiveBuffer) -> None:
        """Wait for live events without holding a turn (a live frame is light work)."""
        writer.turn.release()
        await buffer.wait()


def _is_dump(index: RecoveryIndex, start: int | None, end: int | None) -> bool:
    """Whether ``range_or_snapshot(start, end)`` answers with a tree dump (its first check, without the
    dump): heavy work that must wait for a turn."""
    return index.answers_with_dump(start, end)


def _first_agent_error(group: BaseExceptionGroup[KvAgentError]) -> KvAgentError:
    first = group.exceptions[0]
    return first if isinstance(first, KvAgentError) else _first_agent_error(first)
