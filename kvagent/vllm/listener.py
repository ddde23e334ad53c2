"""The per-attachment vLLM listener: SUB socket → decode → rank check → normalize → chunk → coordinator.

Live frames and replay replies both go through :func:`kvagent.vllm.decode.decode`. A burst is handled in slices of about a millisecond, so the
coordinator and recovery requests on the same event loop are never kept waiting longer.

Admission never waits on the coordinator (``CoordinatorHandle.admit_nowait`` is a non-blocking send on an
unbounded channel; memory stays bounded because the coordinator drains much faster than one engine
publishes, and the SUB's RCVHWM bounds what the engine can queue). If the listener ends on its own — an
error, or the attachment no longer being ready — it quarantines its generation with
``"framework listener terminated"``; cancelled from outside, it just stops.

Sequence gaps (issue #6). With a replay endpoint, a gap is repaired before the live batch that exposed it
is applied; live batches that arrive meanwhile wait in a bounded reorder buffer (``reorder_capacity``) so
a late replayed ``Stored(A)`` can never resurrect a block a newer live ``Removed(A)`` deleted
(vllm-wire.md §9.2). What cannot be repaired is reported to the coordinator as source loss and the stream
continues (lossy, agent-semantics.md §3.5). On a cold attach the whole replay buffer is applied first, so
blocks published before the SUB connected are not missing. A seq going backwards (an in-place engine
restart) is passed through for the coordinator's reset barrier; if it went back to n > 0, the new
incarnation's seqs 0..n-1 are a gap like any other.

The listener owns its two sockets: the SUB, and the DEALER of its :class:`ReplayClient`, which runs one
request at a time, collecting replies into a :class:`ReplayAttempt` so a cancelled or abandoned attempt keeps
what it got.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any

import attrs
import structlog
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.coordinator.task import CoordinatorHandle, StatusCell
from kvagent.model.errors import ChunkingError, KvAgentError, ListenerError, WireDecodeError
from kvagent.model.events import MAX_RAW_PAYLOAD_BYTES
from kvagent.model.status import Attachment
from kvagent.vllm.decode import RawMessage, decode
from kvagent.vllm.normalize import AttachmentNormalizer, build_ingress_chunks
from kvagent.vllm.sequence import SeqDecision, SequenceGate

__all__ = [
    "LISTENER_TERMINATED",
    "ListenerCounters",
    "ListenerError",
    "ListenerOptions",
    "ListenerStatistics",
    "ReplayAttempt",
    "ReplayClient",
    "run_listener",
]

log = structlog.get_logger(__name__)

LISTENER_TERMINATED = "framework listener terminated"
QUARANTINE_TIMEOUT = 5.0
SLICE_SECONDS = 0.001


class _NotReady(Exception):
    """The attachment is no longer ready: stop quietly (and still quarantine)."""


_positive = attrs.validators.gt(0)


@attrs.frozen(slots=True)
class ListenerOptions:
    rcvhwm: int = attrs.field(default=1_000_000, validator=attrs.validators.ge(0))  # 0: libzmq's "no limit"
    batch_messages: int = attrs.field(default=256, validator=_positive)
    # Inactivity timeout of one replay attempt, in seconds.
    replay_timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0.0))
    reorder_capacity: int = attrs.field(default=4096, validator=_positive)  # live batches held during replay
    cold_bootstrap: bool = True
    max_payload_bytes: int = attrs.field(default=MAX_RAW_PAYLOAD_BYTES, validator=_positive)


@attrs.frozen(slots=True)
class ListenerStatistics:
    """A snapshot of one listener's counters (all since the listener started).

    Attributes:
        messages: live messages received from the SUB socket.
        batches: batches normalized and admitted (live and replayed).
        decode_errors: live messages that failed to decode (each ends the listener).
        gaps: sequence gaps detected in the live stream.
        repaired_batches: batches applied from replay replies.
        lost_batches: batches reported to the coordinator as source loss.
        restarts_seen: live seqs that went backwards (the engine restarted in place).
        duplicates: batches dropped because their seq was already applied.
        reorder_overflows: replays cut short because the reorder buffer filled up.
        filtered: events dropped by normalization, by reason.
        unpublished_blocks: stored blocks normalization could not publish (block size or missing tokens).
    """

    messages: int
    batches: int
    decode_errors: int
    gaps: int
    repaired_batches: int
    lost_batches: int
    restarts_seen: int
    duplicates: int
    reorder_overflows: int
    filtered: Mapping[str, int]
    unpublished_blocks: int


@attrs.define
class ListenerCounters:
    """The listener's hot-path counters (plain increments); :meth:`statistics` takes a frozen snapshot."""

    messages: int = 0
    batches: int = 0
    decode_errors: int = 0
    gaps: int = 0
    repaired_batches: int = 0
    lost_batches: int = 0
    restarts_seen: int = 0
    duplicates: int = 0
    reorder_overflows: int = 0
    filtered: dict[str, int] = attrs.Factory(dict)
    unpublished_blocks: int = 0

    def statistics(self) -> ListenerStatistics:
        # asdict copies ``filtered``, so the snapshot never changes afterwards.
        return ListenerStatistics(**attrs.asdict(self))


