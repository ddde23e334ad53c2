"""Every setting declared once, on the runtime class that uses it: :func:`option`.

A runtime class (``SlotAgentConfig``, ``ListenerOptions``, ``ServingOptions``, ``RepublishConfig``,
``StreamConfig``, ``AttachmentConfig``) declares each setting an operator may choose as
``name: T = option(DEFAULT, help=..., flags=(...), check=...)``. The field's metadata (an :class:`Option`)
carries its help, its command-line flag(s), its TOML key and its check; its default is the field's
default. The check is the field's attrs validator, so the library refuses a bad value with the same words
the command line and the TOML file get (:class:`~kvagent.model.errors.ConfigError`, ``bad_request``).

``kvagent serve`` builds on these declarations (kvagent/cli/options.py): its settings classes take a
runtime field with :func:`option_from` (same default, help, flag, check) and build the runtime instance
with :func:`configured`, so a library user and a command-line user with no flags get the same agent.

This module is at the bottom of the layers (it imports only ``attrs`` and ``model.errors``): every
runtime class can use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import attrs

from kvagent.model.errors import ConfigError
from kvagent.model.events import U32_MAX, U64_MAX

__all__ = [
    "Check",
    "Option",
    "at_least",
    "bind_endpoint",
    "configured",
    "connect_endpoint",
    "declared",
    "declared_options",
    "field_problems",
    "format_bytes",
    "host_port",
    "in_range",
    "option",
    "option_from",
    "option_validator",
    "parse_byte_size",
    "positive",
    "u32",
    "u64",
]

OPTION = "kvagent.option"  # the key of an Option in an attrs field's metadata

# A check: the problem of a value (said without the key: "must be > 0, got 0"), or None.
Check = Callable[[Any], str | None]

_T = TypeVar("_T")


@attrs.frozen(slots=True)
class Option:
    """One setting's declaration (its field gives its name, type and default).

    ``toml``: its key in kvagent.toml when it is not the field's name. ``flags``: its command-line flags
    (empty: TOML only). ``parse``: the flag text's parser (argparse ``type``). ``check``: the problem of a
    value, or None (None values are never checked: they mean "not set"). ``switch``: the flag takes no
    value and sets True. ``repeat``: the flag may be repeated, each ``KEY=VALUE`` an entry of a table.
    ``slot_key``: the ``--slot`` key that overrides the flag for one slot. ``exclusive``: a value several
    slots would share is refused (a replay endpoint, worker id or rank is never right for two slots).
    ``clears``: keys of the same table this option replaces when given on the command line (an older
    name). ``default_text``: the default as the docs show it, when the field's default does not explain
    itself. ``source``: for a field of a settings class, the runtime class and field it stands for
    (:func:`option_from`).
    """

    help: str
    toml: str | None = None
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    check: Check | None = None
    switch: bool = False
    repeat: bool = False
    slot_key: str | None = None
    exclusive: bool = False
    clears: tuple[str, ...] = ()
    default_text: str | None = None
    source: tuple[type, str] | None = None

    @property
    def dest(self) -> str:
        """The argparse destination (argparse's own choice for the first flag)."""
        return self.flags[0].removeprefix("--").replace("-", "_")


def option_validator(check: Check) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    """An attrs validator running ``check`` (for a field that is not an operator's option)."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        problem = check(value)
        if problem is not None:
            raise ConfigError(f"{attribute.name}: {problem}")

    return validate


def _field(default: Any, factory: Callable[[], Any] | None, declared: Option, *, validate: bool) -> Any:
    metadata = {OPTION: declared}
    validator = option_validator(declared.check) if validate and declared.check is not None else None
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata=metadata)
    return attrs.field(default=default, validator=validator, metadata=metadata)


def option(
    default: Any = attrs.NOTHING,
    *,
    factory: Callable[[], Any] | None = None,
    help: str,  # noqa: A002  # argparse's name for it
    toml: str | None = None,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    check: Check | None = None,
    switch: bool = False,
    repeat: bool = False,
    slot_key: str | None = None,
    exclusive: bool = False,
    clears: tuple[str, ...] = (),
    default_text: str | None = None,
    validate: bool = True,
) -> Any:
    """An attrs field declaring a setting (see :class:`Option`); ``check`` is also its validator unless
    ``validate`` is false (a settings class checked as a whole, so that every problem is reported)."""
    declared = Option(
        help=help,
        toml=toml,
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
    return _field(default, factory, declared, validate=validate)


def declared(field: attrs.Attribute[Any]) -> Option | None:
    """The option a field declares, or None."""
    found = field.metadata.get(OPTION)
    return found if isinstance(found, Option) else None


def declared_options(cls: type) -> Iterator[tuple[attrs.Attribute[Any], Option]]:
    """The declared options among ``cls``'s fields, in field order."""
    for field in attrs.fields(cls):
        found = declared(field)
        if found is not None:
            yield field, found


def option_from(cls: type, name: str, **changes: Any) -> Any:
    """A settings-class field standing for ``cls.name``: its default, help, flags, TOML key and check.

    ``changes`` adjust the declaration for the settings class (``default=None`` where the command line
    derives the value when it is not set). The settings field's own name must be the option's TOML key.
    The check is not the field's validator: a settings class is checked as a whole (:func:`field_problems`)
    so that every problem is reported at once; the runtime class checks again when it is built.
    """
    field = attrs.fields_dict(cls)[name]
    found = declared(field)
    if found is None:
        raise TypeError(f"{cls.__name__}.{name} declares no option")
    default = changes.pop("default", field.default)
    found = attrs.evolve(found, source=(cls, name), **changes)
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return _field(attrs.NOTHING, default.factory, found, validate=False)
    return _field(default, None, found, validate=False)


def configured(cls: type[_T], *settings: attrs.AttrsInstance, **values: Any) -> _T:
    """A ``cls`` built from the fields of ``settings`` that stand for its options (:func:`option_from`),
    plus ``values`` (what no setting gives: a name, an id, a resolved address; they take precedence)."""
    taken: dict[str, Any] = {}
    for source in settings:
        for field, found in declared_options(type(source)):
            if found.source is not None and found.source[0] is cls:
                taken[found.source[1]] = getattr(source, field.name)
    return cls(**(taken | values))


def field_problems(value: attrs.AttrsInstance, path: str) -> list[str]:
    """``path.key: problem`` for every declared field of the attrs instance ``value`` whose check fails."""
    problems: list[str] = []
    prefix = f"{path}." if path else ""
    for field, found in declared_options(type(value)):
        current = getattr(value, field.name)
        if found.check is None or current is None:
            continue
        problem = found.check(current)
        if problem is not None:
            problems.append(f"{prefix}{field.name}: {problem}")
    return problems


# -- checks ----------------------------------------------------------------------------------------------


def in_range(low: float, high: float, unit: str = "") -> Check:
    def check(value: float) -> str | None:
        return None if low <= value <= high else f"must be {low}..{high}{unit}, got {value}"

    return check


def at_least(low: float, why: str = "") -> Check:
    def check(value: float) -> str | None:
        return None if value >= low else f"must be >= {low}{why}, got {value}"

    return check


def positive(value: float) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number, got {value!r}"
    return None if value > 0 else f"must be > 0, got {value}"


u32 = in_range(0, U32_MAX)
u64 = in_range(0, U64_MAX)

_HOST_PORT_RE = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):(?P<port>[0-9]{1,5})")


