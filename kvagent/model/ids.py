"""Slot and cache-owner identity: BLAKE3 digests over framed canonical material, and their text forms.

The exact bytes are documented in ``docs/identity.md``; the test vectors there are pinned by
``tests/unit/test_identity.py``.  Framing follows Dynamo's rules: ``framed(x)`` is a little-endian u32 length
followed by ``x``, explicit maps are written in bytewise-sorted key order, and every material starts with a
versioned domain tag naming both the id kind and its source.
"""

from __future__ import annotations

import enum
import re
import secrets
import struct
from collections.abc import Mapping
from typing import ClassVar, Self

import attrs
import blake3

from kvagent.model.convert import converter, register_object, structure, unstructure
from kvagent.model.errors import IdentityError

__all__ = [
    "MAX_JSON_SAFE_ID",
    "derive_worker_id",
    "CacheOwnerId",
    "CacheSemanticsId",
    "DcId",
    "IdentityError",
    "IdentitySource",
    "IndexerDomainId",
    "KvStateAgentIdentity",
    "PoolId",
    "RoutingScopeId",
    "StableDpSlotId",
    "attachment_record_id",
    "derive_cache_owner_id",
    "new_publisher_id",
    "resolve_stable_dp_slot_id",
    "with_model",
]

MAX_IDENTITY_ENTRIES = 32
MAX_IDENTITY_KEY_BYTES = 128
MAX_IDENTITY_VALUE_BYTES = 1024
MAX_JSON_SAFE_ID = (1 << 53) - 1  # the largest integer JSON readers keep exactly (also a mask)

STABLE_DP_SLOT_TAG = b"kvagent/stable-dp-slot/explicit/v1"
CACHE_SEMANTICS_TAGS = {
    True: b"dynamo/indexer-cache-semantics/explicit/v1",
    False: b"dynamo/indexer-cache-semantics/default/v1",
}
ROUTING_SCOPE_TAGS = {
    True: b"dynamo/indexer-routing-scope/explicit/v1",
    False: b"dynamo/indexer-routing-scope/default/v1",
}
# kvagent defines: the default (non-explicit) material is the single value below, so that a deployment
# that supplies nothing still gets a stable, documented id.
DEFAULT_MATERIAL_VALUES = (b"kvagent-default",)
# kvagent defines: event hash format 1 = XXH3-64 LocalBlockHash over u32-LE tokens (seed 1337).
EVENT_HASH_FORMAT_XXH3_64_U32LE = 1

ATTACHMENT_RECORD_TAG = b"dynamo/kv-state-attachment-record/v2"

# The cache-semantics key the served model's name is written under (kvagent defines; docs/identity.md).
MODEL_KEY = "model"


class IdentitySource(enum.Enum):
    DEFAULT_DERIVED = "default_derived"
    EXPLICIT = "explicit"


def framed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def count(n: int) -> bytes:
    return struct.pack("<I", n)


def explicit_material(entries: Mapping[str, str]) -> bytes:
    """Canonical bytes of an explicit identity map, validating Dynamo's limits."""
    if not 1 <= len(entries) <= MAX_IDENTITY_ENTRIES:
        raise IdentityError(
            f"explicit identity map must have 1 to {MAX_IDENTITY_ENTRIES} entries, got {len(entries)}"
        )
    encoded: list[tuple[bytes, bytes]] = []
    for key, value in entries.items():
        key_bytes, value_bytes = key.encode(), value.encode()
        if not key_bytes or len(key_bytes) > MAX_IDENTITY_KEY_BYTES:
            raise IdentityError(
                f"identity key {key!r} must be 1 to {MAX_IDENTITY_KEY_BYTES} UTF-8 bytes, got {len(key_bytes)}"
            )
        if not value_bytes or len(value_bytes) > MAX_IDENTITY_VALUE_BYTES:
            raise IdentityError(
                f"identity value for {key!r} must be 1 to {MAX_IDENTITY_VALUE_BYTES} UTF-8 bytes, "
                f"got {len(value_bytes)}"
            )
        encoded.append((key_bytes, value_bytes))
    encoded.sort()
    return count(len(encoded)) + b"".join(framed(k) + framed(v) for k, v in encoded)


def default_material(values: tuple[bytes, ...] = DEFAULT_MATERIAL_VALUES) -> bytes:
    return count(len(values)) + b"".join(framed(v) for v in values)


def digest16(material: bytes) -> bytes:
    return blake3.blake3(material).digest()[:16]


