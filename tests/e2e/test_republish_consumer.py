"""``kvagent serve --republish``: a plain vLLM-style consumer rebuilds exactly kvagent's Worker resident set.

The consumer (tests/support/vllm_consumer.py) is written the way vLLM's docs show a subscriber: SUB + DEALER,
replay from the seq it needs, reset on ``AllBlocksCleared``; it knows nothing of kvagent. A fake vLLM engine in
this process feeds ``kvagent serve`` (a subprocess configured by TOML); the consumer joins late, restarts, and
lives through an engine restart, and after each phase its view equals the websocket tree dump's Worker blocks.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import trio
import zmq

from kvagent.model.events import StorageTier
from kvagent.simulator.engine import FakeVllmEngine, SimulatedWorkload
from kvagent.simulator.events import block_stored
from tests.support.serve import Client, ServeProcess, client, serve
from tests.support.vllm_consumer import VllmStyleConsumer

TIMEOUT = 90
BLOCK_SIZE = 16
RING_BATCHES = 8  # small, so a late joiner's replay from 0 is answered with a snapshot
_sentinels = itertools.count(0xA5A5_0000)


def worker_blocks(dump: dict[str, Any]) -> set[tuple[str, int]]:
    """``{(storage tier, block hash)}`` of the Worker domain in a websocket tree dump."""
    blocks: set[tuple[str, int]] = set()
    for item in dump["events"]:
        data = item["event"]["data"]
        if item["residency_domain"] == "worker" and isinstance(data, dict) and "stored" in data:
            blocks.update((item["storage_tier"], block["block_hash"]) for block in data["stored"]["blocks"])
    return blocks


def consumer_blocks(consumer: VllmStyleConsumer) -> set[tuple[str, int]]:
    tiers = {medium: StorageTier.from_medium(medium) for medium, _ in consumer.resident}
    assert None not in tiers.values(), tiers
    return {(tiers[medium].value, block_hash) for medium, block_hash in consumer.resident}  # type: ignore[union-attr]


async def republish_endpoints(agent: ServeProcess) -> tuple[str, str]:
    line = await agent.log.wait_for(lambda text: "republishes vLLM KV events on" in text)
    match = re.search(r"on (tcp://\S+) replay (tcp://\S+)", line)
    assert match is not None, line
    return match[1], match[2]


async def settle(engine: FakeVllmEngine, c: Client, consumer: VllmStyleConsumer) -> dict[str, Any]:
    """Publish a sentinel store until kvagent has it and the consumer has applied kvagent's newest batch.

    A sentinel that went out before the consumer's SUB was subscribed (the slow-joiner window) is followed by
    another, which the consumer sees as a gap and repairs by replay. Returns the slot's tree dump then.
    """
    while True:
        dump = await applied_so_far(engine, c)
        seq = (await c.request("status"))["status"]["republish"]["seq"]
        with trio.move_on_after(1.0):
            await consumer.wait_for_seq(seq)
            return dump


async def applied_so_far(engine: FakeVllmEngine, c: Client) -> dict[str, Any]:
    """Publish a sentinel store and wait until kvagent has it: every batch before it is applied too."""
    sentinel = next(_sentinels)
    tokens = list(range(sentinel % 1000, sentinel % 1000 + BLOCK_SIZE))
    await engine.publish_batch([block_stored([sentinel], None, tokens, BLOCK_SIZE)])
    while True:
        dump = await c.request("recover", start=None, end=None)
        if ("device", sentinel) in worker_blocks(dump):
            return dump
        await trio.sleep(0.02)  # polling kvagent's dump (bounded by the test's fail_after)


async def run_steps(engine: FakeVllmEngine, workload: SimulatedWorkload, steps: int) -> None:
    for _ in range(steps):
        events = workload.next_step()
        if events:
            await engine.publish_batch(events)


def write_config(tmp_path: Path, engine: FakeVllmEngine) -> Path:
    path = tmp_path / "kvagent.toml"
    path.write_text(
        f"""
[[slots]]
name = "s0"
kv_block_size = {BLOCK_SIZE}

[slots.engine]
endpoint = "{engine.endpoint}"
replay_endpoint = "{engine.replay_endpoint}"
topic = "kv-events"

