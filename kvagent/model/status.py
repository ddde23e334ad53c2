"""Attachments and the slot's status: immutable snapshots, with their JSON both ways.

``from_json`` parses what ``to_json`` wrote (the websocket ``status`` op) with the strict converter of
kvagent/model/convert.py: it checks every member's type, refuses members it does not know, and raises
:class:`~kvagent.model.errors.CodecError` naming the first one that is wrong (a malformed identity keeps
its :class:`~kvagent.model.errors.IdentityError`).
"""

from __future__ import annotations

from typing import Any

import attrs
from cattrs.gen import make_dict_unstructure_fn, override

from kvagent.model.convert import converter, register_object, structure, unstructure
from kvagent.model.errors import CodecError
from kvagent.model.events import IngressProtocol, SourceState, WorkerWithDpRank
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
        data: dict[str, object] = unstructure(self)
        return data

    @classmethod
    def from_json(cls, value: object, field: str = "attachment") -> AttachmentStatus:
        """The inverse of :meth:`to_json`; an older agent's JSON without ``state`` is read from ``ready``."""
        return structure(value, cls, what=field, error=CodecError)


@attrs.frozen(slots=True)
class RepublishStatus:
    """Where a slot republishes its vLLM-compatible stream, and the seq of its last batch (None: none yet)."""

    endpoint: str
    replay_endpoint: str | None = None
    seq: int | None = None

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = unstructure(self)
        return data

    @classmethod
    def from_json(cls, value: object, field: str = "republish") -> RepublishStatus:
        return structure(value, cls, what=field, error=CodecError)


PERSISTENCE_STATES = ("ok", "failed", "off")


@attrs.frozen(slots=True)
class PersistenceStatus:
    """The slot's state directory: ``ok``, ``failed`` (serving from memory, retrying) or ``off`` (none).

    ``persisted_id`` is the newest outbound id on disk, ``lag_events`` how many applied ids are not yet.
    """

    state: str = attrs.field(default="off", validator=attrs.validators.in_(PERSISTENCE_STATES))
    persisted_id: int = 0
    lag_events: int = 0
    disk_bytes: int = 0

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = unstructure(self)
        return data

    @classmethod
    def from_json(cls, value: object, field: str = "persistence") -> PersistenceStatus:
        return structure(value, cls, what=field, error=CodecError)


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
    last_event_age_s: float | None = attrs.field(
        default=None, eq=False, validator=attrs.validators.optional(attrs.validators.ge(0.0))
    )

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = unstructure(self)
        return data

    @classmethod
    def from_json(cls, value: object) -> AgentStatus:
        """The inverse of :meth:`to_json`; a bad identity raises its IdentityError, anything else CodecError."""
        return structure(value, cls, what="status", error=CodecError)

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


# -- the JSON (kvagent/model/convert.py) ------------------------------------------------------------------

register_object(WorkerWithDpRank)
register_object(AttachmentStatus, optional=("state",))  # an older agent's JSON has no state
register_object(RepublishStatus)
register_object(PersistenceStatus)
register_object(AgentStatus, optional=("republish", "persistence", "last_event_age_s"))

# republish and persistence are in the JSON only when set, and last, after last_event_age_s: the order the
# status JSON has always had, so its bytes do not change.
_status_members = make_dict_unstructure_fn(
    AgentStatus,
    converter,
    republish=override(omit_if_default=True),
    persistence=override(omit_if_default=True),
)


def _unstructure_status(status: AgentStatus) -> dict[str, Any]:
    data = _status_members(status)
    for optional in ("republish", "persistence"):
        if optional in data:
            data[optional] = data.pop(optional)
    return data


converter.register_unstructure_hook(AgentStatus, _unstructure_status)
