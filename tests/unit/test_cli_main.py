"""The top-level ``kvagent`` command: bare, ``--version``, ``--log-level``."""

from __future__ import annotations

import importlib.metadata

import pytest

from kvagent import _native
from kvagent.cli.config import structure_serve_config
from kvagent.cli.main import build_parser, main, serve_config_from_args
from kvagent.model.errors import ConfigError


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
