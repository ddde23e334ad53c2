"""Private redis-server processes for the figures: one plain server, or a small cluster (no persistence).

The figures that measure the Redis Streams path (fig_fleet, fig_stream_entries) start their servers here, so
the command line, the free-port choice and the wait for readiness are written once.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import redis

__all__ = [
    "RedisServer",
    "free_port",
    "redis_server",
    "redis_server_binary",
    "start_cluster",
    "wait_ping",
]


class RedisServer(NamedTuple):
    url: str
    client: redis.Redis
    directory: Path


def redis_server_binary() -> str:
    binary = os.environ.get("KVAGENT_REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no redis-server: apt-get install redis-server (or set KVAGENT_REDIS_SERVER)")
    return binary


def _server_command(binary: str, port: int, directory: Path) -> list[str]:
    return [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(directory),
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ping(client: redis.Redis) -> None:
    """Return once the server answers PING (raise its ConnectionError after 20 s)."""
    deadline = time.monotonic() + 20
    while True:  # an external process's startup: polling is the only option
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextmanager
def redis_server(prefix: str) -> Iterator[RedisServer]:
    """A private redis-server on a free loopback port, its data in a temporary directory named ``prefix*``."""
    binary = redis_server_binary()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        server = subprocess.Popen(
            _server_command(binary, port, Path(tmp)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis(port=port)
        try:
            wait_ping(client)
            yield RedisServer(f"redis://127.0.0.1:{port}/0", client, Path(tmp))
        finally:
            client.close()
            server.terminate()
            server.wait(timeout=10)


def cluster_port(taken: set[int]) -> int:
    """A free port P with P + 10000 (its cluster bus) free too, both added to ``taken``."""
    while True:
        port = free_port()
        if port > 55535 or port in taken or port + 10000 in taken:
            continue
        try:
            with socket.socket() as bus:
                bus.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        taken.update((port, port + 10000))
        return port


def start_cluster(
    binary: str, directory: Path, masters: int
) -> tuple[list[int], list[subprocess.Popen[bytes]]]:
    """``masters`` cluster-enabled servers joined by ``redis-cli --cluster create`` (no replicas)."""
    taken: set[int] = set()
    ports = [cluster_port(taken) for _ in range(masters)]
    processes = []
    for port in ports:
        node = directory / str(port)
        node.mkdir()
        command = [
            *_server_command(binary, port, node), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        ]  # fmt: skip
        processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for port in ports:
        wait_ping(redis.Redis(port=port))
    cli = shutil.which("redis-cli") or str(Path(binary).with_name("redis-cli"))
    nodes = [f"127.0.0.1:{port}" for port in ports]
    subprocess.run(
        [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    deadline = time.monotonic() + 30
    while True:  # an external process's state: polling is the only option
        states = []
        for port in ports:
            info: Any = redis.Redis(port=port).cluster("INFO")
            states.append(
                info.get("cluster_state") == "ok" if isinstance(info, dict) else b"cluster_state:ok" in info
            )
        if all(states):
            return ports, processes
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not reach cluster_state:ok")
        time.sleep(0.1)
