"""Trio clients for routers: the websocket recovery protocol v1, and ``subscribe`` (event plane + repair).

One :class:`RecoveryClient` owns one connection and sends one request at a time; a streamed answer
(``"more": true`` frames) is reassembled by :meth:`RecoveryClient.recover`, while
:meth:`RecoveryClient.follow` yields frame by frame so a large backlog never has to sit in memory whole.
:func:`subscribe` reads the lossy ZMQ event plane and fills its gaps with ``recover``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import attrs
import msgpack
import zmq
from trio_websocket import WebSocketConnection, open_websocket_url

from kvagent._util.gcutil import gc_paused
from kvagent._util.zmqtrio import TrioSocket
from kvagent.model.errors import CodecError, FollowOverrun, IdentityError, RecoveryClientError
from kvagent.model.events import (
    RouterEvent,
)
from kvagent.model.ids import KvStateAgentIdentity
from kvagent.model.status import AgentStatus
from kvagent.recovery.dump import DumpColumns, dump_columns_from_wire
from kvagent.wire.event_plane import EVENT_PLANE_TOPIC, decode_event_plane_message, is_event_plane_message
from kvagent.wire.router_event import (
    decode_router_events,
    router_event_from_json,
    router_event_to_json,
)

__all__ = [
    "DumpColumns",
    "FollowItem",
    "FollowOverrun",
    "RecoverResult",
    "RecoveryClient",
    "RecoveryClientError",
    "SubscribeGapError",
    "agent_status_from_json",
    "connect_slot",
    "subscribe",
]

CLIENT_MAX_MESSAGE_BYTES = 4 << 20  # the server sends frames of at most 1 MiB; leave headroom
# trio-websocket reads 4 KiB at a time by default: a 1 MiB frame then costs 256 reads, each through
# wsproto's parser, which made the client's reader the bottleneck of many concurrent recoveries.
CLIENT_RECEIVE_BYTES = 256 << 10


@attrs.frozen(slots=True)
class RecoverResult:
    """A reassembled ``recover`` answer; ``raw`` is the merged response without its events.

    ``events`` holds decoded RouterEvents, unless the request asked for ``raw_events`` (then the wire maps
    are in ``wire_events``) or for the ``columns`` dump format (then a tree dump is in ``dump``).
    """

    kind: str
    events: tuple[RouterEvent, ...]
    raw: Mapping[str, Any]
    wire_events: tuple[Mapping[str, Any], ...] = ()
    dump: tuple[DumpColumns, ...] = ()
    events_msgpack: tuple[bytes, ...] = ()  # lazy_events: each frame's msgpack array of events, undecoded

    def all_events(self) -> Iterator[RouterEvent]:
        """The answer's events whatever form they came in (decoding wire maps, arrays or dump columns)."""
        yield from self.events
        yield from _events({"events": self.wire_events})
        for blob in self.events_msgpack:
            try:
                yield from decode_router_events(blob)
            except CodecError as exc:
                raise RecoveryClientError("bad_response", f"malformed event: {exc}") from None
        for piece in self.dump:
            yield from piece.events()

    @property
    def last_event_id(self) -> int | None:
        value = self.raw.get("last_event_id")
        return value if isinstance(value, int) else None

    @property
    def receipt(self) -> Mapping[str, Any] | None:
        return self.raw.get("receipt")

    @property
    def reset_scope(self) -> object:
        return self.raw.get("reset_scope")

    def to_json(self) -> dict[str, Any]:
        return {**self.raw, "events": [router_event_to_json(event) for event in self.all_events()]}


@attrs.frozen(slots=True)
class FollowItem:
    """One follow frame: backlog (``events`` / ``tree_dump``; ``more`` until its last frame) or ``live``."""

    kind: str
    events: tuple[RouterEvent, ...]
    last_event_id: int | None = None
    more: bool = False
    reset_scope: object = None
    dump: tuple[DumpColumns, ...] = ()  # a tree dump backlog frame, when following with dump_format="columns"


def agent_status_from_json(value: object) -> AgentStatus:
    """The inverse of ``AgentStatus.to_json``; a malformed status raises RecoveryClientError."""
    try:
        return AgentStatus.from_json(value)
    except (CodecError, IdentityError) as exc:
        raise RecoveryClientError("bad_response", f"malformed status: {exc!r}") from None


