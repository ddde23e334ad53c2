"""The ``kvagent`` command: ``serve``, ``query`` and ``slot-id``."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Any

import trio

from kvagent import _native
from kvagent.cli.config import ServeConfig, load_config_file, structure_serve_config
from kvagent.cli.errors import OneLineArgumentParser, explain, one_line
from kvagent.cli.logs import Console
from kvagent.cli.slot_grammar import SlotSpec, parse_slot_spec
from kvagent.cli.top import add_top_parser
from kvagent.model.errors import ConfigError
from kvagent.model.ids import resolve_stable_dp_slot_id

__all__ = ["build_parser", "main"]


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _add_republish_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("republish (a vLLM-compatible KV event stream per slot)")
    group.add_argument(
        "--republish",
        metavar="tcp://HOST:PORT",
        help="bind each slot's vLLM-format PUB here (PORT + the slot's dp_rank, as vLLM offsets DP ranks)",
    )
    group.add_argument(
        "--republish-replay",
        metavar="tcp://HOST:PORT",
        help="bind each slot's vLLM replay ROUTER here (PORT + dp_rank); old starts get a snapshot",
    )
    group.add_argument("--republish-topic", help="topic frame of the republished stream (default empty)")
    group.add_argument(
        "--legacy-replay",
        action="store_true",
        default=None,
        help="answer replay in the 3-frame form of vLLM < 0.26",
    )


def _republish_from_args(args: argparse.Namespace) -> dict[str, object] | None:
    """The ``republish`` table the republish options give every slot (None: no option given)."""
    options = {
        "endpoint": args.republish,
        "replay_endpoint": args.republish_replay,
        "topic": args.republish_topic,
        "legacy_replay": args.legacy_replay,
    }
    given = {key: value for key, value in options.items() if value is not None}
    return given or None


def _apply_republish(data: dict[str, Any], republish: dict[str, object] | None) -> None:
    """Command-line republish options override each slot's ``[slots.republish]`` key by key.

    Without ``--republish`` they refine the slots that already republish (from ``--config``).
    """
    if republish is None or not isinstance(data.get("slots"), list):
        return
    slots: list[object] = []
    applied = False
    for slot in data["slots"]:
        if isinstance(slot, dict):
            table = slot.get("republish")
            if isinstance(table, dict) or "endpoint" in republish:
                slot = {**slot, "republish": {**(table if isinstance(table, dict) else {}), **republish}}
                applied = True
        slots.append(slot)
    if not applied:
        raise ConfigError("--republish-replay, --republish-topic and --legacy-replay need --republish")
    data["slots"] = slots


# --etcd-* flag -> its key in the [etcd] table
_ETCD_OPTIONS = {
    "etcd_ttl": "ttl",
    "etcd_user": "username",
    "etcd_password_file": "password_file",
    "etcd_ca": "ca_file",
    "etcd_cert": "cert_file",
    "etcd_key": "key_file",
}


def _add_etcd_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("etcd discovery (TOML [etcd]; docs/discovery.md)")
    group.add_argument("--etcd-ttl", type=float, metavar="SECONDS", help="lease TTL (default 10)")
    group.add_argument("--etcd-user", metavar="NAME", help="etcd user (with --etcd-password-file)")
    group.add_argument("--etcd-password-file", metavar="FILE", help="file holding the etcd user's password")
    group.add_argument("--etcd-ca", metavar="FILE", help="CA bundle verifying etcd (etcds:// only)")
    group.add_argument("--etcd-cert", metavar="FILE", help="client certificate (etcds:// only)")
    group.add_argument("--etcd-key", metavar="FILE", help="client certificate's key (etcds:// only)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="kvagent", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"kvagent {_version()}, native core: {_native.describe()}"
    )
    parser.add_argument("--debug", action="store_true", help="a failure shows its traceback, not one line")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run slot agents (one per --slot)")
    serve.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="as kvagent --debug")
    serve.add_argument("--config", help="a kvagent.toml file (command-line options override it)")
    serve.add_argument(
        "--slot",
        action="append",
        default=[],
        metavar="NAME[=ENDPOINT][,KEY=VALUE...]",
        help="a stable DP slot; with an engine endpoint it attaches at start, without one it waits for "
        "'attach'. Per-slot keys (else the global flags): replay=ENDPOINT, worker=N, rank=N, topic=T, "
        "model=M; e.g. 'gpu0=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,worker=7,rank=0'",
    )
    serve.add_argument("--block-size", type=int, help="KV block size in tokens (default 16)")
    serve.add_argument(
        "--worker-id", type=int, help="worker id of the engine attached at start (per slot: worker=N)"
    )
    serve.add_argument(
        "--dp-rank", type=int, help="the slot's global data-parallel rank (default 0; per slot: rank=N)"
    )
    serve.add_argument("--topic", help="raw vLLM topic filter (default: everything; per slot: topic=T)")
    serve.add_argument(
        "--replay",
        metavar="ENDPOINT",
        help="vLLM replay (ROUTER) endpoint for gap repair (per slot: replay=)",
    )
    serve.add_argument(
        "--model",
        metavar="NAME",
        help="the served model's name; part of each derived CacheOwnerId, so two models' slots never "
        "collide (per slot: model=NAME)",
    )
    serve.add_argument("--cache-owner-id", help="full CacheOwnerId text instead of deriving one")
    serve.add_argument(
        "--cache-semantics",
        type=_key_value,
        action="append",
        metavar="KEY=VALUE",
        help="explicit cache-semantics material of the derived CacheOwnerId (docs/identity.md; repeatable)",
    )
    serve.add_argument(
        "--routing-scope",
        type=_key_value,
        action="append",
        metavar="KEY=VALUE",
        help="explicit routing-scope material of the derived CacheOwnerId (docs/identity.md; repeatable)",
    )
    serve.add_argument("--dc-id", type=int, help="data-centre id (u64) of the derived CacheOwnerId")
    serve.add_argument("--ring-capacity", type=int, help="recovery ring buffer size in events (default 1024)")
    serve.add_argument(
        "--strict-cache-owner",
        action="store_true",
        default=None,
        help="refuse engine events whose cache owner differs from the slot's instead of counting them",
    )
    serve.add_argument("--listen", help="websocket HOST:PORT (default 127.0.0.1:8765; IPv6 as [::1]:8765)")
    serve.add_argument(
        "--advertise",
        metavar="HOST",
        help="host put into advertised and printed URLs (default: the --listen host, or this machine's "
        "name when it listens on 0.0.0.0 or ::)",
    )
    serve.add_argument("--discovery", help="memory | file:DIR | etcd://HOST:PORT[,HOST:PORT][/PREFIX]")
    serve.add_argument("--token-file", help="control token file (created with a fresh token if missing)")
    serve.add_argument(
        "--state-dir",
        metavar="DIR|none",
        help="persist each slot's state here and resume from it on restart "
        "(default: <state root>/state; 'none' keeps it in memory)",
    )
    serve.add_argument("--publish", metavar="tcp://HOST:PORT", help="bind the outbound ZMQ event plane here")
    serve.add_argument(
        "--http",
        "--metrics",
        dest="http",
        metavar="HOST:PORT",
        help="serve the HTTP surface here: /metrics, /healthz, /readyz, /v1/slots[/SLOT/status|dump] "
        "(--metrics is the older name)",
    )
    serve.add_argument(
        "--log-format", choices=["text", "json"], help="log lines as text (default) or one JSON object each"
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    _add_republish_arguments(serve)
    serve.add_argument(
        "--max-connections", type=int, help="websocket connections served at once (default 256)"
    )
    serve.add_argument(
        "--handshake-timeout",
        type=float,
        help="seconds a connection may take to finish its websocket handshake",
    )
    serve.add_argument(
        "--max-pending-handshakes",
        type=int,
        help="connections still in their handshake (oldest dropped first; default 128, at most fd limit / 4)",
    )
    serve.add_argument(
        "--send-deadline",
        type=float,
        help="seconds a client may leave a frame unaccepted before it is closed with 1013 overrun",
    )
    serve.add_argument("--outbound-queue-bytes", type=int, help="per-connection bound of queued answer bytes")
    serve.add_argument("--shutdown-timeout", type=float, help="seconds to close every client with 1001")
    serve.add_argument("--status-interval", type=float, help="seconds between console status lines")
    serve.add_argument(
        "--silence-warning",
        type=float,
        metavar="SECONDS",
        help="warn once when an attached engine has published nothing for this long (default 60)",
    )
    serve.add_argument(
        "--coalesce-window",
        type=float,
        metavar="SECONDS",
        help="under a steady event stream, read the engine's batches together once per this window "
        "(default 0.02; 0: wake for every batch; a batch after a quiet spell is read at once)",
    )
    _add_etcd_arguments(serve)
    serve.add_argument(
        "--simulate",
        action="store_true",
        help="attach every slot without an endpoint to an embedded simulated vLLM engine",
    )

    query = sub.add_parser("query", help="ask a running agent over websocket; prints JSON lines")
    query.add_argument("--url", default="ws://127.0.0.1:8765", help="agent websocket base URL")
    query.add_argument("--token-file", help="control token file (for attach/detach/quarantine)")
    query.add_argument("--msgpack", action="store_true", help="use binary msgpack frames")
    query.add_argument("slot", help="slot name (or '-' with op 'list')")
    query.add_argument(
        "op", choices=["status", "recover", "follow", "list", "attach", "detach", "quarantine"]
    )
    query.add_argument("--from", dest="from_", type=int, help="cursor: recover/follow after this id")
    query.add_argument("--end", type=int, help="recover: end id (validates, does not truncate)")
    query.add_argument("--generation", type=int, help="detach/quarantine: attachment generation")
    query.add_argument("--reason", default="operator quarantine", help="quarantine reason")
    query.add_argument("--limit", type=int, help="follow: stop after this many live events")
    attach = query.add_argument_group("attach (needs the control token)")
    attach.add_argument("--endpoint", metavar="tcp://HOST:PORT", help="the engine's KV event (PUB) endpoint")
    attach.add_argument("--replay", metavar="ENDPOINT", help="the engine's replay (ROUTER) endpoint")
    attach.add_argument("--topic", default="", help="raw vLLM topic filter (default: everything)")
    attach.add_argument(
        "--worker-id",
        type=int,
        help="engine worker id (default: derived from slot and endpoint, as serve does)",
    )
    attach.add_argument(
        "--dp-rank", type=int, help="engine DP rank (default: the current attachment's, else 0)"
    )

    add_top_parser(sub)

    slot_id = sub.add_parser("slot-id", help="print the stable DP slot id derived from a slot name")
    slot_id.add_argument("name")
    return parser


# The global engine flags each slot may override, with the --slot key that does it.
_SHARED_FLAGS = (
    ("--replay", "replay", "replay", True),
    ("--worker-id", "worker_id", "worker", True),
    ("--dp-rank", "dp_rank", "rank", False),
)


def _check_shared_flags(specs: list[SlotSpec], args: argparse.Namespace) -> None:
    """A global --replay/--worker-id/--dp-rank that two slots would share is a mistake, not a default."""
    for flag, option, key, engine_only in _SHARED_FLAGS:
        value = getattr(args, option)
        if value is None:
            continue
        sharing = [
            spec.name
            for spec in specs
            if getattr(spec, key) is None and (spec.endpoint is not None or not engine_only)
        ]
        if len(sharing) > 1:
            example = specs[0].name + ("=tcp://HOST:PORT" if engine_only else "")
            raise ConfigError(
                f"{flag} {value} would apply to every one of slots {', '.join(sharing)}: "
                f"set it per slot instead, e.g. --slot '{example},{key}=...'"
            )


def _engine_table(spec: SlotSpec, args: argparse.Namespace) -> dict[str, object]:
    engine: dict[str, object] = {"endpoint": spec.endpoint}
    for key, own, default in (
        ("topic", spec.topic, args.topic),
        ("replay_endpoint", spec.replay, args.replay),
        ("worker_id", spec.worker, args.worker_id),
    ):
        value = own if own is not None else default
        if value is not None:
            engine[key] = value
    return engine


def _slot_tables(args: argparse.Namespace, slot_defaults: dict[str, object]) -> list[dict[str, object]]:
    """The ``[[slots]]`` tables of the --slot options (each key of a --slot overrides its global flag)."""
    specs = [parse_slot_spec(text) for text in args.slot]
    _check_shared_flags(specs, args)
    slots: list[dict[str, object]] = []
    for spec in specs:
        slot: dict[str, object] = {"name": spec.name, **slot_defaults}
        rank = spec.rank if spec.rank is not None else args.dp_rank
        if rank is not None:
            slot["dp_rank"] = rank
        if spec.model is not None:
            slot["model"] = spec.model
        if spec.endpoint is not None:
            slot["engine"] = _engine_table(spec, args)
        elif args.simulate:
            slot["simulate"] = True
        slots.append(slot)
    return slots


def _slot_defaults(args: argparse.Namespace) -> dict[str, object]:
    """Slot keys the command line sets for every slot (--dp-rank is applied per slot: it may be shared)."""
    slot_defaults: dict[str, object] = {}
    for option, key in (
        ("block_size", "kv_block_size"),
        ("cache_owner_id", "cache_owner_id"),
        ("dc_id", "dc_id"),
        ("ring_capacity", "ring_capacity"),
        ("strict_cache_owner", "strict_cache_owner"),
    ):
        value = getattr(args, option)
        if value is not None:
            slot_defaults[key] = value
    if args.cache_semantics:
        slot_defaults["cache_semantics"] = dict(args.cache_semantics)
    if args.routing_scope:
        slot_defaults["routing_scope"] = dict(args.routing_scope)
    return slot_defaults


def _override_file_slots(
    data: dict[str, Any], args: argparse.Namespace, slot_defaults: dict[str, object]
) -> None:
    """Without --slot, the command line's slot options override every ``[[slots]]`` table of --config."""
    file_slots = data.get("slots")
    if not isinstance(file_slots, list):
        return
    if args.dp_rank is not None:
        if len(file_slots) > 1:
            raise ConfigError(
                f"--dp-rank {args.dp_rank} would apply to all {len(file_slots)} [[slots]] of --config: "
                "set dp_rank in each table instead"
            )
        slot_defaults = {**slot_defaults, "dp_rank": args.dp_rank}
    if slot_defaults:
        data["slots"] = [{**dict(s), **slot_defaults} for s in file_slots]


