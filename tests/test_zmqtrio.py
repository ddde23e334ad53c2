"""The Trio/pyzmq adapter against the edge-trigger trap, cancellation and close."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import zmq

from kvagent.zmqtrio import TrioSocket


@pytest.fixture
def context() -> Any:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def pair(context: zmq.Context[Any]) -> tuple[TrioSocket, TrioSocket]:
    pull = context.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:0")
    push = context.socket(zmq.PUSH)
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    return TrioSocket(push), TrioSocket(pull)


async def test_every_prequeued_message_is_received(context: zmq.Context[Any]) -> None:
    sender, receiver = pair(context)
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
    assert sock.send_multipart_nowait([b"x"]) is False
    sock.close()
