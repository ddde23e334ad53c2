"""The per-attachment vLLM listener: SUB → inbox → SourceSync → decode → normalize → chunk → coordinator.

Three tasks per attachment generation, each owning its socket:

- the **reader** (:class:`~kvagent.vllm.reader.LiveReader`) drains the SUB into the byte-counted inbox,
  watches the SUB's monitor for the engine's connection dropping and coming back, and sheds (drops what
  is queued and re-opens the SUB) rather than hold more than its share of the ingest budget
  (:class:`~kvagent.vllm.budget.IngestBudget`);
- the **replay client** (:class:`~kvagent.vllm.replay.ReplayClient`, with a replay endpoint) streams the
  replies of one request at a time into the inbox;
- the **processor** (here) takes the inbox in order and feeds :class:`~kvagent.vllm.sequence.SourceSync`,
  the sans-IO judge of the engine's history, whose actions it executes: ``Apply`` decodes, checks the
  rank, normalizes and admits the chunks (each batch's payload bytes charged to them); ``Signal`` admits a
  :class:`~kvagent.model.events.SourceSignal` in order with the chunks (ready / degraded / disconnected,
  Worker reset, counted loss); ``RequestReplay`` / ``CancelReplay`` go to the replay client. Before every
  batch it waits while the coordinator's queue holds more than its share of the budget.

A payload is decoded only when SourceSync lets it apply, so what the listener holds is raw bytes, counted
exactly. Batches are handled in slices of about a millisecond, so the coordinator and recovery requests on
the same event loop are never kept waiting longer.

The listener runs while its attachment generation is open (also while degraded or disconnected). If it
ends on its own — a malformed frame, a rank mismatch, a closed coordinator, the attachment no longer
open — it admits a terminal ``SourceSignal(quarantine=True)`` after everything it applied, so every valid
batch before a malformed one is kept; cancelled from outside, it just stops.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import attrs
import structlog
import trio
import zmq
from xxhash import xxh3_64_intdigest

from kvagent._util.sync import checkpoint
from kvagent.coordinator.signals import LISTENER_TERMINATED
from kvagent.coordinator.task import CoordinatorHandle, StatusCell
from kvagent.model.errors import ChunkingError, KvAgentError, ListenerError, WireDecodeError
from kvagent.model.events import MAX_RAW_PAYLOAD_BYTES, SourceSignal
from kvagent.model.options import at_least, format_bytes, in_range, option, positive
from kvagent.model.status import Attachment
from kvagent.vllm.budget import IngestBudget
from kvagent.vllm.decode import split_live_frames
from kvagent.vllm.normalize import AttachmentNormalizer, build_ingress_chunks
from kvagent.vllm.reader import SLICE_SECONDS, Inbox, LinkItem, LiveItem, LiveReader, ReplayEndItem, ReplyItem
from kvagent.vllm.replay import ReplayClient, ReplayTimeouts
from kvagent.vllm.sequence import (
    Action,
    Apply,
    CancelReplay,
    RequestReplay,
    Signal,
    SourceSync,
    SyncStatistics,
)

__all__ = [
    "LISTENER_TERMINATED",
    "ListenerCounters",
    "ListenerError",
    "ListenerOptions",
    "ListenerStatistics",
    "ReplayClient",
    "run_listener",
]

log = structlog.get_logger(__name__)

DECODE_FAILED = "failed to decode framework KV event batch"
MiB = 1 << 20

# What SourceSync carries for the shell between on_live/on_replay_reply and Apply: (topic, raw payload,
# payload digest); the digest goes on the batch's chunks as its resume point (issue #17).
_Batch = tuple[bytes, bytes, int]

_positive = attrs.validators.gt(0)
_positive_seconds = attrs.validators.gt(0.0)


@attrs.frozen(slots=True)
class ListenerOptions:
    """How one listener reads its engine.

    ``ingress_bytes`` bounds the raw payload bytes between the SUB and the coordinator; :attr:`budget`
    (an :class:`~kvagent.vllm.budget.IngestBudget`) splits it between the listener and the coordinator's
    queue.
    ``rcvhwm`` bounds libzmq's own queue in messages; the reader keeps it short anyway, and at ~10 KB per
    typical vLLM batch 1000 messages are well under the budget (0 is libzmq's "no limit").
    """

    rcvhwm: int = option(
        1000,
        help="the engine SUB's receive high-water mark in messages (the listener fits it lower for large "
        "messages; 0: libzmq's no limit)",
        check=in_range(0, (1 << 31) - 1),
    )
    # A replay attempt: the wait for its first reply, the wait between replies, and its whole duration.
    replay_timeout: float = attrs.field(default=5.0, validator=_positive_seconds)
    replay_idle_timeout: float = attrs.field(default=0.5, validator=_positive_seconds)
    replay_total_timeout: float = attrs.field(default=60.0, validator=_positive_seconds)
    reorder_window: int = attrs.field(default=8, validator=attrs.validators.ge(0))
    reorder_wait: float = attrs.field(default=0.05, validator=attrs.validators.ge(0.0))
    cold_bootstrap: bool = True
    max_payload_bytes: int = attrs.field(default=MAX_RAW_PAYLOAD_BYTES, validator=_positive)
    # The budget's rule (each share holds two of the largest payloads) needs max_payload_bytes too: it is
    # checked by IngestBudget in __attrs_post_init__ (kvagent serve says it in the operator's units).
    ingress_bytes: int = option(
        64 * MiB,
        toml="ingest_budget",
        help="bytes of raw engine payloads a slot holds between its SUB and its index (like 64MiB); past "
        "it the listener sheds (docs/configuration.md, 'The ingest budget')",
        flags=("--ingest-budget",),
        metavar="BYTES",
        check=positive,
        default_text=format_bytes(64 * MiB),
    )
    # Over its share of the budget the reader first stops reading: a burst then waits in libzmq's queue and
    # the engine's send queue (vLLM's SNDHWM is 100k messages) instead of being dropped, and it sheds only if
    # the slot makes no room for this long (docs/configuration.md, "The ingest budget").
    shed_after: float = option(
        5.0,
        help="over the ingest budget, stop reading the engine for up to this many seconds before shedding "
        "(0: shed at once; inf: never shed)",
        flags=("--shed-after",),
        metavar="SECONDS",
        parse=float,
        check=at_least(0, " seconds (0: shed at once, inf: never)"),
    )
    # No engine handshake on the SUB within this many seconds: one WARNING naming the endpoint (reader.py).
    connect_warning_after: float = attrs.field(default=3.0, validator=_positive_seconds)
    # After a drain that emptied the SUB, wait up to this long before reading again. Under a steady stream
    # the reader, processor and coordinator then wake once per window with several batches instead of once
    # per batch (docs/performance.md: paced CPU); a batch after a quiet spell is still read at once.
    coalesce_window: float = option(
        0.02,
        help="under a steady event stream, read the engine's batches together once per this window, or "
        "sooner when they would fill libzmq's queue (0: wake for every batch; a batch after a quiet spell "
        "is read at once)",
        flags=("--coalesce-window",),
        metavar="SECONDS",
        parse=float,
        check=in_range(0, 1, " seconds"),
    )

    def __attrs_post_init__(self) -> None:
        IngestBudget(self.ingress_bytes, self.max_payload_bytes)  # raises unless each share holds 2 batches

    @property
    def budget(self) -> IngestBudget:
        """``ingress_bytes`` and how it is split (kvagent/vllm/budget.py owns the arithmetic)."""
        return IngestBudget(self.ingress_bytes, self.max_payload_bytes)

    @property
    def replay_timeouts(self) -> ReplayTimeouts:
        return ReplayTimeouts(self.replay_timeout, self.replay_idle_timeout, self.replay_total_timeout)


@attrs.frozen(slots=True)
class ListenerStatistics:
    """A snapshot of one listener's counters (all since the listener started).

    Attributes:
        messages: live messages received from the SUB socket.
        batches: batches normalized and admitted (live and replayed).
        decode_errors: messages that failed to decode (each ends the listener).
        gaps: sequence gaps detected in the live stream.
        repaired_batches: batches applied from replay replies.
        lost_batches: batches that can never be applied (reported to the coordinator as source loss).
        restarts_seen: confirmed new engine incarnations (in place, or found on reconnect).
        duplicates: live batches dropped because the same bytes were already applied.
        shed_held_batches: batches SourceSync held (reorder window, replay) and dropped when the listener shed.
        filtered: events dropped by normalization, by reason.
        unpublished_blocks: stored blocks normalization could not publish (block size or missing tokens).
        late_batches: batches that arrived out of order and still applied in order (within the reorder window).
        resets: Worker resets signalled (history lost, or a new engine).
        degradations: times the source went degraded.
        engine_disconnects / reconnects: the engine's connection dropping and coming back (SUB monitor).
        replay_requests / replay_replies: replay requests sent and replies received.
        ingest_sheds / ingest_shed_bytes: times the listener dropped its queued batches to stay under its byte bound.
        held_bytes: payload bytes the listener holds now (inbox and SourceSync), a gauge.
    """

    messages: int
    batches: int
    decode_errors: int
    gaps: int
    repaired_batches: int
    lost_batches: int
    restarts_seen: int
    duplicates: int
    shed_held_batches: int
    filtered: Mapping[str, int]
    unpublished_blocks: int
    late_batches: int = 0
    resets: int = 0
    degradations: int = 0
    engine_disconnects: int = 0
    reconnects: int = 0
    replay_requests: int = 0
    replay_replies: int = 0
    ingest_sheds: int = 0
    ingest_shed_bytes: int = 0
    held_bytes: int = 0


@attrs.define
class ListenerCounters:
    """The listener's own hot-path counters; :meth:`statistics` adds SourceSync's, the reader's and the
    replay client's once the listener runs, and takes a frozen snapshot."""

    messages: int = 0
    batches: int = 0
    decode_errors: int = 0
    filtered: dict[str, int] = attrs.Factory(dict)
    unpublished_blocks: int = 0
    sync: SourceSync[_Batch] | None = None
    reader: LiveReader | None = None
    replay: ReplayClient | None = None

    def statistics(self) -> ListenerStatistics:
        sync = _sync_counts(self.sync.statistics()) if self.sync is not None else dict.fromkeys(_SYNC_NAMES, 0)
        reader, replay = self.reader, self.replay
        held = (self.sync.held_bytes if self.sync is not None else 0) + (
            reader.inbox.nbytes if reader is not None else 0
        )
        return ListenerStatistics(
            messages=self.messages,
            batches=self.batches,
            decode_errors=self.decode_errors,
            filtered=dict(self.filtered),  # a copy: the snapshot never changes afterwards
            unpublished_blocks=self.unpublished_blocks,
            engine_disconnects=reader.engine_disconnects if reader is not None else 0,
            reconnects=reader.reconnects if reader is not None else 0,
            ingest_sheds=reader.ingest_sheds if reader is not None else 0,
            ingest_shed_bytes=reader.ingest_shed_bytes if reader is not None else 0,
            replay_replies=replay.replies if replay is not None else 0,
            held_bytes=held,
            **sync,
        )


# SourceSync's counters the listener reports, under the same names (one name per counter).
_SYNC_NAMES = (
    "gaps",
    "repaired_batches",
    "lost_batches",
    "restarts_seen",
    "duplicates",
    "shed_held_batches",
    "late_batches",
    "resets",
    "degradations",
    "replay_requests",
)


def _sync_counts(stats: SyncStatistics) -> dict[str, int]:
    """SourceSync's counters the listener reports."""
    return {name: getattr(stats, name) for name in _SYNC_NAMES}


class _Stop(Exception):
    """The attachment generation is no longer open: stop (and still quarantine, a no-op by then)."""


class _Processor:
    """Takes the inbox in order, feeds SourceSync and executes its actions (see the module docstring)."""

    def __init__(
        self,
        *,
        attachment: Attachment,
        kv_block_size: int,
        coordinator: CoordinatorHandle,
        status: StatusCell,
        options: ListenerOptions,
        counters: ListenerCounters,
        inbox: Inbox,
        sync: SourceSync[_Batch],
        replay: ReplayClient | None,
    ) -> None:
        self.generation = attachment.generation
        self.rank = attachment.worker.dp_rank
        self.coordinator = coordinator
        self.status = status
        self.options = options
        self.counters = counters
        self.inbox = inbox
        self.sync = sync
        self.replay = replay
        self.coordinator_bound = options.budget.coordinator_bytes
        self.pending_bytes = 0  # payload bytes of Apply actions taken from SourceSync, not yet admitted
        self.normalizer = AttachmentNormalizer(
            kv_block_size=kv_block_size,
            worker=attachment.worker,
            ingress_protocol=attachment.source.ingress_protocol,
            image_token_id=attachment.source.image_token_id,
            video_token_id=attachment.source.video_token_id,
        )
        self._slice_end = 0.0

    async def run(self) -> None:
        sync = self.sync
        sync.start(trio.current_time())
        self._slice_end = time.perf_counter() + SLICE_SECONDS
        while True:
            await self._execute()
            if not self.status.get().is_open_generation(self.generation):
                raise _Stop()
            item = self.inbox.pop()
            if item is None:
                await self._idle()
                continue
            now = trio.current_time()
            self._feed(item, now)
            deadline = sync.deadline
            if deadline is not None and now >= deadline:
                sync.on_timer(now)
            await self._yield_if_slice_over()

    async def _idle(self) -> None:
        """Wait for the inbox, or until SourceSync's deadline (then tell it the time)."""
        deadline = self.sync.deadline
        with trio.move_on_at(math.inf if deadline is None else deadline):
            await self.inbox.wait()
        now = trio.current_time()
        deadline = self.sync.deadline
        if deadline is not None and now >= deadline:
            self.sync.on_timer(now)
        self._slice_end = time.perf_counter() + SLICE_SECONDS

    async def _yield_if_slice_over(self) -> None:
        if time.perf_counter() >= self._slice_end:
            # A burst is handled in slices, so the coordinator and recovery requests on the same event
            # loop get their turn every millisecond or so.
            await checkpoint()
            self._slice_end = time.perf_counter() + SLICE_SECONDS

    # -- input ----------------------------------------------------------------------------------------

    def _feed(self, item: object, now: float) -> None:
        sync = self.sync
        kind = type(item)
        if kind is LiveItem:
            assert isinstance(item, LiveItem)
            self._on_live(item.frames, now)
        elif kind is ReplyItem:
            assert isinstance(item, ReplyItem)
            if self.replay is not None and item.request == self.replay.current_request:
                reply = item.reply
                digest = xxh3_64_intdigest(reply.payload)
                batch = (reply.topic, reply.payload, digest)
                sync.on_replay_reply(reply.seq, digest, len(reply.payload), batch, now)
        elif kind is ReplayEndItem:
            assert isinstance(item, ReplayEndItem)
            if self.replay is not None and item.request == self.replay.current_request:
                if not item.complete:
                    log.info("vllm_replay_incomplete", generation=self.generation, reason=item.reason)
                sync.on_replay_end(item.complete, now)
        elif kind is LinkItem:
            assert isinstance(item, LinkItem)
            if item.connected:
                sync.on_connected(now)
            else:
                sync.on_disconnected(now)

    def _on_live(self, frames: list[bytes], now: float) -> None:
        self.counters.messages += 1
        try:
            topic, seq, payload = split_live_frames(frames)
            if len(payload) > self.options.max_payload_bytes:
                raise WireDecodeError(f"ZMQ payload exceeds {self.options.max_payload_bytes} bytes")
        except WireDecodeError as exc:
            self.counters.decode_errors += 1
            raise ListenerError(f"{DECODE_FAILED}: {exc}") from exc
        digest = xxh3_64_intdigest(payload)
        self.sync.on_live(seq, digest, len(payload), (topic, payload, digest), now)

    # -- actions --------------------------------------------------------------------------------------

    async def _execute(self) -> None:
        # Until none are left: while this awaits room, the reader's shed can add actions (its Signal), which
        # must not wait for the next item to arrive (there may be none: the end of a flood).
        while actions := self.sync.take_actions():
            await self._execute_actions(actions)

    async def _execute_actions(self, actions: list[Action[_Batch]]) -> None:
        self.pending_bytes += sum(len(action.message[1]) for action in actions if type(action) is Apply)
        for action in actions:
            kind = type(action)
            if kind is Apply:
                assert isinstance(action, Apply)
                payload_bytes = len(action.message[1])
                await self._wait_for_coordinator_room()
                self.pending_bytes -= payload_bytes
                self._apply(action.seq, action.message[1], action.message[2])
                self.inbox.space_freed()
                await self._yield_if_slice_over()
            elif kind is Signal:
                assert isinstance(action, Signal)
                self._signal(action)
            elif kind is RequestReplay:
                assert isinstance(action, RequestReplay) and self.replay is not None
                self.replay.request(action.start)
            elif kind is CancelReplay:
                assert self.replay is not None
                self.replay.cancel()

    async def _wait_for_coordinator_room(self) -> None:
        if self.coordinator.ingress_bytes > self.coordinator_bound:
            await self.coordinator.wait_ingress_bytes_at_most(self.coordinator_bound)

    def _signal(self, action: Signal) -> None:
        log.info(
            "vllm_source_signal",
            generation=self.generation,
            state=None if action.state is None else action.state.value,
            reset=action.reset,
            lost_batches=action.lost_batches,
            reason=action.reason,
        )
        signal = SourceSignal(
            self.generation,
            state=action.state,
            reset=action.reset,
            lost_batches=action.lost_batches,
            reason=action.reason,
        )
        try:
            self.coordinator.admit_nowait(signal)
        except KvAgentError as exc:
            raise ListenerError(exc.message) from exc

    def _apply(self, seq: int, payload: bytes, digest: int) -> None:
        """Decode, check, normalize and admit one batch SourceSync let through (in seq order)."""
        try:  # decode, the rank check and normalize: one native pass for a plain batch (normalize.py)
            batch_rank, normalized = self.normalizer.normalize_payload(
                payload, max_payload_bytes=self.options.max_payload_bytes
            )
        except WireDecodeError as exc:
            self.counters.decode_errors += 1
            raise ListenerError(f"{DECODE_FAILED}: {exc}") from exc
        if normalized is None:
            raise ListenerError(f"vLLM batch rank {batch_rank} does not match configured rank {self.rank}")
        counters = self.counters
        counters.batches += 1
        counters.unpublished_blocks += normalized.unpublished_blocks
        for reason, count in normalized.filtered.items():
            counters.filtered[reason] = counters.filtered.get(reason, 0) + count
        try:
            # Every chunk names the batch's digest (the final one's is the coordinator's resume point).
            chunks = build_ingress_chunks(
                self.generation, seq, normalized, raw_bytes=len(payload), source_digest=digest
            )
        except ChunkingError as exc:
            raise ListenerError(str(exc)) from exc
        admit = self.coordinator.admit_nowait
        try:
            for chunk in chunks:
                admit(chunk)
        except KvAgentError as exc:
            raise ListenerError(exc.message) from exc


def _build(
    context: zmq.Context[Any],
    attachment: Attachment,
    kv_block_size: int,
    coordinator: CoordinatorHandle,
    status: StatusCell,
    options: ListenerOptions,
    counters: ListenerCounters,
    resume: tuple[int, int] | None = None,
) -> tuple[LiveReader, ReplayClient | None, _Processor]:
    source = attachment.source
    budget = options.budget
    inbox = Inbox(reply_bytes_bound=budget.reply_bytes)
    sync: SourceSync[_Batch] = SourceSync(
        has_replay=source.replay_endpoint is not None,
        reorder_window=options.reorder_window,
        reorder_wait=options.reorder_wait,
        cold_bootstrap=options.cold_bootstrap,
        resume=resume,
    )
    replay = None
    if source.replay_endpoint:
        replay = ReplayClient(
            context,
            source.replay_endpoint,
            inbox,
            max_payload_bytes=options.max_payload_bytes,
            timeouts=options.replay_timeouts,
        )
    processor = _Processor(
        attachment=attachment,
        kv_block_size=kv_block_size,
        coordinator=coordinator,
        status=status,
        options=options,
        counters=counters,
        inbox=inbox,
        sync=sync,
        replay=replay,
    )

    def shed_held() -> int:
        now = trio.current_time()
        freed = sync.shed(now)
        sync.verify_after_shed(now)  # with replay: ask it what the re-open lost, not wait for a live batch
        inbox.wake()  # SourceSync may have something to do about it
        return freed

    reader = LiveReader(
        context,
        endpoint=source.endpoint,
        topic=source.topic.encode(),
        rcvhwm=options.rcvhwm,
        inbox=inbox,
        budget=budget,
        held_bytes=lambda: sync.held_bytes + processor.pending_bytes,
        shed_held=shed_held,
        shed_after=options.shed_after,
        connect_warning_after=options.connect_warning_after,
        coalesce_window=options.coalesce_window,
        replay_endpoint=source.replay_endpoint,
    )
    counters.sync, counters.reader, counters.replay = sync, reader, replay
    return reader, replay, processor


async def run_listener(
    *,
    attachment: Attachment,
    kv_block_size: int,
    coordinator: CoordinatorHandle,
    status: StatusCell,
    options: ListenerOptions = ListenerOptions(),
    zmq_context: zmq.Context[Any] | None = None,
    stats: ListenerCounters | None = None,
    resume: tuple[int, int] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen to one attachment until cancelled or ended; ending on its own quarantines its generation.

    ``stats`` is the counters object the caller reads (a fresh one if not given). The SUB is connected
    before ``task_status.started()``.  ``resume=(seq, digest)``: a restarted agent's last applied batch of
    this engine (see :meth:`~kvagent.vllm.sequence.SourceSync.start`); the coordinator's attach must have
    been a resumed one.
    """
    context = zmq_context if zmq_context is not None else zmq.Context.instance()
    counters = stats if stats is not None else ListenerCounters()
    generation = attachment.generation
    reader, replay, processor = _build(
        context, attachment, kv_block_size, coordinator, status, options, counters, resume
    )
    reader.open()
    error: str | None = None
    try:
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            if replay is not None:
                nursery.start_soon(replay.run)
            await processor.run()
    except* _Stop:
        log.info("listener_stopping", generation=generation, reason="attachment generation no longer open")
    except* ListenerError as group:
        error = str(group.exceptions[0])
    except* Exception as group:  # any other failure still ends in a quarantine, never a silent stop
        log.error("listener_crashed", generation=generation, exc_info=group.exceptions[0])
        error = f"{type(group.exceptions[0]).__name__}: {group.exceptions[0]}"
    finally:
        reader.close()
        if replay is not None:
            replay.close()
    if error is not None:
        log.warning("listener_failed", generation=generation, error=error)
    _quarantine(coordinator, generation)


def _quarantine(coordinator: CoordinatorHandle, generation: int) -> None:
    """The terminal quarantine, in order after every batch the listener admitted."""
    try:
        coordinator.admit_nowait(SourceSignal(generation, quarantine=True, reason=LISTENER_TERMINATED))
    except KvAgentError as exc:
        log.warning("listener_quarantine_failed", generation=generation, error=str(exc))
