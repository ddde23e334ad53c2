"""Republish options: ``[slots.republish]`` in TOML, the ``--republish*`` flags, and what a slot is given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvagent.cli.config import RepublishSettings, load_config_file, structure_serve_config
from kvagent.cli.main import build_parser, serve_config_from_args
from kvagent.cli.serve import slot_agent_config
from kvagent.model.errors import ConfigError
from kvagent.model.status import AgentStatus, RepublishStatus
from kvagent.publish.republisher import RepublishConfig
from tests.support.ids import IDENTITY

TOML = """
discovery = "memory"

[[slots]]
name = "r0"
dp_rank = 0

[slots.republish]
endpoint = "tcp://*:5557"
replay_endpoint = "tcp://*:5600"
topic = "kv-events"
legacy_replay = true
buffer_batches = 500

[[slots]]
name = "r1"
dp_rank = 1

[slots.republish]
endpoint = "tcp://*:5557"
replay_endpoint = "tcp://*:5600"
"""


def serve_args(*args: str) -> Any:
    return serve_config_from_args(build_parser().parse_args(["serve", *args]))


def test_toml_republish_table_reaches_the_slot_agent_config(tmp_path: Path) -> None:
    path = tmp_path / "kvagent.toml"
    path.write_text(TOML)
    config = load_config_file(path)
    first, second = config.slots
    assert first.republish == RepublishSettings(
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5600",
        topic="kv-events",
        legacy_replay=True,
        buffer_batches=500,
    )
    agent_config = slot_agent_config(first, config, recovery_url="ws://x/v1/slots/r0")
    assert agent_config.republish == RepublishConfig(
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5600",
        topic="kv-events",
        legacy_replay=True,
        buffer_batches=500,
    )
    # The slot of dp_rank 1 binds PORT + 1, as vLLM's rank 1 would.
    shifted = slot_agent_config(second, config, recovery_url="ws://x").republish
    assert shifted is not None
    assert shifted.for_rank(second.dp_rank).endpoint == "tcp://*:5558"
    assert structure_serve_config(config.to_dict()) == config


@pytest.mark.parametrize(
    ("republish", "message"),
    [
        ({"endpoint": "http://x:1"}, "slots[0].republish.endpoint: expected tcp://HOST:PORT"),
        ({"endpoint": "tcp://*:1", "replay_endpoint": "tcp://x"}, "slots[0].republish.replay_endpoint"),
        ({"endpoint": "tcp://*:1", "buffer_batches": 0}, "slots[0].republish.buffer_batches: must be > 0"),
        ({"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:1"}, "must differ from endpoint"),
        ({"endpoint": "tcp://*:1", "legacy": True}, "slots[0].republish: unknown keys: legacy"),
        ({"replay_endpoint": "tcp://*:1"}, "slots[0].republish.endpoint"),
        ({"endpoint": 5}, "slots[0].republish.endpoint: expected a string"),
        ({"endpoint": "tcp://*:1", "legacy_replay": "yes"}, "expected true or false"),
    ],
)
def test_bad_republish_tables_name_their_key(republish: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        structure_serve_config({"slots": [{"name": "a", "republish": republish}]})
    assert message in str(raised.value)


def test_ipc_republish_cannot_be_offset_past_rank_zero() -> None:
    structure_serve_config({"slots": [{"name": "a", "republish": {"endpoint": "ipc:///tmp/kv"}}]})
    with pytest.raises(ConfigError, match="cannot be offset by dp_rank 1"):
        structure_serve_config(
            {"slots": [{"name": "a", "dp_rank": 1, "republish": {"endpoint": "ipc:///tmp/kv"}}]}
        )


def test_colliding_offset_ports_are_refused() -> None:
    # vLLM's trap: PUB P and replay P+1 collide for rank 1 (its PUB lands on rank 0's replay port).
    slots = [
        {
            "name": "a",
            "dp_rank": 0,
            "republish": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
        },
        {
            "name": "b",
            "dp_rank": 1,
            "republish": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
        },
    ]
    with pytest.raises(ConfigError) as raised:
        structure_serve_config({"slots": slots})
    assert (
        "slots[1].republish.endpoint: tcp://*:5558 is also bound by slots[0].republish.replay_endpoint"
        in str(raised.value)
    )
    ephemeral = [
        {"name": name, "republish": {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}}
        for name in ("a", "b")
    ]
    structure_serve_config({"slots": ephemeral})  # port 0 never collides


def test_republish_flags_apply_to_every_slot() -> None:
    config = serve_args(
        "--slot",
        "a",
        "--slot",
        "b=tcp://127.0.0.1:5557",
        "--republish",
        "tcp://127.0.0.1:0",
        "--republish-replay",
        "tcp://127.0.0.1:0",
        "--republish-topic",
        "kv",
        "--legacy-replay",
    )
    expected = RepublishSettings("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "kv", True)
    assert [slot.republish for slot in config.slots] == [expected, expected]
    plain = serve_args("--slot", "a")
    assert plain.slots[0].republish is None


def test_republish_flags_override_the_file_key_by_key(tmp_path: Path) -> None:
    path = tmp_path / "kvagent.toml"
    path.write_text(TOML)
    config = serve_args("--config", str(path), "--republish-topic", "other")
    assert [slot.republish.topic for slot in config.slots if slot.republish] == ["other", "other"]
    assert config.slots[0].republish is not None and config.slots[0].republish.legacy_replay is True
    moved = serve_args("--config", str(path), "--republish", "tcp://*:7000")
    assert [slot.republish.endpoint for slot in moved.slots if slot.republish] == ["tcp://*:7000"] * 2


def test_republish_refinements_need_an_endpoint() -> None:
    with pytest.raises(ConfigError, match="need --republish"):
        serve_args("--slot", "a", "--republish-replay", "tcp://127.0.0.1:0")
    with pytest.raises(ConfigError, match="slots\\[0\\].republish.endpoint"):
        serve_args("--slot", "a", "--republish", "udp://x:1")


def test_status_json_shows_republish_only_when_set() -> None:
    plain = AgentStatus(IDENTITY)
    assert "republish" not in plain.to_json()
    status = AgentStatus(IDENTITY, republish=RepublishStatus("tcp://127.0.0.1:5", "tcp://127.0.0.1:6", 41))
    assert status.to_json()["republish"] == {
        "endpoint": "tcp://127.0.0.1:5",
        "replay_endpoint": "tcp://127.0.0.1:6",
        "seq": 41,
    }
    assert AgentStatus.from_json(status.to_json()) == status
    fresh = AgentStatus(IDENTITY, republish=RepublishStatus("tcp://h:1"))
    assert AgentStatus.from_json(fresh.to_json()) == fresh
