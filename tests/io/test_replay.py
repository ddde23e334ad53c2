"""The replay client against real ROUTERs: streaming, both reply layouts, timeouts, cancel, back-pressure."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.model.errors import WireDecodeError
from kvagent.simulator.engine import FakeVllmEngine, block_stored
from kvagent.vllm.replay import ReplayClient, ReplayReply, ReplayTimeouts, parse_replay_reply
from kvagent.wire.vllm_events import END_SEQ
from tests.support.fakes import ReplayRouter
from tests.support.vectors import load_live

LIVE, REPLAY = load_live()
DEFAULT_TIMEOUTS = ReplayTimeouts()


# -- ReplayClient -----------------------------------------------------------------------------------------


class RecordingReplaySink:
    """A ReplaySink that records what the client streams; ``room`` can be closed to hold the client back."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, int]] = []  # (request, seq)
        self.topics: set[bytes] = set()
        self.ends: list[tuple[int, bool, str]] = []
        self.room = True
        self.full_after: int | None = None  # close the room once this many replies arrived
        self._changed = trio.Event()
        self._room_opened = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def on_reply(self, request: int, reply: ReplayReply) -> None:
        self.replies.append((request, reply.seq))
        self.topics.add(reply.topic)
        if len(self.replies) == self.full_after:
            self.room = False
        self._notify()

    def on_end(self, request: int, complete: bool, reason: str) -> None:
        self.ends.append((request, complete, reason))
        self._notify()

    async def wait_for_room(self) -> None:
        while not self.room:
            await self._room_opened.wait()

    def open_room(self) -> None:
        self.room = True
        self._room_opened.set()
        self._room_opened = trio.Event()

    async def wait_for(self, predicate: Callable[[RecordingReplaySink], bool]) -> None:
        while not predicate(self):
            await self._changed.wait()

    def seqs(self, request: int) -> list[int]:
        return [seq for (r, seq) in self.replies if r == request]


@asynccontextmanager
async def replay_client(
    endpoint: str, timeouts: ReplayTimeouts = DEFAULT_TIMEOUTS
) -> AsyncIterator[tuple[ReplayClient, RecordingReplaySink]]:
    sink = RecordingReplaySink()
    client = ReplayClient(zmq.Context.instance(), endpoint, sink, max_payload_bytes=1 << 23, timeouts=timeouts)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        yield client, sink
        nursery.cancel_scope.cancel()


async def test_replies_stream_from_the_captured_replay_then_the_end_marker() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            router = ReplayRouter(REPLAY)
            await nursery.start(router.run)
            async with replay_client(router.endpoint) as (client, sink):
                request = client.request(60)
                await sink.wait_for(lambda s: bool(s.ends))
                assert sink.seqs(request) == list(range(60, 68))
                assert sink.topics == {LIVE[0][0]}
                assert sink.ends == [(request, True, "")]
                assert client.reconnects == 0, "a complete answer keeps its DEALER"
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("layout", ["v0.26", "v0.25", "sglang"])
async def test_replies_from_the_fake_engine_in_both_layouts(layout: str) -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine(replay_endpoint="tcp://127.0.0.1:0", replay_layout=layout)  # type: ignore[arg-type]
            await nursery.start(engine.run)
            for n in range(4):
                await engine.publish_batch([block_stored([n + 1], None, [n] * 16, 16)])
            assert engine.replay_endpoint is not None
            async with replay_client(engine.replay_endpoint) as (client, sink):
                request = client.request(1)
                await sink.wait_for(lambda s: bool(s.ends))
                assert sink.seqs(request) == [1, 2, 3]
                assert sink.ends == [(request, True, "")]
                assert sink.topics == ({b"kv-events"} if layout == "v0.26" else {b""})
            nursery.cancel_scope.cancel()


