"""A real Redis Cluster for the stream tests: 3 masters + 3 replicas from the redis-server binary.

``RedisClusterServer`` starts six ``redis-server --cluster-enabled yes`` on free 127.0.0.1 ports (no RDB, no
AOF), joins them with ``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes`` and waits until
every node says ``cluster_state:ok``.  A test may kill a master (SIGKILL) and wait for its replica to take
over, start the killed node again (it rejoins as a replica), or restart the whole cluster without persistence
(every node comes back empty and the cluster is created anew on the same ports).  Fast failover: the node
timeout is 1 s and a replica takes over whatever its replication lag (``cluster-replica-validity-factor 0``).

Fixtures: ``redis_cluster`` (one per module, left as it was found: tests that kill nodes use
``private_redis_cluster``, their own).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.cluster
import trio

from bench.redis_procs import cluster_port
from kvagent._util.redis_target import StreamTarget
from tests.support.redis_server import _stop, redis_binary

__all__ = ["RedisClusterServer", "private_redis_cluster", "redis_cluster"]

NODES = 6
NODE_TIMEOUT_MS = 1000
START_TIMEOUT = 30.0


def _info(port: int) -> dict[str, str]:
    try:
        with redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1) as client:
            text = client.execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return {}
    text = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def _role(port: int) -> str | None:
    try:
        with redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1) as client:
            info = client.info("replication")
    except redis.RedisError:
        return None
    return str(info.get("role"))


class RedisClusterServer:
    """Six cluster-enabled redis-servers on their own ports: 3 masters, each with one replica."""

    def __init__(self, binary: str, directory: Path, extra_args: tuple[str, ...] = ()) -> None:
        self._binary = binary
        self._extra_args = extra_args  # further redis-server options of every node
        self._cli = shutil.which("redis-cli") or str(Path(binary).with_name("redis-cli"))
        self.directory = directory
        taken: set[int] = set()
        self.ports: list[int] = []
        for _ in range(NODES):
            self.ports.append(cluster_port(taken))
        self._processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The entry node's URL (a cluster client learns the others from it)."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    @property
    def every_node_url(self) -> str:
        """A cluster URL naming every node (any that answers will do: survives a killed entry node)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def target(self, **kwargs: float) -> StreamTarget:
        return StreamTarget(self.url, cluster=True, **kwargs)  # type: ignore[arg-type]

    def client(self) -> redis.cluster.RedisCluster:
        port = next(p for p in self.ports if p in self._processes and _role(p) is not None)
        return redis.cluster.RedisCluster(host="127.0.0.1", port=port, socket_timeout=5)

    # --- blocking steps (the async methods run them in a worker thread) ---------------------------------
    def _spawn(self, port: int) -> None:
        node_dir = self.directory / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        command = [
            self._binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(node_dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0",
            "--loglevel", "warning", *self._extra_args,
        ]  # fmt: skip
        with (node_dir / "redis.log").open("ab") as log_file:
            self._processes[port] = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)

    def _wait(self, predicate: object, what: str) -> None:
        assert callable(predicate)
        deadline = time.monotonic() + START_TIMEOUT
        # External processes' states have no event to wait on: poll, up to a deadline.
        while not predicate():
            if time.monotonic() > deadline:
                logs = "\n".join(
                    (self.directory / str(p) / "redis.log").read_text()[-600:]
                    for p in self.ports
                    if (self.directory / str(p) / "redis.log").exists()
                )
                raise RuntimeError(f"redis cluster: {what} not reached in {START_TIMEOUT} s\n{logs}")
            time.sleep(0.05)

    def _live(self) -> list[int]:
        return [p for p, proc in self._processes.items() if proc.poll() is None]

    def _all_ok(self) -> bool:
        return all(_info(p).get("cluster_state") == "ok" for p in self._live())

    def _start_blocking(self) -> None:
        for port in self.ports:
            self._spawn(port)
        self._wait(lambda: all(_role(p) is not None for p in self.ports), "every node answering")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        created = subprocess.run(
            [self._cli, "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-1500:]!r}")
        self._wait(self._all_ok, "cluster_state:ok on every node")
        self._wait(lambda: len(self.masters()) == NODES // 2, "three masters")
        self._wait(self._replicas_linked, "every replica linked to its master")

    def _replicas_linked(self) -> bool:
        for port in self._live():
            try:
                with redis.Redis(port=port, socket_timeout=1) as client:
                    info = client.info("replication")
            except redis.RedisError:
                return False
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def masters(self) -> list[int]:
        """Ports of the live nodes that are masters."""
        return [p for p in self._live() if _role(p) == "master"]

    def master_of(self, key: str) -> int:
        """Port of the master that holds ``key`` now."""
        with self.client() as client:
            node = client.get_node_from_key(key)
            return int(node.port)

    def keys_of(self, port: int, pattern: str) -> list[str]:
        """Keys matching ``pattern`` on the node on ``port``."""
        with redis.Redis(port=port, socket_timeout=5) as client:
            return sorted(k.decode() for k in client.scan_iter(match=pattern, count=1000))

    def replica_of(self, master: int) -> int:
        """Port of the replica of the master on ``master``."""
        with redis.Redis(port=master, socket_timeout=1) as client:
            info = client.info("replication")
        return int(info["slave0"]["port"])

    def pause(self, port: int) -> None:
        """SIGSTOP the node (with :meth:`cut_replication`, what its master acknowledges meanwhile is lost if
        the master dies and this replica takes over)."""
        self._processes[port].send_signal(signal.SIGSTOP)

    def cut_replication(self, master: int) -> None:
        """Close the master's links to its replicas (a paused replica then gets nothing written after this:
        not even what a kernel buffer would have held for it)."""
        with redis.Redis(port=master, socket_timeout=1) as client:
            client.execute_command("CLIENT", "KILL", "TYPE", "replica")

    def resume(self, port: int) -> None:
        self._processes[port].send_signal(signal.SIGCONT)

    def _move_blocking(self, key: str) -> tuple[int, int]:
        """Migrate the hash slot of ``key`` to another master, key by key (clients meet ASK, then MOVED)."""
        source = self.master_of(key)
        target = next(p for p in self.masters() if p != source)
        with (
            redis.Redis(port=source, socket_timeout=5) as src,
            redis.Redis(port=target, socket_timeout=5) as dst,
        ):
            slot = int(src.execute_command("CLUSTER", "KEYSLOT", key))
            src_id = src.execute_command("CLUSTER", "MYID")
            dst_id = dst.execute_command("CLUSTER", "MYID")
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10):
                src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            for port in self.masters():
                with redis.Redis(port=port, socket_timeout=5) as node:
                    node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return source, target

    async def move_slot_of(self, key: str) -> tuple[int, int]:
        """Reshard: the hash slot of ``key`` moves to another master; returns (source, target) ports."""
        return await trio.to_thread.run_sync(self._move_blocking, key)

    def _kill_blocking(self, port: int) -> None:
        process = self._processes.pop(port)
        _stop(process, signal.SIGKILL)

    def _failed_over(self) -> bool:
        live = self._live()
        if len(self.masters()) != NODES // 2:
            return False
        return all(_info(p).get("cluster_state") == "ok" for p in live)

    def _stop_all(self, sig: signal.Signals = signal.SIGTERM) -> None:
        for port in list(self._processes):
            _stop(self._processes.pop(port), sig)

    # --- the test's side ----------------------------------------------------------------------------------
    async def start(self) -> None:
        await trio.to_thread.run_sync(self._start_blocking)

    async def kill_master(self, port: int, *, wait: bool = True) -> None:
        """SIGKILL the master on ``port``; with ``wait``, return once its replica has taken over."""
        assert port in self.masters(), f"{port} is not a live master"
        await trio.to_thread.run_sync(self._kill_blocking, port)
        if wait:
            await self.wait_failed_over()

    async def wait_failed_over(self) -> None:
        """Return once three masters serve again and every live node says cluster_state:ok."""
        await trio.to_thread.run_sync(self._wait, self._failed_over, "the replica's takeover")

    async def restart_node(self, port: int) -> None:
        """Start a killed node again (its nodes.conf is kept: it rejoins, as a replica)."""
        await trio.to_thread.run_sync(self._spawn, port)
        await trio.to_thread.run_sync(self._wait, self._all_ok, "cluster_state:ok after the rejoin")

    async def restart_all(self) -> None:
        """Every node killed, its files removed, and the cluster created anew: nothing survives."""

        def restart() -> None:
            self._stop_all(signal.SIGKILL)
            for port in self.ports:
                shutil.rmtree(self.directory / str(port), ignore_errors=True)
            self._start_blocking()

        await trio.to_thread.run_sync(restart)

    async def stop(self) -> None:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._stop_all)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServer]:
    """A started cluster shared by a module's tests (which must not kill its nodes)."""
    cluster = RedisClusterServer(redis_binary(), tmp_path_factory.mktemp("redis-cluster"))
    try:
        trio.run(cluster.start)
    except RuntimeError as exc:
        trio.run(cluster.stop)
        pytest.fail(str(exc))
    try:
        yield cluster
    finally:
        trio.run(cluster.stop)


@pytest.fixture
async def private_redis_cluster(tmp_path: Path) -> AsyncIterator[RedisClusterServer]:
    """A started cluster of the test's own, which it may kill nodes of."""
    cluster = RedisClusterServer(redis_binary(), tmp_path / "redis-cluster")
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.stop()
