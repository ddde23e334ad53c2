"""The ingest fast path: vLLM batches decoded by msgspec into typed structs and normalized in one loop.

vLLM encodes its events with its own msgspec structs: tagged maps since PR #42892 (0.26.0, 0.32.0, ...),
tagged positional arrays before. Decoding them with msgspec into matching typed structs checks every field
in C (u32 token ids, integer hashes, optional strings) and builds no dict per event, which alone is faster
than a bare ``msgpack.unpackb``. The common shapes — framework-owned device stores and removes with no namespace,
LoRA or multimodal data — are then normalized inline, in one loop per batch with no per-event helper
calls.

The general path (:func:`kvagent.vllm.decode.decode_payload` + ``AttachmentNormalizer.normalize``) stays the
definition of behaviour, and the fast path defers to it:

- a payload msgspec does not accept (positional arrays, ``bytes`` or bigram forms, a malformed field) goes
  to the general decoder, which accepts it or names the failing field;
- an event outside the inlined shapes is converted to its ``Raw*`` form and handed to the general
  per-event normalizer, which shares the attachment's learned state (attention groups, namespaces).

One difference is deliberate: msgspec skips map keys it does not know, with their values, without
decoding them, so invalid UTF-8 inside an unknown key does not fail the batch (``msgpack.unpackb`` decodes
every string and refuses it). ``tests/test_fastpath.py`` checks that both paths otherwise agree, on the
vectors, on generated batches of both forms and on mutated payloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, TypeAlias

import attrs
import msgspec
import xxhash

from kvagent.model.events import (
    MAX_RAW_PAYLOAD_BYTES,
    U32_MAX,
    U64_MAX,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    StorageTier,
    Stored,
)
from kvagent.model.hashing import BASE_SEED
from kvagent.vllm.decode import (
    REPLAY_END_SEQ,
    RawAllBlocksCleared,
    RawBatch,
    RawBlockRemoved,
    RawBlockStored,
    RawEvent,
    RawIgnored,
    RawMessage,
    decode_frames,
    u32_packer,
)
from kvagent.vllm.normalize import (
    MAIN_ATTENTION_KINDS,
    AttachmentNormalizer,
    NormalizedBatch,
)

__all__ = [
    "ArrayBatch",
    "MapBatch",
    "TypedBatch",
    "TypedMessage",
    "decode_live_frames",
    "decode_typed_payload",
    "normalize_typed_batch",
    "to_raw_batch",
]

_U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]


class _StoredFields(msgspec.Struct, frozen=True, gc=False):
    """BlockStored's fields in vLLM's declaration order (the positional form's slots 1..13)."""

    block_hashes: tuple[int, ...]  # decoded straight into the tuple the Stored event keeps
    parent_block_hash: int | None
    token_ids: list[_U32]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _RemovedFields(msgspec.Struct, frozen=True, gc=False):
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


# A map without parent_block_hash is legal but never sent (vllm-wire.md 1: the key is present even when
# nil); msgspec refuses it and the general decoder takes the batch.
class MapBlockStored(_StoredFields, tag="BlockStored", tag_field="type", frozen=True, gc=False):
    session_id: str | None = None
    cache_salt: str | None = None


class MapBlockRemoved(_RemovedFields, tag="BlockRemoved", tag_field="type", frozen=True, gc=False):
    pass


class MapAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", frozen=True, gc=False):
    medium: str | None = None
    ownership: str | None = None
    locality: str | None = None


class MapTierBlocksCleared(msgspec.Struct, tag="TierBlocksCleared", tag_field="type", frozen=True, gc=False):
    pass


class MapIgnored(msgspec.Struct, tag="Ignored", tag_field="type", frozen=True, gc=False):
    pass


MapEvent: TypeAlias = MapBlockStored | MapBlockRemoved | MapAllBlocksCleared | MapTierBlocksCleared | MapIgnored


class MapBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The ``[ts, events, data_parallel_rank]`` envelope; extra trailing elements are ignored (as Dynamo)."""

    ts: float
    events: list[MapEvent]
    data_parallel_rank: _U32 | None = None


# The positional form (vLLM before PR #42892): the tag first, then the fields in declaration order. The
# trailing fields follow Dynamo's 14-slot layout; where an older layout reads them differently the batch is
# declined (see _positional_layout_is_ambiguous).


class ArrayBlockStored(_StoredFields, tag="BlockStored", array_like=True, frozen=True, gc=False):
    # Not on the positional wire; read by the shared normalization loop.
    session_id: ClassVar[None] = None
    cache_salt: ClassVar[None] = None


class ArrayBlockRemoved(_RemovedFields, tag="BlockRemoved", array_like=True, frozen=True, gc=False):
    pass


class ArrayAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, frozen=True, gc=False):
    ownership: str | None = None

    medium: ClassVar[None] = None
    locality: ClassVar[None] = None


class ArrayTierBlocksCleared(msgspec.Struct, tag="TierBlocksCleared", array_like=True, frozen=True, gc=False):
    pass


class ArrayIgnored(msgspec.Struct, tag="Ignored", array_like=True, frozen=True, gc=False):
    pass


ArrayEvent: TypeAlias = (
    ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared | ArrayTierBlocksCleared | ArrayIgnored
)


class ArrayBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: _U32 | None = None


TypedBatch: TypeAlias = MapBatch | ArrayBatch


@attrs.frozen(slots=True)
class TypedMessage:
    topic: bytes
    seq: int
    batch: TypedBatch


_MAP_DECODER = msgspec.msgpack.Decoder(MapBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(ArrayBatch)
_MSGSPEC_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)


def _positional_layout_is_ambiguous(batch: ArrayBatch) -> bool:
    """Whether a store's trailing fields could be an older layout that the general decoder reads differently.

    With fewer than four trailing fields the general decoder takes the integers in order as group_idx then
    sliding window, so ``[nil, kind, window]`` would give group_idx = window there.
    """
    return any(
        type(event) is ArrayBlockStored and event.group_idx is None and event.kv_cache_spec_sliding_window is not None
        for event in batch.events
    )


def decode_typed_payload(payload: bytes) -> TypedBatch | None:
    """The batch if all its events are well typed in one form, maps or arrays; else None (the general path)."""
    batch: TypedBatch
    try:
        batch = _MAP_DECODER.decode(payload)
    except _MSGSPEC_ERRORS:
        try:
            batch = _ARRAY_DECODER.decode(payload)
        except _MSGSPEC_ERRORS:
            return None
        if _positional_layout_is_ambiguous(batch):
            return None
    if type(batch.ts) is not float:  # msgspec reads a msgpack bool as a float; the general path refuses it
        return None
    return batch


def decode_live_frames(
    frames: Sequence[bytes], *, max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES
) -> RawMessage | TypedMessage:
    """:func:`kvagent.vllm.decode.decode_frames`, through the fast decoder when the payload allows it."""
    if len(frames) == 3:
        topic, seq_frame, payload = frames
        if len(seq_frame) == 8 and seq_frame != REPLAY_END_SEQ and len(payload) <= max_payload_bytes:
            batch = decode_typed_payload(payload)
            if batch is not None:
                return TypedMessage(bytes(topic), int.from_bytes(seq_frame, "big"), batch)
    return decode_frames(frames, max_payload_bytes=max_payload_bytes)


# --- normalization -----------------------------------------------------------------------------------

_DEVICE_MEDIA = frozenset({"", "GPU", "DEVICE"})
_xxh3 = xxhash.xxh3_64_intdigest
_DEVICE = StorageTier.DEVICE
_WORKER = ResidencyDomain.WORKER


_STORED = frozenset({MapBlockStored, ArrayBlockStored})
_REMOVED = frozenset({MapBlockRemoved, ArrayBlockRemoved})


def normalize_typed_batch(normalizer: AttachmentNormalizer, batch: TypedBatch) -> NormalizedBatch:
    """``normalizer.normalize(to_raw_batch(batch))``, with the common event shapes inlined."""
    # Both forms share field names (positional stores read None for session_id and cache_salt).
    out = NormalizedBatch([])
    append = out.events.append
    filtered = out.filtered
    # The inlined shapes are framework-owned, so they read and teach the framework normalizer's state.
    framework = normalizer.framework
    groups = framework._groups
    group_filter = framework._group_filter  # (kind, group_idx, rank) -> rejection reason or None
    namespaces = framework._namespaces
    rank = normalizer.worker.dp_rank
    block_size = normalizer.kv_block_size
    stride = 4 * block_size
    device_media = _DEVICE_MEDIA
    main_kinds = MAIN_ATTENTION_KINDS
    xxh3 = _xxh3
    for event in batch.events:
        cls = type(event)
        if cls in _STORED:
            assert isinstance(event, MapBlockStored | ArrayBlockStored)
            hashes = event.block_hashes
            parent = event.parent_block_hash
            tokens = event.token_ids
            extra_keys = event.extra_keys
            count = len(hashes)
            medium = event.medium
            locality = event.locality
            if not (
                event.ownership is None
                and (medium is None or medium in device_media)
                and (locality is None or locality == "LOCAL")
                and not event.cache_salt
                and not event.lora_name
                and not namespaces
                and event.block_size == block_size
                and count
                and len(tokens) >= count * block_size
                and (extra_keys is None or extra_keys.count(None) == len(extra_keys))
                and min(hashes) >= 0
                and (parent is None or (parent >= 0 and parent not in hashes))
                and len(set(hashes)) == count
            ):
                normalizer.normalize_event(_raw_stored(event), out)
                continue
            kind = event.kv_cache_spec_kind
            group_idx = event.group_idx
            if kind and group_idx is not None:
                groups[(rank, group_idx)] = (kind, event.kv_cache_spec_sliding_window)
            if kind not in main_kinds and (rejection := group_filter(kind, group_idx, rank)) is not None:
                filtered[rejection] = filtered.get(rejection, 0) + 1
                continue
            token_bytes = u32_packer(len(tokens)).pack(*tokens)
            tokens_hashes = tuple(
                [xxh3(token_bytes[offset : offset + stride], BASE_SEED) for offset in range(0, count * stride, stride)]
            )
            append(
                PlacementEvent(
                    Stored(parent, hashes, tokens_hashes, None), _DEVICE, _WORKER, rank, event.session_id
                )
            )
        elif cls in _REMOVED:
            assert isinstance(event, MapBlockRemoved | ArrayBlockRemoved)
            hashes = event.block_hashes
            medium = event.medium
            locality = event.locality
            if not (
                event.ownership is None
                and (medium is None or medium in device_media)
                and (locality is None or locality == "LOCAL")
                and not namespaces
                and (not hashes or min(hashes) >= 0)
            ):
                normalizer.normalize_event(_raw_removed(event), out)
                continue
            kind = event.kv_cache_spec_kind
            if kind not in main_kinds and (rejection := group_filter(kind, event.group_idx, rank)) is not None:
                filtered[rejection] = filtered.get(rejection, 0) + 1
                continue
            append(PlacementEvent(Removed(hashes), _DEVICE, _WORKER, rank, None))
        else:
            normalizer.normalize_event(_raw_event(event), out)
    return out


# --- the Raw* forms (for events outside the inlined shapes, and for tests) ------------------------------


def _hashes(values: tuple[int, ...]) -> tuple[int, ...]:
    # Negative hashes (old builtin hashing, LMCache, SGLang) are two's complement u64 (vllm-wire.md 7.1).
    if values and min(values) < 0:
        return tuple(value & U64_MAX for value in values)
    return values


def _raw_stored(event: MapBlockStored | ArrayBlockStored) -> RawBlockStored:
    parent = event.parent_block_hash
    extra_keys = event.extra_keys
    return RawBlockStored(
        _hashes(event.block_hashes),
        None if parent is None else parent & U64_MAX,
        tuple(event.token_ids),
        event.block_size,
        event.lora_id,
        event.medium,
        event.lora_name,
        None if extra_keys is None else tuple(extra_keys),
        event.group_idx,
        event.kv_cache_spec_kind,
        event.kv_cache_spec_sliding_window,
        event.locality,
        event.ownership,
        event.session_id,
        False,
        event.cache_salt,
        u32_packer(len(event.token_ids)).pack(*event.token_ids),
    )


def _raw_removed(event: MapBlockRemoved | ArrayBlockRemoved) -> RawBlockRemoved:
    return RawBlockRemoved(
        _hashes(event.block_hashes),
        event.medium,
        event.group_idx,
        event.kv_cache_spec_kind,
        event.kv_cache_spec_sliding_window,
        event.locality,
        event.ownership,
    )


def _raw_event(event: MapEvent | ArrayEvent) -> RawEvent:
    if isinstance(event, MapBlockStored | ArrayBlockStored):
        return _raw_stored(event)
    if isinstance(event, MapBlockRemoved | ArrayBlockRemoved):
        return _raw_removed(event)
    if isinstance(event, MapAllBlocksCleared | ArrayAllBlocksCleared):
        return RawAllBlocksCleared(event.medium, event.ownership, event.locality)
    if isinstance(event, MapTierBlocksCleared | ArrayTierBlocksCleared):
        return RawIgnored("TierBlocksCleared")
    return RawIgnored("Ignored")


def to_raw_batch(batch: TypedBatch) -> RawBatch:
    """The general decoder's value for the same payload."""
    return RawBatch(batch.ts, tuple(_raw_event(event) for event in batch.events), batch.data_parallel_rank)
