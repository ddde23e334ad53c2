"""Issue #37: the start-up hint says an engine that is not up yet is not up yet, and keeps vLLM's
bind-address hint for when the engine's replay ROUTER answers while its live port refuses (real sockets on
127.0.0.1)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from kvagent.vllm.connect_hint import (
    Reach,
    diagnose_unreachable,
    probe,
    tcp_address,
    unreachable_endpoint_hint,
)
from tests.support.ports import free_port, port_in_use

GUARD = 10


@pytest.fixture
def listening() -> Iterator[str]:
    with port_in_use() as address:
        yield f"tcp://{address}"


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_only_plain_tcp_endpoints_are_probed() -> None:
    assert tcp_address("tcp://127.0.0.1:5557") == ("127.0.0.1", 5557)
    assert tcp_address("tcp://[::1]:5557") == ("::1", 5557)
    assert tcp_address("tcp://10.0.0.1;10.0.0.2:5557") is None  # a source address: not ours to read
    assert tcp_address("ipc:///tmp/kv.sock") is None


async def test_a_listening_port_is_accepted_and_a_free_one_refused(listening: str) -> None:
    with trio.fail_after(GUARD):
        assert await probe(listening) is Reach.ACCEPTED
        assert await probe(free_endpoint()) is Reach.REFUSED
        assert await probe("ipc:///tmp/nothing.sock") is Reach.NOT_TCP


async def test_an_engine_not_up_yet_is_said_so_without_blaming_the_bind_address() -> None:
    with trio.fail_after(GUARD):
        reason, hint = await diagnose_unreachable(free_endpoint(), free_endpoint())
    assert reason == "engine_not_up"
    assert "tcp://*" not in hint and "keeps retrying" in hint


async def test_a_replay_port_that_answers_while_the_live_one_refuses_points_at_the_bind_address(
    listening: str,
) -> None:
    live = free_endpoint()
    with trio.fail_after(GUARD):
        reason, hint = await diagnose_unreachable(live, listening)
    assert reason == "engine_not_bound"
    assert f"start vLLM with endpoint tcp://*:{live.rpartition(':')[2]}" in hint


async def test_something_listening_without_a_handshake_is_a_wrong_port(listening: str) -> None:
    with trio.fail_after(GUARD):
        reason, hint = await diagnose_unreachable(listening, None)
    assert reason == "no_handshake" and listening in hint


@pytest.mark.parametrize("reach", [Reach.UNREACHABLE, Reach.TIMEOUT, Reach.UNRESOLVED])
def test_a_host_that_does_not_answer_is_not_blamed_on_vllm(reach: Reach) -> None:
    reason, hint = unreachable_endpoint_hint("tcp://engine-0:5557", reach)
    assert reason in ("host_unreachable", "host_unresolved") and "tcp://*" not in hint
