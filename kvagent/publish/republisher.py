"""The vLLM-compatible republisher: one slot's Worker-domain stream as vLLM 0.32.0 publishes it.

A router that consumes vLLM's KV events (PUB ``[topic, seq u64 BE, msgpack KVEventBatch]`` and the replay
ROUTER) reads a kvagent slot exactly as it would read the engine, and gains what no engine gives: one seq
space for the slot's lifetime (engine restarts, detaches and resets appear as ``AllBlocksCleared``), a deep
replay ring, and snapshots for starts older than the ring (vLLM PR #50134's shape).

What is published and answered is decided by the sans-IO :class:`~kvagent.publish.republish_state.RepublishState`;
this module moves its bytes: the PUB sends non-blocking from the coordinator's publication (drops at the
high-water mark are counted; consumers repair them by replay), and :meth:`VllmRepublisher.run` is the one task
owning the replay ROUTER.  It answers several DEALERs round-robin, a few messages each per turn, so a slow one
never stalls the others; ``ROUTER_MANDATORY`` makes a full peer pipe refuse a frame (kept and retried) instead
of dropping it, and an answer whose DEALER takes nothing for ``answer_deadline`` seconds is abandoned, logged
and counted, never truncated silently.

The PUB is an XPUB, so kvagent sees every subscription arrive. A subscriber that arrives once something has
been published (a late joiner, or a consumer whose SUB reconnects after kvagent's own restart) may hold a
state the stream cannot repair — a consumer without replay applies whatever follows a gap — so it gets a
*resync*: the whole state as live batches (``AllBlocksCleared``, then every resident block) under the next
seqs. A PUB cannot address one subscriber, so every subscriber sees it; for one already in step it changes
nothing. Subscriptions coalesce, and a :class:`~kvagent.publish.republish_state.ResyncGate` spaces resyncs
by time and bytes, so a consumer reconnecting in a loop cannot make kvagent flood the others.
"""

from __future__ import annotations

import collections
import errno
import math
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import attrs
import structlog
import trio
import zmq

from kvagent._util.sync import Changed, checkpoint
from kvagent._util.zmqtrio import TrioSocket
from kvagent.model.errors import KvAgentError, SinkError
from kvagent.model.events import RouterEvent
from kvagent.model.options import bind_endpoint, option, option_validator, positive
from kvagent.model.status import RepublishStatus
from kvagent.publish.republish_state import (
    ReplayAnswer,
    RepublishState,
    RepublishStatistics,
    ResyncBuild,
    ResyncGate,
    SnapshotAnswer,
)
from kvagent.wire.vllm_events import END_SEQ

__all__ = [
    "RepublishConfig",
    "RepublisherStatistics",
    "VllmRepublisher",
    "offset_endpoint",
]

log = structlog.get_logger(__name__)

# What one answer may send per round-robin turn: enough to keep a fast DEALER's pipe busy, little enough that
# the other answers (and every other task: snapshot payloads are encoded as they are drawn) get their turn soon.
ANSWER_BURST = 32
ANSWER_BURST_BYTES = 256 << 10
# Answers per DEALER (sent one after the other) and overall; beyond, a request is refused: logged, counted and
# answered with just the end marker, because a consumer may wait for it without a timeout (Dynamo's indexer
# does). A DEALER with MAX_QUEUED_PER_PEER answers queued is flooding: its further requests are dropped.
MAX_ANSWERS_PER_PEER = 4
MAX_ANSWERS = 64
MAX_QUEUED_PER_PEER = 64
# A resync is encoded this many payloads (of up to 512 blocks) at a time between checkpoints.
RESYNC_CHUNK_PAYLOADS = 16
# When every answer's peer pipe is full the task waits for libzmq's next command (a peer read, a request),
# and at most this long: an edge consumed by a send attempt is noticed within it.
BLOCKED_RETRY = 0.05


