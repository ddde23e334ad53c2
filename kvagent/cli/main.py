"""The ``kvagent`` command: ``serve``, ``query`` and ``slot-id``."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Any

import trio

from kvagent import _native
from kvagent.cli.config import SERVE_OPTIONS, ServeConfig, load_config_file, structure_serve_config
from kvagent.cli.errors import OneLineArgumentParser, explain, one_line
from kvagent.cli.logs import Console
from kvagent.cli.options import Option, Scope, add_arguments, given_values
from kvagent.cli.slot_grammar import SlotSpec, parse_slot_spec
from kvagent.cli.stream_follow import add_stream_follow_parser
from kvagent.cli.top import add_top_parser
from kvagent.model.errors import ConfigError
from kvagent.model.ids import resolve_stable_dp_slot_id
from kvagent.recovery.protocol import DEFAULT_URL

__all__ = ["build_parser", "main"]


def _apply_republish(data: dict[str, Any], republish: dict[str, object]) -> None:
    """Command-line republish options override each slot's ``[slots.republish]`` key by key.

    Without ``--republish`` they refine the slots that already republish (from ``--config``).
    """
    if not republish or not isinstance(data.get("slots"), list):
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
        flags = [
            declared.flags[0]
            for scope, _, declared in SERVE_OPTIONS
            if scope is Scope.REPUBLISH and declared.flags
        ]
        raise ConfigError(f"{', '.join(flags[1:-1])} and {flags[-1]} need {flags[0]}")
    data["slots"] = slots


_GROUPS = {
    Scope.REPUBLISH: "republish (a vLLM-compatible KV event stream per slot)",
    Scope.ETCD: "etcd discovery (TOML [etcd]; docs/discovery.md)",
    Scope.STREAM: "event streams in Redis/Valkey (TOML [stream]; docs/fleet.md)",
}


def _add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """``--config``, ``--slot`` and one argument per declared option (kvagent/cli/options.py)."""
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
    add_arguments(serve, [entry for entry in SERVE_OPTIONS if entry[0] not in _GROUPS])
    for scope, title in _GROUPS.items():
        add_arguments(
            serve.add_argument_group(title), [entry for entry in SERVE_OPTIONS if entry[0] is scope]
        )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="kvagent", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"kvagent {_version()}, native core: {_native.describe()}"
    )
    parser.add_argument("--debug", action="store_true", help="a failure shows its traceback, not one line")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run slot agents (one per --slot)")
    serve.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="as kvagent --debug")
    _add_serve_arguments(serve)

    query = sub.add_parser("query", help="ask a running agent over websocket; prints JSON lines")
    query.add_argument("--url", default=DEFAULT_URL, help="agent websocket base URL")
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
    add_stream_follow_parser(sub)

    slot_id = sub.add_parser("slot-id", help="print the stable DP slot id derived from a slot name")
    slot_id.add_argument("name")
    return parser


# -- merging the command line over --config (generated from the declarations: kvagent/cli/options.py) ------

Given = dict[str, tuple[Option, Any]]  # TOML key -> (its option, the command line's value)


def _check_exclusive(specs: list[SlotSpec], given: Given, *, engine_only: bool) -> None:
    """A global value that two slots would share (a replay endpoint, worker id, rank) is a mistake, not a
    default: ``engine_only`` counts only the slots with an engine endpoint (engine keys)."""
    for declared, value in given.values():
        if not declared.exclusive or declared.slot_key is None:
            continue
        sharing = [
            spec.name
            for spec in specs
            if getattr(spec, declared.slot_key) is None and (spec.endpoint is not None or not engine_only)
        ]
        if len(sharing) > 1:
            example = specs[0].name + ("=tcp://HOST:PORT" if engine_only else "")
            raise ConfigError(
                f"{declared.flags[0]} {value} would apply to every one of slots {', '.join(sharing)}: "
                f"set it per slot instead, e.g. --slot '{example},{declared.slot_key}=...'"
            )


def _per_slot(table: dict[str, object], spec: SlotSpec, given: Given, options: dict[str, Option]) -> None:
    """Set ``table``'s keys: a ``--slot`` key of the spec, else the global flag's value."""
    for key, declared in options.items():
        own = getattr(spec, declared.slot_key) if declared.slot_key is not None else None
        chosen = own if own is not None else (given[key][1] if key in given else None)
        if chosen is not None:
            table[key] = chosen


def _slot_options(scope: Scope) -> dict[str, Option]:
    """The options of ``scope`` that a ``--slot`` key overrides, by TOML key."""
    return {
        field.name: declared
        for option_scope, field, declared in SERVE_OPTIONS
        if option_scope is scope and declared.slot_key is not None
    }


def _slot_tables(
    args: argparse.Namespace, given: dict[Scope, Given], slot_defaults: dict[str, object]
) -> list[dict[str, object]]:
    """The ``[[slots]]`` tables of the --slot options (each key of a --slot overrides its global flag)."""
    specs = [parse_slot_spec(text) for text in args.slot]
    _check_exclusive(specs, given[Scope.ENGINE], engine_only=True)
    _check_exclusive(specs, given[Scope.SLOT], engine_only=False)
    slots: list[dict[str, object]] = []
    for spec in specs:
        slot: dict[str, object] = {"name": spec.name, **slot_defaults}
        _per_slot(slot, spec, given[Scope.SLOT], _slot_options(Scope.SLOT))
        # A top-level option with a --slot key (model): the key sets the slot's own value of that name.
        _per_slot(slot, spec, {}, _slot_options(Scope.TOP))
        if spec.endpoint is not None:
            engine: dict[str, object] = {"endpoint": spec.endpoint}
            _per_slot(engine, spec, given[Scope.ENGINE], _slot_options(Scope.ENGINE))
            engine.update(
                {key: value for key, (declared, value) in given[Scope.ENGINE].items() if key not in engine}
            )
            slot["engine"] = engine
        elif args.simulate:
            slot["simulate"] = True
        slots.append(slot)
    return slots


def _slot_defaults(given: dict[Scope, Given]) -> dict[str, object]:
    """Slot keys the command line sets for every slot (those with a --slot key are applied per slot;
    --simulate only to slots without an engine)."""
    return {
        key: value
        for key, (declared, value) in given[Scope.SLOT].items()
        if declared.slot_key is None and key != "simulate"
    }


def _override_file_slots(
    data: dict[str, Any], given: dict[Scope, Given], slot_defaults: dict[str, object]
) -> None:
    """Without --slot, the command line's slot options override every ``[[slots]]`` table of --config."""
    file_slots = data.get("slots")
    if not isinstance(file_slots, list):
        return
    for key, (declared, value) in given[Scope.SLOT].items():
        if declared.slot_key is None:
            continue
        if declared.exclusive and len(file_slots) > 1:
            raise ConfigError(
                f"{declared.flags[0]} {value} would apply to all {len(file_slots)} [[slots]] of --config: "
                f"set {key} in each table instead"
            )
        slot_defaults = {**slot_defaults, key: value}
    if slot_defaults:
        data["slots"] = [{**dict(s), **slot_defaults} for s in file_slots]


