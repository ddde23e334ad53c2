"""The outbound ZMQ event plane: real PUB/SUB on loopback."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.agent.config import SlotAgentConfig
from kvagent.agent.host import open_host
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.events import CLEARED, Removed, ResidencyDomain, RouterEvent, StorageTier, Stored
from kvagent.model.ids import derive_cache_owner_id
from kvagent.publish.zmq_plane import PlaneSink, ZmqEventPlane
from kvagent.wire.event_plane import decode_event_plane_message, split_publication
from kvagent.wire.router_event import encode_router_events

GOLDEN_HEX = (
    "9384a9776f726b65725f696407ac73746f726167655f74696572a6646576696365b07265736964656e63795f646f6d61696ea6776f726b6572"
    "a56576656e7483a86576656e745f696401a46461746181a673746f72656483ab706172656e745f68617368cd0100ae73746172745f706f7369"
    "74696f6e10a6626c6f636b739283aa626c6f636b5f68617368cf0123456789abcdefab746f6b656e735f6861736811ad6d6d5f6578747261"
    "5f696e666fc083aa626c6f636b5f686173680cab746f6b656e735f6861736816ad6d6d5f65787472615f696e666fc0a764705f72616e6b00"
    "84a9776f726b65725f696407ac73746f726167655f74696572ab686f73745f70696e6e6564b07265736964656e63795f646f6d61696ea677"
    "6f726b6572a56576656e7483a86576656e745f696402a46461746181a772656d6f76656481ac626c6f636b5f6861736865739201cf012345"
    "6789abcdefa764705f72616e6b0185a9776f726b65725f696407ac73746f726167655f74696572a6646576696365b07265736964656e6379"
    "5f646f6d61696ea6776f726b6572a56576656e7483a86576656e745f696403a464617461a7636c6561726564a764705f72616e6b00aa7365"
    "7373696f6e5f6964a5732d303031"
)


def golden_events() -> list[RouterEvent]:
    return [
        RouterEvent(
            7,
            StorageTier.DEVICE,
            ResidencyDomain.WORKER,
            1,
            Stored(256, (0x0123456789ABCDEF, 12), (17, 22), None, 16),
            0,
        ),
        RouterEvent(
            7, StorageTier.HOST_PINNED, ResidencyDomain.WORKER, 2, Removed((1, 0x0123456789ABCDEF)), 1
        ),
        RouterEvent(7, StorageTier.DEVICE, ResidencyDomain.WORKER, 3, CLEARED, 0, session_id="s-001"),
    ]


def store(event_id: int, block_hash: int, blocks: int = 1) -> RouterEvent:
    hashes = tuple(range(block_hash, block_hash + blocks))
    return RouterEvent(
        9, StorageTier.DEVICE, ResidencyDomain.WORKER, event_id, Stored(None, hashes, hashes), 0
    )


@pytest.fixture
def context() -> Any:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


async def subscriber(context: zmq.Context[Any], plane: ZmqEventPlane, rcvhwm: int = 0) -> TrioSocket:
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(plane.last_endpoint)
    # Slow joiner: once the subscription has reached the XPUB, everything published after reaches the SUB.
    await plane.wait_for_subscriber()
    return TrioSocket(sock)


def test_golden_payload_encoding() -> None:
    assert encode_router_events(golden_events()) == bytes.fromhex(GOLDEN_HEX)
    assert len(bytes.fromhex(GOLDEN_HEX)) == 464


async def test_pub_sends_the_golden_bytes(context: zmq.Context[Any]) -> None:
    plane = ZmqEventPlane("tcp://127.0.0.1:0", context=context)
    with trio.fail_after(10):
        sub = await subscriber(context, plane)
        plane.publish(41, golden_events())
        frames = await sub.recv_multipart()
    assert frames[0] == b"kv-state-events-v2"
    assert int.from_bytes(frames[1], "big") == 41 and int.from_bytes(frames[2], "big") == 1
    assert frames[3] == bytes.fromhex(GOLDEN_HEX)
    assert decode_event_plane_message(frames) == (41, 1, golden_events())
    sub.close()
    plane.close()


async def test_a_slot_sink_names_the_publisher_it_was_built_for(context: zmq.Context[Any]) -> None:
    plane = ZmqEventPlane("tcp://127.0.0.1:0", context=context)
    with trio.fail_after(10):
        sub = await subscriber(context, plane)
        plane.sink_for(41).publish(golden_events())
        plane.sink_for(42).publish([store(9, 90)])
        first, second = await sub.recv_multipart(), await sub.recv_multipart()
    assert decode_event_plane_message(first) == (41, 1, golden_events())
    assert decode_event_plane_message(second)[:2] == (42, 9)
    statistics = plane.statistics()
    assert (statistics.subscriptions, statistics.messages_sent, statistics.events_sent) == (1, 2, 4)
    assert (statistics.dropped_messages, statistics.dropped_events) == (0, 0)
    sub.close()
    plane.close()


def test_split_at_event_and_block_bounds() -> None:
    events = [store(i + 1, i * 10) for i in range(300)]
    assert [len(b) for b in split_publication(events)] == [128, 128, 44]
    big = [store(1, 0, 5000), store(2, 10_000, 5000), store(3, 20_000, 9000), store(4, 40_000, 1)]
    assert [[e.event_id for e in b] for b in split_publication(big)] == [[1], [2], [3], [4]]


async def test_a_subscriber_that_never_reads_never_blocks_publish(context: zmq.Context[Any]) -> None:
    plane = ZmqEventPlane("tcp://127.0.0.1:0", sndhwm=1, context=context)
    stuck = context.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    # A fixed kernel buffer: no receive-window autotuning to absorb the whole burst.
    stuck.setsockopt(zmq.RCVBUF, 65536)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(plane.last_endpoint)
    with trio.fail_after(10):
        await plane.wait_for_subscriber()
    # ~6.5 KiB per message: 4000 of them (26 MB) are far more than the loopback socket buffers hold.
    started = trio.current_time()
    for i in range(4000):
        plane.publish(1, [store(i * 1000 + 1, i * 1000, blocks=150)])
    counters = plane.statistics()
    assert counters.messages_sent + counters.dropped_messages == 4000
    assert counters.dropped_messages > 0 and counters.dropped_events == counters.dropped_messages
    assert counters.messages_sent > 0
    assert trio.current_time() - started < 5, "publish must never wait for the subscriber"
    stuck.close(linger=0)
    plane.close()


def test_without_any_subscriber_publish_is_a_no_op_that_succeeds(context: zmq.Context[Any]) -> None:
    plane = ZmqEventPlane("tcp://127.0.0.1:0", sndhwm=1, context=context)
    for i in range(100):
        plane.publish(1, [store(i + 1, i)])
    statistics = plane.statistics()
    assert statistics.messages_sent == 100 and statistics.dropped_messages == 0
    plane.close()


async def test_subscriber_repairs_dropped_messages_from_the_index(context: zmq.Context[Any]) -> None:
    plane = ZmqEventPlane("tcp://127.0.0.1:0", sndhwm=1, context=context)
    index = RecoveryIndex(16, ring_capacity=4096)
    with trio.fail_after(20):
        sub = await subscriber(context, plane, rcvhwm=1)
        received: dict[int, RouterEvent] = {}
        for i in range(1, 2001):
            event = (
                store(i, 100 * i)
                if i % 7
                else RouterEvent(
                    9, StorageTier.DEVICE, ResidencyDomain.WORKER, i, Removed((100 * (i - 1),)), 0
                )
            )
            index.apply(event)
            plane.publish(5, [event])
            if i % 500 == 0:  # a slow reader: read only now and then
                with trio.move_on_after(0.1):
                    while True:
                        for frames in await sub.recv_multipart_batch():
                            for e in decode_event_plane_message(frames)[2]:
                                received[e.event_id] = e
        assert plane.statistics().dropped_messages > 0
        missing = [i for i in range(1, 2001) if i not in received]
        assert missing
        answer = index.events_in_range(missing[0], None)
        for e in getattr(answer, "events", ()):
            received.setdefault(e.event_id, e)
    replica = RecoveryIndex(16, ring_capacity=4096)
    for event_id in sorted(received):
        replica.apply(received[event_id])
    assert replica.resident_blocks() == index.resident_blocks()
    sub.close()
    plane.close()


async def test_a_hosted_slot_publishes_under_its_own_publisher_id(context: zmq.Context[Any]) -> None:
    plane = ZmqEventPlane("tcp://127.0.0.1:0", context=context)
    sinks: list[PlaneSink] = []

    def sink_factory(config: SlotAgentConfig, publisher_id: int) -> PlaneSink:
        assert config.publisher_id == publisher_id  # the host fixes the id before it builds the sink
        sinks.append(plane.sink_for(publisher_id))
        return sinks[-1]

    config = SlotAgentConfig(
        name="s0", cache_owner_id=derive_cache_owner_id("s0", kv_block_size=32), kv_block_size=32
    )
    with trio.fail_after(10):
        async with open_host(
            discovery=MemoryDiscovery(), sink_factory=sink_factory, zmq_context=context
        ) as host:
            agent = await host.add_slot(config)
            assert [sink.publisher_id for sink in sinks] == [agent.identity.publisher_id]
    plane.close()
