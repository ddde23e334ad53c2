"""The client process of the ``serving`` figure: N recovery clients, each paced at a fixed request rate.

Each client holds one msgpack connection to the slot and, every ``1 / rate`` seconds, reads the cursor
with an untimed ``status`` and then times ``recover(cursor - backlog)`` (the last ``backlog`` events, plus
whatever was applied in between).  Every timed request ends in exactly one of:

* ``answered``: a complete answer (its latency is recorded);
* ``refused``: an error frame (by code; its latency is recorded separately);
* ``hanging``: neither within ``request_timeout`` seconds (the connection is then dropped and reopened);
* ``closed``: the connection closed under the request (by close code).

Answers stay encoded (``lazy_events``): decoding is the router's own work and would only load the shared
cores with client CPU.  ``lite`` clients speak through :mod:`bench.lite_ws` instead of trio-websocket:
the same requests and frames on the wire, at a fraction of the client CPU.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

REQUEST_TIMEOUT = 10.0  # an answer (or error) slower than this counts as a request left hanging


class Refused(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _frame_head(message: bytes) -> dict[str, Any]:
    """A msgpack answer frame without its ``events`` / ``groups`` (skipped at C speed, never decoded)."""
    import msgpack

    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(message), 1))
    unpacker.feed(message)
    head: dict[str, Any] = {}
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key in ("events", "groups"):
            unpacker.skip()
        else:
            head[key] = unpacker.unpack()
    return head


class LiteClient:
    """status / recover over :mod:`bench.lite_ws` (msgpack frames, answers left encoded)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0

    async def _request(self, fields: dict[str, Any]) -> dict[str, Any]:
        import msgpack

        self.next_id += 1
        await self.ws.send(msgpack.packb({"id": self.next_id, **fields}))
        while True:
            head = _frame_head(await self.ws.receive())
            if head.get("id") != self.next_id:
                continue
            if head.get("ok") is not True:
                raise Refused(str((head.get("error") or {}).get("code")))
            if not head.get("more"):
                return head

    async def cursor(self) -> int:
        import msgpack

        self.next_id += 1
        await self.ws.send(msgpack.packb({"id": self.next_id, "op": "status"}))
        while True:
            value = msgpack.unpackb(await self.ws.receive(), raw=False, strict_map_key=False)
            if value.get("id") == self.next_id:
                if value.get("ok") is not True:
                    raise Refused(str((value.get("error") or {}).get("code")))
                return int(value["status"]["outbound_cursor"])

    async def recover_kind(self, start: int) -> str:
        head = await self._request({"op": "recover", "start": start, "dump_format": "columns"})
        return str(head.get("kind"))


