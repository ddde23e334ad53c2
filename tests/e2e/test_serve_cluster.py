"""Two ``kvagent serve`` processes share one etcd; both appear in ``watch``. And ``/metrics`` moves."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import httpx
import trio

from kvagent.discovery import open_discovery
from kvagent.model.events import KV_STATE_SOURCES_TOPIC
from tests.support.agent import XpubEngine, batch, gpu_store
from tests.support.etcd_server import EtcdEndpoint
from tests.support.serve import client, follow_until, serve


async def test_two_serve_processes_share_one_etcd_and_both_appear_in_watch(
    tmp_path: Path, etcd_endpoint: EtcdEndpoint
) -> None:
    url = etcd_endpoint.discovery_url
    with trio.fail_after(60):
        async with open_discovery(url) as discovery:
            seen: set[str] = set()
            both = trio.Event()

            async def watch() -> None:
                async with contextlib.aclosing(discovery.watch(KV_STATE_SOURCES_TOPIC)) as changes:  # type: ignore[attr-defined]
                    async for change in changes:
                        if change.kind == "put" and change.record is not None:
                            recovery_url = str(change.record.metadata.get("recovery_url", ""))
                            seen.add(recovery_url.rsplit("/", 1)[-1])
                            if {"left", "right"} <= seen:
                                both.set()
                                return

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await trio.testing.wait_all_tasks_blocked()
                (tmp_path / "l").mkdir()
                (tmp_path / "r").mkdir()
                async with (
                    serve(tmp_path / "l", "--slot", "left", "--discovery", url),
                    serve(tmp_path / "r", "--slot", "right", "--discovery", url),
                ):
                    await both.wait()
                    records = await discovery.list(KV_STATE_SOURCES_TOPIC)
                    assert {str(r.metadata["recovery_url"]).rsplit("/", 1)[-1] for r in records} >= {
                        "left",
                        "right",
                    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_metrics_endpoint_counters_move(tmp_path: Path, fake_engine: XpubEngine) -> None:
    port = free_port()
    with trio.fail_after(60):
        async with serve(
            tmp_path,
            "--slot",
            f"s0={fake_engine.endpoint}",
            "--block-size",
            "32",
            "--metrics",
            f"127.0.0.1:{port}",
        ) as agent:
            await fake_engine.wait_subscribed()

            async def scrape() -> dict[str, float]:
                async with httpx.AsyncClient() as http:
                    response = await http.get(f"http://127.0.0.1:{port}/metrics")
                assert response.status_code == 200
                values: dict[str, float] = {}
                for line in response.text.splitlines():
                    if line.startswith("kvagent_") and 'slot="s0"' in line:
                        name = line.split("{", 1)[0]
                        values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
                return values

            before = await scrape()
            for i in range(50):
                await fake_engine.send_payload(batch([gpu_store([100 + i])]))
            async with client(agent.url) as c:
                await fake_engine.send_payload(batch([gpu_store([0xFEED])]))
                await follow_until(c, 0xFEED, 1)
            after = await scrape()
            assert after["kvagent_outbound_cursor"] >= before["kvagent_outbound_cursor"] + 51
            assert after["kvagent_events_in_total"] > before.get("kvagent_events_in_total", 0)
            assert after["kvagent_resident_blocks"] == 51
            assert after["kvagent_attachment_ready"] == 1
            assert after["kvagent_attachment_state"] == 1  # one-hot: the five states sum to 1
            async with httpx.AsyncClient() as http:
                ready = await http.get(f"http://127.0.0.1:{port}/readyz")
                health = await http.get(f"http://127.0.0.1:{port}/healthz")
            slot_ready = {"ready": True, "state": "ready", "reason": None}
            assert (ready.status_code, ready.json()) == (200, {"ready": True, "slots": {"s0": slot_ready}})
            assert health.status_code == 200
