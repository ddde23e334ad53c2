"""``kvagent serve`` options of #19: the per-slot ``--slot`` grammar, ``--model``, ``--advertise``, etcd options
and ``--silence-warning`` — from the command line (and TOML) to the config the slots run with."""

from __future__ import annotations

import argparse
import shlex
import tomllib
from pathlib import Path

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from kvagent.cli.config import (
    SIMULATED_MODEL,
    EtcdSettings,
    ServeConfig,
    SlotSpec,
    discovery_options,
    load_config_file,
    parse_slot_spec,
    resolve_cache_owner_id,
    structure_serve_config,
    warn_if_models_unnamed,
)
from kvagent.cli.main import build_parser, serve_config_from_args
from kvagent.cli.serve import slot_agent_config
from kvagent.model.errors import ConfigError, IdentityError
from kvagent.model.ids import derive_cache_owner_id
from tests.support.ids import OWNER_TEXT

FULL = "gpu0=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,worker=7,rank=0"


def config_of(*argv: str) -> ServeConfig:
    """The config of ``kvagent serve ARGV`` (memory discovery unless ARGV or its --config chooses one)."""
    default = [] if "--discovery" in argv or "--config" in argv else ["--discovery", "memory"]
    return serve_config_from_args(build_parser().parse_args(["serve", *default, *argv]))


def refused(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        config_of(*argv)
    return str(info.value)


# -- the grammar -----------------------------------------------------------------------------------


def test_the_full_slot_form_parses_every_key() -> None:
    assert parse_slot_spec(FULL) == SlotSpec(
        name="gpu0",
        endpoint="tcp://127.0.0.1:5557",
        replay="tcp://127.0.0.1:5558",
        worker=7,
        rank=0,
    )
    assert parse_slot_spec("s=tcp://h:1,topic=kv,model=llama") == SlotSpec(
        name="s", endpoint="tcp://h:1", topic="kv", model="llama"
    )
    assert parse_slot_spec("s=tcp://h:1,topic=") == SlotSpec(name="s", endpoint="tcp://h:1", topic="")


def test_the_old_forms_keep_working() -> None:
    assert parse_slot_spec("decode-0") == SlotSpec(name="decode-0")
    assert parse_slot_spec("a=ipc:///tmp/x=y") == SlotSpec(name="a", endpoint="ipc:///tmp/x=y")
    # A comma that does not start a KEY= stays in the endpoint (or the name).
    assert parse_slot_spec("a=ipc:///tmp/x,y") == SlotSpec(name="a", endpoint="ipc:///tmp/x,y")
    assert parse_slot_spec("a,b") == SlotSpec(name="a,b")
    assert parse_slot_spec("s,rank=3,model=m") == SlotSpec(name="s", rank=3, model="m")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "gpu0=tcp://h:1,replya=tcp://h:2",
            "unknown key 'replya' (known: replay, worker, rank, topic, model)",
        ),
        ("gpu0=tcp://h:1,worker=1,worker=2", "worker is given twice"),
        ("gpu0=tcp://h:1,worker=seven", "worker must be an integer 0..18446744073709551615, got 'seven'"),
        ("gpu0=tcp://h:1,worker=-1", "worker must be an integer"),
        ("gpu0=tcp://h:1,rank=4294967296", "rank must be an integer 0..4294967295"),
        ("gpu0=tcp://h:1,replay=", "replay needs a value"),
        (
            "gpu0,worker=7",
            "worker configures the engine, so the slot needs one: gpu0=tcp://HOST:PORT,worker=7",
        ),
        ("gpu0,replay=tcp://h:2", "replay configures the engine"),
        ("=tcp://h:1,worker=1", "slot name must not be empty"),
        ("", "slot name must not be empty"),
        ("=tcp://h:1", "slot name must not be empty"),
        ("a=,worker=1", "engine endpoint after '=' must not be empty"),
        ("a=", "engine endpoint after '=' must not be empty"),
    ],
)
def test_bad_slot_texts_are_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_slot_spec(text)
    assert str(info.value).startswith(f"--slot {text!r}: ")
    assert message in str(info.value)


_names = st.text(st.characters(blacklist_characters="=,/", codec="utf-8"), min_size=1, max_size=12)
_optional_int = st.none() | st.integers(0, 2**32 - 1)


