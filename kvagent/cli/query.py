"""``kvagent query``: one websocket request (or a follow stream) printed as JSON lines."""

from __future__ import annotations

import argparse
import json
import os
import sys

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError

from kvagent.model.errors import FollowOverrun, RecoveryClientError
from kvagent.recovery.client import connect_slot
from kvagent.wire.router_event import router_event_to_json

__all__ = ["run_query"]


def _emit(value: object) -> None:
    print(json.dumps(value, separators=(",", ":")), flush=True)


def _fail(message: str, status: int = 1) -> int:
    """One line on stderr (issue #19): 2 for a usage mistake, 1 for what went wrong at run time."""
    print(f"kvagent: error: {message}", file=sys.stderr)
    return status


async def run_query(args: argparse.Namespace) -> int:
    if not args.url.startswith(("ws://", "wss://")):
        return _fail(f"--url must be ws://HOST:PORT or wss://HOST:PORT, got {args.url!r}", 2)
    try:
        token = (await trio.Path(args.token_file).read_text()).strip() if args.token_file else None
    except OSError as exc:
        return _fail(f"--token-file {args.token_file}: {exc.strerror or exc}", 2)
    try:
        return await _query(args, token)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


async def _query(args: argparse.Namespace, token: str | None) -> int:
    encoding = "msgpack" if args.msgpack else "json"
    try:
        async with connect_slot(args.url, args.slot, token=token, encoding=encoding) as client:
            if args.op == "status":
                _emit({"status": (await client.status()).to_json()})
            elif args.op == "list":
                _emit({"slots": await client.list_slots()})
            elif args.op == "recover":
                result = await client.recover(
                    start=None if args.from_ is None else args.from_ + 1, end=args.end
                )
                _emit(result.to_json())
            elif args.op == "detach":
                if args.generation is None:
                    return _fail("query detach: --generation is required", 2)
                _emit({"cursor": await client.detach(args.generation)})
            elif args.op == "quarantine":
                if args.generation is None:
                    return _fail("query quarantine: --generation is required", 2)
                await client.quarantine(args.generation, args.reason)
                _emit({"ok": True})
            else:
                seen = 0
                async for item in client.follow(args.from_):
                    for event in item.events:
                        _emit({"kind": item.kind, "event": router_event_to_json(event)})
                        if item.kind == "live":
                            seen += 1
                    if args.limit is not None and seen >= args.limit:
                        break
    except FollowOverrun as exc:
        print(f"kvagent: error: follower overrun; resume with --from {exc.last_sent}", file=sys.stderr)
        return 3
    except RecoveryClientError as exc:
        return _fail(f"{exc.code}: {exc.message}")
    except ConnectionRejected as exc:
        if exc.status_code == 404:
            return _fail(f"no slot {args.slot!r} at {args.url} (`kvagent query - list` shows the slots)")
        body = (exc.body or b"").decode(errors="replace").strip()
        return _fail(f"{args.url} refused the connection: HTTP {exc.status_code} {body}".rstrip())
    except ConnectionClosed as exc:
        reason = exc.reason
        detail = (
            ""
            if reason is None
            else f" (close code {reason.code}{f' {reason.reason}' if reason.reason else ''})"
        )
        return _fail(f"the agent at {args.url} closed the connection{detail}")
    except BrokenPipeError:
        raise  # our stdout, not the agent: run_query stops quietly
    except (HandshakeError, OSError) as exc:
        cause = exc.__cause__ or exc.__context__ or exc
        return _fail(f"cannot reach an agent at {args.url}: {cause}")
    return 0
