"""The ``kvagent serve`` options, generated from their declarations (kvagent/model/options.py).

Every option is declared once, on the runtime class that uses it (``SlotAgentConfig``,
``ListenerOptions``, ``ServingOptions``, ``RepublishConfig``, ``StreamConfig``, ``AttachmentConfig``), or,
for what only the serve process has (its listen address, discovery, logging), on a settings class of
kvagent/cli/config.py. The settings classes (``ServeConfig``, ``SlotConfig``, ``EngineConfig``,
``RepublishSettings``, ``EtcdSettings``, ``StreamSettings``) are what cattrs structures a TOML document into;
a field standing for a runtime option is ``option_from(RuntimeClass, "name")``, and
:func:`~kvagent.model.options.configured` builds the runtime instance from them. From the declarations:

- :func:`add_arguments` adds the argparse arguments of ``kvagent serve``;
- :func:`given_values` reads back what the command line set, by where it goes in the TOML document
  (``kvagent.cli.main`` merges it over ``--config``);
- :func:`~kvagent.model.options.field_problems` runs every field's check (the same checks the runtime
  classes validate with);
- :func:`option_rows` lists every option for docs/configuration.md (a test holds the page to it).

Adding an option is one field on its runtime class, ``name: T = option(DEFAULT, help=..., flags=(...),
check=...)``, one ``option_from`` line on the settings class whose TOML table holds it, and its row in
docs/configuration.md (the test names a missing row).
"""

from __future__ import annotations

import argparse
import enum
import functools
from collections.abc import Iterator
from typing import Any

import attrs

from kvagent.model.options import Option, declared_options, option

__all__ = [
    "Option",
    "OptionRow",
    "Scope",
    "ScopedOption",
    "add_arguments",
    "given_values",
    "option_rows",
    "option_table",
    "scoped_options",
    "setting",
]

# A field of a settings class, declared with ``option(..., validate=False)``: the settings are checked as a
# whole after structuring (every problem reported at once, each with its key path).
setting = functools.partial(option, validate=False)


class Scope(enum.Enum):
    """Where a declared option's value goes in the TOML document (its key's prefix)."""

    TOP = ""  # a top-level key
    SLOT = "slots."  # a key of every slot (the command line sets it for every slot)
    ENGINE = "slots.engine."  # a key of the engine table of every slot with an engine endpoint
    REPUBLISH = "slots.republish."  # a key of every slot's ``[slots.republish]`` table
    ETCD = "etcd."  # a key of the ``[etcd]`` table
    STREAM = "stream."  # a key of the ``[stream]`` table (present only when a stream is configured)


ScopedOption = tuple[Scope, "attrs.Attribute[Any]", Option]  # attrs.Attribute is not subscriptable at run time


def scoped_options(cls: type, scope: Scope) -> Iterator[ScopedOption]:
    """The declared options among the settings class ``cls``'s fields, in field order, in ``scope``.

    A settings field's name is its TOML key: a field standing for a runtime option must be named as the
    option declares (its ``toml`` key, else the runtime field's name)."""
    for field, declared in declared_options(cls):
        if declared.source is not None:
            runtime, name = declared.source
            key = declared.toml or name
            if field.name != key:
                raise TypeError(f"{cls.__name__}.{field.name} stands for {runtime.__name__}.{name}: name it {key}")
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
    options: list[ScopedOption],
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
    args: argparse.Namespace, options: list[ScopedOption]
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


# -- the docs ------------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class OptionRow:
    """One option as docs/configuration.md lists it; ``runtime``: the library field it sets (``Class.field``),
    None for what only the serve process has."""

    flags: tuple[str, ...]
    toml_key: str
    default: str
    help: str
    runtime: str | None = None


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


def _runtime_name(declared: Option) -> str | None:
    if declared.source is None:
        return None
    runtime, name = declared.source
    return f"{runtime.__name__}.{name}"


def option_rows(options: list[ScopedOption]) -> list[OptionRow]:
    return [
        OptionRow(
            declared.flags,
            scope.value + field.name,
            _default_text(field, declared),
            declared.help,
            _runtime_name(declared),
        )
        for scope, field, declared in options
    ]


TABLE_HEADER = ("| flag | TOML key | default | library field | what it sets |", "|---|---|---|---|---|")


def option_table(rows: list[OptionRow]) -> str:
    """docs/configuration.md's table of every option (a test holds the page to it, byte for byte)."""
    lines = list(TABLE_HEADER)
    for row in rows:
        flags = ", ".join(f"`{flag}`" for flag in row.flags) or "(TOML only)"
        runtime = "—" if row.runtime is None else f"`{row.runtime}`"
        help_text = row.help.replace("|", "\\|")
        lines.append(f"| {flags} | `{row.toml_key}` | `{row.default}` | {runtime} | {help_text} |")
    return "\n".join(lines)
