"""Chained test blocks with real vLLM-style hashes and their tokens, and vLLM 0.32.0 replay frames."""

from __future__ import annotations

import collections
import random
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvagent.model.hashing import local_block_hash
from kvagent.simulator.engine import (
    all_blocks_cleared,
    block_removed,
    block_stored,
    chain_block_hash,
    fold_hash,
)
from kvagent.wire.vllm_events import END_SEQ

BLOCK_SIZE = 16


@attrs.frozen(slots=True)
class Block:
    hash: int
    digest: bytes
    tokens: tuple[int, ...]
    parent: int | None

    @property
    def tokens_hash(self) -> int:
        """Dynamo's LocalBlockHash of the block (XXH3-64 of u32-LE tokens, seed 1337)."""
        return local_block_hash(self.tokens)


class BlockMaker:
    """Deterministic chains: ``chain(n, after=parent)`` makes n new blocks hashed as vLLM's sha256_cbor does."""

    def __init__(self, seed: int, block_size: int = BLOCK_SIZE) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size

    def chain(self, count: int, *, after: Block | None = None) -> list[Block]:
        blocks: list[Block] = []
        parent = after
        for _ in range(count):
            tokens = tuple(self.rng.randrange(1, 50_000) for _ in range(self.block_size))
            digest = chain_block_hash(parent.digest if parent else None, tokens)
            block = Block(fold_hash(digest), digest, tokens, parent.hash if parent else None)
            blocks.append(block)
            parent = block
        return blocks


def stored(blocks: Sequence[Block], block_size: int = BLOCK_SIZE, medium: str = "GPU") -> dict[str, Any]:
    """One vLLM ``BlockStored`` of a run of chained blocks (its parent is the first block's parent)."""
    tokens = [token for block in blocks for token in block.tokens]
    return block_stored([b.hash for b in blocks], blocks[0].parent, tokens, block_size, medium)


class PrefixClosedWorkload:
    """Engine steps whose GPU residency stays prefix-closed: eviction takes the least recently used *leaf*.

    Requests share system prompts and add fresh user blocks; some blocks are offloaded to the CPU tier (LRU,
    bounded) and now and then the prefix cache is reset. vLLM frees a request's blocks tail first, so its
    evictions mostly take leaves too. Dynamo's tree is prefix-closed (removing a block drops its subtree,
    docs/interop.md), so only such a workload lets Dynamo's index equal the engine's resident set exactly.
    """

    def __init__(
        self,
        seed: int,
        *,
        gpu_capacity: int = 96,
        cpu_capacity: int = 24,
        offload_probability: float = 0.2,
        clear_probability: float = 0.01,
    ) -> None:
        self.rng = random.Random(seed)
        self.maker = BlockMaker(seed)
        self.prompts = [self.maker.chain(self.rng.randint(2, 5)) for _ in range(4)]
        self.gpu: collections.OrderedDict[int, Block] = collections.OrderedDict()  # LRU first
        self.children: collections.Counter[int] = collections.Counter()  # resident GPU children per block
        self.cpu: collections.OrderedDict[int, Block] = collections.OrderedDict()
        self.gpu_capacity = gpu_capacity
        self.cpu_capacity = cpu_capacity
        self.offload_probability = offload_probability
        self.clear_probability = clear_probability

    def next_step(self) -> list[dict[str, Any]]:
        rng = self.rng
        events: list[dict[str, Any]] = []
        if self.gpu and rng.random() < self.clear_probability:
            events.append(all_blocks_cleared())
            self.gpu.clear()
            self.children.clear()
            self.cpu.clear()
        for _ in range(rng.randint(0, 3)):
            self._request(events)
        if self.gpu and rng.random() < self.offload_probability:
            self._offload(events)
        return events

    def _request(self, events: list[dict[str, Any]]) -> None:
        prompt = self.rng.choice(self.prompts)
        chain = [*prompt, *self.maker.chain(self.rng.randint(1, 3), after=prompt[-1])]
        fresh: list[Block] = []
        for block in chain:
            if not fresh and block.hash in self.gpu:
                self.gpu.move_to_end(block.hash)  # a prefix-cache hit: no event
                continue
            fresh.append(block)
            self.gpu[block.hash] = block
            if block.parent is not None:
                self.children[block.parent] += 1
        events.append(stored(fresh))
        protected = {block.hash for block in chain}
        while len(self.gpu) > self.gpu_capacity:
            victim = next(h for h in self.gpu if self.children[h] == 0 and h not in protected)
            evicted = self.gpu.pop(victim)
            if evicted.parent is not None:
                self.children[evicted.parent] -= 1
            events.append(block_removed([victim]))

    def _offload(self, events: list[dict[str, Any]]) -> None:
        candidates = [block for h, block in self.gpu.items() if h not in self.cpu]
        if not candidates:
            return
        block = self.rng.choice(candidates)
        events.append(stored([block], medium="CPU"))
        self.cpu[block.hash] = block
        while len(self.cpu) > self.cpu_capacity:
            victim, _ = self.cpu.popitem(last=False)
            events.append(block_removed([victim], medium="CPU"))


def snapshot_payload_events(blocks: Iterable[Block], *, per_payload: int) -> list[list[dict[str, Any]]]:
    """The events of a #50134-shaped snapshot: ``AllBlocksCleared`` first, then one store per block."""
    payloads: list[list[dict[str, Any]]] = [[all_blocks_cleared()]]
    for block in blocks:
        if len(payloads[-1]) >= per_payload:
            payloads.append([])
        payloads[-1].append(stored([block]))
    return payloads


def replay_frames(topic: bytes, pairs: Iterable[tuple[int, bytes]], *, legacy: bool) -> list[list[bytes]]:
    """A DEALER's view of a replay answer: vLLM >= 0.26's 4-frame form or the legacy 3-frame one."""
    frames = [
        [b"", seq.to_bytes(8, "big"), payload] if legacy else [b"", topic, seq.to_bytes(8, "big"), payload]
        for seq, payload in pairs
    ]
    frames.append([b"", END_SEQ, b""] if legacy else [b"", b"", END_SEQ, b""])
    return frames
