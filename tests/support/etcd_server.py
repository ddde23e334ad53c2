"""A real etcd for the discovery integration tests (pytest plugin, loaded from tests/conftest.py).

``etcd_endpoint``: the shared server named by KVAGENT_ETCD_ENDPOINT (CI starts one), else a private server
started once per session from the ``etcd`` binary on PATH, else skip -- or fail when KVAGENT_REQUIRE_ETCD=1.
Each test gets its own random key prefix, so tests never see each other's records.

``PrivateEtcd``: an etcd process of the test's own (own ports, own data dir) that the test may stop and
start again on the same ports and data dir, e.g. to simulate an outage; always private, whatever the
environment says.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import attrs
import httpx
import pytest
import trio

__all__ = ["EtcdEndpoint", "PrivateEtcd", "etcd_binary", "etcd_endpoint", "private_etcd"]

ENDPOINT_ENV = "KVAGENT_ETCD_ENDPOINT"
REQUIRE_ENV = "KVAGENT_REQUIRE_ETCD"
NO_ETCD = (
    "no etcd server: install Debian's etcd-server (apt-get install etcd-server) or set KVAGENT_ETCD_ENDPOINT"
)
START_TIMEOUT = 20.0


@attrs.frozen(slots=True)
class EtcdEndpoint:
    """One test's view of an etcd server: its client URL and a key prefix nobody else uses."""

    client_url: str  # http://HOST:PORT
    prefix: str  # /kvagent-test-<hex>

    @property
    def host_port(self) -> str:
        return self.client_url.split("://", 1)[1].rstrip("/")

    @property
    def discovery_url(self) -> str:
        return f"etcd://{self.host_port}{self.prefix}"


def _no_etcd() -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {NO_ETCD}")
    pytest.skip(NO_ETCD)


def etcd_binary() -> str:
    """Path of the etcd binary; skips (or fails under KVAGENT_REQUIRE_ETCD=1) if there is none."""
    binary = shutil.which("etcd")
    if binary is None:
        _no_etcd()
    assert binary is not None
    return binary


def _free_ports(count: int) -> list[int]:
    # Bind them all before closing any, so the kernel hands out distinct ports.
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _etcd_command(binary: str, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        binary,
        "--name=kvagent-test",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kvagent-test={peer}",
        "--log-level=error",
    ]


def _healthy_sync(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=1) as response:
            return b'"true"' in response.read()
    except OSError:
        return False


@pytest.fixture(scope="session")
def etcd_server_url() -> Iterator[str]:
    """Client URL of the session's etcd server (shared from the environment, or private)."""
    shared = os.environ.get(ENDPOINT_ENV)
    if shared:
        yield shared.rstrip("/")
        return
    binary = etcd_binary()
    client_port, peer_port = _free_ports(2)
    client_url = f"http://127.0.0.1:{client_port}"
    with tempfile.TemporaryDirectory(prefix="kvagent-etcd-") as tmp:
        log_file = (Path(tmp) / "etcd.log").open("wb")
        process = subprocess.Popen(
            _etcd_command(binary, Path(tmp) / "data", client_port, peer_port),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT
            # Waiting on an external process's startup, outside any Trio run: polling is the only option.
            while not _healthy_sync(client_url):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"private etcd did not start: {(Path(tmp) / 'etcd.log').read_text()[-2000:]}")
                time.sleep(0.05)
            yield client_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log_file.close()


@pytest.fixture
def etcd_endpoint(etcd_server_url: str) -> EtcdEndpoint:
    return EtcdEndpoint(client_url=etcd_server_url, prefix=f"/kvagent-test-{uuid.uuid4().hex[:12]}")


class PrivateEtcd:
    """An etcd process on its own ports and data dir that survives stop()/start() cycles."""

    def __init__(self, binary: str, data_dir: Path) -> None:
        self._binary = binary
        self.data_dir = data_dir
        self.client_port, self.peer_port = _free_ports(2)
        self.client_url = f"http://127.0.0.1:{self.client_port}"
        self.log_path = data_dir.parent / "etcd.log"
        self._process: trio.Process | None = None

    def endpoint(self, prefix: str = "/kvagent") -> EtcdEndpoint:
        return EtcdEndpoint(client_url=self.client_url, prefix=prefix)

    @property
    def running(self) -> bool:
        return self._process is not None

    async def start(self) -> None:
        """Start (again, same ports and data) and return once /health says true."""
        assert self._process is None, "already running"
        with self.log_path.open("ab") as log_file:
            self._process = await trio.lowlevel.open_process(
                _etcd_command(self._binary, self.data_dir, self.client_port, self.peer_port),
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        async with httpx.AsyncClient(timeout=1) as client:
            with trio.fail_after(START_TIMEOUT):
                # An external process's readiness has no event to wait on: poll /health.
                while True:
                    if self._process.poll() is not None:
                        raise RuntimeError(f"etcd exited: {self.log_path.read_text()[-2000:]}")
                    try:
                        response = await client.get(f"{self.client_url}/health")
                        if response.status_code == 200 and response.json().get("health") == "true":
                            return
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.05)

    async def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the process (SIGTERM: graceful; SIGKILL: crash) and wait until it is gone."""
        process, self._process = self._process, None
        if process is None:
            return
        process.send_signal(sig)
        with trio.move_on_after(10, shield=True) as scope:
            await process.wait()
        if scope.cancelled_caught:
            process.kill()
            with trio.move_on_after(5, shield=True):
                await process.wait()


@pytest.fixture
async def private_etcd(tmp_path: Path) -> AsyncIterator[PrivateEtcd]:
    """A started PrivateEtcd, stopped after the test."""
    server = PrivateEtcd(etcd_binary(), tmp_path / "etcd-data")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
