"""A simulated slot for the fleet benchmark and the stream tests (tests/support/stream_sim.py).

A real RecoveryIndex and StatusCell fed with random outbound events (Worker chains, removes, clears,
CacheOwner residency, multimodal blocks), numbered as the coordinator numbers them, and a StreamWriter
woken for each chunk as the coordinator's sink is.
"""

from __future__ import annotations

import random
import time

import attrs
import trio

from kvagent._util.redis_target import StreamTarget
from kvagent.coordinator.task import StatusCell
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.events import (
    Cleared,
    MmExtraInfo,
    MmObject,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.model.ids import (
    CacheOwnerId,
    CacheSemanticsId,
    DcId,
    IndexerDomainId,
    KvStateAgentIdentity,
    PoolId,
    RoutingScopeId,
    StableDpSlotId,
)
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.stream.reader import StreamFollower
from kvagent.stream.writer import StreamConfig, StreamWriter

__all__ = ["SimulatedSlot", "canonical_state", "run_paced", "run_writers", "slot_owner"]


def slot_owner(number: int) -> CacheOwnerId:
    return CacheOwnerId(
        PoolId(IndexerDomainId(CacheSemanticsId(bytes([1] * 16)), RoutingScopeId(bytes([2] * 16))), DcId(3)),
        StableDpSlotId(number.to_bytes(16, "big")),
    )


@attrs.define
class SimulatedSlot:
    """One slot's outbound side: ``step(n)`` applies n events to the index and wakes the writer."""

    name: str
    number: int
    publisher_id: int
    rng: random.Random
    index: RecoveryIndex
    status: StatusCell
    writer: StreamWriter | None = None
    next_id: int = 1
    chains: list[list[int]] = attrs.Factory(list)
    owner_blocks: list[int] = attrs.Factory(list)

    @classmethod
    def create(
        cls, number: int, config: StreamConfig | None, *, publisher_id: int | None = None, ring: int = 4096
    ) -> SimulatedSlot:
        name = f"slot-{number}"
        publisher = publisher_id if publisher_id is not None else 1000 + number
        identity = KvStateAgentIdentity(slot_owner(number), publisher)
        index = RecoveryIndex(16, ring)
        status = StatusCell(AgentStatus(identity))
        slot = cls(name, number, publisher, random.Random(number), index, status)
        if config is not None:
            slot.writer = StreamWriter(
                config,
                slot=name,
                publisher_id=publisher,
                cache_owner_id=str(identity.cache_owner_id),
                kv_block_size=16,
                ring=index,
                status=status,
            )
        return slot

    @property
    def worker(self) -> WorkerWithDpRank:
        return WorkerWithDpRank(100 + self.number, 0)

    def set_ready(self, generation: int, ready: bool) -> None:
        attachment = AttachmentStatus(generation, self.worker, ready, self.next_id - 1)
        self.status.set(
            attrs.evolve(self.status.get(), attachment=attachment, outbound_cursor=self.next_id - 1)
        )

    def _event(self, data: Stored | Removed | Cleared, *, owner: bool = False) -> RouterEvent:
        event_id, self.next_id = self.next_id, self.next_id + 1
        if owner:
            return RouterEvent(
                self.worker.worker_id,
                StorageTier.HOST_PINNED,
                ResidencyDomain.CACHE_OWNER,
                event_id,
                data,
                0,
                slot_owner(self.number),
            )
        return RouterEvent(
            self.worker.worker_id, StorageTier.DEVICE, ResidencyDomain.WORKER, event_id, data, 0
        )

    def _hash(self) -> int:
        return self.rng.getrandbits(64)

    def make_events(self, count: int) -> list[RouterEvent]:
        rng, events = self.rng, []
        for _ in range(count):
            roll = rng.random()
            if roll < 0.55 or not self.chains:
                blocks = [self._hash() for _ in range(rng.randint(1, 4))]
                chain = rng.choice(self.chains) if self.chains and rng.random() < 0.5 else None
                parent = chain[-1] if chain else None
                mm = None
                if rng.random() < 0.05:
                    mm = tuple(
                        MmExtraInfo((MmObject(self._hash(), ((0, 8),)),)) if i == 0 else None
                        for i in range(len(blocks))
                    )
                events.append(
                    self._event(Stored(parent, tuple(blocks), tuple(self._hash() for _ in blocks), mm))
                )
                if chain is not None:
                    chain.extend(blocks)
                else:
                    self.chains.append(blocks)
            elif roll < 0.85:
                chain = rng.choice(self.chains)
                cut = rng.randint(0, len(chain) - 1)
                removed, chain[cut:] = chain[cut:], []
                if not chain:
                    self.chains.remove(chain)
                events.append(self._event(Removed(tuple(removed))))
            elif roll < 0.97:
                block = self._hash()
                self.owner_blocks.append(block)
                events.append(self._event(Stored(None, (block,), (self._hash(),)), owner=True))
            elif roll < 0.999 and self.owner_blocks:
                events.append(self._event(Removed((self.owner_blocks.pop(),)), owner=True))
            else:
                self.chains.clear()
                events.append(self._event(Cleared()))
        return events

    def step(self, count: int) -> None:
        """Apply ``count`` events (in chunks of at most 128, as the coordinator publishes)."""
        events = self.make_events(count)
        for start in range(0, len(events), 128):
            chunk = events[start : start + 128]
            for event in chunk:
                self.index.apply(event)
            if self.writer is not None:
                self.writer.publish(chunk)

    async def flushed(self) -> None:
        """Wait until the writer has every applied event (and the current status) in the stream."""
        assert self.writer is not None
        await self.writer.wait_written(self.index.current_event_id())


async def run_writers(slots: list[SimulatedSlot], nursery: trio.Nursery) -> None:
    for slot in slots:
        assert slot.writer is not None
        await nursery.start(slot.writer.run)


def canonical_state(index: RecoveryIndex) -> frozenset[tuple[object, ...]]:
    """Every resident block with its route, parent, tokens hash and multimodal info: equal iff same state."""
    state = set()
    for event in index.tree_dump().events:
        data = event.data
        assert isinstance(data, Stored)
        state.add(
            (
                event.worker_id,
                event.storage_tier,
                event.residency_domain,
                event.dp_rank,
                event.state_source,
                data.block_hashes[0],
                data.parent_hash,
                data.tokens_hashes[0],
                None if data.mm_extra_infos is None else data.mm_extra_infos[0],
            )
        )
    return frozenset(state)


async def run_paced(
    slots: list[SimulatedSlot], *, rate: float, seconds: float, tick: float = 0.1, sample: float = 0.02
) -> dict[str, object]:
    """Feed every slot ``rate`` events/s for ``seconds`` (one chunk per slot per ``tick``, as a steady engine's
    coordinator publishes), with the writers running; then wait until every event is written.

    Returned: ``lags`` (seconds from a chunk's publish to the first look, every ``sample`` s, that finds its
    writer past it: a resolution of ``sample``), ``cpu`` (this process's CPU seconds over the paced window,
    worker threads included), ``wall`` and the events applied.
    """
    per_tick = max(1, round(rate * tick))
    pending: list[list[tuple[int, float]]] = [[] for _ in slots]
    lags: list[float] = []
    done = trio.Event()

    async def watch() -> None:
        while not (done.is_set() and not any(pending)):
            now = trio.current_time()
            for slot, waiting in zip(slots, pending, strict=True):
                if not waiting or slot.writer is None:
                    continue
                written = slot.writer.statistics().written_cursor
                while waiting and waiting[0][0] <= written:
                    lags.append(now - waiting.pop(0)[1])
            await trio.sleep(sample)

    async with trio.open_nursery() as nursery:
        for slot in slots:
            if slot.writer is not None:
                await nursery.start(slot.writer.run)
            slot.set_ready(1, ready=True)
        for slot in slots:  # measured from here: every writer connected (its client made, its head written)
            if slot.writer is not None:
                await slot.writer.wait_until(lambda s: s.connected)
        nursery.start_soon(watch)
        cpu0, wall0 = time.process_time(), trio.current_time()
        deadline = wall0 + seconds
        next_tick = wall0
        while next_tick < deadline:
            for slot, waiting in zip(slots, pending, strict=True):
                slot.step(per_tick)
                if slot.writer is not None:
                    waiting.append((slot.index.current_event_id(), trio.current_time()))
            # The engines' pace, not a synchronization; a machine too busy to keep it skips ticks (the rate
            # reached is reported) rather than stretching the window.
            next_tick = max(next_tick + tick, trio.current_time())
            await trio.sleep_until(next_tick)
        cpu = time.process_time() - cpu0
        wall = trio.current_time() - wall0
        done.set()
        for slot in slots:
            if slot.writer is not None:
                await slot.flushed()
        nursery.cancel_scope.cancel()
    events = sum(s.index.current_event_id() for s in slots)
    return {"lags": lags, "cpu": cpu, "wall": wall, "events": events}


async def timed_catch_up(target: StreamTarget, prefix: str) -> tuple[float, StreamFollower]:
    """A cold router replica: every slot under ``prefix`` rebuilt from snapshot and stream; the seconds it took."""
    follower = StreamFollower(target, prefix=prefix)
    started = time.perf_counter()
    await follower.catch_up()
    seconds = time.perf_counter() - started
    await follower.aclose()
    return seconds, follower
