"""The client process of the ``serving`` figure: N recovery clients, each paced at a fixed request rate.

Each client holds one msgpack connection to the slot and, every ``1 / rate`` seconds, reads the cursor
with an untimed ``status`` and then times ``recover(cursor - backlog)`` (the last ``backlog`` events, plus
whatever was applied in between).  Every timed request ends in exactly one of:

* ``answered``: a complete answer (its latency is recorded);
* ``refused``: an error frame (by code; its latency is recorded separately);
* ``hanging``: neither within ``request_timeout`` seconds (the connection is then dropped and reopened);
* ``closed``: the connection closed under the request (by close code).

Answers stay encoded (``lazy_events``): decoding is the router's own work and would only load the shared
cores with client CPU.
"""

from __future__ import annotations

import time
from typing import Any

import trio

REQUEST_TIMEOUT = 10.0  # an answer (or error) slower than this counts as a request left hanging


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
        }


async def _one_request(client: Any, backlog: int, tally: _Tally, record: bool) -> bool:
    """One status + timed recover; False when the connection must be reopened."""
    from trio_websocket import ConnectionClosed

    from kvagent.model.errors import RecoveryClientError

    started = time.perf_counter()
    try:
        with trio.move_on_after(REQUEST_TIMEOUT) as waited:
            cursor = (await client.status()).outbound_cursor
            started = time.perf_counter()
            answer = await client.recover(max(1, cursor - backlog), dump_format="columns", lazy_events=True)
    except RecoveryClientError as exc:
        if record:
            tally.issued += 1
            tally.refused[exc.code] = tally.refused.get(exc.code, 0) + 1
            tally.refused_latencies.append(time.perf_counter() - started)
        return True
    except ConnectionClosed as exc:
        if record:
            tally.issued += 1
            code = str(exc.reason.code) if exc.reason is not None else "none"
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
        tally.kinds[answer.kind] = tally.kinds.get(answer.kind, 0) + 1
    return True


async def _client_loop(
    url: str, interval: float, offset: float, warm: float, deadline: float, backlog: int, tally: _Tally
) -> None:
    from trio_websocket import ConnectionClosed, HandshakeError

    from kvagent.recovery.client import connect_slot

    next_start = trio.current_time() + offset
    while trio.current_time() < deadline:
        try:
            async with connect_slot(url, "s0", encoding="msgpack") as client:
                while trio.current_time() < deadline:
                    await trio.sleep_until(next_start)  # the offered load's schedule, not synchronization
                    next_start = max(next_start + interval, trio.current_time())
                    record = warm <= trio.current_time() < deadline
                    if not await _one_request(client, backlog, tally, record):
                        break
        except (HandshakeError, ConnectionClosed, OSError):
            tally.connect_failures += 1
            await trio.sleep(0.1)  # a refused client retries after a pause, as a router would


async def clients_main(
    url: str, clients: int, rate: float, warmup: float, seconds: float, backlog: int
) -> dict[str, Any]:
    tally = _Tally()
    interval = 1.0 / rate
    now = trio.current_time()
    warm = now + warmup
    deadline = warm + seconds
    cpu_started = time.process_time()
    async with trio.open_nursery() as nursery:
        for number in range(clients):
            nursery.start_soon(
                _client_loop, url, interval, interval * number / clients, warm, deadline, backlog, tally
            )
    result = tally.to_json()
    result["client_cpu_seconds"] = time.process_time() - cpu_started
    result["window_seconds"] = seconds
    return result


def client_process(conn: Any, url: str, clients: int, rate: float, warmup: float, seconds: float,
                   backlog: int) -> None:
    """Entry point of the spawned client process: the tally goes back over ``conn``."""
    try:
        conn.send(("ok", trio.run(clients_main, url, clients, rate, warmup, seconds, backlog)))
    except Exception as exc:
        import traceback

        conn.send(("error", "".join(traceback.format_exception(exc))[-3000:]))
