"""docs/configuration.md against the declared serve options (kvagent/model/options.py, kvagent/cli/options.py),
and the declarations themselves: each one becomes its argparse argument, its TOML key, its check and its
runtime validator, with nothing else to write."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import attrs
import pytest

from kvagent.cli.config import SERVE_OPTIONS, ServeConfig, structure_serve_config
from kvagent.cli.errors import OneLineArgumentParser
from kvagent.cli.main import build_parser
from kvagent.cli.options import (
    OptionRow,
    Scope,
    add_arguments,
    given_values,
    option_rows,
    option_table,
    scoped_options,
    setting,
)
from kvagent.model.errors import ConfigError
from kvagent.model.options import configured, field_problems, option, option_from

DOC = Path(__file__).parents[2] / "docs" / "configuration.md"
BEGIN, END = "<!-- serve-options:begin -->", "<!-- serve-options:end -->"
# Flags of `kvagent serve` that are not config options: the file, the slots, the traceback, the help.
STRUCTURAL_FLAGS = {"--config", "--slot", "--debug", "--help"}


def _cells(line: str) -> list[str]:
    """A markdown table row's cells (a ``\\|`` inside a cell is not a separator)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def documented_rows(text: str) -> dict[str, tuple[tuple[str, ...], str]]:
    """TOML key -> (flags, default) of every row of the page's option table."""
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
    rows: dict[str, tuple[tuple[str, ...], str]] = {}
    for line in table[2:]:  # after the header and its rule
        flags, key, default, _, _ = _cells(line)
        assert key.startswith("`") and default.startswith("`"), line
        named = tuple(re.findall(r"`(--[a-z0-9-]+)`", flags))
        assert key.strip("`") not in rows, f"{key} is listed twice"
        rows[key.strip("`")] = (named, default[1:-1])
    return rows


def test_every_option_is_documented_with_its_flags_key_and_default() -> None:
    rows = documented_rows(DOC.read_text())
    declared = {row.toml_key: row for row in option_rows(SERVE_OPTIONS)}
    missing = sorted(set(declared) - set(rows))
    assert not missing, f"docs/configuration.md has no row for {missing}"
    unknown = sorted(set(rows) - set(declared))
    assert not unknown, f"docs/configuration.md lists options that do not exist: {unknown}"
    for key, row in declared.items():
        assert rows[key] == (row.flags, row.default), key


def test_the_page_s_table_is_the_generated_one() -> None:
    """The table is generated from the declarations (help, library field and all): paste the printed one."""
    generated = option_table(option_rows(SERVE_OPTIONS))
    table = DOC.read_text().split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == generated, f"replace docs/configuration.md's option table with:\n{generated}"


def test_the_page_names_no_flag_that_does_not_exist() -> None:
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    serve = subparsers.choices["serve"]
    flags = {flag for action in serve._actions for flag in action.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", DOC.read_text().split("-->", 1)[1]))
    assert named, "the pattern finds the page's flags"
    assert sorted(named - flags) == []
    # The table covers every flag serve has, but the structural ones explained in prose.
    table_flags = {
        flag for flags_of_row, _ in documented_rows(DOC.read_text()).values() for flag in flags_of_row
    }
    assert flags - table_flags == STRUCTURAL_FLAGS | {"-h"}


def test_the_check_fails_on_a_missing_row_and_on_a_wrong_default() -> None:
    text = DOC.read_text()
    without = "\n".join(
        line for line in text.splitlines() if "`ingest_budget`" not in line or "|" not in line
    )
    assert "ingest_budget" not in documented_rows(without)
    wrong = text.replace(
        "| `--ingest-budget` | `ingest_budget` | `64MiB` |",
        "| `--ingest-budget` | `ingest_budget` | `32MiB` |",
    )
    assert documented_rows(wrong)["ingest_budget"] == (("--ingest-budget",), "32MiB")


@attrs.frozen
class _Toy:
    """A runtime class: what one declaration gives it (as ``shed_after`` gives ListenerOptions)."""

    stream: str | None = option(
        None,
        help="a stream URL",
        flags=("--stream",),
        metavar="URL",
        check=lambda url: None if url.startswith("redis://") else f"expected redis://…, got {url!r}",
    )
    depth: int = option(5, help="how deep", flags=("--depth",), parse=int, check=lambda depth: None)
    hidden: int = option(1, help="TOML only", toml="shown")


@attrs.frozen
class _ToySettings:
    """A settings class of the command line: each field stands for the runtime option."""

    stream: str | None = option_from(_Toy, "stream")
    depth: int = option_from(_Toy, "depth")
    shown: int = option_from(_Toy, "hidden")
    only_here: bool = setting(False, help="a process-only switch", flags=("--only-here",), switch=True)


def test_one_declaration_is_the_argument_the_merge_the_check_and_the_validator() -> None:
    options = list(scoped_options(_ToySettings, Scope.TOP))
    parser = OneLineArgumentParser(prog="toy")
    add_arguments(parser, options)
    args = parser.parse_args(["--stream", "redis://r:6379", "--depth", "7"])
    given = given_values(args, options)[Scope.TOP]
    assert {key: value for key, (_, value) in given.items()} == {"stream": "redis://r:6379", "depth": 7}
    assert given_values(parser.parse_args([]), options)[Scope.TOP] == {}  # unset flags leave the file alone
    # The settings are checked as a whole (every problem, with its key); the runtime class refuses at once.
    assert field_problems(_ToySettings(stream="http://x"), "") == ["stream: expected redis://…, got 'http://x'"]
    assert field_problems(_ToySettings(stream="redis://x"), "") == []
    with pytest.raises(ConfigError, match="stream: expected redis://…, got 'http://x'"):
        _Toy(stream="http://x")
    assert configured(_Toy, _ToySettings(depth=9, shown=2)) == _Toy(depth=9, hidden=2)
    assert configured(_Toy, _ToySettings()) == _Toy()  # the same defaults
    assert option_rows(options) == [
        OptionRow(("--stream",), "stream", "unset", "a stream URL", "_Toy.stream"),
        OptionRow(("--depth",), "depth", "5", "how deep", "_Toy.depth"),
        OptionRow((), "shown", "1", "TOML only", "_Toy.hidden"),
        OptionRow(("--only-here",), "only_here", "false", "a process-only switch"),
    ]
    with pytest.raises(SystemExit):
        parser.parse_args(["--depth", "deep"])


def test_a_settings_field_is_named_as_its_option_s_toml_key() -> None:
    @attrs.frozen
    class Misnamed:
        hidden: int = option_from(_Toy, "hidden")  # its TOML key is "shown"

    with pytest.raises(TypeError, match="name it shown"):
        list(scoped_options(Misnamed, Scope.TOP))


def test_every_top_level_key_is_a_declared_option() -> None:
    declared = {field.name for scope, field, _ in SERVE_OPTIONS if scope is Scope.TOP}
    tables = {"slots", "etcd", "stream"}
    assert {field.name for field in attrs.fields(ServeConfig)} == declared | tables
    structure_serve_config({"slots": [{"name": "a"}]})  # every default passes its own check
