"""The top-level ``kvagent`` command: bare, ``--version``."""

from __future__ import annotations

import importlib.metadata

import pytest

from kvagent.cli.main import main


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
    assert capsys.readouterr().out.strip() == f"kvagent {importlib.metadata.version('kvagent')}"
