"""Same-run baselines that need no kvagent code: bare receive+decode loops and plain-dict memory."""

from __future__ import annotations

import array
import time
from typing import Any

import msgpack
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


def bare_loop(publisher: Publisher, *, hash_blocks: bool = False, paced: tuple[float, float] | None = None,
              cpu_window: tuple[float, float] | None = None) -> dict[str, float]:
    """Receive and msgpack-decode the publisher's whole stream with blocking pyzmq in this process.

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
        events = blocks = 0
        cpu_start = cpu_end = wall_start = wall_end = 0.0
        cpu_marks = None if cpu_window is None else (started + cpu_window[0], started + sum(cpu_window))
        for _ in range(expected):
            frames = recv()
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