@attrs.define
class ReplayAttempt:
    """What one replay request produced; filled in as replies arrive."""

    start: int
    messages: list[RawMessage] = attrs.Factory(list)
    complete: bool = False  # the end marker arrived
    error: str | None = None


class ReplayClient:
    """One DEALER connected to the engine's replay ROUTER, owned by the listener task."""

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        *,
        inactivity_timeout: float = 5.0,
        max_payload_bytes: int,
    ) -> None:
        self.context = context
        self.endpoint = endpoint
        self.inactivity_timeout = inactivity_timeout
        self.max_payload_bytes = max_payload_bytes
        self.socket = self._connect()

    def _connect(self) -> TrioSocket:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint)
        return TrioSocket(dealer)

    def _reconnect(self) -> None:
        # Replies to an abandoned request may still be on their way; a fresh DEALER has a new identity,
        # so the ROUTER routes those stale replies nowhere instead of into the next attempt.
        self.socket.close()
        self.socket = self._connect()

    def close(self) -> None:
        self.socket.close()

    async def fetch(self, attempt: ReplayAttempt) -> None:
        """Request every buffered batch with ``seq >= attempt.start``; fills ``attempt`` oldest first.

        Ends at the end marker, a malformed reply, or ``inactivity_timeout`` without a reply. A reply
        below the requested start is ignored (it can only be a stray from an earlier request).
        """
        try:
            await self.socket.send_multipart([b"", attempt.start.to_bytes(8, "big")])
            while True:
                with trio.move_on_after(self.inactivity_timeout) as idle:
                    frames = await self.socket.recv_multipart()
                if idle.cancelled_caught:
                    attempt.error = "replay inactivity timeout"
                    return
                try:
                    message = decode(frames, replay=True, max_payload_bytes=self.max_payload_bytes)
                except WireDecodeError as exc:
                    attempt.error = f"malformed replay reply: {exc}"
                    return
                if message is None:
                    attempt.complete = True
                    return
                if message.seq >= attempt.start:
                    attempt.messages.append(message)
        finally:
            if not attempt.complete:
                self._reconnect()


class _Pipeline:
    """Everything after sequencing: sans-IO apart from the coordinator handle's non-blocking admit."""

    def __init__(
        self, attachment: Attachment, kv_block_size: int, coordinator: CoordinatorHandle, stats: ListenerCounters
    ) -> None:
        self.generation = attachment.generation
        self.rank = attachment.worker.dp_rank
        self.coordinator = coordinator
        self.stats = stats
        self.normalizer = AttachmentNormalizer(
            kv_block_size=kv_block_size,
            worker=attachment.worker,
            ingress_protocol=attachment.source.ingress_protocol,
            image_token_id=attachment.source.image_token_id,
            video_token_id=attachment.source.video_token_id,
        )

    def process(self, message: RawMessage) -> None:
        batch_rank = message.batch.data_parallel_rank or 0
        if batch_rank != self.rank:
            raise ListenerError(f"vLLM batch rank {batch_rank} does not match configured rank {self.rank}")
        normalized = self.normalizer.normalize(message.batch)
        stats = self.stats
        stats.batches += 1
        stats.unpublished_blocks += normalized.unpublished_blocks
        for reason, count in normalized.filtered.items():
            stats.filtered[reason] = stats.filtered.get(reason, 0) + count
        try:
            chunks = build_ingress_chunks(self.generation, message.seq, normalized)
        except ChunkingError as exc:
            raise ListenerError(str(exc)) from exc
        admit = self.coordinator.admit_nowait
        try:
            for chunk in chunks:
                admit(chunk)
        except KvAgentError as exc:
            raise ListenerError(exc.message) from exc


