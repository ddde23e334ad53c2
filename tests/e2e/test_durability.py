"""Issue #17 end to end: ``kvagent serve --state-dir D`` killed with SIGKILL and restarted on the same D.

A fake vLLM engine (live PUB + replay ROUTER) runs in the test process; the agent is a subprocess. Batches
are streamed, the agent is killed with ``kill -9``, more batches are streamed while it is down, and it is
started again with the same state directory. A ``follow`` client that saw every event before the kill
reconnects with its last id and must get exactly what it missed: applying those events to what it had
gives the engine's truth.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from kvagent.cli.main import build_parser, serve_config_from_args
from kvagent.cli.serve import slot_agent_config
from kvagent.model.errors import CodecError
from kvagent.model.status import AgentStatus, PersistenceStatus
from kvagent.persist.store import SCHEMA_VERSION, SlotIdentityRecord, SlotStore
from kvagent.simulator.engine import FakeVllmEngine, block_removed, block_stored
from tests.support.ids import IDENTITY
from tests.support.serve import Client, ServeProcess, client, follow_until, serve

TIMEOUT = 90
BLOCK = 16
SENTINEL_BASE = 1 << 60


class Churn:
    """One new block per engine step; past ``capacity`` the oldest is removed (so truth is the last N)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self.next_hash = 1

    def step(self) -> list[dict[str, Any]]:
        block = self.next_hash
        self.next_hash += 1
        events = [block_stored([block], None, [block % 50_000] * BLOCK, BLOCK)]
        if block > self.capacity:
            events.append(block_removed([block - self.capacity]))
        return events


def worker_device(event: dict[str, Any]) -> bool:
    return bool(event["residency_domain"] == "worker" and event["storage_tier"] == "device")


def is_cleared(event: dict[str, Any]) -> bool:
    data = event["event"]["data"]
    return data == "cleared" or (isinstance(data, dict) and "cleared" in data)


def apply_events(state: set[int], events: list[dict[str, Any]]) -> set[int]:
    """A router's Worker GPU residency after ``events`` (set based, as every router keeps it)."""
    state = set(state)
    for event in filter(worker_device, events):
        data = event["event"]["data"]
        if is_cleared(event):
            state.clear()
        elif "stored" in data:
            state.update(block["block_hash"] for block in data["stored"]["blocks"])
        elif "removed" in data:
            state.difference_update(data["removed"]["block_hashes"])
    return state


def event_ids(events: list[dict[str, Any]]) -> list[int]:
    return [event["event"]["event_id"] for event in events]


async def worker_dump(c: Client) -> set[int]:
    dump = await c.request("recover", start=None, end=None)
    assert dump["ok"] and dump["kind"] == "tree_dump", dump
    return apply_events(set(), dump["events"])


async def wait_persisted(c: Client, event_id: int) -> dict[str, Any]:
    """Poll the status (a real observable) until the state file holds ``event_id``."""
    while True:
        status: dict[str, Any] = (await c.request("status"))["status"]
        if status["persistence"]["persisted_id"] >= event_id:
            return status
        await trio.sleep(0.05)


class Rig:
    def __init__(self, tmp: Path, engine: FakeVllmEngine) -> None:
        self.tmp = tmp
        self.engine = engine
        self.workload = Churn()
        self.sentinels = 0
        self.state_dir = tmp / "state"

    @property
    def args(self) -> tuple[str, ...]:
        replay = self.engine.replay_endpoint
        assert replay is not None
        return (
            "--slot",
            f"s0={self.engine.endpoint}",
            "--replay",
            replay,
            "--topic",
            self.engine.topic.decode(),
            "--block-size",
            str(BLOCK),
            "--state-dir",
            str(self.state_dir),
        )

    @property
    def state_file(self) -> Path:
        return self.state_dir / "slots" / "s0.sqlite3"

    async def publish(self, batches: int) -> None:
        for _ in range(batches):
            await self.engine.publish_batch(self.workload.step())

    async def sentinel(self) -> int:
        block = SENTINEL_BASE + self.sentinels
        self.sentinels += 1
        await self.engine.publish_batch([block_stored([block], None, [7] * BLOCK, BLOCK)])
        return block

    async def remove(self, block: int) -> None:
        await self.engine.publish_batch([block_removed([block])])

    @asynccontextmanager
    async def serving(self, *args: str) -> AsyncIterator[ServeProcess]:
        """``kvagent serve`` on this rig (``args`` instead of the usual ones), returned once its SUB has
        subscribed to the engine."""
        subscriptions = self.engine.subscriptions  # cumulative: a restarted agent subscribes once more
        async with serve(self.tmp, *(args or self.args)) as agent:
            await self.engine.wait_for_subscriber(subscriptions + 1)
            yield agent

    def truth(self) -> set[int]:
        return {int(block) for block in self.engine.truth.blocks("GPU")}  # type: ignore[call-overload]


