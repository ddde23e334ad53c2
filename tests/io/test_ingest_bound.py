"""Ingest is bounded in bytes: a flood of 1 MiB batches from another process never grows the agent's RSS.

The publisher is a subprocess (so it floods at full speed on its own core, as an engine would): an XPUB
sending pre-encoded ~1 MiB batches as fast as libzmq takes them for ``KVAGENT_FLOOD_SECONDS`` (default 30).
Each batch stores and removes the same 10,700 blocks, so the index itself stays small and any growth
would be the ingest path's. The agent runs with the default ingress byte budget (64 MiB) and sheds.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

from kvagent import SlotAgentConfig, open_slot_agent
from kvagent.agent.config import AttachmentConfig
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.publish.sinks import NullSink
from kvagent.vllm.listener import ListenerOptions
from tests.support.ids import OWNER

FLOOD_SECONDS = float(os.environ.get("KVAGENT_FLOOD_SECONDS", "30"))
MiB = 1 << 20
BUDGET = ListenerOptions().ingress_bytes
# What RSS may exceed the baseline by, beyond the byte budget: libzmq's receive path (the reader fits RCVHWM
# so that libzmq queues about a quarter of the listener's half, plus the kernel's TCP buffers), the decoded
# batch in flight (its Python objects are several times its msgpack bytes: ~7 MiB for this content), and
# malloc keeping freed 1 MiB buffers in its arenas. Measured: see the line the test prints (-s).
OVERHEAD = 48 * MiB

PUBLISHER = r"""
import sys, time
import msgpack, zmq

seconds = float(sys.argv[1])
blocks = 5_350  # per event: two stores and two removes a batch, each under a chunk's 8,192 blocks
events = []
for part in range(2):
    hashes = list(range((1 << 40) + part * blocks, (1 << 40) + (part + 1) * blocks))
    tokens = [70_000 + (i % 1000) for i in range(blocks * 16)]  # 5 msgpack bytes each
    events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                   "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None})
    events.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})
payloads = [msgpack.packb([float(n), events, 0]) for n in range(4)]
assert all(len(p) >= 1 << 20 for p in payloads), len(payloads[0])
context = zmq.Context()
sock = context.socket(zmq.XPUB)
sock.setsockopt(zmq.SNDHWM, 64)
sock.setsockopt(zmq.LINGER, 0)
sock.bind("tcp://127.0.0.1:0")
print(sock.getsockopt_string(zmq.LAST_ENDPOINT), len(payloads[0]), flush=True)
while sock.recv()[:1] != b"\x01":
    pass
deadline = time.monotonic() + seconds
seq = 0
while time.monotonic() < deadline:
    sock.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payloads[seq % 4]], copy=False)
    seq += 1
print(seq, flush=True)
sock.close(linger=0)
context.term()
"""


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def read_line(stream: trio.abc.ReceiveStream, buffer: bytearray) -> str:
    while b"\n" not in buffer:
        data = await stream.receive_some()
        if not data:
            raise AssertionError(f"the publisher ended early: {bytes(buffer)!r}")
        buffer += data
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line.decode()


@pytest.mark.slow
async def test_a_flood_of_1_mib_batches_keeps_rss_under_the_byte_budget() -> None:
    config = SlotAgentConfig(
        name="s0",
        cache_owner_id=OWNER,
        kv_block_size=16,
        # The recovery ring keeps whole events (here ~10,700 hashes each): keep it small, it is not ingest.
        ring_capacity=16,
        # Shed at once (the default first stops reading for up to 5 s): the bound must hold while shedding.
        listener=ListenerOptions(shed_after=0.0),
    )
    samples: list[int] = []
    publisher = await trio.lowlevel.open_process(
        [sys.executable, "-c", PUBLISHER, str(FLOOD_SECONDS)], stdout=subprocess.PIPE
    )
    try:
        async with open_slot_agent(config, discovery=MemoryDiscovery(), sink=NullSink()) as agent:
            assert publisher.stdout is not None
            buffer = bytearray()
            endpoint, payload_bytes = (await read_line(publisher.stdout, buffer)).split()
            await agent.attach(AttachmentConfig(worker_id=17, dp_rank=0, endpoint=endpoint))
            baseline = rss_bytes()
            async with trio.open_nursery() as nursery:

                async def sample() -> None:
                    while True:
                        samples.append(rss_bytes())
                        if os.environ.get("KVAGENT_FLOOD_DEBUG"):
                            counters = agent.lifecycle.latest_listener_counters
                            inbox = counters.reader.inbox.nbytes if counters and counters.reader else 0
                            held = counters.sync.held_bytes if counters and counters.sync else 0
                            print(f"rss {samples[-1] / MiB:.0f} inbox {inbox / MiB:.0f} held {held / MiB:.0f} coord {agent._coordinator.ingress_bytes / MiB:.0f}")
                        await trio.sleep(0.2)  # sampling, not synchronization

                nursery.start_soon(sample)
                with trio.fail_after(FLOOD_SECONDS + 60):
                    sent = int(await read_line(publisher.stdout, buffer))
                nursery.cancel_scope.cancel()
            stats = agent.statistics().listener
            assert stats is not None
    finally:
        publisher.kill()
        with trio.move_on_after(5, shield=True):
            await publisher.wait()
    peak = max(samples)
    print(
        f"flood: {sent} batches of {int(payload_bytes) / MiB:.2f} MiB sent in {FLOOD_SECONDS:.0f} s, "
        f"{stats.messages} received, {stats.batches} applied, {stats.ingest_sheds} sheds ({stats.ingest_shed_bytes / MiB:.0f} MiB); "
        f"RSS baseline {baseline / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB "
        f"(+{(peak - baseline) / MiB:.0f} MiB; budget {BUDGET / MiB:.0f} MiB + overhead {OVERHEAD / MiB:.0f} MiB)"
    )
    assert stats.batches > 0 and stats.ingest_sheds > 0, "the flood outran the agent and was shed"
    assert sent > stats.messages, "the flood was faster than ingest"
    assert peak <= baseline + BUDGET + OVERHEAD, f"RSS grew by {(peak - baseline) / MiB:.0f} MiB"
