"""Through the real CLI: a slot pointed at an endpoint nobody binds says so on stderr: no engine up there yet."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import trio

from tests.support.serve import client, serve

TIMEOUT = 30


def unbound_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


async def test_a_dead_endpoint_is_a_warning_that_the_engine_is_not_up_yet(tmp_path: Path) -> None:
    endpoint = unbound_endpoint()
    port = endpoint.rpartition(":")[2]
    with trio.fail_after(TIMEOUT):
        async with serve(
            tmp_path, "--slot", f"s0={endpoint}", "--block-size", "32", "--log-format", "json"
        ) as agent:
            line = await agent.log.wait_for(lambda text: "vllm_endpoint_unreachable" in text)
            record = json.loads(line)
            assert (record["level"], record["slot"], record["endpoint"]) == ("warning", "s0", endpoint)
            assert record["reason"] == "engine_not_up" and record["retrying"] is True
            assert f"no engine listens at {endpoint} yet" in record["hint"]
            assert f"tcp://*:{port}" not in record["hint"], "an engine not up yet is not vLLM's bind address"
            async with client(agent.url) as c:
                status = (await c.request("status"))["status"]
            assert status["attachment"]["state"] == "ready"
            assert status["last_event_age_s"] is None, "nothing was ever received"