class _Listener:
    def __init__(
        self,
        *,
        attachment: Attachment,
        kv_block_size: int,
        coordinator: CoordinatorHandle,
        status: StatusCell,
        options: ListenerOptions,
        stats: ListenerCounters,
        sub: TrioSocket,
        replay: ReplayClient | None,
    ) -> None:
        self.generation = attachment.generation
        self.coordinator = coordinator
        self.status = status
        self.options = options
        self.stats = stats
        self.sub = sub
        self.replay = replay
        self.pipeline = _Pipeline(attachment, kv_block_size, coordinator, stats)
        self.gate = SequenceGate()
        # Live frames received but not yet processed: the reorder buffer while a replay runs. Arrival order
        # is seq order within one publisher process (and keeps an in-place restart recognisable).
        self.pending: collections.deque[list[bytes]] = collections.deque()

    async def run(self) -> None:
        if self.replay is not None and self.options.cold_bootstrap:
            await self._bootstrap()
        clock = time.perf_counter
        while True:
            if not self.pending:
                self.pending.extend(await self._receive(self.options.batch_messages))
            slice_end = clock() + SLICE_SECONDS
            while self.pending:
                await self._on_live(self.pending.popleft())
                if self.pending and clock() >= slice_end:
                    # A burst is handled in slices, so the coordinator and recovery requests on the same
                    # event loop get their turn every millisecond or so.
                    await trio.lowlevel.checkpoint()
                    slice_end = clock() + SLICE_SECONDS

    async def _receive(self, max_messages: int) -> list[list[bytes]]:
        try:
            return await self.sub.recv_multipart_batch(max_messages)
        except zmq.ZMQError as exc:
            raise ListenerError(f"ZMQ receive failed: {exc}") from exc

    def _check_ready(self) -> None:
        if not self.status.get().is_ready_generation(self.generation):
            raise _NotReady()

    def _apply(self, message: RawMessage) -> None:
        self.pipeline.process(message)
        self.gate.mark_applied(message.seq)

    async def _lose(self, lost: int, why: str) -> None:
        log.warning("vllm_source_lost_batches", generation=self.generation, batches=lost, reason=why)
        self.stats.lost_batches += lost
        try:
            await self.coordinator.report_source_loss(self.generation, lost)
        except KvAgentError as exc:
            raise ListenerError(exc.message) from exc

    async def _on_live(self, frames: list[bytes]) -> None:
        self._check_ready()
        self.stats.messages += 1
        try:
            message = decode(frames, max_payload_bytes=self.options.max_payload_bytes)
        except WireDecodeError as exc:
            self.stats.decode_errors += 1
            raise ListenerError(f"failed to decode framework KV event batch: {exc}") from exc
        gate = self.gate
        decision = gate.classify(message.seq)
        if decision is SeqDecision.DUPLICATE:
            self.stats.duplicates += 1
            return
        if decision is SeqDecision.RESTART:
            # The coordinator sees the cursor regress and publishes its own reset barrier.
            self.stats.restarts_seen += 1
            log.warning("vllm_engine_restarted_in_place", generation=self.generation, seq=message.seq)
            if message.seq > 0:
                # The new incarnation's first batches went by before the SUB reconnected: its history
                # starts at 0, so that is a gap like any other (repaired from its fresh replay buffer).
                gate.expect(0)
                decision = SeqDecision.GAP
        if decision is SeqDecision.GAP:
            expected = gate.expected()
            assert expected is not None  # a gap needs something applied before it
            self.stats.gaps += 1
            if self.replay is not None:
                await self._apply_replay(await self._fetch(expected))
                if gate.classify_replayed(message.seq) is SeqDecision.DUPLICATE:
                    self.stats.duplicates += 1  # the replay already carried this batch
                    return
            hole_start = gate.expected()
            assert hole_start is not None
            if hole_start < message.seq:
                await self._lose(message.seq - hole_start, "unrepaired seq gap")
                gate.expect(message.seq)
        self._apply(message)

    async def _bootstrap(self) -> None:
        """Cold attach: apply the engine's whole replay buffer first."""
        attempt = await self._fetch(0)
        if attempt.messages or attempt.complete:
            self.gate.expect(0)
        else:
            log.warning("vllm_cold_attach_replay_empty", generation=self.generation, error=attempt.error)
        await self._apply_replay(attempt)

    async def _apply_replay(self, attempt: ReplayAttempt) -> None:
        gate = self.gate
        for message in attempt.messages:
            self._check_ready()
            decision = gate.classify_replayed(message.seq)
            if decision is SeqDecision.DUPLICATE:
                continue
            if decision is SeqDecision.GAP:
                expected = gate.expected()
                assert expected is not None
                why = "replay started late" if message is attempt.messages[0] else "replay skipped batches"
                await self._lose(message.seq - expected, why)
            self._apply(message)
            self.stats.repaired_batches += 1
        if not attempt.complete:
            log.warning(
                "vllm_replay_incomplete", generation=self.generation, start=attempt.start, error=attempt.error
            )

    async def _fetch(self, start: int) -> ReplayAttempt:
        """Run one replay request while live messages collect in the reorder buffer."""
        replay = self.replay
        assert replay is not None
        attempt = ReplayAttempt(start)
        capacity = self.options.reorder_capacity
        done = trio.CancelScope()  # whichever side finishes first ends the other

        async def fetch() -> None:
            await replay.fetch(attempt)
            done.cancel()

        async def buffer_live() -> None:
            # This task owns the SUB only while the replay runs; the listener task is waiting here.
            while len(self.pending) < capacity:
                room = min(self.options.batch_messages, capacity - len(self.pending))
                self.pending.extend(await self._receive(room))
            self.stats.reorder_overflows += 1
            attempt.error = f"reorder buffer full ({capacity} live batches)"
            done.cancel()

        try:
            with done:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(fetch)
                    nursery.start_soon(buffer_live)
        except* ListenerError as group:
            # Only buffer_live raises it (a failed SUB receive): end the listener with that message.
            raise group.exceptions[0] from None
        return attempt


