"""``kvagent serve`` configuration: attrs classes structured by cattrs from TOML or command-line options.

Errors are :class:`ConfigError` and name the failing key path, for example
``slots[0].kv_block_size: must be > 0``; several failures are reported together.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NewType, NoReturn

import attrs
import cattrs
import structlog
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.v import format_exception, transform_error

from kvagent.agent.advertising import WILDCARD_HOSTS
from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.cli.etcd_settings import EtcdSettings, etcd_open_options, etcd_problems
from kvagent.cli.options import Scope, ScopedOption, scoped_options, setting
from kvagent.cli.slot_grammar import SlotSpec, parse_slot_spec
from kvagent.cli.stream_settings import StreamSettings, stream_problems
from kvagent.discovery import check_discovery_url
from kvagent.model.errors import ConfigError, IdentityError, KvAgentError
from kvagent.model.events import IngressProtocol
from kvagent.model.ids import CacheOwnerId, derive_cache_owner_id, explicit_material, with_model
from kvagent.model.options import (
    bind_endpoint,
    configured,
    field_problems,
    format_bytes,
    host_port,
    option_from,
    parse_byte_size,
    positive,
    u64,
)
from kvagent.publish.republisher import RepublishConfig
from kvagent.recovery.protocol import DEFAULT_HOST, DEFAULT_PORT
from kvagent.recovery.server import ServingOptions
from kvagent.vllm.budget import IngestBudget
from kvagent.vllm.listener import ListenerOptions

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


# -- checks of what only the serve process has (the runtime classes declare their own) ------------------


def _listen_address(text: str) -> str | None:
    return host_port(text)


_ADVERTISE_RE = re.compile(r"\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*|[A-Za-z0-9_.-]+")


def _advertise_problem(text: str) -> str | None:
    """A host name or address (IPv6 with or without brackets), no port: URLs get the bound ports."""
    if _ADVERTISE_RE.fullmatch(text) is None:
        return f"expected a host name or IP address (no port, no scheme), got {text!r}"
    if text in WILDCARD_HOSTS:
        return f"must name this machine as clients reach it, not the wildcard address {text!r}"
    return None


def _discovery_problem(url: str) -> str | None:
    try:
        check_discovery_url(url)
    except ValueError as exc:
        return str(exc)
    return None


def _not_empty(value: str) -> str | None:
    return None if value else "must not be empty"


def _one_of(*choices: str) -> Callable[[str], str | None]:
    listing = " or ".join(map(repr, choices)) if len(choices) == 2 else "one of " + ", ".join(choices)

    def check(value: str) -> str | None:
        return None if value in choices else f"must be {listing}, got {value!r}"

    return check


def _identity_map_problem(entries: Mapping[str, str] | None) -> str | None:
    if not entries:
        return None
    try:
        explicit_material(entries)
    except IdentityError as exc:
        return str(exc)
    return None


def _cache_owner_id_problem(text: str) -> str | None:
    try:
        CacheOwnerId.parse(text)
    except IdentityError as exc:
        return str(exc)
    return None


def _ingress_protocol_problem(text: str) -> str | None:
    return None if text == IngressProtocol.VLLM_RESIDENCY_V1.value else EXTERNAL_INGRESS_ERROR


def _state_dir_problem(text: str) -> str | None:
    return None if text else f"must be a directory or {STATE_DIR_NONE!r}, got an empty string"


# The listener's own defaults: the largest payload it accepts (kvagent/vllm/listener.py).
MAX_PAYLOAD_BYTES = ListenerOptions().max_payload_bytes


def _ingest_budget_problem(budget: int) -> str | None:
    # IngestBudget owns the rule (each half holds two of the largest payloads); here it is said in the
    # operator's units before ListenerOptions would refuse it.
    least = IngestBudget.least_total(MAX_PAYLOAD_BYTES)
    if budget >= least:
        return None
    return (
        f"must be at least {format_bytes(least)} (4 x the largest vLLM payload a listener accepts, "
        f"{format_bytes(MAX_PAYLOAD_BYTES)}), got {format_bytes(budget)}"
    )


def _parse_byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ByteSize: an int in the config; TOML and the command line also take a text like "64MiB".
ByteSize = NewType("ByteSize", int)


# -- the configuration: what cattrs structures a TOML document into --------------------------------------
# A field ``option_from(RuntimeClass, "name")`` is that runtime option (its default, help, flag and check,
# declared once on the runtime class); ``setting(...)`` declares what only the serve process has.


@attrs.frozen(slots=True)
class EngineConfig:
    """The engine a slot attaches to at start (an :class:`AttachmentConfig` with the slot's rank)."""

    endpoint: str = option_from(AttachmentConfig, "endpoint")
    topic: str = option_from(AttachmentConfig, "topic")
    replay_endpoint: str | None = option_from(AttachmentConfig, "replay_endpoint")
    # None: derived from the slot's name and the endpoint (kvagent.model.ids.derive_worker_id).
    worker_id: int | None = option_from(AttachmentConfig, "worker_id", default=None)
    image_token_id: int | None = option_from(AttachmentConfig, "image_token_id")
    video_token_id: int | None = option_from(AttachmentConfig, "video_token_id")


@attrs.frozen(slots=True)
class RepublishSettings:
    """``[slots.republish]``: the slot's vLLM-compatible stream (endpoints of dp_rank 0, offset per rank)."""

    endpoint: str = option_from(RepublishConfig, "endpoint")
    replay_endpoint: str | None = option_from(RepublishConfig, "replay_endpoint")
    topic: str = option_from(RepublishConfig, "topic")
    legacy_replay: bool = option_from(RepublishConfig, "legacy_replay")
    buffer_batches: int = option_from(RepublishConfig, "buffer_batches")

    def to_config(self) -> RepublishConfig:
        return configured(RepublishConfig, self)


@attrs.frozen(slots=True)
class SlotConfig:
    name: str = setting(help="the slot's name, one URL path segment (--slot NAME)")
    kv_block_size: int = option_from(SlotAgentConfig, "kv_block_size")
    dp_rank: int = option_from(SlotAgentConfig, "dp_rank")
    cache_owner_id: str | None = setting(
        None,
        help="full CacheOwnerId text instead of deriving one",
        flags=("--cache-owner-id",),
        check=_cache_owner_id_problem,
    )
    cache_semantics: dict[str, str] | None = setting(
        None,
        help="explicit cache-semantics material of the derived CacheOwnerId (docs/identity.md; repeatable)",
        flags=("--cache-semantics",),
        repeat=True,
        check=_identity_map_problem,
    )
    routing_scope: dict[str, str] | None = setting(
        None,
        help="explicit routing-scope material of the derived CacheOwnerId (docs/identity.md; repeatable)",
        flags=("--routing-scope",),
        repeat=True,
        check=_identity_map_problem,
    )
    dc_id: int = setting(
        0, help="data-centre id (u64) of the derived CacheOwnerId", flags=("--dc-id",), parse=int, check=u64
    )
    ring_capacity: int = option_from(SlotAgentConfig, "ring_capacity")
    ingress_protocol: str = setting(
        IngressProtocol.VLLM_RESIDENCY_V1.value,
        help="the engine's event protocol (only vllm_residency_v1)",
        check=_ingress_protocol_problem,
    )
    strict_cache_owner: bool = option_from(SlotAgentConfig, "strict_cache_owner")
    engine: EngineConfig | None = None
    simulate: bool = setting(
        False,
        help="attach every slot without an endpoint to an embedded simulated vLLM engine",
        flags=("--simulate",),
        switch=True,
    )
    republish: RepublishSettings | None = None
    # The served model's name: part of the derived CacheOwnerId (docs/identity.md). Unset, a slot without
    # an explicit cache_owner_id gets the top-level ``model``, else (simulated) SIMULATED_MODEL, else none.
    model: str | None = setting(
        None, help="this slot's model (--slot NAME,model=M; default: the top-level model)"
    )


@attrs.frozen(slots=True)
class ServeConfig:
    # Empty by default so a config file may leave the slots to the command line (the CLI insists on one).
    slots: tuple[SlotConfig, ...] = ()
    listen: str = setting(
        f"{DEFAULT_HOST}:{DEFAULT_PORT}",
        help="websocket HOST:PORT (IPv6 as [::1]:8765)",
        flags=("--listen",),
        metavar="HOST:PORT",
        check=_listen_address,
    )
    discovery: str = setting(
        factory=_default_discovery,
        help="memory | file:DIR | etcd://HOST:PORT[,HOST:PORT][/PREFIX]",
        flags=("--discovery",),
        check=_discovery_problem,
        default_text='"file:<state root>/discovery"',
    )
    # Where slots persist their state (docs/durability.md); "none" keeps it in memory only.
    state_dir: str = setting(
        factory=_default_slot_state_dir,
        help="persist each slot's state here and resume from it on restart ('none' keeps it in memory)",
        flags=("--state-dir",),
        metavar="DIR|none",
        check=_state_dir_problem,
        default_text='"<state root>/state"',
    )
    token_file: str | None = setting(
        None,
        help="control token file (created with a fresh token if missing)",
        flags=("--token-file",),
        default_text="<state root>/token",
    )
    publish: str | None = setting(
        None,
        help="bind the outbound ZMQ event plane here",
        flags=("--publish",),
        metavar="tcp://HOST:PORT",
        check=bind_endpoint,
    )
    http: str | None = setting(
        None,
        help="serve the HTTP surface here: /metrics, /healthz, /readyz, /v1/slots[/SLOT/status|dump] "
        "(--metrics is the older name)",
        flags=("--http", "--metrics"),
        metavar="HOST:PORT",
        check=_listen_address,
        clears=("metrics",),  # the file's older spelling of the same listener is overridden too
    )
    metrics: str | None = setting(None, help="the older name of http, still accepted", check=_listen_address)
    log_format: str = setting(
        "text",
        help="log lines as text or one JSON object each",
        flags=("--log-format",),
        choices=("text", "json"),
        check=_one_of("text", "json"),
    )
    log_level: str = setting(
        "info",
        help="the log threshold",
        flags=("--log-level",),
        choices=LOG_LEVELS,
        check=_one_of(*LOG_LEVELS),
    )
    # The websocket server's bounds (recovery.server.ServingOptions; docs/protocol.md, "Limits and deadlines").
    max_connections: int = option_from(ServingOptions, "max_connections")
    max_message_bytes: int = option_from(ServingOptions, "max_message_size")
    status_interval: float = setting(
        5.0,
        help="seconds between console status lines",
        flags=("--status-interval",),
        parse=float,
        check=positive,
    )
    shutdown_timeout: float = option_from(ServingOptions, "shutdown_timeout")
    # Every slot's listener (vllm.listener.ListenerOptions).
    rcvhwm: int = option_from(ListenerOptions, "rcvhwm")
    coalesce_window: float = option_from(ListenerOptions, "coalesce_window")
    # An int in the listener; TOML and the command line also take a text like "64MiB", and the check says
    # the listener's rule in the operator's units (the command line cannot change max_payload_bytes).
    ingest_budget: ByteSize = option_from(
        ListenerOptions, "ingress_bytes", parse=_parse_byte_size, check=_ingest_budget_problem
    )
    shed_after: float = option_from(ListenerOptions, "shed_after")
    handshake_timeout: float = option_from(ServingOptions, "handshake_timeout")
    max_pending_handshakes: int | None = option_from(ServingOptions, "max_pending_handshakes")
    send_deadline: float = option_from(ServingOptions, "send_deadline")
    outbound_queue_bytes: int = option_from(ServingOptions, "outbound_queue_bytes")
    # The host put into advertised and printed URLs; None: the listen host, or this machine's name for a
    # wildcard listen address (kvagent/agent/advertising.py).
    advertise: str | None = setting(
        None,
        help="host put into advertised and printed URLs (default: the --listen host, or this machine's "
        "name when it listens on 0.0.0.0 or ::)",
        flags=("--advertise",),
        metavar="HOST",
        check=_advertise_problem,
    )
    model: str | None = setting(
        None,
        help="the served model's name; part of each derived CacheOwnerId, so two models' slots never "
        "collide (per slot: model=NAME)",
        flags=("--model",),
        metavar="NAME",
        check=_not_empty,
        slot_key="model",
    )
    silence_warning: float = option_from(SlotAgentConfig, "silence_warning")
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


# Every serve option, in the order of `kvagent serve --help` and of docs/configuration.md's table.
SERVE_OPTIONS: list[ScopedOption] = [
    *scoped_options(ServeConfig, Scope.TOP),
    *scoped_options(SlotConfig, Scope.SLOT),
    *scoped_options(EngineConfig, Scope.ENGINE),
    *scoped_options(RepublishSettings, Scope.REPUBLISH),
    *scoped_options(EtcdSettings, Scope.ETCD),
    *scoped_options(StreamSettings, Scope.STREAM),
]


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


def _byte_size(value: object, _: type) -> int:
    if isinstance(value, str):
        try:
            return parse_byte_size(value)
        except ValueError as exc:
            raise _StrictTypeError(str(exc)) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _StrictTypeError(f"expected a byte size like 64MiB or an integer, got {value!r}")
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
    converter.register_structure_hook(ByteSize, _byte_size)
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


def _republish_endpoints(errors: list[str], path: str, slot: SlotConfig) -> list[tuple[str, str]]:
    """Check ``[slots.republish]``; the endpoints this slot binds (offset by its dp_rank) with their key paths."""
    republish = slot.republish
    if republish is None:
        return []
    errors.extend(field_problems(republish, path))
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
    errors.extend(field_problems(slot, path))
    if slot.model is not None and slot.cache_owner_id is None:
        try:
            explicit_material(with_model(slot.cache_semantics, slot.model) or {})
        except IdentityError as exc:
            errors.append(f"{path}.model: {exc}")
    if slot.cache_owner_id is not None:
        # An explicit owner id already encodes the pool; accepting pool material too would silently ignore it.
        errors.extend(
            f"{path}.{key}: cannot be combined with an explicit cache_owner_id"
            for key in ("cache_semantics", "routing_scope")
            if getattr(slot, key)
        )
        if slot.dc_id:
            errors.append(f"{path}.dc_id: cannot be combined with an explicit cache_owner_id")
    if slot.engine is not None:
        errors.extend(field_problems(slot.engine, f"{path}.engine"))
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
    errors.extend(field_problems(config, ""))  # each option's own check
    if config.http is not None and config.metrics is not None and config.http != config.metrics:
        errors.append("metrics: is the older name of http; set only http")
    errors.extend(etcd_problems(config.etcd, config.discovery))
    errors.extend([] if config.stream is None else stream_problems(config.stream))
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
