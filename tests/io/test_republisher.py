"""The vLLM-compatible republisher over real ZMQ on loopback: live frames, replay, snapshots, slow DEALERs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
import zmq

from kvagent import AttachmentConfig, SlotAgent, SlotAgentConfig, open_slot_agent
from kvagent._util.zmqtrio import TrioSocket
from kvagent.agent.metrics import MetricSources, render_metrics
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.errors import KvAgentError
from kvagent.model.events import (
    CLEARED,
    EventData,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.model.status import AgentStatus
from kvagent.publish.republish_state import RepublishState, ResyncGate, SnapshotAnswer
from kvagent.publish.republisher import RepublishConfig, VllmRepublisher, offset_endpoint
from kvagent.publish.sinks import FanoutSink
from kvagent.simulator.engine import FakeVllmEngine, block_stored
from kvagent.testing import RecordingSink
from kvagent.vllm.decode import decode_payload
from tests.support.agent import XpubEngine, batch, gpu_store, is_store_of, wait_for_event
from tests.support.ids import OWNER
from tests.support.vllm_consumer import END_SEQ, VllmStyleConsumer

TIMEOUT = 20
BLOCK_SIZE = 4


def event(
    data: EventData,
    *,
    tier: StorageTier = StorageTier.DEVICE,
    domain: ResidencyDomain = ResidencyDomain.WORKER,
) -> RouterEvent:
    return RouterEvent(
        worker_id=17, storage_tier=tier, residency_domain=domain, event_id=0, data=data, dp_rank=0
    )


def tokens(count: int, first: int = 0) -> bytes:
    return b"".join((first + i).to_bytes(4, "little") for i in range(count * BLOCK_SIZE))


def store(hashes: Sequence[int], parent: int | None = None) -> RouterEvent:
    data = Stored(parent, tuple(hashes), tuple(hashes), token_bytes=tokens(len(hashes)))
    return event(data)


def remove(hashes: Sequence[int]) -> RouterEvent:
    return event(Removed(tuple(hashes)))


def config(**overrides: Any) -> RepublishConfig:
    values: dict[str, Any] = {
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "topic": "kv-events",
    }
    return RepublishConfig(**{**values, **overrides})


@asynccontextmanager
async def running(context: zmq.Context[Any], **overrides: Any) -> AsyncIterator[VllmRepublisher]:
    republisher = VllmRepublisher(config(**overrides), dp_rank=0, block_size=BLOCK_SIZE, context=context)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(republisher.run)
            yield republisher
            nursery.cancel_scope.cancel()
    finally:
        republisher.close()


def socket(context: zmq.Context[Any], kind: int, endpoint: str, **options: int) -> TrioSocket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return TrioSocket(sock)


async def ask(dealer: TrioSocket, request: bytes) -> list[list[bytes]]:
    """Send one replay request; every reply up to and including the end marker."""
    await dealer.send_multipart([b"", request])
    replies: list[list[bytes]] = []
    while True:
        frames = await dealer.recv_multipart()
        replies.append(frames)
        if frames[-2] == END_SEQ:
            return replies


def events_of(payload: bytes) -> list[dict[str, Any]]:
    _ts, events, rank = msgpack.unpackb(payload)
    assert rank == 0
    return list(events)


def resident_after(payloads: Sequence[bytes]) -> set[int]:
    resident: set[int] = set()
    for payload in payloads:
        for item in events_of(payload):
            if item["type"] == "BlockStored":
                resident.update(item["block_hashes"])
            elif item["type"] == "BlockRemoved":
                resident.difference_update(item["block_hashes"])
            else:
                resident.clear()
    return resident


async def until(condition: Callable[[], bool]) -> None:
    # The republisher's counters have no change notification: poll them (bounded by the caller's fail_after).
    while True:
        if condition():
            return
        await trio.sleep(0.02)


# --- configuration ------------------------------------------------------------------------------------------


def test_endpoints_are_offset_by_dp_rank_the_way_vllm_does() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"  # ephemeral per rank
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(KvAgentError, match="cannot be offset"):
        offset_endpoint("ipc:///tmp/kv", 1)
    shifted = config(endpoint="tcp://*:6000", replay_endpoint="tcp://*:7000").for_rank(1)
    assert (shifted.endpoint, shifted.replay_endpoint) == ("tcp://*:6001", "tcp://*:7001")


@pytest.mark.parametrize(
    "overrides",
    [
        {"endpoint": "http://x:1"},
        {"endpoint": "tcp://nohost"},
        {"endpoint": "tcp://h:70000"},
        {"replay_endpoint": "udp://h:1"},
        {"endpoint": "tcp://h:1", "replay_endpoint": "tcp://h:1"},
        {"buffer_batches": 0},
        {"answer_deadline": 0.0},
    ],
)
def test_bad_republish_config_is_a_bad_request(overrides: dict[str, Any]) -> None:
    with pytest.raises(KvAgentError) as raised:
        config(**overrides)
    assert raised.value.code == "bad_request"


# --- live -----------------------------------------------------------------------------------------------------


async def test_live_frames_carry_the_topic_and_seqs_from_zero_for_worker_changes_only(
    zmq_context: zmq.Context[Any],
) -> None:
    with trio.fail_after(TIMEOUT):
        async with running(zmq_context) as republisher:
            with socket(zmq_context, zmq.SUB, republisher.endpoint) as sub:
                await republisher.wait_for_subscriber()
                republisher.publish([store([1, 2])])
                owner_only = event(Stored(None, (9,), (9,)), domain=ResidencyDomain.CACHE_OWNER)
                republisher.publish([owner_only])  # nothing of the Worker view: no batch, no seq
                republisher.publish([event(Removed(()))])  # a no-op: no batch either
                republisher.publish([remove([2]), store([3], parent=1)])
                republisher.publish([event(CLEARED)])
                frames = [await sub.recv_multipart() for _ in range(3)]
    assert [f[0] for f in frames] == [b"kv-events"] * 3
    assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2]
    first, second, third = (events_of(f[2]) for f in frames)
    assert first == [
        {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            "parent_block_hash": None,
            "token_ids": list(range(2 * BLOCK_SIZE)),
            "block_size": BLOCK_SIZE,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
    ]
    assert [e["type"] for e in second] == ["BlockRemoved", "BlockStored"]
    assert third == [{"type": "AllBlocksCleared"}]
    # kvagent's own decoder reads the stream as it reads a vLLM engine.
    decoded = decode_payload(frames[0][2], max_payload_bytes=1 << 20)
    assert decoded.data_parallel_rank == 0
    statistics = republisher.statistics()
    assert (statistics.batches_sent, statistics.dropped_batches) == (3, 0)
    assert republisher.status().seq == 2


async def test_publish_after_close_raises_a_sink_error(zmq_context: zmq.Context[Any]) -> None:
    republisher = VllmRepublisher(config(), dp_rank=0, block_size=BLOCK_SIZE, context=zmq_context)
    republisher.close()
    with pytest.raises(KvAgentError, match="closed"):
        republisher.publish([store([1])])


def test_a_taken_port_is_a_clear_bind_error(zmq_context: zmq.Context[Any]) -> None:
    first = VllmRepublisher(
        config(replay_endpoint=None), dp_rank=0, block_size=BLOCK_SIZE, context=zmq_context
    )
    try:
        with pytest.raises(KvAgentError, match="cannot bind republish endpoint"):
            VllmRepublisher(
                config(endpoint=first.endpoint, replay_endpoint=None),
                dp_rank=0,
                block_size=4,
                context=zmq_context,
            )
    finally:
        first.close()


def test_fanout_sink_publishes_everywhere_and_raises_the_first_failure() -> None:
    class Failing:
        def publish(self, events: Sequence[RouterEvent]) -> None:
            raise RuntimeError("down")

    before, after = RecordingSink(), RecordingSink()
    with pytest.raises(RuntimeError, match="down"):
        FanoutSink(before, Failing(), after).publish([store([1])])
    assert len(before.events) == len(after.events) == 1


# --- replay ---------------------------------------------------------------------------------------------------


async def test_replay_range_is_answered_in_four_frames_then_the_end_marker(
    zmq_context: zmq.Context[Any],
) -> None:
    with trio.fail_after(TIMEOUT):
        async with running(zmq_context) as republisher:
            with socket(zmq_context, zmq.SUB, republisher.endpoint) as sub:
                await republisher.wait_for_subscriber()
                for i in range(5):
                    republisher.publish([store([100 + i])])
                live = {
                    int.from_bytes(f[1], "big"): f[2] for f in [await sub.recv_multipart() for _ in range(5)]
                }
            with socket(zmq_context, zmq.DEALER, republisher.replay_endpoint or "") as dealer:
                replies = await ask(dealer, (2).to_bytes(8, "big"))
                too_new = await ask(dealer, (9).to_bytes(8, "big"))
    assert [r[:2] for r in replies[:-1]] == [[b"", b"kv-events"]] * 3
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [2, 3, 4]
    assert [r[3] for r in replies[:-1]] == [live[2], live[3], live[4]]  # byte-identical to live
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    assert too_new == [[b"", b"", END_SEQ, b""]]


@pytest.mark.parametrize("request_bytes", [(0).to_bytes(8, "big"), b"snapshot"])
async def test_an_evicted_start_or_a_snapshot_request_gets_a_snapshot(
    zmq_context: zmq.Context[Any], request_bytes: bytes
) -> None:
    with trio.fail_after(TIMEOUT):
        async with running(zmq_context, buffer_batches=2) as republisher:
            republisher.publish([store([1, 2, 3])])
            republisher.publish([store([4], parent=3)])
            republisher.publish([remove([2])])  # the mirror keeps 1, 3, 4 (3's parent is gone)
            republisher.publish([store([10, 11])])
            republisher.publish([event(CLEARED), store([20, 21]), store([22], parent=21)])
            republisher.publish([store([23], parent=22)])
            with socket(zmq_context, zmq.DEALER, republisher.replay_endpoint or "") as dealer:
                replies = await ask(dealer, request_bytes)
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    data = replies[:-1]
    # Every frame carries the seq of the last batch the snapshot includes (5): a consumer goes on from 6.
    assert {int.from_bytes(r[2], "big") for r in data} == {5}
    payloads = [r[3] for r in data]
    assert events_of(payloads[0])[0] == {"type": "AllBlocksCleared"}
    assert resident_after(payloads) == {20, 21, 22, 23}
    stores = [e for p in payloads for e in events_of(p) if e["type"] == "BlockStored"]
    assert all(len(e["token_ids"]) == len(e["block_hashes"]) * BLOCK_SIZE for e in stores)
    assert republisher.statistics().state.snapshots_served == 1


async def test_legacy_replay_answers_in_the_three_frame_form(zmq_context: zmq.Context[Any]) -> None:
    with trio.fail_after(TIMEOUT):
        async with running(zmq_context, legacy_replay=True) as republisher:
            republisher.publish([store([1])])
            republisher.publish([store([2])])
            with socket(zmq_context, zmq.DEALER, republisher.replay_endpoint or "") as dealer:
                replies = await ask(dealer, (1).to_bytes(8, "big"))
                malformed = await ask(dealer, b"bad")
    assert len(replies) == 2
    assert replies[0][:2] == [b"", (1).to_bytes(8, "big")] and len(replies[0]) == 3
    assert replies[1] == [b"", END_SEQ, b""]
    assert malformed == [[b"", END_SEQ, b""]]


async def test_malformed_requests_get_only_the_end_marker(zmq_context: zmq.Context[Any]) -> None:
    with trio.fail_after(TIMEOUT):
        async with running(zmq_context) as republisher:
            republisher.publish([store([1])])
            with socket(zmq_context, zmq.DEALER, republisher.replay_endpoint or "") as dealer:
                short = await ask(dealer, b"\x00\x01")
                await dealer.send_multipart([b"", b"x", b"y"])  # one frame too many
                extra = await dealer.recv_multipart()
                good = await ask(dealer, (0).to_bytes(8, "big"))
    assert short == [[b"", b"", END_SEQ, b""]]
    assert extra == [b"", b"", END_SEQ, b""]
    assert len(good) == 2
    statistics = republisher.statistics()
    assert (statistics.malformed_requests, statistics.replay_requests) == (2, 1)


async def test_a_slow_dealer_neither_starves_another_nor_loses_a_frame(zmq_context: zmq.Context[Any]) -> None:
    batches = 3000  # ~9 kB each: far more than the slow DEALER's socket buffers and both HWMs hold
    hashes = list(range(1_000, 2_000))
    with trio.fail_after(60):
        async with running(zmq_context, replay_sndhwm=4) as republisher:
            for _ in range(batches):
                republisher.publish([event(Stored(None, tuple(hashes), tuple(hashes)))])
            endpoint = republisher.replay_endpoint or ""
            with socket(zmq_context, zmq.DEALER, endpoint, RCVHWM=1, RCVBUF=65536) as slow:
                await slow.send_multipart([b"", (0).to_bytes(8, "big")])
                first = await slow.recv_multipart()  # the slow answer is under way, then left unread
                with socket(zmq_context, zmq.DEALER, endpoint) as fast:
                    fast_replies = await ask(fast, (batches - 10).to_bytes(8, "big"))
                assert len(fast_replies) == 11
                assert republisher.statistics().answers_active == 1  # the slow answer waits, not dropped
                rest = [await slow.recv_multipart() for _ in range(batches)]
    seqs = [int.from_bytes(r[2], "big") for r in [first, *rest[:-1]]]
    assert seqs == list(range(batches))
    assert rest[-1] == [b"", b"", END_SEQ, b""]
    statistics = republisher.statistics()
    assert (statistics.answers_completed, statistics.answers_abandoned) == (2, 0)


async def test_an_answer_the_dealer_stops_taking_is_abandoned_after_the_deadline(
    zmq_context: zmq.Context[Any],
) -> None:
    big_tokens = 1 << 24  # 5-byte token ids: ~30 bytes per block, so 300k blocks outgrow every buffer
    with trio.fail_after(60):
        async with running(zmq_context, replay_sndhwm=2, answer_deadline=0.2) as republisher:
            for chunk in range(300):
                hashes = tuple(range(chunk * 1000, (chunk + 1) * 1000))
                stored = Stored(None, hashes, hashes, token_bytes=tokens(1000, big_tokens))
                republisher.publish([event(stored)])
            endpoint = republisher.replay_endpoint or ""
            with socket(zmq_context, zmq.DEALER, endpoint, RCVHWM=1, RCVBUF=65536) as stalled:
                await stalled.send_multipart([b"", b"snapshot"])
                await stalled.send_multipart([b"", (0).to_bytes(8, "big")])  # queued behind it
                await until(lambda: republisher.statistics().answers_abandoned >= 2)
                statistics = republisher.statistics()
                assert statistics.answers_active == 0 and statistics.answers_completed == 0
                # The abandoned snapshot released the mirror: later batches reach it again.
                assert statistics.state.snapshots_open == 0
                republisher.publish([remove([0, 1])])
                assert republisher.statistics().state.resident_blocks == 300_000 - 2
                with socket(zmq_context, zmq.DEALER, endpoint) as other:
                    assert len(await ask(other, (300).to_bytes(8, "big"))) == 2


async def test_requests_beyond_the_queue_bound_get_just_the_end_marker(zmq_context: zmq.Context[Any]) -> None:
    hashes = tuple(range(1_000, 2_000))
    with trio.fail_after(60):
        async with running(zmq_context, replay_sndhwm=2) as republisher:
            for _ in range(1000):  # ~9 MB an answer: the first cannot finish while the DEALER reads nothing
                republisher.publish([event(Stored(None, hashes, hashes))])
            endpoint = republisher.replay_endpoint or ""
            with socket(zmq_context, zmq.DEALER, endpoint, RCVHWM=1, RCVBUF=65536) as dealer:
                for _ in range(6):
                    await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                await until(lambda: republisher.statistics().refused_requests == 2)
                answers: list[int] = []  # data replies per answer
                count = 0
                while len(answers) < 6:
                    frames = await dealer.recv_multipart()
                    if frames[2] == END_SEQ:
                        answers.append(count)
                        count = 0
                    else:
                        count += 1
    assert answers == [1000, 1000, 1000, 1000, 0, 0]
    assert republisher.statistics().answers_completed == 6


# --- a plain consumer, and the slot --------------------------------------------------------------------------


async def test_a_late_consumer_reconstructs_the_state_through_a_snapshot(
    zmq_context: zmq.Context[Any],
) -> None:
    with trio.fail_after(TIMEOUT):
        async with (
            running(zmq_context, buffer_batches=3, topic="") as republisher,
            trio.open_nursery() as nursery,
        ):
            expected: set[int] = set()
            for i in range(20):
                republisher.publish([store([i, 1000 + i], parent=i - 1 if i else None)])
                expected |= {i, 1000 + i}
                if i % 3 == 0:
                    republisher.publish([remove([1000 + i])])
                    expected.discard(1000 + i)
            consumer = VllmStyleConsumer(zmq_context, republisher.endpoint, republisher.replay_endpoint or "")
            await nursery.start(consumer.run)
            await republisher.wait_for_subscriber()
            republisher.publish([store([5000])])
            expected.add(5000)
            await consumer.wait_for_seq(republisher.last_seq or 0)
            assert {block for _, block in consumer.resident} == expected
            assert consumer.snapshot_answers == 1 and consumer.replays[0] == 0
            assert consumer.token_counts_ok and consumer.stores_without_tokens == 0
            nursery.cancel_scope.cancel()


async def test_live_drops_at_the_high_water_mark_are_counted_and_repaired_by_replay(
    zmq_context: zmq.Context[Any],
) -> None:
    hashes = tuple(range(1_000, 2_000))
    with trio.fail_after(60):
        async with running(zmq_context, sndhwm=1, topic="") as republisher, trio.open_nursery() as nursery:
            endpoint, replay_endpoint = republisher.endpoint, republisher.replay_endpoint or ""
            consumer = VllmStyleConsumer(zmq_context, endpoint, replay_endpoint, rcvhwm=1, rcvbuf=65536)
            await nursery.start(consumer.run)
            await republisher.wait_for_subscriber()
            await consumer.joined.wait()  # its first replay (from 0, nothing published yet) is done
            # ~18 MB published without yielding: far more than the consumer's buffers take, so the PUB drops.
            for index in range(2000):
                republisher.publish([event(Stored(None, (index, *hashes), (index, *hashes)))])
            # The burst's tail may be dropped too, and a consumer only notices a gap at the next live batch
            # (as vLLM's does): publish until it has caught up.
            nudges = 0
            while consumer.last_seq != republisher.last_seq:
                republisher.publish([store([5000 + nudges])])
                nudges += 1
                with trio.move_on_after(0.5):
                    await consumer.wait_for_seq(republisher.last_seq or 0)
            assert consumer.hashes() == {*range(2000), *hashes, *range(5000, 5000 + nudges)}
            assert republisher.statistics().dropped_batches > 0
            assert len(consumer.replays) > 1  # the gaps were asked for
            nursery.cancel_scope.cancel()


async def test_a_slot_republishes_one_seq_space_across_detach_and_reattach(
    zmq_context: zmq.Context[Any],
) -> None:
    slot_config = SlotAgentConfig(
        name="s0",
        cache_owner_id=OWNER,
        kv_block_size=32,
        republish=RepublishConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"),
    )
    engines: list[XpubEngine] = []
    try:
        with trio.fail_after(TIMEOUT):
            async with (
                open_slot_agent(slot_config, discovery=MemoryDiscovery(), zmq_context=zmq_context) as agent,
                trio.open_nursery() as nursery,
            ):
                republisher = agent.republisher
                assert republisher is not None
                consumer = VllmStyleConsumer(
                    zmq_context, republisher.endpoint, republisher.replay_endpoint or ""
                )
                await nursery.start(consumer.run)
                await republisher.wait_for_subscriber()
                for worker_id in (17, 18):  # two engine incarnations, one after the other
                    engine = XpubEngine(zmq_context)
                    engines.append(engine)
                    async with trio.open_nursery() as attaching:
                        attaching.start_soon(engine.wait_subscribed)
                        attached = await agent.attach(
                            AttachmentConfig(worker_id=worker_id, dp_rank=0, endpoint=engine.endpoint)
                        )
                    await engine.send_payload(batch([gpu_store([worker_id, worker_id + 100])]), seq=0)
                    await consumer.wait_for_hashes({worker_id, worker_id + 100})
                    await agent.detach(attached.generation)
                    # detach returns once its barrier is published: it is the stream's newest batch.
                    await consumer.wait_for_seq(republisher.last_seq or 0)
                    assert consumer.resident == set()  # the detach barrier is AllBlocksCleared in the stream
                assert consumer.clears >= 4  # attach, detach, attach, detach barriers
                assert consumer.replays == [0]  # one seq space: no gap, no regression
                status = agent.status()
                assert status.republish is not None and status.republish.seq == consumer.last_seq
                assert AgentStatus.from_json(status.to_json()) == status
                statistics = agent.statistics().republish
                assert statistics is not None and statistics.batches_sent == (consumer.last_seq or 0) + 1
                metrics = render_metrics(MetricSources(slots=lambda: [agent])).decode()
                assert f'kvagent_republish_batches_total{{slot="s0"}} {statistics.state.batches}.0' in metrics
                assert 'kvagent_republish_answers_completed_total{slot="s0"} 1.0' in metrics
                nursery.cancel_scope.cancel()
    finally:
        for engine in engines:
            engine.close()
    with pytest.raises(KvAgentError, match="closed"):  # the slot closed its republisher on the way out
        republisher.publish([store([1])])


async def test_a_slot_of_dp_rank_2_binds_offset_endpoints_and_names_its_rank(
    zmq_context: zmq.Context[Any],
) -> None:
    slot_config = SlotAgentConfig(
        name="s2",
        cache_owner_id=OWNER,
        kv_block_size=32,
        dp_rank=2,
        republish=RepublishConfig(endpoint="inproc://republish-test", replay_endpoint="inproc://replay-test"),
    )
    engine = XpubEngine(zmq_context)
    try:
        with trio.fail_after(TIMEOUT):
            async with open_slot_agent(
                slot_config, discovery=MemoryDiscovery(), zmq_context=zmq_context
            ) as agent:
                republisher = agent.republisher
                assert republisher is not None
                assert republisher.endpoint == "inproc://republish-test_dp2"
                assert republisher.replay_endpoint == "inproc://replay-test_dp2"
                with socket(zmq_context, zmq.SUB, republisher.endpoint) as sub:
                    await republisher.wait_for_subscriber()
                    async with trio.open_nursery() as attaching:
                        attaching.start_soon(engine.wait_subscribed)
                        await agent.attach(AttachmentConfig(worker_id=5, dp_rank=2, endpoint=engine.endpoint))
                    await engine.send_payload(batch([gpu_store([77])], rank=2), seq=0)
                    while True:
                        _topic, _seq, payload = await sub.recv_multipart()
                        _ts, events, rank = msgpack.unpackb(payload)
                        assert rank == 2
                        if any(77 in e.get("block_hashes", ()) for e in events):
                            break
    finally:
        engine.close()


# --- consumers that join or rejoin: the resync on subscription ------------------------------------------------


def apply_batch(resident: set[int], payload: bytes) -> None:
    """A consumer without replay applies every live batch it gets, gap or not (as Dynamo's indexer does)."""
    for item in events_of(payload):
        if item["type"] == "BlockStored":
            resident.update(item["block_hashes"])
        elif item["type"] == "BlockRemoved":
            resident.difference_update(item["block_hashes"])
        else:
            resident.clear()


async def follow_until(sub: TrioSocket, resident: set[int], expected: set[int]) -> list[int]:
    """Apply live batches until the consumer's blocks are ``expected``; the seqs applied."""
    seqs: list[int] = []
    while resident != expected:
        _topic, seq, payload = await sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        apply_batch(resident, payload)
    return seqs


async def test_a_consumer_without_replay_rejoining_a_restarted_republisher_converges_to_its_state(
    zmq_context: zmq.Context[Any],
) -> None:
    """kvagent restarts (its republish state restored from the state dir, seqs going on past the lease) and
    publishes its restart batch before the consumer's SUB is back: the rejoining consumer, which has no
    replay endpoint, must still end with exactly the restarted republisher's Worker state."""
    resident: set[int] = set()
    first_process = zmq.Context()  # terminated once the first run ends: its port is free again then
    with trio.fail_after(TIMEOUT):
        async with running(first_process, replay_endpoint=None, topic="") as first:
            endpoint = first.endpoint
            sub = socket(zmq_context, zmq.SUB, endpoint)  # the consumer outlives both runs
            await first.wait_for_subscriber()
            first.publish([store([1, 2, 3])])
            first.publish([store([4], parent=3)])
            await follow_until(sub, resident, {1, 2, 3, 4})
            rows = first.state.mirror_rows()
            persisted = list(rows)
            rows.close()
            next_seq = (first.last_seq or 0) + 1 + 1000  # a restart goes on at the seq lease's end
        first_process.term()
        # kvagent stopped; the consumer keeps its view, and its SUB is away until after the restart.
        with sub:
            sub.socket.disconnect(endpoint)
            async with running(zmq_context, endpoint=endpoint, replay_endpoint=None, topic="") as second:
                second.state.restore(persisted, [], next_seq)
                # The restart's own batch (a reset barrier and the engine's blocks) goes out unseen.
                second.publish([event(CLEARED), store([10, 11]), store([12], parent=11)])
                sub.socket.connect(endpoint)
                await second.wait_for_subscriber()
                second.publish([store([13], parent=12)])
                with trio.fail_after(5):
                    seqs = await follow_until(sub, resident, {10, 11, 12, 13})
                assert resident == {block for _, block, _, _ in second.state.snapshot_blocks()}
                assert min(seqs) > next_seq  # the seq space goes on: nothing looks like a restart


async def test_a_reconnecting_subscriber_costs_one_resync_per_interval_and_others_stay_exact(
    zmq_context: zmq.Context[Any],
) -> None:
    steady_view: set[int] = set()
    with trio.fail_after(TIMEOUT):
        async with running(
            zmq_context, replay_endpoint=None, topic="", resync_interval=3600.0
        ) as republisher:
            with socket(zmq_context, zmq.SUB, republisher.endpoint) as steady:
                await republisher.wait_for_subscriber()
                assert republisher.statistics().state.resyncs == 0  # nothing published yet: nothing to miss
                republisher.publish([store([1, 2])])
                republisher.publish([store([3], parent=2), remove([1])])
                await follow_until(steady, steady_view, {2, 3})
                with socket(zmq_context, zmq.SUB, republisher.endpoint):  # a late joiner
                    await republisher.wait_for_subscriber(2)
                    await until(lambda: republisher.statistics().state.resyncs == 1)
                # The steady subscriber sees the resync too (a PUB cannot address one subscriber): it ends where
                # it was, at the resync's last seq.
                _topic, seq, payload = await steady.recv_multipart()
                assert int.from_bytes(seq, "big") == republisher.last_seq == 2
                assert events_of(payload)[0] == {"type": "AllBlocksCleared"}
                apply_batch(steady_view, payload)
                assert steady_view == {2, 3}
                for reconnect in range(5):  # a consumer reconnecting in a loop
                    with socket(zmq_context, zmq.SUB, republisher.endpoint):
                        await republisher.wait_for_subscriber(3 + reconnect)
                await trio.testing.wait_all_tasks_blocked()
                statistics = republisher.statistics()
                # One resync: the later ones are held back by the bound.
                assert (statistics.state.resyncs, statistics.resync_wanted) == (1, True)
                assert statistics.state.resync_batches == 1
                republisher.publish([store([4], parent=3)])
                await follow_until(steady, steady_view, {2, 3, 4})


def test_the_resync_gate_coalesces_subscriptions_and_spaces_resyncs_by_time_and_bytes() -> None:
    gate = ResyncGate(min_interval=1.0, bytes_per_second=1000.0)
    assert not gate.due(0.0)  # nobody asked
    gate.want()
    gate.want()
    assert gate.due(0.0)
    gate.sent(0.0, size=500)  # 0.5 s of bytes: the interval decides
    assert not gate.due(0.5)
    gate.want()
    assert not gate.due(0.99) and gate.due(1.0)
    gate.sent(1.0, size=5000)  # 5 s of bytes: the byte budget decides
    gate.want()
    assert not gate.due(5.9) and gate.due(6.0)


def test_a_resync_built_a_chunk_at_a_time_while_batches_go_on_ends_at_the_newest_state() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    state.publish([store(range(1, 1201))])  # 1200 blocks: three resync payloads of at most 512
    state.publish([remove([1200])])
    build = state.begin_resync()
    assert not build.encode(1)  # the first payload; the coordinator publishes before the rest is drawn
    state.publish([remove([1199]), store([5000], parent=1198)])
    assert state.statistics().deferred_batches == 1  # the mirror is frozen for the build (persistence waits)
    state.publish([store([5001], parent=5000)])
    batches = state.finish_resync(build)
    assert [seq for seq, _ in batches] == list(range(4, 4 + len(batches)))  # right after the newest batch
    assert len(batches) == 3 + 2  # the state at the cut, then the two batches published while it was built
    expected = {*range(1, 1199), 5000, 5001}
    for held in ({7, 1200}, set(expected), set()):  # stale, in step, empty: every consumer ends exact
        resident = set(held)
        for _, payload in batches:
            apply_batch(resident, payload)
        assert resident == expected
    assert state.mirror_current and state.last_seq == batches[-1][0]
    assert {block for _, block, _, _ in state.snapshot_blocks()} == expected
    statistics = state.statistics()
    assert (statistics.resyncs, statistics.resync_batches, statistics.snapshots_open) == (1, 5, 0)
    answer = state.answer(b"snapshot")  # a replay snapshot taken after the resync includes it
    assert isinstance(answer, SnapshotAnswer) and answer.seq == state.last_seq
    answer.close()


def test_a_resync_build_closed_early_releases_the_mirror() -> None:
    state = RepublishState(dp_rank=0, block_size=BLOCK_SIZE)
    state.publish([store([1, 2])])
    build = state.begin_resync()
    state.publish([remove([2])])
    build.close()  # the republisher was cancelled while encoding
    assert state.mirror_current and {b for _, b, _, _ in state.snapshot_blocks()} == {1}
    with pytest.raises(RuntimeError, match="closed"):
        state.finish_resync(build)
    assert state.finish_resync(state.begin_resync())[0][0] == 2  # a later resync goes on normally


async def test_a_resync_waits_for_an_open_replay_snapshot_then_goes_out(
    zmq_context: zmq.Context[Any],
) -> None:
    big_tokens = 1 << 24  # 5-byte token ids: ~30 bytes per block, so 300k blocks outgrow every buffer
    with trio.fail_after(60):
        async with running(zmq_context, replay_sndhwm=2, answer_deadline=0.5, topic="") as republisher:
            for chunk in range(300):
                hashes = tuple(range(chunk * 1000, (chunk + 1) * 1000))
                stored = Stored(None, hashes, hashes, token_bytes=tokens(1000, big_tokens))
                republisher.publish([event(stored)])
            expected = {block for _, block, _, _ in republisher.state.snapshot_blocks()}
            endpoint = republisher.replay_endpoint or ""
            with socket(zmq_context, zmq.DEALER, endpoint, RCVHWM=1, RCVBUF=65536) as stalled:
                await stalled.send_multipart([b"", b"snapshot"])
                await stalled.recv_multipart()  # the snapshot is streaming and holds the mirror...
                republisher.publish([remove([1000])])  # ...which cannot take this batch yet
                expected.discard(1000)
                with socket(zmq_context, zmq.SUB, republisher.endpoint) as late:
                    await republisher.wait_for_subscriber()
                    await trio.testing.wait_all_tasks_blocked()
                    assert republisher.statistics().state.resyncs == 0  # the resync waits for the mirror...
                    resident: set[int] = set()
                    await follow_until(late, resident, expected)  # ...which the abandoned snapshot frees
            statistics = republisher.statistics()
            assert (statistics.state.resyncs, statistics.answers_abandoned) == (1, 1)


async def test_a_slot_reopened_on_its_state_file_resyncs_a_consumer_that_rejoins_late(tmp_path: Path) -> None:
    """The slot is stopped and opened again on the same state file while its engine restarts; the restarted
    slot publishes its reset and the new engine's blocks before a consumer without replay (a SUB alone) is
    back. That consumer must end with the restarted slot's Worker blocks, not the dead engine's."""
    context: zmq.Context[Any] = zmq.Context()
    engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", block_size=16, context=context)
    config = SlotAgentConfig(
        name="s0",
        cache_owner_id=OWNER,
        kv_block_size=16,
        republish=RepublishConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"),
        state_path=tmp_path / "slots" / "s0.sqlite3",
    )

    async def attach(agent: SlotAgent) -> None:
        async with trio.open_nursery() as attaching:
            attaching.start_soon(engine.wait_for_subscriber)
            await agent.attach(
                AttachmentConfig(
                    worker_id=17,
                    dp_rank=0,
                    endpoint=engine.endpoint,
                    topic="kv-events",
                    replay_endpoint=engine.replay_endpoint,
                )
            )

    async def chain(agent: SlotAgent, first: int, count: int) -> None:
        for block in range(first, first + count):
            parent = block - 1 if block > first else None
            await engine.publish_batch([block_stored([block], parent, [block % 1000] * 16, 16)])
        await wait_for_event(agent, is_store_of(first + count - 1))

    consumer = VllmStyleConsumer(context, "", None)
    try:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                async with open_slot_agent(config, discovery=MemoryDiscovery(), zmq_context=context) as agent:
                    assert agent.republisher is not None
                    consumer.endpoint = agent.republisher.endpoint
                    away = trio.CancelScope()
                    await nursery.start(_consume, consumer, away)
                    await agent.republisher.wait_for_subscriber()
                    await attach(agent)
                    await chain(agent, 1, 30)
                    await consumer.wait_for_hashes(set(range(1, 31)))
                    away.cancel()  # the consumer's SUB is away until the restarted slot has published
                engine.kill()
                await engine.revive(restart=True)  # meanwhile a new engine, with an empty cache
                async with open_slot_agent(config, discovery=MemoryDiscovery(), zmq_context=context) as agent:
                    republisher = agent.republisher
                    assert republisher is not None and republisher.last_seq is not None  # restored
                    await attach(agent)
                    await chain(agent, 500, 10)
                    expected = {block for _, block, _, _ in republisher.state.snapshot_blocks()}
                    assert expected == set(range(500, 510))
                    consumer.endpoint = republisher.endpoint
                    await nursery.start(_consume, consumer, trio.CancelScope())  # the same consumer, back
                    with trio.fail_after(5):
                        await consumer.wait_for_hashes(expected)
                    assert consumer.gaps_unrepaired >= 1  # it missed the restart's batches
                nursery.cancel_scope.cancel()
    finally:
        context.destroy(linger=0)


async def _consume(
    consumer: VllmStyleConsumer,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await consumer.run(task_status=task_status)
