"""Attachments and the slot's status: immutable snapshots, swapped whole in a cell."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from kvagent.model.events import IngressProtocol, WorkerWithDpRank
from kvagent.model.ids import KvStateAgentIdentity

__all__ = ["AgentStatus", "Attachment", "AttachmentSource", "AttachmentStatus", "StatusCell"]


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

    def is_ready_generation(self, generation: int) -> bool:
        return (
            self.attachment is not None and self.attachment.generation == generation and self.attachment.ready
        )


class StatusCell:
    """Holds the current :class:`AgentStatus`; readers never see a partial update.

    ``wait_for`` lets tests and lifecycle code wait on a condition without polling or sleeping.
    """

    def __init__(self, initial: AgentStatus) -> None:
        self._status = initial
        self._changed = trio.Event()

    def get(self) -> AgentStatus:
        return self._status

    def set(self, status: AgentStatus) -> None:
        self._status = status
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[AgentStatus], bool]) -> AgentStatus:
        """Wait until ``predicate(status)`` is true and return that status."""
        while not predicate(self._status):
            await self._changed.wait()
        return self._status
