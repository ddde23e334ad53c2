"""One slot's outbound events appended to its own Redis/Valkey stream, with a compacted snapshot beside it.

The writer is a sink and a task.  The sink side (:meth:`StreamWriter.publish`, called by the coordinator once
per chunk) only wakes the task: it copies nothing and never blocks, so a slow or absent Redis never slows
ingest.  The task reads what is missing from the slot's own ring *by cursor* (the index keeps the events
anyway) and appends it with ``XADD <last cursor>-0 MAXLEN ~ N``; when the ring no longer reaches back to the
stream's top (Redis was down long enough, or the stream is new or lost), it writes a fresh snapshot and a
``snap`` marker instead.  Every ``snapshot_every`` entries it refreshes the snapshot, so a cold reader needs
at most about one snapshot plus ``maxlen`` entries.  Status changes and idle heartbeats go in the stream too
(docs/fleet.md has the format, ``kvagent/stream/format.py`` the bytes).

redis-py's sync client (a cluster client against a Redis Cluster: a slot's keys share one hash tag, so all
of its calls go to one shard) runs in a worker thread, one call at a time, owned by this task alone.  Failures
are counted and logged once per outage (one line naming a wrong setup: a cluster URL at a single server or the
reverse, a refused password); the task backs off exponentially, drops its client (a cluster's slot map is
read anew: after a failover the replica that took over is the master), and on reconnecting re-reads the
stream's top before writing anything, so nothing is written twice and nothing is skipped.

A failover may lose entries Redis acknowledged (replication is asynchronous): the top the writer re-reads is
then below what it had written.  The loss is counted (``lost_entries``) and answered with a reset (a fresh
snapshot and a ``snap`` marker above every cursor written), so a reader that read the lost entries, or the
status among them, reloads the snapshot rather than missing what they said.  Every append also reads the top
it continues, in the same pipeline: a stream found elsewhere than where the writer left it is the same loss.

On a cluster every pipeline that appends also rings the slot's doorbell (``SPUBLISH`` on the slot's sharded
channel, same hash tag, so the same shard and the same round trip): readers block on the doorbells of a shard
instead of polling its streams (kvagent/stream/reader.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

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
from kvagent._util.sync import Changed, checkpoint
from kvagent.model.events import RouterEvent
from kvagent.model.options import option, option_validator, positive
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.stream.format import (
    SlotHead,
    SnapshotLike,
    StreamKeys,
    chunk_events,
    cursor_of_id,
    encode_events_entry,
    encode_head,
    encode_heartbeat_entry,
    encode_snapshot,
    encode_snapshot_entry,
    encode_status_entry,
    event_entry_id,
    slots_key,
)

__all__ = ["EventRing", "StatusSource", "StreamConfig", "StreamWriter", "StreamWriterStatistics"]

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
# Entries sent in one pipeline: enough to catch up fast, few enough that status and heartbeats interleave.
ROUND_ENTRIES = 64
RETIRED_STREAM_TTL = 3600  # seconds a slot's previous stream (an older publisher id) is kept for readers


_positive = option_validator(positive)


def _prefix_problem(prefix: str) -> str | None:
    # Braces would pin every slot's keys to one cluster hash slot; spaces break the key grammar of readers.
    if prefix and not any(c in prefix for c in "{} "):
        return None
    return f"must be non-empty, without braces or spaces, got {prefix!r}"


@attrs.frozen(slots=True)
class StreamConfig:
    """Where and how every slot of a process writes its stream (``kvagent serve --stream``, TOML ``[stream]``).

    ``maxlen`` entries are kept per stream (approximate trim); an entry holds at most ``entry_events`` events;
    the snapshot is refreshed every ``snapshot_every`` entries (default ``maxlen // 2``).
    """

    target: StreamTarget
    prefix: str = option(
        "kvagent",
        help="key prefix of every stream",
        flags=("--stream-prefix",),
        metavar="PREFIX",
        check=_prefix_problem,
    )
    maxlen: int = option(10_000, help="entries kept per stream (approximate, XADD MAXLEN ~)", check=positive)
    entry_events: int = option(256, help="events per stream entry at most", check=positive)
    heartbeat_interval: float = option(
        5.0, help="seconds between heartbeat entries of an idle slot", check=positive
    )
    snapshot_every: int | None = None
    backoff_initial: float = attrs.field(default=0.1, validator=_positive)
    backoff_max: float = attrs.field(default=5.0, validator=_positive)

    @property
    def refresh_entries(self) -> int:
        return self.snapshot_every if self.snapshot_every is not None else max(1, self.maxlen // 2)


class EventRing(Protocol):
    """What the writer reads of the slot's recovery index (``RecoveryIndex`` is one)."""

    def current_event_id(self) -> int: ...
    def answers_with_dump(self, start: int | None, end: int | None) -> bool: ...
    def ring_tail(self, start: int) -> tuple[RouterEvent, ...]: ...
    def dump_snapshot(self) -> SnapshotLike: ...


class StatusSource(Protocol):
    """The slot's status (``StatusCell`` is one)."""

    def get(self) -> AgentStatus: ...
    @property
    def attachment_changed(self) -> Changed: ...


@attrs.frozen(slots=True)
class StreamWriterStatistics:
    """The writer's counters (since it started) and its position.

    Attributes:
        connected: the last Redis call succeeded.
        written_cursor: every event up to this cursor is in the stream.
        index_cursor: the slot's newest outbound cursor.
        lag_events: ``index_cursor - written_cursor`` (ids skipped by the agent count too).
        entries: event entries appended; events: events in them.
        snapshots: snapshots written (refreshes and resets); resets: of them, with a ``snap`` marker.
        status_entries, heartbeats: those entries appended.
        refused: entries Redis refused as already present (a retried write; idempotence at work).
        lost_entries: times the stream's top was found below what had been written (entries a failover lost,
            or a server restarted without its data), each answered with a reset.
        failures: Redis calls that failed; last_error: the newest failure's text.
    """

    connected: bool
    written_cursor: int
    index_cursor: int
    lag_events: int
    entries: int
    events: int
    snapshots: int
    resets: int
    status_entries: int
    heartbeats: int
    refused: int
    lost_entries: int
    failures: int
    last_error: str | None


def _status_key(status: AgentStatus) -> tuple[AttachmentStatus | None, bool]:
    return status.attachment, status.cache_owner_ready


def _redis_fields(fields: dict[str, bytes]) -> dict[Any, Any]:
    """An entry's fields as redis-py's ``xadd`` types them (its invariant dict type takes no ``str`` keys)."""
    return fields


class StreamTopMoved(redis.RedisError):
    """The stream's top is not where this writer left it (raised to re-establish: re-read it, then reset)."""


def _is_refused_id(exc: BaseException) -> bool:
    return isinstance(exc, redis.ResponseError) and "equal or smaller" in str(exc)


def _raise_first_failure(results: list[Any], *, rung: bool) -> None:
    """A pipeline's first failed command raised, except the doorbell's (the last, when ``rung``): a ring is
    at most once by nature, and a server without sharded pub/sub (before Redis 7) refuses it."""
    for result in results[:-1] if rung else results:
        if isinstance(result, Exception):
            raise result


async def _cancel_after_change(changed: Changed, since: int, scope: trio.CancelScope) -> None:
    await changed.wait(since)
    scope.cancel()


class StreamWriter:
    """One slot's stream writer: :meth:`publish` is its sink, :meth:`run` its task."""

    def __init__(
        self,
        config: StreamConfig,
        *,
        slot: str,
        publisher_id: int,
        cache_owner_id: str,
        kv_block_size: int,
        ring: EventRing,
        status: StatusSource,
        client_factory: Callable[[], RedisClient] | None = None,
    ) -> None:
        self.config = config
        self.keys = StreamKeys(config.prefix, slot, publisher_id)
        self._head = SlotHead(slot, publisher_id, kv_block_size, cache_owner_id)
        self._ring = ring
        self._status = status
        self._client_factory = client_factory or config.target.client
        self._client = OwnedClient(self._client_factory)
        self._cluster = config.target.is_cluster
        self._established = False  # once: from then on, a top found below ``_written`` is a loss
        self._lost = 0
        self._limiter = trio.CapacityLimiter(1)
        self._wake = Changed()  # notified by publish
        self._wake_seen = 0  # the wake's version when the last round began
        self._connected = False
        self._written = 0  # every event up to here is in the stream (valid while connected)
        self._written_status: tuple[AttachmentStatus | None, bool] | None = None
        self._since_snapshot = 0
        self._last_write = -math.inf
        self._entries = self._events = self._snapshots = self._resets = 0
        self._status_entries = self._heartbeats = self._refused = self._failures = 0
        self._last_error: str | None = None
        self._progress = Changed()

    # --- sink side (the coordinator's task) ---------------------------------------------------------
    def publish(self, events: Sequence[RouterEvent]) -> None:
        """Wake the writer: the events are in the ring already, the writer reads them from there."""
        self._wake.notify()

    # --- read side ----------------------------------------------------------------------------------
    def statistics(self) -> StreamWriterStatistics:
        index_cursor = self._ring.current_event_id()
        return StreamWriterStatistics(
            connected=self._connected,
            written_cursor=self._written,
            index_cursor=index_cursor,
            lag_events=max(0, index_cursor - self._written),
            entries=self._entries,
            events=self._events,
            snapshots=self._snapshots,
            resets=self._resets,
            status_entries=self._status_entries,
            heartbeats=self._heartbeats,
            refused=self._refused,
            lost_entries=self._lost,
            failures=self._failures,
            last_error=self._last_error,
        )

    async def wait_written(self, cursor: int) -> None:
        """Return once every event up to ``cursor`` (and the status of that moment) is in the stream."""
        await self._progress.wait_for(
            lambda: self._connected
            and self._written >= cursor
            and self._written_status == _status_key(self._status.get())
        )

    async def wait_until(self, predicate: Callable[[StreamWriterStatistics], bool]) -> None:
        """Return once ``predicate(self.statistics())`` holds (checked at each write round and failure)."""
        await self._progress.wait_for(lambda: predicate(self.statistics()))

    # --- the task -----------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write until cancelled; Redis failures are retried with backoff, never raised."""
        task_status.started()
        backoff = self.config.backoff_initial
        try:
            while True:
                try:
                    if not self._connected:
                        await self._establish()
                        if self._failures:
                            log.info("stream_reconnected", stream=self.keys.events, cursor=self._written)
                    await self._write_round()
                    backoff = self.config.backoff_initial
                    await self._wait_for_work()
                except REDIS_ERRORS as exc:
                    self._failures += 1
                    self._last_error = describe_redis_error(exc, cluster=self._cluster)
                    if self._connected or self._failures == 1:
                        log.warning("stream_write_failed", stream=self.keys.events, error=self._last_error)
                    self._connected = False
                    self._client.failed()
                    self._note_progress()
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, self.config.backoff_max)
        finally:
            if self._connected:  # the last events and the shutdown status, if Redis answers promptly
                with trio.move_on_after(1, shield=True):
                    try:
                        await self._write_round()
                    except REDIS_ERRORS as exc:
                        log.warning("stream_final_write_failed", stream=self.keys.events, error=str(exc))
            with trio.move_on_after(1, shield=True):
                await trio.to_thread.run_sync(
                    self._client.close, limiter=self._limiter, abandon_on_cancel=True
                )

    async def _call(self, fn: Callable[[RedisClient], _T]) -> _T:
        return await trio.to_thread.run_sync(
            self._client.call, fn, limiter=self._limiter, abandon_on_cancel=True
        )

    def _note_progress(self) -> None:
        self._progress.notify()

    async def _establish(self) -> None:
        """Register the head, then learn how far the stream already is (after an outage or a restart)."""
        keys, head = self.keys, encode_head(self._head)
        prefix, slot, cluster = self.config.prefix, self._head.slot, self._cluster

        def establish(client: RedisClient) -> tuple[list[Any], bool]:
            previous: Any = client.hget(keys.head, "publisher_id")
            pipe = client.pipeline(transaction=False)
            if previous is not None and previous.isdigit() and int(previous) != keys.publisher_id:
                # The slot restarted under a new publisher id: readers move to the new stream (the head
                # says so); the old one stays readable for a while, then Redis frees it.
                retired = StreamKeys(keys.prefix, keys.slot, int(previous))
                pipe.expire(retired.events, RETIRED_STREAM_TTL)
                pipe.expire(retired.snapshot, RETIRED_STREAM_TTL)
            pipe.hset(keys.head, mapping=head)  # type: ignore[arg-type]
            if not cluster:  # a cluster has no global key: readers find the heads by SCAN on each shard
                pipe.sadd(slots_key(prefix), slot)
            pipe.xrevrange(keys.events, count=1)
            pipe.exists(keys.snapshot)
            result = pipe.execute()
            return result[-2], bool(result[-1])

        top, has_snapshot = await self._call(establish)
        top_cursor = cursor_of_id(top[0][0]) if top else 0
        lost = self._established and top_cursor < self._written
        if lost:
            self._lost += 1
            log.warning("stream_entries_lost", stream=self.keys.events, written=self._written, top=top_cursor)
        self._established = True
        self._written = top_cursor
        self._written_status = None  # a restarted Redis may have lost it: write the status again
        self._connected = True
        if lost or not top or not has_snapshot:
            await self._reset()

    async def _write_round(self) -> None:
        await self._write_status()
        current = self._ring.current_event_id()
        if self._written < current:
            if self._ring.answers_with_dump(self._written + 1, None):
                await self._reset()
            else:
                await self._append(current)
        if self._since_snapshot >= self.config.refresh_entries:
            await self._write_snapshot(marker=False)
        if trio.current_time() - self._last_write >= self.config.heartbeat_interval:
            await self._heartbeat()
        self._note_progress()

    async def _write_status(self) -> None:
        status = self._status.get()
        key = _status_key(status)
        if key == self._written_status:
            return
        entry_id, fields = f"{self._written}-*", encode_status_entry(status)
        await self._xadd(entry_id, fields)
        self._written_status = key
        self._status_entries += 1

    async def _append(self, current: int) -> None:
        """Append the ring's events after the stream's top, up to ``ROUND_ENTRIES`` entries."""
        tail = self._ring.ring_tail(self._written + 1)
        max_events = ROUND_ENTRIES * self.config.entry_events
        complete = len(tail) <= max_events
        tail = tail[:max_events]
        entries: list[tuple[int, int, Sequence[RouterEvent]]] = []
        start = self._written + 1
        for chunk in chunk_events(tail, self.config.entry_events):
            last = chunk[-1].event_id
            entries.append((start, last, chunk))
            start = last + 1
        if complete and start <= current:
            entries.append((start, current, ()))  # ids the agent skipped (a restart): covered, no events
        keys, maxlen, expected = self.keys, self.config.maxlen, self._written
        cluster, ring = self._cluster, doorbell_channel(self.keys.tag)

        def append(client: RedisClient) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.xrevrange(keys.events, count=1)  # the top this round continues, read where it writes
            for first, last, events in entries:
                fields = encode_events_entry(first, events)
                pipe.xadd(
                    keys.events,
                    _redis_fields(fields),
                    id=event_entry_id(last),
                    maxlen=maxlen,
                    approximate=True,
                )
            if cluster and entries:
                pipe.spublish(ring, str(entries[-1][1]))  # the doorbell: readers block on it, not poll
            results: list[Any] = pipe.execute(raise_on_error=False)
            return results[: 1 + len(entries)]  # the ring's answer is not needed (at most once anyway)

        top, *results = await self._call(append)
        if isinstance(top, Exception):
            raise top
        if not top or cursor_of_id(top[0][0]) != expected:
            # Not where this writer left it (a failover lost entries, or the stream was lost): what was just
            # appended may follow a hole; readers refuse to apply past it, and the re-establish resets.
            raise StreamTopMoved(f"stream top is {top[0][0] if top else None!r}, expected cursor {expected}")
        for (_, last, events), result in zip(entries, results, strict=True):
            if isinstance(result, Exception):
                if not _is_refused_id(result):
                    raise result
                self._refused += 1  # already there: a retried write after a lost reply
            else:
                self._entries += 1
                self._events += len(events)
                self._since_snapshot += 1
            self._written = last
        self._last_write = trio.current_time()

    async def _reset(self) -> None:
        """The stream cannot be continued from the ring: a snapshot at the index's cursor, and a marker."""
        await self._write_snapshot(marker=True)

    async def _write_snapshot(self, *, marker: bool) -> None:
        snapshot = self._ring.dump_snapshot()  # one synchronous copy: consistent at its cursor
        status = self._status.get()
        cursor = snapshot.last_event_id
        if marker and cursor < self._written:
            # The stream holds cursors this agent never issued (its state was restored from an older file
            # with the same publisher id): ids cannot go back, so the reset is announced at the top.
            log.error(
                "stream_ahead_of_agent", stream=self.keys.events, stream_cursor=self._written, cursor=cursor
            )
        keys, maxlen = self.keys, self.config.maxlen
        marker_cursor = max(cursor, self._written)
        marker_id = f"{marker_cursor}-*"
        cluster, ring = self._cluster, doorbell_channel(self.keys.tag)

        def write(client: RedisClient) -> None:
            payload = encode_snapshot(snapshot, status)
            pipe = client.pipeline(transaction=False)
            pipe.set(keys.snapshot, payload)
            if marker:
                pipe.xadd(
                    keys.events,
                    _redis_fields(encode_snapshot_entry(cursor)),
                    id=marker_id,
                    maxlen=maxlen,
                    approximate=True,
                )
                if cluster:
                    pipe.spublish(ring, str(marker_cursor))
            _raise_first_failure(pipe.execute(raise_on_error=False), rung=cluster and marker)

        await self._call(write)
        self._snapshots += 1
        self._since_snapshot = 0
        if marker:
            self._resets += 1
            self._written = max(cursor, self._written)
            self._last_write = trio.current_time()
            log.info("stream_snapshot_reset", stream=self.keys.events, cursor=cursor)

    async def _heartbeat(self) -> None:
        await self._xadd(f"{self._written}-*", encode_heartbeat_entry(int(time.time() * 1000)))
        self._heartbeats += 1

    async def _xadd(self, entry_id: str, fields: dict[str, bytes]) -> None:
        keys, maxlen = self.keys, self.config.maxlen
        cluster, ring = self._cluster, doorbell_channel(self.keys.tag)

        def xadd(client: RedisClient) -> None:
            if not cluster:
                client.xadd(keys.events, _redis_fields(fields), id=entry_id, maxlen=maxlen, approximate=True)
                return
            pipe = client.pipeline(transaction=False)
            pipe.xadd(keys.events, _redis_fields(fields), id=entry_id, maxlen=maxlen, approximate=True)
            pipe.spublish(ring, entry_id)
            _raise_first_failure(pipe.execute(raise_on_error=False), rung=True)

        await self._call(xadd)
        self._last_write = trio.current_time()

    async def _wait_for_work(self) -> None:
        """Sleep until events are published, the attachment changes, or a heartbeat is due."""
        woken = self._wake.version != self._wake_seen
        self._wake_seen = self._wake.version
        changes = self._status.attachment_changed
        changes_seen = changes.version
        if (
            woken
            or self._ring.current_event_id() != self._written
            or _status_key(self._status.get()) != self._written_status
        ):
            await checkpoint()
            return
        due = self._last_write + self.config.heartbeat_interval
        with trio.move_on_at(due):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_after_change, self._wake, self._wake_seen, nursery.cancel_scope)
                nursery.start_soon(_cancel_after_change, changes, changes_seen, nursery.cancel_scope)
