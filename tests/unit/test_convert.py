"""The one strict JSON converter (kvagent/model/convert.py): every value class it reads refuses what is not
its own JSON, naming the member, in the error class of its caller."""

from __future__ import annotations

import json

import pytest

from kvagent.discovery.base import DiscoveryRecord
from kvagent.discovery.ownership import SlotHolder
from kvagent.model.errors import CodecError, DiscoveryError, IdentityError, KvAgentError
from kvagent.model.events import WorkerWithDpRank
from kvagent.model.ids import KvStateAgentIdentity
from kvagent.model.status import AgentStatus, AttachmentStatus, PersistenceStatus, RepublishStatus
from tests.support.ids import IDENTITY

FULL = AgentStatus(
    IDENTITY,
    AttachmentStatus(7, WorkerWithDpRank(17, 3), False, 12, "degraded"),
    cache_owner_ready=False,
    outbound_cursor=40,
    republish=RepublishStatus("tcp://*:6557", None, 5),
    persistence=PersistenceStatus("ok", 3, 4, 5),
    last_event_age_s=1.5,
)


def test_the_status_json_keeps_its_member_order_and_round_trips() -> None:
    data = FULL.to_json()
    assert list(data) == [
        "identity",
        "attachment",
        "cache_owner_ready",
        "outbound_cursor",
        "last_event_age_s",
        "republish",
        "persistence",
    ]
    assert list(AgentStatus(IDENTITY).to_json()) == list(data)[:5]  # the optional tables only when set
    assert AgentStatus.from_json(json.loads(json.dumps(data))) == FULL


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"surprise": 1}, "status has unknown members surprise"),
        ({"last_event_age_s": -1}, "status: "),
        ({"last_event_age_s": True}, "status.last_event_age_s must be a number, got True"),
        ({"republish": {"endpoint": "tcp://*:1", "seq": None}}, "status.republish is missing 'replay_endpoint'"),
        ({"persistence": {"state": "lost", "persisted_id": 0, "lag_events": 0, "disk_bytes": 0}}, "status.persistence.state must be in"),
    ],
)
def test_a_status_member_that_is_not_its_own_json_is_named(change: dict[str, object], message: str) -> None:
    with pytest.raises(CodecError) as raised:
        AgentStatus.from_json({**FULL.to_json(), **change})
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"publisher_id": True}, "identity.publisher_id must be a u64, got True"),
        ({"publisher_id": 1 << 64}, "identity.publisher_id must be a u64"),
        ({"protocol_version": 2}, "identity.protocol_version must be a string, got 2"),
        ({"extra": "x"}, "identity has unknown members extra"),
        ({"cache_owner_id": "nope"}, "identity.cache_owner_id: cache owner id must be"),
    ],
)
def test_an_identity_that_is_not_its_own_json_is_an_identity_error(change: dict[str, object], message: str) -> None:
    with pytest.raises(IdentityError) as raised:
        KvStateAgentIdentity.from_json({**IDENTITY.to_json(), **change})
    assert str(raised.value).startswith(message)
    # Inside a status, the identity's problem stays an IdentityError.
    with pytest.raises(IdentityError):
        AgentStatus.from_json({**FULL.to_json(), "identity": {**IDENTITY.to_json(), **change}})


def test_an_identity_without_a_version_is_v2() -> None:
    data = {key: value for key, value in IDENTITY.to_json().items() if key != "protocol_version"}
    assert KvStateAgentIdentity.from_json(data) == IDENTITY


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"topic":"t","record_id":1,"scope":"s"}', "discovery record is missing 'metadata'"),
        ('{"topic":"t","record_id":1,"scope":"s","metadata":{},"x":1}', "discovery record has unknown members x"),
        ('{"topic":"t","record_id":true,"scope":"s","metadata":{}}', "discovery record.record_id must be a u64"),
        ('{"topic":"t","record_id":1,"scope":"s","metadata":[]}', "discovery record: record metadata must be"),
        ('{"topic":"a b","record_id":1,"scope":"s","metadata":{}}', "discovery record: discovery topic must"),
        ("[]", "discovery record must be an object, got list"),
    ],
)
def test_a_discovery_record_that_is_not_its_own_json_is_a_discovery_error(text: str, message: str) -> None:
    with pytest.raises(DiscoveryError) as raised:
        DiscoveryRecord.from_json(text)
    assert str(raised.value).startswith(message)


def test_a_discovery_record_s_json_is_canonical_and_round_trips() -> None:
    record = DiscoveryRecord("t", 5, "s", {"b": [1, 2], "a": {"c": None}})
    assert record.to_json() == '{"metadata":{"a":{"c":null},"b":[1,2]},"record_id":5,"scope":"s","topic":"t"}'
    assert DiscoveryRecord.from_json(record.to_json()) == record


def test_a_slot_holder_round_trips_and_anything_else_is_no_holder() -> None:
    holder = SlotHolder("gpu0", "owner", "host", 42, None, "ab")
    assert holder.to_json() == (
        b'{"cache_owner_id":"owner","hostname":"host","nonce":"ab","pid":42,"slot":"gpu0","url":null}'
    )
    assert SlotHolder.from_json(holder.to_json()) == holder
    for other in (b"", b"{", b"[]", holder.to_json().replace(b'"pid":42', b'"pid":"42"'), b'{"slot":"gpu0"}'):
        assert SlotHolder.from_json(other) is None


def test_every_error_is_a_bad_request() -> None:
    with pytest.raises(KvAgentError) as raised:
        AgentStatus.from_json(None)
    assert raised.value.code == "bad_request"
