"""The records a slot's state file keeps besides its events: identity, attachment progress, mirror rows.

Value types only, plus the attachment's bytes (a msgpack array in the ``slot`` row); sans-IO.
"""

from __future__ import annotations

import attrs

from kvagent.model.errors import CodecError
from kvagent.model.events import U64_MAX, StorageTier
from kvagent.persist.codec import pack, unpack

__all__ = [
    "AttachmentProgress",
    "MirrorRow",
    "SlotIdentityRecord",
    "attachment_from_bytes",
    "attachment_to_bytes",
]


@attrs.frozen(slots=True)
class SlotIdentityRecord:
    """What a restarted agent keeps: the slot's name, its publisher id, its CacheOwnerId (canonical text)."""

    slot: str
    publisher_id: int
    cache_owner_id: str


@attrs.frozen(slots=True)
class AttachmentProgress:
    """The engine attachment and how far its stream was applied: ``engine_seq`` is the last applied batch's
    seq and ``digest`` the xxh3 digest of its raw bytes (None before any batch)."""

    worker_id: int
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    generation: int
    engine_seq: int | None
    digest: int | None


@attrs.frozen(slots=True)
class MirrorRow:
    """One block of the republisher's Worker mirror; ``token_bytes`` is None where the tokens are unknown."""

    tier: StorageTier
    block_hash: int
    parent_hash: int | None
    token_bytes: bytes | None


# --- the attachment -----------------------------------------------------------------------------------------


def attachment_to_bytes(progress: AttachmentProgress) -> bytes:
    return pack(attrs.astuple(progress, recurse=False))


def _optional_u64(value: object, what: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise CodecError(f"attachment {what} must be a u64 or nil")
    return value


def attachment_from_bytes(body: bytes) -> AttachmentProgress:
    fields = unpack(body, "attachment")
    if not isinstance(fields, list) or len(fields) != 8:
        raise CodecError("attachment must have 8 fields")
    worker_id, dp_rank, endpoint, replay_endpoint, topic, generation, engine_seq, digest = fields
    for value, what in ((worker_id, "worker_id"), (dp_rank, "dp_rank"), (generation, "generation")):
        if _optional_u64(value, what) is None:
            raise CodecError(f"attachment {what} must be a u64")
    if type(endpoint) is not str or type(topic) is not str:
        raise CodecError("attachment endpoint and topic must be strings")
    if replay_endpoint is not None and type(replay_endpoint) is not str:
        raise CodecError("attachment replay_endpoint must be a string or nil")
    return AttachmentProgress(
        worker_id,
        dp_rank,
        endpoint,
        replay_endpoint,
        topic,
        generation,
        _optional_u64(engine_seq, "engine_seq"),
        _optional_u64(digest, "digest"),
    )
