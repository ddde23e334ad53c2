"""Prometheus metrics: every component's ``statistics()`` snapshot, rendered in this one place.

The hot paths only increment plain private counters; nothing here runs per event. When ``/metrics`` is
scraped, the collector takes one frozen snapshot per component (each slot's :class:`SlotStatistics`, the
recovery server's, the event plane's, the etcd backend's) and maps its fields to metric families.

The same small HTTP server answers ``/healthz`` (200 while the process serves) and ``/readyz`` (200 only if
every slot has an attachment in state ``ready``, 503 otherwise; the JSON body lists each slot's state).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial

import attrs
import structlog
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvagent._util.listen import accept_loop, shed_pending_handshakes
from kvagent.agent.slot import SlotAgent, SlotStatistics
from kvagent.discovery.etcd import EtcdStatistics
from kvagent.model.status import ATTACHMENT_STATES, DETACHED, AgentStatus
from kvagent.publish.republisher import RepublisherStatistics
from kvagent.publish.zmq_plane import EventPlaneStatistics
from kvagent.recovery.protocol import ServerStatistics
from kvagent.vllm.listener import ListenerStatistics

__all__ = [
    "SLOT_STATES",
    "MetricSources",
    "SlotMetricsCollector",
    "readiness",
    "render_metrics",
    "serve_metrics",
]

log = structlog.get_logger(__name__)

SCRAPE_TIMEOUT = 5.0  # a scrape connection that has not sent its request by then is closed

# Every value of ``AgentStatus.state``: the attachment states, and "detached" for a slot without one.
SLOT_STATES = (*ATTACHMENT_STATES, DETACHED)


@attrs.frozen
class MetricSources:
    """Where the collector reads its snapshots: the running slots and the process-wide components."""

    slots: Callable[[], Iterable[SlotAgent]]
    server: Callable[[], ServerStatistics] | None = None
    event_plane: Callable[[], EventPlaneStatistics] | None = None
    etcd: Callable[[], EtcdStatistics] | None = None


@attrs.frozen
class _SlotView:
    """One slot at one scrape: its status, its statistics snapshot and its index size."""

    name: str
    status: AgentStatus
    statistics: SlotStatistics
    resident_blocks: int

    @classmethod
    def of(cls, agent: SlotAgent) -> _SlotView:
        return cls(agent.name, agent.status(), agent.statistics(), agent.index.resident_block_count)


_Reading = Callable[[_SlotView], float | None]


def _listener(read: Callable[[ListenerStatistics], int]) -> _Reading:
    # The listener counts exist once a slot has attached; before that the family has no sample for it.
    return lambda view: None if view.statistics.listener is None else read(view.statistics.listener)


def _ready(view: _SlotView) -> float:
    attachment = view.status.attachment
    return 1.0 if attachment is not None and attachment.ready else 0.0


def _generation(view: _SlotView) -> float:
    return 0.0 if view.status.attachment is None else view.status.attachment.generation


# Per-slot families (label ``slot``): name (after ``kvagent_``), help, and how to read it from one view.
_SLOT_COUNTERS: tuple[tuple[str, str, _Reading], ...] = (
    (
        "events_in",
        "Placement events received from the listener",
        lambda v: v.statistics.coordinator.events_in,
    ),
    (
        "events_published",
        "Outbound events handed to the sinks",
        lambda v: v.statistics.coordinator.events_published,
    ),
    (
        "dropped_events",
        "Raw events lost to source-cursor gaps or incomplete batches",
        lambda v: v.statistics.coordinator.dropped_events,
    ),
    ("attachments", "Successful attachments", lambda v: v.statistics.coordinator.attachments),
    (
        "restarts",
        "Engine restarts detected in place (sequence regression)",
        lambda v: v.statistics.coordinator.restarts,
    ),
    ("publications", "Sink publications (one per chunk)", lambda v: v.statistics.coordinator.publications),
    (
        "publication_failures",
        "Failed sink publications",
        lambda v: v.statistics.coordinator.publication_failures,
    ),
    (
        "source_losses",
        "Unrepairable raw batches reported by the listener",
        lambda v: v.statistics.coordinator.source_losses,
    ),
    (
        "degradations",
        "Times the attachment went degraded (history lost, Worker reset published)",
        lambda v: v.statistics.coordinator.degradations,
    ),
    (
        "disconnects",
        "Times the attachment went disconnected (the engine's connection dropped)",
        lambda v: v.statistics.coordinator.disconnects,
    ),
    (
        "resyncs",
        "Times the attachment returned to ready from degraded or disconnected",
        lambda v: v.statistics.coordinator.resyncs,
    ),
    (
        "source_resets",
        "Worker reset barriers published for a listener's source signal",
        lambda v: v.statistics.coordinator.source_resets,
    ),
    (
        "signals_ignored",
        "Source signals for a generation that was not the open attachment",
        lambda v: v.statistics.coordinator.signals_ignored,
    ),
    ("ingress_chunks", "Ingress chunks handled", lambda v: v.statistics.coordinator.ingress_chunks),
    ("messages", "Raw ZMQ messages received", _listener(lambda listener: listener.messages)),
    (
        "decode_errors",
        "Raw messages that failed to decode",
        _listener(lambda listener: listener.decode_errors),
    ),
    ("gaps", "Raw sequence gaps seen", _listener(lambda listener: listener.gaps)),
    (
        "repaired_batches",
        "Raw batches recovered from the engine's replay buffer",
        _listener(lambda listener: listener.repaired_batches),
    ),
    (
        "lost_batches",
        "Raw batches that could not be repaired",
        _listener(lambda listener: listener.lost_batches),
    ),
    (
        "late_batches",
        "Raw batches that arrived out of order and were applied in order",
        _listener(lambda listener: listener.late),
    ),
    ("engine_disconnects", "Engine connections dropped (SUB monitor)", _listener(lambda s: s.disconnects)),
    ("replay_requests", "Replay requests sent to the engine", _listener(lambda s: s.replay_requests)),
    (
        "ingest_sheds",
        "Times queued raw batches were shed to stay under the byte bound",
        _listener(lambda s: s.sheds),
    ),
    (
        "ingest_shed_bytes",
        "Raw payload bytes shed to stay under the byte bound",
        _listener(lambda s: s.shed_bytes),
    ),
    (
        "withdrawals",
        "Attachment advertisements withdrawn by the supervisor",
        lambda v: v.statistics.withdrawal.withdrawals,
    ),
    (
        "withdrawal_retries",
        "Failed withdrawal attempts that were retried",
        lambda v: v.statistics.withdrawal.retries,
    ),
    (
        "stale_withdrawals",
        "Withdrawal requests fenced off (another generation's advertisement)",
        lambda v: v.statistics.withdrawal.stale_noops,
    ),
    (
        "required_withdrawals",
        "Withdrawals a detach or quarantine awaited",
        lambda v: v.statistics.withdrawal.required_withdrawals,
    ),
)
_SLOT_GAUGES: tuple[tuple[str, str, _Reading], ...] = (
    ("outbound_cursor", "Last assigned outbound event id", lambda v: v.status.outbound_cursor),
    ("attachment_ready", "1 when the attachment is ready", _ready),
    ("attachment_generation", "Current attachment generation", _generation),
    (
        "cache_owner_ready",
        "1 when CacheOwner residency is trusted",
        lambda v: 1.0 if v.status.cache_owner_ready else 0.0,
    ),
    ("resident_blocks", "Resident blocks in the recovery index", lambda v: v.resident_blocks),
    (
        "ingress_queue_depth",
        "Ingress chunks and signals waiting for the coordinator",
        lambda v: v.statistics.coordinator.ingress_queue_depth,
    ),
    (
        "ingress_bytes",
        "Raw payload bytes of the ingress chunks waiting for the coordinator",
        lambda v: v.statistics.coordinator.ingress_bytes,
    ),
)
# Per-slot families with a second label: (name, help, label, the counts by that label).
_SLOT_LABELLED: tuple[tuple[str, str, str, Callable[[_SlotView], Mapping[str, int]]], ...] = (
    ("events_filtered", "Events filtered, by reason", "reason", lambda v: v.statistics.coordinator.filtered),
    ("quarantines", "Quarantines, by reason", "reason", lambda v: v.statistics.coordinator.quarantines),
)


def _slot_families(views: list[_SlotView]) -> Iterator[Metric]:
    for kind, table in ((CounterMetricFamily, _SLOT_COUNTERS), (GaugeMetricFamily, _SLOT_GAUGES)):
        for name, doc, read in table:
            family = kind(f"kvagent_{name}", doc, labels=["slot"])
            for view in views:
                value = read(view)
                if value is not None:
                    family.add_metric([view.name], value)
            yield family
    for name, doc, label, counts in _SLOT_LABELLED:
        labelled = CounterMetricFamily(f"kvagent_{name}", doc, labels=["slot", label])
        for view in views:
            for key, count in counts(view).items():
                labelled.add_metric([view.name, key], count)
        yield labelled
    state = GaugeMetricFamily(
        "kvagent_attachment_state",
        "1 for the slot's attachment state (ready, degraded, disconnected, unready, detached), else 0",
        labels=["slot", "state"],
    )
    for view in views:
        current = view.status.state
        for name in SLOT_STATES:
            state.add_metric([view.name, name], 1.0 if name == current else 0.0)
    yield state


# Per-slot families of the vLLM-compatible republisher (slots that republish): name after ``kvagent_republish_``,
# help, counter (else gauge), and how to read it from the republisher's statistics.
_REPUBLISH: tuple[tuple[str, str, bool, Callable[[RepublisherStatistics], int]], ...] = (
    ("batches", "Batches published (each took the next seq)", True, lambda r: r.state.batches_published),
    ("events", "Events in the published batches", True, lambda r: r.state.events_published),
    ("batches_sent", "Live batches the PUB accepted", True, lambda r: r.batches_sent),
    ("dropped_batches", "Live batches dropped at the PUB high-water mark", True, lambda r: r.dropped_batches),
    (
        "stores_without_tokens",
        "Stores sent with empty token_ids",
        True,
        lambda r: r.state.stores_without_tokens,
    ),
    ("replay_requests", "Replay and snapshot requests", True, lambda r: r.replay_requests),
    (
        "malformed_requests",
        "Replay requests answered with just the end",
        True,
        lambda r: r.malformed_requests,
    ),
    ("refused_requests", "Replay requests refused (queue full)", True, lambda r: r.refused_requests),
    ("snapshots", "Replay answers served as snapshots", True, lambda r: r.state.snapshots_served),
    ("answers_completed", "Replay answers sent to their end marker", True, lambda r: r.answers_completed),
    (
        "answers_abandoned",
        "Replay answers abandoned (DEALER stalled or gone)",
        True,
        lambda r: r.answers_abandoned,
    ),
    ("subscriptions", "Subscriptions seen on the republish PUB", True, lambda r: r.subscriptions),
    ("answers_active", "Replay answers being sent", False, lambda r: r.answers_active),
    ("ring_batches", "Batches in the replay ring", False, lambda r: r.state.ring_batches),
    ("ring_bytes", "Payload bytes in the replay ring", False, lambda r: r.state.ring_bytes),
    ("resident_blocks", "Blocks in the snapshot mirror", False, lambda r: r.state.resident_blocks),
)


def _republish_families(views: list[_SlotView]) -> Iterator[Metric]:
    republishing = [(view.name, view.statistics.republish) for view in views if view.statistics.republish]
    for name, doc, counter, read in _REPUBLISH:
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind(f"kvagent_republish_{name}", doc, labels=["slot"])
        for slot, statistics in republishing:
            if statistics is not None:
                family.add_metric([slot], read(statistics))
        yield family


def _labelled(
    name: str, doc: str, label: str, counts: Mapping[str, int] | Mapping[int, int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, count in sorted(counts.items(), key=lambda item: str(item[0])):
        family.add_metric([str(key)], count)
    return family


def _counters(prefix: str, table: Iterable[tuple[str, str, float]]) -> Iterator[Metric]:
    for name, doc, value in table:
        yield CounterMetricFamily(f"kvagent_{prefix}_{name}", doc, value=value)


def _server_families(server: ServerStatistics) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvagent_recovery_connections_open",
        "Open recovery websocket connections",
        value=server.connections_open,
    )
    yield GaugeMetricFamily(
        "kvagent_recovery_handshakes_pending",
        "Accepted connections whose websocket handshake is not finished",
        value=server.handshakes_pending,
    )
    yield from _counters(
        "recovery",
        (
            ("connections", "Accepted recovery websocket connections", server.connections_total),
            (
                "request_seconds",
                "Seconds spent answering recovery requests (follow excluded)",
                server.request_seconds_sum,
            ),
            (
                "handshake_timeouts",
                "Connections closed for missing the handshake deadline",
                server.handshake_timeouts,
            ),
            (
                "handshakes_dropped",
                "Connections dropped in their handshake (pre-handshake limit or descriptor exhaustion)",
                server.handshakes_dropped,
            ),
            (
                "send_overruns",
                "Connections closed 1013 overrun (a frame not taken within the send deadline)",
                server.send_overruns,
            ),
            ("ping_timeouts", "Connections closed for not answering a ping in time", server.ping_timeouts),
            (
                "accept_capacity_errors",
                "accept() calls that failed for lack of descriptors or memory",
                server.accept_capacity_errors,
            ),
        ),
    )
    yield _labelled(
        "kvagent_recovery_rejected", "Refused recovery handshakes, by HTTP status", "status", server.rejected
    )
    yield _labelled("kvagent_recovery_requests", "Recovery requests, by op", "op", server.requests)
    yield _labelled(
        "kvagent_recovery_request_errors", "Recovery error responses, by code", "code", server.request_errors
    )


def _event_plane_families(plane: EventPlaneStatistics) -> Iterator[Metric]:
    yield from _counters(
        "event_plane",
        (
            ("messages_sent", "Event-plane messages sent", plane.messages_sent),
            ("events_sent", "Events sent on the event plane", plane.events_sent),
            ("dropped_messages", "Event-plane messages dropped at the HWM", plane.dropped_messages),
            ("dropped_events", "Events dropped at the event-plane HWM", plane.dropped_events),
        ),
    )


def _etcd_families(etcd: EtcdStatistics) -> Iterator[Metric]:
    yield from _counters(
        "etcd",
        (
            ("keepalives", "Successful etcd lease keepalives", etcd.keepalives),
            ("keepalive_failures", "Failed etcd lease keepalives", etcd.keepalive_failures),
            ("lease_losses", "etcd leases given up as lost", etcd.lease_losses),
            ("regrants", "etcd leases granted again after a loss", etcd.regrants),
            ("reregistrations", "Records put again under a re-granted lease", etcd.reregistrations),
            ("recoveries", "Re-grants whose re-registration completed", etcd.recoveries),
        ),
    )


class SlotMetricsCollector(Collector):
    def __init__(self, sources: MetricSources) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        views = [_SlotView.of(agent) for agent in sorted(self._sources.slots(), key=lambda agent: agent.name)]
        yield from _slot_families(views)
        yield from _republish_families(views)
        if self._sources.server is not None:
            yield from _server_families(self._sources.server())
        if self._sources.event_plane is not None:
            yield from _event_plane_families(self._sources.event_plane())
        if self._sources.etcd is not None:
            yield from _etcd_families(self._sources.etcd())


def render_metrics(sources: MetricSources) -> bytes:
    prometheus_registry = CollectorRegistry()
    prometheus_registry.register(SlotMetricsCollector(sources))
    return generate_latest(prometheus_registry)


def readiness(agents: Iterable[SlotAgent]) -> tuple[bool, dict[str, str]]:
    """Whether every slot has a ready attachment (and there is a slot at all), and each slot's state."""
    states = {agent.name: agent.status().state for agent in agents}
    return bool(states) and all(state == "ready" for state in states.values()), dict(sorted(states.items()))


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.0 " + status + b"\r\nContent-Type: " + content_type + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _answer(path: bytes, sources: MetricSources) -> bytes:
    if path == b"/metrics":
        return _response(b"200 OK", b"text/plain; version=0.0.4; charset=utf-8", render_metrics(sources))
    if path == b"/healthz":
        return _response(b"200 OK", b"text/plain; charset=utf-8", b"ok\n")
    if path == b"/readyz":
        ready, states = readiness(sources.slots())
        body = json.dumps({"ready": ready, "slots": states}).encode()
        return _response(b"200 OK" if ready else b"503 Service Unavailable", b"application/json", body)
    return b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n"


