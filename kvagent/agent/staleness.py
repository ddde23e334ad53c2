"""Is the attached engine still talking? The slot's silence watch and its last-event age.

An engine that never publishes (dead, misconfigured, or a vLLM that *connected* its PUB instead of binding
it) leaves a slot ``ready`` with 0 events/s. The listener's reader notes when it last received a live
message (:attr:`~kvagent.vllm.reader.LiveReader.last_live_at`, once per drain); from that:

- :func:`last_event_age` is the seconds since then (None before the first message), shown in the status
  (``last_event_age_s``) and as ``kvagent_slot_last_event_age_seconds``;
- :func:`watch_silence` runs beside each attachment's listener and logs ONE ``engine_silent`` WARNING per
  silence episode (nothing for ``silence_warning`` seconds since the last message, or since the attach when
  none came yet), and an ``engine_events_resumed`` INFO when messages come again.
"""

from __future__ import annotations

import time

import structlog
import trio

from kvagent.vllm.reader import LiveReader

__all__ = ["last_event_age", "watch_silence"]

log = structlog.get_logger(__name__)


def last_event_age(reader: LiveReader | None, now: float | None = None) -> float | None:
    """Seconds since ``reader`` last received a live message; None before the first one."""
    if reader is None or reader.last_live_at is None:
        return None
    return max(0.0, (time.monotonic() if now is None else now) - reader.last_live_at)


async def watch_silence(reader: LiveReader, *, slot: str, generation: int, silence_warning: float) -> None:
    """Warn once per silence episode of ``silence_warning`` seconds; runs until cancelled."""
    attached_at = time.monotonic()
    while True:
        quiet_since = attached_at if reader.last_live_at is None else reader.last_live_at
        remaining = quiet_since + silence_warning - time.monotonic()
        if remaining > 0:
            await trio.sleep(remaining)  # a timer, not a poll: it wakes when the episode would be due
            continue
        log.warning(
            "engine_silent",
            slot=slot,
            generation=generation,
            endpoint=reader.endpoint,
            silent_s=round(time.monotonic() - quiet_since, 3),
            ever_received=reader.last_live_at is not None,
            hint="the engine publishes nothing: is it running, and bound at this endpoint?",
        )
        await reader.wait_for_live()
        log.info(
            "engine_events_resumed",
            slot=slot,
            generation=generation,
            endpoint=reader.endpoint,
            silent_s=round(time.monotonic() - quiet_since, 3),
        )
