"""Attachment-advertisement withdrawal: the required withdrawal (docs/spec/agent-semantics.md 7.4 step 2) and the
generation-fenced withdrawal supervisor (7.6).

Both retry forever with exponential backoff (100 ms doubling to 5 s): an advertisement that stays
registered after its attachment failed would make routers trust a dead engine, so giving up is never the
right answer; only cancellation (the agent's lease ending) stops the retries.
"""

from __future__ import annotations

import attrs
import structlog
import trio

from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC
from kvagent.model.ids import attachment_record_id

__all__ = [
    "INITIAL_BACKOFF",
    "MAX_BACKOFF",
    "AttachmentRecordHolder",
    "WithdrawalStatistics",
    "run_withdrawal_supervisor",
    "unregister_required",
]

log = structlog.get_logger(__name__)

INITIAL_BACKOFF = 0.1  # backoff after a failed discovery call (withdrawal, advertisement), doubling up to:
MAX_BACKOFF = 5.0


@attrs.frozen(slots=True)
class WithdrawalStatistics:
    """The withdrawal counters of one slot at one instant (never reset).

    Attributes:
      withdrawals: generations whose attachment ad the supervisor unregistered.
      retries: failed withdrawal attempts (supervisor and required withdrawals) that were retried.
      stale_withdrawals: supervisor requests fenced off: no ad held, or it belongs to another generation.
      required_withdrawals: successful :func:`unregister_required` withdrawals.
    """

    withdrawals: int
    retries: int
    stale_withdrawals: int
    required_withdrawals: int


class AttachmentRecordHolder:
    """The currently registered attachment advertisement, shared by the agent and the supervisor."""

    def __init__(self) -> None:
        self._record: DiscoveryRecord | None = None
        self._changed = trio.Event()
        # Plain counters bumped by the withdrawal paths (count_*); statistics() snapshots them.
        self._withdrawals = 0
        self._retries = 0
        self._stale_withdrawals = 0
        self._required_withdrawals = 0

    def statistics(self) -> WithdrawalStatistics:
        return WithdrawalStatistics(
            withdrawals=self._withdrawals,
            retries=self._retries,
            stale_withdrawals=self._stale_withdrawals,
            required_withdrawals=self._required_withdrawals,
        )

    @property
    def record(self) -> DiscoveryRecord | None:
        return self._record

    def set(self, record: DiscoveryRecord | None) -> None:
        if record is not self._record:
            self._record = record
            self._notify()

    def forget_if(self, record: DiscoveryRecord) -> bool:
        """Forget the held record only if it is still ``record`` (a newer one is never dropped)."""
        if self._record is not None and self._record == record:
            self._record = None
            self._notify()
            return True
        return False

    # The withdrawal paths below count what they did (statistics() snapshots the counters).
    def count_retry(self) -> None:
        self._retries += 1

    def count_required_withdrawal(self) -> None:
        self._required_withdrawals += 1

    def count_stale_noop(self) -> None:
        self._stale_withdrawals += 1

    def count_withdrawal(self) -> None:
        self._withdrawals += 1

    def change(self) -> trio.Event:
        """An event set at the next change of the held record (take it before looking, then wait)."""
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


def _next_delay(delay: float, cap: float) -> float:
    return min(delay * 2, cap)


async def unregister_required(
    discovery: Discovery,
    holder: AttachmentRecordHolder,
    record: DiscoveryRecord | None,
    *,
    initial: float = INITIAL_BACKOFF,
    cap: float = MAX_BACKOFF,
) -> None:
    """Withdraw ``record`` until it succeeds, then forget it if the holder still holds it.

    Cancellation propagates (the caller reports ``state-agent lease ended before attachment
    advertisement was withdrawn``).
    """
    if record is None:
        return
    delay = initial
    while True:
        try:
            await discovery.unregister(record.topic, record.record_id)
            break
        except Exception as exc:  # any backend failure is retried; Cancelled is not an Exception
            holder.count_retry()
            log.warning(
                "required_withdrawal_retry",
                record_id=record.record_id,
                topic=record.topic,
                error=str(exc),
                retry_in=delay,
            )
        await trio.sleep(delay)
        delay = _next_delay(delay, cap)
    holder.count_required_withdrawal()
    holder.forget_if(record)


async def _withdraw_generation(
    discovery: Discovery, holder: AttachmentRecordHolder, publisher_id: int, generation: int
) -> None:
    expected_id = attachment_record_id(publisher_id, generation)
    current = holder.record
    if current is None or current.record_id != expected_id or current.topic != KV_STATE_ATTACHMENTS_TOPIC:
        # The fence: a late request never removes a newer attachment's record.
        holder.count_stale_noop()
        return
    await discovery.unregister(current.topic, current.record_id)
    holder.forget_if(current)
    holder.count_withdrawal()


async def run_withdrawal_supervisor(
    *,
    discovery: Discovery,
    holder: AttachmentRecordHolder,
    publisher_id: int,
    requests: trio.MemoryReceiveChannel[int],
    initial_backoff: float = INITIAL_BACKOFF,
    max_backoff: float = MAX_BACKOFF,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Withdraw each requested generation's advertisement; ends when ``requests`` is closed and drained.

    Takes ownership of ``requests`` and closes it on exit, so later senders see BrokenResourceError.
    """
    with requests:
        task_status.started()
        async for generation in requests:
            delay = initial_backoff
            while True:
                try:
                    await _withdraw_generation(discovery, holder, publisher_id, generation)
                    break
                except Exception as exc:  # retried until success; cancellation stops it
                    holder.count_retry()
                    log.warning("withdrawal_retry", generation=generation, error=str(exc), retry_in=delay)
                await trio.sleep(delay)
                delay = _next_delay(delay, max_backoff)