_positive = option_validator(positive)


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """vLLM's ``offset_endpoint_port``: each DP rank binds ``PORT + dp_rank`` (inproc: ``_dp{rank}`` suffix).

    Rank 0 and port 0 (an ephemeral port per rank) are unchanged; an ipc endpoint cannot be offset, so a
    rank above 0 is refused as vLLM refuses it.
    """
    if dp_rank == 0:
        return endpoint
    scheme, _, rest = endpoint.partition("://")
    if scheme == "inproc":
        return f"{endpoint}_dp{dp_rank}"
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if int(port) == 0:
            return endpoint
        if int(port) + dp_rank > 65535:
            raise KvAgentError(
                f"republish endpoint {endpoint!r} offset by dp_rank {dp_rank} is past port 65535",
                code="bad_request",
            )
        return f"tcp://{host}:{int(port) + dp_rank}"
    raise KvAgentError(
        f"republish endpoint {endpoint!r} cannot be offset by dp_rank {dp_rank} (use tcp or inproc)",
        code="bad_request",
    )


@attrs.frozen(slots=True)
class RepublishConfig:
    """Where and how one slot republishes (validated: ``KvAgentError(code="bad_request")`` on bad values).

    ``endpoint`` and ``replay_endpoint`` are the addresses of dp_rank 0; :meth:`for_rank` offsets them the way
    vLLM does.  ``legacy_replay`` answers replay in the 3-frame form of vLLM < 0.26.  ``resync_on_subscribe``
    publishes the whole state when a subscriber arrives after the first batch (see the module docstring), at
    most once per ``resync_interval`` seconds and, after a resync of B bytes, not again for
    ``B / resync_bytes_per_second`` seconds.
    """

    endpoint: str = option(
        help="bind each slot's vLLM-format PUB here (PORT + the slot's dp_rank, as vLLM offsets DP ranks)",
        flags=("--republish",),
        metavar="tcp://HOST:PORT",
        check=bind_endpoint,
    )
    replay_endpoint: str | None = option(
        None,
        help="bind each slot's vLLM replay ROUTER here (PORT + dp_rank); old starts get a snapshot",
        flags=("--republish-replay",),
        metavar="tcp://HOST:PORT",
        check=bind_endpoint,
    )
    topic: str = option("", help="topic frame of the republished stream", flags=("--republish-topic",))
    legacy_replay: bool = option(
        False,
        help="answer replay in the 3-frame form of vLLM < 0.26",
        flags=("--legacy-replay",),
        switch=True,
    )
    buffer_batches: int = option(10_000, help="batches the republisher keeps for replay", check=positive)
    sndhwm: int = attrs.field(default=100_000, validator=_positive)
    replay_sndhwm: int = attrs.field(default=1000, validator=_positive)  # a full peer pipe waits, never drops
    answer_deadline: float = attrs.field(default=10.0, validator=_positive)
    resync_on_subscribe: bool = True
    resync_interval: float = attrs.field(default=1.0, validator=_positive)
    resync_bytes_per_second: float = attrs.field(default=float(32 << 20), validator=_positive)

    def __attrs_post_init__(self) -> None:
        ephemeral = self.endpoint.startswith("tcp://") and self.endpoint.endswith(":0")
        if self.replay_endpoint == self.endpoint and not ephemeral:
            raise KvAgentError(
                f"republish replay_endpoint must differ from endpoint ({self.endpoint!r})", code="bad_request"
            )

    def for_rank(self, dp_rank: int) -> RepublishConfig:
        """This config with both endpoints offset for ``dp_rank`` (vLLM's DP port convention)."""
        return attrs.evolve(
            self,
            endpoint=offset_endpoint(self.endpoint, dp_rank),
            replay_endpoint=None
            if self.replay_endpoint is None
            else offset_endpoint(self.replay_endpoint, dp_rank),
        )


