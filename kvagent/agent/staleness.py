"""Is the attached engine still talking? The slot's silence watch and its last-event age.

An engine that never publishes (dead, misconfigured, or a vLLM that *connected* its PUB instead of binding
it) leaves a slot ``ready`` with 0 events/s. The listener's reader notes when it last received a live
message (:attr:`~kvagent.vllm.reader.LiveReader.last_live_at`, Trio's clock, once per drain); from that:

- :func:`last_event_age` is the seconds since then (None before the first message), shown in the status
  (``last_event_age_s``) and as ``kvagent_slot_last_event_age_seconds``;
- :func:`watch_silence` runs beside each attachment's listener and logs ONE ``engine_silent`` WARNING per
  silence episode (nothing for ``silence_warning`` seconds since the last message, or since the attach when
  none came yet), and an ``engine_events_resumed`` INFO when messages come again.

Both read Trio's clock, so they must run inside Trio (every status and metrics reader does).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog
import trio

__all__ = ["LiveSource", "last_event_age", "run_then_cancel", "watch_silence"]

log = structlog.get_logger(__name__)


class LiveSource(Protocol):
    """What the silence watch reads of the listener's reader (:class:`~kvagent.vllm.reader.LiveReader`)."""

    @property
    def endpoint(self) -> str: ...

    @property
    def last_live_at(self) -> float | None: ...

    async def wait_for_live(self) -> None: ...


def last_event_age(source: LiveSource | None) -> float | None:
    """Seconds since ``source`` last received a live message; None before the first one."""
    if source is None or source.last_live_at is None:
        return None
    return max(0.0, trio.current_time() - source.last_live_at)


async def watch_silence(source: LiveSource, *, slot: str, generation: int, silence_warning: float) -> None:
    """Warn once per silence episode of ``silence_warning`` seconds; runs until cancelled."""
    attached_at = trio.current_time()
    while True:
        quiet_since = attached_at if source.last_live_at is None else source.last_live_at
        due = quiet_since + silence_warning
        if trio.current_time() < due:
            await trio.sleep_until(due)  # a timer, not a poll: it wakes when the episode would be due
            continue
        log.warning(
            "engine_silent",
            slot=slot,
            generation=generation,
            endpoint=source.endpoint,
            silent_s=round(trio.current_time() - quiet_since, 3),
            ever_received=source.last_live_at is not None,
            hint="no KV events: an idle engine publishes none; if it serves requests, is it bound at this endpoint?",
        )
        await source.wait_for_live()
        log.info(
            "engine_events_resumed",
            slot=slot,
            generation=generation,
            endpoint=source.endpoint,
            silent_s=round(trio.current_time() - quiet_since, 3),
        )


async def run_then_cancel(
    run: Callable[..., Awaitable[None]],
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``run`` (a listener), then cancel ``scope``: once the listener ends its silence watch has nothing
    to watch, and must not keep the listener task's nursery open."""
    try:
        await run(task_status=task_status)
    finally:
        scope.cancel()
