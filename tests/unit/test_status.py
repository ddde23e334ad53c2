"""Status values and their JSON, both ways (the websocket ``status`` op)."""

from __future__ import annotations

import json

import pytest

from kvagent.model.errors import CodecError, IdentityError
from kvagent.model.events import WorkerWithDpRank
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.recovery.client import RecoveryClientError, agent_status_from_json
from tests.support.ids import IDENTITY

ATTACHED = AgentStatus(
    IDENTITY,
    AttachmentStatus(7, WorkerWithDpRank(17, 3), True, 12),
    cache_owner_ready=False,
    outbound_cursor=40,
)


@pytest.mark.parametrize("status", [AgentStatus(IDENTITY), ATTACHED])
def test_status_json_round_trips(status: AgentStatus) -> None:
    assert AgentStatus.from_json(json.loads(json.dumps(status.to_json()))) == status


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