async def _answer_scrape(stream: trio.SocketStream, sources: MetricSources) -> None:
    request = b""
    while b"\r\n\r\n" not in request and len(request) < 8192:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return
        request += chunk
    line = request.split(b"\r\n", 1)[0].split()
    if len(line) >= 2 and line[0] == b"GET":
        await stream.send_all(_answer(line[1].split(b"?")[0], sources))
    else:
        await stream.send_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")


async def serve_metrics(
    sources: MetricSources,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A minimal HTTP/1.0 server for ``GET /metrics``, ``/healthz`` and ``/readyz``.

    Its accept loop is the recovery server's (:func:`kvagent._util.listen.accept_loop`): when the process
    runs out of descriptors it logs once per episode, frees the ones held by half-open websocket
    handshakes and retries, so a scrape still gets through while the websocket port is under attack.
    """

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(SCRAPE_TIMEOUT):
                await _answer_scrape(stream, sources)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("metrics_request_failed")
        finally:
            with trio.move_on_after(1, shield=True):
                await stream.aclose()

    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(
                partial(
                    accept_loop,
                    listener.accept,
                    handle,
                    nursery,
                    name="metrics",
                    shed=shed_pending_handshakes,
                )
            )
        log.info("metrics_listening", host=host, port=bound_port)
        task_status.started(bound_port)
