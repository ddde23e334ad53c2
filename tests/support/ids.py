"""The one set of test identities: the seed CacheOwner, the agent identity, the worker, ready attachments.

Every test that needs "a slot" uses these values (tests pin bytes derived from them, so they never change):
CacheSemantics ``01``*16, RoutingScope ``02``*16, DC 3, stable slot ``04``*16, publisher id 41. Tests take
them as the fixtures of tests/conftest.py; Hypothesis strategies and parametrizations import the constants.
"""

from __future__ import annotations

from kvagent.coordinator.task import StatusCell
from kvagent.model.events import ResidencyDomain, StorageTier, WorkerWithDpRank
from kvagent.model.ids import (
    CacheOwnerId,
    CacheSemanticsId,
    DcId,
    IndexerDomainId,
    KvStateAgentIdentity,
    PoolId,
    RoutingScopeId,
    StableDpSlotId,
)
from kvagent.model.status import AgentStatus, Attachment, AttachmentSource

__all__ = [
    "C",
    "DEVICE",
    "DISK",
    "HP",
    "IDENTITY",
    "OWNER",
    "OWNER_TEXT",
    "PUBLISHER_ID",
    "W",
    "WORKER",
    "attachment_for",
    "ready_attachment",
    "status_for",
]

OWNER = CacheOwnerId(
    PoolId(IndexerDomainId(CacheSemanticsId(bytes([1] * 16)), RoutingScopeId(bytes([2] * 16))), DcId(3)),
    StableDpSlotId(bytes([4] * 16)),
)
# The canonical text form of OWNER, spelt out: config files, advertisements and JSON pin this exact string.
OWNER_TEXT = (
    "01010101010101010101010101010101:02020202020202020202020202020202/0000000000000003/"
    "04040404040404040404040404040404"
)
PUBLISHER_ID = 41
IDENTITY = KvStateAgentIdentity(OWNER, PUBLISHER_ID)
WORKER = WorkerWithDpRank(17, 0)

# Shorthands for the residency domains and tiers that event-building tests spell on every line.
W, C = ResidencyDomain.WORKER, ResidencyDomain.CACHE_OWNER
DEVICE, HP, DISK = StorageTier.DEVICE, StorageTier.HOST_PINNED, StorageTier.DISK


def ready_attachment(
    endpoint: str,
    *,
    replay_endpoint: str | None = None,
    topic: str = "kv-events",
    dp_rank: int = 0,
    generation: int = 1,
    worker_id: int = WORKER.worker_id,
) -> Attachment:
    """An attachment as the coordinator hands it to the listener: ready, with a generation."""
    return Attachment(
        worker=WorkerWithDpRank(worker_id, dp_rank),
        source=AttachmentSource(endpoint=endpoint, topic=topic, replay_endpoint=replay_endpoint),
        producer_instance=f"test/producer/raw-kv/{worker_id}",
        intent_incarnation=worker_id,
        generation=generation,
        ready=True,
    )


def attachment_for(worker: WorkerWithDpRank, endpoint: str = "tcp://framework") -> Attachment:
    """An attachment request as an operator makes it (not yet ready, no generation)."""
    return Attachment(
        worker=worker,
        source=AttachmentSource(endpoint=endpoint, topic="kv-events-v2"),
        producer_instance=f"test/producer/raw-kv/{worker.worker_id}",
        intent_incarnation=worker.worker_id,
    )


def status_for(attachment: Attachment) -> StatusCell:
    """A status cell holding IDENTITY with ``attachment``'s status."""
    return StatusCell(AgentStatus(IDENTITY, attachment.status()))
