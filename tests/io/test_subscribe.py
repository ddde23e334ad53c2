"""Event plane + websocket repair: a subscriber that loses messages on purpose still ends exact."""

from __future__ import annotations

from functools import partial
from typing import Any

import trio
import zmq

from kvagent import SlotAgentConfig, open_slot_agent
from kvagent.agent.host import SlotRegistry
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.events import RouterEvent
from kvagent.publish.zmq_plane import ZmqEventPlane
from kvagent.recovery.client import subscribe
from kvagent.recovery.server import serve_recovery
from kvagent.vllm.listener import ListenerOptions
from tests.support.agent import XpubEngine, attach, batch, gpu_store
from tests.support.ids import OWNER

PUBLISHER = 7


async def test_dropped_event_plane_messages_are_repaired_through_recover() -> None:
    context: zmq.Context[Any] = zmq.Context()
    plane = ZmqEventPlane("tcp://127.0.0.1:0", sndhwm=1, context=context)
    publisher_id = 0x5EED
    sink = plane.sink_for(publisher_id)
    received: list[RouterEvent] = []
    progressed = trio.Event()
    try:
        with trio.fail_after(60):
            # coalesce_window=0: one plane message per batch, so the slow reader behind SNDHWM 1 loses some
            # (read together, the 600 batches can go out in messages few enough that none is dropped).
            config = SlotAgentConfig(
                name="s0",
                cache_owner_id=OWNER,
                kv_block_size=32,
                ring_capacity=8192,
                publisher_id=publisher_id,
                listener=ListenerOptions(coalesce_window=0.0),
            )
            async with (
                open_slot_agent(config, discovery=MemoryDiscovery(), sink=sink, zmq_context=context) as agent,
                trio.open_nursery() as nursery,
            ):
                registry = SlotRegistry()
                registry.add(agent)
                info = await nursery.start(partial(serve_recovery, registry, host="127.0.0.1", port=0))
                engine = XpubEngine(context)
                await attach(agent, engine)
                start_cursor = agent.status().outbound_cursor

                async def consume() -> None:
                    nonlocal progressed
                    async with subscribe(
                        f"ws://127.0.0.1:{info.port}",
                        "s0",
                        plane.last_endpoint,
                        from_cursor=start_cursor,
                        context=context,
                    ) as events:
                        async for event in events:
                            received.append(event)
                            progressed.set()
                            progressed = trio.Event()
                            if len(received) % 50 == 0:
                                await trio.sleep(0.02)  # a deliberately slow reader: the plane's HWM drops

                nursery.start_soon(consume)
                # Slow joiner: probe until the subscriber sees the stream.
                probe = 1 << 40
                while not received:
                    probe += 1
                    await engine.send_payload(batch([gpu_store([probe])]))
                    with trio.move_on_after(0.1):
                        await progressed.wait()
                for i in range(600):
                    await engine.send_payload(batch([gpu_store([i + 1, 100_000 + i])]))
                # Keep nudging until the subscriber has caught up with the agent's cursor.
                while not received or received[-1].event_id < agent.status().outbound_cursor:
                    with trio.move_on_after(0.2):
                        await progressed.wait()
                    if received[-1].event_id < agent.status().outbound_cursor:
                        probe += 1
                        await engine.send_payload(batch([gpu_store([probe])]))
                assert plane.statistics().dropped_messages > 0, "the test must actually lose messages"
                ids = [e.event_id for e in received]
                assert ids == list(range(start_cursor + 1, start_cursor + 1 + len(ids)))
                replica = RecoveryIndex(32, ring_capacity=8192)
                for event in received:
                    replica.apply(event)
                assert replica.resident_blocks() == agent.index.resident_blocks()
                engine.close()
                nursery.cancel_scope.cancel()
    finally:
        plane.close()
        context.destroy(linger=0)
