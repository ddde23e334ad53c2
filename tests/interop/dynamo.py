"""A harness around Dynamo's real standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo-runtime).

The indexer runs as a subprocess of the python named by ``KVAGENT_DYNAMO_PYTHON`` (its own venv: Dynamo is
never installed next to kvagent). It listens for HTTP on 127.0.0.1:PORT; workers are registered with
``POST /register`` (the only way to give it a replay endpoint: ``--workers`` takes none) and its radix tree
is read back with ``GET /dump``. Its log (``NO_COLOR``, ``RUST_LOG=info``) is kept line by line so tests can
wait for what it did ("Requesting replay from engine", "Replay complete") instead of sleeping.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from tests.support.serve import LineLog

DYNAMO_PYTHON_ENV = "KVAGENT_DYNAMO_PYTHON"
MODEL = "interop"
_START_ATTEMPTS = 3  # the port is chosen before the child binds it: another process may win the race
_HEALTH_TIMEOUT = 60.0  # the first start of a 200 MB extension module on a loaded CI machine
_DUMP_POLL = 0.05
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the indexer colours its log even under NO_COLOR

# Dynamo's names for vLLM's ``medium`` values in ``/dump`` (``storage_tier``).
TIER_OF_MEDIUM: Mapping[str, str] = {"GPU": "device", "CPU": "host_pinned"}


def dynamo_python() -> str | None:
    """The python that has ``dynamo`` installed, or None (the interop tests are then skipped)."""
    return os.environ.get(DYNAMO_PYTHON_ENV) or None


def free_port() -> int:
    """A port free on 127.0.0.1 now (for programs that cannot report the port they bound)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@attrs.frozen(slots=True)
class DumpedBlock:
    worker_id: int
    dp_rank: int
    tier: str
    block_hash: int
    tokens_hash: int


@attrs.frozen(slots=True)
class IndexerDump:
    """``GET /dump`` of one model, flattened: every stored block of every worker (the dump holds stores only)."""

    blocks: frozenset[DumpedBlock]

    def hashes(self, *, tier: str = "device", worker_id: int | None = None) -> frozenset[int]:
        return frozenset(
            block.block_hash
            for block in self.blocks
            if block.tier == tier and (worker_id is None or block.worker_id == worker_id)
        )

    def tokens_hashes(self, *, tier: str = "device") -> dict[int, int]:
        return {block.block_hash: block.tokens_hash for block in self.blocks if block.tier == tier}


def blocks_of(entries: Iterable[Mapping[str, Any]]) -> IndexerDump:
    """The stored blocks of RouterEvent-shaped entries (Dynamo's ``/dump`` and kvagent's tree dump alike)."""
    blocks: set[DumpedBlock] = set()
    for entry in entries:
        data = entry["event"]["data"]
        if set(data) != {"stored"}:
            raise AssertionError(f"a dump entry that is not a store: {entry!r}")
        for block in data["stored"]["blocks"]:
            blocks.add(
                DumpedBlock(
                    worker_id=int(entry["worker_id"]),
                    dp_rank=int(entry["event"]["dp_rank"]),
                    tier=str(entry["storage_tier"]),
                    block_hash=int(block["block_hash"]),
                    tokens_hash=int(block["tokens_hash"]),
                )
            )
    return IndexerDump(frozenset(blocks))


def parse_dump(body: Mapping[str, Any], model: str = MODEL) -> IndexerDump:
    """The blocks of ``model`` in a ``/dump`` answer (``{"model:group": {block_size, events}}``)."""
    sections = [section for key, section in body.items() if key.split(":", 1)[0] == model]
    return blocks_of(entry for section in sections for entry in section["events"])