@given(
    name=_names,
    port=st.integers(1, 65535),
    replay_port=st.none() | st.integers(1, 65535),
    worker=_optional_int,
    rank=_optional_int,
    topic=st.none() | st.text(st.characters(blacklist_characters=",", codec="utf-8"), max_size=8),
    model=st.none() | st.from_regex(r"[A-Za-z0-9._/-]{1,12}", fullmatch=True),
    order=st.permutations(["replay", "worker", "rank", "topic", "model"]),
)
def test_any_combination_of_keys_in_any_order_round_trips(
    name: str,
    port: int,
    replay_port: int | None,
    worker: int | None,
    rank: int | None,
    topic: str | None,
    model: str | None,
    order: list[str],
) -> None:
    expected = SlotSpec(
        name=name,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay=None if replay_port is None else f"tcp://127.0.0.1:{replay_port}",
        worker=worker,
        rank=rank,
        topic=topic,
        model=model,
    )
    pairs = [f"{key}={getattr(expected, key)}" for key in order if getattr(expected, key) is not None]
    assert parse_slot_spec(",".join([f"{name}={expected.endpoint}", *pairs])) == expected


# -- per-slot values and the global defaults -------------------------------------------------------


def test_per_slot_keys_reach_each_slot_and_globals_fill_the_rest() -> None:
    config = config_of(
        "--slot", FULL,
        "--slot", "gpu1=tcp://127.0.0.1:6557,replay=tcp://127.0.0.1:6558,worker=8,rank=1,topic=t1",
        "--topic", "kv",
    )  # fmt: skip
    first, second = config.slots
    assert (first.dp_rank, second.dp_rank) == (0, 1)
    assert first.engine is not None and second.engine is not None
    assert (first.engine.replay_endpoint, first.engine.worker_id, first.engine.topic) == (
        "tcp://127.0.0.1:5558", 7, "kv"
    )  # fmt: skip
    assert (second.engine.replay_endpoint, second.engine.worker_id, second.engine.topic) == (
        "tcp://127.0.0.1:6558", 8, "t1"
    )  # fmt: skip


def test_a_single_slot_takes_the_global_flags_as_before() -> None:
    config = config_of(
        "--slot", "s=tcp://127.0.0.1:5557", "--replay", "tcp://127.0.0.1:5558", "--worker-id", "9", "--dp-rank", "2"
    )  # fmt: skip
    (slot,) = config.slots
    assert slot.engine is not None
    assert (slot.engine.replay_endpoint, slot.engine.worker_id, slot.dp_rank) == (
        "tcp://127.0.0.1:5558",
        9,
        2,
    )


@pytest.mark.parametrize(
    ("flag", "value", "key"),
    [
        ("--replay", "tcp://127.0.0.1:5558", "replay"),
        ("--worker-id", "7", "worker"),
        ("--dp-rank", "1", "rank"),
    ],
)
def test_a_global_engine_flag_two_slots_would_share_is_refused(flag: str, value: str, key: str) -> None:
    message = refused("--slot", "a=tcp://127.0.0.1:1", "--slot", "b=tcp://127.0.0.1:2", flag, value)
    assert message.startswith(
        f"{flag} {value} would apply to every one of slots a, b: set it per slot instead"
    )
    assert f",{key}=...'" in message
    # Every slot setting its own makes the global a default nobody uses: accepted.
    config = config_of(
        "--slot", f"a=tcp://127.0.0.1:1,{key}={value}", "--slot", f"b=tcp://127.0.0.1:2,{key}={value}", flag, value
    )  # fmt: skip
    assert len(config.slots) == 2
    # One slot left to the default is a default, not a shared value.
    config = config_of(
        "--slot", f"a=tcp://127.0.0.1:1,{key}={value}", "--slot", "b=tcp://127.0.0.1:2", flag, value
    )
    assert len(config.slots) == 2


def test_engine_flags_do_not_count_slots_without_an_engine_but_dp_rank_does() -> None:
    config = config_of("--slot", "a=tcp://127.0.0.1:1", "--slot", "b", "--worker-id", "7")
    assert config.slots[0].engine is not None and config.slots[0].engine.worker_id == 7
    assert config.slots[1].engine is None
    assert "--dp-rank 3 would apply to every one of slots a, b" in refused(
        "--slot", "a", "--slot", "b", "--dp-rank", "3"
    )


def test_dp_rank_over_several_config_file_slots_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvagent.toml"
    path.write_text('[[slots]]\nname = "a"\n[[slots]]\nname = "b"\ndp_rank = 1\n')
    assert refused("--config", str(path), "--dp-rank", "2").startswith(
        "--dp-rank 2 would apply to all 2 [[slots]]"
    )
    path.write_text('[[slots]]\nname = "a"\n')
    assert config_of("--config", str(path), "--dp-rank", "2").slots[0].dp_rank == 2


