"""Advertised addresses through a real ``kvagent serve``: the discovery records and the printed lines carry a
reachable host (``--advertise``, or the machine's name for a wildcard listen), IPv6 in brackets, and slot names
percent-encoded — and the advertised URL, used as is, reaches its slot."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import trio
from trio_websocket import open_websocket_url

from kvagent.agent.advertising import url_host
from kvagent.cli.config import SIMULATED_MODEL
from kvagent.model.ids import derive_cache_owner_id
from tests.support.serve import Client, ServeProcess, serve


def _ads(agent: ServeProcess) -> list[dict[str, Any]]:
    records = []
    for path in agent.discovery_files():
        try:
            records.append(json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):  # being replaced right now; read it next time
            continue
    return records


async def _recovery_urls(agent: ServeProcess, count: int) -> set[str]:
    """The recovery URLs of the attachment ads once ``count`` slots advertise (polling the real files)."""
    with trio.fail_after(30):
        while True:
            urls = {
                str(ad["metadata"]["recovery_url"]) for ad in _ads(agent) if "recovery_url" in ad["metadata"]
            }
            if len(urls) >= count:
                return urls
            await trio.sleep(0.05)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_ipv6_listen_and_odd_slot_names_are_advertised_reachable(tmp_path: Path) -> None:
    names = ["gpu 0", "ü"]
    argv = ["--listen", "[::1]:0", "--simulate", "--state-dir", "none"]
    async with serve(tmp_path, *argv, *(arg for name in names for arg in ("--slot", name))) as agent:
        assert agent.url.startswith("ws://[::1]:")
        assert any(f"serving 2 slot(s) on {agent.url}/v1/slots" in line for line in agent.stderr_lines)
        urls = await _recovery_urls(agent, 2)
        assert urls == {f"{agent.url}/v1/slots/gpu%200", f"{agent.url}/v1/slots/%C3%BC"}
        for url in sorted(urls):
            name = unquote(url.rsplit("/", 1)[1])
            async with open_websocket_url(url) as ws:  # the advertised URL, as is, reaches its slot
                status = await Client(ws).request("status")
            owner = derive_cache_owner_id(name, kv_block_size=16, model=SIMULATED_MODEL)
            assert status["status"]["identity"]["cache_owner_id"] == str(owner), status


async def test_a_wildcard_listen_advertises_the_advertise_host_everywhere(tmp_path: Path) -> None:
    argv = ["--listen", "0.0.0.0:0", "--advertise", "node-3.example", "--http", "0.0.0.0:0"]
    async with serve(tmp_path, *argv, "--slot", "s0", "--simulate", "--state-dir", "none") as agent:
        assert agent.url.startswith("ws://node-3.example:")
        port = agent.url.rsplit(":", 1)[1]
        (url,) = await _recovery_urls(agent, 1)
        assert url == f"ws://node-3.example:{port}/v1/slots/s0"
        assert any(
            line.startswith("kvagent: HTTP surface on http://node-3.example:") for line in agent.stderr_lines
        )
        printed = [line for line in agent.stderr_lines if line.startswith("kvagent:")]
        assert printed and not any("0.0.0.0" in line for line in printed)
        async with open_websocket_url(
            f"ws://127.0.0.1:{port}/v1/slots/s0"
        ) as ws:  # it does listen everywhere
            assert (await Client(ws).request("status"))["ok"]


async def test_a_wildcard_listen_without_advertise_uses_the_machine_name(tmp_path: Path) -> None:
    async with serve(
        tmp_path, "--listen", "0.0.0.0:0", "--slot", "s0", "--simulate", "--state-dir", "none"
    ) as agent:
        expected = url_host(socket.getfqdn())
        assert agent.url.startswith(f"ws://{expected}:")
        (url,) = await _recovery_urls(agent, 1)
        assert url.startswith(f"ws://{expected}:")
        assert sum("advertising_machine_hostname" in line for line in agent.stderr_lines) == 1


async def test_a_publish_port_0_is_advertised_as_the_port_it_bound(tmp_path: Path) -> None:
    argv = ["--publish", "tcp://127.0.0.1:0", "--slot", "s0", "--simulate", "--state-dir", "none"]
    async with serve(tmp_path, *argv) as agent:
        with trio.fail_after(30):
            while True:  # the source and the attachment record (polling the real files)
                ads = _ads(agent)
                if len(ads) >= 2:
                    break
                await trio.sleep(0.05)
        (scope,) = {ad["scope"] for ad in ads}
        host, port = scope.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) != 0, scope
        with socket.create_connection((host, int(port)), timeout=5):  # the event plane listens there
            pass
