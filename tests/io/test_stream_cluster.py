"""Slots' streams on a real Redis Cluster (3 masters + 3 replicas): sharding by hash tag, a master killed
mid-stream, entries lost to asynchronous replication, a whole-cluster restart without persistence, and the
wrong setups that must read as one line while the writer keeps retrying (docs/fleet.md, issue #36)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import trio

from kvagent._util.redis_target import StreamTarget, doorbell_channel
from kvagent.stream.format import StreamKeys, cursor_of_id, encode_heartbeat_entry, slots_key
from kvagent.stream.reader import StreamFollower
from kvagent.stream.writer import StreamConfig, StreamWriter, StreamWriterStatistics
from tests.support.redis_cluster import RedisClusterServer, private_redis_cluster, redis_cluster
from tests.support.redis_server import _free_port, redis_binary
from tests.support.stream_sim import SimulatedSlot, canonical_state, run_writers

__all__ = ["private_redis_cluster", "redis_cluster"]  # the fixtures, used by name below

pytestmark = pytest.mark.timeout(240)


def _prefix() -> str:
    return f"kvc-{uuid.uuid4().hex[:10]}"


def _config(target: StreamTarget, prefix: str, maxlen: int = 10_000, entry_events: int = 64) -> StreamConfig:
    return StreamConfig(
        target,
        prefix=prefix,
        heartbeat_interval=0.2,
        backoff_initial=0.05,
        backoff_max=0.5,
        maxlen=maxlen,
        entry_events=entry_events,
    )


def _follower(target: StreamTarget, prefix: str) -> StreamFollower:
    return StreamFollower(target, prefix=prefix, block_ms=200, poll_ms=10)


def _caught_up(slots: list[SimulatedSlot]) -> Callable[[StreamFollower], bool]:
    def check(follower: StreamFollower) -> bool:
        return all(
            s.name in follower.replicas and follower.replicas[s.name].cursor == s.index.current_event_id()
            for s in slots
        )

    return check


def _assert_exact(follower: StreamFollower, slots: list[SimulatedSlot]) -> None:
    """Every rebuilt slot equals the agent's own tree dump, at the agent's cursor."""
    assert sorted(follower.replicas) == sorted(s.name for s in slots)
    for slot in slots:
        replica = follower.replicas[slot.name]
        assert replica.cursor == slot.index.current_event_id()
        assert canonical_state(replica.index) == canonical_state(slot.index), slot.name
        assert replica.ready == slot.status.get().attachment.ready  # type: ignore[union-attr]


def _writer(slot: SimulatedSlot) -> StreamWriter:
    assert slot.writer is not None
    return slot.writer


async def _produce(slots: list[SimulatedSlot], stop: trio.Event, per_step: int = 15) -> None:
    """The engines' side: every slot applies events at a steady pace until ``stop``."""
    while not stop.is_set():
        for slot in slots:
            slot.step(per_step)
        await trio.sleep(0.01)  # pacing of the simulated engines, not a synchronization


def _resumed_after(cursor: int) -> Callable[[StreamWriterStatistics], bool]:
    return lambda s: s.failures > 0 and s.connected and s.written_cursor > cursor


async def test_slots_are_sharded_and_rebuilt_exactly(redis_cluster: RedisClusterServer) -> None:
    prefix = _prefix()
    config = _config(redis_cluster.target(), prefix, maxlen=200)
    slots = [SimulatedSlot.create(n, config) for n in range(8)]
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await run_writers(slots, nursery)
            follower = _follower(redis_cluster.target(), prefix)
            for round_ in range(4):
                for slot in slots:
                    slot.set_ready(1, ready=round_ != 2)
                    slot.step(250)
            for slot in slots:
                await slot.flushed()
            await follower.catch_up()
            _assert_exact(follower, slots)
            # Each slot's keys are on one shard, the slots over several; no global key at all.
            shards = {redis_cluster.master_of(_writer(s).keys.events) for s in slots}
            assert len(shards) >= 2
            for slot in slots:
                keys = _writer(slot).keys
                assert redis_cluster.master_of(keys.head) == redis_cluster.master_of(keys.snapshot)
            with redis_cluster.client() as client:
                assert not client.exists(slots_key(prefix))
            # Live: every slot followed across the shards.
            await nursery.start(follower.run)
            for slot in slots:
                slot.step(120)
            await follower.wait_until(_caught_up(slots))
            _assert_exact(follower, slots)
            assert follower.statistics().failures == 0
            nursery.cancel_scope.cancel()