# -- --model and the CacheOwnerId ------------------------------------------------------------------

DEMO_DEFAULT_ID = "ca8ed73fce11e9fdc547145070b9d5b7:7b61e56677a8609fec55d20fb2e1d8aa/0000000000000000/18dc76520abaaa80a95ee869a5e94196"


def test_the_model_enters_the_derived_id_as_cache_semantics_material() -> None:
    plain = derive_cache_owner_id("demo", kv_block_size=16)
    assert str(plain) == DEMO_DEFAULT_ID  # without a model: unchanged
    llama = derive_cache_owner_id("demo", kv_block_size=16, model="llama")
    assert llama == derive_cache_owner_id("demo", kv_block_size=16, cache_semantics={"model": "llama"})
    assert llama.pool != plain.pool and llama.slot == plain.slot
    assert derive_cache_owner_id("demo", kv_block_size=16, model="qwen").pool != llama.pool
    both = derive_cache_owner_id("demo", kv_block_size=16, cache_semantics={"dtype": "bf16"}, model="llama")
    assert both == derive_cache_owner_id(
        "demo", kv_block_size=16, cache_semantics={"dtype": "bf16", "model": "llama"}
    )
    with pytest.raises(IdentityError, match="cache semantics say model 'a' but the slot serves model 'b'"):
        derive_cache_owner_id("demo", kv_block_size=16, cache_semantics={"model": "a"}, model="b")


def test_model_from_the_command_line_per_slot_and_from_the_simulator() -> None:
    config = config_of("--slot", "a", "--slot", "b,model=qwen", "--model", "llama")
    assert [slot.model for slot in config.slots] == ["llama", "qwen"]
    ids = [resolve_cache_owner_id(slot) for slot in config.slots]
    assert ids[0] == derive_cache_owner_id("a", kv_block_size=16, model="llama")
    assert ids[1] == derive_cache_owner_id("b", kv_block_size=16, model="qwen")
    simulated = config_of("--slot", "demo", "--simulate").slots[0]
    assert simulated.model == SIMULATED_MODEL
    assert config_of("--slot", "demo", "--simulate", "--model", "m").slots[0].model == "m"
    assert config_of("--slot", "demo").slots[0].model is None
    assert str(resolve_cache_owner_id(config_of("--slot", "demo").slots[0])) == DEMO_DEFAULT_ID


def test_an_explicit_cache_owner_id_stays_exactly_as_given() -> None:
    for argv in (("--model", "llama"), ("--simulate",), ()):
        slot = config_of("--slot", "demo", "--cache-owner-id", OWNER_TEXT, *argv).slots[0]
        assert str(resolve_cache_owner_id(slot)) == OWNER_TEXT


def test_a_model_contradicting_the_cache_semantics_is_refused() -> None:
    message = refused("--slot", "a", "--model", "b", "--cache-semantics", "model=a")
    assert message == "slots[0].model: cache semantics say model 'a' but the slot serves model 'b'"
    assert refused("--slot", "a", "--model", "m" * 1025).startswith(
        "slots[0].model: identity value for 'model'"
    )
    same = config_of("--slot", "a", "--model", "a", "--cache-semantics", "model=a").slots[0]
    assert resolve_cache_owner_id(same) == derive_cache_owner_id(
        "a", kv_block_size=16, cache_semantics={"model": "a"}
    )


def test_model_in_toml_top_level_and_per_slot_and_the_cli_overrides_the_default(tmp_path: Path) -> None:
    path = tmp_path / "kvagent.toml"
    path.write_text('model = "llama"\n[[slots]]\nname = "a"\n[[slots]]\nname = "b"\nmodel = "qwen"\n')
    loaded = load_config_file(path)
    assert [slot.model for slot in loaded.slots] == ["llama", "qwen"]
    assert structure_serve_config(loaded.to_dict()) == loaded
    overridden = config_of("--config", str(path), "--model", "mistral")
    assert [slot.model for slot in overridden.slots] == ["mistral", "qwen"]


def test_one_warning_names_every_slot_whose_id_has_no_model() -> None:
    config = config_of(
        "--slot", "a", "--slot", "b,model=m", "--slot", "c", "--cache-semantics", "x=y",
    )  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        assert warn_if_models_unnamed(config) == ["a", "c"]
    assert [(entry["event"], entry["log_level"], entry["slots"]) for entry in logs] == [
        ("cache_owner_id_without_model", "warning", ["a", "c"])
    ]
    assert "--model" in logs[0]["hint"]
    for quiet in (
        config_of("--slot", "a", "--model", "m"),
        config_of("--slot", "a", "--cache-owner-id", OWNER_TEXT),
    ):
        with structlog.testing.capture_logs() as logs:
            assert warn_if_models_unnamed(quiet) == []
        assert logs == []


