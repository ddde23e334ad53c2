"""The fake vLLM engine and the simulated workload: wire fidelity, determinism, realistic content."""

from __future__ import annotations

import collections
from functools import partial

import msgpack
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.simulator.engine import (
    NONE_HASH,
    FakeVllmEngine,
    SimulatedWorkload,
    all_blocks_cleared,
    block_removed,
    block_stored,
    cbor_encode,
    chain_block_hash,
    fold_hash,
    run_simulated_engine,
)
from kvagent.vllm.decode import (
    RawAllBlocksCleared,
    RawBlockRemoved,
    RawBlockStored,
    decode,
    decode_payload,
)
from tests.support.vectors import load_live

LIVE, REPLAY = load_live()


def subscriber(endpoint: str, topic: bytes = b"") -> TrioSocket:
    """A SUB socket connected to the fake engine, subscribed to ``topic``; close it with ``with``."""
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return TrioSocket(sub)


def test_cbor_matches_known_encodings() -> None:
    assert cbor_encode(None) == b"\xf6"
    assert cbor_encode(23) == b"\x17"
    assert cbor_encode(24) == b"\x18\x18"
    assert cbor_encode(1000) == b"\x19\x03\xe8"
    assert cbor_encode(-1) == b"\x20"
    assert cbor_encode("a") == b"\x61a"
    assert cbor_encode((1, [2, 3])) == b"\x82\x01\x82\x02\x03"
    assert cbor_encode(b"\x00" * 2) == b"\x42\x00\x00"


def test_block_hashes_chain_over_full_digests() -> None:
    first = chain_block_hash(None, [1, 2, 3, 4])
    assert len(first) == 32 and len(NONE_HASH) == 32
    assert chain_block_hash(NONE_HASH, [1, 2, 3, 4]) == first
    second = chain_block_hash(first, [5, 6, 7, 8])
    assert second != chain_block_hash(None, [5, 6, 7, 8])
    assert fold_hash(first) == int.from_bytes(first[-8:], "big")


def test_builders_reencode_the_capture_byte_for_byte() -> None:
    engine = FakeVllmEngine(block_size=32)
    for frames in LIVE:
        ts, events, rank = msgpack.unpackb(frames[2])
        rebuilt = []
        for event in events:
            if event["type"] == "BlockStored":
                rebuilt.append(
                    block_stored(
                        event["block_hashes"],
                        event["parent_block_hash"],
                        event["token_ids"],
                        event["block_size"],
                    )
                )
            elif event["type"] == "BlockRemoved":
                rebuilt.append(block_removed(event["block_hashes"]))
            else:
                rebuilt.append(all_blocks_cleared())
        assert rank == 0
        assert engine.encode_batch(rebuilt, ts=ts) == frames[2]


def test_legacy_mode_writes_full_length_arrays_that_decode() -> None:
    engine = FakeVllmEngine(mode="legacy")
    payload = engine.encode_batch(
        [block_stored([1, 2], None, [0] * 32, 16), block_removed([1]), all_blocks_cleared()], ts=1.0
    )
    _, events, _ = msgpack.unpackb(payload)
    assert [len(e) for e in events] == [12, 4, 1]
    batch = decode_payload(payload)
    assert isinstance(batch.events[0], RawBlockStored) and batch.events[0].block_hashes == (1, 2)
    assert batch.events[0].group_idx == 0 and batch.events[0].kv_cache_spec_kind == "full_attention"
    assert isinstance(batch.events[1], RawBlockRemoved) and batch.events[1].medium == "GPU"
    assert isinstance(batch.events[2], RawAllBlocksCleared)


def run_workload(seed: int, steps: int, **options: int) -> list[list[dict[str, object]]]:
    workload = SimulatedWorkload(seed=seed, block_size=4, **options)
    return [workload.next_step() for _ in range(steps)]


def test_the_workload_is_deterministic_for_a_seed() -> None:
    assert run_workload(3, 200) == run_workload(3, 200)
    assert run_workload(3, 200) != run_workload(4, 200)