@asynccontextmanager
async def open_rig(tmp: Path, buffer_steps: int = 10_000) -> AsyncIterator[Rig]:
    context: zmq.Context[Any] = zmq.Context()
    engine = FakeVllmEngine(
        replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK, buffer_steps=buffer_steps, context=context
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            yield Rig(tmp, engine)
            nursery.cancel_scope.cancel()
    finally:
        context.destroy(linger=0)


async def first_life(rig: Rig, batches: int) -> tuple[int, int, set[int], list[dict[str, Any]]]:
    """Serve, stream ``batches``, follow everything, wait until it is on disk, then ``kill -9``.

    Returns (publisher id, last id seen, the follower's Worker state, every event it saw).
    """
    async with rig.serving() as agent:
        async with client(agent.url) as c:
            status = (await c.request("status"))["status"]
            assert status["persistence"]["state"] == "ok"
            publisher_id = status["identity"]["publisher_id"]
            await rig.publish(batches)
            seen = await follow_until(c, await rig.sentinel(), None)
        async with client(agent.url) as c:
            last_id = max(event_ids(seen))
            await wait_persisted(c, last_id)
        kill9(agent)
        await agent.process.wait()
    return publisher_id, last_id, apply_events(set(), seen), seen


def kill9(agent: ServeProcess) -> None:
    agent.process.kill()  # SIGKILL: no shutdown step runs, the state file stays as the crash left it


async def test_kill9_then_restart_resumes_from_the_engine_replay_without_a_reset(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_rig(tmp_path) as rig:
            publisher_id, last_id, follower, _ = await first_life(rig, 200)
            await rig.publish(150)  # while the agent is down: only the engine's replay buffer has them

            async with rig.serving() as agent:
                async with client(agent.url) as c:
                    missed = await follow_until(c, await rig.sentinel(), last_id)
                    status = (await c.request("status"))["status"]
                    dump = await worker_dump(c)
                ids = event_ids(missed)
                assert ids and ids[0] > last_id, "an outbound id was issued twice"
                assert ids == sorted(set(ids)), "ids only grow"
                assert status["identity"]["publisher_id"] == publisher_id
                assert not [event for event in missed if worker_device(event) and is_cleared(event)]
                assert dump == rig.truth()
                assert apply_events(follower, missed) == rig.truth()
                assert status["attachment"]["state"] == "ready"


async def test_kill9_with_the_gap_beyond_the_replay_buffer_resets_then_reaches_the_exact_state(
    tmp_path: Path,
) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_rig(tmp_path, buffer_steps=100) as rig:
            publisher_id, last_id, follower, seen = await first_life(rig, 50)
            await rig.remove(SENTINEL_BASE)  # the first life's sentinel goes, so the truth is the last 64
            await rig.publish(300)  # 300 > 100: the batch after the persisted one is gone from the buffer

            async with rig.serving() as agent:
                async with client(agent.url) as c:
                    missed = await follow_until(c, await rig.sentinel(), last_id)
                    status = (await c.request("status"))["status"]
                    dump = await worker_dump(c)
                ids = event_ids(missed)
                assert ids and ids[0] > last_id
                assert status["identity"]["publisher_id"] == publisher_id
                resets = [event for event in missed if worker_device(event) and is_cleared(event)]
                assert resets, "history was lost: the Worker state must be reset"
                assert dump == rig.truth()
                assert apply_events(follower, missed) == rig.truth()


async def test_a_clean_stop_continues_the_ids_without_a_jump(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_rig(tmp_path) as rig:
            async with rig.serving() as agent:
                async with client(agent.url) as c:
                    await rig.publish(20)
                    seen = await follow_until(c, await rig.sentinel(), None)
                agent.process.terminate()  # SIGTERM: the clean stop
                assert await agent.process.wait() == 0
            last_id = max(event_ids(seen))
            await rig.publish(10)
            async with rig.serving() as agent:
                async with client(agent.url) as c:
                    missed = await follow_until(c, await rig.sentinel(), last_id)
                assert event_ids(missed)[0] == last_id + 1
                assert apply_events(apply_events(set(), seen), missed) == rig.truth()


def write_garbage(path: Path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)  # a header, then garbage


def write_newer_version(path: Path) -> None:
    store = SlotStore.open(path)
    store.initialize(SlotIdentityRecord("s0", 41, "x"), 1 << 24, 1 << 24)
    store.close()
    db = sqlite3.connect(path)
    try:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        db.commit()
    finally:
        db.close()  # (a `with` block commits but does not close)


@pytest.mark.parametrize("damage", [write_garbage, write_newer_version], ids=["corrupt", "newer-version"])
async def test_a_refused_state_file_is_named_in_one_line_set_aside_and_the_slot_starts_cold(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_rig(tmp_path) as rig:
            rig.state_file.parent.mkdir(parents=True)
            damage(rig.state_file)
            async with rig.serving() as agent:
                refused = [line for line in agent.stderr_lines if "state_file_refused" in line]
                assert len(refused) == 1 and str(rig.state_file) in refused[0]
                aside = [
                    path
                    for path in rig.state_file.parent.glob("s0.sqlite3.refused-*")
                    if not path.name.endswith(("-wal", "-shm"))  # its WAL moves along with it
                ]
                assert len(aside) == 1
                async with client(agent.url) as c:
                    await rig.publish(5)
                    await follow_until(c, await rig.sentinel(), None)
                    status = (await c.request("status"))["status"]
                assert status["attachment"]["state"] == "ready"
                assert status["persistence"]["state"] == "ok"
            with closing(sqlite3.connect(rig.state_file)) as db:  # the new file is a sound database
                assert db.execute("PRAGMA quick_check").fetchone() == ("ok",)


def agent_config_for(tmp_path: Path, *options: str) -> object:
    args = build_parser().parse_args(["serve", "--slot", "s:0=tcp://127.0.0.1:5557", *options])
    config = serve_config_from_args(args)
    return slot_agent_config(config.slots[0], config, recovery_url="ws://x").state_path


def test_the_state_dir_option_default_none_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVAGENT_STATE_DIR", str(tmp_path / "root"))
    assert agent_config_for(tmp_path) == tmp_path / "root" / "state" / "slots" / "s%3A0.sqlite3"
    assert agent_config_for(tmp_path, "--state-dir", "none") is None
    assert (
        agent_config_for(tmp_path, "--state-dir", str(tmp_path / "d")) == tmp_path / "d/slots/s%3A0.sqlite3"
    )
    toml = tmp_path / "kvagent.toml"
    toml.write_text(f'state_dir = "{tmp_path / "t"}"\n[[slots]]\nname = "s:0"\n')
    assert agent_config_for(tmp_path, "--config", str(toml)) == tmp_path / "t" / "slots" / "s%3A0.sqlite3"
    toml.write_text('state_dir = "none"\n')
    assert agent_config_for(tmp_path, "--config", str(toml)) is None


def test_the_persistence_status_round_trips_through_json() -> None:
    status = AgentStatus(IDENTITY, persistence=PersistenceStatus("failed", 12, 3, 4096))
    encoded = status.to_json()
    assert encoded["persistence"] == {
        "state": "failed",
        "persisted_id": 12,
        "lag_events": 3,
        "disk_bytes": 4096,
    }
    assert AgentStatus.from_json(encoded) == status
    assert "persistence" not in AgentStatus(IDENTITY).to_json()
    bad = {**encoded, "persistence": {**encoded["persistence"], "state": "maybe"}}
    with pytest.raises(CodecError, match="status.persistence.state"):
        AgentStatus.from_json(bad)


async def test_a_second_agent_on_the_same_state_dir_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_rig(tmp_path) as rig, rig.serving():
            other = tmp_path / "other"
            command = [
                sys.executable,
                "-m",
                "kvagent.cli.main",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--discovery",
                f"file:{other / 'discovery'}",
                "--token-file",
                str(other / "token"),
                *rig.args,
            ]
            second = await trio.run_process(command, capture_stderr=True, check=False)
            assert second.returncode != 0
            assert str(rig.state_file) in second.stderr.decode()
            assert not list(rig.state_file.parent.glob("*.refused-*")), "a file in use is never set aside"


async def test_a_restarted_slot_without_a_configured_engine_resumes_the_engine_of_its_state(
    tmp_path: Path,
) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_rig(tmp_path) as rig:
            publisher_id, last_id, follower, _ = await first_life(rig, 40)
            await rig.publish(30)
            bare = ("--slot", "s0", "--block-size", str(BLOCK), "--state-dir", str(rig.state_dir))
            async with rig.serving(*bare) as agent, client(agent.url) as c:
                missed = await follow_until(c, await rig.sentinel(), last_id)
                status = (await c.request("status"))["status"]
            assert status["identity"]["publisher_id"] == publisher_id
            assert status["attachment"]["state"] == "ready"
            assert not [event for event in missed if worker_device(event) and is_cleared(event)]
            assert apply_events(follower, missed) == rig.truth()
