"""Every stop deadline of a slot, derived from one number, so that the nested ones always fit.

``SlotAgentConfig.shutdown_step_timeout`` (``t``, default 5 s) bounds one step of a stop: a quarantine, an
ad withdrawal, a coordinator command, a rung's wait for its children.  The slot task's shutdown runs three
such steps (quarantine, withdraw the ad, join the listener), so it gets ``3t``, and the ladder waits ``4t``
for the slot task (the command in progress first).  The listener join is shorter than a step (``0.4t``: a
listener only has to notice its cancellation), so the three steps fit inside ``3t`` with room to spare.
"""

from __future__ import annotations

import attrs

__all__ = ["StopDeadlines"]


@attrs.frozen(slots=True)
class StopDeadlines:
    """The stop deadlines of one slot, in seconds, all derived from ``step`` (module doc)."""

    step: float  # one step of a stop (shutdown_step_timeout)

    def __attrs_post_init__(self) -> None:
        if not self.step > 0:
            raise ValueError(f"the stop step must be positive, got {self.step}")

    @property
    def listener_join(self) -> float:
        """Waiting for a cancelled listener task to end."""
        return 0.4 * self.step

    @property
    def slot_task_shutdown(self) -> float:
        """The slot task's shutdown: quarantine, ad withdrawal and listener join, each bounded on its own."""
        return 3 * self.step

    @property
    def slot_task_stop(self) -> float:
        """The ladder's wait for the slot task after its stop: the command in progress, then the shutdown."""
        return 4 * self.step
