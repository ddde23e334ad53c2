"""Slots' events in Redis Streams and replicas rebuilt from them, against a real redis-server (docs/fleet.md)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import redis
import trio
import trio.testing

from kvagent._util.redis_target import StreamTarget
from kvagent.stream.format import EventsEntry, SnapshotEntry, StreamKeys, cursor_of_id, decode_entry
from kvagent.stream.reader import StreamFollower
from kvagent.stream.writer import StreamConfig, StreamWriter
from tests.support.redis_server import PrivateRedis
from tests.support.stream_sim import SimulatedSlot, canonical_state, run_writers


def _config(
    url: str,
    prefix: str,
    maxlen: int = 10_000,
    entry_events: int = 256,
    heartbeat_interval: float = 0.2,
) -> StreamConfig:
    target = StreamTarget(url)
    return StreamConfig(
        target,
        prefix=prefix,
        heartbeat_interval=heartbeat_interval,
        backoff_initial=0.05,
        maxlen=maxlen,
        entry_events=entry_events,
    )


def _event_entries(url: str, keys: StreamKeys) -> list[tuple[str, EventsEntry | SnapshotEntry]]:
    client = redis.Redis.from_url(url)
    try:
        found: list[tuple[str, EventsEntry | SnapshotEntry]] = []
        raw: Any = client.xrange(keys.events)
        for raw_id, fields in raw:
            entry_id = raw_id.decode()
            entry = decode_entry(entry_id, fields)
            if isinstance(entry, EventsEntry | SnapshotEntry):
                found.append((entry_id, entry))
        return found
    finally:
        client.close()


def _at(name: str, cursor: int) -> Callable[[StreamFollower], bool]:
    return lambda follower: name in follower.replicas and follower.replicas[name].cursor == cursor


async def _failed(writer: StreamWriter) -> None:
    await writer.wait_until(lambda s: s.failures > 0)


def _assert_no_gap_no_duplicate(entries: list[tuple[str, EventsEntry | SnapshotEntry]]) -> None:
    """Event entries cover consecutive cursor ranges; a snapshot marker restarts the count at its cursor."""
    covered: int | None = None
    seen: set[int] = set()
    for _, entry in entries:
        if isinstance(entry, SnapshotEntry):
            covered = entry.cursor
            continue
        if covered is not None:
            assert entry.first == covered + 1, f"gap or overlap before {entry.first} (covered {covered})"
        for event in entry.events:
            assert event.event_id not in seen, f"event {event.event_id} twice"
            seen.add(event.event_id)
        covered = entry.last


async def test_eight_slots_rebuilt_exactly(redis_server: str, redis_prefix: str) -> None:
    config = _config(redis_server, redis_prefix, maxlen=200, entry_events=64)
    slots = [SimulatedSlot.create(n, config) for n in range(8)]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await run_writers(slots, nursery)
            for round_ in range(5):
                for slot in slots:
                    slot.set_ready(1, ready=round_ != 2)
                    slot.step(300)
            for slot in slots:
                await slot.flushed()
            follower = StreamFollower(StreamTarget(redis_server), prefix=redis_prefix)
            await follower.catch_up()
            assert sorted(follower.replicas) == sorted(s.name for s in slots)
            for slot in slots:
                replica = follower.replicas[slot.name]
                assert replica.cursor == slot.index.current_event_id() == 1500
                assert canonical_state(replica.index) == canonical_state(slot.index)
                assert replica.index.resident_block_count == slot.index.resident_block_count > 0
                assert replica.ready and replica.generation == 1
                _assert_no_gap_no_duplicate(_event_entries(redis_server, slot.writer.keys))  # type: ignore[union-attr]
            await follower.aclose()
            nursery.cancel_scope.cancel()


async def test_follow_live_and_readiness_is_not_emptiness(redis_server: str, redis_prefix: str) -> None:
    config = _config(redis_server, redis_prefix)
    slot = SimulatedSlot.create(1, config)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            await slot.flushed()
            follower = StreamFollower(StreamTarget(redis_server), prefix=redis_prefix, block_ms=100)
            await nursery.start(follower.run)
            replica = follower.replicas[slot.name]
            # Empty and not attached: no blocks, and the stream says "not ready", not "unknown".
            assert replica.loaded and replica.index.resident_block_count == 0 and not replica.ready
            slot.set_ready(4, ready=True)
            slot.step(500)
            await follower.wait_until(
                lambda f: f.replicas[slot.name].cursor == 500 and f.replicas[slot.name].ready
            )
            assert canonical_state(follower.replicas[slot.name].index) == canonical_state(slot.index)
            assert follower.replicas[slot.name].generation == 4
            slot.set_ready(4, ready=False)  # detaching: no event, only the status moves
            await follower.wait_until(lambda f: not f.replicas[slot.name].ready)
            await follower.wait_until(lambda f: f.replicas[slot.name].heartbeat_unix_ms is not None)
            nursery.cancel_scope.cancel()


async def test_reader_cold_after_trimming_reads_snapshot_plus_maxlen(
    redis_server: str, redis_prefix: str
) -> None:
    config = _config(redis_server, redis_prefix, maxlen=50, entry_events=32)
    slot = SimulatedSlot.create(2, config, ring=1 << 16)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            for _ in range(20):
                slot.step(1000)
                await slot.flushed()
            client = redis.Redis.from_url(redis_server)
            length = client.xlen(slot.writer.keys.events)  # type: ignore[union-attr]
            client.close()
            assert length < 2 * 50 + 100  # trimmed: not the 625 entries written
            follower = StreamFollower(StreamTarget(redis_server), prefix=redis_prefix)
            await follower.catch_up()
            replica = follower.replicas[slot.name]
            assert replica.snapshots_loaded == 1 and replica.entries <= length
            assert canonical_state(replica.index) == canonical_state(slot.index)
            assert slot.writer.statistics().snapshots >= 2  # type: ignore[union-attr]
            await follower.aclose()
            nursery.cancel_scope.cancel()


async def test_a_resent_entry_is_refused_by_redis(redis_server: str, redis_prefix: str) -> None:
    keys = StreamKeys(redis_prefix, "s", 7)
    client = redis.Redis.from_url(redis_server)
    try:
        client.xadd(keys.events, {"k": "ev"}, id="5-0")
        with pytest.raises(redis.ResponseError, match="equal or smaller"):
            client.xadd(keys.events, {"k": "ev"}, id="5-0")
        assert cursor_of_id(client.xadd(keys.events, {"k": "hb"}, id="5-*")) == 5
    finally:
        client.close()


async def test_redis_restarted_mid_stream(private_redis: PrivateRedis, redis_prefix: str) -> None:
    config = _config(private_redis.url, redis_prefix, maxlen=1000)
    slot = SimulatedSlot.create(3, config, ring=256)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            slot.set_ready(1, ready=True)
            slot.step(400)
            await slot.flushed()
            follower = StreamFollower(private_redis.target(), prefix=redis_prefix, block_ms=100)
            await nursery.start(follower.run)
            await private_redis.stop()
            slot.step(1000)  # more than the ring holds: the writer must start over from a snapshot
            assert slot.writer is not None
            await _failed(slot.writer)
            await private_redis.start()
            await slot.flushed()
            stats = slot.writer.statistics()
            assert stats.failures >= 1 and stats.resets >= 2 and stats.lag_events == 0
            await follower.wait_until(lambda f: f.replicas[slot.name].cursor == 1400)
            assert canonical_state(follower.replicas[slot.name].index) == canonical_state(slot.index)
            assert follower.replicas[slot.name].ready
            # And it goes on live after the restart.
            slot.step(50)
            await follower.wait_until(lambda f: f.replicas[slot.name].cursor == 1450)
            assert canonical_state(follower.replicas[slot.name].index) == canonical_state(slot.index)
            nursery.cancel_scope.cancel()


async def test_writer_lag_shows_while_redis_is_down(private_redis: PrivateRedis, redis_prefix: str) -> None:
    config = _config(private_redis.url, redis_prefix)
    slot = SimulatedSlot.create(4, config)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            await slot.flushed()
            await private_redis.stop()
            slot.step(100)  # ingest goes on: publish never waits on Redis
            assert slot.index.current_event_id() == 100
            writer = slot.writer
            assert writer is not None
            await _failed(writer)
            stats = writer.statistics()
            assert not stats.connected and stats.lag_events == 100 and stats.last_error
            await private_redis.start()
            await slot.flushed()
            assert writer.statistics().lag_events == 0
            nursery.cancel_scope.cancel()


def test_stream_config_refuses_password_in_url() -> None:
    from kvagent.model.errors import ConfigError

    with pytest.raises(ConfigError, match="password"):
        StreamTarget("redis://:secret@127.0.0.1:6379/0")
    with pytest.raises(ConfigError, match="redis://"):
        StreamTarget("http://127.0.0.1:6379")
    assert "secret" not in repr(attrs.evolve(StreamTarget("rediss://h:1/2"), password="secret"))


@pytest.mark.parametrize(
    "events",
    [50_000, pytest.param(1_000_000, marks=[pytest.mark.slow, pytest.mark.timeout(900)])],
)
async def test_reader_started_cold_after_many_events(
    redis_server: str, redis_prefix: str, events: int
) -> None:
    """The default stream settings: a cold reader reads one snapshot and at most about ``maxlen`` entries."""
    config = StreamConfig(StreamTarget(redis_server), prefix=redis_prefix)
    slot = SimulatedSlot.create(11, config, ring=1 << 14)
    with trio.fail_after(850):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            for _ in range(events // 10_000):
                slot.step(10_000)
                await slot.flushed()  # the writer keeps up from the ring: no reset after the first
            writer = slot.writer
            assert writer is not None and writer.statistics().resets == 1
            with redis.Redis.from_url(redis_server) as client:
                length = client.xlen(writer.keys.events)
            follower = StreamFollower(StreamTarget(redis_server), prefix=redis_prefix)
            await follower.catch_up()
            await follower.aclose()
            replica = follower.replicas[slot.name]
            assert replica.cursor == events
            assert replica.snapshots_loaded == 1 and replica.entries <= length <= config.maxlen * 1.2 + 100
            assert canonical_state(replica.index) == canonical_state(slot.index)
            nursery.cancel_scope.cancel()


def _group_info(client: redis.Redis, key: str) -> list[tuple[bytes, int, bytes]]:
    """(name, pending, last-delivered-id) of every consumer group of the stream ``key``."""
    info: Any = client.xinfo_groups(key)
    return [(g["name"], g["pending"], g["last-delivered-id"]) for g in info]


def _consumers(client: redis.Redis, key: str, group: str) -> list[bytes]:
    info: Any = client.xinfo_consumers(key, group)
    return [c["name"] for c in info]


# No heartbeats during these tests: an idle writer would keep delivering entries to the group, so
# "every delivered entry is acknowledged" would hold only between two heartbeats.
QUIET = 3600.0


async def test_consumer_group_members_split_the_slots(redis_server: str, redis_prefix: str) -> None:
    config = _config(redis_server, redis_prefix, heartbeat_interval=QUIET)
    slots = [SimulatedSlot.create(n, config) for n in (20, 21)]
    target = StreamTarget(redis_server)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await run_writers(slots, nursery)
            for slot in slots:
                await slot.flushed()  # the heads exist: each member finds its slot when it starts
            members = [
                StreamFollower(
                    target,
                    prefix=redis_prefix,
                    slots=[slot.name],
                    block_ms=100,
                    group="routers",
                    consumer=f"r{i}",
                )
                for i, slot in enumerate(slots)
            ]
            for member in members:
                await nursery.start(member.run)
            with redis.Redis.from_url(redis_server) as client:
                for slot in slots:
                    assert slot.writer is not None
                    # A started member is in its group already, so every later entry goes through it.
                    groups = _group_info(client, slot.writer.keys.events)
                    assert [name for name, _, _ in groups] == [b"routers"]
            for slot in slots:
                slot.set_ready(1, ready=True)
                slot.step(700)
            for member, slot in zip(members, slots, strict=True):
                await member.wait_until(_at(slot.name, 700))
                assert canonical_state(member.replicas[slot.name].index) == canonical_state(slot.index)
                assert list(member.replicas) == [slot.name]
            with redis.Redis.from_url(redis_server) as client:
                for i, slot in enumerate(slots):
                    assert slot.writer is not None
                    key = slot.writer.keys.events
                    # Delivered through the group up to the last entry, each acknowledged once applied
                    # (a member acknowledges before it reports progress), and only to this slot's member.
                    assert _group_info(client, key) == [(b"routers", 0, b"700-0")]
                    assert _consumers(client, key, "routers") == [f"r{i}".encode()]
            nursery.cancel_scope.cancel()


class _HeldAcks(redis.Redis):
    """A client whose XACK waits for the test (an acknowledgment still on its way, held deterministically)."""

    def __init__(self, url: str) -> None:
        super().__init__(connection_pool=redis.ConnectionPool.from_url(url, socket_timeout=5))
        self.entered = trio.Event()
        self.release = threading.Event()

    def xack(self, name: Any, groupname: Any, *ids: Any) -> Any:
        trio.from_thread.run_sync(self.entered.set)  # called from the follower's worker thread
        assert self.release.wait(timeout=20), "the test never released the acknowledgment"
        return super().xack(name, groupname, *ids)


async def test_a_member_is_never_seen_between_applying_and_acknowledging(
    redis_server: str, redis_prefix: str
) -> None:
    """``wait_until`` holds back until the round's XACKs are sent: then nothing it applied is still pending."""
    config = _config(redis_server, redis_prefix, heartbeat_interval=QUIET)
    slot = SimulatedSlot.create(23, config)

    def held_client() -> redis.Redis:
        client = _HeldAcks(redis_server)
        clients.append(client)
        return client

    clients: list[_HeldAcks] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            await slot.flushed()
            member = StreamFollower(
                StreamTarget(redis_server),
                prefix=redis_prefix,
                slots=[slot.name],
                block_ms=100,
                group="routers",
                consumer="r0",
                client_factory=held_client,
            )
            await nursery.start(member.run)
            slot.step(100)
            (client,) = clients
            await client.entered.wait()
            assert member.replicas[slot.name].cursor == 100  # applied, its acknowledgment held
            returned = trio.Event()

            async def waiter() -> None:
                await member.wait_until(_at(slot.name, 100))
                returned.set()

            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert not returned.is_set()
            client.release.set()
            await returned.wait()
            with redis.Redis.from_url(redis_server) as check:
                assert slot.writer is not None
                assert _group_info(check, slot.writer.keys.events) == [(b"routers", 0, b"100-0")]
            nursery.cancel_scope.cancel()


