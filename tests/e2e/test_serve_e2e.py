"""``kvagent serve`` as a subprocess: a real PUB socket feeds it, a real websocket client checks it.

The client here speaks the documented protocol (docs/protocol.md) with raw trio-websocket frames, so
these tests pin the wire protocol itself, not just the bundled client.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.agent import XpubEngine, batch, gpu_store
from tests.support.serve import client, follow_until, serve, stored_hashes
from tests.support.vectors import live_model, load_live

TIMEOUT = 60


async def test_serve_end_to_end_recover_follow_control_and_sigterm(
    tmp_path: Path, fake_engine: XpubEngine
) -> None:
    sub_messages, _ = load_live()
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", f"s0={fake_engine.endpoint}", "--block-size", "32") as agent:
            await fake_engine.wait_subscribed()
            async with client(agent.url) as c:
                status = (await c.request("status"))["status"]
                assert status["attachment"]["ready"] is True
                assert status["attachment"]["state"] == "ready"
                await agent.log.wait_for(lambda text: text.startswith("[s0] gen 1 ready cursor"))
                assert status["attachment"]["generation"] == 1
                assert status["outbound_cursor"] == status["attachment"]["ready_at_outbound_cursor"] == 1

                for frames in sub_messages:
                    await fake_engine.send_frames(frames)
                await fake_engine.send_payload(batch([gpu_store([0xFEED])]), seq=len(sub_messages))
                await follow_until(c, 0xFEED, None)

            async with client(agent.url) as c:
                dump = await c.request("recover", start=None, end=None)
                assert dump["ok"] and dump["kind"] == "tree_dump"
                assert stored_hashes(dump["events"]) == live_model(sub_messages) | {0xFEED}
                newest = dump["last_event_id"]
                assert dump["receipt"]["recovered_through_cursor"] == newest

                tail = await c.request("recover", start=newest - 3, end=None)
                assert tail["kind"] == "events"
                assert [e["event"]["event_id"] for e in tail["events"]] == list(range(newest - 3, newest + 1))

                too_new = await c.request("recover", start=newest + 10, end=None)
                assert too_new["kind"] == "too_new"
                assert too_new["newest_available"] == newest

                # Follow across a burst: gap-free and duplicate-free across the backlog/live hand-off.
                request_from = newest - 2
                async with trio.open_nursery() as nursery:
                    collected: list[list[dict[str, Any]]] = []

                    async def collect() -> None:
                        collected.append(await follow_until(c, 0xBEEF, request_from))

                    nursery.start_soon(collect)
                    seq = len(sub_messages) + 1
                    for i in range(300):
                        await fake_engine.send_payload(batch([gpu_store([1_000_000 + i])]), seq=seq + i)
                    await fake_engine.send_payload(batch([gpu_store([0xBEEF])]), seq=seq + 300)
                ids = [e["event"]["event_id"] for e in collected[0]]
                assert ids == list(range(request_from + 1, request_from + 1 + len(ids)))
                assert len(ids) >= 302

            async with client(agent.url) as c:
                denied = await c.request("detach", generation=1)
                assert denied["ok"] is False and denied["error"]["code"] == "unauthorized"
                wrong = await c.request("detach", generation=1, token="not-the-token")
                assert wrong["error"]["code"] == "unauthorized"
                assert agent.token not in "\n".join(agent.stderr_lines)

            assert len(agent.discovery_files()) == 2  # source + attachment advertisements
            agent.process.send_signal(signal.SIGTERM)
            with trio.fail_after(20):
                returncode = await agent.process.wait()
            assert returncode == 0, "\n".join(agent.stderr_lines)
            assert agent.discovery_files() == []


async def test_json_log_lines_of_a_slot_carry_its_name_and_generation(
    tmp_path: Path, fake_engine: XpubEngine
) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(
            tmp_path, "--slot", f"s0={fake_engine.endpoint}", "--block-size", "32", "--log-format", "json"
        ) as agent:
            await fake_engine.wait_subscribed()
            await fake_engine.send_payload(b"\xc1 is never valid msgpack")
            line = await agent.log.wait_for(lambda text: "listener_failed" in text)
            record = json.loads(line)
            assert (record["slot"], record["generation"], record["level"]) == ("s0", 1, "warning")
            # The coordinator's own lines (another task) carry the slot as well.
            quarantined = json.loads(await agent.log.wait_for(lambda text: "ingress_quarantined" in text))
            assert quarantined["slot"] == "s0"


async def test_simulated_demo_serves_a_ready_advancing_slot(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "demo", "--simulate") as agent, client(agent.url, "demo") as c:
            first = (await c.request("status"))["status"]
            assert first["attachment"]["ready"] is True
            request_id = await c.send("follow", **{"from": first["outbound_cursor"]})
            while True:
                frame = await c.frame()
                assert frame["id"] == request_id and frame["ok"]
                if frame.get("kind") == "live" and frame["events"]:
                    break
            async with client(agent.url, "demo") as other:  # a fresh connection: no follow frames interleave
                later = (await other.request("status"))["status"]
            assert later["outbound_cursor"] > first["outbound_cursor"]
            agent.process.send_signal(signal.SIGINT)
            with trio.fail_after(20):
                assert await agent.process.wait() == 0


@pytest.mark.parametrize("argv", [["--slot", "x", "--block-size", "0"], ["--slot", "bad/name"]])
async def test_bad_configuration_is_a_clear_error(tmp_path: Path, argv: list[str]) -> None:
    result = await trio.run_process(
        [sys.executable, "-m", "kvagent.cli.main", "serve", *argv], capture_stderr=True, check=False
    )
    assert result.returncode == 2
    assert result.stderr.startswith(b"kvagent: error: ") and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("moment", ["attach", "dump", "follow"])
async def test_sigterm_mid_operation_exits_zero_and_withdraws_ads(
    tmp_path: Path, moment: str, fake_engine: XpubEngine
) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "waiting", "--block-size", "32") as agent:
            async with client(agent.url, "waiting") as c:
                attached = await c.request(
                    "attach",
                    worker_id=5,
                    dp_rank=0,
                    endpoint=fake_engine.endpoint,
                    topic="",
                    token=agent.token,
                )
                assert attached["ok"], attached
                await fake_engine.wait_subscribed()
                for i in range(200):
                    await fake_engine.send_payload(batch([gpu_store([5000 + i, 9000 + i])]))
                await fake_engine.send_payload(batch([gpu_store([0xFEED])]))
                await follow_until(c, 0xFEED, None)
            # This client reads none of its answers; the server answers every request it took before it
            # closes with 1001, and trio-websocket's reader must have room for them to see that close.
            async with client(agent.url, "waiting", message_queue_size=8) as c:
                if moment == "attach":
                    await c.send("detach", generation=1, token=agent.token)
                    await c.send(
                        "attach", worker_id=6, dp_rank=0, endpoint=fake_engine.endpoint, token=agent.token
                    )
                elif moment == "dump":
                    await c.send("recover", start=None, end=None)
                else:
                    await c.send("follow", **{"from": None})
                    await c.frame()
                agent.process.send_signal(signal.SIGTERM)
                with trio.fail_after(20):
                    returncode = await agent.process.wait()
            assert returncode == 0, "\n".join(agent.stderr_lines)
            assert agent.discovery_files() == []
