"""``kvagent serve --stream … --stream-cluster`` and ``kvagent stream-follow --cluster`` against a real
3-master + 3-replica Redis Cluster, as a new user would run them (issue #36), and the one line a wrong
setup prints while the agent keeps serving its slots."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import trio

from kvagent._util.redis_target import StreamTarget
from kvagent.stream.format import StreamKeys
from kvagent.stream.reader import StreamFollower
from tests.support.redis_cluster import RedisClusterServer, redis_cluster
from tests.support.serve import serve

__all__ = ["redis_cluster"]  # the fixture, used by name below

TIMEOUT = 120
SLOTS = ("a", "b", "c", "d")


async def _written(target: StreamTarget, prefix: str) -> StreamFollower:
    """A follower that found every slot with events (the agent is another process: its streams are polled)."""
    while True:
        follower = StreamFollower(target, prefix=prefix)
        await follower.catch_up()
        await follower.aclose()
        if sorted(follower.replicas) == list(SLOTS) and all(r.cursor > 0 for r in follower.replicas.values()):
            return follower
        await trio.sleep(0.1)


async def test_serve_and_follow_a_cluster(tmp_path: Path, redis_cluster: RedisClusterServer) -> None:
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    slots = [arg for name in SLOTS for arg in ("--slot", name)]
    stream = ("--stream", redis_cluster.url, "--stream-cluster", "--stream-prefix", prefix)
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, *slots, "--simulate", *stream) as agent:
            await _written(redis_cluster.target(), prefix)
            command = [sys.executable, "-m", "kvagent.cli.main", "stream-follow", redis_cluster.url]
            command += ["--cluster", "--all", "--once", "--prefix", prefix]
            result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
            assert result.returncode == 0, result.stderr.decode()
            lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
            assert [line["slot"] for line in lines] == list(SLOTS)
            assert all(line["cursor"] > 0 and line["ready"] for line in lines)
            assert b"Error" not in result.stderr, result.stderr.decode()
            log = "\n".join(agent.stderr_lines)
            assert "stream_write_failed" not in log and "MovedError" not in log, log


async def test_a_plain_url_at_a_cluster_is_one_line_and_the_slots_go_on(
    tmp_path: Path, redis_cluster: RedisClusterServer
) -> None:
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    entry = int(redis_cluster.url.rsplit(":", 1)[1])
    # Slots whose keys are on another shard than the URL's node (that node answers MOVED for them).
    elsewhere = [
        name
        for name in (f"s{n}" for n in range(100))
        if redis_cluster.master_of(StreamKeys(prefix, name, 0).head) != entry
    ][:2]
    slots = [arg for name in elsewhere for arg in ("--slot", name)]
    stream = ("--stream", redis_cluster.url, "--stream-prefix", prefix)  # no --stream-cluster
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, *slots, "--simulate", *stream) as agent:
            line = await agent.log.wait_for(lambda text: "stream_write_failed" in text)
            assert "is a Redis Cluster node" in line and "--stream-cluster" in line, line
            # The slots keep serving: status lines go on after the failure.
            seen = len(agent.stderr_lines)
            await agent.log.wait_for(lambda _: any("cursor" in text for text in agent.stderr_lines[seen:]))
            assert agent.process.poll() is None

        command = [sys.executable, "-m", "kvagent.cli.main", "stream-follow", redis_cluster.url, "--once"]
        result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
        # Against a cluster without --cluster, the directory key may live on another node: one line, no
        # "unexpected".
        text = result.stderr.decode()
        assert "unexpected" not in text, text
        if result.returncode != 0:
            assert len(text.strip().splitlines()) == 1 and "redis+cluster://" in text, text


async def test_stream_follow_with_no_node_up_is_one_line() -> None:
    with trio.socket.socket() as sock:  # a port nothing listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "kvagent.cli.main", "stream-follow", f"redis+cluster://127.0.0.1:{port}"]
    with trio.fail_after(TIMEOUT):
        result = await trio.run_process([*command, "--once"], capture_stderr=True, check=False)
    text = result.stderr.decode().strip()
    assert result.returncode != 0 and len(text.splitlines()) == 1, text
    assert "cannot be connected" in text and "unexpected" not in text, text
