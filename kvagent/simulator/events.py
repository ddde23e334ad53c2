"""vLLM 0.32.0 KV events for the fake engine: block hashes (§7.1, §7.2), event builders, and the truth.

:class:`ResidentTruth` is what the engine really holds: every event it produced, applied with vLLM's
semantics (one store or remove per physical copy, ``AllBlocksCleared`` empties every tier), whether or not
the batch ever reached a subscriber. Tests compare the agent's dump with it.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from kvagent.model.events import U64_MAX

__all__ = [
    "NONE_HASH",
    "Event",
    "ResidentTruth",
    "all_blocks_cleared",
    "block_removed",
    "block_stored",
    "cbor_encode",
    "chain_block_hash",
    "fold_hash",
    "to_legacy",
]

Event = dict[str, Any] | list[Any]


# --- hashes (docs/spec/vllm-wire.md §7.1, §7.2) -------------------------------------------------------------------


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | info]) + value.to_bytes(size, "big")
    raise ValueError("CBOR integer out of range")


def cbor_encode(value: object) -> bytes:
    """Canonical CBOR for the few types vLLM hashes: ints, bytes, str, None, tuples and lists."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        encoded = value.encode()
        return _cbor_head(3, len(encoded)) + encoded
    if isinstance(value, tuple | list):
        return _cbor_head(4, len(value)) + b"".join(cbor_encode(item) for item in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor_encode(value)).digest()


NONE_HASH = sha256_cbor("vllm-none-hash")


def chain_block_hash(parent_digest: bytes | None, tokens: Sequence[int], extra: object = None) -> bytes:
    """The full 32-byte digest of one block; the chain always uses full parent digests."""
    return sha256_cbor((parent_digest if parent_digest is not None else NONE_HASH, tuple(tokens), extra))


def fold_hash(digest: bytes) -> int:
    """What events carry by default: the low 64 bits of the digest."""
    return int.from_bytes(digest, "big") & U64_MAX


# --- event builders (vLLM 0.32.0 map form, key order of docs/spec/vllm-wire.md §1 / §6.3) -------------------------


def block_stored(
    hashes: Sequence[int | bytes],
    parent: int | bytes | None,
    tokens: Sequence[int],
    block_size: int,
    medium: str | None = "GPU",
    *,
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: Sequence[object] | None = None,
    group_idx: int | None = 0,
    kv_cache_spec_kind: str | None = "full_attention",
    kv_cache_spec_sliding_window: int | None = None,
    locality: str | None = None,
    ownership: str | None = None,
    session_id: str | None = None,
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
        # A list of None is not the default None, so live GPU stores always carry it.
        "extra_keys": list(extra_keys) if extra_keys is not None else [None] * len(hashes),
    }
    optional = {
        "group_idx": group_idx,
        "kv_cache_spec_kind": kv_cache_spec_kind,
        "kv_cache_spec_sliding_window": kv_cache_spec_sliding_window,
        "locality": locality,
        "ownership": ownership,
        "session_id": session_id,
    }
    event.update((key, value) for key, value in optional.items() if value is not None)
    return event


def block_removed(
    hashes: Sequence[int | bytes],
    medium: str | None = "GPU",
    *,
    group_idx: int | None = 0,
    locality: str | None = None,
    ownership: str | None = None,
) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}
    optional = {"group_idx": group_idx, "locality": locality, "ownership": ownership}
    event.update((key, value) for key, value in optional.items() if value is not None)
    return event


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


_LEGACY_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_LEGACY_REMOVED = ("block_hashes", "medium", "group_idx")


def to_legacy(event: Event) -> list[Any]:
    """The positional (array_like, pre-PR #42892) form: tag first, every declared field, full length."""
    if isinstance(event, list):
        return event
    tag = event["type"]
    fields = {"BlockStored": _LEGACY_STORED, "BlockRemoved": _LEGACY_REMOVED}.get(tag, ())
    return [tag, *(event.get(name) for name in fields)]


# --- the truth -------------------------------------------------------------------------------------------

_GPU = "GPU"


def _event_fields(event: Event) -> tuple[str, dict[str, Any]]:
    """(tag, fields) of a map-form or positional event."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    tag = str(event[0]) if event else ""
    names = {"BlockStored": _LEGACY_STORED, "BlockRemoved": _LEGACY_REMOVED}.get(tag, ())
    return tag, dict(zip(names, event[1:], strict=False))


class ResidentTruth:
    """The engine's true residency: physical copies per ``(medium, block hash)``.

    vLLM stores and removes one physical copy at a time (a hash can be cached twice), so a block is resident
    while its count is above zero; ``AllBlocksCleared`` empties every medium. A medium of None is the GPU.
    """

    def __init__(self) -> None:
        self._copies: collections.Counter[tuple[str, object]] = collections.Counter()

    def apply(self, events: Iterable[Event]) -> None:
        copies = self._copies
        for event in events:
            tag, fields = _event_fields(event)
            medium = str(fields.get("medium") or _GPU)
            if tag == "BlockStored":
                for block_hash in fields.get("block_hashes") or ():
                    copies[(medium, block_hash)] += 1
            elif tag == "BlockRemoved":
                for block_hash in fields.get("block_hashes") or ():
                    key = (medium, block_hash)
                    if copies[key] <= 1:
                        copies.pop(key, None)  # a remove of an unknown hash is ignored, as vLLM's pool does
                    else:
                        copies[key] -= 1
            elif tag == "AllBlocksCleared":
                copies.clear()

    def clear(self) -> None:
        self._copies.clear()

    def blocks(self, medium: str = _GPU) -> frozenset[object]:
        """The hashes resident in ``medium`` (at least one physical copy)."""
        return frozenset(
            block_hash for (m, block_hash), count in self._copies.items() if m == medium and count > 0
        )
