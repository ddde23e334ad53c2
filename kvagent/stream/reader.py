"""Rebuild the resident state of any number of slots from their Redis/Valkey streams, and follow them live.

No connection to any agent: a slot's replica is its stream's snapshot (a tree dump at a cursor) plus the
event entries after it (docs/fleet.md).  :class:`SlotReplica` is sans-IO: it takes decoded entries and says
when it needs its snapshot again (a ``snap`` marker beyond its cursor, or entries that start after it: the
stream was trimmed under a slow reader, lost with a restarted Redis, or lost to a failover): it never applies
past a hole.  :class:`StreamFollower` is its Trio shell: it owns one redis-py sync client, used from one worker
thread at a time, and reads every followed stream with one blocking ``XREAD`` (or ``XREADGROUP``, for routers
that share the entries of a group).

Against a Redis Cluster (``StreamTarget.is_cluster``) the client is redis-py's cluster client, which follows
MOVED/ASK and reads the slot map anew after resharding or a failover.  A cluster refuses a multi-key ``XREAD``
whose keys are not in one hash slot (CROSSSLOT), and every slot has its own hash tag, so there the follower
blocks on doorbells instead: the writer rings its slot's sharded pub/sub channel (``SPUBLISH``, same hash tag,
same shard) in the pipeline of each append, and the follower holds one ``SSUBSCRIBE``d connection per shard,
each blocked on in its own worker thread.  A ring makes it read just the rung streams (a non-blocking
``XRANGE``, or ``XREADGROUP``, pipelined: one round trip per shard).  Pub/sub is at most once (a ring is lost
to a failover, a resharding, a dropped connection), so every ``block_ms`` the follower also catches up every
stream and looks at the heads again (the safety poll): a lost ring makes it late, never wrong.  A cluster
without sharded pub/sub (before Redis 7) is polled every ``poll_ms`` instead.  The directory is found by
``SCAN`` of each master for the slots' heads: no global key.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import attrs
import redis
import structlog
import trio

from kvagent._util.redis_target import (
    REDIS_ERRORS,
    OwnedClient,
    RedisClient,
    StreamTarget,
    describe_redis_error,
    doorbell_channel,
)
from kvagent._util.sync import Changed
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import CodecError, IndexApplyError
from kvagent.model.status import AgentStatus
from kvagent.stream.apply import apply_entry
from kvagent.stream.format import (
    EventsEntry,
    HeartbeatEntry,
    SlotHead,
    SnapshotEntry,
    StatusEntry,
    StreamEntry,
    StreamKeys,
    StreamSnapshot,
    decode_entry,
    decode_head,
    decode_snapshot,
    head_key,
    slots_key,
)

__all__ = ["FollowerStatistics", "SlotReplica", "StreamFollower"]

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
PAGE_ENTRIES = 64  # entries per XRANGE/XREAD page, per stream (an entry holds up to 256 events)
MAX_RELOADS = 8  # snapshot reloads in a row before a slot waits for the next round
# The longest a doorbell listener's worker thread blocks on its shard's connection: how soon it notices that it
# was cancelled (a new set of doorbells, or the follower stopping); a ring ends the wait at once.
DOORBELL_WAIT_S = 0.25


class SlotReplica:
    """One slot's state rebuilt from its stream: an index, the slot's status, and how far it has read.

    ``ready`` is the slot's attachment readiness as the stream last said (False: not ready, or no status
    seen yet), told apart from ``index.resident_block_count == 0`` (empty).
    """

    def __init__(self, head: SlotHead, prefix: str) -> None:
        self.head = head
        self.keys = StreamKeys(prefix, head.slot, head.publisher_id)
        self.index = RecoveryIndex(head.kv_block_size, ring_capacity=1)
        self.status: AgentStatus | None = None
        self.cursor = 0
        self.position = "0-0"  # the stream id read through (exclusive start of the next read)
        self.loaded = False  # a snapshot (or an empty new stream) is the base of the state
        self.heartbeat_unix_ms: int | None = None
        self.entries = 0
        self.events = 0
        self.snapshots_loaded = 0
        self.gaps = 0  # entries that started after the cursor (trimmed or lost): answered by a reload

    @property
    def slot(self) -> str:
        return self.head.slot

    @property
    def ready(self) -> bool:
        attachment = None if self.status is None else self.status.attachment
        return attachment is not None and attachment.ready

    @property
    def generation(self) -> int | None:
        attachment = None if self.status is None else self.status.attachment
        return None if attachment is None else attachment.generation

    def load(self, snapshot: StreamSnapshot | None) -> None:
        """Start over from ``snapshot`` (None: the stream has none yet, so it starts empty at cursor 0)."""
        index = RecoveryIndex(self.head.kv_block_size, ring_capacity=1)
        if snapshot is None:
            self.cursor, self.status = 0, None
        else:
            index.restore(snapshot.events(), (), snapshot_id=snapshot.cursor)
            self.cursor, self.status = snapshot.cursor, snapshot.status
            self.snapshots_loaded += 1
        self.index = index
        self.position = f"{self.cursor}-0"
        self.loaded = True

    def apply(self, entry_id: str, entry: StreamEntry) -> bool:
        """Apply one entry; False: the replica needs its snapshot first (the entry is not consumed)."""
        if isinstance(entry, EventsEntry):
            if entry.last <= self.cursor:
                self.position = entry_id
                return True  # already in the state (a snapshot taken after it)
            if entry.first > self.cursor + 1:
                self.gaps += 1
                return False
            self.events += apply_entry(self.index, entry.columns, after=self.cursor, last=entry.last)
            self.cursor = entry.last
            self.entries += 1
        elif isinstance(entry, SnapshotEntry):
            if entry.cursor > self.cursor:
                return False  # the slot's state was reset to that snapshot
        elif isinstance(entry, StatusEntry):
            self.status = entry.status
        elif isinstance(entry, HeartbeatEntry):
            self.heartbeat_unix_ms = entry.unix_ms
        self.position = entry_id
        return True


@attrs.frozen(slots=True)
class FollowerStatistics:
    slots: int
    entries: int
    events: int
    snapshots_loaded: int
    gaps: int
    malformed: int
    failures: int
    last_error: str | None
    doorbell_reads: int = 0  # rounds of reads a ring started (a cluster's live path)
    safety_polls: int = 0  # catch-ups of every stream because no ring came for block_ms (a cluster)
    doorbells_opened: int = 0  # times the per-shard doorbell connections were (re)subscribed
    doorbells_subscribed: int = 0  # followed slots whose doorbell is subscribed now (0 while any is stale)


def _read_pages(client: RedisClient, *, requests: list[tuple[str, str]]) -> list[Any]:
    """One page of each stream after its position (a pipeline: one round trip for every stream)."""
    pipe = client.pipeline(transaction=False)
    for key, position in requests:
        pipe.xrange(key, min=f"({position}", count=PAGE_ENTRIES)
    pages: list[Any] = pipe.execute()
    return pages


def _poll_pages(
    client: RedisClient, *, requests: list[tuple[str, str]], group: str | None, consumer: str | None
) -> list[Any]:
    """One page of each stream, non-blocking, one pipelined round trip per shard (a cluster's live read)."""
    if group is None or consumer is None:
        return _read_pages(client, requests=requests)
    pipe = client.pipeline(transaction=False)
    for key, _ in requests:
        pipe.xreadgroup(group, consumer, {key: ">"}, count=PAGE_ENTRIES)
    pages: list[Any] = []
    for answer in pipe.execute():
        if not answer:
            pages.append([])
        elif isinstance(answer, dict):  # RESP3
            pages.append(next(iter(answer.values()), []))
        else:
            pages.append(answer[0][1])
    return pages


class _ShardDoorbells:
    """One shard's connection, subscribed (``SSUBSCRIBE``) to the doorbells of the followed slots it serves.

    A bare connection read by hand, not redis-py's ``PubSub``: that re-subscribes every channel with one
    ``SSUBSCRIBE`` when it reconnects, which a cluster refuses (CROSSSLOT) for channels of several hash slots;
    here a lost connection is an error, answered by subscribing anew on the slot map read anew.  RESP2: every
    message is a reply on the socket (``smessage``, ``ssubscribe``, ``sunsubscribe``).
    """

    def __init__(self, client: redis.cluster.RedisCluster, node: Any) -> None:
        settings: dict[str, Any] = {**client.get_connection_kwargs(), "protocol": 2}  # type: ignore[no-untyped-call]
        # A connection of its own (not the client's pool): a slot-map refresh does not touch it.
        self._server = client.nodes_manager.create_redis_node(node.host, node.port, **settings)  # type: ignore[no-untyped-call]
        self._connection = self._server.connection_pool.get_connection()
        self.name: str = node.name

    def subscribe(self, channels: list[str]) -> None:
        """Subscribe, one channel a command (SSUBSCRIBE's channels must share a hash slot), and wait for every
        confirmation: a ring sent after this returns is heard."""
        for channel in channels:
            self._connection.send_command("SSUBSCRIBE", channel)
        waiting = set(channels)
        while waiting:
            reply = self._connection.read_response()  # socket_timeout bounds the wait
            kind, channel = _text(reply[0]), _text(reply[1])
            if kind != "ssubscribe":
                raise redis.ResponseError(f"unexpected reply to SSUBSCRIBE: {kind} {channel}")
            waiting.discard(channel)

    def wait(self, timeout: float) -> tuple[set[str], bool]:
        """Block up to ``timeout`` for a ring, then take every ring already there: (rung channels, stale).

        Stale: the server unsubscribed a channel (its hash slot moved to another shard).
        """
        rung: set[str] = set()
        stale = False
        ready = self._connection.can_read(timeout=timeout)
        while ready:
            reply = self._connection.read_response()
            kind = _text(reply[0])
            if kind == "smessage":
                rung.add(_text(reply[1]))
            elif kind == "sunsubscribe":
                stale = True
            ready = self._connection.can_read(timeout=0)
        return rung, stale

    def close(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            self._connection.disconnect()
        with contextlib.suppress(*REDIS_ERRORS):
            self._server.close()


def _open_doorbells(client: RedisClient, *, channels: Sequence[str]) -> list[_ShardDoorbells]:
    """One doorbell connection per master, for the channels whose hash slots it serves as the client's slot map
    says.  Raises what a command would (MOVED/ASK while the map is stale: the caller refreshes it)."""
    assert isinstance(client, redis.cluster.RedisCluster)
    by_node: dict[str, tuple[Any, list[str]]] = {}
    for channel in channels:
        node = client.get_node_from_key(channel)  # type: ignore[no-untyped-call]  # the channel's master
        by_node.setdefault(node.name, (node, []))[1].append(channel)
    opened: list[_ShardDoorbells] = []
    try:
        for node, subscribed in by_node.values():
            doorbells = _ShardDoorbells(client, node)
            opened.append(doorbells)
            doorbells.subscribe(subscribed)
    except BaseException:
        for doorbells in opened:
            doorbells.close()
        raise
    return opened


def _head_keys(client: RedisClient, *, prefix: str) -> list[str]:
    """Every slot's head key under ``prefix``, by SCAN of every master (a cluster: no global directory)."""
    assert isinstance(client, redis.cluster.RedisCluster)
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", "{" + prefix + ":") + "*}:head"
    keys = client.scan_iter(
        match=pattern, count=1000, _type="hash", target_nodes=redis.cluster.RedisCluster.PRIMARIES
    )
    return sorted({_text(key) for key in keys})


def _xread(
    client: RedisClient, *, streams: dict[str, str], group: str | None, consumer: str | None, block: int
) -> list[tuple[Any, Any]]:
    """One blocking XREAD (or XREADGROUP) of every stream: [(key, [(id, fields), ...]), ...]."""
    keys: Any = streams
    if group is not None and consumer is not None:
        result: Any = client.xreadgroup(group, consumer, keys, count=PAGE_ENTRIES, block=block)
    else:
        result = client.xread(keys, count=PAGE_ENTRIES, block=block)
    if not result:
        return []
    if isinstance(result, dict):  # RESP3
        return list(result.items())
    return [(key, entries) for key, entries in result]


def _ack(client: RedisClient, *, key: str, group: str | None, ids: list[Any]) -> None:
    if group is not None:
        client.xack(key, group, *ids)


def _ack_all(client: RedisClient, *, group: str, acks: list[tuple[str, list[Any]]]) -> None:
    pipe = client.pipeline(transaction=False)
    for key, ids in acks:
        pipe.xack(key, group, *ids)
    pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StreamFollower:
    """Replicas of the followed slots (``slots`` None: every slot in the directory, new ones included).

    ``group``/``consumer``: read live entries through a consumer group instead (``XREADGROUP`` and
    ``XACK``): each entry then goes to one member of the group, for routers that share the work of
    applying entries (each member's replicas hold only its share, so members should split the slots).
    """

    def __init__(
        self,
        target: StreamTarget,
        *,
        prefix: str = "kvagent",
        slots: Sequence[str] | None = None,
        block_ms: int = 1000,
        group: str | None = None,
        consumer: str | None = None,
        on_update: Callable[[SlotReplica], None] | None = None,
        client_factory: Callable[[], RedisClient] | None = None,
        poll_ms: int = 20,
    ) -> None:
        if (group is None) != (consumer is None):
            raise ValueError("a consumer group needs both group and consumer names")
        self._target = target
        self.prefix = prefix
        self._slots = None if slots is None else list(slots)
        self._block_ms = block_ms
        self._poll_ms = poll_ms
        self._cluster = target.is_cluster
        self._group = group
        self._consumer = consumer
        self._on_update = on_update
        self._client_factory = client_factory or (
            lambda: attrs.evolve(
                target, socket_timeout=max(target.socket_timeout, 2 * block_ms / 1000)
            ).client()
        )
        self._client = OwnedClient(self._client_factory)
        self._limiter = trio.CapacityLimiter(1)
        self.replicas: dict[str, SlotReplica] = {}
        self._grouped: set[str] = set()
        self._malformed = 0
        self._failures = 0
        self._last_error: str | None = None
        self._progress = Changed()
        # Inside a round of live reads: entries applied whose acknowledgments (XACK) are not all sent yet.
        self._acknowledging = False
        # A cluster's doorbells: the channels subscribed, the listeners' cancel scope, what they heard.
        self._nursery: trio.Nursery | None = None
        self._doorbell_channels: frozenset[str] = frozenset()
        self._doorbell_scope: trio.CancelScope | None = None
        self._doorbells_stale = False  # a listener failed, or a channel's hash slot moved: subscribe anew
        self._doorbells_unsupported = False  # the cluster has no sharded pub/sub: poll instead
        self._rung: set[str] = set()
        self._rang = Changed()  # notified when a doorbell adds to _rung
        self._doorbell_reads = 0
        self._safety_polls = 0
        self._doorbells_opened = 0

    def statistics(self) -> FollowerStatistics:
        replicas = list(self.replicas.values())
        return FollowerStatistics(
            slots=len(replicas),
            entries=sum(r.entries for r in replicas),
            events=sum(r.events for r in replicas),
            snapshots_loaded=sum(r.snapshots_loaded for r in replicas),
            gaps=sum(r.gaps for r in replicas),
            malformed=self._malformed,
            failures=self._failures,
            last_error=self._last_error,
            doorbell_reads=self._doorbell_reads,
            safety_polls=self._safety_polls,
            doorbells_opened=self._doorbells_opened,
            doorbells_subscribed=0 if self._doorbells_stale else len(self._doorbell_channels),
        )

    async def _call(self, fn: Callable[[RedisClient], _T]) -> _T:
        return await trio.to_thread.run_sync(
            self._client.call, fn, limiter=self._limiter, abandon_on_cancel=True
        )

    async def aclose(self) -> None:
        with trio.move_on_after(1, shield=True):
            await trio.to_thread.run_sync(self._client.close, limiter=self._limiter, abandon_on_cancel=True)

    async def wait_until(self, predicate: Callable[[StreamFollower], bool]) -> None:
        """Return once ``predicate(self)`` holds (checked after every round of reads).

        Never in the middle of a round: in a group, every entry applied so far is acknowledged by then.
        """
        await self._progress.wait_for(lambda: not self._acknowledging and predicate(self))

    # --- one pass ---------------------------------------------------------------------------------
    async def refresh_heads(self) -> None:
        """Find the followed slots' current streams; a slot whose publisher changed starts over."""
        prefix, wanted, cluster = self.prefix, self._slots, self._cluster

        def heads(client: RedisClient) -> dict[str, dict[bytes, bytes]]:
            if wanted is not None:
                keys = {head_key(prefix, name): name for name in wanted}
            elif cluster:
                keys = {key: key for key in _head_keys(client, prefix=prefix)}  # named by the head's field
            else:
                keys = {head_key(prefix, _text(n)): _text(n) for n in client.smembers(slots_key(prefix))}
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            found: dict[str, dict[bytes, bytes]] = {}
            for (key, name), fields in zip(keys.items(), pipe.execute(), strict=True):
                if key == name and fields and b"slot" in fields:  # found by SCAN: the head names its slot
                    name = _text(fields[b"slot"])
                    if head_key(prefix, name) != key:
                        continue  # another prefix's key that the pattern matched
                found[name] = fields
            return found

        for name, fields in sorted((await self._call(heads)).items()):
            if not fields:
                continue  # not written yet (or lost with a restarted Redis, until the writer is back)
            try:
                head = decode_head(fields)
            except CodecError as exc:
                self._malformed += 1
                log.warning("stream_head_malformed", slot=name, error=str(exc))
                continue
            current = self.replicas.get(name)
            if current is None or current.head.publisher_id != head.publisher_id:
                self.replicas[name] = SlotReplica(head, prefix)
                self._grouped.discard(name)

    async def _load_snapshot(self, replica: SlotReplica) -> None:
        key = replica.keys.snapshot

        def get(client: RedisClient) -> bytes | None:
            value: bytes | None = client.get(key)  # type: ignore[assignment]
            return value

        payload = await self._call(get)
        replica.load(None if payload is None else decode_snapshot(payload))

    def _apply_entries(self, replica: SlotReplica, entries: list[tuple[Any, dict[bytes, bytes]]]) -> bool:
        """Apply read entries in order; False: the replica must reload its snapshot (the rest is dropped)."""
        for raw_id, fields in entries:
            entry_id = _text(raw_id)
            try:
                entry = decode_entry(entry_id, fields)
            except CodecError as exc:
                self._malformed += 1
                log.warning("stream_entry_malformed", slot=replica.slot, id=entry_id, error=str(exc))
                replica.position = entry_id
                continue
            try:
                if not replica.apply(entry_id, entry):
                    return False
            except IndexApplyError as exc:
                self._malformed += 1
                log.warning("stream_entry_refused", slot=replica.slot, id=entry_id, error=str(exc))
                return False
        return True

    async def catch_up(self) -> None:
        """Bring every followed replica to the end of its stream (snapshot first where needed)."""
        await self.refresh_heads()
        pending = [r for r in self.replicas.values()]
        reloads = dict.fromkeys((r.slot for r in pending), 0)
        while pending:
            for replica in pending:
                if not replica.loaded:
                    await self._load_snapshot(replica)
            requests = [(r.keys.events, r.position) for r in pending]

            pages = await self._call(partial(_read_pages, requests=requests))
            still: list[SlotReplica] = []
            for replica, entries in zip(pending, pages, strict=True):
                if not self._apply_entries(replica, entries):
                    reloads[replica.slot] += 1
                    if reloads[replica.slot] <= MAX_RELOADS:
                        replica.loaded = False
                        still.append(replica)
                    continue
                if self._on_update is not None and entries:
                    self._on_update(replica)
                if len(entries) == PAGE_ENTRIES:
                    still.append(replica)
            pending = still
        self._note_progress()

    def _note_progress(self) -> None:
        self._progress.notify()

    # --- follow -----------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Catch up, then follow every stream live until cancelled; Redis failures are retried.

        Started once caught up and, with a ``group``, a member of it on every stream found: an entry written
        after that is delivered through the group.
        """
        try:
            async with trio.open_nursery() as nursery:  # a cluster's doorbell listeners
                self._nursery = nursery
                await self._follow(task_status)
        finally:
            self._close_doorbells()
            self._nursery = None
            await self.aclose()

    async def _follow(self, task_status: trio.TaskStatus[None]) -> None:
        started = False
        backoff = 0.1
        while True:
            try:
                await self.catch_up()
                await self._join_groups()
                if not started:
                    task_status.started()
                    started = True
                backoff = 0.1
                await self._read_live()
            except REDIS_ERRORS as exc:
                self._failures += 1
                self._last_error = describe_redis_error(exc, cluster=self._cluster)
                log.warning("stream_read_failed", error=self._last_error)
                # A fresh client after the outage: fresh connections and group reads, and a cluster's
                # slot map read anew (the replica that took over from a killed master is the master now).
                self._client.failed()
                # A Redis restarted without its data lost the groups with the streams (XREADGROUP then
                # answers NOGROUP): join every group again, at each replica's position (BUSYGROUP: kept).
                self._grouped.clear()
                self._doorbells_stale = True  # subscribe anew, on the masters of the map read anew
                await trio.sleep(backoff)
                backoff = min(2 * backoff, 5.0)

    async def _read_live(self) -> None:
        """Blocking reads of every replica's stream, until a replica needs its snapshot or heads may move."""
        if self._cluster:
            if self._doorbells_unsupported:
                await self._poll_live()
            else:
                await self._ring_live()
            return
        while True:
            replicas = [r for r in self.replicas.values() if r.loaded]
            if not replicas:
                await self._sleep_ms(self._block_ms)
                return
            streams = {r.keys.events: (r.position if self._group is None else ">") for r in replicas}
            by_key = {r.keys.events: r for r in replicas}
            read = partial(_xread, streams=streams, group=self._group, consumer=self._consumer)
            answer = await self._call(partial(read, block=self._block_ms))
            if not answer:
                return  # idle for a block: let the caller look at the heads again
            needs_snapshot = False
            self._acknowledging = self._group is not None
            try:
                for raw_key, entries in answer:
                    replica = by_key[_text(raw_key)]
                    ok = self._apply_entries(replica, entries)
                    if self._group is not None and entries:
                        ids = [raw_id for raw_id, _ in entries]
                        await self._call(partial(_ack, key=replica.keys.events, group=self._group, ids=ids))
                    if not ok:
                        replica.loaded = False
                        needs_snapshot = True
                    elif self._on_update is not None and entries:
                        self._on_update(replica)
            finally:
                self._acknowledging = False
            self._note_progress()
            if needs_snapshot:
                return

    async def _ring_live(self) -> None:
        """A cluster's live reads: wait for a ring on any shard's doorbells, then read the rung streams (one
        pipelined round trip per shard), until a replica needs its snapshot or ``block_ms`` is up (then the
        caller catches up every stream and looks at the heads: the safety poll for a lost ring)."""
        replicas = [r for r in self.replicas.values() if r.loaded]
        if not replicas:
            await self._sleep_ms(self._block_ms)
            return
        deadline = trio.current_time() + (self._block_ms / 1000 if math.isfinite(self._block_ms) else 1.0)
        try:
            subscribed = await self._sync_doorbells(replicas)
        except redis.ResponseError as exc:
            if "unknown command" not in str(exc).lower():
                raise
            self._doorbells_unsupported = True
            log.warning("stream_doorbells_unsupported", error=str(exc).splitlines()[0], poll_ms=self._poll_ms)
            return
        by_channel = {doorbell_channel(r.keys.tag): r for r in replicas}
        # Just subscribed: an entry may have come between the last read and the subscription.
        pending = replicas if subscribed else []
        while True:
            while pending:
                pending, needs_snapshot, _ = await self._read_round(pending)
                if needs_snapshot:
                    return
            if trio.current_time() >= deadline:  # due even while rings keep coming: a lost one is not starved
                self._safety_polls += 1
                return
            with trio.move_on_at(deadline):
                await self._rang.wait_for(lambda: bool(self._rung))
            if not self._rung:
                continue
            rung, self._rung = self._rung, set()
            pending = [by_channel[c] for c in sorted(rung) if c in by_channel and by_channel[c].loaded]
            if pending:
                self._doorbell_reads += 1

    async def _sync_doorbells(self, replicas: list[SlotReplica]) -> bool:
        """Subscribe to every followed slot's doorbell, one connection per shard, unless already (True: just
        subscribed anew).  Any change (a new slot, a listener that failed, a hash slot that moved) subscribes
        every channel anew: rare, and simpler than mending one shard's subscriptions."""
        channels = frozenset(doorbell_channel(r.keys.tag) for r in replicas)
        if channels == self._doorbell_channels and not self._doorbells_stale:
            return False
        if self._doorbells_stale:
            self._client.failed()  # a cluster client reads the slot map anew before subscribing
        self._close_doorbells()
        self._doorbells_stale = False
        shards = await self._call(partial(_open_doorbells, channels=sorted(channels)))
        assert self._nursery is not None
        self._doorbell_scope = await self._nursery.start(self._listen_all, shards)
        self._doorbell_channels = channels
        self._doorbells_opened += 1
        return True

    def _close_doorbells(self) -> None:
        if self._doorbell_scope is not None:
            self._doorbell_scope.cancel()  # each listener closes its connection once its thread is back
            self._doorbell_scope = None
        self._doorbell_channels = frozenset()

    async def _listen_all(
        self,
        shards: list[_ShardDoorbells],
        *,
        task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            async with trio.open_nursery() as nursery:
                for shard in shards:
                    nursery.start_soon(self._listen, shard)

    async def _listen(self, shard: _ShardDoorbells) -> None:
        """One shard's doorbells: a worker thread of its own blocks on the connection (``DOORBELL_WAIT_S`` at
        most, so a cancellation is noticed), and what it hears wakes the live reads."""
        wait = partial(shard.wait, DOORBELL_WAIT_S)
        limiter = trio.CapacityLimiter(1)
        try:
            while True:
                # Not abandoned on cancel: the connection is closed below, once no thread reads it.
                rung, stale = await trio.to_thread.run_sync(wait, limiter=limiter)
                if stale:  # subscribed anew at the next round; until then, the safety poll covers it
                    self._doorbells_stale = True
                if rung:
                    self._rung |= rung
                    self._rang.notify()
        except REDIS_ERRORS as exc:
            self._doorbells_stale = True
            log.info("stream_doorbell_lost", error=describe_redis_error(exc, cluster=True))
        finally:
            shard.close()

    async def _read_round(self, replicas: list[SlotReplica]) -> tuple[list[SlotReplica], bool, bool]:
        """One page of each replica's stream (one pipelined round trip per shard), applied and acknowledged:
        (the replicas whose page was full, so more may follow; whether a replica needs its snapshot; whether
        any entry came)."""
        requests = [(r.keys.events, r.position) for r in replicas]
        read = partial(_poll_pages, requests=requests, group=self._group, consumer=self._consumer)
        pages = await self._call(read)
        needs_snapshot = got = False
        more: list[SlotReplica] = []
        acks: list[tuple[str, list[Any]]] = []
        self._acknowledging = self._group is not None
        try:
            for replica, entries in zip(replicas, pages, strict=True):
                if not entries:
                    continue
                got = True
                ok = self._apply_entries(replica, entries)
                if self._group is not None:
                    acks.append((replica.keys.events, [raw_id for raw_id, _ in entries]))
                if not ok:
                    replica.loaded = False
                    needs_snapshot = True
                    continue
                if self._on_update is not None:
                    self._on_update(replica)
                if len(entries) == PAGE_ENTRIES:
                    more.append(replica)
            if acks and self._group is not None:
                await self._call(partial(_ack_all, group=self._group, acks=acks))
        finally:
            self._acknowledging = False
        self._note_progress()
        return more, needs_snapshot, got

    async def _poll_live(self) -> None:
        """A cluster without sharded pub/sub: every stream's next page, one pipelined round trip per shard,
        until a replica needs its snapshot or nothing came for ``block_ms`` (then the heads may have moved)."""
        idle_since = trio.current_time()
        while True:
            replicas = [r for r in self.replicas.values() if r.loaded]
            if not replicas:
                await self._sleep_ms(self._block_ms)
                return
            _, needs_snapshot, got = await self._read_round(replicas)
            if needs_snapshot:
                return
            now = trio.current_time()
            if got:
                idle_since = now
            elif (now - idle_since) * 1000 >= self._block_ms:
                return
            else:
                await self._sleep_ms(self._poll_ms)

    async def _join_groups(self) -> None:
        """Create the group on every caught-up replica's stream not joined yet, at the replica's position.

        At the position, not at ``$``: entries written since the catch-up's last read are delivered too.
        ``MKSTREAM``: the head can exist before the writer's first entry.
        """
        group = self._group
        todo = [r for r in self.replicas.values() if r.loaded and r.slot not in self._grouped]
        if not todo or group is None:
            return

        def create(client: RedisClient) -> None:
            for replica in todo:
                try:
                    client.xgroup_create(replica.keys.events, group, id=replica.position, mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

        await self._call(create)
        self._grouped.update(r.slot for r in todo)

    @staticmethod
    async def _sleep_ms(ms: float) -> None:
        await trio.sleep(ms / 1000 if math.isfinite(ms) else 1.0)
