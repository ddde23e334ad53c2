"""The etcd options of ``kvagent serve`` reach the backend: a real ``kvagent serve`` against a private etcd with
authentication on registers its records on a lease of the TTL asked for, with the password from a file."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.support.etcd_server import PrivateEtcd
from tests.support.serve import serve

PASSWORD = "s3cret"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def _enable_auth(client: httpx.AsyncClient) -> None:
    """Turn on etcd authentication with a root user (the gateway's own API, as etcdctl would)."""
    for path, body in (
        ("/v3/auth/user/add", {"name": "root", "password": PASSWORD}),
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/enable", {}),
    ):
        (await client.post(path, json=body)).raise_for_status()


async def _records(client: httpx.AsyncClient, prefix: str) -> list[dict[str, Any]]:
    token = (await client.post("/v3/auth/authenticate", json={"name": "root", "password": PASSWORD})).json()
    headers = {"Authorization": token["token"]}
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    response = await client.post(
        "/v3/kv/range", json={"key": _b64(prefix), "range_end": _b64(end)}, headers=headers
    )
    kvs: list[dict[str, Any]] = response.json().get("kvs", [])
    for kv in kvs:
        ttl = await client.post("/v3/lease/timetolive", json={"ID": kv["lease"]}, headers=headers)
        kv["grantedTTL"] = int(ttl.json()["grantedTTL"])
    return kvs


async def test_ttl_user_and_password_file_reach_etcd(private_etcd: PrivateEtcd, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=private_etcd.client_url, timeout=3) as client:
        await _enable_auth(client)
        password_file = tmp_path / "etcd-password"
        password_file.write_text(PASSWORD + "\n")
        url = private_etcd.endpoint("/kvopts").discovery_url
        argv = ["--discovery", url, "--etcd-ttl", "7", "--etcd-user", "root"]
        argv += [
            "--etcd-password-file",
            str(password_file),
            "--slot",
            "s0",
            "--simulate",
            "--state-dir",
            "none",
        ]
        async with serve(tmp_path, *argv):
            with trio.fail_after(30):
                # The agent advertises asynchronously once the slot is ready: poll etcd, the real observable.
                while True:
                    records = await _records(client, "/kvopts/")
                    if records:
                        break
                    await trio.sleep(0.05)
            assert {kv["grantedTTL"] for kv in records} == {7}


async def test_a_wrong_password_file_does_not_serve(private_etcd: PrivateEtcd, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=private_etcd.client_url, timeout=3) as client:
        await _enable_auth(client)
    password_file = tmp_path / "etcd-password"
    password_file.write_text("wrong\n")
    command = [
        sys.executable, "-m", "kvagent.cli.main", "serve", "--listen", "127.0.0.1:0", "--state-dir", "none",
        "--token-file", str(tmp_path / "token"), "--slot", "s0", "--simulate",
        "--discovery", private_etcd.endpoint().discovery_url,
        "--etcd-user", "root", "--etcd-password-file", str(password_file),
    ]  # fmt: skip
    with trio.fail_after(60):
        result = await trio.run_process(command, capture_stderr=True, check=False, stdin=subprocess.DEVNULL)
    assert result.returncode != 0
    assert b"authentication failed" in result.stderr
    assert b"serving" not in result.stderr
