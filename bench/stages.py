"""The per-stage breakdown of the ingest (issue #34): CPU µs per event of each stage, in process, on the trace.

``kvagent serve`` runs every stage on one event loop, so its CPU per event is one number. Here each stage
runs alone over the same pre-encoded trace the side-by-side figure sends, with the parts kvagent uses
(no Trio, no HTTP), and is timed with this thread's CPU clock:

- **read**: every message received from a SUB on loopback TCP (the reader's drain loop, frame by frame;
  libzmq's own I/O thread is not counted);
- **native ingest**: the listener's per-batch work without Trio: the frames split, the payload digest,
  ``AttachmentNormalizer.normalize_payload`` (the compiled pass) and the chunking;
- **coordinator**: ``SlotCoordinator.handle_ingress`` of every chunk with an index that stores nothing
  (continuity, dedup, coalescing, outbound ids, the RouterEvents, status);
- **index**: ``RecoveryIndex.apply_run`` of the stamped events, minus the ring below;
- **ring**: the same events appended to a ring of the default capacity one by one (``EventRing.append``;
  the compiled apply_run appends a run at once, so this overstates the ring and understates the index);
- **persistence**: the writer's appends (``encode_ring_batch`` from the ring's retained columns and the
  SQLite transaction) in the 2,000-event groups a 20 ms flush takes at 100k events/s;
- **sinks**: ``encode_router_events`` of the outbound chunks (only with ``--publish``; default serve has
  no sink).

What serve spends beyond their sum is the Trio shell: the tasks, the inbox and channels, SourceSync, the
slices and checkpoints, status and HTTP polling.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq
from xxhash import xxh3_64_intdigest

from bench.agent_run import BLOCK_SIZE, WORKER_ID, owner
from bench.trace import TOPIC, build_trace

STAGES = ("read", "native ingest", "coordinator", "index", "ring", "persistence", "sinks")
FLUSH_EVENTS = 2_000


class _NoIndex:
    """An index that stores nothing (the coordinator stage alone); it keeps the stamped events."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.runs: list[Sequence[Any]] = []

    def apply(self, event: Any) -> None:
        self.events.append(event)

    def apply_run(self, events: Sequence[Any]) -> list[tuple[int, Exception]]:
        self.runs.append(events)
        return []

    def current_event_id(self) -> int:
        return self.events[-1].event_id if self.events else 0


def _cpu(work: Callable[[], object]) -> float:
    start = time.thread_time()
    work()
    return time.thread_time() - start


def _read(payloads: list[bytes]) -> float:
    """CPU seconds of receiving every payload from a SUB (sent beforehand into libzmq's queues)."""
    context = zmq.Context()
    try:
        pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
        for sock in (pub, sub):
            sock.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        while True:  # the slow joiner: wait until a probe arrives
            pub.send_multipart([b"probe", b"", b""])
            if sub.poll(100):
                while sub.poll(50):
                    sub.recv_multipart()
                break
        for seq, payload in enumerate(payloads):
            pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload], copy=False)
        received = 0
        recv, more = sub.recv, sub.get  # the reader's loop (kvagent/vllm/reader.py's _drain)
        nonblock, rcvmore = int(zmq.NOBLOCK), int(zmq.RCVMORE)
        start = time.thread_time()
        while received < len(payloads):
            try:
                frames = [recv(nonblock)]
                while more(rcvmore):
                    frames.append(recv(nonblock))
            except zmq.Again:
                sub.poll(1000)
                continue
            _ = sum(map(len, frames))
            received += 1
        return time.thread_time() - start
    finally:
        context.destroy(linger=0)


