"""The ingest byte budget of one listener, and how it is split (issue #26 item 7).

``ListenerOptions.ingress_bytes`` is the one setting: the raw payload bytes one attachment may hold between
the engine's SUB socket and the coordinator. :class:`IngestBudget` owns its split, so the arithmetic lives
here and nowhere else:

- **listener**: half, for what the listener holds — its inbox, the live batches ``SourceSync`` holds back,
  the replies it keeps, and the batches the processor has taken but not admitted. Over it, the reader sheds.
- **coordinator**: the other half, for the chunks admitted to the coordinator and not yet handled; the
  processor waits before admitting more (``CoordinatorHandle.wait_ingress_bytes_at_most``).
- **replies**: a quarter of the listener's half, for replay replies in flight in the inbox (the replay
  client waits for room), so a shed can always free the rest.
- **libzmq**: a quarter of the listener's half is what the SUB's own queue may hold in the largest messages
  seen (and never fitted to less than 1/32 of ``max_payload_bytes``), which sets the RCVHWM the
  reader opens each SUB with.

Each half must hold a couple of the largest batches, or every such batch would shed: the total is at least
four times ``max_payload_bytes``. Sans-IO.
"""

from __future__ import annotations

import attrs

__all__ = ["MIN_RCVHWM", "IngestBudget"]

MIN_RCVHWM = 4  # libzmq's queue in messages, whatever their size: a couple of batches in flight


@attrs.frozen(slots=True)
class IngestBudget:
    """``total`` raw payload bytes for one listener, split as the module docstring says."""

    total: int
    max_payload_bytes: int

    def __attrs_post_init__(self) -> None:
        if self.max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes must be positive, got {self.max_payload_bytes}")
        if self.total < self.least_total(self.max_payload_bytes):
            raise ValueError(
                f"ingress_bytes ({self.total}) must be at least 4 x max_payload_bytes ({self.max_payload_bytes})"
            )

    @staticmethod
    def least_total(max_payload_bytes: int) -> int:
        """The smallest budget that lets each half hold two of the largest payloads: 4 x the largest."""
        return 4 * max_payload_bytes

    @property
    def listener_bytes(self) -> int:
        """What the listener may hold before its reader sheds."""
        return self.total // 2

    @property
    def coordinator_bytes(self) -> int:
        """What the coordinator's ingress queue may hold before the processor waits."""
        return self.total - self.total // 2

    @property
    def reply_bytes(self) -> int:
        """Replay replies in flight in the inbox before the replay client waits."""
        return self.listener_bytes // 4

    @property
    def libzmq_bytes(self) -> int:
        """What the SUB's own queue should hold at most, in the largest messages seen."""
        return self.listener_bytes // 4

    @property
    def smallest_fitted_message(self) -> int:
        """The message size the RCVHWM is fitted to before larger ones are seen: 1/32 of the largest allowed.
        The first SUB is opened before any message arrives, and a connected SUB's RCVHWM cannot be changed
        safely (reader.py), so libzmq's queue is bounded from the start: with the defaults 32 messages, 8
        MiB of 256 KiB ones (32 MiB of 1 MiB ones until the first shed re-fits it; a burst of small ones
        waits in the kernel's buffers and the engine's send queue)."""
        return max(1, self.max_payload_bytes // 32)

    def rcvhwm(self, configured: int, largest_message: int) -> int:
        """The RCVHWM to open a SUB with: what holds :attr:`libzmq_bytes` of the largest message seen (or of
        :attr:`smallest_fitted_message`), at least :data:`MIN_RCVHWM`, at most ``configured`` (0: no bound)."""
        fitted = max(MIN_RCVHWM, self.libzmq_bytes // max(largest_message, self.smallest_fitted_message))
        return fitted if configured == 0 else min(configured, fitted)
