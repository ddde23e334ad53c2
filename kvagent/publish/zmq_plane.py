"""The outbound ZMQ event plane: every coordinator publication on a PUB socket.

Message: ``[b"kv-state-events-v2", publisher_id (u64 BE), first event_id (u64 BE), payload]`` where the
payload is the Dynamo-identical msgpack ``Vec<RouterEvent>``, split at event boundaries into batches of at
most 128 events and 8192 blocks.  A slow or absent subscriber never blocks the coordinator: sends are
non-blocking, drops at the high-water mark are counted, and subscribers detect gaps by event id and repair
them with the websocket ``recover`` op (``kvagent.recovery.client.subscribe`` does exactly that).  The
message format is declared in kvagent.wire.event_plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import zmq

from kvagent._util.zmqtrio import TrioSocket
from kvagent.model.errors import SinkError
from kvagent.model.events import RouterEvent
from kvagent.wire.event_plane import encode_event_plane_message, split_publication

__all__ = [
    "EventPlaneStatistics",
    "PlaneSink",
    "ZmqEventPlane",
]


@attrs.frozen(slots=True)
class EventPlaneStatistics:
    """A snapshot of the event plane's counters (all count since the plane was opened, never reset).

    Attributes:
        subscriptions: subscribe notifications seen (the first subscriber of each topic prefix).
        messages_sent: messages the PUB accepted.
        events_sent: RouterEvents in those messages.
        dropped_messages: messages dropped at the send high-water mark.
        dropped_events: RouterEvents in those messages.
    """

    subscriptions: int
    messages_sent: int
    events_sent: int
    dropped_messages: int
    dropped_events: int


class ZmqEventPlane:
    """One PUB (an XPUB, see below) per process, shared by every slot (each message names its slot's publisher id).

    Several coordinator tasks publish through this socket, but they only ever send non-blocking and
    never wait on its FD, so no task contends for it.
    """

    def __init__(
        self, endpoint: str, *, sndhwm: int = 100_000, context: zmq.Context[Any] | None = None
    ) -> None:
        ctx = context if context is not None else zmq.Context.instance()
        # An XPUB with XPUB_NODROP behaves as a PUB whose send reports EAGAIN at the high-water mark
        # instead of dropping silently, so drops can be counted (subscribers repair them via recover).
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        self.last_endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = TrioSocket(sock)
        self._subscriptions = 0
        self._messages_sent = 0
        self._events_sent = 0
        self._dropped_messages = 0
        self._dropped_events = 0

    def statistics(self) -> EventPlaneStatistics:
        return EventPlaneStatistics(
            subscriptions=self._subscriptions,
            messages_sent=self._messages_sent,
            events_sent=self._events_sent,
            dropped_messages=self._dropped_messages,
            dropped_events=self._dropped_events,
        )

    def poll_subscriptions(self) -> int:
        """Take the XPUB's pending (un)subscribe notifications; returns the subscriptions seen so far.

        Called on every publish as well: libzmq queues these notifications without bound, so a socket
        that never reads them grows with every subscriber that comes and goes.
        """
        sock = self._socket.socket
        while True:
            try:
                note = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return self._subscriptions
            except zmq.ZMQError as exc:
                raise SinkError(f"event plane receive failed: {exc}") from exc
            if note[:1] == b"\x01":
                self._subscriptions += 1

    async def wait_for_subscriber(self, count: int = 1) -> None:
        """Return once ``count`` subscriptions have reached the PUB (tests: the slow-joiner window is over).

        The caller becomes the one task waiting on the socket's FD; publishing never waits on it.
        """
        while self.poll_subscriptions() < count:
            await self._socket.wait_readable()

    def publish(self, publisher_id: int, events: Sequence[RouterEvent]) -> None:
        self.poll_subscriptions()
        for batch in split_publication(events):
            frames = encode_event_plane_message(publisher_id, batch)
            try:
                sent = self._socket.try_send_multipart(frames)
            except zmq.ZMQError as exc:
                raise SinkError(f"event plane send failed: {exc}") from exc
            if sent:
                self._messages_sent += 1
                self._events_sent += len(batch)
            else:
                self._dropped_messages += 1
                self._dropped_events += len(batch)

    def sink_for(self, publisher_id: int) -> PlaneSink:
        """The sink of the slot whose publisher id is ``publisher_id``."""
        return PlaneSink(self, publisher_id)

    def close(self) -> None:
        self._socket.close()


class PlaneSink:
    """An :class:`~kvagent.publish.sinks.EventSink` for one slot: its messages carry ``publisher_id``."""

    def __init__(self, plane: ZmqEventPlane, publisher_id: int) -> None:
        self.plane = plane
        self.publisher_id = publisher_id

    def publish(self, events: Sequence[RouterEvent]) -> None:
        self.plane.publish(self.publisher_id, events)