def _apply_top_level(data: dict[str, Any], args: argparse.Namespace) -> None:
    for option in (
        "listen",
        "advertise",
        "discovery",
        "token_file",
        "publish",
        "http",
        "log_format",
        "log_level",
        "state_dir",
        "model",
        "silence_warning",
        "coalesce_window",
        "max_connections",
        "handshake_timeout",
        "max_pending_handshakes",
        "send_deadline",
        "outbound_queue_bytes",
        "shutdown_timeout",
        "status_interval",
    ):
        value = getattr(args, option)
        if value is not None:
            data[option] = value
    if args.http is not None:
        data.pop("metrics", None)  # the file's older spelling of the same listener is overridden too
    etcd = {
        key: getattr(args, option)
        for option, key in _ETCD_OPTIONS.items()
        if getattr(args, option) is not None
    }
    if etcd:
        table = data.get("etcd")
        data["etcd"] = {**(table if isinstance(table, dict) else {}), **etcd}


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Merge a config file (if any) with command-line options into one validated ServeConfig."""
    data: dict[str, Any] = {}
    if args.config:
        data = load_config_file(args.config).to_dict()
    slot_defaults = _slot_defaults(args)
    if args.slot:
        data["slots"] = _slot_tables(args, slot_defaults)
    else:
        _override_file_slots(data, args, slot_defaults)
    if args.simulate and isinstance(data.get("slots"), list):
        data["slots"] = [
            {**s, "simulate": True} if isinstance(s, dict) and not s.get("engine") else s
            for s in data["slots"]
        ]
    _apply_top_level(data, args)
    _apply_republish(data, _republish_from_args(args))
    if not data.get("slots"):
        raise ConfigError("at least one --slot (or a [[slots]] table in --config) is required")
    return structure_serve_config(data)


def _version() -> str:
    try:
        return importlib.metadata.version("kvagent")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a failure ends in one stderr line (``--debug``: the traceback instead)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `kvagent`: the whole help, not just "a command is required"
        parser.print_help(sys.stderr)
        return 2
    console = Console()
    try:
        if args.command == "serve":
            console = Console(args.log_format or "text")  # a config error follows --log-format json too
            config = serve_config_from_args(args)
            console = Console(config.log_format)  # from here on, even the error line follows --log-format
            from kvagent.cli.serve import run_serve

            return trio.run(run_serve, config)
        if args.command == "slot-id":
            print(resolve_stable_dp_slot_id(args.name))
            return 0
        if args.command == "top":
            from kvagent.cli.top import run_top

            return trio.run(run_top, args)
        from kvagent.cli.query import run_query

        return trio.run(run_query, args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        message, status = explain(exc)
        console.error(one_line(message))
        return status


if __name__ == "__main__":
    sys.exit(main())
