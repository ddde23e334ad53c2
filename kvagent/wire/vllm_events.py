"""kvagent's Worker-domain events in vLLM 0.32.0's ZMQ KV event encoding (docs/spec/vllm-wire.md §1, §5, §6.3).

The structs below mirror vLLM 0.32.0's own ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` declarations field for field, so msgspec writes the same bytes vLLM does: an
``array_like`` envelope ``[ts (float64), events, data_parallel_rank]`` and map-form events with ``"type"``
first, the required fields always present (``nil`` when None) and the optional ones omitted when None
(``tests/unit/test_vllm_events.py`` re-encodes vLLM's own payloads byte for byte).

kvagent republishes only what it keeps: block hashes, the parent, the tokens, the block size and the medium.
LoRA names, extra keys, attention groups and session ids are not part of a RouterEvent and are not
republished.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Generator, Iterable, Sequence
from typing import Any, TypeAlias

import msgspec

from kvagent.model.events import Cleared, ResidencyDomain, RouterEvent, StorageTier, Stored

__all__ = [
    "END_SEQ",
    "SNAPSHOT_REQUEST",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "SnapshotBlock",
    "encode_publication",
    "encode_snapshot_batches",
    "medium_of",
    "token_ids",
]

END_SEQ = b"\xff" * 8
"""The seq frame of a replay answer's end marker (vLLM's ``END_SEQ``)."""
SNAPSHOT_REQUEST = b"snapshot"
"""The replay request that asks for a snapshot (vLLM PR #50134)."""

# --- vLLM 0.32.0's structs ---------------------------------------------------------------------------------
# Class names are the tags (vLLM declares ``KVCacheEvent(omit_defaults=True, tag=True)``), and the field order
# is the declaration order, which msgspec keeps on the wire.


class BlockStored(msgspec.Struct, omit_defaults=True, tag=True, gc=False):
    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: Sequence[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, tag=True, gc=False):
    block_hashes: Sequence[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, tag=True, gc=False):
    pass


VllmEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: Sequence[VllmEvent]
    data_parallel_rank: int | None = None


_encode = msgspec.msgpack.Encoder().encode

# What vLLM (and Dynamo's ``StorageTier::from_kv_medium``) call each tier; ``StorageTier.from_medium`` reads
# every one of these back to the same tier.
_MEDIA = {
    StorageTier.DEVICE: "GPU",
    StorageTier.HOST_PINNED: "CPU",
    StorageTier.DISK: "STORAGE",
    StorageTier.EXTERNAL: "EXTERNAL",
}
_WORKER = ResidencyDomain.WORKER
_CLEARED = AllBlocksCleared()
_LITTLE_ENDIAN = sys.byteorder == "little"

SnapshotBlock: TypeAlias = tuple[StorageTier, int, int | None, bytes | None]
"""One resident block of a snapshot: ``(tier, block_hash, parent_hash, token_bytes)``.

A plain tuple, not a value type: a snapshot streams one per resident block (a million and more).
"""


def medium_of(tier: StorageTier) -> str:
    """The ``medium`` string a tier is republished with."""
    return _MEDIA[tier]


def token_ids(token_bytes: bytes | None) -> Sequence[int]:
    """u32 little-endian token bytes as a list of ints (``[]`` for None: tokens unknown)."""
    if not token_bytes:
        return []
    if _LITTLE_ENDIAN:
        return memoryview(token_bytes).cast("I").tolist()
    return struct.unpack(f"<{len(token_bytes) // 4}I", token_bytes)


def encode_publication(
    events: Sequence[RouterEvent], *, ts: float, dp_rank: int, block_size: int
) -> bytes | None:
    """One ``KVEventBatch`` payload of the Worker-domain events, in order; None when nothing remains.

    Other domains are skipped, and so are stores and removes without blocks (no-ops a consumer must not
    see). A Stored without tokens is written with ``token_ids=[]`` (the caller counts those).
    """
    out: list[VllmEvent] = []
    append = out.append
    for event in events:
        if event.residency_domain is not _WORKER:
            continue
        data = event.data
        if type(data) is Cleared:
            append(_CLEARED)
            continue
        hashes = data.block_hashes
        if not hashes:
            continue
        medium = _MEDIA[event.storage_tier]
        if type(data) is Stored:
            tokens = token_ids(data.token_bytes)
            append(BlockStored(hashes, data.parent_hash, tokens, block_size, None, medium, None))
        else:
            append(BlockRemoved(hashes, medium))
    if not out:
        return None
    return _encode(KVEventBatch(float(ts), out, dp_rank))


def encode_snapshot_batches(
    blocks: Iterable[SnapshotBlock], *, ts: float, dp_rank: int, block_size: int, max_blocks: int = 512
) -> Generator[bytes, None, None]:
    """The payloads of a snapshot: ``AllBlocksCleared`` first, then every block as ``BlockStored``, in order.

    ``blocks`` must come parents first. Consecutive blocks that continue a chain (the next one's parent is
    the previous hash, same tier, tokens known for both or for neither) merge into one ``BlockStored``; a
    payload holds at most ``max_blocks`` blocks, so memory stays bounded however large the snapshot is.
    At least one payload is produced (the clear alone for an empty snapshot).
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
    ts = float(ts)
    events: list[VllmEvent] = [_CLEARED]
    in_payload = 0
    run: list[SnapshotBlock] = []
    last_tier: StorageTier | None = None
    last_hash: int | None = None
    last_known = False
    for block in blocks:
        tier, block_hash, parent, tokens = block
        known = tokens is not None
        # A run continues while each block's parent is the previous block, in the same tier, with tokens
        # known for both or for neither.
        if run and (parent != last_hash or tier is not last_tier or known is not last_known):
            events.append(_stored_run(run, block_size))
            run = []
        run.append(block)
        last_tier, last_hash, last_known = tier, block_hash, known
        in_payload += 1
        if in_payload >= max_blocks:
            events.append(_stored_run(run, block_size))
            yield _encode(KVEventBatch(ts, events, dp_rank))
            events, run, in_payload = [], [], 0
    if run:
        events.append(_stored_run(run, block_size))
    if events:
        yield _encode(KVEventBatch(ts, events, dp_rank))


def _stored_run(run: Sequence[SnapshotBlock], block_size: int) -> BlockStored:
    first = run[0]
    hashes = [block[1] for block in run]
    if first[3] is None:
        tokens: Sequence[int] = []
    elif len(run) == 1:
        tokens = token_ids(first[3])
    else:
        tokens = token_ids(b"".join([block[3] or b"" for block in run]))
    return BlockStored(hashes, first[2], tokens, block_size, None, _MEDIA[first[0]], None)