class ReferenceClient:
    """The same two calls through kvagent.recovery.client (trio-websocket)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def cursor(self) -> int:
        return int((await self.client.status()).outbound_cursor)

    async def recover_kind(self, start: int) -> str:
        answer = await self.client.recover(start, dump_format="columns", lazy_events=True)
        return str(answer.kind)


class _Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.refused_latencies: list[float] = []
        self.kinds: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.closed: dict[str, int] = {}
        self.hanging = 0
        self.connect_failures = 0
        self.issued = 0
        self.stalled = 0  # never-reading followers that got their follow in

    def to_json(self) -> dict[str, Any]:
        return {
            "latencies": self.latencies,
            "refused_latencies": self.refused_latencies,
            "kinds": self.kinds,
            "refused": self.refused,
            "closed": self.closed,
            "hanging": self.hanging,
            "connect_failures": self.connect_failures,
            "issued": self.issued,
            "stalled": self.stalled,
        }


async def _one_request(client: Any, backlog: int, tally: _Tally, record: bool) -> bool:
    """One status + timed recover; False when the connection must be reopened."""
    from trio_websocket import ConnectionClosed

    from bench.lite_ws import Closed
    from kvagent.model.errors import RecoveryClientError

    started = time.perf_counter()
    try:
        with trio.move_on_after(REQUEST_TIMEOUT) as waited:
            cursor = await client.cursor()
            started = time.perf_counter()
            kind = await client.recover_kind(max(1, cursor - backlog))
    except (RecoveryClientError, Refused) as exc:
        if record:
            tally.issued += 1
            tally.refused[exc.code] = tally.refused.get(exc.code, 0) + 1
            tally.refused_latencies.append(time.perf_counter() - started)
        return True
    except (ConnectionClosed, Closed, trio.BrokenResourceError) as exc:
        if record:
            tally.issued += 1
            code = _close_code(exc)
            tally.closed[code] = tally.closed.get(code, 0) + 1
        return False
    if record:
        tally.issued += 1
    if waited.cancelled_caught:
        if record:
            tally.hanging += 1
        return False
    if record:
        tally.latencies.append(time.perf_counter() - started)
        tally.kinds[kind] = tally.kinds.get(kind, 0) + 1
    return True


def _close_code(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    code = getattr(reason, "code", None) if reason is not None else getattr(exc, "code", None)
    return "none" if code is None else str(code)


@asynccontextmanager
async def _connect(url: str, lite: bool) -> AsyncIterator[Any]:
    if lite:
        from bench.lite_ws import LiteWebSocket

        host, port = url.removeprefix("ws://").rsplit(":", 1)
        ws = await LiteWebSocket.connect(host, int(port), "/v1/slots/s0")
        try:
            yield LiteClient(ws)
        finally:
            with trio.move_on_after(2):
                await ws.aclose()
        return
    from kvagent.recovery.client import connect_slot

    async with connect_slot(url, "s0", encoding="msgpack") as client:
        yield ReferenceClient(client)


async def _client_loop(
    url: str, lite: bool, interval: float, offset: float, warm: float, deadline: float, backlog: int,
    tally: _Tally,
) -> None:
    from trio_websocket import ConnectionClosed, HandshakeError

    from bench.lite_ws import Closed, Rejected

    next_start = trio.current_time() + offset
    while trio.current_time() < deadline:
        try:
            async with _connect(url, lite) as client:
                while trio.current_time() < deadline:
                    await trio.sleep_until(next_start)  # the offered load's schedule, not synchronization
                    # Each client keeps its own phase: a late answer skips the slots it missed instead of
                    # moving the schedule to "now", which would line every late client up on the same
                    # instant and turn a steady load into bursts of simultaneous requests.
                    next_start += interval
                    while next_start < trio.current_time():
                        next_start += interval
                    record = warm <= trio.current_time() < deadline
                    if not await _one_request(client, backlog, tally, record):
                        break
        except (HandshakeError, ConnectionClosed, Rejected, Closed, OSError, trio.BrokenResourceError):
            tally.connect_failures += 1
            await trio.sleep(0.1)  # a refused client retries after a pause, as a router would


STALLED_RECEIVE_BUFFER = 4096  # a never-reading follower's SO_RCVBUF: its window fills within a second


async def _stalled_follower(url: str, deadline: float, tally: _Tally) -> None:
    """A router that asks to follow and never reads again: the server must cut it, not queue for it.

    It reads the cursor (so the backlog is a short range, not a tree dump), sends ``follow`` and then
    holds the connection without reading until the run ends.
    """
    import msgpack

    from bench.lite_ws import LiteWebSocket

    host, port = url.removeprefix("ws://").rsplit(":", 1)
    try:
        ws = await LiteWebSocket.connect(host, int(port), "/v1/slots/s0", receive_buffer=STALLED_RECEIVE_BUFFER)
        cursor = await LiteClient(ws).cursor()
        await ws.send(msgpack.packb({"id": 1 << 30, "op": "follow", "from": cursor}))
    except Exception:
        tally.connect_failures += 1
        return
    tally.stalled += 1
    await trio.sleep_until(deadline)  # never reading: the point of this client
    with trio.move_on_after(0.5):
        await ws.aclose()


async def clients_main(
    url: str, clients: int, rate: float, warmup: float, seconds: float, backlog: int, lite: bool,
    stalled: int = 0,
) -> dict[str, Any]:
    tally = _Tally()
    interval = 1.0 / rate
    now = trio.current_time()
    warm = now + warmup
    deadline = warm + seconds
    cpu_started = time.process_time()
    async with trio.open_nursery() as nursery:
        for _ in range(stalled):
            nursery.start_soon(_stalled_follower, url, deadline, tally)
        for number in range(clients):
            nursery.start_soon(
                _client_loop, url, lite, interval, interval * number / clients, warm, deadline, backlog, tally
            )
    result = tally.to_json()
    result["client_cpu_seconds"] = time.process_time() - cpu_started
    result["window_seconds"] = seconds
    return result


def client_process(conn: Any, url: str, clients: int, rate: float, warmup: float, seconds: float,
                   backlog: int, lite: bool, stalled: int = 0) -> None:
    """Entry point of the spawned client process: the tally goes back over ``conn``."""
    try:
        conn.send(("ok", trio.run(clients_main, url, clients, rate, warmup, seconds, backlog, lite, stalled)))
    except Exception as exc:
        import traceback

        conn.send(("error", "".join(traceback.format_exception(exc))[-3000:]))
