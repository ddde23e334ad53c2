"""LocalBlockHash: XXH3-64 over a block's tokens as u32 little-endian (docs/spec/agent-semantics.md 2.6).

The only place token ids are packed into bytes and hashed: the decoder validates tokens with
:func:`pack_tokens`, and normalization hashes per-block slices of the same packing.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from kvagent.model.events import U64_MAX

__all__ = [
    "BASE_SEED",
    "block_hash_seed",
    "local_block_hash",
    "local_block_hashes",
    "mm_block_hash",
    "pack_tokens",
    "u32_packer",
]

BASE_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest
# Token counts are few distinct values (blocks x block size), so the cache stays small; it is bounded anyway.
_U32_PACKERS: dict[int, struct.Struct] = {}
_MAX_CACHED_PACKERS = 4096


def u32_packer(count: int) -> struct.Struct:
    """A cached ``struct.Struct`` for ``count`` u32 little-endian values (token ids as LocalBlockHash reads them)."""
    packer = _U32_PACKERS.get(count)
    if packer is None:
        packer = struct.Struct(f"<{count}I")
        if len(_U32_PACKERS) < _MAX_CACHED_PACKERS:
            _U32_PACKERS[count] = packer
    return packer


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian bytes; ``struct.error`` for anything but ints in u32 range (or bools)."""
    return u32_packer(len(tokens)).pack(*tokens)


def block_hash_seed(lora_name: str | None, namespace: str | None) -> int:
    """1337, plus xxh3(lora_name, seed 0), plus xxh3(namespace, seed 1), mod 2^64 (empty = absent)."""
    seed = BASE_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode(), 0)) & U64_MAX
    if namespace:
        seed = (seed + _xxh3(namespace.encode(), 1)) & U64_MAX
    return seed


def local_block_hash(tokens: Sequence[int], seed: int = BASE_SEED) -> int:
    return _xxh3(pack_tokens(tokens), seed)


def local_block_hashes(
    token_bytes: bytes, block_size: int, count: int, seed: int = BASE_SEED, *, extra: int = 0, first: int = 0
) -> tuple[int, ...]:
    """LocalBlockHash of blocks ``first .. first + count - 1`` of packed tokens, one C-level slice + hash each.

    Block i covers ``block_size + extra`` tokens from token ``i * block_size`` (``extra`` is 1 for EAGLE's
    bigram form, whose blocks overlap by one token).
    """
    stride, width = 4 * block_size, 4 * (block_size + extra)
    start = first * stride
    return tuple([_xxh3(token_bytes[offset : offset + width], seed) for offset in range(start, start + count * stride, stride)])


def mm_block_hash(tokens: Sequence[int], mm_hashes: Sequence[int], seed: int = BASE_SEED) -> int:
    """Multimodal block: tokens as u32-LE followed by each mm_hash as u64-LE, sorted ascending."""
    ordered = sorted(mm_hashes)
    data = pack_tokens(tokens) + struct.pack(f"<{len(ordered)}Q", *ordered)
    return _xxh3(data, seed)
