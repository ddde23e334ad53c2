"""The bounded send path over real sockets: peers that stop reading, pings behind big answers, shutdown.

Every test runs the real server on 127.0.0.1 with short deadlines; waits are bounded by ``fail_after`` and
conditions on the server's counters, never by sleeping for a guessed time.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, ConnectionRejected, open_websocket_url
from wsproto import ConnectionType, WSConnection
from wsproto.events import BytesMessage, Request

from kvagent.recovery.client import connect_slot
from kvagent.recovery.server import ServerStats, ServingOptions
from kvagent.recovery.websocket import RECEIVE_BYTES, SendLimits, WebSocket, accept_response
from kvagent.recovery.wscore import MESSAGE_OVERHEAD
from tests.support.rawws import OP_PING, OP_TEXT, RawPeer, close_code, masked_frame
from tests.support.recovery import FakeSlot, start_server

SEND_DEADLINE = 1.0
BIG_BACKLOG_BLOCKS = 40_000  # a follow backlog of about 10 MB of JSON: far more than the socket buffers


@pytest.fixture
def big_slot() -> FakeSlot:
    slot = FakeSlot(ring_capacity=8)
    for block in range(BIG_BACKLOG_BLOCKS):
        slot.store_worker(block)
    return slot


async def until(condition: Callable[[], bool]) -> None:
    """Wait for a condition on the server's counters (they move on the server's own schedule)."""
    # The counters belong to the server, which has no change notification: poll them (bounded by the
    # caller's fail_after).
    while True:
        if condition():
            return
        await trio.sleep(0.01)


async def test_never_reading_followers_do_not_lock_out_a_legitimate_client(
    nursery: trio.Nursery, big_slot: FakeSlot
) -> None:
    limit = 3
    stats = ServerStats()
    options = ServingOptions(max_connections=limit, send_deadline=SEND_DEADLINE, close_grace=0.5)
    url = await start_server(nursery, big_slot, options=options, stats=stats)
    followers = []
    with trio.fail_after(20):
        for _ in range(limit):
            peer = await RawPeer.connect(url, "/v1/slots/a", receive_buffer=4096)
            await peer.send_json({"id": 1, "op": "follow", "from": None})  # a tree dump, never read
            followers.append(peer)
        with pytest.raises(ConnectionRejected) as full:
            async with open_websocket_url(f"{url}/v1/slots/a"):
                pass
        assert full.value.status_code == 503
    # The judged bound: served within the send deadline plus 5 s, although no follower ever reads.
    with trio.fail_after(SEND_DEADLINE + 5):
        while True:
            try:
                async with connect_slot(url, "a") as client:
                    assert await client.status() == big_slot.status()
                    break
            except ConnectionRejected as exc:
                assert exc.status_code == 503
                await trio.sleep(0.05)  # a refused client retries, as a router would
    assert stats.send_overruns >= 1
    with trio.fail_after(10):
        await until(lambda: stats.send_overruns == limit and stats.connections_open == 0)
    for peer in followers:
        await peer.aclose()


async def test_a_peer_that_stalls_past_the_deadline_gets_1013_overrun(
    nursery: trio.Nursery, big_slot: FakeSlot
) -> None:
    stats = ServerStats()
    options = ServingOptions(send_deadline=SEND_DEADLINE, close_grace=3)
    url = await start_server(nursery, big_slot, options=options, stats=stats)
    with trio.fail_after(30):
        peer = await RawPeer.connect(url, "/v1/slots/a", receive_buffer=4096)
        await peer.send_json({"id": 1, "op": "follow", "from": None})
        await until(lambda: stats.send_overruns == 1)
        # The peer reads again within the close grace: the frame in flight, then the close frame (and,
        # as this peer sends no close reply, the end of the connection once the grace is over).
        frames = await peer.read_until_closed()
        assert close_code(frames) == (1013, "overrun")
        await until(lambda: stats.connections_open == 0)


async def test_pings_are_answered_while_a_slow_reader_keeps_the_send_path_blocked(
    nursery: trio.Nursery, big_slot: FakeSlot
) -> None:
    """Pings go out between the 64 KiB frames of a multi-megabyte answer, so a slow but live reader is
    never mistaken for a dead one, however long its answer takes."""
    stats = ServerStats()
    # The reference client answers a ping only when its one-message queue has room, i.e. after the next
    # get_message: the timeout leaves room for that (a ping waits behind the frames already in the socket
    # buffers, each read 0.35 s apart; 3 s holds on a loaded machine, where 1 s failed half the runs, old
    # server and new alike), and the reading takes longer than interval + timeout.
    options = ServingOptions(heartbeat_interval=0.05, heartbeat_timeout=3.0, send_deadline=SEND_DEADLINE)
    url = await start_server(nursery, big_slot, options=options, stats=stats)
    messages = 0
    with trio.fail_after(60):
        async with open_websocket_url(f"{url}/v1/slots/a", max_message_size=4 << 20) as ws:
            await ws.send_message(json.dumps({"id": 1, "op": "recover", "start": None}))
            while True:
                frame = json.loads(await ws.get_message())
                messages += 1
                if not frame["more"]:
                    break
                await trio.sleep(0.35)  # pacing: a reader that takes longer than interval + timeout
            await ws.send_message(json.dumps({"id": 2, "op": "status"}))
            assert json.loads(await ws.get_message())["ok"] is True
    assert messages >= 10  # reading the answer took longer than a heartbeat interval plus its timeout
    assert stats.ping_timeouts == 0
    assert stats.send_overruns == 0


async def test_a_peer_that_never_answers_pings_is_closed_with_4000(nursery: trio.Nursery) -> None:
    slot = FakeSlot()
    stats = ServerStats()
    options = ServingOptions(heartbeat_interval=0.05, heartbeat_timeout=0.2)
    url = await start_server(nursery, slot, options=options, stats=stats)
    with trio.fail_after(10):
        peer = await RawPeer.connect(url, "/v1/slots/a")
        await until(lambda: stats.ping_timeouts == 1)
        frames = await peer.read_until_closed()
    assert frames[0][0] == OP_PING
    assert close_code(frames) == (4000, "ping timeout")


async def test_shutdown_closes_every_client_with_1001_within_the_timeout(big_slot: FakeSlot) -> None:
    stats = ServerStats()
    options = ServingOptions(shutdown_timeout=2.0, send_deadline=30, close_grace=0.5)
    closed: list[tuple[int, str | None]] = []

    async def idle_client(url: str, task_status: trio.TaskStatus[None]) -> None:
        async with open_websocket_url(f"{url}/v1/slots/a") as ws:
            task_status.started()
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
            assert info.value.reason is not None
            closed.append((info.value.reason.code, info.value.reason.reason))

    async def live_follower(url: str, task_status: trio.TaskStatus[None]) -> None:
        async with open_websocket_url(f"{url}/v1/slots/a", max_message_size=4 << 20) as ws:
            await ws.send_message(json.dumps({"id": 1, "op": "follow", "from": BIG_BACKLOG_BLOCKS}))
            assert json.loads(await ws.get_message())["kind"] == "events"
            task_status.started()
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    await ws.get_message()
            assert info.value.reason is not None
            closed.append((info.value.reason.code, info.value.reason.reason))

    with trio.fail_after(30):
        async with trio.open_nursery() as clients:
            with trio.CancelScope() as shutdown_window:
                async with trio.open_nursery() as server:
                    url = await start_server(server, big_slot, options=options, stats=stats)
                    await clients.start(idle_client, url)
                    await clients.start(live_follower, url)
                    # A peer that reads nothing, in the middle of a big dump, must not hold the shutdown up.
                    stalled = await RawPeer.connect(url, "/v1/slots/a", receive_buffer=4096)
                    await stalled.send_json({"id": 1, "op": "follow", "from": None})
                    await until(lambda: stats.connections_open == 3)
                    shutdown_window.deadline = trio.current_time() + options.shutdown_timeout + 1
                    server.cancel_scope.cancel()
            assert not shutdown_window.cancelled_caught, "the shutdown overran its timeout"
            assert stats.connections_open == 0
    assert sorted(closed) == [(1001, "going away"), (1001, "going away")]
    await stalled.aclose()


async def test_a_peer_that_floods_requests_is_held_to_the_inbound_byte_bound() -> None:
    """A session busy elsewhere stops the reader at the inbound bound; the rest waits in the peer's TCP
    window, and every request is still delivered, in order, once the session reads again."""
    server_sock, client_sock = socket.socketpair()
    server_sock.setblocking(False)
    client_sock.setblocking(False)
    server_side, client = WSConnection(ConnectionType.SERVER), WSConnection(ConnectionType.CLIENT)
    server_side.receive_data(client.send(Request(host="localhost", target="/v1/slots/a")))
    assert any(isinstance(event, Request) for event in server_side.events())
    client.receive_data(accept_response(server_side))
    list(client.events())
    message_size = 128 << 10
    limit = 512 << 10
    ws = WebSocket(server_sock, server_side, max_message_size=limit, limits=SendLimits())
    session_reads = trio.Event()
    received: list[bytes] = []

    async def busy_session() -> None:
        await session_reads.wait()
        while len(received) < written:
            message = await ws.get_message()
            assert isinstance(message, bytes)
            received.append(message)

    written = 0
    pending = b""
    peak = 0
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.run, busy_session)
            stuck_rounds = 0
            while stuck_rounds < 3:  # the peer's writes stay blocked while the server gets to run
                if not pending:
                    pending = client.send(BytesMessage(data=written.to_bytes(4, "big") * (message_size // 4)))
                    written += 1
                try:
                    pending = pending[client_sock.send(pending) :]
                    stuck_rounds = 0
                except BlockingIOError:
                    stuck_rounds += 1
                await trio.testing.wait_all_tasks_blocked()
                peak = max(peak, ws.core.inbound_bytes)
            assert written * message_size > limit  # more than the bound was offered
            assert not ws.core.wants_data  # the reader stopped: the rest waits in the peer's window
            assert peak <= limit + RECEIVE_BYTES + MESSAGE_OVERHEAD * 8
            if pending:  # the message cut by the full window: finish it, or the session waits forever
                written_before = written
                session_reads.set()
                while pending:
                    try:
                        pending = pending[client_sock.send(pending) :]
                    except BlockingIOError:
                        await trio.lowlevel.wait_writable(client_sock)
                assert written == written_before
            else:
                session_reads.set()
    assert [message[:4] for message in received] == [n.to_bytes(4, "big") for n in range(written)]
    client_sock.close()


async def test_a_peer_that_never_reads_is_reset_after_the_deadline_and_the_grace(
    nursery: trio.Nursery, big_slot: FakeSlot
) -> None:
    """Not a graceful close queued behind the blocked send: once neither the frame in flight nor the 1013
    could be written, the server resets the connection, and the kernel drops what it still buffered."""
    stats = ServerStats()
    options = ServingOptions(send_deadline=SEND_DEADLINE, close_grace=0.3)
    url = await start_server(nursery, big_slot, options=options, stats=stats)
    with trio.fail_after(30):
        peer = await RawPeer.connect(url, "/v1/slots/a", receive_buffer=4096)
        await peer.send_json({"id": 1, "op": "follow", "from": None})
        await until(lambda: stats.send_overruns == 1)
        await until(lambda: stats.connections_open == 0)  # aborted without the peer reading a byte
        with pytest.raises(trio.BrokenResourceError):  # ECONNRESET: the reset, not a FIN after the data
            while await peer.stream.receive_some(1 << 16):
                pass
    await peer.aclose()


async def test_pipelined_requests_are_answered_one_per_step(nursery: trio.Nursery) -> None:
    """200 requests arriving in one read are not answered in one task step: every other task (ingest,
    other connections) runs between two of them."""
    slot = FakeSlot()
    stats = ServerStats()
    url = await start_server(nursery, slot, stats=stats)
    requests = 200
    with trio.fail_after(10):
        peer = await RawPeer.connect(url, "/v1/slots/a")
        burst = b"".join(
            masked_frame(OP_TEXT, json.dumps({"id": n, "op": "status"}).encode()) for n in range(requests)
        )
        largest_step = 0
        seen = 0
        await peer.stream.send_all(burst)
        while seen < requests:
            await trio.lowlevel.checkpoint()  # one scheduling round: how many answers did it hold?
            now = stats.requests.get("status", 0)
            largest_step = max(largest_step, now - seen)
            seen = now
    assert largest_step <= 2
    await peer.aclose()
