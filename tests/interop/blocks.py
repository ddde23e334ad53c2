"""Chained test blocks with real vLLM-style hashes and their tokens, and vLLM 0.32.0 replay frames."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvagent.model.hashing import local_block_hash
from kvagent.vllm.decode import REPLAY_END_SEQ
from kvagent.vllm.fake_engine import all_blocks_cleared, block_stored, chain_block_hash, fold_hash

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


def stored(blocks: Sequence[Block], block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """One vLLM ``BlockStored`` of a run of chained blocks (its parent is the first block's parent)."""
    tokens = [token for block in blocks for token in block.tokens]
    return block_stored([b.hash for b in blocks], blocks[0].parent, tokens, block_size)


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
    frames.append([b"", REPLAY_END_SEQ, b""] if legacy else [b"", b"", REPLAY_END_SEQ, b""])
    return frames
