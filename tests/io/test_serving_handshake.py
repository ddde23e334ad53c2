"""Before the upgrade: the handshake deadline, the pre-handshake limit, and ``accept`` out of descriptors.

Plus the fair answer turns (kvagent.recovery.turns), which decide when a request is refused as overloaded.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from functools import partial

import msgpack
import pytest
import structlog
import trio
import trio.testing

from kvagent._util.listen import BACKOFF_MAX, EPISODE_QUIET, accept_loop, default_pending_limit
from kvagent.model.errors import KvAgentError
from kvagent.recovery.client import connect_slot
from kvagent.recovery.server import ServerStats, ServingOptions
from kvagent.recovery.turns import AnswerTurns
from tests.support.rawws import OP_BINARY, OP_TEXT, RawPeer, masked_frame, parse_frames
from tests.support.recovery import FakeSlot, start_server


async def until(condition: Callable[[], bool]) -> None:
    # The counters belong to the server, which has no change notification: poll them (bounded by the
    # caller's fail_after).
    while True:
        if condition():
            return
        await trio.sleep(0.01)


async def open_silent(url: str) -> trio.SocketStream:
    """A TCP connection that never sends its upgrade request."""
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def closed_by_server(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some(4096) == b""
    except trio.BrokenResourceError:
        return True


async def test_a_silent_connection_is_closed_at_the_handshake_deadline(nursery: trio.Nursery) -> None:
    stats = ServerStats()
    url = await start_server(nursery, FakeSlot(), options=ServingOptions(handshake_timeout=0.3), stats=stats)
    with trio.fail_after(10):
        silent = await open_silent(url)
        assert await closed_by_server(silent)
        # A slow-loris request that trickles bytes is held to the same deadline.
        trickling = await open_silent(url)
        for byte in b"GET /v1/slots/a HTTP/1.1\r\nHost: x\r\n":
            try:
                await trickling.send_all(bytes([byte]))
            except trio.BrokenResourceError:
                break
            await trio.sleep(0.05)  # pacing: slower than the deadline allows
        assert await closed_by_server(trickling)
    assert stats.handshake_timeouts == 2
    assert stats.connections_total == 0


async def test_half_open_connections_beyond_the_limit_make_room_for_live_clients(nursery: trio.Nursery) -> None:
    slot = FakeSlot()
    stats = ServerStats()
    options = ServingOptions(max_pending_handshakes=4, handshake_timeout=60)
    url = await start_server(nursery, slot, options=options, stats=stats)
    with trio.fail_after(10):
        silent = [await open_silent(url) for _ in range(10)]
        await until(lambda: stats.handshakes_dropped == 6 and stats.handshakes_pending == 4)
        for stream in silent[:6]:  # the oldest went first
            assert await closed_by_server(stream)
        async with connect_slot(url, "a") as client:  # served at once, long before the 60 s deadline
            assert await client.status() == slot.status()
    assert stats.handshakes_dropped == 7  # one more made room for the client
    for stream in silent:
        await stream.aclose()


def test_the_default_pending_limit_leaves_most_descriptors_to_everything_else() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert default_pending_limit() <= max(8, soft // 4)
    assert default_pending_limit(7) == 7


async def test_accept_out_of_descriptors_logs_once_per_episode_and_recovers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    failures = {"left": 500}
    offered_send, offered = trio.open_memory_channel[int](10)
    accepted: list[int] = []
    shed_calls: list[int] = []
    four_accepted = trio.Event()

    async def accept() -> int:
        await trio.lowlevel.checkpoint()
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return await offered.receive()

    async def handle(connection: int) -> None:
        accepted.append(connection)
        if len(accepted) == 4:
            four_accepted.set()

    def shed() -> int:
        shed_calls.append(1)
        return 1 if len(shed_calls) <= 3 else 0  # three half-open connections to free, then none

    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(accept_loop, accept, handle, nursery, name="test", shed=shed))
            for number in range(2):
                offered_send.send_nowait(number)
            await until(lambda: len(accepted) == 2)
            await trio.sleep(EPISODE_QUIET)  # quiet: the next accept ends the first episode...
            failures["left"] = 10  # ...and the one after it starts a second
            offered_send.send_nowait(2)
            await until(lambda: len(accepted) == 3 and failures["left"] == 0)
            await trio.sleep(EPISODE_QUIET)
            offered_send.send_nowait(3)
            with trio.fail_after(60):
                await four_accepted.wait()
            nursery.cancel_scope.cancel()
    events = [entry["event"] for entry in logs]
    assert events == ["accept_out_of_descriptors", "accept_recovered"] * 2  # one line each way per episode
    first, second = (entry for entry in logs if entry["event"] == "accept_recovered")
    assert (first["failures"], second["failures"]) == (500, 10)
    # The back-off is capped: 497 sleeps (after three sheds), none longer than BACKOFF_MAX.
    assert first["seconds"] <= 500 * BACKOFF_MAX
    assert accepted == [0, 1, 2, 3]


async def test_answer_turns_are_fifo_and_refuse_after_the_wait(autojump_clock: trio.testing.MockClock) -> None:
    turns = AnswerTurns(tokens=1, max_wait=5)
    holder = await turns.first()
    order: list[int] = []

    async def request(number: int) -> None:
        turn = await turns.first()
        order.append(number)
        await turn.pass_on()  # a multi-frame answer queues behind the others between frames
        order.append(number)
        turn.release()

    async with trio.open_nursery() as nursery:
        for number in range(3):
            nursery.start_soon(request, number)
            await trio.testing.wait_all_tasks_blocked()
        holder.release()
    assert order == [0, 1, 2, 0, 1, 2]

    holder = await turns.first()
    with pytest.raises(KvAgentError) as refused:
        await turns.first()
    assert refused.value.code == "overloaded"
    holder.release()


@pytest.mark.parametrize("binary", [False, True])
async def test_deeply_nested_requests_are_bad_requests_without_a_traceback(
    nursery: trio.Nursery, binary: bool
) -> None:
    url = await start_server(nursery, FakeSlot())
    depth = 100_000
    with trio.fail_after(10), structlog.testing.capture_logs() as logs:
        peer = await RawPeer.connect(url, "/v1/slots/a")
        if binary:
            await peer.stream.send_all(masked_frame(OP_BINARY, b"\x91" * depth + b"\xc0"))
        else:
            await peer.stream.send_all(masked_frame(OP_TEXT, ("[" * depth + "]" * depth).encode()))
        await peer.send_json({"id": 2, "op": "status"})
        frames: list[dict[str, object]] = []
        data = peer.buffer
        while len(frames) < 2:
            data += await peer.stream.receive_some(1 << 16)
            parsed, data = parse_frames(data)
            frames += [msgpack.unpackb(p) if op == OP_BINARY else json.loads(p) for op, p in parsed]
        await peer.aclose()
    refusal, status = frames
    assert refusal["ok"] is False and refusal["id"] is None
    assert refusal["error"] == {"code": "bad_request", "message": "request nests arrays/maps too deeply"}
    assert status["id"] == 2 and status["ok"] is True  # the connection stayed usable
    assert not [entry for entry in logs if entry.get("exc_info") or entry["log_level"] in ("error", "exception")]


def test_serve_options_for_the_websocket_bounds() -> None:
    from kvagent.cli.main import build_parser, serve_config_from_args
    from kvagent.model.errors import ConfigError

    args = ["serve", "--slot", "a", "--handshake-timeout", "1.5", "--max-pending-handshakes", "32"]
    args += ["--send-deadline", "3", "--outbound-queue-bytes", "65536", "--shutdown-timeout", "4"]
    config = serve_config_from_args(build_parser().parse_args(args))
    assert (config.handshake_timeout, config.max_pending_handshakes, config.send_deadline) == (1.5, 32, 3.0)
    assert (config.outbound_queue_bytes, config.shutdown_timeout) == (65536, 4.0)
    defaults = serve_config_from_args(build_parser().parse_args(["serve", "--slot", "a"]))
    assert defaults.max_pending_handshakes is None  # derived from the descriptor limit at start
    with pytest.raises(ConfigError) as bad:
        serve_config_from_args(build_parser().parse_args(["serve", "--slot", "a", "--send-deadline", "0"]))
    assert "send_deadline" in str(bad.value)
