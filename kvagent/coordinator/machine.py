"""The slot coordinator: the single owner of a slot's mutable state (docs/spec/agent-semantics.md section 3).

:class:`SlotCoordinator` is sans-IO and synchronous: every lifecycle command and every ingress chunk is
one method call that runs to completion (the index applies synchronously, the sink publishes without
blocking), so no interleaving can be observed from outside.  It touches no Trio object: status snapshots
go to an ``on_status`` callback and withdrawal requests to a ``request_withdrawal`` callback.

The Trio shell is :mod:`kvagent.coordinator.task`: ``open_coordinator(core)`` returns a
:class:`~kvagent.coordinator.task.CoordinatorHandle` and ``run(*, task_status)``; control always wins over
queued ingress.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import attrs
import structlog

from kvagent import _native
from kvagent.coordinator.coalesce import coalesce
from kvagent.coordinator.counters import CoordinatorCounters, CoordinatorStatistics
from kvagent.coordinator.cursor import Continuity, SourceContinuity, SourceCursorTracker
from kvagent.coordinator.dedup import DedupFilter
from kvagent.coordinator.fastpath import apply_plain_chunk
from kvagent.coordinator.lease import OutboundIdLease
from kvagent.coordinator.signals import LISTENER_TERMINATED, SlotTrust, SourceProgress
from kvagent.model.errors import CoordinatorError
from kvagent.model.events import (
    CLEARED,
    MAX_CHUNK_BLOCKS,
    MAX_CHUNK_EVENTS,
    U64_MAX,
    Cleared,
    IngressChunk,
    PlacementEvent,
    ResidencyDomain,
    RouterEvent,
    SourceSignal,
    SourceState,
    StorageTier,
    WorkerWithDpRank,
)
from kvagent.model.ids import KvStateAgentIdentity
from kvagent.model.status import AgentStatus, Attachment
from kvagent.publish.sinks import EventSink

__all__ = [
    "CoordinatorCounters",
    "CoordinatorStatistics",
    "LocalIndex",
    "SHUTDOWN_QUARANTINE",
    "SlotCoordinator",
    "SourceProgress",
]

SHUTDOWN_QUARANTINE = "state-agent shutdown"  # the reason a stopping slot quarantines its attachment with

log = structlog.get_logger(__name__)


class LocalIndex(Protocol):
    """What the coordinator needs of :class:`kvagent.index.recovery_index.RecoveryIndex`."""

    def apply(self, event: RouterEvent) -> None: ...

    def current_event_id(self) -> int: ...


class SlotCoordinator:
    """Sans-IO coordinator of one stable DP slot; see the module docstring.

    ``first_outbound_id`` is where a restarted agent's ids continue; ``lease_end`` (None: no lease) is the
    first id it may not stamp until :meth:`set_lease_end` moves it (the Trio shell waits for that, using
    :meth:`ids_needed`, before it hands over work that could cross it).

    Its parts: ``lease`` (:class:`~kvagent.coordinator.lease.OutboundIdLease`, the outbound ids) and
    ``trust`` (:class:`~kvagent.coordinator.signals.SlotTrust`, what its applied state can be trusted for).
    """

    ids_needed = staticmethod(OutboundIdLease.ids_needed)

    def __init__(
        self,
        *,
        identity: KvStateAgentIdentity,
        slot_rank: int,
        index: LocalIndex,
        sink: EventSink,
        on_status: Callable[[AgentStatus], None],
        request_withdrawal: Callable[[int], None],
        strict_cache_owner: bool = False,
        first_outbound_id: int = 1,
        lease_end: int | None = None,
    ) -> None:
        self.lease = OutboundIdLease(first_outbound_id, lease_end)
        self.identity = identity
        self.slot_rank = slot_rank
        self.index = index
        self.sink = sink
        self._on_status = on_status
        self.trust = SlotTrust(strict_cache_owner)
        self.counters = CoordinatorCounters()
        self._request_withdrawal = request_withdrawal
        self._attachment: Attachment | None = None
        self._ingress_generation: int | None = None
        self._next_attachment_generation = 1
        self._continuity = SourceContinuity(self.counters)
        self._dedup = DedupFilter()
        self._batching_ingress = False
        self._status_dirty = False
        # The batch-level path for plain chunks (coordinator/fastpath.py); False: every chunk takes the general
        # loop, which defines the behaviour (the differential tests compare the two).
        self.fast_path = True
        # The compiled core's plain-chunk pass (kvagent/_native), or None: the Python one. Tests run both.
        self.native = _native.core

    # -- read-only views ---------------------------------------------------------------------------

    @property
    def ingress_generation(self) -> int | None:
        return self._ingress_generation

    @property
    def outbound_cursor(self) -> int:
        return self.lease.last_taken

    @property
    def cursor(self) -> SourceCursorTracker:
        return self._continuity.tracker

    def statistics(self) -> CoordinatorStatistics:
        """The counters so far; ``ingress_queue_depth`` is 0 (the queue belongs to the Trio shell)."""
        return self.counters.statistics()

    # -- the outbound id lease (lease.py) ----------------------------------------------------------

    @property
    def lease_end(self) -> int | None:
        return self.lease.lease_end

    def set_lease_end(self, lease_end: int) -> None:
        """The persisted lease now reaches ``lease_end`` (it never moves back)."""
        self.lease.set_lease_end(lease_end)

    def ids_available(self) -> int | None:
        """Ids that may still be stamped under the lease (None: no lease)."""
        return self.lease.ids_available()

    def source_progress(self) -> SourceProgress | None:
        """(generation, engine seq, digest) of the last batch applied with complete history, or None.

        Updated when the final chunk of a batch is handled (also when dedup left nothing to publish);
        None after any Worker barrier (attach, detach, reset, in-place restart) or a degradation, until a
        batch completes again while not degraded.
        """
        return self.trust.progress

    # -- control commands (3.3) --------------------------------------------------------------------

    def attach(self, attachment: Attachment, *, resume: tuple[int, int] | None = None) -> Attachment:
        """Open a new attachment generation behind a Worker reset barrier.

        ``resume=(engine seq, digest)``: a restarted agent re-attaches to the engine its restored index
        follows. No barrier: the Worker stream continues where it stopped (the listener, resumed from the
        same point, proves the same engine or sends the reset itself); the source shows DISCONNECTED and
        CacheOwner is unready until the source is READY.
        """
        if self.trust.worker_failed:
            raise CoordinatorError("Worker domain is retired after a local/publish failure", code="internal")
        if self._attachment is not None:
            raise CoordinatorError("KV state agent already has an attachment", code="conflict")
        generation = self._next_attachment_generation
        if generation >= U64_MAX:
            raise CoordinatorError("attachment generation exhausted", code="internal")
        # The generation is consumed even if the barrier below fails.
        self._next_attachment_generation = generation + 1
        attachment = attrs.evolve(
            attachment,
            generation=generation,
            ready=False,
            ready_at_outbound_cursor=0,
            source_state=SourceState.READY,  # a new engine incarnation: its listener reports otherwise
        )
        self._attachment = attachment
        self._publish_status()
        if resume is None:
            barrier_cursor = self._attach_barrier(attachment)
        else:
            barrier_cursor = self.outbound_cursor
            attachment = attrs.evolve(attachment, source_state=SourceState.DISCONNECTED)
        attachment = attrs.evolve(attachment, ready=True, ready_at_outbound_cursor=barrier_cursor)
        self._ingress_generation = generation
        self._continuity.reset()
        self.trust.attached(generation, resume)
        self._attachment = attachment
        self.counters.attachments += 1
        self._publish_status()
        return attachment

    def _attach_barrier(self, attachment: Attachment) -> int:
        try:
            return self._apply_and_publish_reset(attachment.worker)
        except CoordinatorError as error:
            self.trust.fail_worker()
            self._quarantine(attachment.generation, "attach reset transaction failed")
            raise CoordinatorError(
                "failed to establish Worker reset barrier before attach", code="internal"
            ) from error

    def restore(
        self, *, next_generation: int, worker_blocks: Iterable[tuple[int, StorageTier, int]] = ()
    ) -> None:
        """A restarted agent's restored state, before anything is attached: attachment generations continue
        at ``next_generation``, and the Worker dedup counts each restored resident ``(dp_rank, tier, hash)``
        once (the index keeps sets; copies the engine held twice are forgotten, so their first remove passes).
        Publishes a status: the outbound cursor where ids continue, CacheOwner unready.
        """
        if self._attachment is not None:
            raise CoordinatorError("restore needs a coordinator with no attachment", code="conflict")
        if not 1 <= next_generation < U64_MAX:
            raise ValueError(f"next_generation must be in [1, U64_MAX), got {next_generation}")
        self._next_attachment_generation = next_generation
        self._dedup.seed(ResidencyDomain.WORKER, worker_blocks)
        # The restored CacheOwner state is the persisted one: unready until a resumed attach is proven (a
        # fresh attach makes it advisory again, as any fresh attach does).
        self.trust.restored()
        self._publish_status()

    def begin_detach(self, generation: int) -> None:
        attachment = self._require_attachment()
        if attachment.generation != generation:
            raise CoordinatorError(f"stale attachment generation {generation}", code="generation_mismatch")
        # Ingress stays open: chunks queued before CompleteDetach are still handled (9.5).
        self._attachment = attrs.evolve(attachment, ready=False)
        self._publish_status()

    def complete_detach(self, generation: int, queued: Iterable[IngressChunk | SourceSignal]) -> int:
        attachment = self._require_attachment()
        if attachment.generation != generation or attachment.ready:
            raise CoordinatorError(
                "attachment must be unready before detach cleanup",
                code="generation_mismatch" if attachment.generation != generation else "not_ready",
            )
        self._ingress_generation = None
        self._drain_cache_owner(generation, queued)
        try:
            cursor = self._apply_and_publish_reset(attachment.worker)
        except CoordinatorError as error:
            self.trust.fail_worker()
            self._publish_status()
            raise CoordinatorError(
                "failed to publish final Worker detach barrier", code="internal"
            ) from error
        self._attachment = None
        self._continuity.reset()
        self._publish_status()
        return cursor

    def quarantine(self, generation: int, reason: str) -> bool:
        """Quarantine ``generation`` if it is the current attachment (True); a stale one changes nothing."""
        if self._quarantine(generation, reason):
            self._withdraw(generation)
            return True
        return False

    def abort_attach(self, generation: int) -> None:
        """Forget a started attach whose listener never ran; publishes no barrier."""
        if self._attachment is None or self._attachment.generation != generation:
            return
        self._attachment = None
        self._ingress_generation = None
        self._continuity.reset()
        self._publish_status()

    # -- the listener's verdicts about its source (issue #14) ---------------------------------------

    def report_source_loss(self, generation: int, lost_batches: int) -> None:
        """The listener could not repair ``lost_batches`` raw batches of ``generation`` (a control command;
        a listener sends ``SourceSignal(lost_batches=...)`` in order with its chunks instead)."""
        current = self._attachment is not None and self._attachment.generation == generation
        self._count_source_loss(generation, lost_batches, current=current)

    def handle_signal(self, signal: SourceSignal) -> None:
        """Act on one verdict about the source of ``signal.generation``, after every chunk admitted before it.

        Ignored (counted) unless the generation is the open attachment. In order: ``reset`` publishes a Worker
        reset barrier and forgets the source cursor and the Worker dedup; ``lost_batches`` are counted (with
        strict CacheOwner, CacheOwner is untrusted); ``state`` becomes the attachment's source state;
        ``quarantine`` ends the attachment.
        """
        generation = signal.generation
        attachment = self._attachment
        if (
            attachment is None
            or attachment.generation != generation
            or not attachment.ready
            or self._ingress_generation != generation
        ):
            self.counters.signals_ignored += 1
            log.info("source_signal_ignored", generation=generation, reason=signal.reason)
            return
        if signal.reset:
            self._reset_source(attachment.worker, signal)
        if signal.lost_batches:
            self._count_source_loss(generation, signal.lost_batches, current=True)
        if signal.state is not None:
            self._set_source_state(signal.state, signal)
        self._publish_status()
        if signal.quarantine:
            self.quarantine(generation, signal.reason or LISTENER_TERMINATED)

    def _reset_source(self, worker: WorkerWithDpRank, signal: SourceSignal) -> None:
        """Routers drop what may be stale at the barrier; the stream after it rebuilds the Worker state."""
        self.counters.source_resets += 1
        log.warning("source_reset", generation=signal.generation, reason=signal.reason)
        try:
            barrier_cursor = self._apply_and_publish_reset(worker)
        except CoordinatorError as error:
            raise CoordinatorError(
                "failed to publish Worker source reset barrier", code="internal"
            ) from error
        self._continuity.reset()
        self._dedup.reset_domain(worker.dp_rank, ResidencyDomain.WORKER)
        self.trust.source_reset()
        attachment = self._require_attachment()
        if (signal.state or attachment.source_state) is SourceState.READY:
            # The stream from the barrier on carries the engine's complete history.
            self._attachment = attrs.evolve(attachment, ready_at_outbound_cursor=barrier_cursor)
            if attachment.source_state is SourceState.READY:
                self._withdraw(attachment.generation)  # the ad names the old cursor; it is registered anew

    def _count_source_loss(self, generation: int, lost_batches: int, *, current: bool) -> None:
        self.counters.source_losses += lost_batches
        log.warning("source_batches_lost", generation=generation, lost_batches=lost_batches)
        if self.trust.batches_lost(lost_batches, current=current):
            self._publish_status()

    def _set_source_state(self, state: SourceState, signal: SourceSignal) -> None:
        attachment = self._require_attachment()
        self.trust.source_state_reported(state)
        previous = attachment.source_state
        if state is previous:
            return
        if state is SourceState.DEGRADED:
            self.counters.degradations += 1
        elif state is SourceState.DISCONNECTED:
            self.counters.disconnects += 1
        else:
            self.counters.resyncs += 1
        self._attachment = attrs.evolve(attachment, source_state=state)
        log.warning(
            "attachment_source_state",
            generation=attachment.generation,
            state=state.value,
            previous=previous.value,
            reason=signal.reason,
        )
        if previous is SourceState.READY:
            # The attachment advertisement exists only while the attachment is ready.
            self._withdraw(attachment.generation)

    # -- ingress (3.4) -----------------------------------------------------------------------------

    def handle_ingress(self, chunk: IngressChunk) -> None:
        self.counters.ingress_chunks += 1
        generation = chunk.generation
        if self._ingress_generation != generation or self.trust.ingress_failed:
            raise CoordinatorError(
                f"ingress is closed for attachment generation {generation}", code="not_ready"
            )
        if len(chunk.events) > MAX_CHUNK_EVENTS or self._chunk_blocks(chunk.events) > MAX_CHUNK_BLOCKS:
            self._fail_source(generation, "oversized ingress envelope")
            raise CoordinatorError("oversized ingress envelope", code="bad_request")
        continuity = self._continuity.classify(chunk)
        if continuity is Continuity.DUPLICATE:
            return
        if continuity is Continuity.RESTARTED:
            self._restart_in_place(chunk)
        self._continuity.observe_lossy(chunk, "live ingress")
        self.counters.events_in += len(chunk.events)
        if chunk.source_fault is not None:
            self._fail_source(generation, chunk.source_fault)
            raise CoordinatorError(f"incompatible raw source: {chunk.source_fault}", code="bad_request")
        if chunk.cache_owner_fault is not None:
            self._fail_cache_owner(generation, chunk.cache_owner_fault)
        self._apply_and_publish(self._without_failed_cache_owner(chunk.events))
        attachment = self._attachment
        if chunk.final and attachment is not None and attachment.source_state is not SourceState.DEGRADED:
            self.trust.batch_completed(generation, chunk.source_cursor, chunk.source_digest)

    def _without_failed_cache_owner(self, events: Sequence[PlacementEvent]) -> Sequence[PlacementEvent]:
        if not self.trust.cache_owner_failed:
            return events
        kept = [event for event in events if event.domain is not ResidencyDomain.CACHE_OWNER]
        self.counters.count_filtered("cache_owner_failed", len(events) - len(kept))
        return kept

    def _drain_cache_owner(self, generation: int, queued: Iterable[IngressChunk | SourceSignal]) -> None:
        """CompleteDetach step 3: CacheOwner events queued for this attachment are residency truth."""
        for chunk in queued:
            if isinstance(chunk, SourceSignal):
                # The final Worker barrier supersedes any reset or state; losses are still counted.
                self.counters.signals_ignored += 1
                self.counters.source_losses += chunk.lost_batches
                continue
            self.counters.ingress_chunks += 1
            if chunk.generation != generation:
                log.warning(
                    "stale_generation_discarded", queued_generation=chunk.generation, generation=generation
                )
                self.counters.count_filtered("stale_generation", len(chunk.events))
                continue
            continuity = self._continuity.classify(chunk)
            if continuity is Continuity.DUPLICATE:
                continue
            if continuity is Continuity.RESTARTED:
                # The final Worker barrier follows at once, so no restart barrier is needed here.
                self.counters.restarts += 1
                self._continuity.reset()
            self._continuity.observe_lossy(chunk, "detach drain")
            self.counters.events_in += len(chunk.events)
            if chunk.source_fault is not None:
                self._fail_source(generation, chunk.source_fault)
                continue
            if chunk.cache_owner_fault is not None:
                self._fail_cache_owner(generation, chunk.cache_owner_fault)
            cache_owner_events = [e for e in chunk.events if e.domain is ResidencyDomain.CACHE_OWNER]
            # Worker mutations are superseded by the final Worker reset.
            self.counters.count_filtered("detach_worker_dropped", len(chunk.events) - len(cache_owner_events))
            try:
                self._apply_and_publish(self._without_failed_cache_owner(cache_owner_events))
            except CoordinatorError as error:
                log.error("detach_cache_owner_drain_failed", generation=generation, error=str(error))
        if self._continuity.tracker.active is not None:
            # CacheOwner residency stays advisory: part of a raw batch never arrived.
            log.warning("detach_after_incomplete_batch", generation=generation)
            self.counters.dropped_events += 1
            self._continuity.reset()

    # -- in-place restart detection (issue #6) ------------------------------------------------------

    def _restart_in_place(self, chunk: IngressChunk) -> None:
        """The engine's sequence went backwards: its Worker state is gone, so reset ours (issue #6)."""
        attachment = self._require_attachment()
        self.counters.restarts += 1
        log.warning(
            "engine_restarted_in_place",
            generation=chunk.generation,
            source_cursor=chunk.source_cursor,
            previous_cursor=self._continuity.tracker.last_seen(),
        )
        try:
            self._apply_and_publish_reset(attachment.worker)
        except CoordinatorError as error:
            raise CoordinatorError("failed to publish Worker restart barrier", code="internal") from error
        self._continuity.reset()
        self._dedup.reset_domain(attachment.worker.dp_rank, ResidencyDomain.WORKER)

    # -- failure functions (3.6) -------------------------------------------------------------------

    def _quarantine(self, generation: int, reason: str) -> bool:
        """Internal quarantine: True when it affected the current attachment."""
        attachment = self._attachment
        if attachment is None or attachment.generation != generation:
            return False
        self._attachment = attrs.evolve(attachment, ready=False)
        self._ingress_generation = None
        # A shutdown quarantines by design: not worth a warning on every clean stop.
        (log.info if reason == SHUTDOWN_QUARANTINE else log.warning)(
            "ingress_quarantined", generation=generation, reason=reason
        )
        self.counters.quarantines[reason] = self.counters.quarantines.get(reason, 0) + 1
        self._publish_status()
        return True

    def _fail_source(self, generation: int, reason: str) -> None:
        self.trust.fail_source()
        self._quarantine(generation, reason)
        self._withdraw(generation)

    def _fail_cache_owner(self, generation: int, reason: str) -> None:
        self.trust.fail_cache_owner()
        self._ingress_generation = None
        self._quarantine(generation, reason)
        self._withdraw(generation)
        log.error("cache_owner_failed_closed", generation=generation, reason=reason)

    def _fail_domain(self, generation: int, domain: ResidencyDomain, reason: str) -> None:
        if domain is ResidencyDomain.CACHE_OWNER:
            self._fail_cache_owner(generation, reason)
            return
        self.trust.fail_worker()
        self._ingress_generation = None
        self._quarantine(generation, reason)
        self._withdraw(generation)

    def _withdraw(self, generation: int) -> None:
        try:
            self._request_withdrawal(generation)
        except Exception as error:  # the supervisor's channel is closed: the agent is shutting down
            log.warning("withdrawal_supervisor_closed", generation=generation, error=str(error))

    # -- apply and publish (3.8, 3.9) ----------------------------------------------------------------

    def _apply_and_publish_reset(self, worker: WorkerWithDpRank) -> int:
        """Publish a Worker-domain Cleared for ``worker`` as its own chunk; returns its outbound id."""
        barrier = PlacementEvent(CLEARED, StorageTier.DEVICE, ResidencyDomain.WORKER, worker.dp_rank)
        # The Worker state no longer follows any engine batch: nothing to resume from until the next one.
        self.trust.worker_barrier()
        self._apply_and_publish([barrier])
        return self.lease.last_taken

    def _apply_and_publish(self, placement_events: Sequence[PlacementEvent]) -> None:
        attachment = self._attachment
        if attachment is None:
            raise CoordinatorError("KV state agent has no framework attachment", code="not_ready")
        output: list[RouterEvent] = []
        cleared_domains: list[ResidencyDomain] = []
        first_id = self.lease.next_id
        try:
            failed_barrier = self._apply_locally(attachment, placement_events, output, cleared_domains)
        finally:
            self.counters.events_out_ids += self.lease.next_id - first_id
        if output:
            self._publish(output, cleared_domains, attachment.generation)
        if self._batching_ingress:
            self._status_dirty = True
        else:
            self._publish_status()
        if failed_barrier is not None:
            raise failed_barrier

    def _apply_locally(
        self,
        attachment: Attachment,
        placement_events: Sequence[PlacementEvent],
        output: list[RouterEvent],
        cleared_domains: list[ResidencyDomain],
    ) -> CoordinatorError | None:
        """Coalesce, dedup, number and apply one chunk's events, appending what to publish to ``output``.

        Stored/Removed are lossy (one admission, one best-effort publication); a Cleared is a strong barrier
        that is fully applied locally before it is published.  A barrier that fails locally ends the chunk:
        its error is returned, to be raised once the events before it are published.
        """
        generation = attachment.generation
        worker_id = attachment.worker.worker_id
        owner = self.identity.cache_owner_id
        slot_rank = self.slot_rank
        dedup = self._dedup.filter
        apply = self.index.apply
        if self.fast_path:
            plain_swallowed = apply_plain_chunk(
                placement_events,
                slot_rank=slot_rank,
                worker_id=worker_id,
                owner=owner,
                first_id=self.lease.next_id,
                id_limit=self.lease.id_limit,
                dedup=self._dedup,
                apply=apply,
                apply_run=getattr(self.index, "apply_run", None),
                output=output,
                ids_taken=self._ids_taken,
                native=self.native,
            )
            if plain_swallowed is not None:
                if plain_swallowed:
                    self.counters.count_filtered("dedup_swallowed_remove", plain_swallowed)
                return None
        swallowed = 0
        failed_barrier: CoordinatorError | None = None
        for coalesced in coalesce(placement_events):
            if coalesced.dp_rank != slot_rank:
                self._fail_source(generation, "ingress rank does not match stable slot")
                raise CoordinatorError(
                    f"ingress rank {coalesced.dp_rank} does not match stable slot rank {slot_rank}",
                    code="bad_request",
                )
            event = dedup(coalesced)
            if event is None:
                swallowed += 1
                continue
            domain = event.domain
            router_event = RouterEvent(
                worker_id,
                event.tier,
                domain,
                self._take_outbound_id(generation),
                event.data,
                event.dp_rank,
                owner,
                event.session_id,
            )
            is_barrier = type(event.data) is Cleared
            try:
                apply(router_event)
            except Exception as error:
                if is_barrier:
                    self._fail_domain(generation, domain, "local reset barrier failed")
                    failed_barrier = CoordinatorError("local reset barrier failed", code="internal")
                    failed_barrier.__cause__ = error
                    break
                log.warning(
                    "local_apply_failed",
                    worker_id=worker_id,
                    dp_rank=event.dp_rank,
                    domain=domain.value,
                    error=str(error),
                )
            if is_barrier:
                cleared_domains.append(domain)
            output.append(router_event)
        if swallowed:
            self.counters.count_filtered("dedup_swallowed_remove", swallowed)
        return failed_barrier

    def _chunk_blocks(self, events: Sequence[PlacementEvent]) -> int:
        native = self.native
        blocks = -1 if native is None else native.chunk_blocks(events)
        return _chunk_blocks(events) if blocks < 0 else blocks

    def _ids_taken(self, next_id: int) -> None:
        self.lease.next_id = next_id

    def _take_outbound_id(self, generation: int) -> int:
        """The next outbound cursor: strictly increasing, never reused, never U64_MAX."""
        event_id = self.lease.take()
        if event_id is None:
            if not self.lease.exhausted_for_good():
                # Never reached through the Trio shell, which waits for the lease to cover the work first.
                raise CoordinatorError("outbound id lease exhausted", code="internal")
            self._fail_source(generation, "state-agent outbound cursor exhausted")
            raise CoordinatorError("state-agent outbound cursor exhausted", code="internal")
        return event_id

    def _publish(
        self, output: list[RouterEvent], cleared_domains: list[ResidencyDomain], generation: int
    ) -> None:
        # One publication per chunk, never one per event.
        self.counters.publications += 1
        try:
            self.sink.publish(output)
        except Exception as error:
            self.counters.publication_failures += 1
            if not cleared_domains:
                # Stored/Removed are lossy: the stream goes on.
                log.warning("publication_failed", attempted_event_count=len(output), error=str(error))
                return
            for domain in cleared_domains:
                self._fail_domain(generation, domain, "reset barrier publication failed")
            self._publish_status()
            raise CoordinatorError("failed to publish reset barrier", code="internal") from error
        self.counters.events_published += len(output)

    # -- status (3.11) -----------------------------------------------------------------------------

    def _require_attachment(self) -> Attachment:
        if self._attachment is None:
            raise CoordinatorError("KV state agent is not attached", code="not_ready")
        return self._attachment

    @contextlib.contextmanager
    def ingress_batch(self) -> Iterator[None]:
        """Cursor advances inside publish one status snapshot at the end (the shell wraps each drain).

        Other status changes stay immediate; every snapshot is complete, so none is ever older.
        """
        self._batching_ingress = True
        try:
            yield
        finally:
            self._batching_ingress = False
            if self._status_dirty:
                self._publish_status()

    def _publish_status(self) -> None:
        self._status_dirty = False
        attachment = self._attachment
        self._on_status(
            AgentStatus(
                identity=self.identity,
                attachment=None if attachment is None else attachment.status(),
                cache_owner_ready=self.trust.cache_owner_ready,
                outbound_cursor=self.lease.last_taken,
            )
        )


def _chunk_blocks(events: Sequence[PlacementEvent]) -> int:
    return sum([len(event.data.block_hashes) for event in events])
