"""Client helpers for routers: the websocket recovery client, and ``subscribe`` (event plane + gap repair)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.model.errors import FollowOverrun, RecoveryClientError
from kvagent.model.events import RouterEvent
from kvagent.recovery.client import (
    DumpColumns,
    FollowItem,
    RecoverResult,
    RecoveryClient,
    agent_status_from_json,
    connect_slot,
)
from kvagent.wire.router_event import decode_router_events

__all__ = [
    "EVENT_PLANE_TOPIC",
    "DumpColumns",
    "FollowItem",
    "FollowOverrun",
    "RecoverResult",
    "RecoveryClient",
    "RecoveryClientError",
    "SubscribeGapError",
    "agent_status_from_json",
    "connect_slot",
    "subscribe",
]

EVENT_PLANE_TOPIC = b"kv-state-events-v2"


class SubscribeGapError(RecoveryClientError):
    """A gap the agent can no longer fill from its ring (only a full snapshot would repair it)."""


def _parse_event_plane(frames: list[bytes]) -> tuple[int, list[RouterEvent]] | None:
    """``(publisher_id, events)``, or None for a message that is not a kv-state-events-v2 publication."""
    if len(frames) != 4 or frames[0] != EVENT_PLANE_TOPIC or len(frames[1]) != 8 or len(frames[2]) != 8:
        return None
    return int.from_bytes(frames[1], "big"), decode_router_events(frames[3])


async def subscribe(
    ws_url: str,
    slot: str,
    event_plane_endpoint: str,
    *,
    from_cursor: int | None = None,
    publisher_id: int | None = None,
    context: zmq.Context[Any] | None = None,
) -> AsyncIterator[RouterEvent]:
    """Every outbound event of one slot exactly once, in id order, from the ZMQ event plane.

    The event plane is lossy by design (PUB high-water mark, slow joiners); whenever the next message
    starts after ``last + 1``, the missing ids are fetched with the websocket ``recover`` op before
    anything newer is yielded.  ``from_cursor`` is the last id the caller already holds (None: start at
    the first message that arrives).  A gap older than the agent's ring raises SubscribeGapError.
    """
    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, EVENT_PLANE_TOPIC)
    sock.connect(event_plane_endpoint)
    sub = TrioSocket(sock)
    last = from_cursor
    try:
        async with connect_slot(ws_url, slot) as client:
            if publisher_id is None:
                publisher_id = (await client.status()).identity.publisher_id
            while True:
                parsed = _parse_event_plane(await sub.recv_multipart())
                if parsed is None or parsed[0] != publisher_id or not parsed[1]:
                    continue
                events = parsed[1]
                if last is not None and events[0].event_id > last + 1:
                    async for event in _repair(client, last, events[0].event_id):
                        last = event.event_id
                        yield event
                for event in events:
                    if last is None or event.event_id > last:
                        last = event.event_id
                        yield event
    finally:
        sub.close()


async def _repair(client: RecoveryClient, last: int, next_published: int) -> AsyncIterator[RouterEvent]:
    """The events after ``last`` and before ``next_published``, from the agent's ring."""
    answer = await client.recover(start=last + 1)
    if answer.kind != "events":
        raise SubscribeGapError(
            "gap_unrecoverable",
            f"events {last + 1}..{next_published - 1} are no longer buffered (answer {answer.kind}); "
            "take a full snapshot with recover(start=None)",
        )
    for event in answer.events:
        if last < event.event_id < next_published:
            yield event
