"""A real slot agent attached to a fake vLLM engine over real ZMQ, and what issue #14's tests compare.

``truth`` is what the engine really holds (:class:`~kvagent.simulator.events.ResidentTruth`), ``dump`` the
agent's Worker GPU residency for the attached worker; :meth:`TrustRig.settle` publishes a sentinel batch and
waits until the agent has applied it, so everything published before it has been judged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
import zmq

from kvagent import AttachmentConfig, SlotAgent, SlotAgentConfig, open_slot_agent
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.events import StorageTier, WorkerWithDpRank
from kvagent.simulator.engine import FakeVllmEngine, block_removed, block_stored
from kvagent.testing import RecordingSink
from kvagent.vllm.listener import ListenerCounters, ListenerOptions, ListenerStatistics
from tests.support.agent import is_store_of, wait_for_event
from tests.support.ids import OWNER

__all__ = ["BLOCK", "ChurnWorkload", "TrustRig", "flood", "open_rig", "wait_quiet"]

BLOCK = 16
WORKER_ID = 17
SENTINEL_BASE = 1 << 60
DEFAULT_OPTIONS = ListenerOptions()


class ChurnWorkload:
    """Cheap engine steps: one new block stored, and past ``capacity`` the oldest one removed.

    A stale block (one the engine removed) stays visible in the agent's dump for as long as it wrongly holds it.
    """

    def __init__(self, capacity: int = 300, first_hash: int = 1) -> None:
        self.capacity = capacity
        self.next_hash = first_hash
        self.first_hash = first_hash

    def next_step(self) -> list[dict[str, Any]]:
        block = self.next_hash
        self.next_hash += 1
        events = [block_stored([block], None, [block % 50_000] * BLOCK, BLOCK)]
        if block - self.capacity >= self.first_hash:
            events.append(block_removed([block - self.capacity]))
        return events


class TrustRig:
    """One agent, one engine, one attachment."""

    def __init__(self, agent: SlotAgent, engine: FakeVllmEngine, sink: RecordingSink) -> None:
        self.agent = agent
        self.engine = engine
        self.sink = sink
        self.worker = WorkerWithDpRank(WORKER_ID, 0)
        self.generation = 0
        self.sentinels: list[int] = []

    async def attach(self) -> None:
        engine = self.engine
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.wait_for_subscriber)
            status = await self.agent.attach(
                AttachmentConfig(
                    worker_id=WORKER_ID,
                    dp_rank=0,
                    endpoint=engine.endpoint,
                    topic=engine.topic.decode(),
                    replay_endpoint=engine.replay_endpoint,
                )
            )
        self.generation = status.generation

    # -- what the tests compare -------------------------------------------------------------------------

    @property
    def state(self) -> str:
        attachment = self.agent.status().attachment
        return "detached" if attachment is None else attachment.state

    def dump(self) -> frozenset[object]:
        return frozenset(
            block_hash
            for (owner, tier, block_hash) in self.agent.index.resident_blocks()
            if owner == self.worker and tier is StorageTier.DEVICE
        )

    def truth(self) -> frozenset[object]:
        return self.engine.truth.blocks("GPU")

    @property
    def first_sentinel(self) -> int:
        return self.sentinels[0]

    def worker_resets(self) -> int:
        """Worker reset barriers published for the listener's verdicts (not the attach barrier, not a
        Cleared the engine itself sent with AllBlocksCleared)."""
        return self.agent.statistics().coordinator.source_resets

    def listener_counters(self) -> ListenerCounters:
        """The running listener's live counters (its reader and SourceSync), for waits on them."""
        counters = self.agent.lifecycle.latest_listener_counters
        assert counters is not None
        return counters

    def listener(self) -> ListenerStatistics:
        stats = self.agent.statistics().listener
        assert stats is not None
        return stats

    # -- driving ----------------------------------------------------------------------------------------

    async def publish(self, workload: Any, batches: int, **faults: bool) -> None:
        for _ in range(batches):
            events = workload.next_step()
            if events:
                await self.engine.publish_batch(events, **faults)

    async def settle(self, sentinels: int = 1) -> None:
        """Publish sentinels live and wait until the agent applied the last (and so judged all before it).

        Two when a sentinel may be dropped: without replay, a restart seen as the seq going back is reset
        and the batch that showed it is not applied (it may be a stale late one); the next one is."""
        self.engine.flush_live()
        for _ in range(sentinels):
            sentinel = SENTINEL_BASE + len(self.sentinels)
            self.sentinels.append(sentinel)
            await self.engine.publish_batch([block_stored([sentinel], None, [7] * BLOCK, BLOCK)])
        await wait_for_event(self.agent, is_store_of(sentinel))

    async def wait_state(self, state: str) -> None:
        await self.agent.status_cell.wait_for(
            lambda s: s.attachment is not None and s.attachment.state == state
        )


@asynccontextmanager
async def open_rig(
    options: ListenerOptions = DEFAULT_OPTIONS, *, replay: bool = True, **engine_options: Any
) -> AsyncIterator[TrustRig]:
    """An engine (with a replay socket unless ``replay=False``) and a running agent attached to it."""
    context: zmq.Context[Any] = zmq.Context()
    sink = RecordingSink()
    config = SlotAgentConfig(name="s0", cache_owner_id=OWNER, kv_block_size=BLOCK, dp_rank=0, listener=options)
    try:
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine(
                replay_endpoint="tcp://127.0.0.1:0" if replay else None,
                block_size=BLOCK,
                context=context,
                **engine_options,
            )
            await nursery.start(engine.run)
            async with open_slot_agent(config, discovery=MemoryDiscovery(), sink=sink, zmq_context=context) as agent:
                rig = TrustRig(agent, engine, sink)
                await rig.attach()
                yield rig
            nursery.cancel_scope.cancel()
    finally:
        context.destroy(linger=0)


async def wait_quiet(rig: TrustRig, quiet: float = 0.5, *, cushion: float = 0.2) -> None:
    """Until no live batch has arrived for ``quiet`` seconds and every task has been blocked ``cushion`` s.

    No sentinel on purpose: a batch after the flood would show the gap a shed's re-open left, and the
    case is the one where nothing comes after (the end of a flood).
    """
    reader = rig.listener_counters().reader
    assert reader is not None
    while True:
        with trio.move_on_after(quiet) as quiet_scope:
            await reader.wait_for_live()
        if quiet_scope.cancelled_caught:
            break
    await trio.testing.wait_all_tasks_blocked(cushion=cushion)


async def flood(rig: TrustRig, *, blocks_per_batch: int, batches: int = 600) -> None:
    """Settle, publish ``batches`` batches of ``blocks_per_batch`` new blocks at once, then wait until quiet.

    The flood tests' burst: every batch a new Stored chain (hashes from 1 up), its tokens
    ``blocks_per_batch * BLOCK`` long, so ``blocks_per_batch`` sets the batch's size on the wire.
    """
    await rig.settle()
    steps = []
    for n in range(batches):
        first = blocks_per_batch * n + 1
        hashes = list(range(first, first + blocks_per_batch))
        steps.append([block_stored(hashes, None, [7_000 + n % 40_000] * (blocks_per_batch * BLOCK), BLOCK)])
    rig.engine.publish_burst(steps)
    await wait_quiet(rig)
