"""The publisher process: a fake vLLM engine bursting (or pacing) the pre-encoded trace on an XPUB socket.

It runs in its own process (``multiprocessing`` spawn) so that encoding and sending never compete with the
agent for the bench process's interpreter.  XPUB (with ``XPUB_VERBOSE``) behaves like vLLM's PUB on the
wire and additionally tells the publisher when a subscriber's subscription has arrived, which is the sync
handshake: messages are sent only after the subscriber is connected, so the slow-joiner window cannot
lose anything.  ``SNDHWM`` is 0 (unbounded), so PUB-side drops are impossible too.

Pipe protocol (parent → child): ``("wait_subscriber",)``, ``("forget_subscriptions",)``, ``("burst",)``,
``("paced", events_per_s, seconds)``, ``("stop",)``.  Child → parent: ``("ready", endpoint, TraceStats)`` once
the trace is encoded, ``("subscribed",)``, ``("forgot", count)``, ``("sent", batches, first_send, last_send)``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import time
from typing import Any

import zmq

from bench.trace import EVENTS_PER_BATCH, TOPIC, TraceStats, build_trace

TICK_SECONDS = 0.002


def _wait_subscriber(sock: zmq.Socket[Any]) -> None:
    while True:
        message = sock.recv()
        if message[:1] == b"\x01" and TOPIC.startswith(message[1:]):
            return


def _send(sock: zmq.Socket[Any], payloads: list[bytes], count: int, start: int = 0) -> None:
    send = sock.send_multipart
    for seq in range(start, start + count):
        send([TOPIC, seq.to_bytes(8, "big"), payloads[seq % len(payloads)]], copy=False)


def publisher_main(
    conn: multiprocessing.connection.Connection, batches: int, removes: bool = True, prefix_closed: bool = False
) -> None:
    payloads, stats = build_trace(batches, with_removes=removes, prefix_closed=prefix_closed)
    context = zmq.Context()
    sock = context.socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # re-announce a topic for every new subscriber (repetitions)
    sock.bind("tcp://127.0.0.1:0")
    conn.send(("ready", sock.getsockopt_string(zmq.LAST_ENDPOINT), stats))
    try:
        while True:
            command = conn.recv()
            if command[0] == "stop":
                return
            if command[0] == "wait_subscriber":
                _wait_subscriber(sock)
                conn.send(("subscribed",))
            elif command[0] == "forget_subscriptions":
                # A consumer that shed re-opened its SUB and subscribed again: those messages would pass
                # for the next consumer's. Called once a consumer is stopped, before the next one starts.
                forgotten = 0
                with contextlib.suppress(zmq.Again):
                    while True:
                        sock.recv(zmq.NOBLOCK)
                        forgotten += 1
                conn.send(("forgot", forgotten))
            elif command[0] == "burst":
                first = time.perf_counter()
                _send(sock, payloads, len(payloads))
                conn.send(("sent", len(payloads), first, time.perf_counter()))
            elif command[0] == "paced":
                _, events_per_s, seconds = command
                batches_per_s = events_per_s / EVENTS_PER_BATCH
                total = int(batches_per_s * seconds)
                sent = 0
                first = time.perf_counter()
                while sent < total:
                    due = min(total, int((time.perf_counter() - first) * batches_per_s) + 1)
                    if due > sent:
                        _send(sock, payloads, due - sent, sent)
                        sent = due
                    time.sleep(TICK_SECONDS)
                conn.send(("sent", sent, first, time.perf_counter()))
    finally:
        sock.close(linger=0)
        context.term()


class Publisher:
    """Parent-side handle on a publisher process."""

    def __init__(self, batches: int, *, removes: bool = True, prefix_closed: bool = False) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=publisher_main, args=(child, batches, removes, prefix_closed), daemon=True)
        self._process.start()
        child.close()
        reply = self._recv(timeout=600)
        assert reply[0] == "ready", reply
        self.endpoint: str = reply[1]
        self.stats: TraceStats = reply[2]

    def _recv(self, timeout: float) -> tuple[Any, ...]:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"publisher process did not answer within {timeout} s")
        reply: tuple[Any, ...] = self._conn.recv()
        return reply

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def request_subscriber_wait(self) -> None:
        self._conn.send(("wait_subscriber",))

    def wait_subscribed(self, timeout: float = 30) -> None:
        reply = self._recv(timeout)
        assert reply[0] == "subscribed", reply

    def forget_subscriptions(self, timeout: float = 30) -> int:
        """Drop the subscription messages queued so far (call it between two consumers)."""
        self._conn.send(("forget_subscriptions",))
        reply = self._recv(timeout)
        assert reply[0] == "forgot", reply
        return int(reply[1])

    def burst(self) -> None:
        self._conn.send(("burst",))

    def paced(self, events_per_s: float, seconds: float) -> None:
        self._conn.send(("paced", events_per_s, seconds))

    def wait_sent(self, timeout: float = 600) -> tuple[int, float, float]:
        reply = self._recv(timeout)
        assert reply[0] == "sent", reply
        return int(reply[1]), float(reply[2]), float(reply[3])

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self._conn.send(("stop",))
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
