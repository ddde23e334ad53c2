"""The sans-IO sequence gate, and the replay client against real ROUTERs (both reply layouts)."""

from __future__ import annotations

import pytest
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.vllm.fake_engine import FakeVllmEngine, block_stored
from kvagent.vllm.listener import ReplayAttempt, ReplayClient
from kvagent.vllm.sequence import SeqDecision, SequenceGate
from tests.support.fakes import ReplayRouter
from tests.support.vectors import load_live

LIVE, REPLAY = load_live()
A, G, D, R = SeqDecision.APPLY, SeqDecision.GAP, SeqDecision.DUPLICATE, SeqDecision.RESTART


def run_live(gate: SequenceGate, seqs: list[int]) -> list[SeqDecision]:
    decisions = []
    for seq in seqs:
        decision = gate.classify(seq)
        decisions.append(decision)
        if decision is not SeqDecision.DUPLICATE:
            gate.mark_applied(seq)
    return decisions


# -- SequenceGate -----------------------------------------------------------------------------------------


def test_the_first_seq_is_accepted_whatever_it_is() -> None:
    gate = SequenceGate()
    assert gate.expected() is None
    assert run_live(gate, [7, 8, 9]) == [A, A, A]
    assert gate.expected() == 10


def test_a_jump_forward_is_a_gap() -> None:
    gate = SequenceGate()
    assert run_live(gate, [0, 1, 4]) == [A, A, G]


def test_the_same_seq_twice_is_a_duplicate_and_a_lower_one_a_restart() -> None:
    gate = SequenceGate()
    assert run_live(gate, [0, 1, 2, 2, 0, 1]) == [A, A, A, D, R, A]
    assert gate.applied == 1 and gate.live == 1


def test_live_copies_of_a_replayed_range_are_duplicates_not_a_restart() -> None:
    gate = SequenceGate()
    assert run_live(gate, [0, 1]) == [A, A]
    assert gate.classify(5) is G
    for seq in range(2, 8):  # the replay applied 2..7
        assert gate.classify_replayed(seq) is A
        gate.mark_applied(seq)
    assert gate.classify_replayed(5) is D, "the live batch that exposed the gap came back in the replay"
    assert [gate.classify(seq) for seq in (6, 7)] == [D, D]
    assert gate.classify(8) is A
    gate.mark_applied(8)
    assert gate.classify(3) is R, "a live seq below the newest live one is still a restart"


def test_expect_sets_the_next_seq() -> None:
    gate = SequenceGate()
    gate.expect(0)
    assert gate.classify_replayed(0) is A
    assert gate.classify_replayed(3) is G
    gate.expect(3)
    assert gate.classify_replayed(3) is A
    assert gate.classify_replayed(2) is D


# -- ReplayClient -----------------------------------------------------------------------------------------


async def test_fetch_from_the_captured_replay() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            router = ReplayRouter(REPLAY)
            await nursery.start(router.run)
            client = ReplayClient(zmq.Context.instance(), router.endpoint, max_payload_bytes=1 << 23)
            try:
                attempt = ReplayAttempt(60)
                await client.fetch(attempt)
            finally:
                client.close()
            assert attempt.complete and attempt.error is None
            assert [m.seq for m in attempt.messages] == list(range(60, 68))
            assert all(m.topic == LIVE[0][0] for m in attempt.messages)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("layout", ["v0.26", "v0.25", "sglang"])
async def test_fetch_from_the_fake_engine_in_both_layouts(layout: str) -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", replay_layout=layout)  # type: ignore[arg-type]
            await nursery.start(engine.run)
            for n in range(4):
                await engine.publish_batch([block_stored([n + 1], None, [n] * 16, 16)])
            assert engine.replay_endpoint is not None
            client = ReplayClient(zmq.Context.instance(), engine.replay_endpoint, max_payload_bytes=1 << 23)
            try:
                attempt = ReplayAttempt(1)
                await client.fetch(attempt)
            finally:
                client.close()
            assert attempt.complete
            assert [m.seq for m in attempt.messages] == [1, 2, 3]
            assert [m.batch.events[0].block_hashes for m in attempt.messages] == [(2,), (3,), (4,)]  # type: ignore[union-attr]
            assert {m.topic for m in attempt.messages} == ({b"kv-events"} if layout == "v0.26" else {b""})
            nursery.cancel_scope.cancel()


async def test_a_silent_server_times_out_and_the_dealer_is_replaced() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            router = ReplayRouter(REPLAY, silent=True)
            await nursery.start(router.run)
            client = ReplayClient(
                zmq.Context.instance(), router.endpoint, inactivity_timeout=0.2, max_payload_bytes=1 << 23
            )
            first_socket = client.socket
            try:
                attempt = ReplayAttempt(0)
                await client.fetch(attempt)
            finally:
                client.close()
            assert not attempt.complete and attempt.messages == []
            assert attempt.error == "replay inactivity timeout"
            assert client.socket is not first_socket, "stale replies must not reach the next attempt"
            nursery.cancel_scope.cancel()


async def test_a_malformed_request_gets_no_answer_from_the_fake_engine() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0")
            await nursery.start(engine.run)
            await engine.publish_batch([block_stored([1], None, [0] * 16, 16)])
            assert engine.replay_endpoint is not None
            dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(engine.replay_endpoint)
            with TrioSocket(dealer) as sock:
                # No empty delimiter: 2 frames at the ROUTER, which vLLM never answers.
                await sock.send_multipart([(0).to_bytes(8, "big")])
                await sock.send_multipart([b"", (0).to_bytes(8, "big")])
                first = await sock.recv_multipart()
            assert first[2] == (0).to_bytes(8, "big"), "only the well-formed request was answered"
            assert engine.replay_requests == 1
            nursery.cancel_scope.cancel()
