"""A Trio client for the websocket recovery protocol v1 (``kvagent query``, routers, tests).

One client owns one connection and sends one request at a time; a streamed answer (``"more": true``
frames) is reassembled by :meth:`RecoveryClient.recover`, while :meth:`RecoveryClient.follow` yields frame by
frame so a large backlog never has to sit in memory whole.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
from array import array
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import msgpack
from trio_websocket import WebSocketConnection, open_websocket_url

from kvagent._util.gcutil import gc_paused
from kvagent.model.errors import CodecError, FollowOverrun, IdentityError, RecoveryClientError
from kvagent.model.events import (
    MmExtraInfo,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.model.ids import CacheOwnerId, KvStateAgentIdentity
from kvagent.model.status import AgentStatus
from kvagent.wire.router_event import (
    decode_router_events,
    mm_extra_info_from_wire,
    router_event_from_json,
    state_source_from_wire,
)

__all__ = [
    "DumpColumns",
    "FollowItem",
    "FollowOverrun",
    "RecoverResult",
    "RecoveryClient",
    "RecoveryClientError",
    "agent_status_from_json",
    "connect_slot",
]

CLIENT_MAX_MESSAGE_BYTES = 4 << 20  # the server sends frames of at most 1 MiB; leave headroom
# trio-websocket reads 4 KiB at a time by default: a 1 MiB frame then costs 256 reads, each through
# wsproto's parser, which made the client's reader the bottleneck of many concurrent recoveries.
CLIENT_RECEIVE_BYTES = 256 << 10


_FLAG_ROOT, _FLAG_PARENT, _FLAG_DEAD = 0, 1, 2


@attrs.frozen(slots=True, eq=False)
class DumpColumns:
    """One piece of a ``"dump_format": "columns"`` tree dump: rows of one (owner, tier), parents first.

    Row i is block ``block_hashes[i]`` with tokens hash ``tokens_hashes[i]`` and, when ``flags[i]`` is 1,
    parent ``parent_hashes[i]`` (0: a root; 2: a padding row to skip).  A router that rebuilds its own tree
    reads the arrays directly; :meth:`blocks` and :meth:`events` are conveniences.
    """

    worker_id: int
    storage_tier: StorageTier
    residency_domain: ResidencyDomain
    dp_rank: int
    state_source: CacheOwnerId | None
    first_event_id: int
    block_hashes: array[int]
    parent_hashes: array[int]
    tokens_hashes: array[int]
    flags: bytes
    mm_extra_infos: Mapping[int, MmExtraInfo]

    @property
    def live(self) -> int:
        """Rows that are blocks (not padding)."""
        return len(self.flags) - self.flags.count(_FLAG_DEAD)

    def blocks(self) -> Iterator[tuple[int, int | None, int, MmExtraInfo | None]]:
        """(block hash, parent hash or None, tokens hash, mm info) of each block, in dump order."""
        mm = self.mm_extra_infos
        rows = zip(self.block_hashes, self.parent_hashes, self.tokens_hashes, self.flags, strict=True)
        for row, (block, parent, tokens, flag) in enumerate(rows):
            if flag != _FLAG_DEAD:
                yield block, parent if flag == _FLAG_PARENT else None, tokens, mm.get(row) if mm else None

    def events(self) -> Iterator[RouterEvent]:
        """The same blocks as the ``events`` dump format's one-block Stored events (same synthetic ids)."""
        event_id = self.first_event_id
        for block, parent, tokens, info in self.blocks():
            data = Stored(parent, (block,), (tokens,), None if info is None else (info,))
            yield RouterEvent(
                self.worker_id,
                self.storage_tier,
                self.residency_domain,
                event_id,
                data,
                self.dp_rank,
                self.state_source,
            )
            event_id += 1


def _blob(value: object, field: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):  # the JSON encoding carries the columns as base64
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            raise RecoveryClientError("bad_response", f"{field} is not base64") from None
    raise RecoveryClientError("bad_response", f"{field} must be bytes or a base64 string")


def _u64_column(value: object, field: str, rows: int) -> array[int]:
    blob = _blob(value, field)
    if len(blob) != 8 * rows:
        raise RecoveryClientError("bad_response", f"{field} has {len(blob)} bytes for {rows} rows")
    column = array("Q")
    column.frombytes(blob)
    if sys.byteorder != "little":
        column.byteswap()
    return column


def _dump_columns(piece: object) -> DumpColumns:
    """Validate one piece of a columns dump (C-speed: no per-row Python work)."""
    try:
        assert isinstance(piece, dict)
        rows = piece["rows"]
        assert isinstance(rows, int) and rows >= 0
        flags = _blob(piece["flags"], "flags")
        if len(flags) != rows or flags.translate(None, b"\x00\x01\x02"):
            raise RecoveryClientError("bad_response", "dump flags must be one 0/1/2 byte per row")
        mm: dict[int, MmExtraInfo] = {}
        for row, raw_info in piece.get("mm_extra_infos") or ():
            info = mm_extra_info_from_wire(raw_info)
            if info is not None and isinstance(row, int) and 0 <= row < rows:
                mm[row] = info
        source = piece.get("state_source")
        return DumpColumns(
            int(piece["worker_id"]),
            StorageTier(piece["storage_tier"]),
            ResidencyDomain(piece["residency_domain"]),
            int(piece["dp_rank"]),
            None if source is None else state_source_from_wire(source),
            int(piece["first_event_id"]),
            _u64_column(piece["block_hashes"], "block_hashes", rows),
            _u64_column(piece["parent_hashes"], "parent_hashes", rows),
            _u64_column(piece["tokens_hashes"], "tokens_hashes", rows),
            flags,
            mm,
        )
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise RecoveryClientError("bad_response", f"malformed dump columns: {exc!r}") from None


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
        from kvagent.wire.router_event import router_event_to_json

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
        dump = tuple(_dump_columns(piece) for piece in raw.pop("groups", None) or ())
        blobs = tuple(raw.pop("events_msgpack", None) or ())
        for key in ("id", "ok", "more", "format"):
            raw.pop(key, None)
        return RecoverResult(str(raw.get("kind")), events, raw, tuple(wire) if keep_wire else (), dump, blobs)

    async def follow(self, from_: int | None = None, *, dump_format: str = "events") -> AsyncIterator[FollowItem]:
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
                tuple(_dump_columns(piece) for piece in frame.get("groups") or ()),
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
    """``<url>/v1/slots/<slot>``, or ``<url>/v1/slots`` when slot is None or ``-``; accepts either as url."""
    base = url.rstrip("/")
    if "/v1/slots" not in base:
        base = f"{base}/v1/slots"
    if slot in (None, "-") or base.endswith(f"/{slot}"):
        return base
    return f"{base}/{slot}"


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
