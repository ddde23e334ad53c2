"""Slot-agent test helpers: a vLLM-like XPUB engine, raw vLLM payload builders and a running agent."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import trio
import zmq

from kvagent import AttachmentConfig, SlotAgent, SlotAgentConfig, open_slot_agent
from kvagent._util.zmqtrio import TrioSocket
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC, RouterEvent, Stored
from kvagent.testing import RecordingSink
from tests.support.ids import OWNER

TIMEOUT = 20


class XpubEngine:
    """A vLLM-like publisher on an XPUB socket, so the test knows exactly when the agent has subscribed."""

    def __init__(
        self, context: zmq.Context[Any], topic: bytes = b"kv-events", endpoint: str = "tcp://127.0.0.1:0"
    ) -> None:
        sock = context.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        self.endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.socket = TrioSocket(sock)
        self.topic = topic
        self.seq = 0

    async def wait_subscribed(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if frames and frames[0][:1] == b"\x01":
                return

    async def send_payload(self, payload: bytes, seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        await self.socket.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.socket.send_multipart(frames)

    def close(self) -> None:
        self.socket.close()

    @classmethod
    async def rebind(cls, context: zmq.Context[Any], endpoint: str) -> XpubEngine:
        """A new engine process on the same endpoint (libzmq releases the old port asynchronously)."""
        with trio.fail_after(10):
            while True:
                try:
                    return cls(context, endpoint=endpoint)
                except zmq.ZMQError:
                    await trio.sleep(0.05)


def batch(events: list[dict[str, object]], rank: int = 0) -> bytes:
    payload: bytes = msgpack.packb([1.0, events, rank])
    return payload


def gpu_store(hashes: list[int], parent: int | None = None, block_size: int = 32) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(len(hashes) * block_size)),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def kvcr_store(hashes: list[int], medium: str = "CPU_PINNED", block_size: int = 32) -> dict[str, object]:
    return {
        **gpu_store(hashes, block_size=block_size),
        "medium": medium,
        "locality": "LOCAL",
        "ownership": "kvcr",
    }


async def wait_for_event(agent: SlotAgent, predicate: Callable[[RouterEvent], bool]) -> RouterEvent:
    """Wait until the index applies an event matching ``predicate``."""
    seen: list[RouterEvent] = []
    arrived = trio.Event()

    def on_event(event: RouterEvent) -> None:
        if predicate(event) and not seen:
            seen.append(event)
            arrived.set()

    unsubscribe = agent.index.subscribe(on_event)
    # The event may already have been applied (the sender's checkpoint can let the agent run first):
    # look through the ring buffer too, in the same synchronous step as the subscription.
    oldest = agent.index.oldest_buffered_id()
    if oldest is not None and not seen:
        answer = agent.index.events_in_range(oldest, None)
        for event in getattr(answer, "events", ()):
            on_event(event)
    try:
        await arrived.wait()
    finally:
        unsubscribe()
    return seen[0]


def is_store_of(block_hash: int) -> Callable[[RouterEvent], bool]:
    return lambda e: isinstance(e.data, Stored) and block_hash in e.data.block_hashes


@asynccontextmanager
async def running_agent(
    discovery: MemoryDiscovery | None = None, sink: Any = None, block_size: int = 32
) -> AsyncIterator[tuple[SlotAgent, MemoryDiscovery, Any, zmq.Context[Any]]]:
    discovery = discovery or MemoryDiscovery()
    sink = sink or RecordingSink()
    context: zmq.Context[Any] = zmq.Context()
    config = SlotAgentConfig(name="s0", cache_owner_id=OWNER, kv_block_size=block_size, dp_rank=0)
    try:
        async with open_slot_agent(config, discovery=discovery, sink=sink, zmq_context=context) as agent:
            yield agent, discovery, sink, context
    finally:
        context.destroy(linger=0)


async def attach(agent: SlotAgent, engine: XpubEngine, worker_id: int = 17) -> int:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.wait_subscribed)
        status = await agent.attach(
            AttachmentConfig(worker_id=worker_id, dp_rank=0, endpoint=engine.endpoint)
        )
    return status.generation


def attachment_ads(discovery: MemoryDiscovery) -> list[int]:
    return [record_id for (topic, record_id) in discovery.records if topic == KV_STATE_ATTACHMENTS_TOPIC]


def attachment_ads_of(records: Mapping[tuple[str, int], object]) -> list[int]:
    return [record_id for (topic, record_id) in records if topic == KV_STATE_ATTACHMENTS_TOPIC]