def host_port(text: object, *, wildcard: bool = False, port_zero: bool = True) -> str | None:
    """The problem of a ``HOST:PORT`` (IPv6 in brackets); ``wildcard``: the host may be ``*``."""
    if not isinstance(text, str):
        return f"expected HOST:PORT, got {text!r}"
    match = _HOST_PORT_RE.fullmatch(text)
    if match is None:
        if text.count(":") > 1 and not text.startswith("["):
            return f"expected HOST:PORT with an IPv6 host in brackets (like [::1]:8765), got {text!r}"
        return f"expected HOST:PORT, got {text!r}"
    port = int(match["port"])
    if port > 65535 or (port == 0 and not port_zero):
        return f"port must be {0 if port_zero else 1}..65535, got {match['port']}"
    if match["host"] == "*" and not wildcard:
        return f"host must not be '*' here, got {text!r}"
    return None


def _endpoint_problem(text: object, *, bind: bool) -> str | None:
    if not isinstance(text, str):
        return f"expected a ZMQ endpoint string, got {text!r}"
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return f"expected tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {text!r}"
    if scheme != "tcp":
        return None if rest else f"{scheme} endpoint needs a name, got {text!r}"
    if not bind and rest.startswith("*:"):
        # vLLM binds tcp://*:PORT; the agent connects, and '*' is no address to connect to.
        return (
            f"{text!r} is a bind address; give the address to connect to, like tcp://127.0.0.1:{rest[2:]}"
        )
    problem = host_port(rest, wildcard=bind, port_zero=bind)
    return None if problem is None else f"{problem} (in {text!r})"


def connect_endpoint(text: object) -> str | None:
    """The problem of a ZMQ endpoint to connect to (``tcp://HOST:PORT`` with a real host and port,
    ``ipc://PATH``, ``inproc://NAME``)."""
    return _endpoint_problem(text, bind=False)


def bind_endpoint(text: object) -> str | None:
    """The problem of a ZMQ endpoint to bind (``tcp://*:PORT`` and port 0 allowed)."""
    return _endpoint_problem(text, bind=True)


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
