"""Each ``kvagent serve`` option declared once: an attrs field whose metadata is an :class:`Option`.

A config field (``ServeConfig``, ``SlotConfig``, ``EngineConfig``, ``RepublishSettings``,
``EtcdSettings``, ``StreamSettings``) declared with :func:`option` carries its help, its command-line flag(s), the parser of the
flag's text, the check of its value and the text of its default in the docs; its TOML key is the field's
path (``ingest_budget``, ``slots.kv_block_size``, ``etcd.ttl``) and its default the field's default. From
these declarations:

- :func:`add_arguments` adds the argparse arguments of ``kvagent serve``;
- :func:`given_values` reads back what the command line set, by where it goes in the TOML document
  (``kvagent.cli.main`` merges it over ``--config``);
- :func:`field_problems` runs every field's check (``kvagent.cli.config.validate_serve_config``);
- :func:`option_rows` lists every option for docs/configuration.md (a test holds the page to it).

Adding an option is one field: ``name: T = option(DEFAULT, help=..., flags=("--name",), check=...)`` on the
class whose TOML table holds it, plus its row in docs/configuration.md (the test names a missing row).
"""

from __future__ import annotations

import argparse
import enum
import re
from collections.abc import Callable, Iterator
from typing import Any

import attrs

__all__ = [
    "Option",
    "OptionRow",
    "Scope",
    "add_arguments",
    "declared_options",
    "field_problems",
    "format_bytes",
    "given_values",
    "option",
    "option_rows",
    "parse_byte_size",
]

OPTION = "kvagent.option"  # the key of an Option in an attrs field's metadata


class Scope(enum.Enum):
    """Where a declared option's value goes in the TOML document (its key's prefix)."""

    TOP = ""  # a top-level key
    SLOT = "slots."  # a key of every slot (the command line sets it for every slot)
    ENGINE = "slots.engine."  # a key of the engine table of every slot with an engine endpoint
    REPUBLISH = "slots.republish."  # a key of every slot's ``[slots.republish]`` table
    ETCD = "etcd."  # a key of the ``[etcd]`` table
    STREAM = "stream."  # a key of the ``[stream]`` table (present only when a stream is configured)


@attrs.frozen(slots=True)
class Option:
    """One option's declaration (the field it is attached to gives its TOML key, type and default).

    ``flags``: empty for a TOML-only key. ``parse``: the flag text's parser (argparse ``type``; raising
    ``argparse.ArgumentTypeError`` or ``ValueError`` is a one-line usage error). ``check``: the problem of
    a typed value, or None (None values are never checked: they mean "not set"). ``switch``: the flag
    takes no value and sets True. ``repeat``: the flag may be repeated, each ``KEY=VALUE`` becoming an
    entry of a table. ``slot_key``: the ``--slot`` key that overrides the flag for one slot
    (cli/slot_grammar.py). ``exclusive``: a value that several slots would share is refused (a replay
    endpoint, worker id or rank is never right for two slots). ``clears``: keys of the same table this
    option replaces when given on the command line (an older name). ``default_text``: the default as the
    docs show it, when the field's default is not self-explaining.
    """

    help: str
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    switch: bool = False
    repeat: bool = False
    slot_key: str | None = None
    exclusive: bool = False
    clears: tuple[str, ...] = ()
    default_text: str | None = None

    @property
    def dest(self) -> str:
        """The argparse destination (argparse's own choice for the first flag)."""
        return self.flags[0].removeprefix("--").replace("-", "_")


def option(
    default: Any = attrs.NOTHING,
    *,
    factory: Callable[[], Any] | None = None,
    help: str,  # noqa: A002  # argparse's name for it
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    check: Callable[[Any], str | None] | None = None,
    switch: bool = False,
    repeat: bool = False,
    slot_key: str | None = None,
    exclusive: bool = False,
    clears: tuple[str, ...] = (),
    default_text: str | None = None,
) -> Any:
    """An attrs field declaring a serve option (see :class:`Option`)."""
    declared = Option(
        help=help,
        flags=flags,
        metavar=metavar,
        parse=parse,
        choices=choices,
        check=check,
        switch=switch,
        repeat=repeat,
        slot_key=slot_key,
        exclusive=exclusive,
        clears=clears,
        default_text=default_text,
    )
    metadata = {OPTION: declared}
    if factory is not None:
        return attrs.field(factory=factory, metadata=metadata)
    return attrs.field(default=default, metadata=metadata)