async def test_a_silent_server_ends_the_attempt_incomplete_and_the_dealer_is_replaced() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            router = ReplayRouter(REPLAY, silent=True)
            await nursery.start(router.run)
            async with replay_client(router.endpoint, ReplayTimeouts(first_reply=0.2)) as (client, sink):
                request = client.request(0)
                await sink.wait_for(lambda s: bool(s.ends))
                assert sink.replies == []
                assert sink.ends == [(request, False, "replay idle timeout")]
                assert client.reconnects == 1  # done in the same step as the end, before the sink's waiter runs
            nursery.cancel_scope.cancel()


async def test_a_cancelled_request_streams_nothing_more_and_the_next_one_is_answered_alone() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            release = trio.Event()
            router = ReplayRouter(REPLAY, hold=release)
            await nursery.start(router.run)
            async with replay_client(router.endpoint) as (client, sink):
                abandoned = client.request(0)
                await router.wait_for_requests(1)
                client.cancel()
                release.set()  # the abandoned answer goes out now, to the old DEALER's identity
                request = client.request(65)
                await sink.wait_for(lambda s: any(end[0] == request for end in s.ends))
                assert sink.seqs(abandoned) == [] and all(end[0] == request for end in sink.ends)
                assert sink.seqs(request) == [65, 66, 67]
                assert client.reconnects == 1 and router.requests == [0, 65]
            nursery.cancel_scope.cancel()


async def test_the_client_reads_no_further_while_the_sink_is_full() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            router = ReplayRouter(REPLAY)
            await nursery.start(router.run)
            async with replay_client(router.endpoint) as (client, sink):
                sink.full_after = 3
                request = client.request(0)
                await sink.wait_for(lambda s: len(s.replies) == 3)
                await router.wait_for_requests(1)
                await trio.testing.wait_all_tasks_blocked()
                assert len(sink.replies) == 3 and sink.ends == [], "no reply is taken while the sink is full"
                sink.open_room()
                await sink.wait_for(lambda s: bool(s.ends))
                assert sink.seqs(request) == list(range(68)) and sink.ends == [(request, True, "")]
            nursery.cancel_scope.cancel()


async def test_an_attempt_is_bounded_in_total_time_however_slowly_replies_trickle() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(trickle_router, 0.05)
            timeouts = ReplayTimeouts(first_reply=1.0, idle=1.0, total=0.3)
            async with replay_client(endpoint, timeouts) as (client, sink):
                request = client.request(0)
                await sink.wait_for(lambda s: bool(s.ends))
                assert sink.ends == [(request, False, "replay total timeout")]
                assert 0 < len(sink.seqs(request)) < 68
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"x", b"", b"", b""], "malformed replay reply: 4 frames"),
        ([b"", b"", END_SEQ, b"x"], "end marker carries a non-empty payload"),
        ([b"", (3).to_bytes(8, "big"), b""], "seq 3 has an empty payload"),
        ([b"", b"t", (3).to_bytes(8, "big"), b"123456789"], "exceeds 8 bytes"),
    ],
)
def test_malformed_replies_are_refused(frames: list[bytes], message: str) -> None:
    with pytest.raises(WireDecodeError, match=message):
        parse_replay_reply(frames, max_payload_bytes=8)


def test_replies_parse_in_both_layouts_and_the_end_marker_is_none() -> None:
    seq = (5).to_bytes(8, "big")
    assert parse_replay_reply([b"", b"t", seq, b"p"], max_payload_bytes=8) == ReplayReply(5, b"t", b"p")
    assert parse_replay_reply([b"", seq, b"p"], max_payload_bytes=8) == ReplayReply(5, b"", b"p")
    assert parse_replay_reply([b"", b"", END_SEQ, b""], max_payload_bytes=8) is None
    assert parse_replay_reply([b"", END_SEQ, b""], max_payload_bytes=8) is None


async def trickle_router(interval: float, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """A ROUTER that answers every request with the capture's replies, one per ``interval`` seconds."""
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    with TrioSocket(router) as sock:
        task_status.started(router.getsockopt_string(zmq.LAST_ENDPOINT))
        request = await sock.recv_multipart()
        for reply in REPLAY:
            await sock.send_multipart([request[0], *reply])
            await trio.sleep(interval)  # pacing the server, not synchronizing the test


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