def test_the_workload_is_realistic() -> None:
    engine = FakeVllmEngine(block_size=4)
    resident: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    kinds: collections.Counter[str] = collections.Counter()
    prefix_shared = 0
    for step in run_workload(11, 1500, capacity_blocks=64):
        batch = decode_payload(engine.encode_batch(step))
        for event in batch.events:
            if isinstance(event, RawBlockStored):
                medium = event.medium or "GPU"
                kinds[f"store:{medium}"] += 1
                assert len(event.token_ids) == len(event.block_hashes) * 4
                if event.parent_block_hash is not None:
                    prefix_shared += 1
                    if medium == "GPU":
                        assert resident["GPU"][event.parent_block_hash] > 0, (
                            "a parent is cached before its child"
                        )
                resident[medium].update(event.block_hashes)
            elif isinstance(event, RawBlockRemoved):
                medium = event.medium or "GPU"
                kinds[f"remove:{medium}"] += 1
                assert len(event.block_hashes) == 1, "one remove per evicted block"
                (removed,) = event.block_hashes
                assert resident[medium][removed] > 0, "removes only name stored hashes"
                resident[medium][removed] -= 1
            else:
                assert isinstance(event, RawAllBlocksCleared)
                kinds["clear"] += 1
                resident.clear()
        assert sum(resident["GPU"].values()) <= 64, "LRU keeps the GPU cache within capacity"
    assert kinds["store:GPU"] > 100 and kinds["remove:GPU"] > 100
    assert kinds["store:CPU"] > 10
    assert 1 <= kinds["clear"] <= 10, "a prefix-cache reset is rare"
    assert prefix_shared > 100


async def test_the_engine_publishes_a_workload_a_sub_can_decode() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine(dp_rank=2, block_size=4)
            await nursery.start(engine.run)
            with subscriber(engine.endpoint) as sock:
                await engine.wait_for_subscriber()
                workload = SimulatedWorkload(seed=1, block_size=4)
                nursery.start_soon(partial(run_simulated_engine, engine, workload, steps_per_second=1000.0))
                messages = [decode(await sock.recv_multipart()) for _ in range(5)]
            assert [m.seq for m in messages] == list(range(5))
            assert {m.batch.data_parallel_rank for m in messages} == {2}
            assert {m.topic for m in messages} == {b"kv-events"}
            assert all(m.batch.events for m in messages), "only steps with events are published"
            nursery.cancel_scope.cancel()


async def test_fault_injection_shapes_the_live_stream_and_the_replay_buffer() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", buffer_steps=4)
            await nursery.start(engine.run)
            with subscriber(engine.endpoint, b"kv-events") as sock:
                await engine.wait_for_subscriber()
                event = [block_stored([1], None, [0] * 16, 16)]
                assert await engine.publish_batch(event) == 0
                assert await engine.publish_batch(event, drop_live=True) == 1
                assert await engine.publish_batch(event, unbuffered=True) == 2
                assert await engine.publish_batch(event, skip_seq=True) == 4
                assert await engine.publish_batch(event) == 5
                live = [decode(await sock.recv_multipart()).seq for _ in range(3)]
            assert live == [0, 4, 5]
            assert [seq for seq, _ in engine.buffer] == [0, 1, 4, 5]
            replies = engine.replay_replies(1)
            assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [1, 4, 5]
            assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
            await engine.publish_batch(event)
            assert [seq for seq, _ in engine.buffer] == [1, 4, 5, 6], "the buffer evicts its oldest batch"
            engine.restart()
            assert engine.buffer == collections.deque() and await engine.publish_batch(event) == 0
            nursery.cancel_scope.cancel()


async def test_capture_frames_and_a_loaded_replay_buffer_are_served_verbatim() -> None:
    pairs = [(int.from_bytes(f[2], "big"), f[3]) for f in REPLAY[:-1]]
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", topic=LIVE[0][0])
            await nursery.start(engine.run)
            engine.load_replay_buffer(pairs)
            assert engine.replay_replies(65) == [*REPLAY[65:68], REPLAY[-1]], "byte-identical to the capture"
            with subscriber(engine.endpoint) as sock:
                await engine.wait_for_subscriber()
                await engine.publish_frames_sequence(LIVE[:3])
                assert await engine.send_payload(LIVE[3][2]) == 68, "the next seq follows the loaded buffer"
                received = [await sock.recv_multipart() for _ in range(4)]
            assert received[:3] == LIVE[:3]
            assert received[3] == [LIVE[0][0], (68).to_bytes(8, "big"), LIVE[3][2]]
            assert engine.buffer[-1] == (68, LIVE[3][2])
            nursery.cancel_scope.cancel()
