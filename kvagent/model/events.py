"""Value types shared by every layer: tiers, domains, placement events, RouterEvents, and every limit.

Block data is kept as parallel tuples (hashes, local hashes, optional MM infos) instead of one object per
block: the ingest hot path creates one object per event, not one per block.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeAlias

import attrs

from kvagent.model.ids import CacheOwnerId

__all__ = [
    "FLAG_DEAD",
    "FLAG_PARENT",
    "FLAG_ROOT",
    "U32_MAX",
    "U64_MAX",
    "CLEARED",
    "DOMAIN_BY_VALUE",
    "MAX_CHUNK_BLOCKS",
    "MAX_CHUNK_EVENTS",
    "MAX_COALESCED_BLOCKS",
    "MAX_RAW_PAYLOAD_BYTES",
    "Cleared",
    "EventData",
    "EventRoute",
    "IngressChunk",
    "IngressProtocol",
    "MmExtraInfo",
    "MmObject",
    "PlacementEvent",
    "Removed",
    "ResetScope",
    "ResidencyDomain",
    "RouterEvent",
    "SourceSignal",
    "SourceState",
    "StorageTier",
    "StoredExtra",
    "TIER_BY_VALUE",
    "Stored",
    "WorkerWithDpRank",
    "block_count",
    "resident_row_events",
]

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1

MAX_CHUNK_EVENTS = 128
MAX_CHUNK_BLOCKS = 8192
MAX_COALESCED_BLOCKS = 128
MAX_RAW_PAYLOAD_BYTES = 8 * 1024 * 1024

# The flag of each row of a block-store column set, shared by the index's columns and the dumps and stream
# snapshots that carry them as they are (docs/protocol.md, compact tree dumps).
FLAG_ROOT = 0  # a resident block without a parent
FLAG_PARENT = 1  # a resident block whose parent hash is in the parents column
FLAG_DEAD = 2  # a removed block's row (all zeros) or padding: skipped by every reader

if TYPE_CHECKING:
    # What mypy checks: immutable value types, exactly as @attrs.frozen(slots=True).
    from attrs import frozen as _per_event_value
else:

    def _per_event_value(cls: type[Any]) -> type[Any]:
        """@attrs.frozen(slots=True) for the types built once or more per event, without its cost at run time.

        A frozen attrs class sets each field in __init__ through ``object.__setattr__`` (the class's own
        __setattr__ refuses); a plain slotted class stores them directly, about 4x faster to construct
        (issue #18: Stored, PlacementEvent and RouterEvent are built for every event). Equality and the
        hash are the frozen class's; immutability is the type checker's (mypy sees @attrs.frozen): nothing
        assigns a field after construction, and attrs.evolve makes the changed copies.
        """
        return attrs.define(cls, slots=True, frozen=False, unsafe_hash=True, on_setattr=attrs.setters.NO_OP)


KV_STATE_EVENTS_TOPIC = "kv-state-events-v2"
KV_STATE_SOURCES_TOPIC = "kv-state-sources-v2"
KV_STATE_ATTACHMENTS_TOPIC = "kv-state-attachments-v2"


class StorageTier(enum.Enum):
    DEVICE = "device"
    HOST_PINNED = "host_pinned"
    DISK = "disk"
    EXTERNAL = "external"

    # Members are singletons compared by identity; Enum's own __hash__ is a Python-level call, and tiers
    # are hashed in dict keys for every event on the hot path.
    __hash__ = object.__hash__

    @classmethod
    def from_medium(cls, medium: str | None) -> StorageTier | None:
        """Dynamo's ``StorageTier::from_kv_medium``: case-sensitive, ``None`` for an unknown medium."""
        if not medium:
            return cls.DEVICE
        return _MEDIUM_TIERS.get(medium)


_MEDIUM_TIERS = {
    "GPU": StorageTier.DEVICE,
    "DEVICE": StorageTier.DEVICE,
    "CPU": StorageTier.HOST_PINNED,
    "CPU_PINNED": StorageTier.HOST_PINNED,
    "CPU_TIER1": StorageTier.HOST_PINNED,
    "CPU_TIER2": StorageTier.DISK,
    "DISK": StorageTier.DISK,
    "NVME": StorageTier.DISK,
    "STORAGE": StorageTier.DISK,
    "EXTERNAL": StorageTier.EXTERNAL,
    "NETWORK": StorageTier.EXTERNAL,
    "REMOTE": StorageTier.EXTERNAL,
    "SHARED": StorageTier.EXTERNAL,
}


class ResidencyDomain(enum.Enum):
    WORKER = "worker"
    CACHE_OWNER = "cache_owner"

    __hash__ = object.__hash__  # see StorageTier


# Tier and domain by their value (the name every wire and storage format writes); ``.get`` for None on an
# unknown name, where ``StorageTier(value)`` raises.
TIER_BY_VALUE: dict[str, StorageTier] = {tier.value: tier for tier in StorageTier}
DOMAIN_BY_VALUE: dict[str, ResidencyDomain] = {domain.value: domain for domain in ResidencyDomain}


class IngressProtocol(enum.Enum):
    FRAMEWORK_V1 = "framework_v1"
    VLLM_RESIDENCY_V1 = "vllm_residency_v1"


@attrs.frozen(slots=True)
class WorkerWithDpRank:
    """The exact residency owner of Worker-domain events: one data-parallel rank of one worker."""

    worker_id: int
    dp_rank: int


@attrs.frozen(slots=True)
class MmObject:
    """One multimodal object in a block: its hash and the token ranges ``[start, end)`` it covers."""

    mm_hash: int
    offsets: tuple[tuple[int, int], ...]


@attrs.frozen(slots=True)
class MmExtraInfo:
    """A block's multimodal objects (``mm_extra_info`` on the wire)."""

    mm_objects: tuple[MmObject, ...]


@_per_event_value
class Stored:
    """A chain of stored blocks; ``mm_extra_infos`` is ``None`` when no block carries MM info."""

    parent_hash: int | None
    block_hashes: tuple[int, ...]
    tokens_hashes: tuple[int, ...]
    mm_extra_infos: tuple[MmExtraInfo | None, ...] | None = None
    start_position: int | None = None
    # The tokens of exactly ``len(block_hashes)`` blocks, ``block_size`` u32 little-endian tokens a block
    # (EAGLE's overlap token excluded), for republishing in vLLM's format; None where unknown (Dynamo's
    # RouterEvent carries none). Not part of equality: it is a payload, never an identity.
    token_bytes: bytes | None = attrs.field(default=None, eq=False, repr=False)


@_per_event_value
class Removed:
    """Blocks no longer resident; unknown hashes are ignored."""

    block_hashes: tuple[int, ...]


@attrs.frozen(slots=True)
class Cleared:
    # Not a field: a Cleared carries no blocks, and a uniform ``len(data.block_hashes)`` keeps the block
    # counting of chunking and coalescing free of type dispatch.
    block_hashes: ClassVar[tuple[int, ...]] = ()


CLEARED = Cleared()

EventData: TypeAlias = Stored | Removed | Cleared


def block_count(data: EventData) -> int:
    """Blocks of a Stored, hashes of a Removed, 0 for a Cleared (the chunking and coalescing measure)."""
    return len(data.block_hashes)


@_per_event_value
class PlacementEvent:
    """A normalized engine event, before the coordinator gives it an outbound id.

    The exact residency owner is implied by ``domain``: the attached worker for Worker events, the
    agent's CacheOwnerId for CacheOwner events.
    """

    data: EventData
    tier: StorageTier
    domain: ResidencyDomain
    dp_rank: int
    session_id: str | None = None


@_per_event_value
class RouterEvent:
    """One outbound event, field for field Dynamo's ``RouterEvent``."""

    worker_id: int
    storage_tier: StorageTier
    residency_domain: ResidencyDomain
    event_id: int
    data: EventData
    dp_rank: int
    state_source: CacheOwnerId | None = None
    session_id: str | None = None


class EventRoute(NamedTuple):
    """What a RouterEvent carries beside its id and data: the columnar layouts (a ring segment, a stream
    entry) keep it once per distinct value, shared by the events that have it."""

    worker_id: int
    tier: StorageTier
    domain: ResidencyDomain
    dp_rank: int
    state_source: CacheOwnerId | None
    session_id: str | None


def resident_row_events(
    route: EventRoute,
    hashes: Iterable[int],
    parents: Iterable[int],
    tokens: Iterable[int],
    flags: bytes,
    mm: Mapping[int, MmExtraInfo],
    first_id: int,
) -> list[RouterEvent]:
    """The live rows of a resident-state copy (``FLAG_*`` flags) as one-block Stored events, ids from
    ``first_id``: the tree dump and the stream snapshot both read their groups through this."""
    worker_id, tier, domain, dp_rank, source, session = route
    events: list[RouterEvent] = []
    append = events.append
    event_id = first_id
    for row, (block, parent, tokens_hash, flag) in enumerate(zip(hashes, parents, tokens, flags, strict=True)):
        if flag == FLAG_DEAD:
            continue
        info = mm.get(row) if mm else None
        data = Stored(
            parent if flag == FLAG_PARENT else None,
            (block,),
            (tokens_hash,),
            None if info is None else (info,),
        )
        append(RouterEvent(worker_id, tier, domain, event_id, data, dp_rank, source, session))
        event_id += 1
    return events


# (start_position, mm_extra_infos) of a Stored event that has either: the rare Stored fields, which the
# columnar layouts keep aside by event position.
StoredExtra: TypeAlias = tuple[int | None, tuple[MmExtraInfo | None, ...] | None]


@_per_event_value
class IngressChunk:
    """A bounded slice of one raw batch, as the listener hands it to the coordinator."""

    generation: int
    source_cursor: int
    chunk_index: int
    final: bool
    events: tuple[PlacementEvent, ...]
    source_fault: str | None = None
    cache_owner_fault: str | None = None
    raw_bytes: int = 0  # raw payload bytes charged to this chunk (the listener's ingress byte budget)
    # The xxh3 digest of the raw batch's payload (0: unknown): with ``source_cursor`` it is the resume
    # point a restarted agent checks against the engine's replay (issue #17).
    source_digest: int = 0


class SourceState(enum.Enum):
    """How far the attachment's Worker state can be trusted (only READY is ``ready``)."""

    READY = "ready"
    DEGRADED = "degraded"  # history was lost: a reset was published and the state is a subset of the truth
    DISCONNECTED = "disconnected"  # the engine's connection dropped; identity is checked on reconnect


@attrs.frozen(slots=True)
class SourceSignal:
    """A listener verdict about its source, sent in order with the chunks on the ingress channel.

    Handled after every chunk admitted before it: ``reset`` first publishes a Worker reset barrier,
    ``lost_batches`` counts raw batches that can never be applied, ``state`` is the attachment's new source
    state (None: unchanged), and ``quarantine`` ends the attachment after everything before it was applied.
    """

    generation: int
    state: SourceState | None = None
    reset: bool = False
    lost_batches: int = 0
    reason: str = ""
    quarantine: bool = False


@attrs.frozen(slots=True)
class ResetScope:
    """``All`` when ``domain`` is None, else ``Domain(domain)``."""

    domain: ResidencyDomain | None = None

    def to_json(self) -> object:
        return "all" if self.domain is None else {"domain": self.domain.value}


RESET_ALL = ResetScope()


ResidencyOwner: TypeAlias = WorkerWithDpRank | CacheOwnerId
"""Exact residency owner: the worker for Worker-domain residency, the CacheOwnerId for CacheOwner."""


def residency_owner(event: RouterEvent) -> ResidencyOwner | None:
    """The exact owner of an outbound event's residency, or None when a CacheOwner event has no source."""
    if event.residency_domain is ResidencyDomain.WORKER:
        return WorkerWithDpRank(event.worker_id, event.dp_rank)
    return event.state_source
