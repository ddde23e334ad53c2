"""docs/configuration.md against the declared serve options (kvagent/cli/options.py), and the declarations
themselves: each one becomes its argparse argument, its TOML key and its check, with nothing else to write."""

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
    declared_options,
    field_problems,
    given_values,
    option,
    option_rows,
)

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
        flags, key, default, _ = _cells(line)
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
    """What one declaration gives a config class (as `--stream` would on ServeConfig)."""

    stream: str | None = option(
        None,
        help="a stream URL",
        flags=("--stream",),
        metavar="URL",
        check=lambda url: None if url.startswith("redis://") else f"expected redis://…, got {url!r}",
    )
    depth: int = option(5, help="how deep", flags=("--depth",), parse=int)
    hidden: int = option(1, help="TOML only")


def test_one_declaration_is_the_argument_the_merge_and_the_check() -> None:
    options = list(declared_options(_Toy, Scope.TOP))
    parser = OneLineArgumentParser(prog="toy")
    add_arguments(parser, options)
    args = parser.parse_args(["--stream", "redis://r:6379", "--depth", "7"])
    given = given_values(args, options)[Scope.TOP]
    assert {key: value for key, (_, value) in given.items()} == {"stream": "redis://r:6379", "depth": 7}
    assert given_values(parser.parse_args([]), options)[Scope.TOP] == {}  # unset flags leave the file alone
    assert field_problems(_Toy(stream="http://x"), "") == ["stream: expected redis://…, got 'http://x'"]
    assert field_problems(_Toy(stream="redis://x"), "") == []
    assert option_rows(options) == [
        OptionRow(("--stream",), "stream", "unset", "a stream URL"),
        OptionRow(("--depth",), "depth", "5", "how deep"),
        OptionRow((), "hidden", "1", "TOML only"),
    ]
    with pytest.raises(SystemExit):
        parser.parse_args(["--depth", "deep"])


def test_every_top_level_key_is_a_declared_option() -> None:
    declared = {field.name for scope, field, _ in SERVE_OPTIONS if scope is Scope.TOP}
    tables = {"slots", "etcd", "stream"}
    assert {field.name for field in attrs.fields(ServeConfig)} == declared | tables
    structure_serve_config({"slots": [{"name": "a"}]})  # every default passes its own check