class DynamoIndexer:
    """One running ``python -m dynamo.indexer`` and an HTTP client for it."""

    def __init__(self, process: trio.Process, base_url: str, log: LineLog, http: httpx.AsyncClient) -> None:
        self.process = process
        self.base_url = base_url
        self.log = log
        self.http = http
        self.last_dump: IndexerDump | None = None  # the latest /dump read, for failure reports

    def count(self, text: str) -> int:
        """How many log lines so far contain ``text``."""
        return sum(text in line for line in self.log.lines)

    async def wait_for_log(self, text: str, *, count: int = 1) -> None:
        """Until ``count`` log lines contain ``text`` (callers bound this with ``trio.fail_after``)."""
        while self.count(text) < count:
            await self.log.wait_for(lambda line: text in line and self.count(text) >= count)

    async def register(
        self,
        *,
        instance_id: int,
        endpoint: str,
        replay_endpoint: str | None,
        block_size: int,
        dp_rank: int = 0,
        model: str = MODEL,
    ) -> None:
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": model,
            "block_size": block_size,
            "dp_rank": dp_rank,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        answer = await self.http.post(f"{self.base_url}/register", json=body)
        if answer.status_code != 201:
            raise AssertionError(f"/register answered {answer.status_code}: {answer.text}")

    async def dump(self, model: str = MODEL) -> IndexerDump:
        answer = await self.http.get(f"{self.base_url}/dump")
        answer.raise_for_status()
        self.last_dump = parse_dump(answer.json(), model)
        return self.last_dump

    async def wait_for_dump(self, predicate: Callable[[IndexerDump], bool]) -> IndexerDump:
        """Poll ``/dump`` (a real observable) until ``predicate``; callers bound it with ``trio.fail_after``."""
        while True:
            dump = await self.dump()
            if predicate(dump):
                return dump
            await trio.sleep(_DUMP_POLL)

    async def wait_for_hashes(self, expected: frozenset[object], *, tier: str = "device") -> IndexerDump:
        """Until the indexer's ``tier`` block set equals ``expected``; on timeout the difference is printed."""
        try:
            return await self.wait_for_dump(lambda dump: dump.hashes(tier=tier) == expected)
        except trio.Cancelled:
            if self.last_dump is not None:
                got = self.last_dump.hashes(tier=tier)
                print(f"indexer {tier} set: missing {sorted(expected - got, key=str)[:20]}")
                print(f"indexer {tier} set: extra {sorted(got - expected, key=str)[:20]}")
            raise

    def report(self, expected: IndexerDump) -> None:
        """Print how the last ``/dump`` read differs from ``expected``, and the log's tail."""
        got = self.last_dump.blocks if self.last_dump is not None else frozenset()
        print("indexer missing:", sorted(expected.blocks - got, key=str)[:10])
        print("indexer extra:", sorted(got - expected.blocks, key=str)[:10])
        warnings = [line for line in self.log.lines if " INFO " not in line]
        print(f"{len(warnings)} warnings; the first and the last 20 log lines:")
        print("\n".join([*warnings[:20], "...", *self.log.lines[-20:]]))


async def _pump_lines(stream: Any, log: LineLog) -> None:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            log.append(_ANSI.sub("", line.decode(errors="replace")))


async def _wait_healthy(process: trio.Process, http: httpx.AsyncClient, base_url: str) -> bool:
    """True once ``/health`` answers 200; False if the process died first (e.g. its port was taken)."""
    while process.poll() is None:
        try:
            answer = await http.get(f"{base_url}/health")
        except httpx.TransportError:
            await trio.sleep(_DUMP_POLL)
            continue
        if answer.status_code == 200:
            return True
        await trio.sleep(_DUMP_POLL)
    return False


@asynccontextmanager
async def run_indexer(python: str, *, threads: int = 4) -> AsyncIterator[DynamoIndexer]:
    """Start the indexer on a free 127.0.0.1 port; kill it (and wait for it) on exit."""
    env = {**os.environ, "NO_COLOR": "1", "RUST_LOG": "info", "PYTHONUNBUFFERED": "1"}
    async with httpx.AsyncClient(timeout=30.0) as http, trio.open_nursery() as nursery:
        for _attempt in range(_START_ATTEMPTS):
            port = free_port()
            command = [python, "-m", "dynamo.indexer", "--port", str(port), "--threads", str(threads)]
            process = await trio.lowlevel.open_process(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
            )
            log = LineLog()
            assert process.stdout is not None
            nursery.start_soon(_pump_lines, process.stdout, log)
            base_url = f"http://127.0.0.1:{port}"
            try:
                with trio.fail_after(_HEALTH_TIMEOUT):
                    healthy = await _wait_healthy(process, http, base_url)
                if healthy:
                    break
            except BaseException:
                await _stop(process)
                raise
            await _stop(process)
        else:
            raise AssertionError("dynamo.indexer did not start:\n" + "\n".join(log.lines))
        indexer = DynamoIndexer(process, base_url, log, http)
        try:
            yield indexer
        finally:
            await _stop(process)
            nursery.cancel_scope.cancel()


async def _stop(process: trio.Process) -> None:
    if process.poll() is None:
        process.kill()
    with trio.move_on_after(10, shield=True):
        await process.wait()
