"""kvagent: a durable, recoverable source of truth for the KV-cache blocks of every vLLM DP slot.

The public API for embedders: run slot agents in your own Trio program (``open_slot_agent``,
``open_host``), advertise them through a discovery backend, and read a slot back as a router would
(``connect_slot``, ``subscribe``).  Everything else lives in subpackages and may change; test doubles
(``RecordingSink``, ``FakeVllmEngine``) are in :mod:`kvagent.testing`.  The CLI is not imported here.
"""

from __future__ import annotations

from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.agent.host import Host, SlotState, SlotStateKind, open_host
from kvagent.agent.slot import SlotAgent, SlotStatistics, open_slot_agent
from kvagent.discovery import Discovery, DiscoveryRecord, FileDiscovery, MemoryDiscovery, open_discovery
from kvagent.discovery.etcd import EtcdDiscovery
from kvagent.model.errors import (
    DiscoveryConflict,
    DiscoveryError,
    FollowOverrun,
    KvAgentError,
    RecoveryClientError,
)
from kvagent.model.events import (
    KV_STATE_ATTACHMENTS_TOPIC,
    KV_STATE_SOURCES_TOPIC,
    Cleared,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.model.ids import CacheOwnerId, KvStateAgentIdentity, derive_cache_owner_id
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.publish.republisher import RepublishConfig
from kvagent.recovery.client import RecoverResult, RecoveryClient, connect_slot, subscribe
from kvagent.wire.router_event import router_event_from_json

__version__ = "0.1.0"

__all__ = [
    "KV_STATE_ATTACHMENTS_TOPIC",
    "KV_STATE_SOURCES_TOPIC",
    "AgentStatus",
    "AttachmentConfig",
    "AttachmentStatus",
    "CacheOwnerId",
    "Cleared",
    "Discovery",
    "DiscoveryConflict",
    "DiscoveryError",
    "DiscoveryRecord",
    "EtcdDiscovery",
    "FileDiscovery",
    "FollowOverrun",
    "Host",
    "KvAgentError",
    "KvStateAgentIdentity",
    "MemoryDiscovery",
    "RecoverResult",
    "RecoveryClient",
    "RecoveryClientError",
    "Removed",
    "RepublishConfig",
    "ResidencyDomain",
    "RouterEvent",
    "SlotAgent",
    "SlotAgentConfig",
    "SlotState",
    "SlotStateKind",
    "SlotStatistics",
    "StorageTier",
    "Stored",
    "WorkerWithDpRank",
    "connect_slot",
    "derive_cache_owner_id",
    "open_discovery",
    "open_host",
    "open_slot_agent",
    "router_event_from_json",
    "subscribe",
]
