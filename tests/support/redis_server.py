"""A real redis-server for the stream tests (pytest plugin, loaded from tests/conftest.py).

``redis_server``: a private ``redis-server`` (the binary named by KVAGENT_REDIS_SERVER, else the one on
PATH) started once per session on a free 127.0.0.1 port, without persistence; skips when there is no
binary, or fails when KVAGENT_REQUIRE_REDIS=1 (CI: .ci/redis.sh).  ``redis_prefix`` is a key prefix of the
test's own, so tests never see each other's streams.

``PrivateRedis``: a server of the test's own that it may stop (SIGTERM or SIGKILL) and start again on the
same port, e.g. to restart Redis mid-stream; it keeps nothing across a restart (no RDB, no AOF), the
harshest case for a writer.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import trio

from kvagent._util.redis_target import StreamTarget

__all__ = ["PrivateRedis", "private_redis", "redis_binary", "redis_prefix", "redis_server"]

BINARY_ENV = "KVAGENT_REDIS_SERVER"
REQUIRE_ENV = "KVAGENT_REQUIRE_REDIS"
NO_REDIS = "no redis-server: install Debian's redis-server (apt-get install redis-server) or set KVAGENT_REDIS_SERVER"
START_TIMEOUT = 20.0


def redis_binary() -> str:
    """Path of redis-server; skips (or fails under KVAGENT_REQUIRE_REDIS=1) if there is none."""
    binary = os.environ.get(BINARY_ENV) or shutil.which("redis-server")
    if binary is None or not Path(binary).exists():
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {NO_REDIS}")
        pytest.skip(NO_REDIS)
    assert binary is not None
    return binary


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _command(binary: str, port: int, directory: Path) -> list[str]:
    return [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory),
        "--protected-mode",
        "yes",
        "--loglevel",
        "warning",
    ]


def _pings(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _stop(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM) -> None:
    """Signal ``process`` and reap it (SIGKILL if it is still there after 10 s)."""
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _spawn(binary: str, port: int, directory: Path) -> subprocess.Popen[bytes]:
    with (directory / "redis.log").open("ab") as log_file:
        return subprocess.Popen(_command(binary, port, directory), stdout=log_file, stderr=subprocess.STDOUT)


def _wait_serving(process: subprocess.Popen[bytes], port: int, directory: Path) -> None:
    """Return once the spawned server answers PING (the one start loop of both fixtures); else stop it.

    Blocking: the session fixture calls it directly, PrivateRedis from a worker thread.
    """
    deadline = time.monotonic() + START_TIMEOUT
    # An external process's readiness has no event to wait on: poll PING, up to a deadline.
    while not _pings(port):
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process, signal.SIGKILL)
            log = (directory / "redis.log").read_text()[-2000:]
            raise RuntimeError(f"redis-server did not start: {log}")
        time.sleep(0.02)


class PrivateRedis:
    """A redis-server on its own port that survives stop()/start() cycles (losing its data each time)."""

    def __init__(self, binary: str, directory: Path) -> None:
        self._binary = binary
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = directory / "redis.log"
        self._process: subprocess.Popen[bytes] | None = None

    def target(self, **kwargs: float) -> StreamTarget:
        return StreamTarget(self.url, **kwargs)  # type: ignore[arg-type]

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    async def start(self) -> None:
        assert self._process is None, "already running"
        # Owned before the wait: a start cancelled half-way still leaves the process to stop().
        self._process = process = _spawn(self._binary, self.port, self.directory)
        await trio.to_thread.run_sync(_wait_serving, process, self.port, self.directory)

    async def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with trio.CancelScope(shield=True):  # bounded: _stop kills after 10 s
            await trio.to_thread.run_sync(_stop, process, sig)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of the session's private redis-server."""
    binary = redis_binary()
    directory = tmp_path_factory.mktemp("redis")
    port = _free_port()
    process = _spawn(binary, port, directory)
    try:
        _wait_serving(process, port, directory)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(process)


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix nobody else uses."""
    return f"kvtest-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[PrivateRedis]:
    """A started PrivateRedis, stopped after the test."""
    server = PrivateRedis(redis_binary(), tmp_path / "redis")
    try:
        await server.start()
        yield server
    finally:
        await server.stop()
