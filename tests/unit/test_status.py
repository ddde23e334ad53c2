"""Status values and their JSON, both ways (the websocket ``status`` op)."""

from __future__ import annotations

import json

import attrs
import pytest

from kvagent.model.errors import CodecError, IdentityError
from kvagent.model.events import SourceState, WorkerWithDpRank
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.recovery.client import RecoveryClientError, agent_status_from_json
from tests.support.ids import IDENTITY, ready_attachment

ATTACHED = AgentStatus(
    IDENTITY,
    AttachmentStatus(7, WorkerWithDpRank(17, 3), True, 12),
    cache_owner_ready=False,
    outbound_cursor=40,
)


DEGRADED = AgentStatus(IDENTITY, AttachmentStatus(7, WorkerWithDpRank(17, 3), False, 12, "degraded"))


@pytest.mark.parametrize("status", [AgentStatus(IDENTITY), ATTACHED, DEGRADED])
def test_status_json_round_trips(status: AgentStatus) -> None:
    assert AgentStatus.from_json(json.loads(json.dumps(status.to_json()))) == status


@pytest.mark.parametrize(
    ("ready", "source_state", "state"),
    [
        (True, SourceState.READY, "ready"),
        (True, SourceState.DEGRADED, "degraded"),
        (True, SourceState.DISCONNECTED, "disconnected"),
        (False, SourceState.READY, "unready"),
        (False, SourceState.DEGRADED, "unready"),
    ],
)
def test_an_attachment_is_ready_only_while_open_and_its_source_is_ready(
    ready: bool, source_state: SourceState, state: str
) -> None:
    attachment = attrs.evolve(ready_attachment("tcp://e:1"), ready=ready, source_state=source_state)
    status = AgentStatus(IDENTITY, attachment.status())
    assert status.attachment is not None
    assert (status.attachment.state, status.attachment.ready) == (state, state == "ready")
    assert status.state == state
    assert status.attachment.to_json()["state"] == state
    assert status.is_ready_generation(1) is (state == "ready")
    assert status.is_open_generation(1) is ready
    assert not status.is_open_generation(2)


def test_a_slot_without_attachment_is_detached_and_nothing_is_open() -> None:
    status = AgentStatus(IDENTITY)
    assert status.state == "detached"
    assert not status.is_open_generation(1) and not status.is_ready_generation(1)


def test_state_defaults_from_ready_and_must_agree_with_it() -> None:
    worker = WorkerWithDpRank(1, 0)
    assert AttachmentStatus(1, worker, True, 0).state == "ready"
    assert AttachmentStatus(1, worker, False, 0).state == "unready"
    with pytest.raises(ValueError, match="contradicts"):
        AttachmentStatus(1, worker, True, 0, "degraded")
    with pytest.raises(ValueError, match="unknown attachment state"):
        AttachmentStatus(1, worker, False, 0, "sleepy")


def test_a_status_without_state_is_read_from_ready() -> None:
    attachment = ATTACHED.to_json()["attachment"]
    assert isinstance(attachment, dict)
    legacy = {key: value for key, value in attachment.items() if key != "state"}
    assert AttachmentStatus.from_json(legacy).state == "ready"
    assert AttachmentStatus.from_json({**legacy, "ready": False}).state == "unready"


def test_attachment_status_json_round_trips() -> None:
    attachment = ATTACHED.attachment
    assert attachment is not None
    assert AttachmentStatus.from_json(attachment.to_json()) == attachment


def _malformed() -> list[object]:
    good = ATTACHED.to_json()
    attachment = dict(good["attachment"])  # type: ignore[call-overload]
    return [
        None,
        [],
        {key: value for key, value in good.items() if key != "outbound_cursor"},
        {**good, "outbound_cursor": -1},
        {**good, "outbound_cursor": 1 << 64},
        {**good, "outbound_cursor": "40"},
        {**good, "cache_owner_ready": 1},
        {**good, "attachment": []},
        {**good, "attachment": {**attachment, "generation": True}},
        {**good, "attachment": {**attachment, "worker": {"worker_id": 17}}},
        {**good, "attachment": {**attachment, "state": "sleepy"}},
        {**good, "attachment": {**attachment, "state": 1}},
        {**good, "attachment": {**attachment, "state": "degraded"}},
        {**good, "attachment": {**attachment, "ready": False}},
    ]


@pytest.mark.parametrize("value", _malformed())
def test_a_malformed_status_raises_codec_error_naming_the_field(value: object) -> None:
    with pytest.raises(CodecError, match="status"):
        AgentStatus.from_json(value)


@pytest.mark.parametrize("value", [*_malformed(), {**ATTACHED.to_json(), "identity": {"publisher_id": 1}}])
def test_the_client_reports_a_malformed_status_as_a_bad_response(value: object) -> None:
    with pytest.raises(RecoveryClientError) as raised:
        agent_status_from_json(value)
    assert raised.value.code == "bad_response"


def test_a_bad_identity_keeps_its_identity_error() -> None:
    with pytest.raises(IdentityError):
        AgentStatus.from_json({**ATTACHED.to_json(), "identity": {"publisher_id": 1}})