def breakdown(batches: int = 20_000) -> dict[str, Any]:
    """µs per event of each stage over a trace of ``batches`` batches (see the module docstring)."""
    from kvagent._util.gcutil import gc_paused
    from kvagent.coordinator.machine import SlotCoordinator
    from kvagent.coordinator.task import DRAIN_CHUNKS
    from kvagent.index.recovery_index import DEFAULT_RING_CAPACITY, RecoveryIndex
    from kvagent.index.ring import EventRing
    from kvagent.model.events import WorkerWithDpRank
    from kvagent.model.ids import KvStateAgentIdentity
    from kvagent.model.status import Attachment, AttachmentSource
    from kvagent.persist.columns import encode_ring_batch
    from kvagent.persist.records import SlotIdentityRecord
    from kvagent.persist.store import SlotStore
    from kvagent.vllm.decode import split_live_frames
    from kvagent.vllm.normalize import AttachmentNormalizer, build_ingress_chunks
    from kvagent.wire.router_event import encode_router_events

    payloads, stats = build_trace(batches)
    events = stats.events
    seconds: dict[str, float] = {"read": _read(payloads)}

    worker = WorkerWithDpRank(WORKER_ID, 0)
    identity = KvStateAgentIdentity(owner(), 42)
    request = Attachment(
        worker=worker,
        source=AttachmentSource(endpoint="tcp://bench", topic="kv-events"),
        producer_instance="bench/producer",
        intent_incarnation=1,
    )

    def coordinator(index: Any) -> tuple[SlotCoordinator, int]:
        core = SlotCoordinator(
            identity=identity,
            slot_rank=0,
            index=index,
            sink=_NullSink(),
            on_status=lambda status: None,
            request_withdrawal=lambda generation: None,
        )
        return core, core.attach(request).generation

    _, generation = coordinator(_NoIndex())
    normalizer = AttachmentNormalizer(kv_block_size=BLOCK_SIZE, worker=worker)
    messages = [[TOPIC, seq.to_bytes(8, "big"), payload] for seq, payload in enumerate(payloads)]
    chunks: list[Any] = []

    def ingest() -> None:
        for frames in messages:
            _, seq, payload = split_live_frames(frames)
            digest = xxh3_64_intdigest(payload)
            _, normalized = normalizer.normalize_payload(payload, max_payload_bytes=1 << 24)
            assert normalized is not None
            chunks.extend(
                build_ingress_chunks(generation, seq, normalized, raw_bytes=len(payload), source_digest=digest)
            )

    seconds["native ingest"] = _cpu(ingest)

    stamped = _NoIndex()
    core, _ = coordinator(stamped)
    def coordinate() -> None:
        for first in range(0, len(chunks), DRAIN_CHUNKS):  # as the coordinator task drains
            with core.ingress_batch():
                for chunk in chunks[first : first + DRAIN_CHUNKS]:
                    core.handle_ingress(chunk)

    seconds["coordinator"] = _cpu(coordinate)
    runs = [list(run) for run in stamped.runs]
    applied = sum(map(len, runs))

    index = RecoveryIndex(BLOCK_SIZE)
    index.retain_applied(True)  # as with persistence on: the writer trails the ring
    index_and_ring = _cpu(lambda: [index.apply_run(run) for run in runs])
    ring = EventRing(DEFAULT_RING_CAPACITY)
    flat = [event for run in runs for event in run]
    def append() -> None:
        for event in flat:
            ring.append(event)

    seconds["ring"] = _cpu(append)
    seconds["index"] = max(0.0, index_and_ring - seconds["ring"])

    with tempfile.TemporaryDirectory() as directory:
        store = SlotStore.open(Path(directory) / "bench.sqlite3")
        store.initialize(SlotIdentityRecord("bench", 42, str(owner())), 1 << 62, 1)

        # One append per flush: what was applied since the last, a flush's worth at a time.
        index_flush = RecoveryIndex(BLOCK_SIZE)
        index_flush.retain_applied(True)
        per_flush = FLUSH_EVENTS // 8
        persist_seconds = 0.0
        persisted = 0
        for first in range(0, len(runs), per_flush):
            for run in runs[first : first + per_flush]:
                index_flush.apply_run(run)
            start = time.thread_time()
            pieces = index_flush.applied_after(persisted)
            with gc_paused():  # as the writer does
                body, ids = encode_ring_batch(pieces)
            store.append_encoded(ids, body, None)
            persisted = ids[-1]
            index_flush.release_applied_through(persisted)
            persist_seconds += time.thread_time() - start
        seconds["persistence"] = persist_seconds
        store.close()

    seconds["sinks"] = _cpu(lambda: [encode_router_events(run) for run in runs])
    per_event = {stage: 1e6 * seconds[stage] / events for stage in STAGES}
    return {
        "batches": batches,
        "events": events,
        "applied": applied,
        "us_per_event": per_event,
        "total_us_per_event": sum(per_event.values()) - per_event["sinks"],
    }


class _NullSink:
    def publish(self, events: Sequence[Any]) -> None:
        return None


def format_breakdown(result: dict[str, Any], serve_us: float | None = None) -> str:
    """One line per stage, and what serve spends beyond their sum (its Trio shell) when given."""
    per_event = result["us_per_event"]
    lines = [f"per-stage CPU, in process, {result['events']} events ({result['batches']} batches):"]
    lines += [f"  {stage:<14} {per_event[stage]:6.2f} µs/event" for stage in STAGES]
    lines.append(f"  {'sum (no sink)':<14} {result['total_us_per_event']:6.2f} µs/event")
    if serve_us is not None:
        shell = serve_us - result["total_us_per_event"]
        lines.append(f"  {'serve, measured':<14} {serve_us:6.2f} µs/event -> Trio shell and the rest {shell:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_breakdown(breakdown()))
