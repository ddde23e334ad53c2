"""The Trio/pyzmq adapter against the edge-trigger trap, cancellation and close."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket, open_context


@pytest.fixture
def context() -> Any:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def pair(context: zmq.Context[Any], transport: str = "tcp") -> tuple[TrioSocket, TrioSocket]:
    pull = context.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:0" if transport == "tcp" else f"inproc://pair-{id(pull)}")
    push = context.socket(zmq.PUSH)
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    return TrioSocket(push), TrioSocket(pull)


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_every_prequeued_message_is_received(context: zmq.Context[Any], transport: str) -> None:
    # inproc queues every message in the receiver's pipe before it first looks: a single FD edge for
    # 1000 messages, the case a level-triggered wait loses (pyzmq's documentation of zmq.FD).
    sender, receiver = pair(context, transport)
    with trio.fail_after(10):
        for i in range(1000):
            await sender.send_multipart([b"m", i.to_bytes(4, "big")])
        received: list[int] = []
        while len(received) < 1000:
            batch = await receiver.recv_multipart_batch(256)
            assert 1 <= len(batch) <= 256
            received.extend(int.from_bytes(frames[1], "big") for frames in batch)
    assert received == list(range(1000))
    sender.close()
    receiver.close()


async def test_cancelled_wait_loses_nothing(context: zmq.Context[Any]) -> None:
    sender, receiver = pair(context)
    with trio.move_on_after(0.05):
        await receiver.recv_multipart()
    await sender.send_multipart([b"after-cancel"])
    with trio.fail_after(5):
        assert await receiver.recv_multipart() == [b"after-cancel"]
    sender.close()
    receiver.close()


async def test_a_cancelled_batch_receive_takes_nothing(context: zmq.Context[Any]) -> None:
    sender, receiver = pair(context, "inproc")
    for i in range(300):
        assert sender.try_send_multipart([i.to_bytes(4, "big")])
    received: list[int] = []
    with trio.fail_after(10):
        while len(received) < 300:
            with trio.CancelScope() as scope:
                scope.cancel()
                await receiver.recv_multipart_batch(7)  # cancelled before it takes a message
            assert scope.cancelled_caught
            received.extend(int.from_bytes(f[0], "big") for f in await receiver.recv_multipart_batch(7))
    assert received == list(range(300))
    sender.close()
    receiver.close()


async def test_interleaved_send_and_receive_on_one_owner(context: zmq.Context[Any]) -> None:
    sender, receiver = pair(context)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def produce() -> None:
                for i in range(500):
                    await sender.send_multipart([i.to_bytes(4, "big")])
                    if i % 50 == 0:
                        await trio.lowlevel.checkpoint()

            nursery.start_soon(produce)
            seen = 0
            while seen < 500:
                for frames in await receiver.recv_multipart_batch():
                    assert int.from_bytes(frames[0], "big") == seen
                    seen += 1
    sender.close()
    receiver.close()


async def test_close_wakes_a_waiting_task(context: zmq.Context[Any]) -> None:
    _sender, receiver = pair(context)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            woke = trio.Event()

            async def wait() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await receiver.recv_multipart()
                woke.set()

            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            receiver.close()
            await woke.wait()


def test_nowait_send_reports_backpressure(context: zmq.Context[Any]) -> None:
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1)
    push.bind("tcp://127.0.0.1:0")  # no peer: nothing can be sent
    sock = TrioSocket(push)
    assert sock.try_send_multipart([b"x"]) is False
    sock.close()


async def test_open_context_destroys_without_lingering() -> None:
    with open_context() as ctx:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, -1)  # would block term() forever with the unsent frame below
        push.connect("tcp://127.0.0.1:9")  # nobody listens: the frame can never leave
        push.send(b"stuck")
    assert ctx.closed and push.closed
