"""The ``kvagent`` command: ``serve``, ``query`` and ``slot-id``."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Any

import trio

from kvagent.cli.config import ServeConfig, load_config_file, parse_slot_arg, structure_serve_config
from kvagent.cli.errors import OneLineArgumentParser, explain, one_line
from kvagent.cli.logs import Console
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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="kvagent", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvagent {_version()}")
    parser.add_argument("--debug", action="store_true", help="a failure shows its traceback, not one line")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run slot agents (one per --slot)")
    serve.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="as kvagent --debug")
    serve.add_argument("--config", help="a kvagent.toml file (command-line options override it)")
    serve.add_argument(
        "--slot",
        action="append",
        default=[],
        metavar="NAME[=ENGINE_ENDPOINT]",
        help="a stable DP slot; with an endpoint it attaches at start, without one it waits for 'attach'",
    )
    serve.add_argument("--block-size", type=int, help="KV block size in tokens (default 16)")
    serve.add_argument("--worker-id", type=int, help="worker id of the engine attached at start")
    serve.add_argument("--dp-rank", type=int, help="the slot's global data-parallel rank (default 0)")
    serve.add_argument("--topic", help="raw vLLM topic filter (default: everything)")
    serve.add_argument("--replay", metavar="ENDPOINT", help="vLLM replay (ROUTER) endpoint for gap repair")
    serve.add_argument("--cache-owner-id", help="full CacheOwnerId text instead of deriving one")
    serve.add_argument("--cache-semantics", type=_key_value, action="append", metavar="KEY=VALUE")
    serve.add_argument("--routing-scope", type=_key_value, action="append", metavar="KEY=VALUE")
    serve.add_argument("--dc-id", type=int, help="data-centre id (u64) of the derived CacheOwnerId")
    serve.add_argument("--ring-capacity", type=int, help="recovery ring buffer size in events (default 1024)")
    serve.add_argument("--strict-cache-owner", action="store_true", default=None)
    serve.add_argument("--listen", help="websocket HOST:PORT (default 127.0.0.1:8765)")
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
    serve.add_argument("--log-format", choices=["text", "json"])
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    _add_republish_arguments(serve)
    serve.add_argument("--max-connections", type=int)
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
        "--simulate",
        action="store_true",
        help="attach every slot without an endpoint to an embedded simulated vLLM engine",
    )

    query = sub.add_parser("query", help="ask a running agent over websocket; prints JSON lines")
    query.add_argument("--url", default="ws://127.0.0.1:8765", help="agent websocket base URL")
    query.add_argument("--token-file", help="control token file (for attach/detach/quarantine)")
    query.add_argument("--msgpack", action="store_true", help="use binary msgpack frames")
    query.add_argument("slot", help="slot name (or '-' with op 'list')")
    query.add_argument("op", choices=["status", "recover", "follow", "list", "detach", "quarantine"])
    query.add_argument("--from", dest="from_", type=int, help="cursor: recover/follow after this id")
    query.add_argument("--end", type=int, help="recover: end id (validates, does not truncate)")
    query.add_argument("--generation", type=int, help="detach/quarantine: attachment generation")
    query.add_argument("--reason", default="operator quarantine", help="quarantine reason")
    query.add_argument("--limit", type=int, help="follow: stop after this many live events")

    slot_id = sub.add_parser("slot-id", help="print the stable DP slot id derived from a slot name")
    slot_id.add_argument("name")
    return parser


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Merge a config file (if any) with command-line options into one validated ServeConfig."""
    data: dict[str, Any] = {}
    if args.config:
        data = load_config_file(args.config).to_dict()
    slot_defaults: dict[str, object] = {}
    for option, key in (
        ("block_size", "kv_block_size"),
        ("dp_rank", "dp_rank"),
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
    if args.slot:
        slots: list[dict[str, object]] = []
        for text in args.slot:
            name, endpoint = parse_slot_arg(text)
            slot: dict[str, object] = {"name": name, **slot_defaults}
            if endpoint is not None:
                engine: dict[str, object] = {"endpoint": endpoint}
                if args.topic is not None:
                    engine["topic"] = args.topic
                if args.replay is not None:
                    engine["replay_endpoint"] = args.replay
                if args.worker_id is not None:
                    engine["worker_id"] = args.worker_id
                slot["engine"] = engine
            elif args.simulate:
                slot["simulate"] = True
            slots.append(slot)
        data["slots"] = slots
    elif slot_defaults and isinstance(data.get("slots"), list):
        data["slots"] = [{**dict(s), **slot_defaults} for s in data["slots"]]
    if args.simulate and isinstance(data.get("slots"), list):
        data["slots"] = [
            {**s, "simulate": True} if isinstance(s, dict) and not s.get("engine") else s
            for s in data["slots"]
        ]
    for option in (
        "listen",
        "discovery",
        "token_file",
        "publish",
        "http",
        "log_format",
        "log_level",
        "state_dir",
    ):
        value = getattr(args, option)
        if value is not None:
            data[option] = value
    if args.http is not None:
        data.pop("metrics", None)  # the file's older spelling of the same listener is overridden too
    for option in (
        "max_connections",
        "handshake_timeout",
        "max_pending_handshakes",
        "send_deadline",
        "outbound_queue_bytes",
        "shutdown_timeout",
    ):
        value = getattr(args, option)
        if value is not None:
            data[option] = value
    if args.status_interval is not None:
        data["status_interval"] = args.status_interval
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