@attrs.frozen(slots=True)
class RepublisherStatistics:
    """The republisher's counters (all since it was opened, never reset) and its state's.

    Attributes:
        state: the sans-IO state's counters (batches and events published, ring, mirror, answers served, and
            the whole-state resyncs sent for subscriptions: ``state.resyncs``, ``state.resync_*``).
        subscriptions: subscribe notifications seen on the PUB.
        batches_sent: live batches the PUB accepted.
        dropped_batches: live batches dropped at the PUB's high-water mark (consumers repair them by replay).
        replay_requests: well-formed replay and snapshot requests received.
        malformed_requests: requests answered with only the end marker.
        refused_requests: requests not answered (too many answers queued).
        answers_completed: answers whose end marker was sent.
        answers_abandoned: answers given up (the DEALER took nothing within the deadline, or left).
        answers_active: answers being sent now.
        resync_dropped_batches: resync batches dropped at the PUB's high-water mark.
        resync_wanted: a subscription waits for a resync (held back by the resync bound).
    """

    state: RepublishStatistics
    subscriptions: int
    batches_sent: int
    dropped_batches: int
    replay_requests: int
    malformed_requests: int
    refused_requests: int
    answers_completed: int
    answers_abandoned: int
    answers_active: int
    resync_dropped_batches: int = 0
    resync_wanted: bool = False


@attrs.define
class _Answer:
    """One replay answer in flight: its remaining frames and the one a full pipe refused."""

    frames: Generator[list[bytes], None, None]
    deadline: float
    pending: list[bytes] | None = None

    def close(self) -> None:
        self.frames.close()  # a started answer closes the state's answer in its ``finally``


