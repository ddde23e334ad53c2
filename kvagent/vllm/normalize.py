"""Raw vLLM events → placement events (docs/spec/agent-semantics.md §2), plus bounded ingress chunking.

One :class:`AttachmentNormalizer` per attachment holds two residency normalizers — one for Framework
events, one for KVCR events — so learned attention groups and cache namespaces never mix between the two
ownerships. Faults are recorded first-of-each-kind; the rest of the batch always survives.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs
import structlog
from xxhash import xxh3_64_intdigest as xxh3

from kvagent import _native
from kvagent.model.errors import ChunkingError
from kvagent.model.events import (
    CLEARED,
    MAX_CHUNK_BLOCKS,
    MAX_CHUNK_EVENTS,
    MAX_RAW_PAYLOAD_BYTES,
    EventData,
    IngressChunk,
    IngressProtocol,
    MmExtraInfo,
    MmObject,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    StorageTier,
    Stored,
    WorkerWithDpRank,
    block_count,
)
from kvagent.model.hashing import (
    BASE_SEED,
    block_hash_seed,
    local_block_hash,
    local_block_hashes,
    mm_block_hash,
    pack_tokens,
    u32_packer,
)
from kvagent.vllm.decode import (
    RawAllBlocksCleared,
    RawBatch,
    RawBlockRemoved,
    RawBlockStored,
    RawEvent,
    RawIgnored,
    WireDecodeError,
    decode_payload,
)

__all__ = [
    "AttachmentNormalizer",
    "ChunkingError",
    "NormalizedBatch",
    "ResidencyNormalizer",
    "bounded_ingress_chunks",
    "build_ingress_chunks",
    "split_oversized_event",
]

FAULT_UNKNOWN_OWNERSHIP = "unknown raw event ownership"
FAULT_KVCR_ON_FRAMEWORK = "KVCR event on framework-only raw protocol"
FAULT_KVCR_MEDIUM = "KVCR ownership has an unsupported storage medium"
FAULT_KVCR_BLOCK_SIZE = "KVCR block size is incompatible"
FAULT_KVCR_ENRICHMENT = "KVCR event enrichment failed"
FAULT_KVCR_CANONICALIZATION = "KVCR event canonicalization failed"
FAULT_KVCR_TIER = "unsupported KVCR storage medium"

KVCR_MEDIA = frozenset({"CPU", "CPU_PINNED", "STORAGE", "DISK"})
MAIN_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
NON_MAIN_ATTENTION_KINDS = frozenset(
    {
        "sliding_window",
        "sliding_window_mla",
        "mamba",
        "chunked_local_attention",
        "encoder_only_attention",
        "cross_attention",
    }
)
CACHE_SALT_PREFIX = "dynamo-cache-salt:"
MAX_BLOCK_WARNINGS = 3
MM_PAD_BASE = 1_000_000
MM_PAD_MASK = (1 << 30) - 1
log = structlog.get_logger(__name__)
_AMBIGUOUS = object()
_HEX16 = re.compile("[0-9a-fA-F]{16}")


@attrs.define
class NormalizedBatch:
    events: list[PlacementEvent]
    source_fault: str | None = None
    cache_owner_fault: str | None = None
    filtered: dict[str, int] = attrs.Factory(dict)
    unpublished_blocks: int = 0
    # The events' blocks when already counted (the native pass counts them); None: count when chunking.
    blocks: int | None = attrs.field(default=None, eq=False)


def _medium(event: RawEvent) -> str | None:
    medium = None if isinstance(event, RawIgnored) else event.medium
    return medium or None  # Dynamo reads an empty medium as absent


def _mm_hash(entry: object) -> int | None:
    """Dynamo's rule: an MM hash only from a 64-char string of 16 hex digits then 48 zeros."""
    if isinstance(entry, list | tuple) and entry:
        entry = entry[0]
    if (
        isinstance(entry, str)
        and len(entry) == 64
        and entry[16:] == "0" * 48
        and _HEX16.fullmatch(entry, 0, 16)
    ):
        return int(entry[:16], 16)
    return None


