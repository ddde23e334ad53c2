"""Recovery/control protocol v1: frame encoding, request parsing, fencing and answer framing (sans-IO).

Also the values a recovery session works with: the op tables, the answer headers and receipts, the slot
protocols the server sees slots through, and the server's statistics snapshot.

Text frames carry JSON, binary frames carry msgpack; a response uses the encoding of its request.  Event
lists are framed by hand from individually encoded events so a large answer is split into frames of at most
:data:`MAX_FRAME_BYTES` without encoding anything twice (one event is never split).  docs/protocol.md is the
normative description.
"""

from __future__ import annotations

import bisect
import json
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import attrs
import msgpack

from kvagent._util.latency import LatencySnapshot
from kvagent.index.recovery_index import (
    EventsAnswer,
    InvalidRangeAnswer,
    RangeAnswer,
    RecoveryIndex,
    TooNewAnswer,
    TreeDumpAnswer,
    TreeDumpFailedAnswer,
)
from kvagent.index.ring import RingEvents
from kvagent.model.errors import IdentityError, KvAgentError
from kvagent.model.events import RESET_ALL, U32_MAX, U64_MAX, ResetScope, ResidencyDomain, RouterEvent
from kvagent.model.ids import KvStateAgentIdentity
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.wire.router_event import Encoding, encode_event

__all__ = [
    "CONTROL_OPS",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_URL",
    "KNOWN_OPS",
    "SLOT_OPS",
    "ServerStatistics",
    "SlotDirectory",
    "SlotSurface",
    "frame_encoding",
    "parse_request",
    "range_header",
    "receipt",
    "request_op",
    "single_frame_answer",
    "MAX_FRAME_BYTES",
    "NESTED_TOO_DEEPLY",
    "CACHE_OWNER_INCREMENTAL_UNSUPPORTED",
    "CHANGED_DURING_RECOVERY",
    "EncodedRun",
    "EncodedRuns",
    "Encoding",
    "Fence",
    "check_recovery_fence",
    "check_status_fence",
    "decode_frame",
    "encode_event",
    "encode_frame",
    "error_frame",
    "event_frames",
    "filter_answer",
    "optional_uint",
    "parse_fence",
    "post_check",
    "required_str",
    "required_uint",
]

# Where the recovery server listens unless told otherwise (`kvagent serve --listen`), so where clients look.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_URL = f"ws://{DEFAULT_HOST}:{DEFAULT_PORT}"

MAX_FRAME_BYTES = 1 << 20  # trio-websocket's default receive limit: every frame we send must fit it
NESTED_TOO_DEEPLY = "request nests arrays/maps too deeply"

CACHE_OWNER_INCREMENTAL_UNSUPPORTED = (
    "CacheOwner-only incremental recovery is unsupported; request a full state-agent snapshot"
)
CHANGED_DURING_RECOVERY = "KV state-agent identity, readiness or generation changed during recovery"
STATUS_IDENTITY_MISMATCH = "KV state-agent status identity mismatch"

CONTROL_OPS = frozenset({"attach", "detach", "quarantine"})
SLOT_OPS = frozenset({"status", "recover", "follow"}) | CONTROL_OPS  # ops that need /v1/slots/<slot>
KNOWN_OPS = SLOT_OPS | {"list"}


