"""Stateful model test: SlotCoordinator + the real RecoveryIndex against a simple reference model.

The model keeps the resident set ``{(owner, tier, hash)}`` and Worker refcounts (3.7), plus the few
lifecycle flags that decide whether an operation succeeds, and the listener's source state (signals).
Invariants after every step: published ids strictly increase (never reused), the index's resident set equals
the model, a tree dump replayed into a fresh index reproduces the live one, and the status agrees with the
model (ready only while open and the source is ready).

Issue #17: the agent also crashes and restarts from a persisted index (a snapshot plus the suffix after it),
with ids skipped or not, and re-attaches resumed (no barrier; CacheOwner unready until the source is READY)
or not at all; the same invariants hold across it, ids included (never reused).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvagent.coordinator.machine import SlotCoordinator
from kvagent.coordinator.task import StatusCell
from kvagent.index.recovery_index import RecoveryIndex, TreeDumpAnswer
from kvagent.model.errors import CoordinatorError
from kvagent.model.events import (
    CLEARED,
    Cleared,
    IngressChunk,
    PlacementEvent,
    Removed,
    ResidencyDomain,
    ResidencyOwner,
    SourceSignal,
    SourceState,
    StorageTier,
    Stored,
    WorkerWithDpRank,
)
from kvagent.model.status import AgentStatus, Attachment, AttachmentSource
from kvagent.testing import RecordingSink
from tests.support.ids import DEVICE, DISK, HP, IDENTITY, OWNER, C, W

RANK = 3
WORKER = WorkerWithDpRank(17, RANK)
ATTACHMENT = Attachment(worker=WORKER, source=AttachmentSource(endpoint="tcp://framework"))

Resident = tuple[ResidencyOwner, StorageTier, int]


@st.composite
def placement_events(draw: st.DrawFn) -> PlacementEvent:
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "remove", "clear"]))
    domain = draw(st.sampled_from([W, C]))
    if kind == "clear":
        return PlacementEvent(CLEARED, DEVICE, domain, RANK)
    # CacheOwner has no Device residency; Device stores are single roots so the radix tree and the
    # hash-level model agree.
    tier = draw(st.sampled_from([DEVICE, HP, DISK] if domain is W else [HP, DISK]))
    hashes = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=1 if tier is DEVICE else 3)))
    if kind == "remove":
        return PlacementEvent(Removed(hashes), tier, domain, RANK)
    parent = None if tier is DEVICE else draw(st.sampled_from([None, *range(1, 5)]))
    return PlacementEvent(Stored(parent, hashes, tuple(h + 100 for h in hashes)), tier, domain, RANK)


cursor_moves = st.sampled_from(["next", "next", "next", "gap", "duplicate", "restart"])
# Publication failures are drawn per operation and rare: a failed barrier retires the Worker domain for good.
publication_fails = st.sampled_from([False] * 11 + [True])
rarely = st.sampled_from([False] * 4 + [True])


@attrs.define
class Model:
    resident: set[Resident] = attrs.Factory(set)
    refcounts: dict[tuple[StorageTier, int], int] = attrs.Factory(dict)
    attached: int | None = None
    ready: bool = False  # open: attached, not detaching or quarantined
    source_state: SourceState = SourceState.READY
    ingress: int | None = None
    next_generation: int = 1
    worker_failed: bool = False
    cache_owner_failed: bool = False
    completed: int | None = None
    resyncing: bool = False  # restored from disk: CacheOwner unready until a fresh attach or READY

    def clear_worker(self) -> None:
        self.refcounts.clear()
        self.resident = {entry for entry in self.resident if entry[0] == OWNER}

    def apply(self, events: Sequence[PlacementEvent]) -> list[ResidencyDomain]:
        """Apply one chunk's events; returns the domains of its Cleared events."""
        cleared: list[ResidencyDomain] = []
        for event in events:
            data = event.data
            owner: ResidencyOwner = WORKER if event.domain is W else OWNER
            if isinstance(data, Cleared):
                cleared.append(event.domain)
                if event.domain is W:
                    self.clear_worker()
                else:
                    self.resident = {entry for entry in self.resident if entry[0] != OWNER}
            elif isinstance(data, Stored):
                for block in data.block_hashes:
                    self.resident.add((owner, event.tier, block))
                    if event.domain is W:
                        key = (event.tier, block)
                        self.refcounts[key] = self.refcounts.get(key, 0) + 1
            else:
                for block in data.block_hashes:
                    key = (event.tier, block)
                    if event.domain is W and key in self.refcounts:
                        self.refcounts[key] -= 1
                        if self.refcounts[key] > 0:
                            continue  # another copy is still resident: the remove is swallowed
                        del self.refcounts[key]
                    self.resident.discard((owner, event.tier, block))
        return cleared

    def fail_domains(self, domains: Sequence[ResidencyDomain]) -> None:
        for domain in domains:
            if domain is W:
                self.worker_failed = True
            else:
                self.cache_owner_failed = True
            self.ingress = None
            self.ready = False


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = RecoveryIndex(4, ring_capacity=64)
        self.sink = RecordingSink()
        self.status = StatusCell(AgentStatus(IDENTITY))
        self.withdrawals: list[int] = []
        self.core = SlotCoordinator(
            identity=IDENTITY,
            slot_rank=RANK,
            index=self.index,
            sink=self.sink,
            on_status=self.status.set,
            request_withdrawal=self.withdrawals.append,
        )
        self.model = Model()
        self.last_cursor = 0
        self.persisted = (self.index.tree_dump(), 0)  # the last "compaction": a dump and its id

    # -- helpers -------------------------------------------------------------------------------------

    def barrier(self) -> bool:
        """A Worker reset barrier as the model sees it: applied locally even when publication fails.

        Returns whether it failed (and so retired the Worker domain).
        """
        self.model.clear_worker()
        if self.sink.fail:
            self.model.fail_domains([W])
        return self.sink.fail

    def pick_cursor(self, move: str) -> int:
        completed = self.model.completed
        if completed is None or move == "next":
            return (completed if completed is not None else self.last_cursor) + 1
        if move == "gap":
            return completed + 3
        if move == "duplicate":
            return completed
        return max(completed - 2, 0) if completed > 0 else completed + 1

    # -- rules ---------------------------------------------------------------------------------------

    @precondition(lambda self: self.model.attached is None)
    @rule(fail=publication_fails)
    def attach(self, fail: bool) -> None:
        self.sink.fail = fail
        model = self.model
        if model.worker_failed or model.attached is not None:
            with pytest.raises(CoordinatorError):
                self.core.attach(ATTACHMENT)
            return
        generation = model.next_generation
        model.next_generation += 1
        model.attached = generation
        if self.sink.fail:
            with pytest.raises(
                CoordinatorError, match="^failed to establish Worker reset barrier before attach$"
            ):
                self.core.attach(ATTACHMENT)
            self.barrier()
            assert self.withdrawals[-1] == generation
            return
        attached = self.core.attach(ATTACHMENT)
        self.barrier()
        assert attached.generation == generation
        assert attached.ready_at_outbound_cursor == self.core.outbound_cursor
        model.ready, model.ingress, model.completed = True, generation, None
        model.source_state = SourceState.READY
        model.resyncing = False

    @rule(
        state=st.sampled_from([None, *SourceState]),
        reset=st.booleans(),
        lost=st.sampled_from([0, 0, 3]),
        stale=rarely,
        fail=publication_fails,
    )
    def signal(self, state: SourceState | None, reset: bool, lost: int, stale: bool, fail: bool) -> None:
        self.sink.fail = fail
        model = self.model
        generation = (model.attached or 0) + (9 if stale else 0)
        verdict = SourceSignal(generation, state=state, reset=reset, lost_batches=lost)
        withdrawals, ignored = len(self.withdrawals), self.core.counters.signals_ignored
        if not model.ready or model.ingress != generation:
            self.core.handle_signal(verdict)
            assert self.core.counters.signals_ignored == ignored + 1
            assert len(self.withdrawals) == withdrawals
            return
        previous = model.source_state
        if reset:
            model.completed = None
            if self.barrier():
                with pytest.raises(CoordinatorError, match="^failed to publish Worker source reset barrier$"):
                    self.core.handle_signal(verdict)
                return
        self.core.handle_signal(verdict)
        model.source_state = state or previous
        if state is SourceState.READY:
            model.resyncing = False
        attachment = self.status.get().attachment
        assert attachment is not None
        if reset and model.source_state is SourceState.READY:
            assert attachment.ready_at_outbound_cursor == self.core.outbound_cursor  # the barrier
        # The ad is withdrawn when the attachment leaves ready, or its ready cursor moves while ready.
        moved = reset and previous is SourceState.READY and model.source_state is SourceState.READY
        left = previous is SourceState.READY and model.source_state is not SourceState.READY
        assert self.withdrawals[withdrawals:] == ([generation] if moved or left else [])

    @rule(
        chunks=st.lists(
            st.tuples(st.lists(placement_events(), max_size=6), cursor_moves), min_size=1, max_size=4
        ),
        stale=rarely,
        fail=publication_fails,
    )
    def ingress(self, chunks: list[tuple[list[PlacementEvent], str]], stale: bool, fail: bool) -> None:
        self.sink.fail = fail
        for events, move in chunks:
            self.ingress_one(events, move, stale)

    # Ingress is the common case: a second rule raises its share of the steps while ingress is open.
    @precondition(lambda self: self.model.ingress is not None)
    @rule(
        chunks=st.lists(
            st.tuples(st.lists(placement_events(), max_size=6), cursor_moves), min_size=1, max_size=4
        )
    )
    def more_ingress(self, chunks: list[tuple[list[PlacementEvent], str]]) -> None:
        self.ingress(chunks, stale=False, fail=False)

    def ingress_one(self, events: list[PlacementEvent], move: str, stale: bool) -> None:
        model = self.model
        generation = (model.attached or 0) + (5 if stale else 0)
        cursor = self.pick_cursor(move)
        chunk = IngressChunk(generation, cursor, 0, True, tuple(events))
        if model.ingress != generation or model.worker_failed:
            with pytest.raises(CoordinatorError, match="^ingress is closed for attachment generation"):
                self.core.handle_ingress(chunk)
            return
        self.last_cursor = cursor
        if model.completed is not None and cursor == model.completed:
            self.core.handle_ingress(chunk)  # a duplicate: dropped without applying
            return
        restarted = model.completed is not None and cursor < model.completed
        # A restart publishes a Worker reset barrier first; if that fails the chunk is not processed.
        if restarted and self.barrier():
            with pytest.raises(CoordinatorError, match="^failed to publish Worker restart barrier$"):
                self.core.handle_ingress(chunk)
            return
        model.completed = cursor
        kept = [e for e in events if not (e.domain is C and model.cache_owner_failed)]
        cleared = model.apply(kept)
        if self.sink.fail and cleared:
            with pytest.raises(CoordinatorError, match="^failed to publish reset barrier$"):
                self.core.handle_ingress(chunk)
            model.fail_domains(cleared)
            return
        self.core.handle_ingress(chunk)

    @precondition(lambda self: self.model.attached is not None)
    @rule(kind=st.sampled_from(["quarantine", "stale quarantine", "abort attach"]))
    def interrupt(self, kind: str) -> None:
        model = self.model
        assert model.attached is not None
        if kind == "abort attach":
            # No barrier: Worker residency stays until the next attach resets it.
            self.core.abort_attach(model.attached)
            model.attached, model.ready, model.ingress, model.completed = None, False, None, None
            return
        generation = model.attached + (7 if kind == "stale quarantine" else 0)
        withdrawals = len(self.withdrawals)
        self.core.quarantine(generation, "model quarantine")
        if generation == model.attached:
            model.ready, model.ingress = False, None
            assert self.withdrawals[withdrawals:] == [generation]
        else:
            assert len(self.withdrawals) == withdrawals

    @rule(
        queued=st.lists(st.lists(placement_events(), max_size=4), max_size=2),
        move=cursor_moves,
        fail=publication_fails,
    )
    def detach(self, queued: list[list[PlacementEvent]], move: str, fail: bool) -> None:
        self.sink.fail = fail
        model = self.model
        if model.attached is None:
            with pytest.raises(CoordinatorError, match="^KV state agent is not attached$"):
                self.core.begin_detach(1)
            return
        generation = model.attached
        self.core.begin_detach(generation)
        model.ready, model.ingress = False, None
        chunks = []
        for events in queued:
            cursor = self.pick_cursor(move)
            chunks.append(IngressChunk(generation, cursor, 0, True, tuple(events)))
            if model.completed is None or cursor != model.completed:
                model.completed = cursor
                cache_owner = [e for e in events if e.domain is C and not model.cache_owner_failed]
                cleared = model.apply(cache_owner)
                if self.sink.fail and cleared:
                    model.fail_domains(cleared)
        if self.sink.fail:
            with pytest.raises(CoordinatorError, match="^failed to publish final Worker detach barrier$"):
                self.core.complete_detach(generation, chunks)
            self.barrier()
            return
        assert self.core.complete_detach(generation, chunks) == self.core.outbound_cursor
        self.barrier()
        model.attached, model.completed = None, None

    # -- a restart from persisted state (issue #17) ------------------------------------------------------

    @rule()
    def compact(self) -> None:
        self.persisted = (self.index.tree_dump(), self.index.current_event_id())

    @rule(skip=st.sampled_from([0, 0, 1, 1 << 24]), resume=st.booleans())
    def crash_and_restart(self, skip: int, resume: bool) -> None:
        model = self.model
        dump, snapshot_id = self.persisted
        oldest = self.index.oldest_buffered_id()
        if snapshot_id < self.index.current_event_id() and (oldest is None or oldest > snapshot_id + 1):
            dump, snapshot_id = self.index.tree_dump(), self.index.current_event_id()  # the writer's fallback
        first_id = self.core.outbound_cursor + 1 + skip
        index = RecoveryIndex(4, ring_capacity=64)
        index.restore(dump.events, self.index.ring_tail(snapshot_id + 1), snapshot_id=snapshot_id)
        index.skip_to(first_id - 1)
        self.index = index
        self.persisted = (index.tree_dump(), index.current_event_id())
        self.core = SlotCoordinator(
            identity=IDENTITY,
            slot_rank=RANK,
            index=index,
            sink=self.sink,
            on_status=self.status.set,
            request_withdrawal=self.withdrawals.append,
            first_outbound_id=first_id,
        )
        self.core.restore(next_generation=model.next_generation, worker_blocks=index.resident_worker_blocks())
        # A new process: no failure flags, Worker copies counted once each, nothing attached yet.
        model.refcounts = {(tier, block): 1 for owner, tier, block in model.resident if owner == WORKER}
        model.worker_failed = model.cache_owner_failed = False
        model.resyncing = True
        was_attached, model.attached = model.attached is not None, None
        model.ready, model.ingress, model.completed = False, None, None
        if not (resume and was_attached):
            return
        published = len(self.sink.events)
        attached = self.core.attach(ATTACHMENT, resume=(7, 0x5EED))
        assert len(self.sink.events) == published, "a resumed attach publishes no barrier"
        assert attached.generation == model.next_generation
        model.attached = model.ingress = model.next_generation
        model.next_generation += 1
        model.ready, model.source_state = True, SourceState.DISCONNECTED

    # -- invariants ----------------------------------------------------------------------------------

    @invariant()
    def outbound_ids_strictly_increase(self) -> None:
        ids = [event.event_id for event in self.sink.events]
        assert all(a < b for a, b in zip(ids, ids[1:], strict=False))
        assert not ids or ids[-1] <= self.core.outbound_cursor
        assert self.index.current_event_id() == self.core.outbound_cursor == self.status.get().outbound_cursor

    @invariant()
    def index_matches_model(self) -> None:
        assert self.index.resident_blocks() == frozenset(self.model.resident)

    @invariant()
    def worker_dedup_matches_model(self) -> None:
        """White-box: the dedup's Worker copy counts are the model's (a restart rebuilds them from the index)."""
        counts = {
            (tier, block): count
            for (_rank, tier, domain), per_block in self.core._dedup.reference_counts().items()
            if domain is W
            for block, count in per_block.items()
        }
        assert counts == self.model.refcounts

    @invariant()
    def tree_dump_replays_to_the_live_index(self) -> None:
        dump = self.index.tree_dump()
        assert isinstance(dump, TreeDumpAnswer)
        fresh = RecoveryIndex(4, ring_capacity=1024)
        for event in dump.events:
            fresh.apply(event)
        assert fresh.resident_blocks() == self.index.resident_blocks()

    @invariant()
    def status_agrees_with_model(self) -> None:
        status = self.status.get()
        assert status.cache_owner_ready is not (self.model.cache_owner_failed or self.model.resyncing)
        if self.model.attached is None:
            assert status.attachment is None
        else:
            assert status.attachment is not None
            assert status.attachment.generation == self.model.attached
            source_ready = self.model.source_state is SourceState.READY
            assert status.attachment.ready is (self.model.ready and source_ready)
            expected = self.model.source_state.value if self.model.ready else "unready"
            assert status.attachment.state == expected
            assert status.attachment.ready_at_outbound_cursor <= status.outbound_cursor
        assert self.core.ingress_generation == self.model.ingress


CoordinatorMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_coordinator_model = CoordinatorMachine.TestCase