# -- --advertise, --listen -------------------------------------------------------------------------


def test_advertise_from_the_command_line_and_toml(tmp_path: Path) -> None:
    assert config_of("--slot", "s", "--advertise", "node-3.example").advertise == "node-3.example"
    assert config_of("--slot", "s", "--advertise", "::1").advertise == "::1"
    assert config_of("--slot", "s", "--advertise", "[fd00::5]").advertise == "[fd00::5]"
    path = tmp_path / "kvagent.toml"
    path.write_text('advertise = "10.0.0.7"\n[[slots]]\nname = "s"\n')
    assert load_config_file(path).advertise == "10.0.0.7"


@pytest.mark.parametrize("bad", ["0.0.0.0", "::", "*", "host:8765", "ws://host", "a host", ""])
def test_a_bad_advertise_host_is_refused(bad: str) -> None:
    assert refused("--slot", "s", "--advertise", bad).startswith("advertise: ")


def test_listen_takes_bracketed_ipv6_and_explains_a_bare_one() -> None:
    assert config_of("--slot", "s", "--listen", "[::1]:8765").listen == "[::1]:8765"
    assert refused("--slot", "s", "--listen", "::1:8765") == (
        "listen: expected HOST:PORT with an IPv6 host in brackets (like [::1]:8765), got '::1:8765'"
    )


# -- etcd options ----------------------------------------------------------------------------------

ETCD = ("--slot", "s", "--discovery", "etcds://127.0.0.1:2379/kv")


def test_etcd_options_from_the_command_line_reach_open_discovery(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    config = config_of(
        *ETCD,
        "--etcd-ttl", "4", "--etcd-user", "kv", "--etcd-password-file", str(secret),
        "--etcd-ca", "/ca.pem", "--etcd-cert", "/c.pem", "--etcd-key", "/k.pem",
    )  # fmt: skip
    assert config.etcd == EtcdSettings(
        ttl=4.0,
        username="kv",
        password_file=str(secret),
        ca_file="/ca.pem",
        cert_file="/c.pem",
        key_file="/k.pem",
    )
    assert discovery_options(config) == {
        "ttl": 4.0,
        "username": "kv",
        "password": "s3cret",
        "ca_file": "/ca.pem",
        "cert_file": "/c.pem",
        "key_file": "/k.pem",
    }
    assert "s3cret" not in repr(config.to_dict())  # only the file's path is configuration
    assert discovery_options(config_of("--slot", "s")) == {}


def test_etcd_options_from_toml_and_the_cli_overrides_key_by_key(tmp_path: Path) -> None:
    path = tmp_path / "kvagent.toml"
    path.write_text(
        'discovery = "etcd://127.0.0.1:2379"\n[etcd]\nttl = 5\nusername = "kv"\npassword_file = "/pw"\n'
        '[[slots]]\nname = "s"\n'
    )
    assert load_config_file(path).etcd == EtcdSettings(ttl=5.0, username="kv", password_file="/pw")
    assert config_of("--config", str(path), "--etcd-ttl", "3").etcd == EtcdSettings(
        ttl=3.0, username="kv", password_file="/pw"
    )
    path.write_text(
        'discovery = "etcd://127.0.0.1:2379"\n[etcd]\nttl = 5\nuser = "kv"\n[[slots]]\nname = "s"\n'
    )
    with pytest.raises(ConfigError, match=r"etcd: unknown keys: user"):
        load_config_file(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--slot", "s", "--discovery", "memory", "--etcd-ttl", "5"),
            "etcd.ttl (--etcd-ttl): needs an etcd:// or etcds:// discovery URL, discovery is 'memory'",
        ),
        (ETCD + ("--etcd-ttl", "0.5"), "etcd.ttl (--etcd-ttl): must be at least 1 second, got 0.5"),
        (
            ETCD + ("--etcd-user", "kv"),
            "etcd.username (--etcd-user) and etcd.password_file (--etcd-password-file) go together",
        ),
        (
            ("--slot", "s", "--discovery", "etcd://h:2379", "--etcd-ca", "/ca.pem"),
            "etcd.ca_file (--etcd-ca): TLS files need an etcds:// discovery URL",
        ),
        (ETCD + ("--etcd-key", "/k.pem"), "etcd.key_file (--etcd-key): needs etcd.cert_file (--etcd-cert)"),
    ],
)
def test_inconsistent_etcd_options_are_refused_naming_the_flag(argv: tuple[str, ...], message: str) -> None:
    assert refused(*argv) == message