async def test_consumer_group_members_on_a_cluster(redis_cluster: RedisClusterServer) -> None:
    """Each member of a group follows its own slot through XREADGROUP/XACK polls, on the slot's shard."""
    prefix = _prefix()
    config = _config(redis_cluster.target(), prefix)
    slots = [SimulatedSlot.create(n, config) for n in (20, 21)]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await run_writers(slots, nursery)
            for slot in slots:
                await slot.flushed()
            members = [
                StreamFollower(
                    redis_cluster.target(),
                    prefix=prefix,
                    slots=[slot.name],
                    block_ms=200,
                    poll_ms=10,
                    group="routers",
                    consumer=f"r{i}",
                )
                for i, slot in enumerate(slots)
            ]
            for member in members:
                await nursery.start(member.run)
            for slot in slots:
                slot.set_ready(1, ready=True)
                slot.step(700)
            for member, slot in zip(members, slots, strict=True):
                await member.wait_until(_caught_up([slot]))
                _assert_exact(member, [slot])
            with redis_cluster.client() as client:
                for slot in slots:
                    groups: Any = client.xinfo_groups(_writer(slot).keys.events)
                    # Delivered through the group (heartbeats may follow the last event: "700-N").
                    assert [g["name"] for g in groups] == [b"routers"]
                    assert cursor_of_id(groups[0]["last-delivered-id"]) == 700
            nursery.cancel_scope.cancel()


def _shard_subscribers(cluster: RedisClusterServer) -> dict[int, int]:
    """Per master: how many of its client connections hold sharded subscriptions (CLIENT LIST's ``ssub``)."""
    counts: dict[int, int] = {}
    for port in cluster.masters():
        with redis.Redis(port=port, socket_timeout=5) as client:
            clients: Any = client.client_list()
            counts[port] = sum(1 for c in clients if int(c.get("ssub", 0)) > 0)
    return counts


async def test_a_live_reader_is_woken_by_its_shards_doorbells(redis_cluster: RedisClusterServer) -> None:
    """New entries reach a live reader through the doorbells (one subscribed connection per shard): its safety
    poll is an hour away, so only a ring can have made it read them."""
    prefix = _prefix()
    config = _config(redis_cluster.target(), prefix)
    slots = [SimulatedSlot.create(n, config) for n in range(30, 38)]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await run_writers(slots, nursery)
            for slot in slots:
                slot.set_ready(1, ready=True)
                slot.step(10)
            for slot in slots:
                await slot.flushed()
            channels = [doorbell_channel(_writer(s).keys.tag) for s in slots]
            shards = {redis_cluster.master_of(channel) for channel in channels}
            assert len(shards) >= 2
            before = _shard_subscribers(redis_cluster)
            follower = StreamFollower(redis_cluster.target(), prefix=prefix, block_ms=3_600_000)
            await nursery.start(follower.run)
            await follower.wait_until(lambda f: f.statistics().doorbells_opened == 1)
            after = _shard_subscribers(redis_cluster)
            # Exactly one new subscribed connection on each shard that holds a followed slot, none elsewhere.
            assert {p: after[p] - before.get(p, 0) for p in after} == {p: int(p in shards) for p in after}
            opened = follower.statistics()
            for slot in slots:
                slot.step(40)
            await follower.wait_until(_caught_up(slots))
            _assert_exact(follower, slots)
            stats = follower.statistics()
            assert stats.doorbell_reads > opened.doorbell_reads
            assert stats.safety_polls == 0
            assert stats.doorbells_opened == 1
            assert stats.failures == 0
            nursery.cancel_scope.cancel()