def _apply_table(data: dict[str, Any], given: Given, table: str | None) -> None:
    """The command line's keys of the top level (``table`` None) or of one table, key by key."""
    if not given:
        return
    if table is not None:
        current = data.get(table)
        data[table] = target = dict(current) if isinstance(current, dict) else {}
    else:
        target = data
    for key, (declared, value) in given.items():
        target[key] = value
        for replaced in declared.clears:
            target.pop(replaced, None)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Merge a config file (if any) with command-line options into one validated ServeConfig."""
    data: dict[str, Any] = {}
    if args.config:
        data = load_config_file(args.config).to_dict()
    given = given_values(args, SERVE_OPTIONS)
    slot_defaults = _slot_defaults(given)
    if args.slot:
        data["slots"] = _slot_tables(args, given, slot_defaults)
    else:
        _override_file_slots(data, given, slot_defaults)
    if args.simulate and isinstance(data.get("slots"), list):
        data["slots"] = [
            {**s, "simulate": True} if isinstance(s, dict) and not s.get("engine") else s
            for s in data["slots"]
        ]
    _apply_table(data, given[Scope.TOP], None)
    _apply_table(data, given[Scope.ETCD], "etcd")
    _apply_table(data, given[Scope.STREAM], "stream")
    _apply_republish(data, {key: value for key, (_, value) in given[Scope.REPUBLISH].items()})
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
        if args.command == "stream-follow":
            from kvagent.cli.stream_follow import run_stream_follow

            return trio.run(run_stream_follow, args)
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
