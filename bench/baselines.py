"""Same-run baselines that need no kvagent code: bare receive+decode loops and plain-dict memory."""

from __future__ import annotations

import array
import collections
import struct
import time
from typing import Any

import msgpack
import msgspec
import xxhash
import zmq

from bench.publisher import Publisher
from bench.trace import BLOCK_SIZE, TOPIC

LOCAL_HASH_SEED = 1337  # kvagent's LocalBlockHash: XXH3-64 over u32-LE tokens, seed 1337


def _subscriber(context: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = context.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sock.connect(endpoint)
    return sock


def _block_hashes(events: list[Any]) -> int:
    """xxh3 of every stored block's tokens, as the normalizer must do; returns the block count hashed."""
    hashed = 0
    for event in events:
        if event.get("type") != "BlockStored":
            continue
        tokens = event["token_ids"]
        for start in range(0, len(tokens), BLOCK_SIZE):
            xxhash.xxh3_64_intdigest(array.array("I", tokens[start : start + BLOCK_SIZE]).tobytes(),
                                     seed=LOCAL_HASH_SEED)
            hashed += 1
    return hashed


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: tuple[int, ...]
    token_ids: list[int]
    parent_block_hash: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: tuple[int, ...]


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed]
    rank: int | None = None


class MinimalConsumer:
    """The least a Python consumer must do per event, with none of kvagent's objects, checks or lifecycle.

    Typed msgspec decode, XXH3 of every stored block's u32-LE tokens, reference counts and a resident-block
    map as plain dicts, and a bounded ring of plain tuples: the floor any pure-Python design pays on this
    machine, reported next to kvagent so the gap to the bare decode loop can be read in two parts.
    """

    def __init__(self) -> None:
        self.decode = msgspec.msgpack.Decoder(_Batch).decode
        self.counts: dict[int, int] = {}
        self.resident: dict[int, tuple[int | None, int]] = {}
        self.ring: collections.deque[tuple[object, ...]] = collections.deque(maxlen=1024)
        self.packers: dict[int, struct.Struct] = {}
        self.next_id = 1

    def consume(self, payload: bytes) -> int:
        counts, resident, ring, hash64 = self.counts, self.resident, self.ring, xxhash.xxh3_64_intdigest
        batch = self.decode(payload)
        for event in batch.events:
            hashes = event.block_hashes
            if type(event) is _Stored:
                tokens = event.token_ids
                packer = self.packers.get(len(tokens))
                if packer is None:
                    packer = self.packers[len(tokens)] = struct.Struct(f"<{len(tokens)}I")
                packed = packer.pack(*tokens)
                stride = 4 * BLOCK_SIZE
                local = tuple([hash64(packed[i : i + stride], seed=LOCAL_HASH_SEED)
                               for i in range(0, len(hashes) * stride, stride)])
                parent = event.parent_block_hash
                for block_hash, local_hash in zip(hashes, local, strict=True):
                    counts[block_hash] = counts.get(block_hash, 0) + 1
                    resident[block_hash] = (parent, local_hash)
                    parent = block_hash
                ring.append((self.next_id, event.parent_block_hash, hashes, local))
            else:
                for block_hash in hashes:
                    counts.pop(block_hash, None)
                    resident.pop(block_hash, None)
                ring.append((self.next_id, hashes))
            self.next_id += 1
        return len(batch.events)


def bare_loop(publisher: Publisher, *, hash_blocks: bool = False, minimal: bool = False,
              paced: tuple[float, float] | None = None,
              cpu_window: tuple[float, float] | None = None) -> dict[str, float]:
    """Receive and msgpack-decode the publisher's whole stream with blocking pyzmq in this process.

    ``minimal=True`` runs :class:`MinimalConsumer` on each payload instead of ``msgpack.unpackb``.

    ``paced=(events_per_s, seconds)`` asks for a paced stream instead of a burst; ``cpu_window=(skip,
    length)`` measures this process's CPU time over that part of the run (figure 5).
    """
    context: zmq.Context[Any] = zmq.Context()
    sock = _subscriber(context, publisher.endpoint)
    try:
        publisher.request_subscriber_wait()
        publisher.wait_subscribed()
        if paced is None:
            expected = publisher.stats.batches
            publisher.burst()
        else:
            expected = int(paced[0] / 8 * paced[1])
            publisher.paced(*paced)
        started = time.perf_counter()
        recv, unpackb = sock.recv_multipart, msgpack.unpackb
        consumer = MinimalConsumer() if minimal else None
        events = blocks = 0
        cpu_start = cpu_end = wall_start = wall_end = 0.0
        cpu_marks = None if cpu_window is None else (started + cpu_window[0], started + sum(cpu_window))
        for _ in range(expected):
            frames = recv()
            if consumer is not None:
                events += consumer.consume(frames[2])
            else:
                batch = unpackb(frames[2])
                events += len(batch[1])
                if hash_blocks:
                    blocks += _block_hashes(batch[1])
            if cpu_marks is not None:
                now = time.perf_counter()
                if not wall_start and now >= cpu_marks[0]:
                    wall_start, cpu_start = now, time.process_time()
                elif wall_start and not wall_end and now >= cpu_marks[1]:
                    wall_end, cpu_end = now, time.process_time()
        finished = time.perf_counter()
        publisher.wait_sent()
        result = {"seconds": finished - started, "events": events, "events_per_s": events / (finished - started)}
        if cpu_marks is not None and wall_end:
            result["cpu_percent"] = 100 * (cpu_end - cpu_start) / (wall_end - wall_start)
        return result
    finally:
        sock.close(linger=0)
        context.term()