async def test_a_lost_doorbell_is_covered_by_the_safety_poll(redis_cluster: RedisClusterServer) -> None:
    """An entry appended without its ring (pub/sub is at most once: a ring lost to a failover) is still read,
    by the safety poll every ``block_ms``, and not through a doorbell."""
    prefix = _prefix()
    config = StreamConfig(
        redis_cluster.target(), prefix=prefix, heartbeat_interval=3600, backoff_initial=0.05
    )
    slot = SimulatedSlot.create(40, config)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as writers:
                await run_writers([slot], writers)
                slot.step(10)
                await slot.flushed()
                writers.cancel_scope.cancel()  # nothing rings from here on
            follower = StreamFollower(redis_cluster.target(), prefix=prefix, block_ms=300)
            await nursery.start(follower.run)
            await follower.wait_until(lambda f: f.statistics().doorbells_opened == 1)
            opened = follower.statistics()
            keys = _writer(slot).keys
            with redis_cluster.client() as client:
                client.xadd(
                    keys.events, encode_heartbeat_entry(123_456_789), id=f"{slot.index.current_event_id()}-*"
                )
            await follower.wait_until(lambda f: f.replicas[slot.name].heartbeat_unix_ms == 123_456_789)
            stats = follower.statistics()
            assert stats.doorbell_reads == opened.doorbell_reads
            assert stats.safety_polls > opened.safety_polls
            assert stats.failures == 0
            nursery.cancel_scope.cancel()


async def test_a_cluster_without_sharded_pubsub_is_polled(tmp_path: Path) -> None:
    """A cluster whose nodes refuse SSUBSCRIBE (as before Redis 7) is followed by the pipelined polls: the
    reader says so once and keeps up, with no doorbell."""
    cluster = RedisClusterServer(
        redis_binary(), tmp_path / "redis-cluster", extra_args=("--rename-command", "SSUBSCRIBE", "")
    )
    prefix = _prefix()
    slots = [SimulatedSlot.create(n, _config(cluster.target(), prefix)) for n in range(4)]
    try:
        await cluster.start()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await run_writers(slots, nursery)
                for slot in slots:
                    slot.set_ready(1, ready=True)
                    slot.step(30)
                follower = _follower(cluster.target(), prefix)
                await nursery.start(follower.run)
                for slot in slots:
                    slot.step(60)
                await follower.wait_until(_caught_up(slots))
                _assert_exact(follower, slots)
                stats = follower.statistics()
                assert (stats.doorbells_opened, stats.doorbell_reads, stats.failures) == (0, 0, 0)
                nursery.cancel_scope.cancel()
    finally:
        await cluster.stop()


async def test_a_master_killed_mid_stream(private_redis_cluster: RedisClusterServer) -> None:
    cluster, prefix = private_redis_cluster, _prefix()
    config = _config(cluster.target(), prefix, maxlen=2000)
    slots = [SimulatedSlot.create(n, config, ring=1 << 14) for n in range(6)]
    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            await run_writers(slots, nursery)
            for slot in slots:
                slot.set_ready(1, ready=True)
            live = _follower(cluster.target(), prefix)
            stop = trio.Event()
            nursery.start_soon(_produce, slots, stop)
            await _writer(slots[0]).wait_until(lambda s: s.written_cursor >= 300)
            await nursery.start(live.run)
            victim = cluster.master_of(_writer(slots[0]).keys.events)
            on_victim = [s for s in slots if cluster.master_of(_writer(s).keys.events) == victim]
            await cluster.kill_master(victim, wait=False)
            # A reader started while the cluster is failing over (through a node that is up): it retries until
            # it can catch up.
            entry = next(p for p in cluster.ports if p != victim)
            restarted = _follower(StreamTarget(f"redis://127.0.0.1:{entry}", cluster=True), prefix)
            nursery.start_soon(restarted.run)
            await cluster.wait_failed_over()
            for slot in on_victim:  # the writers saw the master die and write again to its replica
                await _writer(slot).wait_until(_resumed_after(slot.index.current_event_id()))
            stop.set()
            for slot in slots:
                await slot.flushed()
            await live.wait_until(_caught_up(slots))
            _assert_exact(live, slots)
            await restarted.wait_until(_caught_up(slots))
            _assert_exact(restarted, slots)
            # Both readers' doorbells for the victim's slots are on the replica that took over now (the live
            # one's listener on the victim failed, so it subscribed anew).
            for reader in (live, restarted):
                await reader.wait_until(lambda f: f.statistics().doorbells_subscribed == len(slots))
            channel = doorbell_channel(_writer(on_victim[0]).keys.tag)
            with redis.Redis(port=cluster.master_of(channel)) as client:
                counts: Any = client.execute_command("PUBSUB", "SHARDNUMSUB", channel)
                assert int(counts[1]) == 2
            # A cold reader given every node, the killed one first: any node that answers will do.
            nodes = ",".join(f"127.0.0.1:{p}" for p in [victim, *(p for p in cluster.ports if p != victim)])
            cold = _follower(StreamTarget(f"redis+cluster://{nodes}"), prefix)
            await cold.catch_up()
            _assert_exact(cold, slots)
            await cold.aclose()
            nursery.cancel_scope.cancel()


