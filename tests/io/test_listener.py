"""The vLLM listener over real ZMQ sockets: admission, source signals in order, gap repair, restarts, the
byte bound and self-termination (against a recording coordinator, and once the real one)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import msgpack
import pytest
import structlog
import trio
import trio.testing

from kvagent.coordinator.machine import SlotCoordinator
from kvagent.coordinator.task import StatusCell, open_coordinator
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.events import IngressChunk, RouterEvent, SourceState
from kvagent.model.ids import KvStateAgentIdentity
from kvagent.model.status import AgentStatus, Attachment, AttachmentStatus
from kvagent.simulator.engine import FakeVllmEngine, block_stored
from kvagent.testing import RecordingSink
from kvagent.vllm.listener import (
    LISTENER_TERMINATED,
    ListenerCounters,
    ListenerOptions,
    ListenerStatistics,
    run_listener,
)
from kvagent.wire.vllm_events import END_SEQ
from tests.support.fakes import RecordingCoordinator, ReplayRouter
from tests.support.ids import IDENTITY, OWNER, ready_attachment, status_for
from tests.support.vectors import load_live

LIVE, REPLAY = load_live()
TOPIC = LIVE[0][0].decode()
WARM = ListenerOptions(cold_bootstrap=False)
DEGRADED, READY = SourceState.DEGRADED, SourceState.READY
GUARD = 10  # seconds: a hang guard only, never a synchronization device


class Harness:
    def __init__(
        self, nursery: trio.Nursery, engine: FakeVllmEngine, coordinator: RecordingCoordinator
    ) -> None:
        self.nursery = nursery
        self.engine = engine
        self.coordinator = coordinator
        self.stats = ListenerCounters()
        self.finished = trio.Event()
        self.status: StatusCell | None = None
        self.attachment: Attachment | None = None

    async def start_listener(
        self,
        *,
        replay_endpoint: str | None = None,
        dp_rank: int = 0,
        options: ListenerOptions = WARM,
    ) -> None:
        self.attachment = ready_attachment(
            self.engine.endpoint, replay_endpoint=replay_endpoint, dp_rank=dp_rank
        )
        self.status = status_for(self.attachment)

        async def run(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            assert self.attachment is not None and self.status is not None
            try:
                await run_listener(
                    attachment=self.attachment,
                    kv_block_size=32,
                    coordinator=self.coordinator.as_handle(),
                    status=self.status,
                    options=options,
                    stats=self.stats,
                    task_status=task_status,
                )
            finally:
                self.finished.set()

        await self.nursery.start(run)
        await self.engine.wait_for_subscriber()

    async def publish_live(self, seqs: range | list[int]) -> None:
        for seq in seqs:
            await self.engine.publish_frames(LIVE[seq])


@asynccontextmanager
async def harness(**engine_options: object) -> AsyncIterator[Harness]:
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            engine = FakeVllmEngine(topic=TOPIC, **engine_options)  # type: ignore[arg-type]
            await nursery.start(engine.run)
            yield Harness(nursery, engine, RecordingCoordinator())
            nursery.cancel_scope.cancel()


async def start_router(h: Harness, **options: object) -> ReplayRouter:
    router = ReplayRouter(REPLAY, **options)  # type: ignore[arg-type]
    await h.nursery.start(router.run)
    return router


def received_through(seq: int) -> Callable[[RecordingCoordinator], bool]:
    return lambda c: seq in c.cursors()


# -- the capture through a real socket ------------------------------------------------------------------


async def test_capture_is_admitted_in_order_with_the_batch_rank_checked() -> None:
    async with harness() as h:
        await h.start_listener()
        await h.publish_live(range(len(LIVE)))
        await h.coordinator.wait_for(lambda c: 67 in c.cursors())
        assert h.coordinator.cursors() == list(range(68))
        assert all(chunk.generation == 1 for chunk in h.coordinator.chunks)
        stats = h.stats.statistics()
        assert stats.messages == 68 and stats.batches == 68 and stats.gaps == 0
        assert sum(chunk.raw_bytes for chunk in h.coordinator.chunks) == sum(len(f[2]) for f in LIVE)
    assert h.coordinator.quarantines == [], "cancelled from outside: no quarantine"


def test_statistics_are_a_frozen_copy_of_the_counters() -> None:
    counters = ListenerCounters(messages=3, batches=2, filtered={"ignored_event": 4}, unpublished_blocks=5)
    snapshot = counters.statistics()
    assert snapshot == ListenerStatistics(
        messages=3,
        batches=2,
        decode_errors=0,
        gaps=0,
        repaired_batches=0,
        lost_batches=0,
        restarts_seen=0,
        duplicates=0,
        shed_held_batches=0,
        filtered={"ignored_event": 4},
        unpublished_blocks=5,
    )
    counters.messages += 1
    counters.filtered["ignored_event"] += 1
    assert (snapshot.messages, snapshot.filtered) == (3, {"ignored_event": 4})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snapshot.messages = 9  # type: ignore[misc]


async def test_a_dropped_live_range_is_repaired_from_the_replay_socket() -> None:
    async with harness() as h:
        router = await start_router(h)
        await h.start_listener(replay_endpoint=router.endpoint)
        await h.publish_live([*range(20), *range(30, 68)])
        await h.coordinator.wait_for(lambda c: 67 in c.cursors())
        # A later live batch is processed after every live batch queued before it.
        await h.engine.publish_frames([LIVE[0][0], (68).to_bytes(8, "big"), LIVE[0][2]])
        await h.coordinator.wait_for(lambda c: 68 in c.cursors())
        assert h.coordinator.cursors() == list(range(69)), "every seq admitted exactly once, in order"
        # The request starts at the last applied seq: its bytes prove the replay comes from the same engine.
        assert router.requests == [19]
        assert h.coordinator.losses == [] and h.coordinator.signals == []
        stats = h.stats.statistics()
        assert stats.gaps == 1 and stats.lost_batches == 0
        assert stats.repaired_batches == 10, "20..29 from the replay; the rest of its answer was cancelled"
    assert h.coordinator.quarantines == []


def capture_replay_pairs() -> list[tuple[int, bytes]]:
    """The capture's ``replay`` lines as the engine's buffer: ``[b"", topic, seq8, payload]`` each."""
    return [(int.from_bytes(f[2], "big"), f[3]) for f in REPLAY if f[2] != END_SEQ]


def resident_set(chunks: list[IngressChunk]) -> frozenset[object]:
    """Replay admitted chunks into a fresh recovery index, as the coordinator would, and read what is resident."""
    index = RecoveryIndex(32)
    event_id = 0
    for chunk in chunks:
        for placement in chunk.events:
            event_id += 1
            index.apply(
                RouterEvent(
                    17,
                    placement.tier,
                    placement.domain,
                    event_id,
                    placement.data,
                    placement.dp_rank,
                    state_source=OWNER,
                    session_id=placement.session_id,
                )
            )
    return frozenset(index.resident_blocks())


async def admitted_without_loss() -> list[IngressChunk]:
    async with harness() as h:
        await h.start_listener()
        await h.engine.publish_frames_sequence(LIVE)
        await h.coordinator.wait_for(received_through(67))
        return list(h.coordinator.chunks)


async def test_the_fake_engine_router_repairs_a_dropped_range_to_the_no_loss_state() -> None:
    reference = await admitted_without_loss()
    async with harness(replay_endpoint="tcp://127.0.0.1:0") as h:
        h.engine.load_replay_buffer(capture_replay_pairs())
        assert h.engine.replay_endpoint is not None
        await h.start_listener(replay_endpoint=h.engine.replay_endpoint)
        await h.engine.publish_frames_sequence([*LIVE[:12], *LIVE[40:]])  # 12..39 lost on the way
        await h.coordinator.wait_for(received_through(67))
        chunks = h.coordinator.chunks
        assert h.coordinator.cursors() == list(range(68)), "each seq admitted once, in order"
        assert h.engine.replay_requests == 1 and h.coordinator.losses == []
        assert [c.events for c in chunks] == [c.events for c in reference]
        resident = resident_set(chunks)
        assert resident and resident == resident_set(reference)


def degraded_with_reset(coordinator: RecordingCoordinator, lost: int) -> bool:
    return [(x.state, x.reset, x.lost_batches) for x in coordinator.signals] == [(DEGRADED, True, lost)]


async def test_a_replay_that_starts_too_late_loses_history_resets_and_degrades() -> None:
    async with harness() as h:
        router = await start_router(h, first_available=25)
        await h.start_listener(replay_endpoint=router.endpoint)
        await h.publish_live([*range(20), *range(30, 68)])
        await h.coordinator.wait_for(lambda c: 67 in c.cursors())
        # Only contiguous history after the reset: what the engine still held (25..), then the live batches.
        assert h.coordinator.cursors() == [*range(20), *range(25, 68)]
        assert h.coordinator.losses == [(1, 5)]
        assert degraded_with_reset(h.coordinator, 5)
        assert h.stats.statistics().lost_batches == 5


async def test_a_silent_replay_server_loses_the_gap_after_its_attempts() -> None:
    async with harness() as h:
        router = await start_router(h, silent=True)
        await h.start_listener(
            replay_endpoint=router.endpoint, options=ListenerOptions(cold_bootstrap=False, replay_timeout=0.3)
        )
        await h.publish_live([*range(5), *range(10, 15)])
        start = trio.current_time()
        await h.coordinator.wait_for(lambda c: 14 in c.cursors())
        assert trio.current_time() - start >= 3 * 0.3
        assert router.requests == [4, 4, 4], "three attempts without progress"
        assert h.coordinator.losses == [(1, 5)]
        assert degraded_with_reset(h.coordinator, 5)
        assert h.coordinator.cursors() == [*range(5), *range(10, 15)]


async def test_a_hole_mid_answer_is_asked_again_and_a_lasting_one_is_lost() -> None:
    async with harness() as h:
        router = await start_router(h, drop_seqs=frozenset({12, 13}))  # HWM drops, on every answer
        await h.start_listener(replay_endpoint=router.endpoint)
        await h.publish_live([*range(10), 20])
        await h.coordinator.wait_for(lambda c: 20 in c.cursors())
        assert router.requests == [9, 12], "the hole is asked again; its answer starts past it: lost"
        assert h.coordinator.cursors() == [*range(12), *range(14, 21)]
        assert h.coordinator.losses == [(1, 2)]
        assert degraded_with_reset(h.coordinator, 2)


async def test_without_a_replay_endpoint_a_gap_is_lost_with_a_reset() -> None:
    async with harness() as h:
        await h.start_listener()
        await h.publish_live([0, 1, 5, 6])
        await h.coordinator.wait_for(lambda c: 6 in c.cursors())
        assert h.coordinator.cursors() == [0, 1, 5, 6]
        assert h.coordinator.losses == [(1, 3)]
        assert degraded_with_reset(h.coordinator, 3)
        assert h.stats.statistics().gaps == 1 and h.stats.statistics().lost_batches == 3


async def test_live_batches_behind_a_gap_are_applied_only_after_the_replay() -> None:
    async with harness() as h:
        release = trio.Event()
        router = await start_router(h, hold=release)
        await h.start_listener(replay_endpoint=router.endpoint)
        await h.publish_live([0, 1, 5])
        await router.wait_for_requests(1)
        await h.publish_live([6, 7])
        await trio.testing.wait_all_tasks_blocked()
        assert h.coordinator.cursors() == [0, 1], "nothing past the gap is applied while the replay runs"
        release.set()
        await h.coordinator.wait_for(lambda c: 7 in c.cursors())
        await h.engine.publish_frames([LIVE[0][0], (68).to_bytes(8, "big"), LIVE[0][2]])
        await h.coordinator.wait_for(lambda c: 68 in c.cursors())
        assert h.coordinator.cursors() == list(range(69))
        assert router.requests == [1, 7]
        assert h.coordinator.losses == [] and h.coordinator.signals == []


async def test_held_live_batches_are_never_held_past_the_byte_bound() -> None:
    async with harness() as h:
        router = await start_router(h, silent=True)
        options = ListenerOptions(
            cold_bootstrap=False,
            replay_timeout=GUARD,
            max_payload_bytes=2048,
            ingress_bytes=8 * 2048,
            shed_after=0.0,  # shed at once (the default first stops reading for a while)
        )
        await h.start_listener(replay_endpoint=router.endpoint, options=options)
        await h.publish_live([0, 1, 5])
        await router.wait_for_requests(1)  # the repair waits on a silent server: later batches are held
        bound = options.budget.listener_bytes
        most = 0
        # Published until the listener sheds (ZMQ delivers in its own thread, so how many batches it has
        # received by a given moment varies); the held bytes are checked after every batch.
        for seq in range(6, 4000):
            # The capture has 68 batches; later seqs reuse its payloads (delivery can lag under load).
            await h.engine.publish_frames([LIVE[0][0], seq.to_bytes(8, "big"), LIVE[seq % len(LIVE)][2]])
            await trio.testing.wait_all_tasks_blocked()
            most = max(most, h.stats.statistics().held_bytes)
            if h.stats.statistics().ingest_sheds:
                break
        stats = h.stats.statistics()
        assert stats.ingest_sheds >= 1 and stats.shed_held_batches > 0
        assert most <= bound + 2048, "at most one batch past the bound, then shed"
        assert h.coordinator.cursors() == [0, 1]


# -- cold attach ----------------------------------------------------------------------------------------


async def test_cold_attach_bootstraps_batches_published_before_the_listener_connected() -> None:
    async with harness(replay_endpoint="tcp://127.0.0.1:0") as h:
        hashes = []
        for n in range(5):
            await h.engine.publish_batch([block_stored([1000 + n], None, [n] * 32, 32)])
            hashes.append(1000 + n)
        assert h.engine.replay_endpoint is not None
        await h.start_listener(replay_endpoint=h.engine.replay_endpoint, options=ListenerOptions())
        for n in range(5, 8):
            await h.engine.publish_batch([block_stored([1000 + n], None, [n] * 32, 32)])
        await h.coordinator.wait_for(lambda c: 7 in c.cursors())
        assert h.coordinator.cursors() == list(range(8))
        # One bootstrap from 0; a complete answer that made progress is followed by one request for what
        # comes next unless live batches 5.. were already held by then (vLLM's HWM can drop an answer's tail).
        starts = h.engine.replay_starts
        assert starts[0] == 0 and len(starts) <= 2 and all(start >= 5 for start in starts[1:]), starts
        assert h.coordinator.losses == []


async def test_cold_attach_with_evicted_history_applies_the_rest_and_reports_loss() -> None:
    async with harness() as h:
        router = await start_router(h, first_available=10)
        await h.start_listener(replay_endpoint=router.endpoint, options=ListenerOptions())
        await h.coordinator.wait_for(lambda c: 67 in c.cursors())
        assert router.requests == [0]
        assert h.coordinator.cursors() == list(range(10, 68))
        assert h.coordinator.losses == [(1, 10)]
        # Degraded, but nothing was held before: no reset is needed.
        assert [(x.state, x.reset, x.lost_batches) for x in h.coordinator.signals] == [(DEGRADED, False, 10)]


# -- restarts, duplicates ---------------------------------------------------------------------------------


async def test_an_in_place_restart_passes_through_once() -> None:
    async with harness() as h:
        await h.start_listener()
        for n in range(3):
            await h.engine.publish_batch([block_stored([n + 1], None, [n] * 32, 32)])
        h.engine.restart()
        for n in range(2):
            await h.engine.publish_batch([block_stored([n + 7], None, [n] * 32, 32)])
        await h.coordinator.wait_for(lambda c: len(c.cursors()) == 5)
        assert h.coordinator.cursors() == [0, 1, 2, 0, 1]
        assert h.stats.statistics().restarts_seen == 1 and h.coordinator.losses == []
        # Seq 0 again with other bytes: a new engine, whose history from 0 is complete.
        assert [(x.state, x.reset) for x in h.coordinator.signals] == [(READY, True)]
        assert h.coordinator.items.index(h.coordinator.signals[0]) == 3, "the reset comes before its seq 0"


async def restart_missing_its_first_batches(h: Harness) -> None:
    """Seqs 0..3, then an in-place restart whose seqs 0 and 1 never reach the SUB (still buffered)."""
    for n in range(4):
        await h.engine.publish_batch([block_stored([n + 1], None, [n] * 32, 32)])
    h.engine.restart()
    for n in range(2):
        await h.engine.publish_batch([block_stored([n + 7], None, [n] * 32, 32)], drop_live=True)
    await h.engine.publish_batch([block_stored([9], None, [9] * 32, 32)])


async def test_a_restart_seen_mid_stream_is_repaired_from_zero_of_the_new_incarnation() -> None:
    async with harness(replay_endpoint="tcp://127.0.0.1:0") as h:
        assert h.engine.replay_endpoint is not None
        await h.start_listener(replay_endpoint=h.engine.replay_endpoint)
        await restart_missing_its_first_batches(h)
        await h.coordinator.wait_for(lambda c: len(c.cursors()) == 7)
        assert h.coordinator.cursors() == [0, 1, 2, 3, 0, 1, 2]
        assert h.stats.statistics().restarts_seen == 1 and h.coordinator.losses == []
        assert [(x.state, x.reset) for x in h.coordinator.signals] == [(READY, True)]
        assert h.engine.replay_starts == [0], "the new engine's history, from 0"


async def test_a_restart_seen_mid_stream_without_replay_reports_the_missed_batches() -> None:
    async with harness() as h:
        await h.start_listener()
        await restart_missing_its_first_batches(h)
        await h.coordinator.wait_for(lambda c: len(c.cursors()) == 5)
        assert h.coordinator.cursors() == [0, 1, 2, 3, 2]
        assert h.stats.statistics().restarts_seen == 1 and h.coordinator.losses == [(1, 2)]
        assert degraded_with_reset(h.coordinator, 2)


async def test_a_repeated_seq_is_dropped() -> None:
    async with harness() as h:
        await h.start_listener()
        await h.publish_live([0, 1, 1, 2])
        await h.coordinator.wait_for(lambda c: 2 in c.cursors())
        assert h.coordinator.cursors() == [0, 1, 2]
        assert h.stats.statistics().duplicates == 1, "the same seq with the same bytes"
        assert h.coordinator.signals == []


# -- self-termination -----------------------------------------------------------------------------------


Logs = list[MutableMapping[str, Any]]


@pytest.fixture
def logs() -> Iterator[Logs]:
    with structlog.testing.capture_logs() as captured:
        yield captured


async def expect_termination(h: Harness, logs: Logs, message: str) -> None:
    await h.finished.wait()
    assert h.coordinator.quarantines == [(1, LISTENER_TERMINATED)]
    assert any(
        entry["event"] == "listener_failed" and entry["log_level"] == "warning" and message in entry["error"]
        for entry in logs
    ), logs


async def test_a_batch_from_another_rank_ends_the_listener(logs: Logs) -> None:
    async with harness() as h:
        await h.start_listener(dp_rank=2)
        await h.publish_live([0])
        await expect_termination(h, logs, "vLLM batch rank 0 does not match configured rank 2")
        assert h.coordinator.chunks == []


async def test_an_undecodable_batch_ends_the_listener(logs: Logs) -> None:
    async with harness() as h:
        await h.start_listener()
        await h.engine.publish_frames([TOPIC.encode(), (0).to_bytes(8, "big"), b"\xc1"])
        await expect_termination(h, logs, "failed to decode framework KV event batch")
        assert h.stats.statistics().decode_errors == 1


async def test_an_oversized_payload_ends_the_listener(logs: Logs) -> None:
    async with harness() as h:
        await h.start_listener(options=ListenerOptions(cold_bootstrap=False, max_payload_bytes=64))
        await h.publish_live([0])
        await expect_termination(h, logs, "ZMQ payload exceeds 64 bytes")


async def test_an_event_over_the_chunk_block_bound_is_split_not_quarantined() -> None:
    async with harness(block_size=1) as h:
        await h.start_listener()
        count = 8193
        event = block_stored(list(range(1, count + 1)), None, [1] * (count * 32), 32)
        await h.engine.publish_batch([event])
        await h.coordinator.wait_for(lambda c: 0 in c.cursors())
        blocks = [len(p.data.block_hashes) for chunk in h.coordinator.chunks for p in chunk.events]
        assert blocks == [8192, 1] and h.coordinator.quarantines == []
        assert not h.finished.is_set()


async def test_a_closed_coordinator_ends_the_listener(logs: Logs) -> None:
    async with harness() as h:
        h.coordinator.closed = True
        await h.start_listener()
        await h.publish_live([0])
        await h.finished.wait()
        # The terminal quarantine goes in order on the ingress channel, which is what is closed.
        assert h.coordinator.quarantines == []
        assert any(
            entry["event"] == "listener_failed" and "state-agent ingress coordinator is closed" in entry["error"]
            for entry in logs
        ), logs
        assert any(entry["event"] == "listener_quarantine_failed" for entry in logs), logs


def set_state(h: Harness, state: str) -> None:
    assert h.status is not None and h.attachment is not None
    h.status.set(AgentStatus(IDENTITY, AttachmentStatus(1, h.attachment.worker, state == "ready", 0, state)))


async def test_a_generation_no_longer_open_stops_the_listener_and_quarantines() -> None:
    async with harness() as h:
        await h.start_listener()
        await h.publish_live([0])
        await h.coordinator.wait_for(lambda c: 0 in c.cursors())
        set_state(h, "unready")  # detaching or quarantined
        await h.publish_live([1])
        await h.finished.wait()
        assert h.coordinator.cursors() == [0]
        assert h.coordinator.quarantines == [(1, LISTENER_TERMINATED)]


@pytest.mark.parametrize("state", ["degraded", "disconnected"])
async def test_the_listener_runs_on_while_degraded_or_disconnected(state: str) -> None:
    async with harness() as h:
        await h.start_listener()
        await h.publish_live([0])
        await h.coordinator.wait_for(lambda c: 0 in c.cursors())
        set_state(h, state)
        await h.publish_live([1, 2])
        await h.coordinator.wait_for(lambda c: 2 in c.cursors())
        assert not h.finished.is_set() and h.coordinator.quarantines == []


async def test_external_cancellation_does_not_quarantine() -> None:
    async with harness() as h:
        await h.start_listener()
        await h.publish_live([0])
        await h.coordinator.wait_for(lambda c: 0 in c.cursors())
        h.nursery.cancel_scope.cancel()
    assert h.finished.is_set()
    assert h.coordinator.quarantines == []


# -- with the real coordinator ----------------------------------------------------------------------------


async def test_the_capture_reaches_the_real_coordinator_and_index(
    identity: KvStateAgentIdentity, recording_sink: RecordingSink, status_cell: StatusCell
) -> None:
    index = RecoveryIndex(32)
    sink, status = recording_sink, status_cell
    core = SlotCoordinator(
        identity=identity,
        slot_rank=0,
        index=index,
        sink=sink,
        on_status=status.set,
        request_withdrawal=lambda _: None,
    )
    handle, run_coordinator = open_coordinator(core)
    payload_events = [len(msgpack.unpackb(frames[2])[1]) for frames in LIVE]
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_coordinator)
            engine = FakeVllmEngine(topic=TOPIC)
            await nursery.start(engine.run)
            attachment = await handle.attach(ready_attachment(engine.endpoint, generation=0))
            stats = ListenerCounters()
            await nursery.start(
                lambda task_status: run_listener(
                    attachment=attachment,
                    kv_block_size=32,
                    coordinator=handle,
                    status=status,
                    options=ListenerOptions(cold_bootstrap=False),
                    stats=stats,
                    task_status=task_status,
                )
            )
            await engine.wait_for_subscriber()
            for frames in LIVE:
                await engine.publish_frames(frames)
            # One publication for the attach barrier, then one per raw batch (each is one chunk).
            await sink.wait_for_calls(1 + len(LIVE))
            assert core.counters.ingress_chunks == len(LIVE)
            assert core.counters.events_in == sum(payload_events)
            assert core.counters.dropped_events == 0
            assert status.get().outbound_cursor == attachment.ready_at_outbound_cursor + len(sink.events) - 1
            assert stats.batches == 68
            assert index.resident_block_count > 0
            assert status.get().is_ready_generation(attachment.generation)
            nursery.cancel_scope.cancel()
