"""``kvagent serve --stream`` end to end: a real agent process, killed with SIGKILL and restarted on its state
directory, its slot rebuilt from Redis alone (``StreamFollower``, and ``kvagent stream-follow``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis
import trio

from kvagent._util.redis_target import StreamTarget
from kvagent.stream.format import EventsEntry, SnapshotEntry, StreamKeys, decode_entry
from kvagent.stream.reader import StreamFollower
from kvagent.wire.router_event import router_event_to_json
from tests.e2e.test_durability import event_ids, kill9, open_rig, wait_persisted
from tests.support.serve import client, follow_until

TIMEOUT = 120


def canonical(events: list[dict[str, Any]]) -> set[str]:
    """A tree dump's blocks as comparable strings (route, block, parent, tokens, multimodal info)."""
    state = set()
    for event in events:
        stored = event["event"]["data"]["stored"]
        block = stored["blocks"][0]
        route = {
            k: event.get(k)
            for k in ("worker_id", "storage_tier", "residency_domain", "dp_rank", "state_source")
        }
        state.add(json.dumps([route, stored["parent_hash"], block], sort_keys=True))
    return state


async def replica_at(target: StreamTarget, prefix: str, cursor: int) -> StreamFollower:
    """A follower caught up to ``cursor`` (the agent is another process: its stream is polled)."""
    while True:
        follower = StreamFollower(target, prefix=prefix)
        await follower.catch_up()
        await follower.aclose()
        replica = follower.replicas.get("s0")
        if replica is not None and replica.cursor >= cursor:
            return follower
        await trio.sleep(0.05)


def stream_entries(url: str, keys: StreamKeys) -> list[EventsEntry | SnapshotEntry]:
    with redis.Redis.from_url(url) as connection:
        raw: Any = connection.xrange(keys.events)
    entries = [decode_entry(i.decode(), f) for i, f in raw]
    return [e for e in entries if isinstance(e, EventsEntry | SnapshotEntry)]


async def test_kill9_and_restart_no_duplicate_no_gap(
    tmp_path: Path, redis_server: str, redis_prefix: str
) -> None:
    target = StreamTarget(redis_server)
    stream = ("--stream", redis_server, "--stream-prefix", redis_prefix)
    with trio.fail_after(TIMEOUT):
        async with open_rig(tmp_path) as rig:
            async with rig.serving(*rig.args, *stream) as agent:
                async with client(agent.url) as c:
                    publisher_id = (await c.request("status"))["status"]["identity"]["publisher_id"]
                    await rig.publish(200)
                    seen = await follow_until(c, await rig.sentinel(), None)
                async with client(agent.url) as c:
                    last_id = max(event_ids(seen))
                    await wait_persisted(c, last_id)
                await replica_at(target, redis_prefix, last_id)
                kill9(agent)
                await agent.process.wait()
            await rig.publish(150)  # while the agent is down: the engine's replay buffer keeps them

            async with rig.serving(*rig.args, *stream) as agent:
                async with client(agent.url) as c:
                    await follow_until(c, await rig.sentinel(), last_id)
                    status = (await c.request("status"))["status"]
                    dump = await c.request("recover", start=None, end=None)
                assert status["identity"]["publisher_id"] == publisher_id  # the same stream goes on
                cursor = dump["last_event_id"]
                follower = await replica_at(target, redis_prefix, cursor)
                replica = follower.replicas["s0"]
                assert replica.cursor == cursor
                rebuilt = [router_event_to_json(e) for e in replica.index.tree_dump().events]
                assert canonical(rebuilt) == canonical(dump["events"]) != set()
                assert replica.ready and replica.generation == status["attachment"]["generation"]

                # The CLI rebuilds the same state, with no connection to the agent.
                command = [sys.executable, "-m", "kvagent.cli.main", "stream-follow", redis_server]
                command += ["--prefix", redis_prefix, "--slot", "s0", "--once", "--dump"]
                result = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
                lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
                assert lines[0]["slot"] == "s0" and lines[0]["cursor"] == cursor and lines[0]["ready"]
                assert canonical([line["event"] for line in lines[1:]]) == canonical(dump["events"])

    keys = StreamKeys(redis_prefix, "s0", publisher_id)
    covered: int | None = None
    ids: list[int] = []
    for entry in stream_entries(redis_server, keys):
        if isinstance(entry, SnapshotEntry):
            covered = entry.cursor  # a reset: the reader reloads the snapshot at this cursor
            continue
        assert covered is None or entry.first == covered + 1, "a gap or an overlap in the stream"
        covered = entry.last
        ids += [event.event_id for event in entry.events]
    assert len(ids) == len(set(ids)), "an event written twice"
    assert ids == sorted(ids) and ids[-1] >= last_id


def test_stream_follow_refuses_a_password_on_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvagent.cli.main", "stream-follow", "redis://:pw@127.0.0.1:1/0", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "password" in result.stderr and "pw@" not in result.stderr
