"""What a slot can trust of its applied state, and the resume point it leaves (sans-IO; issues #14, #17).

:class:`SlotTrust` is the state :class:`~kvagent.coordinator.machine.SlotCoordinator` keeps about whether its
applied state can be trusted, with one named transition for each thing that changes it: the failure flags
(never cleared, docs/spec/agent-semantics.md 3.1), whether CacheOwner is trusted after the listener's verdicts about its
source (a :class:`~kvagent.model.events.SourceSignal`: lost batches, a Worker reset barrier, the source
state), and the **source progress**: the engine batch (seq, payload digest) the applied Worker state is
complete up to, which a restarted agent resumes from.  Progress exists only while the applied history is the
engine's complete one: a reset or a degradation forgets it, so a resume can never mark a subset of the
engine's state ready.
"""

from __future__ import annotations

import attrs

from kvagent.model.events import SourceState

__all__ = ["LISTENER_TERMINATED", "SlotTrust", "SourceProgress"]

LISTENER_TERMINATED = "framework listener terminated"  # a quarantine signal's reason when it names none

SourceProgress = tuple[int, int, int]
"""(attachment generation, engine seq, payload digest of that batch): the last batch applied completely."""


@attrs.define
class SlotTrust:
    """The trust state of one slot; see the module docstring.

    ``strict_cache_owner``: an unrepaired source loss makes CacheOwner untrusted until the next attach, or
    until the source is READY again after a Worker reset that followed the loss.
    """

    strict_cache_owner: bool = False
    # The three failure flags are never cleared for the life of the agent (3.1).
    worker_failed: bool = False
    cache_owner_failed: bool = False
    source_failed: bool = False
    cache_owner_untrusted: bool = False  # strict_cache_owner: a source loss not yet repaired by a reset
    reset_since_loss: bool = False
    # A resumed attachment: CacheOwner stays unready until the source is READY again (its state is what was
    # persisted, current only once the engine's replay proved nothing was missed).
    cache_owner_resyncing: bool = False
    progress: SourceProgress | None = None

    @property
    def cache_owner_ready(self) -> bool:
        return not (self.cache_owner_failed or self.cache_owner_untrusted or self.cache_owner_resyncing)

    @property
    def ingress_failed(self) -> bool:
        """No ingress is accepted any more (the Worker domain or the source failed)."""
        return self.worker_failed or self.source_failed

    # -- failures (3.6): never undone ---------------------------------------------------------------

    def fail_worker(self) -> None:
        self.worker_failed = True

    def fail_cache_owner(self) -> None:
        self.cache_owner_failed = True

    def fail_source(self) -> None:
        self.source_failed = self.worker_failed = self.cache_owner_failed = True

    # -- lifecycle ----------------------------------------------------------------------------------

    def restored(self) -> None:
        """The persisted CacheOwner state is unready until a resumed attach is proven."""
        self.cache_owner_resyncing = True

    def attached(self, generation: int, resume: tuple[int, int] | None) -> None:
        """A new attachment; ``resume=(engine seq, digest)`` continues the engine the restored state follows.

        A fresh cursor does not prove CacheOwner continuity: CacheOwner stays advisory, and a resumed one is
        unready until the source is READY.
        """
        if resume is not None:
            self.progress = (generation, *resume)
        self.cache_owner_untrusted = False
        self.reset_since_loss = False
        self.cache_owner_resyncing = resume is not None

    def worker_barrier(self) -> None:
        """A Worker reset barrier: the Worker state follows no engine batch until the next one completes."""
        self.progress = None

    def batch_completed(self, generation: int, engine_seq: int, digest: int) -> None:
        self.progress = (generation, engine_seq, digest)

    # -- the listener's verdicts ----------------------------------------------------------------------

    def source_reset(self) -> None:
        """The listener reset the Worker state: a loss before it can be repaired by a READY source."""
        self.reset_since_loss = True

    def batches_lost(self, lost_batches: int, *, current: bool) -> bool:
        """``lost_batches`` unrepaired losses; True when CacheOwner has just become untrusted."""
        if not (self.strict_cache_owner and current and lost_batches > 0):
            return False
        self.reset_since_loss = False
        if self.cache_owner_untrusted:
            return False
        self.cache_owner_untrusted = True
        return True

    def source_state_reported(self, state: SourceState) -> None:
        if state is SourceState.READY:
            if self.reset_since_loss:
                # Resynchronised after a reset that followed the loss: CacheOwner is trusted again.
                self.cache_owner_untrusted = False
            self.cache_owner_resyncing = False  # a resume is confirmed, or the engine's history is complete
        elif state is SourceState.DEGRADED:
            self.progress = None  # the Worker state is a subset of the engine's: nothing to resume
