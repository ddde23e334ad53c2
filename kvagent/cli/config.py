"""``kvagent serve`` configuration: attrs classes structured by cattrs from TOML or command-line options.

Errors are :class:`ConfigError` and name the failing key path, for example
``slots[0].kv_block_size: must be > 0``; several failures are reported together.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import attrs
import cattrs
import structlog
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.v import format_exception, transform_error

from kvagent.cli.etcd_settings import EtcdSettings, etcd_open_options, etcd_problems
from kvagent.cli.slot_grammar import SlotSpec, parse_slot_arg, parse_slot_spec
from kvagent.cli.stream_settings import StreamSettings, stream_problems
from kvagent.discovery import check_discovery_url
from kvagent.model.errors import ConfigError, IdentityError, KvAgentError
from kvagent.model.events import U32_MAX, U64_MAX, IngressProtocol
from kvagent.model.ids import CacheOwnerId, derive_cache_owner_id, explicit_material, with_model
from kvagent.publish.republisher import RepublishConfig

__all__ = [
    "ConfigError",
    "EngineConfig",
    "EtcdSettings",
    "RepublishSettings",
    "ServeConfig",
    "SlotConfig",
    "SIMULATED_MODEL",
    "SlotSpec",
    "default_state_dir",
    "discovery_options",
    "load_config_file",
    "parse_slot_arg",
    "parse_slot_spec",
    "resolve_cache_owner_id",
    "structure_serve_config",
    "validate_serve_config",
    "warn_if_models_unnamed",
]

log = structlog.get_logger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")

EXTERNAL_INGRESS_ERROR = "external state-agent slots require vllm_residency_v1 ingress"

# The model a --simulate slot serves (its CacheOwnerId takes it, like any other model name).
SIMULATED_MODEL = "kvagent-simulated"


def default_state_dir() -> Path:
    """``$KVAGENT_STATE_DIR``, else ``$XDG_STATE_HOME/kvagent``, else ``~/.local/state/kvagent``."""
    explicit = os.environ.get("KVAGENT_STATE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kvagent"
    return Path.home() / ".local" / "state" / "kvagent"


def _default_discovery() -> str:
    return f"file:{default_state_dir() / 'discovery'}"


def _default_slot_state_dir() -> str:
    return str(default_state_dir() / "state")


STATE_DIR_NONE = "none"  # ``state_dir = "none"``: every slot keeps its state in memory only


@attrs.frozen(slots=True)
class EngineConfig:
    """The engine a slot attaches to at start."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    worker_id: int | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None