def _option_of(field: attrs.Attribute[Any]) -> Option | None:
    declared = field.metadata.get(OPTION)
    return declared if isinstance(declared, Option) else None


def declared_options(cls: type, scope: Scope) -> Iterator[tuple[Scope, attrs.Attribute[Any], Option]]:
    """The declared options among ``cls``'s fields, in field order."""
    for field in attrs.fields(cls):
        declared = _option_of(field)
        if declared is not None:
            yield scope, field, declared


# -- the command line ----------------------------------------------------------------------------------


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


_METAVARS: dict[object, str] = {int: "N", float: "SECONDS"}


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    options: list[tuple[Scope, attrs.Attribute[Any], Option]],
) -> None:
    """One argparse argument per declared option with flags; unset, each reads back as None."""
    for _, _, declared in options:
        if not declared.flags:
            continue
        kwargs: dict[str, Any] = {"dest": declared.dest, "help": declared.help, "default": None}
        if declared.switch:
            kwargs["action"] = "store_true"
        else:
            kwargs["metavar"] = declared.metavar or _METAVARS.get(declared.parse)
            if declared.repeat:
                kwargs["action"] = "append"
                kwargs["type"] = _key_value
                kwargs["metavar"] = declared.metavar or "KEY=VALUE"
            elif declared.parse is not None:
                kwargs["type"] = declared.parse
            if declared.choices is not None:
                kwargs["choices"] = declared.choices
        parser.add_argument(*declared.flags, **kwargs)


def given_values(
    args: argparse.Namespace, options: list[tuple[Scope, attrs.Attribute[Any], Option]]
) -> dict[Scope, dict[str, tuple[Option, Any]]]:
    """What the command line set, by scope: TOML key -> (its option, its TOML value)."""
    given: dict[Scope, dict[str, tuple[Option, Any]]] = {scope: {} for scope in Scope}
    for scope, field, declared in options:
        if not declared.flags:
            continue
        value = getattr(args, declared.dest, None)
        if value is None:
            continue
        given[scope][field.name] = (declared, dict(value) if declared.repeat else value)
    return given


# -- validation ----------------------------------------------------------------------------------------


def field_problems(value: attrs.AttrsInstance, path: str) -> list[str]:
    """``path.key: problem`` for every declared field of the attrs instance ``value`` whose check fails."""
    problems: list[str] = []
    prefix = f"{path}." if path else ""
    for field in attrs.fields(type(value)):
        declared = _option_of(field)
        if declared is None or declared.check is None:
            continue
        current = getattr(value, field.name)
        if current is None:
            continue
        problem = declared.check(current)
        if problem is not None:
            problems.append(f"{prefix}{field.name}: {problem}")
    return problems


# -- byte sizes ----------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}
_SIZE_RE = re.compile(r"\s*([0-9]+)\s*([A-Za-z]*)\s*")


def parse_byte_size(text: str) -> int:
    """``64MiB``, ``64 MiB``, ``512kB``, ``67108864``: a whole number of bytes (KiB/MiB/GiB are powers of
    1024, kB/MB/GB of 1000); ValueError naming the accepted forms otherwise."""
    match = _SIZE_RE.fullmatch(text)
    unit = _UNITS.get(match[2].lower()) if match is not None else None
    if match is None or unit is None:
        raise ValueError(f"expected a byte size like 64MiB, 512kB or 67108864, got {text!r}")
    return int(match[1]) * unit


def format_bytes(count: int) -> str:
    """``count`` in the largest binary unit that divides it (``64MiB``), else in bytes."""
    for unit in ("GiB", "MiB", "KiB"):
        size = _UNITS[unit.lower()]
        if count >= size and count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


# -- the docs ------------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class OptionRow:
    """One option as docs/configuration.md lists it."""

    flags: tuple[str, ...]
    toml_key: str
    default: str
    help: str


def _default_text(field: attrs.Attribute[Any], declared: Option) -> str:
    if declared.default_text is not None:
        return declared.default_text
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        raise ValueError(f"{field.name}: a factory default needs default_text")
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, str):
        return f'"{default}"'
    return str(default)


def option_rows(options: list[tuple[Scope, attrs.Attribute[Any], Option]]) -> list[OptionRow]:
    return [
        OptionRow(declared.flags, scope.value + field.name, _default_text(field, declared), declared.help)
        for scope, field, declared in options
    ]
