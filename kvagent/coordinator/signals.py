"""The listener's verdicts about its source, and the resume point they leave (sans-IO; issues #14, #17).

:class:`SourceSignalHandling` is the part of :class:`~kvagent.coordinator.machine.SlotCoordinator` that acts
on a :class:`~kvagent.model.events.SourceSignal` (a Worker reset barrier, lost batches, the attachment's
source state, a quarantine) and keeps the **source progress**: the engine batch (seq, payload digest) the
applied Worker state is complete up to, which a restarted agent resumes from.  Progress exists only while
the applied history is the engine's complete one: a reset or a degradation forgets it, so a resume can
never mark a subset of the engine's state ready.
"""

from __future__ import annotations

import attrs
import structlog

from kvagent.coordinator.counters import CoordinatorCounters
from kvagent.coordinator.cursor import SourceContinuity
from kvagent.coordinator.dedup import DedupFilter
from kvagent.model.errors import CoordinatorError
from kvagent.model.events import ResidencyDomain, SourceSignal, SourceState, WorkerWithDpRank
from kvagent.model.status import Attachment

__all__ = ["LISTENER_TERMINATED", "SourceProgress", "SourceSignalHandling"]

log = structlog.get_logger(__name__)

LISTENER_TERMINATED = "framework listener terminated"  # a quarantine signal's reason when it names none

SourceProgress = tuple[int, int, int]
"""(attachment generation, engine seq, payload digest of that batch): the last batch applied completely."""


class SourceSignalHandling:
    """Source signals and source progress; mixed into SlotCoordinator (which defines what is declared here)."""

    counters: CoordinatorCounters
    strict_cache_owner: bool
    _attachment: Attachment | None
    _ingress_generation: int | None
    _continuity: SourceContinuity
    _dedup: DedupFilter
    _cache_owner_untrusted: bool
    _reset_since_loss: bool
    # A resumed attachment: CacheOwner stays unready until the source is READY again (its state is what was
    # persisted, current only once the engine's replay proved nothing was missed).
    _cache_owner_resyncing: bool
    _source_progress: SourceProgress | None

    def source_progress(self) -> SourceProgress | None:
        """(generation, engine seq, digest) of the last batch applied with complete history, or None.

        Updated when the final chunk of a batch is handled (also when dedup left nothing to publish);
        None after any Worker barrier (attach, detach, reset, in-place restart) or a degradation, until a
        batch completes again while not degraded.
        """
        return self._source_progress

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
        self._reset_since_loss = True
        attachment = self._require_attachment()
        if (signal.state or attachment.source_state) is SourceState.READY:
            # The stream from the barrier on carries the engine's complete history.
            self._attachment = attrs.evolve(attachment, ready_at_outbound_cursor=barrier_cursor)
            if attachment.source_state is SourceState.READY:
                self._withdraw(attachment.generation)  # the ad names the old cursor; it is registered anew

    def _count_source_loss(self, generation: int, lost_batches: int, *, current: bool) -> None:
        self.counters.source_losses += lost_batches
        log.warning("source_batches_lost", generation=generation, lost_batches=lost_batches)
        if self.strict_cache_owner and current and lost_batches > 0:
            self._reset_since_loss = False
            if not self._cache_owner_untrusted:
                self._cache_owner_untrusted = True
                self._publish_status()

    def _set_source_state(self, state: SourceState, signal: SourceSignal) -> None:
        attachment = self._require_attachment()
        if self._cache_owner_untrusted and state is SourceState.READY and self._reset_since_loss:
            self._cache_owner_untrusted = False  # resynchronised after a reset: CacheOwner is trusted again
        if state is SourceState.READY:
            self._cache_owner_resyncing = False  # a resume is confirmed, or the engine's history is complete
        elif state is SourceState.DEGRADED:
            self._source_progress = None  # the Worker state is a subset of the engine's: nothing to resume
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

    # -- defined by SlotCoordinator ----------------------------------------------------------------

    def quarantine(self, generation: int, reason: str) -> bool:
        raise NotImplementedError

    def _apply_and_publish_reset(self, worker: WorkerWithDpRank) -> int:
        raise NotImplementedError

    def _require_attachment(self) -> Attachment:
        raise NotImplementedError

    def _withdraw(self, generation: int) -> None:
        raise NotImplementedError

    def _publish_status(self) -> None:
        raise NotImplementedError
