"""Load on the websocket endpoint of a real ``kvagent serve``: 1,000 connections against a limit of 256."""

from __future__ import annotations

import json
from pathlib import Path

import trio
from trio_websocket import ConnectionRejected, HandshakeError, open_websocket_url

from tests.support.agent import XpubEngine, batch, gpu_store
from tests.support.serve import client, follow_until, serve

ATTEMPTS = 1000
LIMIT = 256


async def test_thousand_connections_against_a_limit_of_256_while_ingesting(
    tmp_path: Path, fake_engine: XpubEngine
) -> None:
    with trio.fail_after(120):
        slot = f"s0={fake_engine.endpoint}"
        async with serve(tmp_path, "--slot", slot, "--block-size", "32", "--max-connections", str(LIMIT)) as agent:
            await fake_engine.wait_subscribed()
            admitted = 0
            rejected = 0
            served = 0
            release = trio.Event()
            settled = trio.Event()
            all_served = trio.Event()

            def tried() -> None:
                if admitted + rejected == ATTEMPTS:
                    settled.set()

            async def attempt() -> None:
                nonlocal admitted, rejected, served
                try:
                    async with open_websocket_url(f"{agent.url}/v1/slots/s0") as ws:
                        admitted += 1
                        tried()
                        await ws.send_message(json.dumps({"id": 1, "op": "status"}))
                        reply = json.loads(await ws.get_message())
                        if reply["ok"] and reply["status"]["attachment"]["ready"]:
                            served += 1
                            if served == LIMIT:
                                all_served.set()
                        await release.wait()
                except ConnectionRejected as exc:
                    assert exc.status_code == 503
                    rejected += 1
                    tried()
                except HandshakeError:
                    rejected += 1  # the listen backlog refused it outright: still an excess connection
                    tried()

            async with trio.open_nursery() as clients:
                for _ in range(ATTEMPTS):
                    clients.start_soon(attempt)
                # Ingest keeps flowing while the endpoint is saturated.
                for i in range(2000):
                    await fake_engine.send_payload(batch([gpu_store([10_000 + i])]))
                await settled.wait()
                assert admitted == LIMIT
                assert rejected == ATTEMPTS - LIMIT
                await all_served.wait()  # every admitted client got its answer
                release.set()
            # Capacity is released; the 2,000 batches were all applied while saturated.
            async with client(agent.url) as c:
                await fake_engine.send_payload(batch([gpu_store([0xFEED])]))
                events = await follow_until(c, 0xFEED, 1)
                stored = sum(1 for e in events if "stored" in e["event"]["data"])
                assert stored == 2001