def _open_sockets(
    context: zmq.Context[Any], attachment: Attachment, options: ListenerOptions
) -> tuple[TrioSocket, ReplayClient | None]:
    """The SUB connected and subscribed to the attachment's topic, and a replay client if it has an endpoint."""
    source = attachment.source
    sub_socket = context.socket(zmq.SUB)
    sub_socket.setsockopt(zmq.RCVHWM, options.rcvhwm)
    sub_socket.setsockopt(zmq.LINGER, 0)
    sub = TrioSocket(sub_socket)
    try:
        sub_socket.connect(source.endpoint)
        sub_socket.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        replay = None
        if source.replay_endpoint:
            replay = ReplayClient(
                context,
                source.replay_endpoint,
                inactivity_timeout=options.replay_timeout,
                max_payload_bytes=options.max_payload_bytes,
            )
    except BaseException:
        sub.close()
        raise
    return sub, replay


async def run_listener(
    *,
    attachment: Attachment,
    kv_block_size: int,
    coordinator: CoordinatorHandle,
    status: StatusCell,
    options: ListenerOptions = ListenerOptions(),
    zmq_context: zmq.Context[Any] | None = None,
    stats: ListenerCounters | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen to one attachment until cancelled or failed; a failure ends in a quarantine of its generation.

    ``stats`` is the counters object the caller reads (a fresh one if not given).
    """
    context = zmq_context if zmq_context is not None else zmq.Context.instance()
    stats = stats if stats is not None else ListenerCounters()
    generation = attachment.generation
    sub, replay = _open_sockets(context, attachment, options)
    task_status.started()
    error: str | None = None
    try:
        listener = _Listener(
            attachment=attachment,
            kv_block_size=kv_block_size,
            coordinator=coordinator,
            status=status,
            options=options,
            stats=stats,
            sub=sub,
            replay=replay,
        )
        await listener.run()
    except _NotReady:
        log.info("listener_stopping", generation=generation, reason="attachment no longer ready")
    except ListenerError as exc:
        error = str(exc)
    except Exception as exc:  # any other failure still ends in a quarantine, never a silent stop
        log.exception("listener_crashed", generation=generation)
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sub.close()
        if replay is not None:
            replay.close()
    if error is not None:
        log.warning("listener_failed", generation=generation, error=error)
    with trio.move_on_after(QUARANTINE_TIMEOUT, shield=True):
        try:
            await coordinator.quarantine(generation, LISTENER_TERMINATED)
        except KvAgentError as exc:
            log.warning("listener_quarantine_failed", generation=generation, error=str(exc))
