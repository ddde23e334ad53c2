"""``kvagent query``: one websocket request (or a follow stream) printed as JSON lines."""

from __future__ import annotations

import argparse
import json
import os
import sys

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError

from kvagent.cli.config import default_state_dir
from kvagent.cli.errors import agent_connection_problem
from kvagent.model.errors import FollowOverrun, RecoveryClientError
from kvagent.model.ids import derive_worker_id
from kvagent.recovery.client import RecoveryClient, connect_slot
from kvagent.recovery.protocol import CONTROL_OPS
from kvagent.wire.router_event import router_event_to_json

__all__ = ["run_query"]


def _emit(value: object) -> None:
    print(json.dumps(value, separators=(",", ":")), flush=True)


def _fail(message: str, status: int = 1) -> int:
    """One line on stderr (issue #19): 2 for a usage mistake, 1 for what went wrong at run time."""
    print(f"kvagent: error: {message}", file=sys.stderr)
    return status


async def _read_token(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(token, error): ``--token-file``, else for a control op ``<state root>/token`` when it exists."""
    path = args.token_file
    if path is None and args.op in CONTROL_OPS:
        default = default_state_dir() / "token"
        if not default.exists():
            return None, (
                f"query {args.op} needs the control token: pass --token-file "
                f"(kvagent serve writes it to --token-file, by default {default})"
            )
        path = str(default)
    if path is None:
        return None, None
    try:
        return (await trio.Path(path).read_text()).strip(), None
    except OSError as exc:
        return None, f"--token-file {path}: {exc.strerror or exc}"


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.op in ("detach", "quarantine") and args.generation is None:
        return f"query {args.op}: --generation is required (`kvagent query SLOT status` shows it)"
    if args.op == "attach" and not args.endpoint:
        return "query attach: --endpoint is required (the engine's KV event endpoint, tcp://HOST:PORT)"
    if args.op in CONTROL_OPS and args.slot == "-":
        return f"query {args.op}: name the slot (`kvagent query - list` shows the slots)"
    return None


async def run_query(args: argparse.Namespace) -> int:
    if not args.url.startswith(("ws://", "wss://")):
        return _fail(f"--url must be ws://HOST:PORT or wss://HOST:PORT, got {args.url!r}", 2)
    problem = _usage_problem(args)
    if problem is not None:
        return _fail(problem, 2)
    token, problem = await _read_token(args)
    if problem is not None:
        return _fail(problem, 2)
    try:
        return await _query(args, token)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


async def _attach(client: RecoveryClient, args: argparse.Namespace) -> dict[str, object]:
    dp_rank = args.dp_rank
    if dp_rank is None:  # the engine being replaced keeps its rank; a first attach is rank 0
        current = (await client.status()).attachment
        dp_rank = 0 if current is None else current.worker.dp_rank
    worker_id = args.worker_id if args.worker_id is not None else derive_worker_id(args.slot, args.endpoint)
    attachment = await client.attach(
        worker_id=worker_id,
        dp_rank=dp_rank,
        endpoint=args.endpoint,
        topic=args.topic,
        replay_endpoint=args.replay,
    )
    return {"attachment": attachment}


async def _one_op(client: RecoveryClient, args: argparse.Namespace) -> None:
    """Every op but follow: one request, one JSON line."""
    if args.op == "status":
        _emit({"status": (await client.status()).to_json()})
    elif args.op == "list":
        _emit({"slots": await client.list_slots()})
    elif args.op == "recover":
        result = await client.recover(start=None if args.from_ is None else args.from_ + 1, end=args.end)
        _emit(result.to_json())
    elif args.op == "attach":
        _emit(await _attach(client, args))
    elif args.op == "detach":
        _emit({"cursor": await client.detach(args.generation)})
    else:
        await client.quarantine(args.generation, args.reason)
        _emit({"ok": True})


async def _follow(client: RecoveryClient, args: argparse.Namespace) -> None:
    seen = 0
    async for item in client.follow(args.from_):
        for event in item.events:
            _emit({"kind": item.kind, "event": router_event_to_json(event)})
            if item.kind == "live":
                seen += 1
        if args.limit is not None and seen >= args.limit:
            break


async def _query(args: argparse.Namespace, token: str | None) -> int:
    encoding = "msgpack" if args.msgpack else "json"
    try:
        async with connect_slot(args.url, args.slot, token=token, encoding=encoding) as client:
            if args.op == "follow":
                await _follow(client, args)
            else:
                await _one_op(client, args)
    except FollowOverrun as exc:
        print(f"kvagent: error: follower overrun; resume with --from {exc.last_sent}", file=sys.stderr)
        return 3
    except RecoveryClientError as exc:
        hint = (
            " (check --token-file: it must be the serving agent's token)"
            if exc.code == "unauthorized"
            else ""
        )
        return _fail(f"{exc.code}: {exc.message}{hint}")
    except ConnectionRejected as exc:
        if exc.status_code == 404:
            return _fail(f"no slot {args.slot!r} at {args.url} (`kvagent query - list` shows the slots)")
        return _fail(agent_connection_problem(args.url, exc))
    except BrokenPipeError:
        raise  # our stdout, not the agent: run_query stops quietly
    except (ConnectionClosed, HandshakeError, OSError) as exc:
        return _fail(agent_connection_problem(args.url, exc))
    return 0