def _events(frame: Mapping[str, Any]) -> list[RouterEvent]:
    try:
        return [router_event_from_json(event) for event in frame.get("events") or ()]
    except CodecError as exc:
        raise RecoveryClientError("bad_response", f"malformed event: {exc}") from None


class RecoveryClient:
    def __init__(self, ws: WebSocketConnection, *, encoding: str = "json", token: str | None = None) -> None:
        if encoding not in ("json", "msgpack"):
            raise ValueError(f"encoding must be 'json' or 'msgpack', got {encoding!r}")
        self.ws = ws
        self.binary = encoding == "msgpack"
        self._token = token  # only sent in control requests, never logged
        self._next_id = 0

    async def _send(self, op: str, fields: Mapping[str, Any]) -> int:
        self._next_id += 1
        request = {"id": self._next_id, "op": op, **fields}
        message = msgpack.packb(request, use_bin_type=True) if self.binary else json.dumps(request)
        await self.ws.send_message(message)
        return self._next_id

    async def _frame(self, request_id: int, lazy: bool = False) -> dict[str, Any]:
        """The next frame answering ``request_id``; an error response raises RecoveryClientError.

        ``lazy``: a msgpack frame's ``events`` array is not decoded but sliced out as bytes (key
        ``events_msgpack``); skipping it is C speed and creates no objects.
        """
        while True:
            message = await self.ws.get_message()
            try:
                with gc_paused():
                    if lazy and isinstance(message, bytes):
                        value = _lazy_msgpack_frame(message)
                    elif isinstance(message, bytes):
                        value = msgpack.unpackb(message, raw=False, strict_map_key=False)
                    else:
                        value = json.loads(message)
            except Exception as exc:  # msgpack raises several unrelated types
                raise RecoveryClientError("bad_response", f"undecodable frame: {exc!r}") from None
            if not isinstance(value, dict):
                raise RecoveryClientError("bad_response", "frame is not an object")
            if value.get("id") != request_id:
                continue  # not ours (e.g. a refusal of a stray request)
            if value.get("ok") is not True:
                error = value.get("error") or {}
                raise RecoveryClientError(str(error.get("code", "internal")), str(error.get("message", "")))
            return value

    async def request(self, op: str, *, lazy: bool = False, **fields: Any) -> dict[str, Any]:
        """One request and its (possibly streamed) answer, events concatenated as raw JSON objects.

        With ``lazy`` (msgpack only) the events stay encoded: a list of per-frame arrays in ``events_msgpack``.
        """
        request_id = await self._send(op, fields)
        merged = await self._frame(request_id, lazy)
        events = list(merged.get("events") or ())
        groups = list(merged.get("groups") or ())
        blobs = [merged["events_msgpack"]] if "events_msgpack" in merged else []
        # A streamed answer can decode into millions of containers; collections in between frames would
        # re-traverse all of them again and again (a 1M-event dump: 18 s instead of a few), so the cyclic
        # GC waits until the answer is whole.  Nothing here creates cycles.
        with gc_paused():
            while merged.pop("more", False):
                frame = await self._frame(request_id, lazy)
                events.extend(frame.get("events") or ())
                groups.extend(frame.get("groups") or ())
                if "events_msgpack" in frame:
                    blobs.append(frame["events_msgpack"])
                merged.update(frame)
        if blobs:
            merged["events_msgpack"] = blobs
        if "events" in merged:
            merged["events"] = events
        if "groups" in merged:
            merged["groups"] = groups
        return merged

    async def status(
        self, *, expected_identity: KvStateAgentIdentity | None = None, generation: int | None = None
    ) -> AgentStatus:
        fields = _fence_fields(expected_identity, generation)
        return agent_status_from_json((await self.request("status", **fields))["status"])

    async def list_slots(self) -> list[dict[str, Any]]:
        return list((await self.request("list"))["slots"])

    async def recover(
        self,
        start: int | None = None,
        end: int | None = None,
        expected_identity: KvStateAgentIdentity | None = None,
        generation: int | None = None,
        *,
        worker_id: int | None = None,
        dp_rank: int | None = None,
        dump_format: str = "events",
        raw_events: bool = False,
        lazy_events: bool = False,
    ) -> RecoverResult:
        """One ``recover``.  ``dump_format="columns"`` asks for the compact dump (see DumpColumns);
        ``raw_events`` keeps the events as wire maps, skipping RouterEvent validation and construction;
        ``lazy_events`` (msgpack connections) does not even decode them: ``events_msgpack`` holds each
        frame's msgpack array (decode with kvagent.wire.router_event.decode_router_events, or ``all_events()``).
        """
        fields: dict[str, Any] = {"start": start, "end": end, **_fence_fields(expected_identity, generation)}
        if worker_id is not None:
            fields["worker_id"] = worker_id
        if dp_rank is not None:
            fields["dp_rank"] = dp_rank
        if dump_format != "events":
            fields["dump_format"] = dump_format
        raw = await self.request("recover", lazy=lazy_events, **fields)
        wire = raw.pop("events", None) or ()
        keep_wire = raw_events or lazy_events  # lazy on a JSON connection: the events are parsed anyway
        events = () if keep_wire else tuple(_events({"events": wire}))
        dump = tuple(dump_columns_from_wire(piece) for piece in raw.pop("groups", None) or ())
        blobs = tuple(raw.pop("events_msgpack", None) or ())
        for key in ("id", "ok", "more", "format"):
            raw.pop(key, None)
        return RecoverResult(str(raw.get("kind")), events, raw, tuple(wire) if keep_wire else (), dump, blobs)

    async def follow(
        self, from_: int | None = None, *, dump_format: str = "events"
    ) -> AsyncIterator[FollowItem]:
        """Backlog frames, then live frames, until the server ends the stream.

        Raises FollowOverrun on overrun and RecoveryClientError("too_new") when ``from_`` is ahead of the
        server (it restarted, or the cursor belongs to another publisher).
        """
        fields: dict[str, Any] = {"from": from_}
        if dump_format != "events":
            fields["dump_format"] = dump_format
        request_id = await self._send("follow", fields)
        while True:
            frame = await self._frame(request_id)
            kind = frame.get("kind")
            if kind == "overrun":
                raise FollowOverrun(int(frame["last_sent"]))
            if kind == "too_new":
                raise RecoveryClientError(
                    "too_new", f"cursor {from_} is newer than the newest id {frame.get('newest_available')}"
                )
            if kind not in ("events", "tree_dump", "live"):
                raise RecoveryClientError("bad_response", f"unexpected follow frame kind {kind!r}")
            yield FollowItem(
                kind,
                tuple(_events(frame)),
                frame.get("last_event_id"),
                bool(frame.get("more", False)),
                frame.get("reset_scope"),
                tuple(dump_columns_from_wire(piece) for piece in frame.get("groups") or ()),
            )

    def _control(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {**fields, "token": self._token} if self._token is not None else fields

    async def attach(
        self,
        *,
        worker_id: int,
        dp_rank: int,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "worker_id": worker_id,
            "dp_rank": dp_rank,
            "endpoint": endpoint,
            "topic": topic,
            "replay_endpoint": replay_endpoint,
        }
        return dict((await self.request("attach", **self._control(fields)))["attachment"])

    async def detach(self, generation: int) -> int:
        return int((await self.request("detach", **self._control({"generation": generation})))["cursor"])

    async def quarantine(self, generation: int, reason: str) -> None:
        await self.request("quarantine", **self._control({"generation": generation, "reason": reason}))


def _lazy_msgpack_frame(message: bytes) -> dict[str, Any]:
    """Decode a frame's map except its ``events`` array, which is sliced out undecoded."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(message), 1))
    unpacker.feed(message)
    value: dict[str, Any] = {}
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key == "events":
            start = unpacker.tell()
            unpacker.skip()
            value["events_msgpack"] = message[start : unpacker.tell()]
        else:
            value[key] = unpacker.unpack()
    if unpacker.tell() != len(message):
        raise ValueError("trailing bytes after the frame")
    return value


def _fence_fields(expected_identity: KvStateAgentIdentity | None, generation: int | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if expected_identity is not None:
        fields["expected_identity"] = expected_identity.to_json()
    if generation is not None:
        fields["generation"] = generation
    return fields


def slot_url(url: str, slot: str | None) -> str:
    """``<url>/v1/slots/<slot>``, or ``<url>/v1/slots`` when slot is None or ``-``; accepts either as url.

    The slot name is percent-encoded (``gpu 0`` → ``gpu%200``, ``ü`` → ``%C3%BC``; ``/`` too): a name is
    any text, a URL path is not, and the server percent-decodes the segment back (docs/protocol.md).
    """
    base = url.rstrip("/")
    if "/v1/slots" not in base:
        base = f"{base}/v1/slots"
    if slot in (None, "-"):
        return base
    segment = quote(slot, safe="")
    if base.endswith(f"/v1/slots/{segment}"):
        return base
    return f"{base}/{segment}"


@asynccontextmanager
async def connect_slot(
    url: str,
    slot: str | None,
    *,
    token: str | None = None,
    encoding: str = "json",
) -> AsyncIterator[RecoveryClient]:
    """Open a connection to one slot (or to ``/v1/slots`` for ``list``); the token goes in the header."""
    headers = [(b"Authorization", f"Bearer {token}".encode())] if token is not None else None
    async with open_websocket_url(
        slot_url(url, slot),
        extra_headers=headers,
        max_message_size=CLIENT_MAX_MESSAGE_BYTES,
        receive_buffer_size=CLIENT_RECEIVE_BYTES,
    ) as ws:
        yield RecoveryClient(ws, encoding=encoding)


# --- subscribe: the event plane, with gaps repaired through recover ---------------------------------


class SubscribeGapError(RecoveryClientError):
    """A gap the agent can no longer fill from its ring (only a full snapshot would repair it)."""


@asynccontextmanager
async def subscribe(
    ws_url: str,
    slot: str,
    event_plane_endpoint: str,
    *,
    from_cursor: int | None = None,
    publisher_id: int | None = None,
    context: zmq.Context[Any] | None = None,
) -> AsyncIterator[AsyncIterator[RouterEvent]]:
    """Every outbound event of one slot exactly once, in id order, from the ZMQ event plane.

    ``async with subscribe(...) as events: async for event in events: ...``.  The event plane is lossy by
    design (PUB high-water mark, slow joiners); whenever the next message starts after ``last + 1``, the
    missing ids are fetched with the websocket ``recover`` op before anything newer is yielded.
    ``from_cursor`` is the last id the caller already holds (None: start at the first message that
    arrives).  A gap older than the agent's ring raises SubscribeGapError; a message that is not a
    kv-state-events-v2 publication is skipped, a malformed one raises CodecError.

    A context manager rather than a bare async generator because the websocket connection runs a task of
    its own: its nursery must be entered and left by the caller's task, never held open across a
    generator's ``yield`` (python-trio/trio#638), which corrupts Trio's scope stack when the caller stops
    iterating early or is cancelled.
    """
    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, EVENT_PLANE_TOPIC)
    sock.connect(event_plane_endpoint)
    sub = TrioSocket(sock)
    try:
        async with connect_slot(ws_url, slot) as client:
            if publisher_id is None:
                publisher_id = (await client.status()).identity.publisher_id
            yield _repaired_plane(sub, client, publisher_id, from_cursor)
    finally:
        sub.close()


async def _repaired_plane(
    sub: TrioSocket, client: RecoveryClient, publisher_id: int, last: int | None
) -> AsyncIterator[RouterEvent]:
    """The plane's events after ``last``, gaps filled from the ring; opens no scope that spans a yield."""
    while True:
        frames = await sub.recv_multipart()
        if not is_event_plane_message(frames):
            continue
        publisher, _first, events = decode_event_plane_message(frames)
        if publisher != publisher_id or not events:
            continue
        if last is not None and events[0].event_id > last + 1:
            async for event in _repair(client, last, events[0].event_id):
                last = event.event_id
                yield event
        for event in events:
            if last is None or event.event_id > last:
                last = event.event_id
                yield event


async def _repair(client: RecoveryClient, last: int, next_published: int) -> AsyncIterator[RouterEvent]:
    """The events after ``last`` and before ``next_published``, from the agent's ring."""
    answer = await client.recover(start=last + 1)
    if answer.kind != "events":
        raise SubscribeGapError(
            "gap_unrecoverable",
            f"events {last + 1}..{next_published - 1} are no longer buffered (answer {answer.kind}); "
            "take a full snapshot with recover(start=None)",
        )
    for event in answer.events:
        if last < event.event_id < next_published:
            yield event
