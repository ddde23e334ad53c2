"""Prometheus metrics: every component's ``statistics()`` snapshot, rendered in this one place.

The hot paths only increment plain private counters; nothing here runs per event. When ``/metrics`` is
scraped, the collector takes one frozen snapshot per component (each slot's :class:`SlotStatistics`, the
recovery server's, the event plane's, the etcd backend's) and maps its fields to metric families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import attrs
import structlog
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvagent.agent.slot import SlotAgent
from kvagent.discovery.etcd import EtcdStatistics
from kvagent.publish.zmq_plane import EventPlaneStatistics
from kvagent.recovery.protocol import ServerStatistics

__all__ = ["MetricSources", "SlotMetricsCollector", "render_metrics", "serve_metrics"]

log = structlog.get_logger(__name__)


@attrs.frozen
class MetricSources:
    """Where the collector reads its snapshots: the running slots and the process-wide components."""

    slots: Callable[[], Iterable[SlotAgent]]
    server: Callable[[], ServerStatistics] | None = None
    event_plane: Callable[[], EventPlaneStatistics] | None = None
    etcd: Callable[[], EtcdStatistics] | None = None


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(name: str, doc: str, label: str, counts: Mapping[str, int] | Mapping[int, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, count in sorted(counts.items(), key=lambda item: str(item[0])):
        family.add_metric([str(key)], count)
    return family


class _SlotFamilies:
    """The per-slot families (label ``slot``), filled from one snapshot per slot."""

    def __init__(self) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ("slot",)) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvagent_{name}", doc, labels=list(labels))

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvagent_{name}", doc, labels=["slot"])

        self.events_in = counter("events_in", "Placement events received from the listener")
        self.events_published = counter("events_published", "Outbound events handed to the sinks")
        self.dropped_events = counter(
            "dropped_events", "Raw events lost to source-cursor gaps or incomplete batches"
        )
        self.attachments = counter("attachments", "Successful attachments")
        self.restarts = counter("restarts", "Engine restarts detected in place (sequence regression)")
        self.publications = counter("publications", "Sink publications (one per chunk)")
        self.publication_failures = counter("publication_failures", "Failed sink publications")
        self.source_losses = counter("source_losses", "Unrepairable raw batches reported by the listener")
        self.ingress_chunks = counter("ingress_chunks", "Ingress chunks handled")
        self.messages = counter("messages", "Raw ZMQ messages received")
        self.decode_errors = counter("decode_errors", "Raw messages that failed to decode")
        self.gaps = counter("gaps", "Raw sequence gaps seen")
        self.repaired_batches = counter(
            "repaired_batches", "Raw batches recovered from the engine's replay buffer"
        )
        self.lost_batches = counter("lost_batches", "Raw batches that could not be repaired")
        self.filtered = counter("events_filtered", "Events filtered, by reason", ("slot", "reason"))
        self.quarantines = counter("quarantines", "Quarantines, by reason", ("slot", "reason"))
        self.cursor = gauge("outbound_cursor", "Last assigned outbound event id")
        self.ready = gauge("attachment_ready", "1 when the attachment is ready")
        self.generation = gauge("attachment_generation", "Current attachment generation")
        self.owner_ready = gauge("cache_owner_ready", "1 when CacheOwner residency is trusted")
        self.blocks = gauge("resident_blocks", "Resident blocks in the recovery index")
        self.depth = gauge("ingress_queue_depth", "Ingress chunks waiting for the coordinator")
        self.withdrawals = counter("withdrawals", "Attachment advertisements withdrawn by the supervisor")
        self.withdrawal_retries = counter(
            "withdrawal_retries", "Failed withdrawal attempts that were retried"
        )
        self.stale_withdrawals = counter(
            "stale_withdrawals", "Withdrawal requests fenced off (another generation's advertisement)"
        )
        self.required_withdrawals = counter(
            "required_withdrawals", "Withdrawals a detach or quarantine awaited"
        )

    def add(self, agent: SlotAgent) -> None:
        slot = [agent.name]
        status = agent.status()
        attachment = status.attachment
        self.cursor.add_metric(slot, status.outbound_cursor)
        self.ready.add_metric(slot, 1.0 if attachment is not None and attachment.ready else 0.0)
        self.generation.add_metric(slot, 0.0 if attachment is None else attachment.generation)
        self.owner_ready.add_metric(slot, 1.0 if status.cache_owner_ready else 0.0)
        self.blocks.add_metric(slot, agent.index.resident_block_count)
        statistics = agent.statistics()
        coordinator = statistics.coordinator
        for family, value in (
            (self.events_in, coordinator.events_in),
            (self.events_published, coordinator.events_published),
            (self.dropped_events, coordinator.dropped_events),
            (self.attachments, coordinator.attachments),
            (self.restarts, coordinator.restarts),
            (self.publications, coordinator.publications),
            (self.publication_failures, coordinator.publication_failures),
            (self.source_losses, coordinator.source_losses),
            (self.ingress_chunks, coordinator.ingress_chunks),
            (self.withdrawals, statistics.withdrawal.withdrawals),
            (self.withdrawal_retries, statistics.withdrawal.retries),
            (self.stale_withdrawals, statistics.withdrawal.stale_noops),
            (self.required_withdrawals, statistics.withdrawal.required_withdrawals),
        ):
            family.add_metric(slot, value)
        for reason, count in coordinator.filtered.items():
            self.filtered.add_metric([agent.name, reason], count)
        for reason, count in coordinator.quarantines.items():
            self.quarantines.add_metric([agent.name, reason], count)
        self.depth.add_metric(slot, coordinator.ingress_queue_depth)
        listener = statistics.listener
        if listener is not None:
            self.messages.add_metric(slot, listener.messages)
            self.decode_errors.add_metric(slot, listener.decode_errors)
            self.gaps.add_metric(slot, listener.gaps)
            self.repaired_batches.add_metric(slot, listener.repaired_batches)
            self.lost_batches.add_metric(slot, listener.lost_batches)

    def families(self) -> Iterator[Metric]:
        yield from (
            self.events_in,
            self.events_published,
            self.dropped_events,
            self.attachments,
            self.restarts,
            self.publications,
            self.publication_failures,
            self.source_losses,
            self.ingress_chunks,
            self.messages,
            self.decode_errors,
            self.gaps,
            self.repaired_batches,
            self.lost_batches,
            self.filtered,
            self.quarantines,
            self.cursor,
            self.ready,
            self.generation,
            self.owner_ready,
            self.blocks,
            self.depth,
            self.withdrawals,
            self.withdrawal_retries,
            self.stale_withdrawals,
            self.required_withdrawals,
        )


def _server_families(server: ServerStatistics) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvagent_recovery_connections_open",
        "Open recovery websocket connections",
        value=server.connections_open,
    )
    yield _counter(
        "kvagent_recovery_connections", "Accepted recovery websocket connections", server.connections_total
    )
    yield _labelled(
        "kvagent_recovery_rejected", "Refused recovery handshakes, by HTTP status", "status", server.rejected
    )
    yield _labelled("kvagent_recovery_requests", "Recovery requests, by op", "op", server.requests)
    yield _labelled(
        "kvagent_recovery_request_errors", "Recovery error responses, by code", "code", server.request_errors
    )
    yield _counter(
        "kvagent_recovery_request_seconds",
        "Seconds spent answering recovery requests (follow excluded)",
        server.request_seconds_sum,
    )


def _event_plane_families(plane: EventPlaneStatistics) -> Iterator[Metric]:
    yield _counter("kvagent_event_plane_messages_sent", "Event-plane messages sent", plane.messages_sent)
    yield _counter("kvagent_event_plane_events_sent", "Events sent on the event plane", plane.events_sent)
    yield _counter(
        "kvagent_event_plane_dropped_messages",
        "Event-plane messages dropped at the HWM",
        plane.dropped_messages,
    )
    yield _counter(
        "kvagent_event_plane_dropped_events", "Events dropped at the event-plane HWM", plane.dropped_events
    )


def _etcd_families(etcd: EtcdStatistics) -> Iterator[Metric]:
    yield _counter("kvagent_etcd_keepalives", "Successful etcd lease keepalives", etcd.keepalives)
    yield _counter("kvagent_etcd_keepalive_failures", "Failed etcd lease keepalives", etcd.keepalive_failures)
    yield _counter("kvagent_etcd_lease_losses", "etcd leases given up as lost", etcd.lease_losses)
    yield _counter("kvagent_etcd_regrants", "etcd leases granted again after a loss", etcd.regrants)
    yield _counter(
        "kvagent_etcd_reregistrations", "Records put again under a re-granted lease", etcd.reregistrations
    )
    yield _counter("kvagent_etcd_recoveries", "Re-grants whose re-registration completed", etcd.recoveries)


class SlotMetricsCollector(Collector):
    def __init__(self, sources: MetricSources) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        slots = _SlotFamilies()
        for agent in sorted(self._sources.slots(), key=lambda agent: agent.name):
            slots.add(agent)
        yield from slots.families()
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


async def _answer_scrape(stream: trio.SocketStream, sources: MetricSources) -> None:
    request = b""
    while b"\r\n\r\n" not in request and len(request) < 8192:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return
        request += chunk
    line = request.split(b"\r\n", 1)[0].split()
    if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
        body = render_metrics(sources)
        head = (
            b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        await stream.send_all(head + body)
    else:
        await stream.send_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")


async def serve_metrics(
    sources: MetricSources,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A minimal HTTP/1.0 server for ``GET /metrics`` (Prometheus scrapes need nothing more)."""

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(5):
                await _answer_scrape(stream, sources)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("metrics_request_failed")
        finally:
            await stream.aclose()

    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        task_status.started(bound_port)