@attrs.frozen(slots=True)
class RepublishSettings:
    """``[slots.republish]``: the slot's vLLM-compatible stream (endpoints of dp_rank 0, offset per rank)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    legacy_replay: bool = False
    buffer_batches: int = 10_000

    def to_config(self) -> RepublishConfig:
        return RepublishConfig(
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            topic=self.topic,
            legacy_replay=self.legacy_replay,
            buffer_batches=self.buffer_batches,
        )


@attrs.frozen(slots=True)
class SlotConfig:
    name: str
    kv_block_size: int = 16
    dp_rank: int = 0
    cache_owner_id: str | None = None
    cache_semantics: dict[str, str] | None = None
    routing_scope: dict[str, str] | None = None
    dc_id: int = 0
    ring_capacity: int = 1024
    ingress_protocol: str = IngressProtocol.VLLM_RESIDENCY_V1.value
    strict_cache_owner: bool = False
    engine: EngineConfig | None = None
    simulate: bool = False
    republish: RepublishSettings | None = None
    # The served model's name: part of the derived CacheOwnerId (docs/identity.md). Unset, a slot without
    # an explicit cache_owner_id gets the top-level ``model``, else (simulated) SIMULATED_MODEL, else none.
    model: str | None = None


@attrs.frozen(slots=True)
class ServeConfig:
    # Empty by default so a config file may leave the slots to the command line (the CLI insists on one).
    slots: tuple[SlotConfig, ...] = ()
    listen: str = "127.0.0.1:8765"
    discovery: str = attrs.field(factory=_default_discovery)
    # Where slots persist their state (docs/durability.md); "none" keeps it in memory only.
    state_dir: str = attrs.field(factory=_default_slot_state_dir)
    token_file: str | None = None
    publish: str | None = None
    http: str | None = None  # the HTTP surface (metrics, health, readiness, status, dumps)
    metrics: str | None = None  # the older name of ``http``, still accepted
    log_format: str = "text"
    log_level: str = "info"
    max_connections: int = 256
    max_message_bytes: int = 1 << 20
    status_interval: float = 5.0
    shutdown_timeout: float = 10.0
    rcvhwm: int = 1000  # the listener fits it lower still once it sees large messages (its byte bound)
    # Seconds the reader lets a steady stream accumulate before reading on (ListenerOptions.coalesce_window).
    coalesce_window: float = 0.02
    # The websocket server's bounds (docs/protocol.md, "Limits and deadlines").
    handshake_timeout: float = 5.0
    max_pending_handshakes: int | None = None  # None: 128, at most a quarter of the fd limit
    send_deadline: float = 10.0
    outbound_queue_bytes: int = 1 << 20
    # The host put into advertised and printed URLs; None: the listen host, or this machine's name for a
    # wildcard listen address (kvagent/agent/advertising.py).
    advertise: str | None = None
    model: str | None = None  # the default of every slot's ``model``
    silence_warning: float = 60.0  # seconds an attached engine may publish nothing before a WARNING
    etcd: EtcdSettings = EtcdSettings()
    stream: StreamSettings | None = None  # [stream]: every slot's events in Redis/Valkey (docs/fleet.md)

    @property
    def http_listen(self) -> str | None:
        """Where the HTTP surface listens: ``http``, or its older name ``metrics``."""
        return self.http if self.http is not None else self.metrics

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :func:`structure_serve_config` turns back into an equal config.

        A slot model inherited from ``model`` (or the simulator) is left out, so a command line that
        changes those defaults (``--model``, ``--simulate``) still reaches the slot.
        """
        data: dict[str, Any] = _converter.unstructure(self)
        for slot, table in zip(self.slots, data["slots"], strict=True):
            if slot.model == _inherited_model(self, slot):
                table["model"] = None
        return data


# -- structuring -----------------------------------------------------------------------------------


class _StrictTypeError(TypeError):
    """A scalar of the wrong JSON/TOML type; the message is shown as is."""


