"""400 half-open connections against a real ``kvagent serve`` whose descriptor limit is 256.

The attacker keeps 400 connections that never finish the websocket handshake (half silent, half sending
an upgrade request without its final blank line), and opens a new one whenever the server drops one.
Throughout, legitimate clients must get their status answered and ``/metrics`` must answer; afterwards
every event the engine sent must be in the slot.

Two servers: one with the default pre-handshake limit (a quarter of the descriptor limit, so it never runs
out of descriptors) and one whose limit is set far above the descriptor limit, so ``accept`` does run out
and must shed half-open connections, back off, and log once per episode.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.agent import XpubEngine, batch, gpu_store
from tests.support.serve import client, follow_until, serve

HALF_OPEN = 400
NOFILE = 256
BATCHES = 600
ROUNDS = 15


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The attacker runs in a process of its own (as an attacker would): its churn must not slow down the
# legitimate clients' own event loop, only the server.
ATTACKER = """
import sys, trio
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = {"opened": 0, "dropped": 0}

async def one(number):
    while True:
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            await trio.sleep(0.05)
            continue
        state["opened"] += 1
        if state["opened"] == count:
            print("all-open", flush=True)
        try:
            if number % 2:
                await stream.send_all(b"GET /v1/slots/s0 HTTP/1.1\\r\\nHost: x\\r\\nUpgrade: websocket\\r\\n")
            while await stream.receive_some(4096):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()
        state["dropped"] += 1

async def report():
    while True:
        await trio.sleep(0.2)
        print("dropped", state["dropped"], flush=True)

async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(report)
        for number in range(count):
            nursery.start_soon(one, number)

trio.run(main)
"""


class Attacker:
    """HALF_OPEN connections that never complete a handshake, each reopened when the server drops it."""

    def __init__(self, host: str, port: int) -> None:
        self.command = [sys.executable, "-c", ATTACKER, host, str(port), str(HALF_OPEN)]
        self.dropped = 0
        self.all_open = trio.Event()
        self.stop = trio.Event()

    async def run(self) -> None:
        process = await trio.lowlevel.open_process(self.command, stdout=subprocess.PIPE)
        assert process.stdout is not None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, process.stdout)
                await self.stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            process.kill()
            with trio.move_on_after(10, shield=True):
                await process.wait()

    async def _read(self, stdout: trio.abc.ReceiveStream) -> None:
        buffer = b""
        async for chunk in stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line == b"all-open":
                    self.all_open.set()
                elif line.startswith(b"dropped "):
                    self.dropped = int(line.split()[1])


def episode_lines(lines: list[str], event: str) -> dict[str, int]:
    """How many log lines of ``event`` each listener wrote (recovery and metrics accept separately)."""
    counts: dict[str, int] = {}
    for line in lines:
        if event in line:
            listener = next(word for word in line.split() if word.startswith("listener="))
            counts[listener] = counts.get(listener, 0) + 1
    return counts


async def legitimate_rounds(url: str, metrics_port: int, failures: list[str]) -> int:
    """Status over websocket and a /metrics scrape, ROUNDS times; returns the rounds fully served."""
    served = 0
    for round_number in range(ROUNDS):
        with trio.move_on_after(5) as status_wait:
            async with client(url) as c:
                reply = await c.request("status")
                assert reply["ok"] is True
        if status_wait.cancelled_caught:
            failures.append(f"round {round_number}: status not served within 5 s")
        with trio.move_on_after(5) as scrape_wait:
            async with httpx.AsyncClient(timeout=5) as http:
                response = await http.get(f"http://127.0.0.1:{metrics_port}/metrics")
            assert response.status_code == 200 and "kvagent_recovery_connections_open" in response.text
        if scrape_wait.cancelled_caught:
            failures.append(f"round {round_number}: /metrics not served within 5 s")
        if not status_wait.cancelled_caught and not scrape_wait.cancelled_caught:
            served += 1
        await trio.sleep(0.1)  # pacing the rounds over the attack
    return served


@pytest.mark.parametrize("pending_limit", [None, 1000], ids=["default-limit", "limit-above-fds"])
async def test_half_open_flood_under_an_fd_limit_of_256(
    tmp_path: Path, fake_engine: XpubEngine, pending_limit: int | None
) -> None:
    metrics_port = free_port()
    args = ["--slot", f"s0={fake_engine.endpoint}", "--block-size", "32", "--discovery", "memory"]
    args += ["--metrics", f"127.0.0.1:{metrics_port}", "--handshake-timeout", "3", "--max-connections", "32"]
    if pending_limit is not None:
        args += ["--max-pending-handshakes", str(pending_limit)]
    with trio.fail_after(240):
        async with serve(tmp_path, *args, nofile=NOFILE) as agent:
            await fake_engine.wait_subscribed()
            host, port = agent.url.removeprefix("ws://").rsplit(":", 1)
            attacker = Attacker(host, int(port))
            failures: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(attacker.run)
                await attacker.all_open.wait()

                async def ingest() -> None:
                    for i in range(BATCHES):
                        await fake_engine.send_payload(batch([gpu_store([10_000 + i])]))
                        if i % 20 == 0:
                            await trio.sleep(0.05)  # spread over the attack

                nursery.start_soon(ingest)
                served = await legitimate_rounds(agent.url, metrics_port, failures)
                attacker.stop.set()
            assert failures == []
            assert served == ROUNDS
            assert attacker.dropped > 0  # the server did drop half-open connections
            # Ingest lost nothing: every stored block arrives through follow, then the sentinel.
            async with client(agent.url) as c:
                await fake_engine.send_payload(batch([gpu_store([0xFEED])]))
                events = await follow_until(c, 0xFEED, None)
                stored = {
                    block["block_hash"]
                    for event in events
                    if "stored" in event["event"]["data"]
                    for block in event["event"]["data"]["stored"]["blocks"]
                }
            assert stored == {10_000 + i for i in range(BATCHES)} | {0xFEED}
            exhausted = episode_lines(agent.stderr_lines, "accept_out_of_descriptors")
            recovered = episode_lines(agent.stderr_lines, "accept_recovered")
            if pending_limit is None:
                assert exhausted == {}  # the default limit kept descriptors in reserve
            else:
                assert exhausted.get("listener=recovery", 0) >= 1  # accept did run out, and each listener
                for listener, count in exhausted.items():  # logged once per episode, not per failure
                    assert count <= recovered.get(listener, 0) + 1, (listener, count)
