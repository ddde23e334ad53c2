"""The serve configuration: TOML loading, cattrs structuring and validation messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvagent.cli.config import (
    EngineConfig,
    ServeConfig,
    SlotConfig,
    default_state_dir,
    load_config_file,
    resolve_cache_owner_id,
    structure_serve_config,
)
from kvagent.model.errors import ConfigError
from kvagent.model.ids import CacheOwnerId, derive_cache_owner_id
from tests.support.ids import OWNER_TEXT

GOOD_TOML = f"""
listen = "127.0.0.1:0"
discovery = "memory"
publish = "tcp://*:5600"
metrics = "127.0.0.1:9100"
log_format = "json"
max_connections = 8
status_interval = 0.5
rcvhwm = 0

[[slots]]
name = "decode-0"
kv_block_size = 32
dp_rank = 1
dc_id = 7
ring_capacity = 64
strict_cache_owner = true
cache_semantics = {{ model = "llama-3", dtype = "bf16" }}
routing_scope = {{ cluster = "a" }}

[slots.engine]
endpoint = "tcp://127.0.0.1:5557"
topic = "kv"
replay_endpoint = "tcp://127.0.0.1:5558"
worker_id = 18446744073709551615
image_token_id = 10

[[slots]]
name = "decode-1"
cache_owner_id = "{OWNER_TEXT}"
simulate = true
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvagent.toml"
    path.write_text(text)
    return path


def base(**slot: Any) -> dict[str, Any]:
    return {"slots": [{"name": "a", **slot}], "discovery": "memory"}


def error_of(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        structure_serve_config(data)
    return info.value


def test_good_toml_loads(tmp_path: Path) -> None:
    config = load_config_file(write(tmp_path, GOOD_TOML))
    assert config == ServeConfig(
        slots=(
            SlotConfig(
                name="decode-0",
                kv_block_size=32,
                dp_rank=1,
                dc_id=7,
                ring_capacity=64,
                strict_cache_owner=True,
                cache_semantics={"model": "llama-3", "dtype": "bf16"},
                routing_scope={"cluster": "a"},
                engine=EngineConfig(
                    endpoint="tcp://127.0.0.1:5557",
                    topic="kv",
                    replay_endpoint="tcp://127.0.0.1:5558",
                    worker_id=2**64 - 1,
                    image_token_id=10,
                ),
            ),
            SlotConfig(name="decode-1", cache_owner_id=OWNER_TEXT, simulate=True),
        ),
        listen="127.0.0.1:0",
        discovery="memory",
        publish="tcp://*:5600",
        metrics="127.0.0.1:9100",
        log_format="json",
        max_connections=8,
        status_interval=0.5,
        rcvhwm=0,
    )
    assert isinstance(config.status_interval, float)


def test_to_dict_round_trips(tmp_path: Path) -> None:
    config = load_config_file(write(tmp_path, GOOD_TOML))
    assert structure_serve_config(config.to_dict()) == config


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVAGENT_STATE_DIR", str(tmp_path / "state"))
    config = structure_serve_config({"slots": [{"name": "a"}]})
    assert config.discovery == f"file:{tmp_path / 'state' / 'discovery'}"
    assert config.listen == "127.0.0.1:8765"
    assert config.max_message_bytes == 1 << 20
    assert (config.max_connections, config.status_interval, config.shutdown_timeout) == (256, 5.0, 10.0)
    assert config.slots == (SlotConfig(name="a"),)
    slot = config.slots[0]
    assert (slot.kv_block_size, slot.ring_capacity, slot.ingress_protocol) == (16, 1024, "vllm_residency_v1")


def test_default_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVAGENT_STATE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KVAGENT_STATE_DIR")
    assert default_state_dir() == tmp_path / "xdg" / "kvagent"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "kvagent"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (base(kv_block_size=0), "slots[0].kv_block_size: must be > 0"),
        (base(kv_block_size=2**32), "slots[0].kv_block_size: must be 1..4294967295, got 4294967296"),
        (
            base(ingress_protocol="framework_v1"),
            "slots[0].ingress_protocol: external state-agent slots require vllm_residency_v1 ingress",
        ),
        (base(dp_rank=-1), "slots[0].dp_rank: must be 0..4294967295, got -1"),
        (base(dp_rank=2**32), "slots[0].dp_rank: must be 0..4294967295, got 4294967296"),
        (base(dc_id=2**64), "slots[0].dc_id: must be 0..18446744073709551615, got 18446744073709551616"),
        (base(ring_capacity=0), "slots[0].ring_capacity: must be > 0, got 0"),
        (base(name=""), "slots[0].name: must not be empty"),
        (base(name="a/b"), "slots[0].name: must be printable and contain no '/' (it is a URL path segment)"),
        (base(cache_owner_id="nope"), "slots[0].cache_owner_id: cache owner id must be"),
        (
            base(cache_owner_id=OWNER_TEXT, dc_id=3),
            "slots[0].dc_id: cannot be combined with an explicit cache_owner_id",
        ),
        (base(cache_semantics={"": "x"}), "slots[0].cache_semantics: identity key '' must be"),
        (base(engine={"endpoint": "127.0.0.1:5557"}), "slots[0].engine.endpoint: expected tcp://HOST:PORT"),
        (base(engine={"endpoint": "tcp://127.0.0.1"}), "slots[0].engine.endpoint: expected HOST:PORT"),
        (base(engine={"endpoint": "tcp://h:70000"}), "slots[0].engine.endpoint: port must be 1..65535"),
        (base(engine={"endpoint": "tcp://h:0"}), "slots[0].engine.endpoint: port must be 1..65535"),
        (
            base(engine={"endpoint": "tcp://*:5557"}),
            "slots[0].engine.endpoint: 'tcp://*:5557' is a bind address; give the address to connect to, "
            "like tcp://127.0.0.1:5557",
        ),
        (base(engine={"endpoint": "ipc://"}), "slots[0].engine.endpoint: ipc endpoint needs a name"),
        (
            base(engine={"endpoint": "inproc://e", "replay_endpoint": "udp://x:1"}),
            "slots[0].engine.replay_endpoint: expected tcp://HOST:PORT",
        ),
        (
            base(engine={"endpoint": "inproc://e", "worker_id": 2**64}),
            "slots[0].engine.worker_id: must be 0..18446744073709551615",
        ),
        (
            base(engine={"endpoint": "inproc://e", "video_token_id": -2}),
            "slots[0].engine.video_token_id: must be 0..4294967295, got -2",
        ),
        (base(engine={"endpoint": "inproc://e"}, simulate=True), "slots[0].simulate: cannot be combined"),
        (base(engine={"topic": "x"}), "slots[0].engine.endpoint: required field missing"),
        (base(kv_block_size="16"), "slots[0].kv_block_size: expected an integer, got '16'"),
        (base(kv_block_size=True), "slots[0].kv_block_size: expected an integer, got True"),
        (base(strict_cache_owner=1), "slots[0].strict_cache_owner: expected true or false, got 1"),
        (base(cache_semantics={"model": 3}), "slots[0].cache_semantics['model']: expected a string, got 3"),
        (base(engine="tcp://h:1"), "slots[0].engine: expected a table, got 'tcp://h:1'"),
        ({"slots": "a"}, "slots: expected a list (an array of tables), got 'a'"),
        ({"slots": [{}]}, "slots[0].name: required field missing"),
        ({**base(), "listen": "8765"}, "listen: expected HOST:PORT, got '8765'"),
        ({**base(), "metrics": "localhost:http"}, "metrics: expected HOST:PORT"),
        ({**base(), "publish": "tcp://*:99999"}, "publish: port must be 0..65535"),
        ({**base(), "discovery": "consul://x"}, "discovery: unknown discovery URL 'consul://x'"),
        ({**base(), "discovery": "file:"}, "discovery: discovery URL 'file:' names no directory"),
        ({**base(), "log_format": "xml"}, "log_format: must be 'text' or 'json', got 'xml'"),
        ({**base(), "max_connections": 0}, "max_connections: must be > 0, got 0"),
        ({**base(), "status_interval": -1.0}, "status_interval: must be > 0, got -1.0"),
        ({**base(), "shutdown_timeout": "soon"}, "shutdown_timeout: expected a number, got 'soon'"),
    ],
)
def test_each_validation_error_names_its_key_path(data: dict[str, Any], message: str) -> None:
    error = error_of(data)
    assert len(error.errors) == 1, error.errors
    assert str(error).startswith(message), str(error)