async def test_a_group_member_rejoins_its_group_after_redis_lost_it(
    private_redis: PrivateRedis, redis_prefix: str
) -> None:
    """Redis restarted without its data: the group is gone with the stream, and the member creates it again."""
    config = _config(private_redis.url, redis_prefix, heartbeat_interval=QUIET)
    slot = SimulatedSlot.create(22, config)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await run_writers([slot], nursery)
            slot.set_ready(1, ready=True)
            slot.step(300)
            await slot.flushed()
            member = StreamFollower(
                private_redis.target(),
                prefix=redis_prefix,
                slots=[slot.name],
                block_ms=100,
                group="routers",
                consumer="r0",
            )
            await nursery.start(member.run)
            await private_redis.stop()
            assert slot.writer is not None
            slot.step(100)
            await _failed(slot.writer)
            await private_redis.start()
            await slot.flushed()
            await member.wait_until(_at(slot.name, 400))
            slot.step(50)
            await member.wait_until(_at(slot.name, 450))
            assert canonical_state(member.replicas[slot.name].index) == canonical_state(slot.index)
            with private_redis.client() as client:
                assert _group_info(client, slot.writer.keys.events) == [(b"routers", 0, b"450-0")]
            nursery.cancel_scope.cancel()


async def test_a_slot_restarted_under_a_new_publisher_moves_its_readers(
    redis_server: str, redis_prefix: str
) -> None:
    config = _config(redis_server, redis_prefix)
    first = SimulatedSlot.create(30, config, publisher_id=7001)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            follower = StreamFollower(StreamTarget(redis_server), prefix=redis_prefix, block_ms=100)
            async with trio.open_nursery() as old_life:
                await run_writers([first], old_life)
                first.step(300)
                await first.flushed()
                await nursery.start(follower.run)
                assert follower.replicas[first.name].head.publisher_id == 7001
                old_life.cancel_scope.cancel()
            # The agent restarted without its state: a new publisher id, cursors from 1 again.
            second = SimulatedSlot.create(30, config, publisher_id=7002)
            second.rng.seed(99)
            await run_writers([second], nursery)
            second.step(120)
            await second.flushed()
            await follower.wait_until(
                lambda f: (
                    f.replicas[second.name].head.publisher_id == 7002
                    and f.replicas[second.name].cursor == 120
                )
            )
            assert canonical_state(follower.replicas[second.name].index) == canonical_state(second.index)
            assert first.writer is not None
            with redis.Redis.from_url(redis_server) as client:
                assert 0 < client.ttl(first.writer.keys.events) <= 3600  # the old stream is freed later
            nursery.cancel_scope.cancel()
