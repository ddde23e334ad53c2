"""A minimal KV-aware router: follow slots, keep an index of their blocks, score a prompt's prefix overlap.

Slots are found either from explicit websocket URLs or through discovery (``--discovery etcd://...`` or
``file:DIR``): every source advertisement carries the slot's ``recovery_url``.  For each slot the router
``follow``s from its last cursor: first a tree dump (or the buffered tail), then live events with no gap and
no duplicate.  On overrun it resumes from ``last_sent``.

    python examples/follow_router.py --url ws://127.0.0.1:8765/v1/slots/demo --prompt-blocks 123,456,789
    python examples/follow_router.py --discovery etcd://127.0.0.1:2379 --prompt-blocks ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from kvagent import (
    KV_STATE_SOURCES_TOPIC,
    Cleared,
    Removed,
    ResidencyDomain,
    Stored,
    open_discovery,
    router_event_from_json,
)


class SlotView:
    """What the router believes one slot holds (Worker residency on the device tier, for routing)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.cursor: int | None = None
        self.blocks: set[int] = set()

    def apply(self, event: dict[str, Any], *, from_dump: bool) -> None:
        parsed = router_event_from_json(event)
        if parsed.residency_domain is not ResidencyDomain.WORKER:
            return
        data = parsed.data
        if isinstance(data, Stored):
            self.blocks.update(data.block_hashes)
        elif isinstance(data, Removed):
            self.blocks.difference_update(data.block_hashes)
        elif isinstance(data, Cleared):
            self.blocks.clear()
        if not from_dump:
            self.cursor = parsed.event_id

    def overlap(self, prompt_blocks: list[int]) -> int:
        """Length of the prompt's block prefix this slot already caches."""
        matched = 0
        for block_hash in prompt_blocks:
            if block_hash not in self.blocks:
                break
            matched += 1
        return matched


async def follow_slot(view: SlotView, *, max_frames: int | None = None) -> None:
    frames = 0
    while True:
        try:
            async with open_websocket_url(view.url) as ws:
                await ws.send_message(json.dumps({"id": 1, "op": "follow", "from": view.cursor}))
                in_dump = False
                while True:
                    reply = json.loads(await ws.get_message())
                    if not reply.get("ok"):
                        raise RuntimeError(f"follow failed: {reply.get('error')}")
                    kind = reply.get("kind")
                    if kind == "tree_dump" and not in_dump:
                        view.blocks.clear()  # a dump replaces everything believed so far
                    in_dump = kind == "tree_dump" and bool(reply.get("more"))
                    for event in reply.get("events", []):
                        view.apply(event, from_dump=kind == "tree_dump")
                    if kind in ("tree_dump", "events") and not reply.get("more"):
                        view.cursor = reply["last_event_id"]
                    if kind == "overrun":
                        view.cursor = reply["last_sent"]
                        break
                    frames += 1
                    if max_frames is not None and frames >= max_frames:
                        return
        except ConnectionClosed:
            pass
        await trio.sleep(0.5)  # reconnect backoff after the agent closed the stream


async def discovered_urls(url: str) -> AsyncIterator[str]:
    async with open_discovery(url) as discovery:
        watch = getattr(discovery, "watch", None)
        seen: set[str] = set()
        for record in await discovery.list(KV_STATE_SOURCES_TOPIC):
            recovery_url = record.metadata.get("recovery_url")
            if isinstance(recovery_url, str) and recovery_url not in seen:
                seen.add(recovery_url)
                yield recovery_url
        if watch is None:
            return
        async with contextlib.aclosing(watch(KV_STATE_SOURCES_TOPIC)) as changes:
            async for change in changes:
                if change.kind == "put" and change.record is not None:
                    recovery_url = change.record.metadata.get("recovery_url")
                    if isinstance(recovery_url, str) and recovery_url not in seen:
                        seen.add(recovery_url)
                        yield recovery_url


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", default=[], help="a slot's websocket URL (repeatable)")
    parser.add_argument("--discovery", help="find slots through discovery instead")
    parser.add_argument("--prompt-blocks", default="", help="comma-separated block hashes of a prompt")
    parser.add_argument("--interval", type=float, default=2.0)
    args = parser.parse_args()
    prompt = [int(x) for x in args.prompt_blocks.split(",") if x]
    views: dict[str, SlotView] = {}

    async with trio.open_nursery() as nursery:

        def add(url: str) -> None:
            if url not in views:
                views[url] = SlotView(url)
                nursery.start_soon(follow_slot, views[url])
                print(f"following {url}", flush=True)

        for url in args.url:
            add(url)
        if args.discovery:

            async def discover() -> None:
                async for url in discovered_urls(args.discovery):
                    add(url)

            nursery.start_soon(discover)
        while True:
            await trio.sleep(args.interval)
            for view in views.values():
                print(
                    f"{view.url}: cursor {view.cursor} blocks {len(view.blocks)} "
                    f"prefix overlap {view.overlap(prompt)}/{len(prompt)}",
                    flush=True,
                )


if __name__ == "__main__":
    trio.run(main)
