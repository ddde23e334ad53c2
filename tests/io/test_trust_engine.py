"""The fake vLLM engine's fault injection for issue #14: swaps, duplicates, kill and revive, and its truth."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.simulator.engine import (
    FakeVllmEngine,
    ResidentTruth,
    all_blocks_cleared,
    block_removed,
    block_stored,
)

GUARD = 10


def store(*hashes: int, medium: str = "GPU") -> dict[str, Any]:
    return block_stored(list(hashes), None, [1] * (16 * len(hashes)), 16, medium=medium)


def test_the_truth_counts_physical_copies_per_medium_and_clears() -> None:
    truth = ResidentTruth()
    truth.apply([store(1, 2), store(2), store(3, medium="CPU")])
    truth.apply([block_removed([2]), block_removed([9])])  # one copy of 2 goes; an unknown hash is ignored
    assert truth.blocks() == {1, 2} and truth.blocks("CPU") == {3}
    truth.apply([block_removed([2])])
    assert truth.blocks() == {1}
    truth.apply([all_blocks_cleared()])
    assert truth.blocks() == frozenset() and truth.blocks("CPU") == frozenset()


class Subscriber:
    """A SUB read by its own task (libzmq re-subscribes after a reconnect only for a socket in use)."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self._changed = trio.Event()

    async def run(self, sock: TrioSocket) -> None:
        while True:
            self.seqs.append(int.from_bytes((await sock.recv_multipart())[1], "big"))
            self._changed.set()
            self._changed = trio.Event()

    async def received(self, count: int) -> list[int]:
        while len(self.seqs) < count:
            await self._changed.wait()
        return self.seqs


@asynccontextmanager
async def engine_and_sub(**options: Any) -> AsyncIterator[tuple[FakeVllmEngine, Subscriber]]:
    async with trio.open_nursery() as nursery:
        engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", **options)
        await nursery.start(engine.run)
        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(engine.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        with TrioSocket(sub) as sock:
            subscriber = Subscriber()
            nursery.start_soon(subscriber.run, sock)
            await engine.wait_for_subscriber()
            yield engine, subscriber
            nursery.cancel_scope.cancel()


async def test_a_swapped_batch_goes_out_after_its_successor_and_a_duplicate_twice() -> None:
    with trio.fail_after(GUARD):
        async with engine_and_sub() as (engine, sub):
            await engine.publish_batch([store(1)])
            await engine.publish_batch([store(2)], swap_with_next=True)
            await engine.publish_batch([store(3)], duplicate=True)
            await engine.publish_batch([store(4)], swap_with_next=True)
            engine.flush_live()  # its successor never came
            assert await sub.received(5) == [0, 2, 2, 1, 3]
            assert [seq for seq, _ in engine.buffer] == [0, 1, 2, 3], "the buffer keeps seq order"
            assert (engine.swapped, engine.duplicated) == (2, 1)
            assert engine.truth.blocks() == {1, 2, 3, 4}


async def test_swap_and_duplicate_rates_draw_from_the_fault_seed() -> None:
    with trio.fail_after(GUARD):
        async with engine_and_sub(swap_rate=0.2, duplicate_rate=0.1, fault_seed=3) as (engine, sub):
            for n in range(200):
                await engine.publish_batch([store(n)])
            engine.flush_live()
            seqs = await sub.received(200 + engine.duplicated)
            assert sorted(set(seqs)) == list(range(200))
            assert engine.swapped > 10 and engine.duplicated > 5
            assert seqs != sorted(seqs)


async def test_kill_drops_the_connection_and_revive_binds_the_same_ports() -> None:
    with trio.fail_after(GUARD):
        async with engine_and_sub() as (engine, sub):
            endpoints = (engine.endpoint, engine.replay_endpoint)
            for n in range(3):
                await engine.publish_batch([store(n)])
            first_payload = engine.buffer[0][1]
            engine.kill()
            assert not engine.alive
            await engine.revive(restart=False)  # the same engine: seq and buffer go on
            assert (engine.endpoint, engine.replay_endpoint) == endpoints
            await engine.wait_for_subscriber()  # the SUB reconnected by itself
            assert await engine.publish_batch([store(3)]) == 3
            assert (await sub.received(4))[3:] == [3]
            assert engine.truth.blocks() == {0, 1, 2, 3}

            engine.kill()
            await engine.revive(restart=True)  # a new engine: seq 0, empty buffer and cache
            await engine.wait_for_subscriber()
            assert await engine.publish_batch([store(9)]) == 0
            assert (await sub.received(5))[4:] == [0]
            assert [seq for seq, _ in engine.buffer] == [0] and engine.truth.blocks() == {9}
            new_stamp = msgpack.unpackb(engine.buffer[0][1])[0]
            assert new_stamp > msgpack.unpackb(first_payload)[0], "a new engine's payloads never repeat old bytes"
