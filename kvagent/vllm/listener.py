"""The per-attachment vLLM listener: SUB socket → decode → rank check → normalize → chunk → coordinator.

Admission never waits on the coordinator (``CoordinatorHandle.admit`` is a non-blocking send on an
unbounded channel; memory stays bounded because the coordinator drains much faster than one engine
publishes, and the SUB's RCVHWM bounds what the engine can queue). If the listener ends on its own — an
error, the stream ending, or the attachment no longer being ready — it quarantines its generation with
``"framework listener terminated"``; cancelled from outside, it just stops.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio
import zmq

from kvagent.coordinator_task import CoordinatorHandle
from kvagent.errors import KvAgentError
from kvagent.events import MAX_RAW_PAYLOAD_BYTES
from kvagent.status import Attachment, StatusCell
from kvagent.vllm.normalize import AttachmentNormalizer, ChunkingError, build_ingress_chunks
from kvagent.vllm.replay import ReplayClient, SeqDecision, SequenceGate
from kvagent.vllm.wire import RawMessage, WireDecodeError, decode_frames
from kvagent.zmqtrio import TrioSocket

__all__ = ["ListenerError", "ListenerOptions", "ListenerStats", "run_listener"]

log = logging.getLogger(__name__)

LISTENER_TERMINATED = "framework listener terminated"


class ListenerError(Exception):
    """A condition that ends the listener (and so quarantines its attachment)."""


@attrs.frozen(slots=True)
class ListenerOptions:
    rcvhwm: int = 1_000_000
    batch_messages: int = 256
    replay_timeout: float = 5.0
    cold_bootstrap: bool = True
    max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES


@attrs.define
class ListenerStats:
    messages: int = 0
    batches: int = 0
    decode_errors: int = 0
    gaps: int = 0
    repaired_batches: int = 0
    lost_batches: int = 0
    restarts_seen: int = 0
    duplicates: int = 0
    filtered: dict[str, int] = attrs.Factory(dict)
    unpublished_blocks: int = 0


class _Pipeline:
    """Everything after the socket: sans-IO apart from the coordinator handle's non-blocking admit."""

    def __init__(
        self, attachment: Attachment, kv_block_size: int, coordinator: CoordinatorHandle, stats: ListenerStats
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
        admit = self.coordinator.admit
        try:
            for chunk in chunks:
                admit(chunk)
        except KvAgentError as exc:
            raise ListenerError(exc.message) from exc


async def run_listener(
    *,
    attachment: Attachment,
    kv_block_size: int,
    coordinator: CoordinatorHandle,
    status: StatusCell,
    options: ListenerOptions = ListenerOptions(),
    zmq_context: zmq.Context[Any] | None = None,
    stats: ListenerStats | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    context = zmq_context if zmq_context is not None else zmq.Context.instance()
    stats = stats if stats is not None else ListenerStats()
    generation = attachment.generation
    source = attachment.source
    sub_socket = context.socket(zmq.SUB)
    sub_socket.setsockopt(zmq.RCVHWM, options.rcvhwm)
    sub_socket.setsockopt(zmq.LINGER, 0)
    sub_socket.connect(source.endpoint)
    sub_socket.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
    sub = TrioSocket(sub_socket)
    replay: ReplayClient | None = None
    if source.replay_endpoint:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(source.replay_endpoint)
        replay = ReplayClient(
            TrioSocket(dealer),
            inactivity_timeout=options.replay_timeout,
            max_payload_bytes=options.max_payload_bytes,
        )
    pipeline = _Pipeline(attachment, kv_block_size, coordinator, stats)
    gate = SequenceGate()
    task_status.started()
    error: str | None = None
    try:
        if replay is not None and options.cold_bootstrap:
            await _bootstrap(replay, pipeline, gate, coordinator, generation, stats)
        while True:
            messages = await sub.recv_multipart_batch(options.batch_messages)
            for frames in messages:
                if not status.get().is_ready_generation(generation):
                    raise ListenerError("attachment is no longer ready")
                stats.messages += 1
                try:
                    message = decode_frames(frames, max_payload_bytes=options.max_payload_bytes)
                except WireDecodeError as exc:
                    stats.decode_errors += 1
                    raise ListenerError(f"failed to decode framework KV event batch: {exc}") from exc
                decision = gate.classify(message.seq)
                if decision is SeqDecision.DUPLICATE:
                    stats.duplicates += 1
                    continue
                if decision is SeqDecision.RESTART:
                    stats.restarts_seen += 1
                    log.warning(
                        "vLLM seq went back from %s to %d: engine restarted in place", gate.last, message.seq
                    )
                elif decision is SeqDecision.GAP:
                    stats.gaps += 1
                    await _repair_gap(replay, pipeline, gate, coordinator, generation, stats, message.seq)
                pipeline.process(message)
                gate.applied(message.seq)
    except ListenerError as exc:
        error = str(exc)
    except Exception as exc:  # any other failure still ends in a quarantine, never a silent stop
        log.exception("vLLM KV listener crashed")
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sub.close()
        if replay is not None:
            replay.socket.close()
    log.warning("vLLM KV listener failed (generation %d): %s", generation, error)
    with trio.move_on_after(5, shield=True):
        try:
            await coordinator.quarantine(generation, LISTENER_TERMINATED)
        except KvAgentError as exc:
            log.warning("listener could not quarantine generation %d: %s", generation, exc)


async def _bootstrap(
    replay: ReplayClient,
    pipeline: _Pipeline,
    gate: SequenceGate,
    coordinator: CoordinatorHandle,
    generation: int,
    stats: ListenerStats,
) -> None:
    """Cold attach: apply the engine's whole replay buffer first, so earlier blocks are not missing."""
    outcome = await replay.fetch(0)
    if not outcome.complete and not outcome.messages:
        log.warning("cold-attach replay gave nothing (%s); starting from the live stream", outcome.error)
        return
    for message in outcome.messages:
        pipeline.process(message)
        gate.applied(message.seq)
        stats.repaired_batches += 1
    if outcome.messages:
        gate.replayed_through(outcome.messages[-1].seq)
    if outcome.first_seq is not None and outcome.first_seq > 0:
        stats.lost_batches += outcome.first_seq
        await coordinator.report_source_loss(generation, outcome.first_seq)


async def _repair_gap(
    replay: ReplayClient | None,
    pipeline: _Pipeline,
    gate: SequenceGate,
    coordinator: CoordinatorHandle,
    generation: int,
    stats: ListenerStats,
    seq: int,
) -> None:
    expected = gate.expected()
    assert expected is not None
    missing = seq - expected
    repaired = 0
    if replay is not None:
        outcome = await replay.fetch(expected, stop_before=seq)
        next_seq = expected
        for message in outcome.messages:
            if message.seq != next_seq:
                break  # only a contiguous prefix can be applied in order
            pipeline.process(message)
            gate.applied(message.seq)
            next_seq += 1
            repaired += 1
        stats.repaired_batches += repaired
        if repaired < missing:
            log.warning(
                "replay repaired %d of %d missing vLLM batches from seq %d (%s)",
                repaired,
                missing,
                expected,
                outcome.error or "replay started late",
            )
    lost = missing - repaired
    if lost:
        stats.lost_batches += lost
        await coordinator.report_source_loss(generation, lost)
