"""``kvagent serve`` as a subprocess for tests, and a raw websocket client speaking docs/protocol.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import trio
from trio_websocket import WebSocketConnection, open_websocket_url


class LineLog:
    """stderr lines as they arrive, with a wait for a matching line (no polling, no sleeps)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._added = trio.Event()

    def append(self, line: str) -> None:
        self.lines.append(line)
        self._added.set()
        self._added = trio.Event()

    async def wait_for(self, predicate: Callable[[str], bool]) -> str:
        checked = 0
        while True:
            for line in self.lines[checked:]:
                if predicate(line):
                    return line
            checked = len(self.lines)
            await self._added.wait()


class ServeProcess:
    def __init__(self, process: trio.Process, url: str, tmp: Path, log: LineLog) -> None:
        self.process = process
        self.url = url
        self.tmp = tmp
        self.log = log
        self.stderr_lines = log.lines

    @property
    def token(self) -> str:
        return (self.tmp / "token").read_text().strip()

    def discovery_files(self) -> list[Path]:
        return sorted(p for p in (self.tmp / "discovery").rglob("*.json"))


async def _read_lines(stream: Any, lines: LineLog, ready: trio.Event, found: list[str]) -> None:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            text = line.decode(errors="replace")
            lines.append(text)
            if "serving" in text and "ws://" in text and not ready.is_set():
                found.append(text.split("ws://", 1)[1].split("/v1/slots", 1)[0])
                ready.set()


# Runs ``kvagent serve`` under a descriptor limit (resource.setrlimit in the child, before anything opens).
_WITH_NOFILE = (
    "import resource, sys; limit = int(sys.argv.pop(1)); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)); "
    "from kvagent.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


@asynccontextmanager
async def serve(tmp: Path, *args: str, nofile: int | None = None) -> AsyncIterator[ServeProcess]:
    launcher = ["-m", "kvagent.cli.main"] if nofile is None else ["-c", _WITH_NOFILE, str(nofile)]
    command = [
        sys.executable,
        *launcher,
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--discovery",
        f"file:{tmp / 'discovery'}",
        "--token-file",
        str(tmp / "token"),
        "--status-interval",
        "1",
        *args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, env=env)
        lines = LineLog()
        found: list[str] = []
        ready = trio.Event()
        assert process.stderr is not None
        nursery.start_soon(_read_lines, process.stderr, lines, ready, found)
        try:
            with trio.fail_after(30):
                while not ready.is_set():
                    with trio.move_on_after(0.5):
                        await ready.wait()
                    if process.poll() is not None:
                        raise AssertionError("kvagent serve exited early:\n" + "\n".join(lines.lines))
            yield ServeProcess(process, f"ws://{found[0]}", tmp, lines)
        finally:
            if process.poll() is None:
                process.kill()
            with trio.move_on_after(10, shield=True):
                await process.wait()
            nursery.cancel_scope.cancel()


class Client:
    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.next_id = 0

    async def send(self, op: str, **fields: object) -> int:
        self.next_id += 1
        await self.ws.send_message(json.dumps({"id": self.next_id, "op": op, **fields}))
        return self.next_id

    async def frame(self) -> dict[str, Any]:
        message = await self.ws.get_message()
        value = json.loads(message) if isinstance(message, str) else msgpack.unpackb(message)
        assert isinstance(value, dict)
        return value

    async def request(self, op: str, **fields: object) -> dict[str, Any]:
        """One request; a streamed answer is reassembled (events lists concatenated)."""
        request_id = await self.send(op, **fields)
        merged: dict[str, Any] | None = None
        while True:
            frame = await self.frame()
            assert frame["id"] == request_id
            if merged is None:
                merged = frame
            else:
                merged.setdefault("events", []).extend(frame.get("events", []))
                merged.update({k: v for k, v in frame.items() if k != "events"})
            if not frame.get("more"):
                return merged


@asynccontextmanager
async def client(url: str, slot: str = "s0", **kwargs: Any) -> AsyncIterator[Client]:
    async with open_websocket_url(f"{url}/v1/slots/{slot}", **kwargs) as ws:
        yield Client(ws)


def stored_hashes(events: list[dict[str, Any]]) -> set[int]:
    resident: set[int] = set()
    for event in events:
        data = event["event"]["data"]
        if isinstance(data, dict) and "stored" in data:
            resident.update(b["block_hash"] for b in data["stored"]["blocks"])
    return resident


async def follow_until(c: Client, sentinel: int, from_: int | None) -> list[dict[str, Any]]:
    """Follow and collect every event until the sentinel block's store arrives."""
    request_id = await c.send("follow", **{"from": from_})
    events: list[dict[str, Any]] = []
    while True:
        frame = await c.frame()
        assert frame["id"] == request_id and frame["ok"], frame
        events.extend(frame.get("events", []))
        if sentinel in stored_hashes(frame.get("events", [])):
            return events
