"""A 1M-block snapshot through the republisher's replay ROUTER: time and memory (``python -m bench.republish_snapshot``).

One :class:`~kvagent.publish.republisher.VllmRepublisher` in this process is fed ``--blocks`` resident blocks
(chains of 64 blocks of 16 tokens, as vLLM stores them), then a DEALER over loopback TCP asks ``b"snapshot"``
and reads every frame to the end marker. Reported: publish rate, snapshot time, the blocks received (must equal
the resident blocks), and the peak RSS growth while the snapshot streamed (bounded: the answer is encoded
lazily, 512 blocks a payload, and the ROUTER's high-water mark holds back the producer).

Then a SUB joins late, which makes the republisher publish a resync (the whole state as live batches, see
docs/republish.md): its bytes and batches, the time from the SUB's connect to its last batch received, and
the longest the event loop went without running another task meanwhile (the resync is encoded and sent in
one synchronous step).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any

import msgpack
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.model.events import ResidencyDomain, RouterEvent, StorageTier, Stored
from kvagent.publish.republisher import RepublishConfig, VllmRepublisher

BLOCK_SIZE = 16
CHAIN = 64
END_SEQ = b"\xff" * 8


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _feed(republisher: VllmRepublisher, blocks: int) -> float:
    tokens = bytes(range(256)) * (CHAIN * BLOCK_SIZE * 4 // 256)
    started = time.perf_counter()
    for first in range(1, blocks + 1, CHAIN):
        hashes = tuple(range(first, min(first + CHAIN, blocks + 1)))
        data = Stored(None, hashes, hashes, token_bytes=tokens[: len(hashes) * BLOCK_SIZE * 4])
        republisher.publish([RouterEvent(1, StorageTier.DEVICE, ResidencyDomain.WORKER, first, data, 0)])
    return time.perf_counter() - started


async def _snapshot(context: zmq.Context[Any], endpoint: str) -> tuple[int, int, float]:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    received = frames = 0
    with TrioSocket(dealer) as sock:
        started = time.perf_counter()
        await sock.send_multipart([b"", b"snapshot"])
        while True:
            for reply in await sock.recv_multipart_batch():
                if reply[2] == END_SEQ:
                    return received, frames, time.perf_counter() - started
                frames += 1
                for event in msgpack.unpackb(reply[3])[1]:
                    if event["type"] == "BlockStored":
                        received += len(event["block_hashes"])


async def _resync(context: zmq.Context[Any], republisher: VllmRepublisher) -> tuple[int, float, float]:
    """A SUB joins: the blocks its resync carried, the seconds until it had all of them, the longest loop stall."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    stall = 0.0

    async def watch_loop() -> None:
        nonlocal stall
        while True:
            before = time.perf_counter()
            await trio.sleep(0.001)
            stall = max(stall, time.perf_counter() - before - 0.001)

    received = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_loop)
        with TrioSocket(sub) as sock:
            started = time.perf_counter()
            sub.connect(republisher.endpoint)
            while received < republisher.state.resident_blocks():
                # A few messages at a time: decoding them is this task's own stall, not the republisher's.
                for _topic, _seq, payload in await sock.recv_multipart_batch(max_messages=2):
                    for event in msgpack.unpackb(payload)[1]:
                        if event["type"] == "BlockStored":
                            received += len(event["block_hashes"])
            seconds = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return received, seconds, stall


async def run(blocks: int) -> dict[str, Any]:
    context: zmq.Context[Any] = zmq.Context()
    config = RepublishConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    republisher = VllmRepublisher(config, dp_rank=0, block_size=BLOCK_SIZE, context=context)
    try:
        rss_start = _rss_mib()
        publish_seconds = _feed(republisher, blocks)
        rss_fed = _rss_mib()
        async with trio.open_nursery() as nursery:
            await nursery.start(republisher.run)
            received, frames, seconds = await _snapshot(context, republisher.replay_endpoint or "")
            resync_received, resync_seconds, stall = await _resync(context, republisher)
            nursery.cancel_scope.cancel()
        rss_after = _rss_mib()
        statistics = republisher.statistics()
    finally:
        republisher.close()
        context.destroy(linger=0)
    return {
        "blocks": blocks,
        "publish_seconds": round(publish_seconds, 2),
        "publish_blocks_per_second": round(blocks / publish_seconds),
        "snapshot_seconds": round(seconds, 2),
        "snapshot_blocks_per_second": round(blocks / seconds),
        "snapshot_payloads": frames,
        "blocks_received": received,
        "resident_blocks": statistics.state.resident_blocks,
        "ring_mib": round(statistics.state.ring_bytes / 2**20, 1),
        "rss_before_feed_mib": round(rss_start),
        "rss_fed_mib": round(rss_fed),
        "peak_rss_growth_during_snapshot_mib": round(rss_after - rss_fed, 1),
        "resync_blocks_received": resync_received,
        "resync_batches": statistics.state.resync_batches,
        "resync_mib": round(statistics.state.resync_bytes / 2**20, 1),
        "resync_seconds": round(resync_seconds, 2),
        "resync_longest_loop_stall_seconds": round(stall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    print(json.dumps(trio.run(run, args.blocks), indent=2))


if __name__ == "__main__":
    main()
