"""Attachments and the slot's status: immutable snapshots, with their JSON both ways.

``from_json`` parses what ``to_json`` wrote (the websocket ``status`` op); it checks every field's type
and raises :class:`~kvagent.model.errors.CodecError` naming the first field that is wrong.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvagent.model.errors import CodecError
from kvagent.model.events import U64_MAX, IngressProtocol, WorkerWithDpRank
from kvagent.model.ids import KvStateAgentIdentity

__all__ = ["AgentStatus", "Attachment", "AttachmentSource", "AttachmentStatus"]


@attrs.frozen(slots=True)
class AttachmentSource:
    """Where one engine incarnation publishes its raw KV events."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    ingress_protocol: IngressProtocol = IngressProtocol.VLLM_RESIDENCY_V1


@attrs.frozen(slots=True)
class Attachment:
    """The coordinator's record of the current engine incarnation."""

    worker: WorkerWithDpRank
    source: AttachmentSource
    producer_instance: str = ""
    intent_incarnation: int = 0
    generation: int = 0
    ready: bool = False
    ready_at_outbound_cursor: int = 0

    def status(self) -> AttachmentStatus:
        return AttachmentStatus(self.generation, self.worker, self.ready, self.ready_at_outbound_cursor)


@attrs.frozen(slots=True)
class AttachmentStatus:
    generation: int
    worker: WorkerWithDpRank
    ready: bool
    ready_at_outbound_cursor: int

    def to_json(self) -> dict[str, object]:
        return {
            "generation": self.generation,
            "worker": {"worker_id": self.worker.worker_id, "dp_rank": self.worker.dp_rank},
            "ready": self.ready,
            "ready_at_outbound_cursor": self.ready_at_outbound_cursor,
        }

    @classmethod
    def from_json(cls, value: object, field: str = "attachment") -> AttachmentStatus:
        obj = _object(value, field)
        worker = _object(_member(obj, "worker", field), f"{field}.worker")
        return cls(
            _uint(_member(obj, "generation", field), f"{field}.generation"),
            WorkerWithDpRank(
                _uint(_member(worker, "worker_id", f"{field}.worker"), f"{field}.worker.worker_id"),
                _uint(_member(worker, "dp_rank", f"{field}.worker"), f"{field}.worker.dp_rank"),
            ),
            _bool(_member(obj, "ready", field), f"{field}.ready"),
            _uint(_member(obj, "ready_at_outbound_cursor", field), f"{field}.ready_at_outbound_cursor"),
        )


@attrs.frozen(slots=True)
class AgentStatus:
    identity: KvStateAgentIdentity
    attachment: AttachmentStatus | None = None
    cache_owner_ready: bool = True
    outbound_cursor: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "identity": self.identity.to_json(),
            "attachment": None if self.attachment is None else self.attachment.to_json(),
            "cache_owner_ready": self.cache_owner_ready,
            "outbound_cursor": self.outbound_cursor,
        }

    @classmethod
    def from_json(cls, value: object) -> AgentStatus:
        """The inverse of :meth:`to_json`; a bad identity raises its IdentityError, anything else CodecError."""
        obj = _object(value, "status")
        attachment = _member(obj, "attachment", "status")
        return cls(
            KvStateAgentIdentity.from_json(_member(obj, "identity", "status")),
            None if attachment is None else AttachmentStatus.from_json(attachment, "status.attachment"),
            _bool(_member(obj, "cache_owner_ready", "status"), "status.cache_owner_ready"),
            _uint(_member(obj, "outbound_cursor", "status"), "status.outbound_cursor"),
        )

    def is_ready_generation(self, generation: int) -> bool:
        return (
            self.attachment is not None and self.attachment.generation == generation and self.attachment.ready
        )


def _object(value: object, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CodecError(f"{field} must be an object, got {type(value).__name__}")
    return value


def _member(obj: dict[str, Any], key: str, field: str) -> object:
    try:
        return obj[key]
    except KeyError:
        raise CodecError(f"{field} is missing {key!r}") from None


def _uint(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= U64_MAX:
        raise CodecError(f"{field} must be a u64, got {value!r}")
    return value


def _bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise CodecError(f"{field} must be a boolean, got {value!r}")
    return value