def _parse_hex(text: str, nbytes: int, what: str) -> bytes:
    if len(text) != 2 * nbytes or not re.fullmatch(r"[0-9a-f]*", text):
        raise IdentityError(f"{what} must be {2 * nbytes} lowercase hex characters, got {text!r}")
    return bytes.fromhex(text)


def _check_digest(instance: object, attribute: attrs.Attribute[bytes], value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != 16:
        raise IdentityError(f"{attribute.name} must be 16 bytes")


@attrs.frozen(slots=True)
class _DigestId:
    """A 16-byte digest plus the source of its material; equality compares the digest only."""

    _what: ClassVar[str] = "digest id"  # names the id kind in parse errors

    digest: bytes = attrs.field(validator=_check_digest)
    source: IdentitySource = attrs.field(default=IdentitySource.EXPLICIT, eq=False)

    def __str__(self) -> str:
        return self.digest.hex()

    @classmethod
    def parse(cls, text: str) -> Self:
        return cls(_parse_hex(text, 16, cls._what), IdentitySource.EXPLICIT)


@attrs.frozen(slots=True)
class StableDpSlotId(_DigestId):
    _what = "stable DP slot id"


@attrs.frozen(slots=True)
class CacheSemanticsId(_DigestId):
    _what = "cache semantics id"


@attrs.frozen(slots=True)
class RoutingScopeId(_DigestId):
    _what = "routing scope id"


@attrs.frozen(slots=True)
class DcId:
    value: int

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.value < 1 << 64:
            raise IdentityError(f"dc id must be a u64, got {self.value}")

    def __str__(self) -> str:
        return f"{self.value:016x}"

    @classmethod
    def parse(cls, text: str) -> DcId:
        return cls(int.from_bytes(_parse_hex(text, 8, "dc id"), "big"))


@attrs.frozen(slots=True)
class IndexerDomainId:
    cache_semantics: CacheSemanticsId
    routing_scope: RoutingScopeId

    def __str__(self) -> str:
        return f"{self.cache_semantics}:{self.routing_scope}"

    @classmethod
    def parse(cls, text: str) -> IndexerDomainId:
        cache_semantics, sep, routing_scope = text.partition(":")
        if not sep:
            raise IdentityError(f"indexer domain id must be '<32 hex>:<32 hex>', got {text!r}")
        return cls(CacheSemanticsId.parse(cache_semantics), RoutingScopeId.parse(routing_scope))


@attrs.frozen(slots=True)
class PoolId:
    indexer_domain: IndexerDomainId
    dc_id: DcId

    def __str__(self) -> str:
        return f"{self.indexer_domain}/{self.dc_id}"


_CACHE_OWNER_RE = re.compile(r"[0-9a-f]{32}:[0-9a-f]{32}/[0-9a-f]{16}/[0-9a-f]{32}")


@attrs.frozen(slots=True, cache_hash=True)  # hashed per event in index and dedup keys: compute it once
class CacheOwnerId:
    """The stable DP slot within its pool; canonical text ``<32hex>:<32hex>/<16hex>/<32hex>``."""

    pool: PoolId
    slot: StableDpSlotId

    def __str__(self) -> str:
        return f"{self.pool}/{self.slot}"

    @classmethod
    def parse(cls, text: str) -> CacheOwnerId:
        if not isinstance(text, str) or not _CACHE_OWNER_RE.fullmatch(text):
            raise IdentityError(
                f"cache owner id must be '<32 hex>:<32 hex>/<16 hex>/<32 hex>' in lowercase hex, got {text!r}"
            )
        domain_text, dc_text, slot_text = text.split("/")
        pool = PoolId(IndexerDomainId.parse(domain_text), DcId.parse(dc_text))
        return cls(pool, StableDpSlotId.parse(slot_text))


@attrs.frozen(slots=True)
class KvStateAgentIdentity:
    cache_owner_id: CacheOwnerId
    publisher_id: int
    protocol_version: str = "v2"

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = unstructure(self)
        return data

    @classmethod
    def from_json(cls, value: object) -> KvStateAgentIdentity:
        """The inverse of :meth:`to_json` (``protocol_version`` defaults to v2); raises IdentityError."""
        return structure(value, cls, what="identity", error=IdentityError)


# The identity's JSON (kvagent/model/convert.py): a CacheOwnerId is its canonical text.
converter.register_structure_hook(CacheOwnerId, lambda text, _: CacheOwnerId.parse(text))
converter.register_unstructure_hook(CacheOwnerId, str)
register_object(KvStateAgentIdentity, optional=("protocol_version",), what="identity", error=IdentityError)


def stable_dp_slot_material(name: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise IdentityError("slot name must not be empty")
    if len(name.encode()) > MAX_IDENTITY_VALUE_BYTES:
        raise IdentityError(
            f"slot name must be at most {MAX_IDENTITY_VALUE_BYTES} UTF-8 bytes, got {len(name.encode())}"
        )
    return framed(STABLE_DP_SLOT_TAG) + explicit_material({"slot": name})


def resolve_stable_dp_slot_id(name: str) -> StableDpSlotId:
    """The durable slot id for an operator-supplied slot name (independent of worker and publisher)."""
    return StableDpSlotId(digest16(stable_dp_slot_material(name)), IdentitySource.EXPLICIT)


def cache_semantics_material(
    entries: Mapping[str, str] | None, kv_block_size: int, event_hash_format: int
) -> bytes:
    explicit = bool(entries)
    material = explicit_material(entries) if entries else default_material()
    return (
        framed(CACHE_SEMANTICS_TAGS[explicit])
        + material
        + struct.pack("<I", kv_block_size)
        + struct.pack("<H", event_hash_format)
    )


def routing_scope_material(entries: Mapping[str, str] | None) -> bytes:
    explicit = bool(entries)
    material = explicit_material(entries) if entries else default_material()
    return framed(ROUTING_SCOPE_TAGS[explicit]) + material


def _source(explicit: bool) -> IdentitySource:
    return IdentitySource.EXPLICIT if explicit else IdentitySource.DEFAULT_DERIVED


def with_model(cache_semantics: Mapping[str, str] | None, model: str | None) -> Mapping[str, str] | None:
    """The cache-semantics map with the served model as its ``model`` entry (unchanged without a model).

    A ``model`` entry already in the map must name the same model: two spellings of one key would make the
    derived id depend on which of them wins.
    """
    if model is None:
        return cache_semantics
    if not model:
        raise IdentityError("model name must not be empty")
    existing = (cache_semantics or {}).get(MODEL_KEY)
    if existing is not None and existing != model:
        raise IdentityError(f"cache semantics say model {existing!r} but the slot serves model {model!r}")
    return {**(cache_semantics or {}), MODEL_KEY: model}


def derive_cache_owner_id(
    slot_name: str,
    *,
    kv_block_size: int,
    cache_semantics: Mapping[str, str] | None = None,
    routing_scope: Mapping[str, str] | None = None,
    dc_id: int = 0,
    event_hash_format: int = EVENT_HASH_FORMAT_XXH3_64_U32LE,
    model: str | None = None,
) -> CacheOwnerId:
    """Derive a full CacheOwnerId from a slot name and optional explicit pool material.

    ``model`` (the served model's name) is explicit cache-semantics material (``{"model": NAME}``), so the
    same slot name serving two models gives two ids; without it the id is what it always was.
    """
    if kv_block_size <= 0:
        raise IdentityError("kv_block_size cannot be zero")
    cache_semantics = with_model(cache_semantics, model)
    semantics = CacheSemanticsId(
        digest16(cache_semantics_material(cache_semantics, kv_block_size, event_hash_format)),
        _source(bool(cache_semantics)),
    )
    scope = RoutingScopeId(digest16(routing_scope_material(routing_scope)), _source(bool(routing_scope)))
    pool = PoolId(IndexerDomainId(semantics, scope), DcId(dc_id))
    return CacheOwnerId(pool, resolve_stable_dp_slot_id(slot_name))


def derive_worker_id(slot: str, endpoint: str) -> int:
    """A stable default worker id for an engine attached from the command line (JSON-safe, never 0)."""
    digest = blake3.blake3(f"kvagent/worker/{slot}@{endpoint}".encode()).digest()
    return int.from_bytes(digest[:6], "big") or 1


def _record_id(tag: bytes, *values: int) -> int:
    digest = blake3.blake3(tag + b"".join(struct.pack(">Q", v) for v in values)).digest()
    record_id = int.from_bytes(digest[:8], "big") & MAX_JSON_SAFE_ID
    return record_id or 1


def attachment_record_id(publisher_id: int, generation: int) -> int:
    return _record_id(ATTACHMENT_RECORD_TAG, publisher_id, generation)


def new_publisher_id() -> int:
    """A fresh, JSON-safe (< 2^53), non-zero publisher id for one agent incarnation."""
    return (secrets.randbits(53) & MAX_JSON_SAFE_ID) or 1