def _strict_int(value: object, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _StrictTypeError(f"expected an integer, got {value!r}")
    return value


def _strict_float(value: object, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _StrictTypeError(f"expected a number, got {value!r}")
    return float(value)


def _strict_str(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise _StrictTypeError(f"expected a string, got {value!r}")
    return value


def _strict_bool(value: object, _: type) -> bool:
    if not isinstance(value, bool):
        raise _StrictTypeError(f"expected true or false, got {value!r}")
    return value


def _require_table(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def structure(value: object, type_: Any) -> Any:
        if not isinstance(value, Mapping):
            raise _StrictTypeError(f"expected a table, got {value!r}")
        return hook(value, type_)

    return structure


def _require_list(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def structure(value: object, type_: Any) -> Any:
        # cattrs would happily iterate a string or a table into a tuple.
        if not isinstance(value, list | tuple):
            raise _StrictTypeError(f"expected a list (an array of tables), got {value!r}")
        return hook(value, type_)

    return structure


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(str, _strict_str)
    converter.register_structure_hook(bool, _strict_bool)
    # Inner types first, so the outer generated hooks pick up the wrapped inner ones.
    for type_ in (EngineConfig, RepublishSettings, SlotConfig, EtcdSettings):
        converter.register_structure_hook(type_, _require_table(converter.get_structure_hook(type_)))
    slots_type = tuple[SlotConfig, ...]
    slots_hook = _require_list(converter.get_structure_hook(slots_type))
    converter.register_structure_hook_func(lambda type_: type_ == slots_type, slots_hook)
    return converter


_converter = _make_converter()


def _describe(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, _StrictTypeError):
        return str(exc)
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown keys: {', '.join(sorted(exc.extra_fields))}"
    return format_exception(exc, type_)


def _flatten(messages: list[str]) -> tuple[str, ...]:
    """cattrs' ``problem @ $.a.b[0]`` lines as ``a.b[0]: problem`` (top-level problems have no path)."""
    lines: list[str] = []
    for message in messages:
        problem, sep, path = message.rpartition(" @ ")
        if not sep:
            lines.append(message)
            continue
        path = path.removeprefix("$").removeprefix(".")
        lines.append(f"{path}: {problem}" if path else problem)
    return tuple(lines)


def _raise(errors: tuple[str, ...], context: str | None = None) -> NoReturn:
    prefix = f"{context}: " if context else ""
    if len(errors) == 1:
        raise ConfigError(f"{prefix}{errors[0]}", errors)
    listing = "".join(f"\n  {error}" for error in errors)
    raise ConfigError(f"{prefix}invalid configuration ({len(errors)} problems):{listing}", errors)


# -- validation ------------------------------------------------------------------------------------

_HOST_PORT_RE = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):(?P<port>[0-9]{1,5})")


def _host_port_problem(text: str, *, wildcard: bool) -> str | None:
    match = _HOST_PORT_RE.fullmatch(text)
    if match is None:
        if text.count(":") > 1 and not text.startswith("["):
            return f"expected HOST:PORT with an IPv6 host in brackets (like [::1]:8765), got {text!r}"
        return f"expected HOST:PORT, got {text!r}"
    if int(match["port"]) > 65535:
        return f"port must be 0..65535, got {match['port']}"
    if match["host"] == "*" and not wildcard:
        return f"host must not be '*' here, got {text!r}"
    return None


def _endpoint_problem(text: str, *, bind: bool) -> str | None:
    """ZMQ endpoint syntax: ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return f"expected tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {text!r}"
    if scheme != "tcp":
        return None if rest else f"{scheme} endpoint needs a name, got {text!r}"
    problem = _host_port_problem(rest, wildcard=bind)
    return None if problem is None else f"{problem} (in {text!r})"


_ADVERTISE_RE = re.compile(r"\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*|[A-Za-z0-9_.-]+")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*")


def _advertise_problem(text: str) -> str | None:
    """A host name or address (IPv6 with or without brackets), no port: URLs get the bound ports."""
    if _ADVERTISE_RE.fullmatch(text) is None:
        return f"expected a host name or IP address (no port, no scheme), got {text!r}"
    if text in _WILDCARD_HOSTS:
        return f"must name this machine as clients reach it, not the wildcard address {text!r}"
    return None


def _check(errors: list[str], path: str, problem: str | None) -> None:
    if problem is not None:
        errors.append(f"{path}: {problem}")


def _range(value: int, low: int, high: int) -> str | None:
    return None if low <= value <= high else f"must be {low}..{high}, got {value}"


def _positive(value: float) -> str | None:
    return None if value > 0 else f"must be > 0, got {value}"


def _identity_map_problem(entries: Mapping[str, str] | None) -> str | None:
    if not entries:
        return None
    try:
        explicit_material(entries)
    except IdentityError as exc:
        return str(exc)
    return None


def _validate_engine(errors: list[str], path: str, engine: EngineConfig) -> None:
    _check(errors, f"{path}.endpoint", _endpoint_problem(engine.endpoint, bind=False))
    if engine.replay_endpoint is not None:
        _check(errors, f"{path}.replay_endpoint", _endpoint_problem(engine.replay_endpoint, bind=False))
    if engine.worker_id is not None:
        _check(errors, f"{path}.worker_id", _range(engine.worker_id, 0, U64_MAX))
    for key in ("image_token_id", "video_token_id"):
        value = getattr(engine, key)
        if value is not None:
            _check(errors, f"{path}.{key}", _range(value, 0, U32_MAX))


def _republish_endpoints(errors: list[str], path: str, slot: SlotConfig) -> list[tuple[str, str]]:
    """Check ``[slots.republish]``; the endpoints this slot binds (offset by its dp_rank) with their key paths."""
    republish = slot.republish
    if republish is None:
        return []
    _check(errors, f"{path}.endpoint", _endpoint_problem(republish.endpoint, bind=True))
    if republish.replay_endpoint is not None:
        _check(errors, f"{path}.replay_endpoint", _endpoint_problem(republish.replay_endpoint, bind=True))
    _check(errors, f"{path}.buffer_batches", _positive(republish.buffer_batches))
    if any(error.startswith(f"{path}.") for error in errors):
        return []
    try:
        config = republish.to_config().for_rank(slot.dp_rank)
    except KvAgentError as exc:
        errors.append(f"{path}: {exc}")
        return []
    bound = [(config.endpoint, f"{path}.endpoint")]
    if config.replay_endpoint is not None:
        bound.append((config.replay_endpoint, f"{path}.replay_endpoint"))
    # Port 0 binds an ephemeral port per socket: never a collision.
    return [(endpoint, key) for endpoint, key in bound if not endpoint.endswith(":0")]


def _validate_slot(errors: list[str], path: str, slot: SlotConfig) -> None:
    if not slot.name:
        errors.append(f"{path}.name: must not be empty")
    elif "/" in slot.name or not slot.name.isprintable():
        errors.append(f"{path}.name: must be printable and contain no '/' (it is a URL path segment)")
    elif len(slot.name.encode()) > 1024:
        errors.append(f"{path}.name: must be at most 1024 UTF-8 bytes")
    if slot.kv_block_size <= 0:
        errors.append(f"{path}.kv_block_size: must be > 0")
    else:
        _check(errors, f"{path}.kv_block_size", _range(slot.kv_block_size, 1, U32_MAX))
    _check(errors, f"{path}.dp_rank", _range(slot.dp_rank, 0, U32_MAX))
    _check(errors, f"{path}.dc_id", _range(slot.dc_id, 0, U64_MAX))
    _check(errors, f"{path}.ring_capacity", _positive(slot.ring_capacity))
    if slot.ingress_protocol != IngressProtocol.VLLM_RESIDENCY_V1.value:
        errors.append(f"{path}.ingress_protocol: {EXTERNAL_INGRESS_ERROR}")
    _check(errors, f"{path}.cache_semantics", _identity_map_problem(slot.cache_semantics))
    if slot.model is not None and slot.cache_owner_id is None:
        try:
            explicit_material(with_model(slot.cache_semantics, slot.model) or {})
        except IdentityError as exc:
            errors.append(f"{path}.model: {exc}")
    _check(errors, f"{path}.routing_scope", _identity_map_problem(slot.routing_scope))
    if slot.cache_owner_id is not None:
        try:
            CacheOwnerId.parse(slot.cache_owner_id)
        except IdentityError as exc:
            errors.append(f"{path}.cache_owner_id: {exc}")
        # An explicit owner id already encodes the pool; accepting pool material too would silently ignore it.
        errors.extend(
            f"{path}.{key}: cannot be combined with an explicit cache_owner_id"
            for key in ("cache_semantics", "routing_scope")
            if getattr(slot, key)
        )
        if slot.dc_id:
            errors.append(f"{path}.dc_id: cannot be combined with an explicit cache_owner_id")
    if slot.engine is not None:
        _validate_engine(errors, f"{path}.engine", slot.engine)
        if slot.simulate:
            errors.append(f"{path}.simulate: cannot be combined with an engine")


def validate_serve_config(config: ServeConfig) -> None:
    """Raise :class:`ConfigError` listing every semantic problem of an already typed config."""
    errors: list[str] = []
    seen: dict[str, int] = {}
    bound: dict[str, str] = {}
    for index, slot in enumerate(config.slots):
        _validate_slot(errors, f"slots[{index}]", slot)
        for endpoint, key in _republish_endpoints(errors, f"slots[{index}].republish", slot):
            if endpoint in bound:
                errors.append(
                    f"{key}: {endpoint} is also bound by {bound[endpoint]} (ports are offset by dp_rank)"
                )
            bound.setdefault(endpoint, key)
        if slot.name in seen:
            errors.append(
                f"slots[{index}].name: duplicate slot name {slot.name!r} (also slots[{seen[slot.name]}])"
            )
        seen.setdefault(slot.name, index)
    _check(errors, "listen", _host_port_problem(config.listen, wildcard=False))
    for key in ("http", "metrics"):
        value = getattr(config, key)
        if value is not None:
            _check(errors, key, _host_port_problem(value, wildcard=False))
    if config.http is not None and config.metrics is not None and config.http != config.metrics:
        errors.append("metrics: is the older name of http; set only http")
    if config.publish is not None:
        _check(errors, "publish", _endpoint_problem(config.publish, bind=True))
    try:
        check_discovery_url(config.discovery)
    except ValueError as exc:
        errors.append(f"discovery: {exc}")
    if config.advertise is not None:
        _check(errors, "advertise", _advertise_problem(config.advertise))
    if config.model is not None and not config.model:
        errors.append("model: must not be empty")
    errors.extend(etcd_problems(config.etcd, config.discovery))
    errors.extend([] if config.stream is None else stream_problems(config.stream))
    if not config.state_dir:
        errors.append(f"state_dir: must be a directory or {STATE_DIR_NONE!r}, got an empty string")
    if config.log_format not in ("text", "json"):
        errors.append(f"log_format: must be 'text' or 'json', got {config.log_format!r}")
    if config.log_level not in LOG_LEVELS:
        errors.append(f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {config.log_level!r}")
    for key in (
        "max_connections",
        "max_message_bytes",
        "status_interval",
        "shutdown_timeout",
        "handshake_timeout",
        "send_deadline",
        "outbound_queue_bytes",
        "silence_warning",
    ):
        _check(errors, key, _positive(getattr(config, key)))
    if config.max_pending_handshakes is not None:
        _check(errors, "max_pending_handshakes", _positive(config.max_pending_handshakes))
    _check(errors, "rcvhwm", _range(config.rcvhwm, 0, (1 << 31) - 1))
    window = config.coalesce_window
    _check(errors, "coalesce_window", None if 0 <= window <= 1 else f"must be 0..1 seconds, got {window}")
    if errors:
        _raise(tuple(errors))


def structure_serve_config(data: Mapping[str, object], *, context: str | None = None) -> ServeConfig:
    """Type-check and validate plain data (a TOML document or merged CLI options) into a ServeConfig."""
    if not isinstance(data, Mapping):
        _raise((f"expected a table of settings, got {type(data).__name__}",), context)
    try:
        config = _converter.structure(dict(data), ServeConfig)
    except (cattrs.BaseValidationError, ForbiddenExtraKeysError) as exc:
        _raise(_flatten(transform_error(exc, format_exception=_describe)), context)
    config = _with_slot_models(config)
    try:
        validate_serve_config(config)
    except ConfigError as exc:
        _raise(exc.errors, context)
    return config


def _inherited_model(config: ServeConfig, slot: SlotConfig) -> str | None:
    if slot.cache_owner_id is not None:
        return None  # an explicit id takes no model: it stays exactly the id given
    return config.model or (SIMULATED_MODEL if slot.simulate else None)


def _with_slot_models(config: ServeConfig) -> ServeConfig:
    """Give every derived-id slot without a ``model`` the top-level one (a simulated slot: the simulator's)."""
    slots = tuple(
        slot if slot.model is not None else attrs.evolve(slot, model=_inherited_model(config, slot))
        for slot in config.slots
    )
    return attrs.evolve(config, slots=slots)


def load_config_file(path: str | os.PathLike[str]) -> ServeConfig:
    """Read a TOML config (top-level settings plus ``[[slots]]`` tables); errors name the file."""
    source = Path(path)
    try:
        data = tomllib.loads(source.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config file: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    return structure_serve_config(data, context=str(source))


def resolve_cache_owner_id(slot: SlotConfig) -> CacheOwnerId:
    """The slot's CacheOwnerId: the explicit text, or derived from its name, model and pool material."""
    if slot.cache_owner_id is not None:
        return CacheOwnerId.parse(slot.cache_owner_id)
    return derive_cache_owner_id(
        slot.name,
        kv_block_size=slot.kv_block_size,
        cache_semantics=slot.cache_semantics,
        routing_scope=slot.routing_scope,
        dc_id=slot.dc_id,
        model=slot.model,
    )


def warn_if_models_unnamed(config: ServeConfig) -> list[str]:
    """Log ONE warning naming the slots whose derived CacheOwnerId has no model in it; those slots."""
    unnamed = [
        slot.name
        for slot in config.slots
        if slot.cache_owner_id is None
        and slot.model is None
        and not (slot.cache_semantics or {}).get("model")
    ]
    if unnamed:
        log.warning(
            "cache_owner_id_without_model",
            slots=unnamed,
            hint="slots of the same name serving different models get the same CacheOwnerId and collide; "
            "pass --model NAME (or model = in the config), or --cache-owner-id",
        )
    return unnamed


def discovery_options(config: ServeConfig) -> dict[str, object]:
    """The keyword options of ``open_discovery(config.discovery, **options)``; reads the password file."""
    return etcd_open_options(config.etcd)