def _namespace(event: RawBlockStored) -> str | None:
    if event.cache_salt:
        return event.cache_salt
    extra_keys = event.extra_keys
    if not extra_keys or extra_keys.count(None) == len(extra_keys):  # live GPU stores: [nil, ...]
        return None
    skipped_lora = False
    for keys in extra_keys:
        for entry in keys if isinstance(keys, list | tuple) else (keys,):
            if not isinstance(entry, str):
                continue
            if not skipped_lora and event.lora_name and entry == event.lora_name:
                skipped_lora = True
                continue
            if entry.startswith(CACHE_SALT_PREFIX) and len(entry) > len(CACHE_SALT_PREFIX):
                return entry[len(CACHE_SALT_PREFIX) :]
    return None


class ResidencyNormalizer:
    """Dynamo's ``ZmqEventNormalizer`` for one ownership: preprocessing (2.4) and conversion (2.5)."""

    def __init__(
        self, kv_block_size: int, image_token_id: int | None = None, video_token_id: int | None = None
    ) -> None:
        self.kv_block_size = kv_block_size
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self._groups: dict[tuple[int, int], tuple[str, int | None]] = {}
        self._namespaces: dict[int, object] = {}
        self._seeds: dict[tuple[str | None, str | None], int] = {(None, None): BASE_SEED}
        self.block_warnings = 0

    def preprocess(self, event: RawEvent, dp_rank: int) -> tuple[str | None, str | None]:
        """(rejection reason or None, the cache namespace to hash with)."""
        cls = type(event)
        if cls is RawIgnored:
            return "ignored_event", None
        medium = event.medium or None  # type: ignore[union-attr]  # Dynamo reads an empty medium as absent
        if cls is RawAllBlocksCleared and medium is not None:
            return "ambiguous_scoped_clear", None
        locality = event.locality  # type: ignore[union-attr]
        if locality is not None and locality != "LOCAL":
            return "non_local_locality", None
        if medium is not None:
            tier = StorageTier.from_medium(medium)
            if tier is None:
                return "unknown_medium", None
            if tier is StorageTier.DISK or tier is StorageTier.EXTERNAL:
                return None, None  # hash-only lower tiers: no group learning, filtering or namespaces
        if cls is RawAllBlocksCleared:
            self._namespaces.clear()
            return None, None
        assert isinstance(event, RawBlockStored | RawBlockRemoved)
        reason = self.attention_rejection(event, dp_rank)
        if reason is not None:
            return reason, None
        if isinstance(event, RawBlockRemoved):
            namespaces = self._namespaces
            if namespaces:
                for block_hash in event.block_hashes:
                    if namespaces.get(block_hash, None) is not _AMBIGUOUS:
                        namespaces.pop(block_hash, None)
            return None, None
        return self._propagate_namespace(event)

    @property
    def namespaced(self) -> bool:
        """Whether any block carries a cache namespace (then every store and remove must track it)."""
        return bool(self._namespaces)

    def attention_rejection(self, event: RawBlockStored | RawBlockRemoved, dp_rank: int) -> str | None:
        """Why the event is not main attention (its filter reason), or None; learns a store's group first."""
        kind, group_idx = event.kv_cache_spec_kind, event.group_idx
        if kind and group_idx is not None and isinstance(event, RawBlockStored):
            self._groups[(dp_rank, group_idx)] = (kind, event.kv_cache_spec_sliding_window)
        if kind in MAIN_ATTENTION_KINDS:
            return None
        return self._group_filter(kind, group_idx, dp_rank)

    def _group_filter(self, kind: str | None, group_idx: int | None, dp_rank: int) -> str | None:
        if kind:
            if kind in MAIN_ATTENTION_KINDS:
                return None
            return "non_main_attention_kind" if kind in NON_MAIN_ATTENTION_KINDS else "unknown_kind"
        if group_idx is None:
            return None
        learned = self._groups.get((dp_rank, group_idx))
        if learned is None:
            return None if group_idx == 0 else "unlearned_group_idx"
        if learned[0] in MAIN_ATTENTION_KINDS:
            return None
        return "non_main_attention_group" if learned[0] in NON_MAIN_ATTENTION_KINDS else "unknown_kind"

    def _propagate_namespace(self, event: RawBlockStored) -> tuple[str | None, str | None]:
        own = _namespace(event)
        if own is None and not self._namespaces:
            return None, None  # nothing namespaced yet: the parent is unknown and no entry can change
        parent_state = (
            None if event.parent_block_hash is None else self._namespaces.get(event.parent_block_hash)
        )
        if own is not None:
            namespace = parent_state if isinstance(parent_state, str) else own
        elif parent_state is _AMBIGUOUS:
            return "ambiguous_cache_namespace", None
        elif isinstance(parent_state, str):
            namespace = parent_state
        else:
            for block_hash in event.block_hashes:  # unsalted: existing namespaced entries become ambiguous
                if block_hash in self._namespaces:
                    self._namespaces[block_hash] = _AMBIGUOUS
            return None, None
        for block_hash in event.block_hashes:
            existing = self._namespaces.get(block_hash)
            self._namespaces[block_hash] = namespace if existing in (None, namespace) else _AMBIGUOUS
        return None, namespace

    def _seed(self, lora_name: str | None, namespace: str | None) -> int:
        key = (lora_name or None, namespace or None)
        seed = self._seeds.get(key)
        if seed is None:
            seed = self._seeds[key] = block_hash_seed(*key)
        return seed

    def convert(
        self, event: RawEvent, namespace: str | None, dp_rank: int
    ) -> tuple[EventData, StorageTier, int] | None:
        """(data, tier, unpublished block count), or None when conversion yields nothing."""
        if isinstance(event, RawIgnored):
            return None
        tier = StorageTier.from_medium(_medium(event))
        if tier is None or (event.locality is not None and event.locality != "LOCAL"):
            return None
        if isinstance(event, RawAllBlocksCleared):
            return CLEARED, tier, 0
        if isinstance(event, RawBlockRemoved):
            return Removed(event.block_hashes), tier, 0
        hashes = event.block_hashes
        parent = event.parent_block_hash
        if len(set(hashes)) != len(hashes) or (parent is not None and parent in hashes):
            return Removed(()), tier, 0  # duplicate hash: a no-op that still occupies an event slot
        block_size = self.kv_block_size
        if event.block_size != block_size:
            self._warn_unpublished(len(hashes))
            return Stored(parent, (), (), None), tier, len(hashes)
        tokens = event.token_ids
        extra = 1 if event.is_eagle else 0
        # Blocks whose tokens are all present: block i needs i*block_size + block_size + extra tokens.
        count = min(len(hashes), max(len(tokens) - extra, 0) // block_size) if block_size > 0 else 0
        lora_name = event.lora_name
        seed = BASE_SEED if not lora_name and not namespace else self._seed(lora_name, namespace)
        token_bytes = pack_tokens(tokens)
        # The republished tokens: whole blocks only, without EAGLE's overlap token (a no-copy slice when
        # the event carries exactly its blocks' tokens, the common case).
        plain_tokens = token_bytes[: count * block_size * 4]
        mm_per_block = _mm_hashes_per_block(event.extra_keys, count)
        if mm_per_block is None:  # the common case: plain blocks
            tokens_hashes = local_block_hashes(token_bytes, block_size, count, seed, extra=extra)
            mm_infos: tuple[MmExtraInfo | None, ...] | None = None
        else:
            plain: list[int] = []
            infos: list[MmExtraInfo | None] = []
            for i, mm_hashes in enumerate(mm_per_block):
                if not mm_hashes:
                    plain.extend(local_block_hashes(token_bytes, block_size, 1, seed, extra=extra, first=i))
                    infos.append(None)
                    continue
                block = tokens[i * block_size : (i + 1) * block_size + extra]
                plain.append(self._mm_tokens_hash(block, mm_hashes, seed))
                infos.append(MmExtraInfo(tuple(MmObject(h, ()) for h in mm_hashes)))
            tokens_hashes, mm_infos = tuple(plain), tuple(infos)
        if count < len(hashes):
            self._warn_unpublished(len(hashes) - count)
            stored = Stored(parent, hashes[:count], tokens_hashes, mm_infos, token_bytes=plain_tokens)
            return stored, tier, len(hashes) - count
        return Stored(parent, hashes, tokens_hashes, mm_infos, token_bytes=plain_tokens), tier, 0

    def _warn_unpublished(self, blocks: int) -> None:
        if self.block_warnings < MAX_BLOCK_WARNINGS:
            self.block_warnings += 1
            log.warning("block_not_published", blocks=blocks)

    def _mm_tokens_hash(self, block: Sequence[int], mm_hashes: Sequence[int], seed: int) -> int:
        """LocalBlockHash of a block with MM objects: pad-normalized when configured, else native MM bytes.

        Image pads apply whenever an image token id is configured (2.6), unless only the video token
        appears. kvagent's reading of the "stricter" video variant: video runs are padded only when there
        is exactly one run per MM object; anything else is ambiguous and hashes natively.
        """
        image, video = self.image_token_id, self.video_token_id
        if image is not None and (image in block or video is None or video not in block):
            return local_block_hash(_pad_runs(block, image, mm_hashes), seed)
        if video is not None and _token_runs(block, video) == len(mm_hashes):
            return local_block_hash(_pad_runs(block, video, mm_hashes), seed)
        return mm_block_hash(block, mm_hashes, seed)


def _mm_hashes_per_block(extra_keys: tuple[object, ...] | None, count: int) -> list[list[int]] | None:
    """Each published block's MM hashes (Dynamo's rule), or None when no block carries any."""
    if not extra_keys or extra_keys.count(None) == len(extra_keys):  # live GPU stores: [nil, ...]
        return None
    if not any(isinstance(keys, list | tuple) and keys for keys in extra_keys[:count]):
        return None
    per_block: list[list[int]] = []
    found = False
    for i in range(count):
        keys = extra_keys[i] if i < len(extra_keys) else None
        hashes = (
            [h for h in (_mm_hash(entry) for entry in keys) if h is not None]
            if isinstance(keys, list | tuple)
            else []
        )
        found = found or bool(hashes)
        per_block.append(hashes)
    return per_block if found else None


def _token_runs(block: Sequence[int], token: int) -> int:
    runs, previous = 0, None
    for value in block:
        if value == token and previous != token:
            runs += 1
        previous = value
    return runs


def _pad_runs(block: Sequence[int], token: int, mm_hashes: Sequence[int]) -> list[int]:
    """Each run of ``token`` becomes 1_000_000 + (mm_hash_k & (2^30 - 1)); extra runs reuse the last object."""
    out: list[int] = []
    run = -1
    previous = None
    for value in block:
        if value == token:
            if previous != token:
                run = min(run + 1, len(mm_hashes) - 1)
            out.append(MM_PAD_BASE + (mm_hashes[run] & MM_PAD_MASK))
        else:
            out.append(value)
        previous = value
    return out


class AttachmentNormalizer:
    """Both normalizers of one attachment; ``normalize`` never raises."""

    def __init__(
        self,
        *,
        kv_block_size: int,
        worker: WorkerWithDpRank,
        ingress_protocol: IngressProtocol = IngressProtocol.VLLM_RESIDENCY_V1,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        native: bool | None = None,
    ) -> None:
        """``native``: use the compiled core for plain batches (None: whenever it is available)."""
        if native and _native.core is None:
            raise ValueError(f"the native ingest core is not available: {_native.REASON}")
        self._native = _native.core if (_native.NATIVE if native is None else native) else None
        self.kv_block_size = kv_block_size
        self.worker = worker
        self.ingress_protocol = ingress_protocol
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.framework = ResidencyNormalizer(kv_block_size, image_token_id, video_token_id)
        self.kvcr = ResidencyNormalizer(kv_block_size, image_token_id, video_token_id)

    @property
    def native(self) -> bool:
        """Whether plain batches go through the compiled core."""
        return self._native is not None

    def normalize_payload(
        self, payload: bytes, *, max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES
    ) -> tuple[int, NormalizedBatch | None]:
        """``decode_payload`` then :meth:`normalize`: ``(the batch's dp rank, the normalized batch)``.

        The normalized batch is None, and nothing is learned, when the batch's rank (nil: 0) is not the
        attachment's. Raises WireDecodeError as ``decode_payload`` does. A plain batch (only framework device
        stores and removes that :meth:`normalize` takes inline, no cache namespace known) goes through the
        compiled core in one pass, when there is one; it declines anything else before changing any state.
        """
        if len(payload) > max_payload_bytes:
            raise WireDecodeError(f"ZMQ payload exceeds {max_payload_bytes} bytes")
        native = self._native
        rank = self.worker.dp_rank
        framework = self.framework
        if native is not None and not framework._namespaces and type(payload) is bytes:
            done = native.normalize_payload(payload, self.kv_block_size, rank, framework._groups)
            if done is not None:
                batch_rank, events, blocks, learned = done
                if (batch_rank or 0) != rank:
                    return batch_rank or 0, None
                groups = framework._groups
                for key, value in learned:  # in the batch's order, as normalize() learns them
                    groups[key] = value
                return rank, NormalizedBatch(events, blocks=blocks)
        batch = decode_payload(payload, max_payload_bytes=max_payload_bytes)
        batch_rank = batch.data_parallel_rank or 0
        if batch_rank != rank:
            return batch_rank, None
        return rank, self.normalize(batch)

    def normalize(self, batch: RawBatch) -> NormalizedBatch:
        """Every event through :meth:`normalize_event`, apart from the common shapes, handled right here.

        Framework-owned device stores and removes with no namespace, LoRA or multimodal data are most of
        the traffic; they skip the general preprocessing and conversion (``tests/unit/test_fastpath.py``
        checks that both give the same result and the same learned state).
        """
        out = NormalizedBatch([])
        normalize_event = self.normalize_event
        framework = self.framework
        namespaces = (
            framework._namespaces
        )  # the same dict for the normalizer's life (cleared, never replaced)
        attention_rejection = framework.attention_rejection
        block_size = self.kv_block_size
        block_bytes = 4 * block_size
        rank = self.worker.dp_rank
        filtered = out.filtered
        append = out.events.append
        for event in batch.events:
            if type(event) is RawBlockStored:
                if namespaces or not _is_plain_store(event, block_size):
                    normalize_event(event, out)
                    continue
                if event.group_idx is not None or event.kv_cache_spec_kind:
                    # Only a group or a kind can reject (or teach a group); most batches carry neither.
                    rejection = attention_rejection(event, rank)
                    if rejection is not None:
                        filtered[rejection] = filtered.get(rejection, 0) + 1
                        continue
                hashes = event.block_hashes
                tokens = event.token_ids
                token_bytes = u32_packer(len(tokens)).pack(*tokens)  # pack_tokens, inline
                end = len(hashes) * block_bytes
                # LocalBlockHash of each whole block, as local_block_hashes(token_bytes, block_size, count).
                tokens_hashes = tuple(
                    [xxh3(token_bytes[at : at + block_bytes], BASE_SEED) for at in range(0, end, block_bytes)]
                )
                # Whole blocks only; a slice of the full length is the same object (no copy).
                stored = Stored(event.parent_block_hash, hashes, tokens_hashes, None, None, token_bytes[:end])
                append(PlacementEvent(stored, _DEVICE, _WORKER, rank, event.session_id))
            elif type(event) is RawBlockRemoved:
                if namespaces or not _is_plain_device_event(event):
                    normalize_event(event, out)
                elif (event.group_idx is not None or event.kv_cache_spec_kind) and (
                    rejection := attention_rejection(event, rank)
                ) is not None:
                    filtered[rejection] = filtered.get(rejection, 0) + 1
                else:
                    append(PlacementEvent(Removed(event.block_hashes), _DEVICE, _WORKER, rank, None))
            else:
                normalize_event(event, out)
        return out

    def normalize_event(self, event: RawEvent, out: NormalizedBatch) -> None:
        """Normalize one raw event into ``out`` (an event, a filter count or a first-of-kind fault)."""
        rank = self.worker.dp_rank
        ownership = None if type(event) is RawIgnored else event.ownership  # type: ignore[union-attr]
        if ownership is None:
            normalizer, kvcr = self.framework, False
        elif ownership == "kvcr":
            if self.ingress_protocol is not IngressProtocol.VLLM_RESIDENCY_V1:
                out.source_fault = out.source_fault or FAULT_KVCR_ON_FRAMEWORK
                return
            if not isinstance(event, RawAllBlocksCleared) and _medium(event) not in KVCR_MEDIA:
                out.cache_owner_fault = out.cache_owner_fault or FAULT_KVCR_MEDIUM
                return
            if isinstance(event, RawBlockStored) and event.block_size != self.kv_block_size:
                out.cache_owner_fault = out.cache_owner_fault or FAULT_KVCR_BLOCK_SIZE
                return
            normalizer, kvcr = self.kvcr, True
        else:
            out.source_fault = out.source_fault or FAULT_UNKNOWN_OWNERSHIP
            return
        reason, namespace = normalizer.preprocess(event, rank)
        if reason is not None:
            out.filtered[reason] = out.filtered.get(reason, 0) + 1
            if kvcr:
                log.warning("kvcr_enrichment_failed", reason=reason)
                out.cache_owner_fault = out.cache_owner_fault or FAULT_KVCR_ENRICHMENT
            return
        converted = normalizer.convert(event, namespace, rank)
        if converted is None:
            if kvcr:
                out.cache_owner_fault = out.cache_owner_fault or FAULT_KVCR_CANONICALIZATION
            return
        data, tier, unpublished = converted
        if unpublished:
            out.unpublished_blocks += unpublished
        if kvcr:
            if data is not CLEARED and tier not in (StorageTier.HOST_PINNED, StorageTier.DISK):
                out.cache_owner_fault = out.cache_owner_fault or FAULT_KVCR_TIER
                return
            domain = ResidencyDomain.CACHE_OWNER
        else:
            domain = ResidencyDomain.WORKER
        session = event.session_id if isinstance(event, RawBlockStored) else None
        out.events.append(PlacementEvent(data, tier, domain, rank, session))


_DEVICE_MEDIA = frozenset({"", "GPU", "DEVICE"})
_DEVICE = StorageTier.DEVICE
_WORKER = ResidencyDomain.WORKER


def _is_plain_device_event(event: RawBlockStored | RawBlockRemoved) -> bool:
    medium, locality = event.medium, event.locality
    return (
        event.ownership is None
        and (medium is None or medium in _DEVICE_MEDIA)
        and (locality is None or locality == "LOCAL")
    )


def _is_plain_store(event: RawBlockStored, block_size: int) -> bool:
    """A framework device store of whole blocks with no LoRA, salt, multimodal data or duplicate hash."""
    hashes = event.block_hashes
    count = len(hashes)
    parent = event.parent_block_hash
    extra_keys = event.extra_keys
    return (
        _is_plain_device_event(event)
        and not event.cache_salt
        and not event.lora_name
        and event.block_size == block_size
        and count > 0
        and len(event.token_ids) >= count * block_size
        and (extra_keys is None or extra_keys.count(None) == len(extra_keys))
        and (parent is None or parent not in hashes)
        and len(set(hashes)) == count
    )


def bounded_ingress_chunks(events: Sequence[PlacementEvent]) -> list[tuple[PlacementEvent, ...]]:
    """At most 128 events and 8192 blocks per chunk; an empty list yields exactly one empty chunk.

    An event with more blocks than a chunk holds is split first (:func:`split_oversized_event`), so each
    part fills a chunk of its own; applied in order, the parts change the index exactly as the event would.
    """
    chunks: list[tuple[PlacementEvent, ...]] = []
    current: list[PlacementEvent] = []
    blocks = 0
    for whole in events:
        parts = (whole,) if block_count(whole.data) <= MAX_CHUNK_BLOCKS else split_oversized_event(whole)
        for event in parts:
            size = block_count(event.data)
            if current and (len(current) >= MAX_CHUNK_EVENTS or blocks + size > MAX_CHUNK_BLOCKS):
                chunks.append(tuple(current))
                current, blocks = [], 0
            current.append(event)
            blocks += size
    chunks.append(tuple(current))
    return chunks


def split_oversized_event(
    event: PlacementEvent, max_blocks: int = MAX_CHUNK_BLOCKS
) -> tuple[PlacementEvent, ...]:
    """``event`` as consecutive parts of at most ``max_blocks`` blocks each.

    A Stored chain continues across its parts: each later part's parent is the previous part's last block
    (its ``start_position``, a position of the first block, stays with the first part). A Removed just
    splits its hashes. A Cleared has no blocks and is never split.
    """
    data = event.data
    if block_count(data) <= max_blocks or not isinstance(data, Removed | Stored):
        return (event,)
    if isinstance(data, Removed):
        hashes = data.block_hashes
        return tuple(
            attrs.evolve(event, data=Removed(hashes[start : start + max_blocks]))
            for start in range(0, len(hashes), max_blocks)
        )
    parts: list[PlacementEvent] = []
    parent = data.parent_hash
    token_bytes = data.token_bytes
    # token_bytes holds exactly one block's tokens per hash, so its block width follows from its length.
    width = 0 if token_bytes is None else len(token_bytes) // len(data.block_hashes)
    for start in range(0, len(data.block_hashes), max_blocks):
        end = start + max_blocks
        hashes = data.block_hashes[start:end]
        mm_infos = None if data.mm_extra_infos is None else data.mm_extra_infos[start:end]
        part = Stored(
            parent,
            hashes,
            data.tokens_hashes[start:end],
            mm_infos,
            data.start_position if start == 0 else None,
            None if token_bytes is None else token_bytes[start * width : end * width],
        )
        parts.append(attrs.evolve(event, data=part))
        parent = hashes[-1]
    return tuple(parts)


def build_ingress_chunks(
    generation: int,
    source_cursor: int,
    normalized: NormalizedBatch,
    *,
    raw_bytes: int = 0,
    source_digest: int = 0,
) -> list[IngressChunk]:
    """The batch as chunks in order: every chunk names the batch's ``source_digest``; the final one carries
    its ``raw_bytes`` (the batch's bytes stay charged until its final chunk is handled)."""
    events = normalized.events
    blocks = normalized.blocks
    if blocks is None:
        blocks = sum([len(event.data.block_hashes) for event in events])
    if len(events) <= MAX_CHUNK_EVENTS and blocks <= MAX_CHUNK_BLOCKS:
        # The common case, one chunk: what the general code below builds for it, without its loops.
        return [
            IngressChunk(
                generation,
                source_cursor,
                0,
                True,
                tuple(events),
                normalized.source_fault,
                normalized.cache_owner_fault,
                raw_bytes,
                source_digest,
            )
        ]
    pieces = bounded_ingress_chunks(events)
    if len(pieces) > 1 << 32:
        raise ChunkingError("vLLM batch has too many chunks")
    last = len(pieces) - 1
    return [
        IngressChunk(
            generation,
            source_cursor,
            index,
            index == last,
            events,
            normalized.source_fault if index == 0 else None,
            normalized.cache_owner_fault if index == 0 else None,
            raw_bytes if index == last else 0,
            source_digest,
        )
        for index, events in enumerate(pieces)
    ]
