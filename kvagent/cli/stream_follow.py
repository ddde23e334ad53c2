"""``kvagent stream-follow redis://HOST:PORT[/DB] [--cluster] [--slot NAME ... | --all]``: slots rebuilt from
Redis alone (a Redis Cluster: ``--cluster``, or a ``redis+cluster://`` URL).

Reads each slot's snapshot and stream entries (docs/fleet.md), with no connection to any agent, and prints
one JSON line per slot: after the catch-up, then whenever a slot's cursor or readiness changes (at most once
per ``--interval``).  ``--once`` stops after the catch-up; ``--dump`` prints each slot's tree dump then (one
RouterEvent per resident block, as ``kvagent query SLOT recover`` prints the agent's own).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import trio

from kvagent._util.redis_target import REDIS_ERRORS, StreamTarget, describe_redis_error
from kvagent.cli.errors import CliError
from kvagent.cli.logs import configure_logging
from kvagent.model.errors import ConfigError
from kvagent.stream.reader import SlotReplica, StreamFollower
from kvagent.wire.router_event import router_event_to_json

__all__ = ["add_stream_follow_parser", "run_stream_follow"]


def add_stream_follow_parser(sub: Any) -> None:
    """Register ``kvagent stream-follow`` on the top-level subparsers."""
    follow = sub.add_parser(
        "stream-follow",
        help="rebuild slots from their Redis/Valkey streams (no agent connection) and follow them",
    )
    follow.add_argument(
        "url",
        metavar="redis://HOST:PORT[/DB]",
        help="the server (rediss:// for TLS; redis+cluster://HOST:PORT for a cluster's node)",
    )
    follow.add_argument(
        "--cluster",
        action="store_true",
        help="the URL is a node of a Redis/Valkey Cluster (all its shards are read)",
    )
    which = follow.add_mutually_exclusive_group()
    which.add_argument("--slot", action="append", help="a slot to follow (repeatable)")
    which.add_argument("--all", action="store_true", help="every slot in the directory (the default)")
    follow.add_argument("--prefix", default="kvagent", help="key prefix the agents write under")
    follow.add_argument("--password-file", metavar="FILE", help="file holding the server's password")
    follow.add_argument("--username", help="the server's ACL user")
    follow.add_argument("--once", action="store_true", help="catch up, print, exit")
    follow.add_argument("--dump", action="store_true", help="with --once: print every slot's tree dump")
    follow.add_argument("--interval", type=float, default=1.0, help="seconds between a slot's lines")
    follow.add_argument(
        "--poll-ms",
        type=int,
        default=20,
        help="a cluster without sharded pub/sub (before Redis 7): milliseconds between idle polls",
    )
    follow.add_argument("--group", help="read live entries through this consumer group (with --consumer)")
    follow.add_argument("--consumer", help="this reader's name in --group")


def _password(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--password-file {path}: {exc.strerror or exc}") from None


def replica_line(replica: SlotReplica) -> dict[str, object]:
    return {
        "slot": replica.slot,
        "publisher_id": replica.head.publisher_id,
        "cursor": replica.cursor,
        "blocks": replica.index.resident_block_count,
        "ready": replica.ready,
        "generation": replica.generation,
        "state": None if replica.status is None else replica.status.state,
        "heartbeat_unix_ms": replica.heartbeat_unix_ms,
    }


def _print(value: object) -> None:
    sys.stdout.write(json.dumps(value, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def run_stream_follow(args: argparse.Namespace) -> int:
    if (args.group is None) != (args.consumer is None):
        raise ConfigError("--group and --consumer go together")
    configure_logging("text", logging.WARNING)  # stderr: stdout carries only the JSON lines
    target = StreamTarget(
        args.url, password=_password(args.password_file), username=args.username, cluster=args.cluster
    )
    follower = StreamFollower(
        target,
        prefix=args.prefix,
        slots=args.slot,
        group=args.group,
        consumer=args.consumer,
        poll_ms=args.poll_ms,
    )
    if args.once:
        try:
            await follower.catch_up()
        except REDIS_ERRORS as exc:
            raise CliError(f"{args.url}: {describe_redis_error(exc, cluster=target.is_cluster)}") from exc
        finally:
            await follower.aclose()
        for name in sorted(follower.replicas):
            replica = follower.replicas[name]
            _print(replica_line(replica))
            if args.dump:
                for event in replica.index.tree_dump().events:
                    _print({"slot": name, "event": router_event_to_json(event)})
        return 0
    await _follow_forever(follower, args.interval)
    return 0


async def _follow_forever(follower: StreamFollower, interval: float) -> None:
    """Follow until interrupted, printing a slot's line when its cursor or readiness changed."""
    printed: dict[str, tuple[object, ...]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(follower.run)
        while True:
            for name in sorted(follower.replicas):
                replica = follower.replicas[name]
                key = (replica.head.publisher_id, replica.cursor, replica.ready, replica.generation)
                if printed.get(name) != key:
                    printed[name] = key
                    _print(replica_line(replica))
            await trio.sleep(interval)