def test_an_unreadable_or_empty_password_file_is_one_config_error(tmp_path: Path) -> None:
    missing = config_of(*ETCD, "--etcd-user", "kv", "--etcd-password-file", str(tmp_path / "none"))
    with pytest.raises(ConfigError) as info:
        discovery_options(missing)
    assert str(info.value) == (
        f"etcd.password_file (--etcd-password-file): cannot read {tmp_path / 'none'}: No such file or directory"
    )
    (tmp_path / "empty").write_text("\n")
    empty = config_of(*ETCD, "--etcd-user", "kv", "--etcd-password-file", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="is empty"):
        discovery_options(empty)


# -- --silence-warning -----------------------------------------------------------------------------


def test_silence_warning_reaches_every_slot_agent(tmp_path: Path) -> None:
    config = config_of("--slot", "a", "--slot", "b", "--silence-warning", "7.5", "--state-dir", "none")
    assert config.silence_warning == 7.5
    agents = [slot_agent_config(slot, config, recovery_url="ws://h:1/v1/slots/x") for slot in config.slots]
    assert [agent.silence_warning for agent in agents] == [7.5, 7.5]
    default = config_of("--slot", "a", "--state-dir", "none")
    assert slot_agent_config(default.slots[0], default, recovery_url="ws://h:1").silence_warning == 60.0
    assert refused("--slot", "a", "--silence-warning", "0") == "silence_warning: must be > 0, got 0.0"
    path = tmp_path / "kvagent.toml"
    path.write_text('silence_warning = 15\n[[slots]]\nname = "s"\n')
    assert load_config_file(path).silence_warning == 15.0


def test_slot_agents_advertise_a_reachable_publish_endpoint() -> None:
    config = config_of(
        "--slot", "a", "--publish", "tcp://*:5600", "--advertise", "node-3", "--state-dir", "none"
    )
    agent = slot_agent_config(config.slots[0], config, recovery_url="ws://node-3:1/v1/slots/a")
    assert agent.kv_state_endpoint == "tcp://node-3:5600"
    local = config_of("--slot", "a", "--state-dir", "none")
    assert slot_agent_config(local.slots[0], local, recovery_url="ws://h:1").kv_state_endpoint == "ws://h:1"


# -- the documented examples -----------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _toml_blocks(page: str) -> list[str]:
    text = (DOCS / page).read_text()
    return [block.split("```", 1)[0] for block in text.split("```toml\n")[1:]]


def test_the_documented_toml_examples_load_as_documented() -> None:
    (example,) = _toml_blocks("configuration.md")
    config = structure_serve_config(tomllib.loads(example))
    assert [(slot.name, slot.model, slot.dp_rank) for slot in config.slots] == [
        ("gpu0", "meta-llama/Llama-3.1-8B", 0),
        ("gpu1", "Qwen/Qwen2.5-7B", 1),
    ]
    assert (config.advertise, config.listen, config.etcd.username) == (
        "node-3.example",
        "[::]:8765",
        "kvagent",
    )
    (options,) = _toml_blocks("discovery.md")
    etcd = structure_serve_config({**tomllib.loads(options), "slots": [{"name": "s"}]}).etcd
    assert etcd == EtcdSettings(
        ttl=10.0,
        username="kvagent",
        password_file="/etc/kvagent/etcd-password",
        ca_file="/etc/kvagent/etcd-ca.pem",
        cert_file="/etc/kvagent/client.pem",
        key_file="/etc/kvagent/client-key.pem",
    )


def test_the_readme_multi_slot_command_parses() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    command = readme.split("### Several slots / identity", 1)[1].split("```\n", 2)[1]
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == ["kvagent", "serve"]
    config = config_of(*argv[2:])
    assert [(slot.name, slot.dp_rank, slot.model) for slot in config.slots] == [
        ("gpu0", 0, "meta-llama/Llama-3.1-8B"),
        ("gpu1", 1, "meta-llama/Llama-3.1-8B"),
    ]
    assert [slot.engine.worker_id for slot in config.slots if slot.engine] == [7, 8]


def test_every_serve_flag_explains_itself() -> None:
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    serve = subparsers.choices["serve"]
    assert [action.option_strings for action in serve._actions if not action.help] == []
