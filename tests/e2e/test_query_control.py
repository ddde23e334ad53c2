"""``kvagent query SLOT attach|detach|quarantine`` through the real CLI against a running ``kvagent serve``.

Slot names that are not URL-safe (a space, non-ASCII) are reachable: the client percent-encodes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from tests.support.agent import XpubEngine, batch, gpu_store
from tests.support.serve import ServeProcess, client, follow_until, serve

TIMEOUT = 120  # a bound, not a wait: the machine is shared and can be slow


async def kvagent_query(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """``kvagent query ARGS`` as its own process (exit status, stdout and stderr as a user sees them)."""
    command = [sys.executable, "-m", "kvagent.cli.main", "query", *args]
    return await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False, env=env)


def answer(result: subprocess.CompletedProcess[bytes]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr.decode()
    assert result.stderr == b""
    lines = result.stdout.decode().splitlines()
    assert len(lines) == 1, lines
    value = json.loads(lines[0])
    assert isinstance(value, dict)
    return value


def one_error_line(result: subprocess.CompletedProcess[bytes], status: int) -> str:
    err = result.stderr.decode().strip()
    assert result.returncode == status, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("kvagent: error: ")
    assert result.stdout == b""
    return err


def token_args(agent: ServeProcess) -> tuple[str, ...]:
    return ("--url", agent.url, "--token-file", str(agent.tmp / "token"))


async def test_detach_attach_and_quarantine_a_slot_named_with_a_space(
    tmp_path: Path, fake_engine: XpubEngine
) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "gpu 0", "--simulate", "--block-size", "32") as agent:
            status = answer(await kvagent_query("--url", agent.url, "gpu 0", "status"))["status"]
            assert status["attachment"]["generation"] == 1

            detached = answer(await kvagent_query(*token_args(agent), "gpu 0", "detach", "--generation", "1"))
            assert isinstance(detached["cursor"], int)
            status = answer(await kvagent_query("--url", agent.url, "gpu 0", "status"))["status"]
            assert status["attachment"] is None

            attached = answer(
                await kvagent_query(
                    *token_args(agent),
                    "gpu 0",
                    "attach",
                    "--endpoint",
                    fake_engine.endpoint,
                    "--worker-id",
                    "7",
                )
            )["attachment"]
            assert attached["generation"] == 2
            assert attached["worker"] == {"worker_id": 7, "dp_rank": 0}

            # The newly attached engine's events reach the slot (a real attachment, not just an answer).
            await fake_engine.wait_subscribed()
            await fake_engine.send_payload(batch([gpu_store([0xFEED])]))
            async with client(agent.url, "gpu%200") as c:
                await follow_until(c, 0xFEED, None)

            quarantined = answer(
                await kvagent_query(
                    *token_args(agent), "gpu 0", "quarantine", "--generation", "2", "--reason", "bad engine"
                )
            )
            assert quarantined == {"ok": True}
            status = answer(await kvagent_query("--url", agent.url, "gpu 0", "status"))["status"]
            assert status["attachment"] is None or status["attachment"]["state"] != "ready"


async def test_a_non_ascii_slot_is_reachable_and_listed_by_name(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "ü?#%1", "--simulate") as agent:
            status = answer(await kvagent_query("--url", agent.url, "ü?#%1", "status"))["status"]
            assert status["attachment"]["generation"] == 1
            slots = answer(await kvagent_query("--url", agent.url, "-", "list"))["slots"]
            assert [slot["name"] for slot in slots] == ["ü?#%1"]


async def test_control_mistakes_are_one_line(tmp_path: Path) -> None:
    wrong_token = tmp_path / "wrong-token"
    wrong_token.write_text("not-the-token\n")
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "s0", "--simulate") as agent:
            url = ("--url", agent.url)
            err = one_error_line(
                await kvagent_query(*token_args(agent), "s0", "quarantine", "--generation", "9"), 1
            )
            assert "generation_mismatch" in err and "9" in err
            err = one_error_line(await kvagent_query(*token_args(agent), "s0", "attach"), 2)
            assert "--endpoint is required" in err
            err = one_error_line(
                await kvagent_query(
                    *url, "--token-file", str(wrong_token), "s0", "detach", "--generation", "1"
                ),
                1,
            )
            assert "unauthorized" in err and "--token-file" in err
            # No --token-file and no token in the default place: told where it would be, nothing is sent.
            env = {**os.environ, "KVAGENT_STATE_DIR": str(tmp_path / "empty-root")}
            err = one_error_line(await kvagent_query(*url, "s0", "detach", "--generation", "1", env=env), 2)
            assert "--token-file" in err and str(tmp_path / "empty-root" / "token") in err
            # ... and with the token in the default place, it is used.
            (tmp_path / "root").mkdir()
            (tmp_path / "root" / "token").write_text(agent.token + "\n")
            env = {**os.environ, "KVAGENT_STATE_DIR": str(tmp_path / "root")}
            assert (
                answer(await kvagent_query(*url, "s0", "detach", "--generation", "1", env=env))["cursor"] >= 0
            )
