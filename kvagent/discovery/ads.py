"""The slot's two advertisements (docs/spec/agent-semantics.md 6.2 and 6.3) as discovery records.

Field names and values follow Dynamo's ``KvStateSourceAdvertisement`` and
``KvStateAttachmentAdvertisement``.  kvagent adds one optional field of its own, ``recovery_url``: the
websocket URL of the slot, so routers without Dynamo's request plane can find the recovery endpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvagent.discovery.base import DiscoveryRecord
from kvagent.model.events import (
    KV_STATE_ATTACHMENTS_TOPIC,
    KV_STATE_EVENTS_TOPIC,
    KV_STATE_SOURCES_TOPIC,
    IngressProtocol,
)
from kvagent.model.ids import KvStateAgentIdentity, attachment_record_id
from kvagent.model.status import Attachment

__all__ = ["attachment_advertisement", "recovery_control_target", "source_advertisement"]

RECOVERY_ENDPOINT_PREFIX = "worker_kv_query_source_"


def recovery_control_target(publisher_id: int) -> str:
    """The name of the slot's recovery/control endpoint (docs/spec/agent-semantics.md 5)."""
    if publisher_id < 0:
        raise ValueError(f"publisher id must be non-negative, got {publisher_id}")
    return f"{RECOVERY_ENDPOINT_PREFIX}{publisher_id:x}"


def source_advertisement(
    *,
    identity: KvStateAgentIdentity,
    global_dp_rank: int,
    kv_state_endpoint: str,
    kv_block_size: int,
    ingress_protocol: IngressProtocol,
    recovery_url: str | None = None,
    router_hint_source: Mapping[str, object] | None = None,
) -> DiscoveryRecord:
    """The persistent source advertisement, registered once at start under the publisher id."""
    metadata: dict[str, object] = {
        "cache_owner_id": str(identity.cache_owner_id),
        "global_dp_rank": global_dp_rank,
        "kv_state_endpoint": kv_state_endpoint,
        "indexer_domain_id": str(identity.cache_owner_id.pool.indexer_domain),
        "kv_block_size": kv_block_size,
        "ingress_protocol": ingress_protocol.value,
        "publisher_id": identity.publisher_id,
        "protocol_version": identity.protocol_version,
        "event_topic": KV_STATE_EVENTS_TOPIC,
        "recovery_control_target": recovery_control_target(identity.publisher_id),
    }
    if router_hint_source is not None:  # omitted when absent, as Dynamo's serde does
        metadata["router_hint_source"] = dict(router_hint_source)
    if recovery_url is not None:
        metadata["recovery_url"] = recovery_url
    return DiscoveryRecord(KV_STATE_SOURCES_TOPIC, identity.publisher_id, kv_state_endpoint, metadata)


def attachment_advertisement(
    *,
    identity: KvStateAgentIdentity,
    attachment: Attachment,
    kv_state_endpoint: str,
    recovery_url: str | None = None,
) -> DiscoveryRecord:
    """The per-generation attachment advertisement; registering it commits readiness."""
    metadata: dict[str, object] = {
        "cache_owner_id": str(identity.cache_owner_id),
        "publisher_id": identity.publisher_id,
        "protocol_version": identity.protocol_version,
        "recovery_control_target": recovery_control_target(identity.publisher_id),
        "attachment_generation": attachment.generation,
        "producer_instance": attachment.producer_instance,
        "intent_incarnation": attachment.intent_incarnation,
        "worker": {"worker_id": attachment.worker.worker_id, "dp_rank": attachment.worker.dp_rank},
        "ingress_protocol": attachment.source.ingress_protocol.value,
        "raw_zmq_endpoint": attachment.source.endpoint,
        "raw_topic": attachment.source.topic,
        "ready_at_outbound_cursor": attachment.ready_at_outbound_cursor,
    }
    if recovery_url is not None:
        metadata["recovery_url"] = recovery_url
    record_id = attachment_record_id(identity.publisher_id, attachment.generation)
    return DiscoveryRecord(KV_STATE_ATTACHMENTS_TOPIC, record_id, kv_state_endpoint, metadata)
