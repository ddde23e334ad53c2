"""The outbound event plane's message format, declared once (the ZMQ PUB side and ``subscribe`` both use it).

A message is four frames: ``[b"kv-state-events-v2", publisher_id (u64 BE), first event_id (u64 BE),
payload]``; the payload is the Dynamo-identical msgpack ``Vec<RouterEvent>`` of one batch.  A publication is
split at event boundaries into batches of at most 128 events and 8192 blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvagent.model.errors import CodecError
from kvagent.model.events import (
    KV_STATE_EVENTS_TOPIC,
    MAX_CHUNK_BLOCKS,
    MAX_CHUNK_EVENTS,
    RouterEvent,
    block_count,
)
from kvagent.wire.router_event import decode_router_events, encode_router_events

__all__ = [
    "EVENT_PLANE_TOPIC",
    "decode_event_plane_message",
    "encode_event_plane_message",
    "is_event_plane_message",
    "split_publication",
]

EVENT_PLANE_TOPIC = KV_STATE_EVENTS_TOPIC.encode()


def split_publication(
    events: Sequence[RouterEvent], max_events: int = MAX_CHUNK_EVENTS, max_blocks: int = MAX_CHUNK_BLOCKS
) -> list[Sequence[RouterEvent]]:
    """Split at event boundaries; a single event larger than the block bound goes alone."""
    batches: list[Sequence[RouterEvent]] = []
    start = 0
    blocks = 0
    for i, event in enumerate(events):
        size = block_count(event.data)
        if i > start and (i - start >= max_events or blocks + size > max_blocks):
            batches.append(events[start:i])
            start, blocks = i, 0
        blocks += size
    if start < len(events):
        batches.append(events[start:])
    return batches


def encode_event_plane_message(publisher_id: int, batch: Sequence[RouterEvent]) -> list[bytes]:
    """The frames of one non-empty batch (one of :func:`split_publication`'s)."""
    return [
        EVENT_PLANE_TOPIC,
        publisher_id.to_bytes(8, "big"),
        batch[0].event_id.to_bytes(8, "big"),
        encode_router_events(batch),
    ]


def is_event_plane_message(frames: Sequence[bytes]) -> bool:
    """True when the frames have the shape of a kv-state-events-v2 message (the payload is not checked)."""
    return len(frames) == 4 and frames[0] == EVENT_PLANE_TOPIC and len(frames[1]) == 8 and len(frames[2]) == 8


def decode_event_plane_message(frames: Sequence[bytes]) -> tuple[int, int, list[RouterEvent]]:
    """``(publisher_id, first_event_id, events)`` of one message; CodecError (a ValueError) if malformed."""
    if not is_event_plane_message(frames):
        raise CodecError(
            "not a kv-state-events-v2 message: expected [topic, publisher_id(8), event_id(8), payload]"
        )
    events = decode_router_events(frames[3])
    first = int.from_bytes(frames[2], "big")
    if events and events[0].event_id != first:
        raise CodecError(f"first event id {events[0].event_id} does not match the header {first}")
    return int.from_bytes(frames[1], "big"), first, events
