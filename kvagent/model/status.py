"""Attachments and the slot's status: immutable snapshots, with their JSON both ways.

``from_json`` parses what ``to_json`` wrote (the websocket ``status`` op); it checks every field's type
and raises :class:`~kvagent.model.errors.CodecError` naming the first field that is wrong.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvagent.model.errors import CodecError
from kvagent.model.events import U64_MAX, IngressProtocol, SourceState, WorkerWithDpRank
from kvagent.model.ids import KvStateAgentIdentity

__all__ = [
    "ATTACHMENT_STATES",
    "DETACHED",
    "UNREADY",
    "AgentStatus",
    "Attachment",
    "AttachmentSource",
    "AttachmentStatus",
    "PersistenceStatus",
    "RepublishStatus",
]

DETACHED = "detached"  # a slot without an attachment (not an attachment state)
UNREADY = "unready"  # attaching, detaching or quarantined: the attachment is not open
# An attachment's state as routers see it: "ready" is the only state whose Worker state can be trusted.
ATTACHMENT_STATES = (
    SourceState.READY.value,
    SourceState.DEGRADED.value,
    SourceState.DISCONNECTED.value,
    UNREADY,
)


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
    """The coordinator's record of the current engine incarnation.

    ``ready`` is the lifecycle half of readiness: the attachment is open (attached, not detaching or
    quarantined). ``source_state`` is the listener's half: whether the Worker state follows the engine's
    complete history. Only both together make the status ``ready``.
    """

    worker: WorkerWithDpRank
    source: AttachmentSource
    producer_instance: str = ""
    intent_incarnation: int = 0
    generation: int = 0
    ready: bool = False
    ready_at_outbound_cursor: int = 0
    source_state: SourceState = SourceState.READY

    @property
    def state(self) -> str:
        """One of :data:`ATTACHMENT_STATES`."""
        return self.source_state.value if self.ready else UNREADY

    def status(self) -> AttachmentStatus:
        state = self.state
        return AttachmentStatus(
            self.generation, self.worker, state == "ready", self.ready_at_outbound_cursor, state
        )


def _default_state(status: AttachmentStatus) -> str:
    return "ready" if status.ready else UNREADY


@attrs.frozen(slots=True)
class AttachmentStatus:
    """What the status op reports of the attachment; ``ready`` is always ``state == "ready"``.

    ``state`` is ``"ready"``, ``"degraded"`` (history was lost: a Worker reset was published and the state
    is a subset of the engine's), ``"disconnected"`` (the engine's connection dropped) or ``"unready"``
    (attaching, detaching or quarantined). Left out, it follows ``ready``.
    """

    generation: int
    worker: WorkerWithDpRank
    ready: bool
    ready_at_outbound_cursor: int
    state: str = attrs.field(default=attrs.Factory(_default_state, takes_self=True))

    def __attrs_post_init__(self) -> None:
        if self.state not in ATTACHMENT_STATES:
            raise ValueError(f"unknown attachment state {self.state!r}")
        if self.ready != (self.state == "ready"):
            raise ValueError(f"attachment state {self.state!r} contradicts ready={self.ready}")

    @property
    def is_open(self) -> bool:
        """Attached and neither detaching nor quarantined (ready, degraded or disconnected)."""
        return self.state != UNREADY

    def to_json(self) -> dict[str, object]:
        return {
            "generation": self.generation,
            "worker": {"worker_id": self.worker.worker_id, "dp_rank": self.worker.dp_rank},
            "ready": self.ready,
            "ready_at_outbound_cursor": self.ready_at_outbound_cursor,
            "state": self.state,
        }

    @classmethod
    def from_json(cls, value: object, field: str = "attachment") -> AttachmentStatus:
        obj = _object(value, field)
        worker = _object(_member(obj, "worker", field), f"{field}.worker")
        ready = _bool(_member(obj, "ready", field), f"{field}.ready")
        return cls(
            _uint(_member(obj, "generation", field), f"{field}.generation"),
            WorkerWithDpRank(
                _uint(_member(worker, "worker_id", f"{field}.worker"), f"{field}.worker.worker_id"),
                _uint(_member(worker, "dp_rank", f"{field}.worker"), f"{field}.worker.dp_rank"),
            ),
            ready,
            _uint(_member(obj, "ready_at_outbound_cursor", field), f"{field}.ready_at_outbound_cursor"),
            _state(obj, ready, field),
        )


@attrs.frozen(slots=True)
class RepublishStatus:
    """Where a slot republishes its vLLM-compatible stream, and the seq of its last batch (None: none yet)."""

    endpoint: str
    replay_endpoint: str | None = None
    seq: int | None = None

    def to_json(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "seq": self.seq}

    @classmethod
    def from_json(cls, value: object, field: str = "republish") -> RepublishStatus:
        obj = _object(value, field)
        endpoint = _member(obj, "endpoint", field)
        replay_endpoint = _member(obj, "replay_endpoint", field)
        seq = _member(obj, "seq", field)
        if not isinstance(endpoint, str):
            raise CodecError(f"{field}.endpoint must be a string, got {endpoint!r}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise CodecError(f"{field}.replay_endpoint must be a string or null, got {replay_endpoint!r}")
        return cls(endpoint, replay_endpoint, None if seq is None else _uint(seq, f"{field}.seq"))


PERSISTENCE_STATES = ("ok", "failed", "off")


@attrs.frozen(slots=True)
class PersistenceStatus:
    """The slot's state directory: ``ok``, ``failed`` (serving from memory, retrying) or ``off`` (none).

    ``persisted_id`` is the newest outbound id on disk, ``lag_events`` how many applied ids are not yet.
    """

    state: str = "off"
    persisted_id: int = 0
    lag_events: int = 0
    disk_bytes: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "state": self.state,
            "persisted_id": self.persisted_id,
            "lag_events": self.lag_events,
            "disk_bytes": self.disk_bytes,
        }

    @classmethod
    def from_json(cls, value: object, field: str = "persistence") -> PersistenceStatus:
        obj = _object(value, field)
        state = _member(obj, "state", field)
        if state not in PERSISTENCE_STATES:
            raise CodecError(f"{field}.state must be one of {', '.join(PERSISTENCE_STATES)}, got {state!r}")
        return cls(
            str(state),
            _uint(_member(obj, "persisted_id", field), f"{field}.persisted_id"),
            _uint(_member(obj, "lag_events", field), f"{field}.lag_events"),
            _uint(_member(obj, "disk_bytes", field), f"{field}.disk_bytes"),
        )


@attrs.frozen(slots=True)
class AgentStatus:
    """A slot's status; ``republish`` is set only on slots that republish (and only then in the JSON), and
    ``persistence`` only on slots of a process that persists (``state`` ``off`` for a slot kept in memory).

    ``last_event_age_s`` is the seconds since the attached engine's last live message reached the slot
    (None: no attachment, or nothing received from it yet); always in the JSON, ``null`` when None.
    """

    identity: KvStateAgentIdentity
    attachment: AttachmentStatus | None = None
    cache_owner_ready: bool = True
    outbound_cursor: int = 0
    republish: RepublishStatus | None = None
    persistence: PersistenceStatus | None = None
    # A measurement, not state: two snapshots of the same state compare equal whatever their ages.
    last_event_age_s: float | None = attrs.field(default=None, eq=False)

    def to_json(self) -> dict[str, object]:
        value: dict[str, object] = {
            "identity": self.identity.to_json(),
            "attachment": None if self.attachment is None else self.attachment.to_json(),
            "cache_owner_ready": self.cache_owner_ready,
            "outbound_cursor": self.outbound_cursor,
            "last_event_age_s": self.last_event_age_s,
        }
        if self.republish is not None:
            value["republish"] = self.republish.to_json()
        if self.persistence is not None:
            value["persistence"] = self.persistence.to_json()
        return value

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
            None
            if obj.get("republish") is None
            else RepublishStatus.from_json(obj["republish"], "status.republish"),
            None
            if obj.get("persistence") is None
            else PersistenceStatus.from_json(obj["persistence"], "status.persistence"),
            _optional_seconds(obj.get("last_event_age_s"), "status.last_event_age_s"),
        )

    def is_ready_generation(self, generation: int) -> bool:
        """Generation ``generation`` is attached and ``ready`` (its Worker state can be trusted)."""
        return (
            self.attachment is not None and self.attachment.generation == generation and self.attachment.ready
        )

    def is_open_generation(self, generation: int) -> bool:
        """Generation ``generation`` is attached and not detaching or quarantined (its listener runs on,
        also while degraded or disconnected)."""
        return (
            self.attachment is not None
            and self.attachment.generation == generation
            and self.attachment.is_open
        )

    @property
    def state(self) -> str:
        """The attachment's state, or ``"detached"`` when there is none (what /readyz and metrics show)."""
        return DETACHED if self.attachment is None else self.attachment.state


def _state(obj: dict[str, Any], ready: bool, field: str) -> str:
    """The ``state`` member; an older agent without it is read from ``ready``."""
    if "state" not in obj:
        return "ready" if ready else UNREADY
    state = obj["state"]
    if state not in ATTACHMENT_STATES:
        raise CodecError(f"{field}.state must be one of {', '.join(ATTACHMENT_STATES)}, got {state!r}")
    if ready != (state == "ready"):
        raise CodecError(f"{field}.state {state!r} contradicts {field}.ready={ready}")
    return str(state)


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


def _optional_seconds(value: object, field: str) -> float | None:
    """A non-negative number of seconds, or None (an older agent leaves the member out)."""
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise CodecError(f"{field} must be a non-negative number or null, got {value!r}")
    return float(value)


def _bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise CodecError(f"{field} must be a boolean, got {value!r}")
    return value