class SlotSurface(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def slot_rank(self) -> int: ...

    @property
    def index(self) -> RecoveryIndex: ...

    def status(self) -> AgentStatus: ...

    async def control_attach(
        self, *, worker_id: int, dp_rank: int, endpoint: str, topic: str, replay_endpoint: str | None
    ) -> AttachmentStatus: ...

    async def control_detach(self, generation: int) -> int: ...

    async def control_quarantine(self, generation: int, reason: str) -> None: ...


class SlotDirectory(Protocol):
    """The slots a recovery server answers for, by name; the agent's host implements it."""

    def get(self, name: str) -> SlotSurface | None: ...

    def names(self) -> list[str]: ...


@attrs.frozen(slots=True)
class ServerStatistics:
    """A snapshot of the recovery server's counters (``ServerStats.statistics()``).

    Attributes:
        connections_open: websocket connections currently being served.
        connections_total: websocket connections accepted since the server started.
        rejected: refused handshakes by HTTP status (403 token in URL, 404 unknown path, 503 too many).
        requests: requests by op; an op the server does not know counts as ``"invalid"``, so a hostile
            client cannot grow the label set.
        request_errors: error responses by error code.
        request_seconds_sum: seconds spent answering requests, ``follow`` excluded (its duration is the
            lifetime of a stream, not the cost of a request).
        handshakes_pending: connections accepted whose websocket handshake is not finished yet.
        handshake_timeouts: connections closed because their handshake missed its deadline.
        handshakes_dropped: connections closed in their handshake to make room under the pre-handshake
            limit, or to free descriptors when ``accept`` ran out of them.
        send_overruns: connections closed (1013 "overrun") because the peer did not take a frame within
            the send deadline.
        ping_timeouts: connections closed because the peer did not answer a ping in time.
        accept_capacity_errors: ``accept`` calls that failed for lack of descriptors or memory.
        request_latency: the seconds each request took to answer, by op (``follow`` excluded), as
            histograms; left out of equality (a snapshot of timings never compares equal by value).
    """

    connections_open: int
    connections_total: int
    rejected: Mapping[int, int]
    requests: Mapping[str, int]
    request_errors: Mapping[str, int]
    request_seconds_sum: float
    handshakes_pending: int = 0
    handshake_timeouts: int = 0
    handshakes_dropped: int = 0
    send_overruns: int = 0
    ping_timeouts: int = 0
    accept_capacity_errors: int = 0
    request_latency: Mapping[str, LatencySnapshot] = attrs.field(factory=dict, eq=False)


# --- frames -----------------------------------------------------------------------------------------


def frame_encoding(message: str | bytes) -> Encoding:
    """The encoding a frame's answer uses, known even when the frame does not parse."""
    return Encoding.MSGPACK if isinstance(message, bytes) else Encoding.JSON


def decode_frame(message: str | bytes) -> tuple[Encoding, object]:
    """The frame's encoding and decoded value; KvAgentError(bad_request) when it does not parse.

    Nesting is bounded by the decoders themselves, in linear time: the JSON parser stops at the
    interpreter's recursion limit (about 1000 levels) and msgpack at its decoder stack (1024 levels); both
    become ``bad_request``.  (A bracket-counting pre-scan would need to skip strings, which a regex cannot
    do in linear time on hostile input.)
    """
    if isinstance(message, str):
        try:
            return Encoding.JSON, json.loads(message)
        except RecursionError:
            raise KvAgentError(NESTED_TOO_DEEPLY, code="bad_request") from None
        except ValueError:
            raise KvAgentError("request is not valid JSON", code="bad_request") from None
    try:
        return Encoding.MSGPACK, msgpack.unpackb(message, raw=False, strict_map_key=False)
    except msgpack.StackError:
        raise KvAgentError(NESTED_TOO_DEEPLY, code="bad_request") from None
    except Exception:  # msgpack raises several unrelated types for malformed input
        raise KvAgentError("request is not valid msgpack", code="bad_request") from None


def encode_frame(encoding: Encoding, value: Mapping[str, object]) -> str | bytes:
    if encoding is Encoding.JSON:
        return json.dumps(value, separators=(",", ":"))
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def error_frame(encoding: Encoding, request_id: int | None, code: str, message: str) -> str | bytes:
    return encode_frame(
        encoding, {"id": request_id, "ok": False, "error": {"code": code, "message": message}}
    )


def too_new_response(request_id: int, answer: TooNewAnswer) -> dict[str, object]:
    """The single-frame answer to a range that starts after the newest buffered event."""
    return {
        "id": request_id,
        "ok": True,
        "kind": "too_new",
        "requested_start": answer.requested_start,
        "requested_end": answer.requested_end,
        "newest_available": answer.newest_available,
    }


def single_frame_answer(
    request_id: int, answer: TooNewAnswer | InvalidRangeAnswer | TreeDumpFailedAnswer
) -> dict[str, object]:
    """The answers that carry no events: one frame each."""
    if isinstance(answer, TooNewAnswer):
        return too_new_response(request_id, answer)
    if isinstance(answer, InvalidRangeAnswer):
        return {
            "id": request_id,
            "ok": True,
            "kind": "invalid_range",
            "start_id": answer.start_id,
            "end_id": answer.end_id,
        }
    return {
        "id": request_id,
        "ok": True,
        "kind": "tree_dump_failed",
        "last_event_id": answer.last_event_id,
        "message": answer.message,
    }


def range_header(request_id: int, answer: EventsAnswer | TreeDumpAnswer) -> dict[str, object]:
    """The header every frame of an ``events`` or ``tree_dump`` answer repeats (the events follow it)."""
    header: dict[str, object] = {
        "id": request_id,
        "ok": True,
        "kind": "events" if isinstance(answer, EventsAnswer) else "tree_dump",
        "last_event_id": answer.last_event_id,
    }
    if isinstance(answer, TreeDumpAnswer):
        header["reset_scope"] = answer.reset_scope.to_json()
    return header


def receipt(status: AgentStatus, fence: Fence, recovered_through: int) -> dict[str, object]:
    """What a ``recover`` answer vouches for: whose state, under which generation, through which cursor."""
    return {
        "identity": status.identity.to_json(),
        "attachment_generation": fence.generation,
        "recovered_through_cursor": recovered_through,
    }


def _assemble(
    encoding: Encoding, header: Mapping[str, object], parts: Sequence[str | bytes], more: bool | None
) -> str | bytes:
    if encoding is Encoding.JSON:
        head = json.dumps(header, separators=(",", ":"))
        tail = "" if more is None else (',"more":true' if more else ',"more":false')
        return f'{head[:-1]},"events":[{",".join(parts)}]{tail}}}'  # type: ignore[arg-type]
    packer = msgpack.Packer(use_bin_type=True)
    pieces = [packer.pack_map_header(len(header) + (1 if more is None else 2))]
    for key, value in header.items():
        pieces.append(packer.pack(key))
        pieces.append(packer.pack(value))
    pieces.append(packer.pack("events"))
    pieces.append(packer.pack_array_header(len(parts)))
    pieces.extend(parts)
    if more is not None:
        pieces.append(packer.pack("more"))
        pieces.append(packer.pack(more))
    return b"".join(pieces)


class EncodedRun(NamedTuple):
    """Encoded events in one buffer: event i ends at ``ends[i]``; JSON events are separated by one comma
    (event i > 0 starts one byte after ``ends[i - 1]``), msgpack events are back to back.

    A range answer is one slice of a ring segment's encoding and a dump chunk one buffer written by the
    column encoders (kvagent/recovery/wire_columns.py): frames are cut at event ends, never per event.
    """

    blob: bytes | bytearray | str
    ends: array[int]
    separator: int  # 1 for JSON (the comma), 0 for msgpack

    def parts(self) -> Iterator[str | bytes]:
        blob, separator = self.blob, self.separator
        start = 0
        for end in self.ends:
            part = blob[start:end]
            yield bytes(part) if isinstance(part, bytearray) else part
            start = end + separator


class EncodedRuns:
    """Encoded events as runs (:class:`EncodedRun`), produced lazily; iterating yields the single events.

    :func:`event_frames` frames them a slice per frame instead of an event at a time.
    """

    __slots__ = ("_runs",)

    def __init__(self, runs: Iterable[EncodedRun]) -> None:
        self._runs = runs

    def runs(self) -> Iterator[EncodedRun]:
        return iter(self._runs)

    def __iter__(self) -> Iterator[str | bytes]:
        for run in self.runs():
            yield from run.parts()


def event_frames(
    encoding: Encoding,
    header: Mapping[str, object],
    encoded_events: Iterable[str | bytes] | EncodedRuns,
    *,
    more_flag: bool = True,
    limit: int = MAX_FRAME_BYTES,
) -> Iterator[str | bytes]:
    """Frames ``header + events [+ more]``, each at most ``limit`` long; always at least one frame.

    ``more`` is true on all frames but the last (when ``more_flag``).  A single event too large for a frame
    raises KvAgentError(too_large): sending it would make a default client close with 1009.
    """
    # Fixed cost of a frame: the header and the empty list (with the longer "more" value), plus room for a
    # msgpack array header (at most 5 bytes).
    overhead = len(_assemble(encoding, header, (), False if more_flag else None)) + 5
    budget = limit - overhead
    if isinstance(encoded_events, EncodedRuns):
        yield from _run_frames(encoding, header, encoded_events, more_flag, budget, limit)
        return
    if isinstance(encoded_events, list) and sum(map(len, encoded_events)) + len(encoded_events) <= budget:
        # The usual buffered answer: one frame, sized at C speed instead of event by event.
        yield _assemble(encoding, header, encoded_events, False if more_flag else None)
        return
    pending: list[str | bytes] = []
    pending_size = 0
    sent_any = False
    for part in encoded_events:
        size = len(part) + 1  # the JSON comma; msgpack needs none, the header allowance covers it
        if size > budget:
            raise _too_large(size, limit)
        if pending and pending_size + size > budget:
            yield _assemble(encoding, header, pending, True if more_flag else None)
            sent_any = True
            pending = []
            pending_size = 0
        pending.append(part)
        pending_size += size
    if pending or not sent_any:
        yield _assemble(encoding, header, pending, False if more_flag else None)


def _too_large(size: int, limit: int) -> KvAgentError:
    return KvAgentError(
        f"one event needs {size} bytes, more than the {limit}-byte frame limit", code="too_large"
    )


def _run_frames(
    encoding: Encoding,
    header: Mapping[str, object],
    encoded: EncodedRuns,
    more_flag: bool,
    budget: int,
    limit: int,
) -> Iterator[str | bytes]:
    """:func:`event_frames` over runs: the same frame budget (each event counts its length plus one), the
    events of a frame found by bisection over the run's ends, each frame one slice per run it spans."""
    chunks: list[memoryview | str] = []  # slices of runs, each a comma-separated list in JSON
    count = 0  # events in ``chunks``
    room = budget
    sent_any = False
    for run in encoded.runs():
        blob, ends, separator = run
        # Slices of a bytes-like run are views: the frame's join is then the only copy.
        view = blob if isinstance(blob, str) else memoryview(blob)
        total = len(ends)
        position = 0
        while position < total:
            start = ends[position - 1] + separator if position else 0
            # Events position..j-1 cost ends[j-1] - start - separator*(j-1-position) + (j - position): the
            # key below is that cost's part that grows with j, so the fitting j is found by bisection.
            step = 1 - separator
            threshold = room + start + step * position - separator
            fit = bisect.bisect_right(
                range(position, total), threshold, key=lambda k: ends[k] + step * (k + 1)
            )
            if fit == 0:
                if count:
                    yield _assemble_chunks(encoding, header, chunks, count, True if more_flag else None)
                    sent_any = True
                    chunks, count, room = [], 0, budget
                    continue
                raise _too_large(ends[position] - start + 1, limit)
            stop = position + fit
            chunks.append(view[start : ends[stop - 1]])
            count += fit
            room -= ends[stop - 1] - start + step * fit + separator
            position = stop
    if count or not sent_any:
        yield _assemble_chunks(encoding, header, chunks, count, False if more_flag else None)


def _assemble_chunks(
    encoding: Encoding,
    header: Mapping[str, object],
    chunks: Sequence[memoryview | str],
    count: int,
    more: bool | None,
) -> str | bytes:
    """A frame from run slices holding ``count`` events in all (see :func:`_assemble`)."""
    if encoding is Encoding.JSON:
        head = json.dumps(header, separators=(",", ":"))
        tail = "" if more is None else (',"more":true' if more else ',"more":false')
        return f'{head[:-1]},"events":[{",".join(chunks)}]{tail}}}'  # type: ignore[arg-type]
    packer = msgpack.Packer(use_bin_type=True)
    pieces: list[bytes | memoryview] = [packer.pack_map_header(len(header) + (1 if more is None else 2))]
    for key, value in header.items():
        pieces.append(packer.pack(key))
        pieces.append(packer.pack(value))
    pieces.append(packer.pack("events"))
    pieces.append(packer.pack_array_header(count))
    pieces.extend(chunks)  # type: ignore[arg-type]
    if more is not None:
        pieces.append(packer.pack("more"))
        pieces.append(packer.pack(more))
    return b"".join(pieces)


# --- requests ---------------------------------------------------------------------------------------


def parse_request(value: object) -> tuple[int, Mapping[str, Any]]:
    """A decoded frame as (request id, request); KvAgentError(bad_request) unless it is a valid request."""
    if not isinstance(value, dict):
        raise KvAgentError("request must be an object", code="bad_request")
    request_id = value.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id <= U64_MAX:
        raise KvAgentError("request id must be an integer in [0, 2^64 - 1]", code="bad_request")
    return request_id, value


def request_op(request: Mapping[str, Any]) -> str:
    op = request.get("op")
    if not isinstance(op, str):
        raise KvAgentError("op must be a string", code="bad_request")
    return op


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def optional_uint(request: Mapping[str, Any], key: str, maximum: int = U64_MAX) -> int | None:
    value = request.get(key)
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= maximum:
        raise KvAgentError(f"{key} must be null or an integer in [0, {maximum}]", code="bad_request")
    return int(value)


def required_uint(request: Mapping[str, Any], key: str, maximum: int = U64_MAX) -> int:
    value = optional_uint(request, key, maximum)
    if value is None:
        raise KvAgentError(f"{key} is required", code="bad_request")
    return value


def required_str(request: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = request.get(key, default)
    if not isinstance(value, str):
        raise KvAgentError(f"{key} must be a string", code="bad_request")
    return value


# --- fencing (docs/spec/agent-semantics.md 5.2, 5.3) ----------------------------------------------------------


@attrs.frozen(slots=True)
class Fence:
    """What a request asked to be checked; ``fenced`` is False for the operator's unfenced full view."""

    expected_identity: KvStateAgentIdentity | None
    generation: int | None
    worker_id: int | None
    dp_rank: int | None

    @property
    def fenced(self) -> bool:
        return self.expected_identity is not None or self.generation is not None


def parse_fence(request: Mapping[str, Any]) -> Fence:
    raw_identity = request.get("expected_identity")
    identity = None
    if raw_identity is not None:
        try:
            identity = KvStateAgentIdentity.from_json(raw_identity)
        except (IdentityError, TypeError) as exc:
            raise KvAgentError(f"expected_identity: {exc}", code="bad_request") from None
    return Fence(
        identity,
        optional_uint(request, "generation"),
        optional_uint(request, "worker_id"),
        optional_uint(request, "dp_rank", U32_MAX),
    )


def check_status_fence(status: AgentStatus, fence: Fence) -> None:
    if fence.expected_identity is not None and status.identity != fence.expected_identity:
        raise KvAgentError(STATUS_IDENTITY_MISMATCH, code="identity_mismatch")
    if fence.generation is not None:
        if status.attachment is None:
            raise KvAgentError(
                "KV state-agent status has no attachment for the expected generation",
                code="generation_mismatch",
            )
        if status.attachment.generation != fence.generation:
            raise KvAgentError(
                "KV state-agent status attachment generation mismatch", code="generation_mismatch"
            )


def check_recovery_fence(status: AgentStatus, fence: Fence, slot_rank: int) -> None:
    """5.3 identity and generation fencing; does nothing for an unfenced request."""
    if not fence.fenced:
        return
    if fence.expected_identity is not None and status.identity != fence.expected_identity:
        raise KvAgentError("KV state-agent recovery identity mismatch", code="identity_mismatch")
    if not status.cache_owner_ready:
        raise KvAgentError("KV state-agent CacheOwner domain is not ready", code="not_ready")
    if fence.generation is None:
        if fence.dp_rank is not None and fence.dp_rank != slot_rank:
            raise KvAgentError(
                "KV state-agent recovery dp_rank does not match the slot's rank", code="bad_request"
            )
        return
    attachment = status.attachment
    if attachment is None:
        raise KvAgentError("KV state-agent recovery has no attachment", code="generation_mismatch")
    if attachment.generation != fence.generation:
        raise KvAgentError(
            "KV state-agent recovery attachment generation mismatch", code="generation_mismatch"
        )
    if not attachment.ready:
        raise KvAgentError("KV state-agent recovery attachment is not ready", code="not_ready")
    if (fence.worker_id is not None and fence.worker_id != attachment.worker.worker_id) or (
        fence.dp_rank is not None and fence.dp_rank != attachment.worker.dp_rank
    ):
        raise KvAgentError(
            "KV state-agent recovery worker does not match the attachment", code="generation_mismatch"
        )


def _fence_view(status: AgentStatus) -> tuple[object, ...]:
    attachment = status.attachment
    return (
        status.identity,
        status.cache_owner_ready,
        None if attachment is None else (attachment.generation, attachment.ready),
    )


def post_check(before: AgentStatus, after: AgentStatus, fence: Fence) -> None:
    """5.3 post-check: a fenced answer is void if identity, readiness or generation moved meanwhile."""
    if fence.fenced and _fence_view(before) != _fence_view(after):
        raise KvAgentError(CHANGED_DURING_RECOVERY, code="not_ready")


CACHE_OWNER_SCOPE = ResetScope(ResidencyDomain.CACHE_OWNER)


def filter_answer(answer: RangeAnswer, status: AgentStatus, fence: Fence) -> RangeAnswer:
    """5.3 filtering: unfenced = full view; with a generation = Worker + own CacheOwner; else CacheOwner-only."""
    if not fence.fenced or not isinstance(answer, EventsAnswer | TreeDumpAnswer):
        return answer
    owner = status.identity.cache_owner_id

    def own_cache_owner(event: RouterEvent) -> bool:
        return event.residency_domain is ResidencyDomain.CACHE_OWNER and event.state_source == owner

    if fence.generation is not None:
        events = answer.events
        if isinstance(answer, EventsAnswer) and isinstance(events, RingEvents):
            # Straight from the ring's columns: a route is kept or not as a whole.
            kept_range = events.ring_range.select(
                lambda route: (
                    route.domain is ResidencyDomain.WORKER
                    or (route.domain is ResidencyDomain.CACHE_OWNER and route.state_source == owner)
                )
            )
            if kept_range is not None:
                return EventsAnswer(RingEvents(kept_range), answer.last_event_id)
        kept = tuple(
            event
            for event in answer.events
            if event.residency_domain is ResidencyDomain.WORKER or own_cache_owner(event)
        )
        if isinstance(answer, EventsAnswer):
            return EventsAnswer(kept, answer.last_event_id)
        return TreeDumpAnswer(kept, answer.last_event_id, RESET_ALL)
    if isinstance(answer, EventsAnswer):
        raise KvAgentError(CACHE_OWNER_INCREMENTAL_UNSUPPORTED, code="bad_request")
    kept = tuple(event for event in answer.events if own_cache_owner(event))
    return TreeDumpAnswer(kept, answer.last_event_id, CACHE_OWNER_SCOPE)
