"""Discovery records and the backend protocol.

An advertisement is an immutable *hint*, not a liveness signal: a router treats a changed payload under an
existing record id as an error (docs/spec/agent-semantics.md 6.1).  Every backend therefore makes ``register`` idempotent for
an equal payload and refuses a different one with :class:`DiscoveryConflict`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from kvagent.model.convert import converter, register_object, structure, unstructure
from kvagent.model.errors import DiscoveryConflict, DiscoveryError
from kvagent.model.ids import MAX_JSON_SAFE_ID

__all__ = [
    "Discovery",
    "DiscoveryConflict",
    "DiscoveryError",
    "DiscoveryRecord",
    "check_topic",
]

# Topics become directory names (file backend) and key segments (etcd), so keep them to a safe alphabet.
_TOPIC_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_topic(topic: object) -> str:
    if not isinstance(topic, str) or not _TOPIC_RE.fullmatch(topic):
        raise DiscoveryError(f"discovery topic must match [A-Za-z0-9][A-Za-z0-9._-]*, got {topic!r}")
    return topic


def _check_topic(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    check_topic(value)


def _check_record_id(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_JSON_SAFE_ID:
        raise DiscoveryError(f"record id must be an integer in 0..2^53-1 (JSON-safe), got {value!r}")


def _check_scope(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise DiscoveryError(f"record scope must be a string, got {value!r}")


def _json_copy(metadata: Mapping[str, object]) -> dict[str, Any]:
    """A private, JSON-normalized copy: callers cannot mutate it behind our back, and every backend
    returns the same value (tuples become lists, as they would after a round trip through storage)."""
    if not isinstance(metadata, Mapping):
        raise DiscoveryError(f"record metadata must be a JSON object, got {type(metadata).__name__}")
    try:
        copied = json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise DiscoveryError(f"record metadata is not JSON-serializable: {exc}") from None
    assert isinstance(copied, dict)
    return copied


@attrs.frozen(slots=True)
class DiscoveryRecord:
    """One advertisement: ``metadata`` is the advertisement's JSON object (treat it as immutable)."""

    topic: str = attrs.field(validator=_check_topic)
    record_id: int = attrs.field(validator=_check_record_id)
    scope: str = attrs.field(validator=_check_scope)
    # Excluded from the hash (a dict is unhashable); equal records still hash equally.
    metadata: Mapping[str, object] = attrs.field(converter=_json_copy, hash=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.record_id)

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = unstructure(self)
        return data

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, no whitespace): equal records give equal bytes."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, value: object) -> DiscoveryRecord:
        """The record in a decoded JSON object (every member, nothing else); raises DiscoveryError."""
        return structure(value, cls, what="discovery record", error=DiscoveryError)

    @classmethod
    def from_json(cls, value: str | bytes | Mapping[str, object]) -> DiscoveryRecord:
        """Parse JSON text (or an already decoded object); raises DiscoveryError."""
        if isinstance(value, str | bytes):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise DiscoveryError(f"discovery record is not valid JSON: {exc}") from None
        return cls.from_dict(value)


# The metadata is any JSON object: taken as it is (the record's converter copies and checks it).
converter.register_structure_hook_func(lambda type_: type_ == Mapping[str, object], lambda value, _: value)
register_object(DiscoveryRecord)



@runtime_checkable
class Discovery(Protocol):
    async def register(self, record: DiscoveryRecord) -> None:
        """Publish ``record``; equal payload under the same key is a no-op, a different one conflicts."""
        ...

    async def unregister(self, topic: str, record_id: int) -> None:
        """Withdraw a record; withdrawing an absent record is a no-op."""
        ...

    async def list(self, topic: str | None = None) -> list[DiscoveryRecord]:
        """Every record, or those of one topic (memory and file backends order by (topic, record_id))."""
        ...

    async def aclose(self) -> None: ...