[slots.republish]
endpoint = "tcp://127.0.0.1:0"
replay_endpoint = "tcp://127.0.0.1:0"
topic = "kvagent"
buffer_batches = {RING_BATCHES}
"""
    )
    return path


async def test_a_vllm_style_consumer_matches_kvagent_after_late_join_own_restart_and_engine_restart(
    tmp_path: Path, zmq_context: zmq.Context[Any]
) -> None:
    engine = FakeVllmEngine(
        replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK_SIZE, context=zmq_context, topic=b"kv-events"
    )
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            config = write_config(tmp_path, engine)
            async with serve(tmp_path, "--config", str(config)) as agent, client(agent.url) as c:
                endpoint, replay_endpoint = await republish_endpoints(agent)
                await engine.wait_for_subscriber()
                workload = SimulatedWorkload(seed=7, block_size=BLOCK_SIZE)
                await run_steps(engine, workload, 60)
                # kvagent has applied (and republished past its ring) every step before the consumer joins: it
                # reads a steady stream once per coalesce window, so the steps may still be on their way.
                await applied_so_far(engine, c)

                def consumer() -> VllmStyleConsumer:
                    return VllmStyleConsumer(zmq_context, endpoint, replay_endpoint, topic=b"kvagent")

                # 1. A consumer joining late: its replay from 0 is older than the ring, so it gets a snapshot.
                first, first_scope = consumer(), trio.CancelScope()
                await nursery.start(_run_in, first, first_scope)
                dump = await settle(engine, c, first)
                assert consumer_blocks(first) == worker_blocks(dump)
                assert first.snapshot_answers >= 1 and first.replays[0] == 0
                assert any(tier == "host_pinned" for tier, _ in worker_blocks(dump))  # CPU tier too
                assert first.token_counts_ok and first.stores_without_tokens == 0
                first_scope.cancel()

                # 2. The consumer restarts (a new process: no state) while kvagent goes on.
                await run_steps(engine, workload, 40)
                await applied_so_far(engine, c)
                second = consumer()
                await nursery.start(_run_in, second, trio.CancelScope())
                dump = await settle(engine, c, second)
                assert consumer_blocks(second) == worker_blocks(dump)
                assert second.snapshot_answers >= 1

                # 3. The engine restarts (seq back to 0, no AllBlocksCleared from it): kvagent's stream goes on
                # in one seq space with an AllBlocksCleared, and the live consumer follows without rejoining.
                clears, last_seq = second.clears, second.last_seq or 0
                engine.kill()
                await engine.revive(restart=True)
                await engine.wait_for_subscriber()
                await run_steps(engine, SimulatedWorkload(seed=8, block_size=BLOCK_SIZE), 40)
                dump = await settle(engine, c, second)
                assert second.clears > clears
                assert (second.last_seq or 0) > last_seq
                assert consumer_blocks(second) == worker_blocks(dump)
                status = (await c.request("status"))["status"]
                assert status["attachment"]["ready"] is True
                assert status["republish"]["seq"] == second.last_seq

                # 4. Engine batches lost on the way to kvagent: one kvagent repairs from the engine's replay
                # buffer, then one nobody can repair (kvagent resets its Worker view: AllBlocksCleared).
                workload = SimulatedWorkload(seed=9, block_size=BLOCK_SIZE)
                await engine.publish_batch(workload.next_step(), drop_live=True)
                await run_steps(engine, workload, 10)
                dump = await settle(engine, c, second)
                assert consumer_blocks(second) == worker_blocks(dump)
                clears = second.clears
                await engine.publish_batch(workload.next_step(), unbuffered=True)
                await run_steps(engine, workload, 10)
                dump = await settle(engine, c, second)
                assert second.clears > clears
                assert consumer_blocks(second) == worker_blocks(dump)
            nursery.cancel_scope.cancel()


async def _run_in(
    consumer: VllmStyleConsumer,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await consumer.run(task_status=task_status)


async def test_command_line_republish_with_legacy_replay_serves_a_pre_026_consumer(
    tmp_path: Path, zmq_context: zmq.Context[Any]
) -> None:
    engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK_SIZE, context=zmq_context)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            args = ["--slot", f"s0={engine.endpoint}", "--replay", engine.replay_endpoint or ""]
            args += ["--topic", "kv-events", "--block-size", str(BLOCK_SIZE)]
            args += ["--republish", "tcp://127.0.0.1:0", "--republish-replay", "tcp://127.0.0.1:0"]
            args += ["--republish-topic", "legacy", "--legacy-replay"]
            async with serve(tmp_path, *args) as agent, client(agent.url) as c:
                endpoint, replay_endpoint = await republish_endpoints(agent)
                await engine.wait_for_subscriber()
                await run_steps(engine, SimulatedWorkload(seed=3, block_size=BLOCK_SIZE), 30)
                consumer = VllmStyleConsumer(
                    zmq_context, endpoint, replay_endpoint, topic=b"legacy", legacy_replay=True
                )
                await nursery.start(consumer.run)
                dump = await settle(engine, c, consumer)
                assert consumer_blocks(consumer) == worker_blocks(dump)
                assert consumer.replays[0] == 0 and consumer.snapshot_answers == 0  # the ring holds it all
                republish = (await c.request("status"))["status"]["republish"]
                assert (republish["endpoint"], republish["replay_endpoint"]) == (endpoint, replay_endpoint)
            nursery.cancel_scope.cancel()


async def test_a_consumer_without_replay_rejoining_after_kvagent_restarts_matches_kvagent(
    tmp_path: Path, zmq_context: zmq.Context[Any]
) -> None:
    """kvagent is killed and restarted on its state directory and ports while the engine goes on; a consumer
    with no replay endpoint (a SUB alone, applying whatever follows a gap) is away meanwhile and rejoins only
    after the restarted kvagent has published its catch-up. It must end with kvagent's Worker blocks."""
    engine = FakeVllmEngine(
        replay_endpoint="tcp://127.0.0.1:0", block_size=BLOCK_SIZE, context=zmq_context, topic=b"kv-events"
    )
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            config = write_config(tmp_path, engine)
            config.write_text(f'state_dir = "{tmp_path / "state"}"\n' + config.read_text())
            workload = SimulatedWorkload(seed=21, block_size=BLOCK_SIZE)
            async with serve(tmp_path, "--config", str(config)) as agent, client(agent.url) as c:
                endpoint, replay_endpoint = await republish_endpoints(agent)
                await engine.wait_for_subscriber()
                consumer = VllmStyleConsumer(zmq_context, endpoint, None, topic=b"kvagent")
                away = trio.CancelScope()
                await nursery.start(_run_in, consumer, away)
                await run_steps(engine, workload, 40)
                dump = await settle(engine, c, consumer)
                assert consumer_blocks(consumer) == worker_blocks(dump) != set()
                away.cancel()  # the consumer's SUB is gone until kvagent has restarted and caught up
            await run_steps(engine, workload, 30)  # kvagent is down (SIGKILL); the engine goes on

            port = endpoint.rsplit(":", 1)[1]
            replay_port = replay_endpoint.rsplit(":", 1)[1]
            text = config.read_text()
            text = text.replace('endpoint = "tcp://127.0.0.1:0"', f'endpoint = "tcp://127.0.0.1:{port}"', 1)
            text = text.replace(
                'replay_endpoint = "tcp://127.0.0.1:0"', f'replay_endpoint = "tcp://127.0.0.1:{replay_port}"'
            )
            config.write_text(text)
            subscribed = engine.subscriptions
            async with serve(tmp_path, "--config", str(config)) as agent, client(agent.url) as c:
                assert await republish_endpoints(agent) == (endpoint, replay_endpoint)
                await engine.wait_for_subscriber(subscribed + 1)
                await run_steps(engine, workload, 20)
                await applied_so_far(engine, c)  # everything the restart publishes has gone out, unseen
                seq_before = consumer.last_seq or 0
                await nursery.start(_run_in, consumer, trio.CancelScope())  # the same consumer, a new SUB
                while True:  # (each round publishes a sentinel: a consumer missing the resync never matches)
                    dump = await settle(engine, c, consumer)
                    if consumer_blocks(consumer) == worker_blocks(dump):
                        break
                assert consumer.gaps_unrepaired >= 1 and (consumer.last_seq or 0) > seq_before
            nursery.cancel_scope.cancel()