def test_unknown_keys_are_rejected_at_every_level() -> None:
    error = error_of(
        {
            "slots": [{"name": "a", "blocksize": 16, "engine": {"endpoint": "inproc://e", "port": 1}}],
            "listen_addr": "x",
        }
    )
    assert set(error.errors) == {
        "slots[0]: unknown keys: blocksize",
        "slots[0].engine: unknown keys: port",
        "unknown keys: listen_addr",
    }


def test_duplicate_slot_names() -> None:
    error = error_of({"slots": [{"name": "a"}, {"name": "b"}, {"name": "a"}], "discovery": "memory"})
    assert error.errors == ("slots[2].name: duplicate slot name 'a' (also slots[0])",)


def test_several_problems_are_reported_together() -> None:
    error = error_of(
        {"slots": [{"name": "a", "kv_block_size": 0}, {"name": "b", "dp_rank": -1}], "listen": "x"}
    )
    assert error.errors == (
        "slots[0].kv_block_size: must be > 0",
        "slots[1].dp_rank: must be 0..4294967295, got -1",
        "listen: expected HOST:PORT, got 'x'",
    )
    assert str(error).splitlines()[1:] == [f"  {line}" for line in error.errors]


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[[slots]]\nname = "a"\nkv_block_size = 0\n')
    with pytest.raises(ConfigError, match=r"kvagent\.toml: slots\[0\]\.kv_block_size: must be > 0$"):
        load_config_file(path)
    write(tmp_path, "[[slots]\nname = ")
    with pytest.raises(ConfigError, match=r"kvagent\.toml: invalid TOML"):
        load_config_file(path)
    with pytest.raises(ConfigError, match=r"missing\.toml: cannot read config file"):
        load_config_file(tmp_path / "missing.toml")


def test_a_file_may_leave_the_slots_to_the_command_line(tmp_path: Path) -> None:
    config = load_config_file(write(tmp_path, 'listen = "0.0.0.0:9000"\ndiscovery = "memory"\n'))
    assert config.slots == ()
    assert config.listen == "0.0.0.0:9000"


def test_resolve_cache_owner_id() -> None:
    explicit = SlotConfig(name="a", cache_owner_id=OWNER_TEXT)
    assert resolve_cache_owner_id(explicit) == CacheOwnerId.parse(OWNER_TEXT)
    derived = SlotConfig(
        name="a", kv_block_size=32, cache_semantics={"m": "x"}, routing_scope={"r": "y"}, dc_id=5
    )
    owner = resolve_cache_owner_id(derived)
    assert owner == derive_cache_owner_id(
        "a", kv_block_size=32, cache_semantics={"m": "x"}, routing_scope={"r": "y"}, dc_id=5
    )
    assert owner.pool.dc_id.value == 5
    assert resolve_cache_owner_id(SlotConfig(name="a", kv_block_size=32)) != owner
    assert resolve_cache_owner_id(SlotConfig(name="b", kv_block_size=32, dc_id=5)).slot != owner.slot
