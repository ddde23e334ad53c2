"""A clean stop of ``kvagent serve`` closes every websocket client with 1001 "going away"."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import trio
from trio_websocket import ConnectionClosed

from tests.support.agent import XpubEngine, batch, gpu_store
from tests.support.serve import client, follow_until, serve


async def test_sigterm_closes_idle_and_following_clients_with_1001(
    tmp_path: Path, fake_engine: XpubEngine
) -> None:
    with trio.fail_after(60):
        async with serve(
            tmp_path, "--slot", f"s0={fake_engine.endpoint}", "--block-size", "32", "--shutdown-timeout", "5"
        ) as agent:
            await fake_engine.wait_subscribed()
            async with client(agent.url) as idle, client(agent.url) as follower:
                await fake_engine.send_payload(batch([gpu_store([0xFEED])]))
                await follow_until(follower, 0xFEED, None)  # following live from here on
                assert (await idle.request("status"))["ok"] is True
                agent.process.send_signal(signal.SIGTERM)
                for peer in (idle, follower):
                    with pytest.raises(ConnectionClosed) as closed:
                        while True:
                            await peer.ws.get_message()
                    assert closed.value.reason is not None
                    assert (closed.value.reason.code, closed.value.reason.reason) == (1001, "going away")
            returncode = await agent.process.wait()
            assert returncode == 0, "\n".join(agent.stderr_lines)


async def test_a_double_sigint_stops_cleanly_without_a_traceback(
    tmp_path: Path, fake_engine: XpubEngine
) -> None:
    """A double Ctrl-C, or `timeout -s INT` (which signals the process and its group): one clean stop."""
    with trio.fail_after(60):
        async with serve(tmp_path, "--slot", f"s0={fake_engine.endpoint}", "--block-size", "32") as agent:
            await fake_engine.wait_subscribed()
            agent.process.send_signal(signal.SIGINT)
            await agent.log.wait_for(lambda line: "shutdown_signal" in line)  # the first one is being handled
            agent.process.send_signal(signal.SIGINT)
            returncode = await agent.process.wait()
            output = "\n".join(agent.stderr_lines)
            assert returncode == 0, output
            assert "Traceback" not in output
            assert "kvagent: stopped" in output


ERROR_LEVELS = frozenset({"error", "exception", "critical"})


async def test_a_clean_sigterm_logs_no_error_line(tmp_path: Path, fake_engine: XpubEngine) -> None:
    """SIGTERM while engines publish: the slots shut down in order, and batches still queued when a slot's
    shutdown quarantine closed its ingress are expected, not errors (issue #28).

    Two simulated slots, and one whose engine floods it right before the signal so its coordinator has a
    backlog at the stop; every stderr line must be a JSON log line below error level, the exit status 0.
    """
    with trio.fail_after(60):
        slots = ("--slot", "a", "--slot", "b", "--slot", f"flooded={fake_engine.endpoint}")
        async with serve(
            tmp_path, *slots, "--simulate", "--block-size", "32", "--log-format", "json"
        ) as agent:
            await fake_engine.wait_subscribed()

            def publishing(line: str) -> bool:
                # The simulated slots have applied batches (a status line shows blocks resident).
                return '"slot_status"' in line and '"slot": "b"' in line and '"blocks": 0' not in line

            await agent.log.wait_for(publishing)
            # Batches of 256 blocks each take the coordinator a while: it is far behind when the signal comes.
            for n in range(400):
                first = 0x5000_0000 + 256 * n
                await fake_engine.send_payload(batch([gpu_store(list(range(first, first + 256)))]))
            agent.process.send_signal(signal.SIGTERM)
            returncode = await agent.process.wait()
        output = "\n".join(agent.stderr_lines)
        assert returncode == 0, output
        assert '"stopped"' in output
        for line in agent.stderr_lines:
            if not line.strip():
                continue
            entry = json.loads(line)  # a traceback or any other stray text fails here
            assert entry.get("level") not in ERROR_LEVELS, line
