"""Prometheus metrics and readiness: every component's ``statistics()`` snapshot, rendered in this one place.

The hot paths only increment plain private counters; nothing here runs per event. When ``/metrics`` is
scraped, the collector takes one frozen snapshot per component (each slot's :class:`SlotStatistics`, the
recovery server's, the event plane's, the etcd backend's, the HTTP surface's) and maps its fields to metric
families.  :func:`readiness` is what ``/readyz`` answers.  The routes are
:mod:`kvagent.agent.http_routes`, the HTTP server :mod:`kvagent.recovery.http`.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator, Mapping

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvagent import __version__
from kvagent._util.latency import LatencySnapshot
from kvagent.agent.host import SlotState, SlotStateKind
from kvagent.agent.slot import SlotAgent, SlotStatistics
from kvagent.discovery.etcd import EtcdStatistics
from kvagent.model.status import ATTACHMENT_STATES, DETACHED, AgentStatus
from kvagent.persist.writer import PersistenceState, PersistenceStatistics
from kvagent.publish.republisher import RepublisherStatistics
from kvagent.publish.zmq_plane import EventPlaneStatistics
from kvagent.recovery.http import HttpStatistics
from kvagent.recovery.protocol import ServerStatistics
from kvagent.stream.writer import StreamWriterStatistics
from kvagent.vllm.listener import ListenerStatistics

__all__ = [
    "SLOT_STATES",
    "HttpStatistics",
    "MetricSources",
    "SlotMetricsCollector",
    "readiness",
    "render_metrics",
]

# Every value of ``AgentStatus.state``: the attachment states, and "detached" for a slot without one.
SLOT_STATES = (*ATTACHMENT_STATES, DETACHED)


@attrs.frozen
class MetricSources:
    """Where the collector reads its snapshots: the running slots and the process-wide components."""

    slots: Callable[[], Iterable[SlotAgent]]
    server: Callable[[], ServerStatistics] | None = None
    event_plane: Callable[[], EventPlaneStatistics] | None = None
    etcd: Callable[[], EtcdStatistics] | None = None
    http: Callable[[], HttpStatistics] | None = None
    # The host's record of every slot it was asked to run (starting, failed, stopped ones included), so
    # /readyz names a slot that is not running; None: only the running slots count.
    slot_states: Callable[[], Mapping[str, SlotState]] | None = None


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
        _listener(lambda listener: listener.late_batches),
    ),
    (
        "engine_disconnects",
        "Engine connections dropped (SUB monitor)",
        _listener(lambda s: s.engine_disconnects),
    ),
    ("replay_requests", "Replay requests sent to the engine", _listener(lambda s: s.replay_requests)),
    (
        "ingest_sheds",
        "Times queued raw batches were shed to stay under the byte bound",
        _listener(lambda s: s.ingest_sheds),
    ),
    (
        "ingest_shed_bytes",
        "Raw payload bytes shed to stay under the byte bound",
        _listener(lambda s: s.ingest_shed_bytes),
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
        lambda v: v.statistics.withdrawal.stale_withdrawals,
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
        "engine_connected",
        "1 while the slot's SUB is connected to the attached engine's PUB (0: never met, or dropped)",
        lambda v: None if v.statistics.engine_connected is None else float(v.statistics.engine_connected),
    ),
    (
        "slot_last_event_age_seconds",
        "Seconds since the attached engine's last live message reached the slot (absent before the first)",
        lambda v: v.status.last_event_age_s,
    ),
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
    (
        "events_filtered",
        "Events filtered, by reason",
        "reason",
        lambda v: v.statistics.coordinator.events_filtered,
    ),
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
    apply = HistogramMetricFamily(
        "kvagent_ingest_apply_latency_seconds",
        "Seconds the coordinator spent applying one drain of ingress (up to 8 chunks)",
        labels=["slot"],
    )
    for view in views:
        if view.statistics.apply_latency is not None:
            _add_histogram(apply, [view.name], view.statistics.apply_latency)
    yield apply


def _add_histogram(family: HistogramMetricFamily, labels: list[str], snapshot: LatencySnapshot) -> None:
    family.add_metric(labels, snapshot.cumulative(), snapshot.sum)


def _build_info() -> GaugeMetricFamily:
    info = GaugeMetricFamily(
        "kvagent_build_info", "Always 1: the kvagent and Python versions", labels=["version", "python"]
    )
    info.add_metric([__version__, platform.python_version()], 1.0)
    return info


# Per-slot families of the vLLM-compatible republisher (slots that republish): name after ``kvagent_republish_``,
# help, counter (else gauge), and how to read it from the republisher's statistics.
_REPUBLISH: tuple[tuple[str, str, bool, Callable[[RepublisherStatistics], int]], ...] = (
    ("batches", "Batches published (each took the next seq)", True, lambda r: r.state.batches),
    ("events", "Events in the published batches", True, lambda r: r.state.events),
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
    ("snapshots_served", "Replay answers served as snapshots", True, lambda r: r.state.snapshots_served),
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


# Per-slot families of the state directory (slots that persist): name after ``kvagent_persistence_``.
_PERSISTENCE: tuple[tuple[str, str, bool, Callable[[PersistenceStatistics], int]], ...] = (
    (
        "failed",
        "1 while writes to the state file fail (serving from memory, retrying)",
        False,
        lambda p: int(p.state is PersistenceState.FAILED),
    ),
    ("persisted_id", "Newest outbound event id in the state file", False, lambda p: p.persisted_id),
    ("lag_events", "Applied outbound ids not yet in the state file", False, lambda p: p.lag_events),
    ("disk_bytes", "Bytes of the state file (with its WAL)", False, lambda p: p.disk_bytes),
    ("lease_end", "End of the leased outbound id block (ids stay below it)", False, lambda p: p.lease_end),
    ("appends", "Append transactions committed", True, lambda p: p.appends),
    ("snapshots", "Compacted snapshots written", True, lambda p: p.snapshots),
    ("failures", "Writes that failed (each retried with back-off)", True, lambda p: p.failures),
)


def _persistence_families(views: list[_SlotView]) -> Iterator[Metric]:
    persisting = [(view.name, view.statistics.persistence) for view in views]
    for name, doc, counter, read in _PERSISTENCE:
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind(f"kvagent_persistence_{name}", doc, labels=["slot"])
        for slot, statistics in persisting:
            if statistics is not None:
                family.add_metric([slot], read(statistics))
        yield family


# Per-slot families of the Redis/Valkey stream writer (slots with ``--stream``): name after ``kvagent_stream_``.
_STREAM: tuple[tuple[str, str, bool, Callable[[StreamWriterStatistics], int]], ...] = (
    ("connected", "1 while the last call to Redis succeeded", False, lambda s: int(s.connected)),
    ("lag_events", "Outbound ids not yet in the stream", False, lambda s: s.lag_events),
    ("written_cursor", "Every event up to this cursor is in the stream", False, lambda s: s.written_cursor),
    ("entries", "Event entries appended", True, lambda s: s.entries),
    ("snapshots", "Snapshots written (refreshes and resets)", True, lambda s: s.snapshots),
    ("resets", "Snapshots written because the ring no longer covered the gap", True, lambda s: s.resets),
    ("failures", "Redis calls that failed (each retried with back-off)", True, lambda s: s.failures),
)


def _stream_families(views: list[_SlotView]) -> Iterator[Metric]:
    streaming = [(view.name, view.statistics.stream) for view in views if view.statistics.stream]
    for name, doc, counter, read in _STREAM:
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind(f"kvagent_stream_{name}", doc, labels=["slot"])
        for slot, statistics in streaming:
            if statistics is not None:
                family.add_metric([slot], read(statistics))
        yield family


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
    latency = HistogramMetricFamily(
        "kvagent_recovery_request_latency_seconds",
        "Seconds to answer one recovery request, by op (follow excluded)",
        labels=["op"],
    )
    for op, snapshot in sorted(server.request_latency.items()):
        _add_histogram(latency, [op], snapshot)
    yield latency


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


def _http_families(http: HttpStatistics) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvagent_http_connections_open", "Open HTTP connections", value=http.connections_open
    )
    yield from _counters(
        "http",
        (
            ("connections", "Accepted HTTP connections", http.connections_total),
            ("connections_refused", "HTTP connections refused (too many open)", http.connections_refused),
            ("request_timeouts", "HTTP requests not received within the deadline", http.request_timeouts),
            ("send_timeouts", "HTTP answers abandoned: the client stopped reading", http.send_timeouts),
            ("dump_bytes", "Body bytes of HTTP tree dumps sent", http.dump_bytes),
        ),
    )
    yield _labelled("kvagent_http_requests", "HTTP requests, by route", "route", http.requests)
    yield _labelled("kvagent_http_responses", "HTTP responses, by status code", "status", http.responses)


class SlotMetricsCollector(Collector):
    def __init__(self, sources: MetricSources) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        views = [_SlotView.of(agent) for agent in sorted(self._sources.slots(), key=lambda agent: agent.name)]
        yield _build_info()
        yield from _slot_families(views)
        yield from _republish_families(views)
        yield from _persistence_families(views)
        yield from _stream_families(views)
        if self._sources.server is not None:
            yield from _server_families(self._sources.server())
        if self._sources.event_plane is not None:
            yield from _event_plane_families(self._sources.event_plane())
        if self._sources.etcd is not None:
            yield from _etcd_families(self._sources.etcd())
        if self._sources.http is not None:
            yield from _http_families(self._sources.http())


def render_metrics(sources: MetricSources) -> bytes:
    prometheus_registry = CollectorRegistry()
    prometheus_registry.register(SlotMetricsCollector(sources))
    return generate_latest(prometheus_registry)


# Why a slot in each state is not ready (what /readyz says of it).
_NOT_READY_REASONS = {
    DETACHED: "no engine is attached",
    "unready": "the attachment is attaching, detaching or quarantined",
    "degraded": "history was lost: the Worker state is a subset of the engine's until it resynchronises",
    "disconnected": "the engine's connection dropped",
}


def _slot_readiness(status: AgentStatus) -> dict[str, object]:
    state = status.state
    ready = state == "ready"
    return {"ready": ready, "state": state, "reason": None if ready else _NOT_READY_REASONS[state]}


def _host_readiness(state: SlotState) -> dict[str, object]:
    reason = state.error if state.error else f"the slot is {state.kind.value}"
    return {"ready": False, "state": state.kind.value, "reason": reason}


def readiness(
    agents: Iterable[SlotAgent], slot_states: Mapping[str, SlotState] | None = None
) -> tuple[bool, dict[str, object]]:
    """Whether every slot is attached and ready (neither degraded nor disconnected), and the /readyz body.

    The body is ``{"ready": bool, "slots": {name: {"ready", "state", "reason"}}}``; ``reason`` is None for a
    ready slot.  A slot the host knows but is not running (starting, failed, stopped) is not ready, with
    its error as the reason.  No slot at all is not ready either: there is nothing to route to.
    """
    slots: dict[str, dict[str, object]] = {agent.name: _slot_readiness(agent.status()) for agent in agents}
    for name, state in (slot_states or {}).items():
        if name not in slots and state.kind is not SlotStateKind.RUNNING:
            slots[name] = _host_readiness(state)
    ready = bool(slots) and all(entry["ready"] for entry in slots.values())
    return ready, {"ready": ready, "slots": dict(sorted(slots.items()))}
