"""The top-level ``kvagent`` command: bare, ``--version``, ``--log-level``, ``--ingest-budget``."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from kvagent import _native
from kvagent.cli.config import ServeConfig, structure_serve_config
from kvagent.cli.main import build_parser, main, serve_config_from_args
from kvagent.model.errors import ConfigError
from kvagent.vllm.listener import ListenerOptions


def test_a_bare_kvagent_prints_the_whole_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    for command in ("serve", "query", "slot-id"):
        assert command in err
    assert "--version" in err


def test_version_names_the_installed_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    expected = f"kvagent {importlib.metadata.version('kvagent')}, native core: {_native.describe()}"
    assert capsys.readouterr().out.strip() == expected
    assert expected.endswith(", native core: yes") == _native.NATIVE


def test_log_level_from_the_command_line_and_its_default() -> None:
    parser = build_parser()
    chosen = serve_config_from_args(parser.parse_args(["serve", "--slot", "s", "--log-level", "debug"]))
    assert chosen.log_level == "debug"
    assert serve_config_from_args(parser.parse_args(["serve", "--slot", "s"])).log_level == "info"


def test_an_unknown_log_level_in_a_config_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="log_level: must be one of debug, info, warning, error"):
        structure_serve_config({"slots": [{"name": "s"}], "log_level": "verbose"})


def test_coalesce_window_reaches_each_slots_listener_and_is_checked() -> None:
    from kvagent.cli.serve import slot_agent_config

    parser = build_parser()
    default = serve_config_from_args(parser.parse_args(["serve", "--slot", "s"]))
    assert default.coalesce_window == 0.02
    chosen = serve_config_from_args(parser.parse_args(["serve", "--slot", "s", "--coalesce-window", "0"]))
    agent = slot_agent_config(chosen.slots[0], chosen, recovery_url="ws://127.0.0.1:1/v1/slots/s")
    assert agent.listener.coalesce_window == 0.0
    with pytest.raises(ConfigError, match="coalesce_window"):
        serve_config_from_args(parser.parse_args(["serve", "--slot", "s", "--coalesce-window", "-1"]))


def test_ingest_budget_takes_a_byte_size_from_the_command_line_or_toml_and_reaches_each_listener(
    tmp_path: Path,
) -> None:
    from kvagent.cli.serve import slot_agent_config

    parser = build_parser()

    def listener_budget(config: ServeConfig) -> int:
        agent = slot_agent_config(config.slots[0], config, recovery_url="ws://127.0.0.1:1/v1/slots/s")
        return agent.listener.ingress_bytes

    default = serve_config_from_args(parser.parse_args(["serve", "--slot", "s"]))
    assert listener_budget(default) == ListenerOptions().ingress_bytes == 64 << 20
    for text, expected in (("256MiB", 256 << 20), ("100 MB", 100_000_000), ("40000000", 40_000_000)):
        chosen = serve_config_from_args(parser.parse_args(["serve", "--slot", "s", "--ingest-budget", text]))
        assert listener_budget(chosen) == expected, text
    path = tmp_path / "kvagent.toml"
    for value, expected in (('"1GiB"', 1 << 30), ("50000000", 50_000_000)):
        path.write_text(f'ingest_budget = {value}\n[[slots]]\nname = "s"\n')
        from_file = serve_config_from_args(parser.parse_args(["serve", "--config", str(path)]))
        assert listener_budget(from_file) == expected
        overridden = ["serve", "--config", str(path), "--ingest-budget", "128MiB"]
        assert serve_config_from_args(parser.parse_args(overridden)).ingest_budget == 128 << 20


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"ingest_budget": "16MiB"},
            "ingest_budget: must be at least 32MiB (4 x the largest vLLM payload a listener accepts, 8MiB), "
            "got 16MiB",
        ),
        ({"ingest_budget": 1000}, "ingest_budget: must be at least 32MiB"),
        (
            {"ingest_budget": "lots"},
            "ingest_budget: expected a byte size like 64MiB, 512kB or 67108864, got 'lots'",
        ),
        ({"ingest_budget": 1.5}, "ingest_budget: expected a byte size like 64MiB or an integer, got 1.5"),
    ],
)
def test_an_ingest_budget_below_four_payloads_or_not_a_size_is_one_error(
    data: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        structure_serve_config({"slots": [{"name": "s"}], **data})
    assert str(raised.value).startswith(message)
    assert len(raised.value.errors) == 1


def test_the_least_ingest_budget_is_what_the_listener_accepts() -> None:
    least = 4 * ListenerOptions().max_payload_bytes
    assert structure_serve_config({"slots": [{"name": "s"}], "ingest_budget": least}).ingest_budget == least
    ListenerOptions(ingress_bytes=least)  # the listener agrees
    with pytest.raises(ValueError, match="at least 4 x max_payload_bytes"):
        ListenerOptions(ingress_bytes=least - 1)
    with pytest.raises(ConfigError):
        structure_serve_config({"slots": [{"name": "s"}], "ingest_budget": least - 1})


def test_shed_after_reaches_each_listener_and_refuses_a_negative_wait() -> None:
    from kvagent.cli.serve import slot_agent_config

    parser = build_parser()

    def listener_shed_after(*argv: str) -> float:
        config = serve_config_from_args(parser.parse_args(["serve", "--slot", "s", *argv]))
        return slot_agent_config(
            config.slots[0], config, recovery_url="ws://127.0.0.1:1/v1/slots/s"
        ).listener.shed_after

    # serve and an embedded agent both wait before they shed (a burst waits in the engine's send queue)
    assert listener_shed_after() == 5.0 == ListenerOptions().shed_after
    assert listener_shed_after("--shed-after", "0") == 0.0
    assert listener_shed_after("--shed-after", "inf") == float("inf")
    with pytest.raises(ConfigError, match="shed_after"):
        listener_shed_after("--shed-after", "-1")
