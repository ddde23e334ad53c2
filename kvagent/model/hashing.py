"""LocalBlockHash: XXH3-64 over a block's tokens as u32 little-endian (agent-semantics 2.6)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from kvagent.model.events import U64_MAX

__all__ = ["BASE_SEED", "block_hash_seed", "local_block_hash", "mm_block_hash", "opaque_mm_id"]

BASE_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest


def block_hash_seed(lora_name: str | None, namespace: str | None) -> int:
    """1337, plus xxh3(lora_name, seed 0), plus xxh3(namespace, seed 1), mod 2^64 (empty = absent)."""
    seed = BASE_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode(), 0)) & U64_MAX
    if namespace:
        seed = (seed + _xxh3(namespace.encode(), 1)) & U64_MAX
    return seed


def local_block_hash(tokens: Sequence[int], seed: int = BASE_SEED) -> int:
    return _xxh3(struct.pack(f"<{len(tokens)}I", *tokens), seed)


def mm_block_hash(tokens: Sequence[int], mm_hashes: Sequence[int], seed: int = BASE_SEED) -> int:
    """Multimodal block: tokens as u32-LE followed by each mm_hash as u64-LE, sorted ascending."""
    ordered = sorted(mm_hashes)
    data = struct.pack(f"<{len(tokens)}I", *tokens) + struct.pack(f"<{len(ordered)}Q", *ordered)
    return _xxh3(data, seed)


def opaque_mm_id(identifier: str) -> int:
    """A 64-hex string → its first 16 hex chars as an integer; any other string → xxh3(UTF-8, seed 0)."""
    if len(identifier) == 64 and all(c in "0123456789abcdefABCDEF" for c in identifier):
        return int(identifier[:16], 16)
    return _xxh3(identifier.encode(), 0)
