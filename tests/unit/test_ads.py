"""Source and attachment advertisements (docs/spec/agent-semantics.md 6.2-6.4)."""

from __future__ import annotations

import json
import struct

import blake3
import pytest

from kvagent.discovery.ads import attachment_advertisement, recovery_control_target, source_advertisement
from kvagent.model.events import IngressProtocol, WorkerWithDpRank
from kvagent.model.status import Attachment, AttachmentSource
from tests.support.ids import IDENTITY, OWNER_TEXT

# The indexer-domain half of the seed's fixture owner (docs/spec/agent-semantics.md 1.3).
DOMAIN_TEXT = "01010101010101010101010101010101:02020202020202020202020202020202"
ENDPOINT = "tcp://127.0.0.1:7000"


def expected_record_id(publisher_id: int, generation: int) -> int:
    """6.4, written out independently of kvagent.model.ids."""
    digest = blake3.blake3(
        b"dynamo/kv-state-attachment-record/v2" + struct.pack(">QQ", publisher_id, generation)
    )
    return (int.from_bytes(digest.digest()[:8], "big") & (2**53 - 1)) or 1


def attachment(generation: int = 3) -> Attachment:
    return Attachment(
        worker=WorkerWithDpRank(worker_id=2**63 + 5, dp_rank=2),
        source=AttachmentSource(endpoint="tcp://127.0.0.1:5557", topic="kv@"),
        producer_instance="engine-a",
        intent_incarnation=11,
        generation=generation,
        ready=True,
        ready_at_outbound_cursor=17,
    )


def test_recovery_control_target_is_lowercase_hex() -> None:
    assert recovery_control_target(41) == "worker_kv_query_source_29"
    assert recovery_control_target(0xABCDEF) == "worker_kv_query_source_abcdef"
    with pytest.raises(ValueError):
        recovery_control_target(-1)


def test_source_advertisement_fields() -> None:
    record = source_advertisement(
        identity=IDENTITY,
        global_dp_rank=2,
        kv_state_endpoint=ENDPOINT,
        kv_block_size=16,
        ingress_protocol=IngressProtocol.VLLM_RESIDENCY_V1,
    )
    assert (record.topic, record.record_id, record.scope) == ("kv-state-sources-v2", 41, ENDPOINT)
    assert record.metadata == {
        "cache_owner_id": OWNER_TEXT,
        "global_dp_rank": 2,
        "kv_state_endpoint": ENDPOINT,
        "indexer_domain_id": DOMAIN_TEXT,
        "kv_block_size": 16,
        "ingress_protocol": "vllm_residency_v1",
        "publisher_id": 41,
        "protocol_version": "v2",
        "event_topic": "kv-state-events-v2",
        "recovery_control_target": "worker_kv_query_source_29",
    }


def test_source_advertisement_optional_fields() -> None:
    record = source_advertisement(
        identity=IDENTITY,
        global_dp_rank=2,
        kv_state_endpoint=ENDPOINT,
        kv_block_size=16,
        ingress_protocol=IngressProtocol.VLLM_RESIDENCY_V1,
        recovery_url="ws://127.0.0.1:8765/v1/slots/a",
        router_hint_source={"source_control_endpoint": "x", "worker_type": "decode"},
    )
    assert record.metadata["recovery_url"] == "ws://127.0.0.1:8765/v1/slots/a"
    assert record.metadata["router_hint_source"] == {"source_control_endpoint": "x", "worker_type": "decode"}
    assert len(record.metadata) == 12


def test_attachment_advertisement_fields() -> None:
    record = attachment_advertisement(identity=IDENTITY, attachment=attachment(3), kv_state_endpoint=ENDPOINT)
    assert record.topic == "kv-state-attachments-v2"
    assert record.scope == ENDPOINT
    assert record.record_id == expected_record_id(41, 3)
    assert record.metadata == {
        "cache_owner_id": OWNER_TEXT,
        "publisher_id": 41,
        "protocol_version": "v2",
        "recovery_control_target": "worker_kv_query_source_29",
        "attachment_generation": 3,
        "producer_instance": "engine-a",
        "intent_incarnation": 11,
        "worker": {"worker_id": 2**63 + 5, "dp_rank": 2},
        "ingress_protocol": "vllm_residency_v1",
        "raw_zmq_endpoint": "tcp://127.0.0.1:5557",
        "raw_topic": "kv@",
        "ready_at_outbound_cursor": 17,
    }
    with_url = attachment_advertisement(
        identity=IDENTITY,
        attachment=attachment(3),
        kv_state_endpoint=ENDPOINT,
        recovery_url="ws://h/v1/slots/a",
    )
    assert with_url.metadata == {**record.metadata, "recovery_url": "ws://h/v1/slots/a"}
    assert with_url.record_id == record.record_id


@pytest.mark.parametrize("generation", [1, 2, 3, 1000, 2**64 - 1])
def test_attachment_record_ids_follow_the_formula_and_are_json_safe(generation: int) -> None:
    record = attachment_advertisement(
        identity=IDENTITY, attachment=attachment(generation), kv_state_endpoint=ENDPOINT
    )
    assert record.record_id == expected_record_id(41, generation)
    assert 0 < record.record_id < 2**53
    # Exact through a JSON round trip (a JavaScript consumer reads ids as doubles).
    assert float(record.record_id) == record.record_id
    assert json.loads(record.to_json())["record_id"] == record.record_id


def test_generations_get_distinct_record_ids() -> None:
    ids = {
        attachment_advertisement(
            identity=IDENTITY, attachment=attachment(g), kv_state_endpoint=ENDPOINT
        ).record_id
        for g in range(1, 200)
    }
    assert len(ids) == 199