async def test_resharding_mid_stream(private_redis_cluster: RedisClusterServer) -> None:
    """A slot's hash slot migrates to another master while its writer writes and a reader follows: the
    clients follow ASK and MOVED, nothing is reported as a failure, and the state stays exact."""
    cluster, prefix = private_redis_cluster, _prefix()
    config = _config(cluster.target(), prefix)
    slots = [SimulatedSlot.create(n, config, ring=1 << 14) for n in range(3)]
    moved = _writer(slots[0]).keys
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await run_writers(slots, nursery)
            for slot in slots:
                slot.set_ready(1, ready=True)
            follower = _follower(cluster.target(), prefix)
            stop = trio.Event()
            nursery.start_soon(_produce, slots, stop)
            await _writer(slots[0]).wait_until(lambda s: s.written_cursor >= 300)
            await nursery.start(follower.run)
            source, target = await cluster.move_slot_of(moved.events)
            assert cluster.master_of(moved.events) == target != source
            written = slots[0].index.current_event_id()
            await _writer(slots[0]).wait_until(lambda s: s.written_cursor > written + 100)
            stop.set()
            for slot in slots:
                await slot.flushed()
            await follower.wait_until(_caught_up(slots))
            _assert_exact(follower, slots)
            with redis.Redis(port=target) as client:  # the stream lives on the new master now
                assert client.exists(moved.events, moved.snapshot, moved.head) == 3
            # The source unsubscribed the moved slot's doorbell (sunsubscribe): the reader subscribed anew,
            # now on the new master.
            await follower.wait_until(lambda f: f.statistics().doorbells_opened >= 2)
            with redis.Redis(port=target) as client:
                counts: Any = client.execute_command("PUBSUB", "SHARDNUMSUB", doorbell_channel(moved.tag))
                assert int(counts[1]) == 1
            assert _writer(slots[0]).statistics().failures == 0
            assert follower.statistics().failures == 0
            nursery.cancel_scope.cancel()


async def test_entries_lost_to_asynchronous_replication_are_never_applied_past(
    private_redis_cluster: RedisClusterServer,
) -> None:
    """The replica is paused while its master acknowledges entries, then the master dies and the replica,
    which never got them, takes over: the writer finds the top below what it wrote and resets; a reader that
    had read the lost entries reloads the snapshot; both end equal to the agent's state, status included."""
    cluster, prefix = private_redis_cluster, _prefix()
    config = _config(cluster.target(), prefix)
    slot = SimulatedSlot.create(7, config, ring=1 << 14)
    writer = _writer(slot)
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            slot.set_ready(1, ready=True)
            slot.step(400)
            await slot.flushed()
            follower = _follower(cluster.target(), prefix)
            await nursery.start(follower.run)
            await follower.wait_until(_caught_up([slot]))
            master = cluster.master_of(writer.keys.events)
            replica = cluster.replica_of(master)
            cluster.pause(replica)
            try:
                cluster.cut_replication(master)
                slot.step(300)
                slot.set_ready(1, ready=False)  # a status change only the lost entries carry
                await slot.flushed()
                await follower.wait_until(_caught_up([slot]))  # the reader saw the entries to be lost
                assert not follower.replicas[slot.name].ready
                await cluster.kill_master(master, wait=False)
            finally:
                cluster.resume(replica)
            await cluster.wait_failed_over()
            slot.step(50)
            await writer.wait_until(lambda s: s.lost_entries == 1 and s.connected)
            await slot.flushed()
            stats = writer.statistics()
            assert stats.resets >= 2 and stats.lag_events == 0
            await follower.wait_until(_caught_up([slot]))
            _assert_exact(follower, [slot])
            cold = _follower(StreamTarget(cluster.every_node_url), prefix)
            await cold.catch_up()
            _assert_exact(cold, [slot])
            await cold.aclose()
            nursery.cancel_scope.cancel()


