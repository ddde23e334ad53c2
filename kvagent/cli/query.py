"""``kvagent query``: one websocket request (or a follow stream) printed as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys

import trio

from kvagent.model.errors import FollowOverrun, RecoveryClientError
from kvagent.recovery.client import connect_slot
from kvagent.wire.router_event import router_event_to_json

__all__ = ["run_query"]


def _emit(value: object) -> None:
    print(json.dumps(value, separators=(",", ":")), flush=True)


async def run_query(args: argparse.Namespace) -> int:
    token = (await trio.Path(args.token_file).read_text()).strip() if args.token_file else None
    encoding = "msgpack" if args.msgpack else "json"
    try:
        async with connect_slot(args.url, args.slot, token=token, encoding=encoding) as client:
            if args.op == "status":
                _emit({"status": (await client.status()).to_json()})
            elif args.op == "list":
                _emit({"slots": await client.list_slots()})
            elif args.op == "recover":
                result = await client.recover(start=None if args.from_ is None else args.from_ + 1, end=args.end)
                _emit(result.to_json())
            elif args.op == "detach":
                if args.generation is None:
                    raise SystemExit("kvagent query detach: --generation is required")
                _emit({"cursor": await client.detach(args.generation)})
            elif args.op == "quarantine":
                if args.generation is None:
                    raise SystemExit("kvagent query quarantine: --generation is required")
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
        print(f"kvagent query: follower overrun; resume with --from {exc.last_sent}", file=sys.stderr)
        return 3
    except RecoveryClientError as exc:
        print(f"kvagent query: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvagent query: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    return 0
