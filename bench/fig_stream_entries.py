"""Issue #36: the stream's entry formats side by side: Redis bytes per event and a cold reader's rate.

``python -m bench stream_entries``: a private ``redis-server`` (no persistence) on a free loopback port; 16
simulated slots' events (bench/fleet_sim.py, 62,500 each, 1,000,000 in all; ``--quick`` 200,000) written
into two sets of streams, in entries of 256 events as the writer cuts them: once in the version-1 entries
(named-map msgpack RouterEvents) and once in the columnar version-2 entries, each slot with its snapshot.
Measured in the same run:

- Redis memory per event kept (``MEMORY USAGE <stream> SAMPLES 0``: exact), both formats;
- the snapshot's bytes per resident block (``MEMORY USAGE`` of the snapshot string);
- a cold reader rebuilding all 16 slots from empty (no snapshot: every event applied): today's reader loop
  (the event plane decoder and RouterEvents applied one by one, as before issue #36) on the version-1
  streams, and ``StreamFollower.catch_up`` on both; each rebuilt state is checked block for block.

The fleet figure can call :func:`measure_entries` on its own server and events: ``measure_entries(client,
url, slots_events, truth_digests)`` returns the rows.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
import trio

from bench.fleet_sim import SimulatedSlot, canonical_state, timed_catch_up
from bench.harness import FigureResult, Row
from bench.redis_procs import redis_server
from kvagent._util.redis_target import StreamTarget
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.events import RouterEvent
from kvagent.model.status import AgentStatus
from kvagent.stream.format import (
    ENTRY_COLUMN_BYTES,
    SlotHead,
    StreamKeys,
    chunk_events,
    encode_events_entry,
    encode_events_entry_v1,
    encode_head,
    encode_snapshot,
    event_entry_id,
    slots_key,
)
from kvagent.stream.reader import PAGE_ENTRIES
from kvagent.wire.router_event import decode_router_events

NAME = "stream_entries"
TITLE = "Stream entries: Redis bytes per event and cold-reader rate, version 1 vs columnar version 2"
ENTRY_EVENTS = 256  # the writer's default entry_events


def _digest(index: RecoveryIndex) -> str:
    return hashlib.sha256(repr(sorted(map(repr, canonical_state(index)))).encode()).hexdigest()


def _write(
    client: redis.Redis,
    prefix: str,
    slot: SimulatedSlot,
    events: Sequence[RouterEvent],
    version: int,
    encode: Callable[[int, Sequence[RouterEvent]], dict[str, bytes]],
    max_bytes: int | None,
) -> StreamKeys:
    keys = StreamKeys(prefix, slot.name, slot.publisher_id)
    head = SlotHead(slot.name, slot.publisher_id, 16, "bench", version=version)
    pipe = client.pipeline(transaction=False)
    pipe.sadd(slots_key(prefix), slot.name)
    pipe.hset(keys.head, mapping=encode_head(head))  # type: ignore[arg-type]
    for chunk in chunk_events(events, ENTRY_EVENTS, max_bytes):
        fields: Any = encode(chunk[0].event_id, chunk)
        pipe.xadd(keys.events, fields, id=event_entry_id(chunk[-1].event_id))
    pipe.execute()
    return keys


def _legacy_catch_up(client: redis.Redis, prefix: str, slots: Sequence[SimulatedSlot]) -> dict[str, RecoveryIndex]:
    """Today's reader before issue #36, on version-1 streams: pages of XRANGE over every stream in one
    pipeline, each entry's RouterEvents decoded by the event plane's decoder and applied as SlotReplica did
    (``apply_run`` when the whole entry is of its shape, else one ``apply`` an event)."""
    indexes = {s.name: RecoveryIndex(16, ring_capacity=1) for s in slots}
    positions = {s.name: "0-0" for s in slots}
    keys = {s.name: StreamKeys(prefix, s.name, s.publisher_id).events for s in slots}
    pending = [s.name for s in slots]
    while pending:
        pipe = client.pipeline(transaction=False)
        for name in pending:
            pipe.xrange(keys[name], min=f"({positions[name]}", count=PAGE_ENTRIES)
        still = []
        for name, entries in zip(pending, pipe.execute(), strict=True):
            index = indexes[name]
            for raw_id, fields in entries:
                events: Sequence[RouterEvent] = tuple(decode_router_events(fields[b"ev"]))
                if events and events[0].event_id == index.current_event_id() + 1:
                    failures = index.apply_run(events)
                    if failures is not None:
                        events = ()
                for event in events:
                    index.apply(event)
                positions[name] = raw_id.decode()
            if len(entries) == PAGE_ENTRIES:
                still.append(name)
        pending = still
    return indexes


def _memory(client: redis.Redis, key: str) -> int:
    return int(client.memory_usage(key, samples=0) or 0)


def measure_entries(
    client: redis.Redis, url: str, slots: Sequence[SimulatedSlot], events: dict[str, Sequence[RouterEvent]]
) -> list[Row]:
    """Both formats' streams of ``events`` (by slot name) in the server at ``url``; ``slots``' indexes hold
    the state the events lead to (the truth each reader is checked against). Returns the figure's rows."""
    truth = {s.name: _digest(s.index) for s in slots}
    total = sum(len(e) for e in events.values())
    prefixes = {1: f"v1-{uuid.uuid4().hex[:8]}", 2: f"v2-{uuid.uuid4().hex[:8]}"}
    stream_bytes = {}
    # Version 1 as the writer cut it before issue #36 (by count alone), version 2 as it cuts now.
    for version, encode, max_bytes in ((1, encode_events_entry_v1, None), (2, encode_events_entry, ENTRY_COLUMN_BYTES)):
        written = [_write(client, prefixes[version], s, events[s.name], version, encode, max_bytes) for s in slots]
        stream_bytes[version] = sum(_memory(client, keys.events) for keys in written)
    snapshot_bytes = 0
    for s in slots:
        key = f"snapshot-{s.name}"
        client.set(key, encode_snapshot(s.index.dump_snapshot(), AgentStatus(s.status.get().identity)))
        snapshot_bytes += _memory(client, key)
        client.delete(key)
    blocks = sum(s.index.resident_block_count for s in slots)

    started = time.perf_counter()
    legacy = _legacy_catch_up(client, prefixes[1], slots)
    legacy_seconds = time.perf_counter() - started
    seconds = {}
    for version in (1, 2):
        seconds[version], follower = trio.run(timed_catch_up, StreamTarget(url), prefixes[version])
        rebuilt = {name: _digest(r.index) for name, r in follower.replicas.items()}
        if rebuilt != truth:
            raise AssertionError(f"the reader's state of the version-{version} streams differs from a slot's own")
    if {name: _digest(index) for name, index in legacy.items()} != truth:
        raise AssertionError("the legacy reader's state differs from a slot's own")
    return [
        Row("Redis memory per event, columnar (v2)", stream_bytes[2] / total, "bytes", "v1 named-map entries",
            stream_bytes[1] / total, target="<= 40", higher_is_better=False),  # fmt: skip
        Row("snapshot per resident block", snapshot_bytes / max(1, blocks), "bytes", target="~25",
            higher_is_better=False, note=f"{blocks} blocks"),  # fmt: skip
        Row("cold reader, v2 streams", seconds[2], "s", "today's reader loop, v1 streams", legacy_seconds,
            target="<= 5 s or 10x", higher_is_better=False, note=f"{total} events"),  # fmt: skip
        Row("cold reader rate, v2 streams", total / seconds[2], "events/s", "today's reader loop, v1 streams",
            total / legacy_seconds),  # fmt: skip
        Row("cold reader rate, v1 streams (new reader)", total / seconds[1], "events/s",
            "today's reader loop, v1 streams", total / legacy_seconds),  # fmt: skip
    ]


def run(result: FigureResult, *, quick: bool) -> None:
    count = 16
    total = 200_000 if quick else 1_000_000
    slots = [SimulatedSlot.create(n, None, ring=1) for n in range(count)]
    events: dict[str, Sequence[RouterEvent]] = {}
    for slot in slots:
        made = slot.make_events(total // count)
        for event in made:
            slot.index.apply(event)
        events[slot.name] = made
    with redis_server("kvagent-entries-") as (url, client, _):
        version: Any = client.info("server")
        result.rows += measure_entries(client, url, slots, events)
        result.params.update(
            slots=count,
            events=total,
            entry_events=ENTRY_EVENTS,
            redis=version.get("redis_version"),
            cpus=os.cpu_count(),
            note="shared machine (2 cores, several engineers): rates are indicative, the ratio is the figure",
        )