def _seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _worth_logging(count: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... occurrence: a flood of bad requests cannot flood the log."""
    return count & (count - 1) == 0


class VllmRepublisher:
    """One slot's vLLM-compatible stream: an :class:`~kvagent.publish.sinks.EventSink` whose ``publish`` never
    blocks, and (with a replay endpoint) the replay ROUTER served by :meth:`run`.

    Binds on construction (a bind failure raises ``KvAgentError``); :meth:`close` closes both sockets.
    """

    def __init__(
        self,
        config: RepublishConfig,
        *,
        dp_rank: int,
        block_size: int,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        self._topic = config.topic.encode()
        self._state = RepublishState(
            dp_rank=dp_rank, block_size=block_size, ring_batches=config.buffer_batches
        )
        ctx = context if context is not None else zmq.Context.instance()
        self._pub, self.endpoint = self._bind_pub(ctx, config)
        self._router: TrioSocket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            try:
                self._router, self.replay_endpoint = self._bind_router(
                    ctx, config.replay_endpoint, config.replay_sndhwm
                )
            except BaseException:
                self._pub.close()
                raise
        self._subscriptions = 0
        self._subscribed = Changed()  # a subscription was counted
        self._resync_gate = ResyncGate(config.resync_interval, config.resync_bytes_per_second)
        self._resync_wanted = Changed()  # the gate was marked wanted
        self._mirror_caught_up = Changed()  # the last snapshot stream holding the mirror back ended
        self._state.on_mirror_current = self._mirror_caught_up.notify
        self._resync_dropped = 0
        self._batches_sent = 0
        self._dropped_batches = 0
        self._replay_requests = 0
        self._malformed_requests = 0
        self._refused_requests = 0
        self._answers_completed = 0
        self._answers_abandoned = 0
        self._answers: collections.OrderedDict[bytes, collections.deque[_Answer]] = collections.OrderedDict()

    @staticmethod
    def _bind_pub(ctx: zmq.Context[Any], config: RepublishConfig) -> tuple[TrioSocket, str]:
        # An XPUB with XPUB_NODROP is a PUB whose send reports EAGAIN at the high-water mark instead of dropping
        # silently, so drops are counted; XPUB_VERBOSE reports every subscriber, not only the first per topic.
        sock = ctx.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.XPUB_NODROP, 1)
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
            sock.setsockopt(zmq.SNDHWM, config.sndhwm)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(config.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise KvAgentError(
                f"cannot bind republish endpoint {config.endpoint!r}: {exc}", code="bad_request"
            ) from exc
        return TrioSocket(sock), sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @staticmethod
    def _bind_router(ctx: zmq.Context[Any], endpoint: str, sndhwm: int) -> tuple[TrioSocket, str]:
        sock = ctx.socket(zmq.ROUTER)
        try:
            # A full peer pipe refuses the frame (EAGAIN: kept and retried) and a gone peer is reported
            # (EHOSTUNREACH) instead of both being dropped silently as vLLM's ROUTER does.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, sndhwm)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise KvAgentError(
                f"cannot bind republish replay endpoint {endpoint!r}: {exc}", code="bad_request"
            ) from exc
        return TrioSocket(sock), sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- read side -------------------------------------------------------------------------------
    @property
    def state(self) -> RepublishState:
        """The sans-IO state (a restarted slot restores it; its persistence reads the mirror)."""
        return self._state

    @property
    def last_seq(self) -> int | None:
        return self._state.last_seq

    def status(self) -> RepublishStatus:
        return RepublishStatus(
            endpoint=self.endpoint, replay_endpoint=self.replay_endpoint, seq=self._state.last_seq
        )

    def statistics(self) -> RepublisherStatistics:
        return RepublisherStatistics(
            state=self._state.statistics(),
            subscriptions=self._subscriptions,
            batches_sent=self._batches_sent,
            dropped_batches=self._dropped_batches,
            replay_requests=self._replay_requests,
            malformed_requests=self._malformed_requests,
            refused_requests=self._refused_requests,
            answers_completed=self._answers_completed,
            answers_abandoned=self._answers_abandoned,
            answers_active=sum(len(queue) for queue in self._answers.values()),
            resync_dropped_batches=self._resync_dropped,
            resync_wanted=self._resync_gate.wanted,
        )

    # --- live ------------------------------------------------------------------------------------
    def publish(self, events: Sequence[RouterEvent]) -> None:
        """Encode, number and send one publication (nothing when it holds no Worker-domain change)."""
        if self._pub.closed:
            raise SinkError("the republisher is closed")
        published = self._state.publish(events)
        self._poll_subscriptions()
        if published is None:
            return
        seq, payload = published
        try:
            sent = self._pub.try_send_multipart([self._topic, _seq_frame(seq), payload])
        except zmq.ZMQError as exc:
            raise SinkError(f"republish send failed: {exc}") from exc
        if sent:
            self._batches_sent += 1
        else:
            self._dropped_batches += 1

    def _poll_subscriptions(self) -> None:
        """Take the XPUB's (un)subscribe notifications: libzmq queues them without bound otherwise."""
        sock = self._pub.socket
        seen = self._subscriptions
        while True:
            try:
                note = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                raise SinkError(f"republish receive failed: {exc}") from exc
            if note[:1] == b"\x01":
                self._subscriptions += 1
        if self._subscriptions != seen:
            # A subscriber before the first batch misses nothing; a later one may hold anything (it joined
            # late, or it followed this slot before kvagent restarted): it gets the whole state.
            if self.config.resync_on_subscribe and self._state.last_seq is not None:
                self._resync_gate.want()
                self._resync_wanted.notify()
            self._subscribed.notify()

    async def wait_for_subscriber(self, count: int = 1) -> None:
        """Return once ``count`` subscriptions reached the PUB (counted since it was opened).

        Notifications are taken by :meth:`run`'s watcher and by every publish; this waits on neither FD.
        """
        await self._subscribed.wait_for(lambda: self._subscriptions >= count)

    # --- tasks -----------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch the PUB's subscriptions and serve the replay ROUTER until cancelled or closed."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_subscriptions)
                nursery.start_soon(self._resync_subscribers)
                if self._router is not None:
                    nursery.start_soon(self._serve_replay, self._router)
                task_status.started()
        except* trio.ClosedResourceError:
            pass  # closed by close(): the slot is shutting down
        finally:
            self._abandon_all("republisher stopped")

    async def _watch_subscriptions(self) -> None:
        while True:
            self._poll_subscriptions()
            await self._pub.wait_readable()

    async def _resync_subscribers(self) -> None:
        """Send a resync whenever a subscription wants one and the gate allows it."""
        gate = self._resync_gate
        while True:
            # Wanted until a resync is sent (_send_resync clears it with every subscription noted so far).
            await self._resync_wanted.wait_for(lambda: gate.wanted)
            await trio.sleep_until(gate.not_before)
            # A replay snapshot holds the mirror back until it ends (or is abandoned at its deadline), and a
            # resync starts from the state after the newest batch.
            await self._mirror_caught_up.wait_for(lambda: self._state.mirror_current)
            build = self._state.begin_resync()
            try:
                # Encoded a chunk at a time, so the coordinator (which goes on publishing: the resync re-sends
                # what it publishes meanwhile) and the other tasks run between chunks.
                while not build.encode(RESYNC_CHUNK_PAYLOADS):
                    await checkpoint()
                self._send_resync(build)
            finally:
                build.close()

    def _send_resync(self, build: ResyncBuild) -> None:
        if self._pub.closed:
            raise trio.ClosedResourceError("the republisher is closed")
        # Every subscription noted so far is served by this resync: gate.sent below clears ``wanted`` with no
        # await in between.
        self._poll_subscriptions()
        batches = self._state.finish_resync(build)
        size = dropped = 0
        for seq, payload in batches:
            size += len(payload)
            if self._pub.try_send_multipart([self._topic, _seq_frame(seq), payload]):
                self._batches_sent += 1
            else:
                dropped += 1
        self._dropped_batches += dropped
        self._resync_dropped += dropped
        self._resync_gate.sent(trio.current_time(), size)
        log.info(
            "republish_resync",
            first_seq=batches[0][0],
            last_seq=batches[-1][0],
            blocks=self._state.resident_blocks(),
            batches_after_cut=len(build.catch_up),
            bytes=size,
            dropped_batches=dropped,
            subscriptions=self._subscriptions,
        )

    async def _serve_replay(self, router: TrioSocket) -> None:
        while True:
            self._take_requests(router)
            self._abandon_stalled()
            if not self._answers:
                await router.wait_readable()
                continue
            if self._send_round(router):
                await checkpoint()
                continue
            # Every answer's pipe is full. Let libzmq process its commands (a peer's read activates its pipe),
            # try once more, then sleep until the next command or the nearest deadline.
            router.socket.getsockopt(zmq.EVENTS)
            if self._send_round(router):
                await checkpoint()
                continue
            wait = min(BLOCKED_RETRY, max(0.0, self._nearest_deadline() - trio.current_time()))
            with trio.move_on_after(wait):
                # Not router.wait_readable(): libzmq signals for any change of EVENTS (a blocked pipe turning
                # writable, too), and that wait returns only once a request is readable.
                await router.wait_signalled()

    # --- requests --------------------------------------------------------------------------------
    def _take_requests(self, router: TrioSocket) -> None:
        while True:
            try:
                frames = router.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._admit(frames)

    def _admit(self, frames: list[bytes]) -> None:
        identity = frames[0]
        queue = self._answers.get(identity) or collections.deque()
        answers = self._answer_frames(frames)
        if len(queue) >= MAX_ANSWERS_PER_PEER or sum(len(q) for q in self._answers.values()) >= MAX_ANSWERS:
            self._refused_requests += 1
            if _worth_logging(self._refused_requests):
                log.warning(
                    "republish_replay_refused",
                    reason="too many answers queued",
                    peer=identity.hex(),
                    refused=self._refused_requests,
                )
            if len(queue) >= MAX_QUEUED_PER_PEER:
                return
            answers = self._end_marker()
        self._answers[identity] = queue
        queue.append(_Answer(answers, deadline=trio.current_time() + self.config.answer_deadline))

    def _answer_frames(self, frames: list[bytes]) -> Generator[list[bytes], None, None]:
        """The DEALER-bound messages (without the identity) answering one request, end marker included.

        A generator: the state is asked when the answer's first message is drawn, so an answer queued behind
        another of the same DEALER reflects the stream when it starts (and a queued snapshot holds nothing).
        """
        problem = (
            f"{len(frames) - 1} frames, not [b'', start]" if len(frames) != 3 or frames[1] != b"" else ""
        )
        answer: ReplayAnswer | None = None
        if not problem:
            try:
                answer = self._state.answer(frames[2])
            except ValueError as exc:
                problem = str(exc)
        if answer is None:
            self._malformed_requests += 1
            if _worth_logging(self._malformed_requests):
                log.warning("republish_replay_malformed", problem=problem, malformed=self._malformed_requests)
            yield from self._end_marker()
            return
        self._replay_requests += 1
        yield from self._reply_frames(answer)

    def _end_marker(self) -> Generator[list[bytes], None, None]:
        # vLLM answers a malformed request with nothing at all; an end marker ends a consumer's wait at once.
        yield [b"", END_SEQ, b""] if self.config.legacy_replay else [b"", b"", END_SEQ, b""]

    def _reply_frames(self, answer: ReplayAnswer) -> Iterator[list[bytes]]:
        if isinstance(answer, SnapshotAnswer):
            seq_frame = _seq_frame(answer.seq)
            batches: Iterator[tuple[bytes, bytes]] = ((seq_frame, payload) for payload in answer.payloads)
        else:
            batches = ((_seq_frame(seq), payload) for seq, payload in answer.batches)
        try:
            if self.config.legacy_replay:
                for seq, payload in batches:
                    yield [b"", seq, payload]
            else:
                for seq, payload in batches:
                    yield [b"", self._topic, seq, payload]
        finally:
            # Closing ends a snapshot's hold on the state's mirror, also when the answer is abandoned.
            answer.close()
        yield from self._end_marker()

    # --- answers ---------------------------------------------------------------------------------
    def _send_round(self, router: TrioSocket) -> bool:
        """One round-robin turn: each peer's current answer sends up to ``ANSWER_BURST`` messages."""
        progressed = False
        now = trio.current_time()
        for identity in list(self._answers):
            queue = self._answers[identity]
            answer = queue[0]
            try:
                sent = self._send_burst(router, identity, answer)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                self._abandon_peer(identity, "the DEALER is gone")
                continue
            if sent:
                progressed = True
                answer.deadline = now + self.config.answer_deadline
            if answer.pending is None:  # finished: its end marker went out
                queue.popleft()
                self._answers_completed += 1
                if queue:
                    queue[0].deadline = now + self.config.answer_deadline
                else:
                    del self._answers[identity]
        return progressed

    @staticmethod
    def _send_burst(router: TrioSocket, identity: bytes, answer: _Answer) -> int:
        """Send one turn's messages; ``answer.pending`` is None afterwards iff the answer is finished."""
        sent = sent_bytes = 0
        while sent < ANSWER_BURST and sent_bytes < ANSWER_BURST_BYTES:
            if answer.pending is None:
                frames = next(answer.frames, None)
                if frames is None:
                    return sent
                answer.pending = [identity, *frames]
            if not router.try_send_multipart(answer.pending):
                return sent
            sent_bytes += len(answer.pending[-1])
            answer.pending = None
            sent += 1
        # The burst is used up: mark the answer unfinished even when its next message is not drawn yet.
        frames = next(answer.frames, None)
        answer.pending = None if frames is None else [identity, *frames]
        return sent

    def _nearest_deadline(self) -> float:
        return min((queue[0].deadline for queue in self._answers.values()), default=math.inf)

    def _abandon_stalled(self) -> None:
        now = trio.current_time()
        for identity in [i for i, queue in self._answers.items() if queue[0].deadline <= now]:
            self._abandon_peer(identity, f"the DEALER took nothing for {self.config.answer_deadline}s")

    def _abandon_peer(self, identity: bytes, reason: str) -> None:
        queue = self._answers.pop(identity, None) or collections.deque()
        for answer in queue:
            answer.close()
        self._answers_abandoned += len(queue)
        if queue:
            log.warning("republish_replay_abandoned", peer=identity.hex(), answers=len(queue), reason=reason)

    def _abandon_all(self, reason: str) -> None:
        for identity in list(self._answers):
            self._abandon_peer(identity, reason)

    def close(self) -> None:
        """Close both sockets (a running :meth:`run` ends); later publications raise ``SinkError``."""
        self._abandon_all("republisher closed")
        self._pub.close()
        if self._router is not None:
            self._router.close()