async def test_whole_cluster_restarted_without_persistence(private_redis_cluster: RedisClusterServer) -> None:
    cluster, prefix = private_redis_cluster, _prefix()
    config = _config(cluster.target(), prefix)
    slots = [SimulatedSlot.create(n, config, ring=256) for n in range(4)]
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            await run_writers(slots, nursery)
            for slot in slots:
                slot.set_ready(2, ready=True)
                slot.step(300)
                await slot.flushed()
            follower = _follower(cluster.target(), prefix)
            await nursery.start(follower.run)
            await cluster.restart_all()
            for slot in slots:
                slot.step(600)  # more than the ring holds: the writers start over from snapshots
            for slot in slots:
                await slot.flushed()
                stats = _writer(slot).statistics()
                assert stats.failures >= 1 and stats.resets >= 2
            await follower.wait_until(_caught_up(slots))
            _assert_exact(follower, slots)
            nursery.cancel_scope.cancel()


async def _first_failure(slot: SimulatedSlot) -> StreamWriterStatistics:
    writer = _writer(slot)
    await writer.wait_until(lambda s: s.failures > 0)
    return writer.statistics()


async def _writer_fails_with(config: StreamConfig, expected: str) -> StreamWriterStatistics:
    slot = SimulatedSlot.create(11, config)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            slot.step(50)  # the slot goes on: its index takes events while the stream is down
            stats = await _first_failure(slot)
            assert not stats.connected and stats.last_error is not None
            assert expected in stats.last_error and "\n" not in stats.last_error, stats.last_error
            assert slot.index.current_event_id() == 50
            await _writer(slot).wait_until(lambda s: s.failures >= 2)  # and retries, never raises
            nursery.cancel_scope.cancel()
    return stats


async def test_a_cluster_url_at_a_single_server_is_one_line(redis_server: str) -> None:
    target = StreamTarget(redis_server.rsplit("/", 1)[0], cluster=True)
    await _writer_fails_with(_config(target, _prefix()), "not a Redis Cluster node")


async def test_a_single_server_url_at_a_cluster_node_is_one_line(redis_cluster: RedisClusterServer) -> None:
    prefix = _prefix()
    entry = int(redis_cluster.url.rsplit(":", 1)[1])
    # A slot whose keys live on another shard than the URL's node: that node answers MOVED.
    name = next(
        f"slot-{n}"
        for n in range(11, 200)
        if redis_cluster.master_of(StreamKeys(prefix, f"slot-{n}", 1011).head) != entry
    )
    target = StreamTarget(redis_cluster.url)
    config = _config(target, prefix)
    slot = SimulatedSlot.create(int(name.split("-")[1]), config)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            stats = await _first_failure(slot)
            assert stats.last_error is not None and "is a Redis Cluster node" in stats.last_error
            assert "--stream-cluster" in stats.last_error and "\n" not in stats.last_error
            nursery.cancel_scope.cancel()


async def test_a_cluster_node_down_at_start_is_one_line_and_retried() -> None:
    target = StreamTarget(f"redis+cluster://127.0.0.1:{_free_port()}", socket_timeout=0.5)
    await _writer_fails_with(_config(target, _prefix()), "cannot be connected")


async def test_a_refused_password_is_one_line(redis_cluster: RedisClusterServer) -> None:
    target = StreamTarget(redis_cluster.url, cluster=True, password="wrong", username="nobody")
    await _writer_fails_with(_config(target, _prefix()), "the server refused the credentials")


def test_cluster_urls_are_checked() -> None:
    assert StreamTarget("redis+cluster://127.0.0.1:7000").is_cluster
    assert StreamTarget("redis+cluster://127.0.0.1:7000,127.0.0.1:7001,[::1]:7002").is_cluster
    assert StreamTarget("redis://127.0.0.1:7000,127.0.0.1:7001", cluster=True).is_cluster
    with pytest.raises(Exception, match="several nodes"):
        StreamTarget("redis://127.0.0.1:7000,127.0.0.1:7001")
    with pytest.raises(Exception, match="HOST:PORT"):
        StreamTarget("redis+cluster://127.0.0.1:7000,nowhere")
    assert StreamTarget("redis://h:1", cluster=True).is_cluster
    assert not StreamTarget("redis://h:1/2").is_cluster
    with pytest.raises(Exception, match="only database 0"):
        StreamTarget("redis+cluster://h:1/3")
