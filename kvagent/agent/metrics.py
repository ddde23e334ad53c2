"""Prometheus metrics, collected at scrape time from the plain counters each component keeps.

The hot paths only increment attributes of plain objects; nothing here runs per event. A custom
collector walks the slot registry when ``/metrics`` is scraped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvagent.recovery.protocol import ServerStatistics, SlotDirectory

__all__ = ["SlotMetricsCollector", "render_metrics", "serve_metrics"]

log = logging.getLogger(__name__)

_COORDINATOR_COUNTERS = {
    "events_in": "Placement events received from the listener",
    "events_published": "Outbound events handed to the sinks",
    "dropped_events": "Raw events lost to source-cursor gaps or incomplete batches",
    "attachments": "Successful attachments",
    "restarts": "Engine restarts detected in place (sequence regression)",
    "publications": "Sink publications (one per chunk)",
    "publication_failures": "Failed sink publications",
    "source_losses": "Unrepairable raw batches reported by the listener",
    "ingress_chunks": "Ingress chunks handled",
}
_LISTENER_COUNTERS = {
    "messages": "Raw ZMQ messages received",
    "decode_errors": "Raw messages that failed to decode",
    "gaps": "Raw sequence gaps seen",
    "repaired_batches": "Raw batches recovered from the engine's replay buffer",
    "lost_batches": "Raw batches that could not be repaired",
}


def _value(obj: object, name: str) -> float | None:
    value = getattr(obj, name, None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class SlotMetricsCollector(Collector):
    def __init__(self, registry: SlotDirectory, extra: list[Any] | None = None) -> None:
        self._registry = registry
        self._extra = extra or []

    def collect(self) -> Iterator[Metric]:
        surfaces = [self._registry.get(name) for name in self._registry.names()]
        agents = [s for s in surfaces if s is not None]
        families: dict[str, CounterMetricFamily] = {}
        for name, doc in {**_COORDINATOR_COUNTERS, **_LISTENER_COUNTERS}.items():
            families[name] = CounterMetricFamily(f"kvagent_{name}", doc, labels=["slot"])
        filtered = CounterMetricFamily("kvagent_events_filtered", "Events filtered, by reason", labels=["slot", "reason"])
        quarantines = CounterMetricFamily("kvagent_quarantines", "Quarantines, by reason", labels=["slot", "reason"])
        cursor = GaugeMetricFamily("kvagent_outbound_cursor", "Last assigned outbound event id", labels=["slot"])
        ready = GaugeMetricFamily("kvagent_attachment_ready", "1 when the attachment is ready", labels=["slot"])
        generation = GaugeMetricFamily("kvagent_attachment_generation", "Current attachment generation", labels=["slot"])
        owner_ready = GaugeMetricFamily("kvagent_cache_owner_ready", "1 when CacheOwner residency is trusted", labels=["slot"])
        blocks = GaugeMetricFamily("kvagent_resident_blocks", "Resident blocks in the recovery index", labels=["slot"])
        depth = GaugeMetricFamily("kvagent_ingress_queue_depth", "Ingress chunks waiting for the coordinator", labels=["slot"])
        for agent in agents:
            slot = agent.name
            status = agent.status()
            cursor.add_metric([slot], status.outbound_cursor)
            attachment = status.attachment
            ready.add_metric([slot], 1.0 if attachment is not None and attachment.ready else 0.0)
            generation.add_metric([slot], 0.0 if attachment is None else attachment.generation)
            owner_ready.add_metric([slot], 1.0 if status.cache_owner_ready else 0.0)
            blocks.add_metric([slot], agent.index.resident_block_count)
            core = getattr(agent, "core", None)
            counters = getattr(core, "counters", None)
            if counters is not None:
                for name in _COORDINATOR_COUNTERS:
                    value = _value(counters, name)
                    if value is not None:
                        families[name].add_metric([slot], value)
                for reason, count in dict(getattr(counters, "filtered", {})).items():
                    filtered.add_metric([slot, str(reason)], count)
                for reason, count in dict(getattr(counters, "quarantines", {})).items():
                    quarantines.add_metric([slot, str(reason)], count)
            queue_depth = getattr(core, "ingress_queue_depth", None)
            if callable(queue_depth):
                depth.add_metric([slot], float(queue_depth()))
            stats = getattr(agent, "listener_stats", None)
            if stats is not None:
                for name in _LISTENER_COUNTERS:
                    value = _value(stats, name)
                    if value is not None:
                        families[name].add_metric([slot], value)
        yield from families.values()
        yield from (filtered, quarantines, cursor, ready, generation, owner_ready, blocks, depth)
        for source in self._extra:
            snapshot = source.statistics() if hasattr(source, "statistics") else None
            if isinstance(snapshot, ServerStatistics):
                yield from _server_families(snapshot)
            else:
                yield from source.collect_metrics()


def _server_families(stats: ServerStatistics) -> Iterator[Metric]:
    """The recovery server's families, from its statistics snapshot."""
    yield GaugeMetricFamily(
        "kvagent_recovery_connections_open", "Open recovery websocket connections", value=stats.connections_open
    )
    yield CounterMetricFamily(
        "kvagent_recovery_connections", "Accepted recovery websocket connections", value=stats.connections_total
    )
    rejected = CounterMetricFamily(
        "kvagent_recovery_rejected", "Refused recovery handshakes, by HTTP status", labels=["status"]
    )
    for status_code, count in sorted(stats.rejected.items()):
        rejected.add_metric([str(status_code)], count)
    yield rejected
    requests = CounterMetricFamily("kvagent_recovery_requests", "Recovery requests, by op", labels=["op"])
    for op, count in sorted(stats.requests.items()):
        requests.add_metric([op], count)
    yield requests
    errors = CounterMetricFamily(
        "kvagent_recovery_request_errors", "Recovery error responses, by code", labels=["code"]
    )
    for code, count in sorted(stats.request_errors.items()):
        errors.add_metric([code], count)
    yield errors
    yield CounterMetricFamily(
        "kvagent_recovery_request_seconds",
        "Seconds spent answering recovery requests (follow excluded)",
        value=stats.request_seconds_sum,
    )


def render_metrics(registry: SlotDirectory, extra: list[Any] | None = None) -> bytes:
    prometheus_registry = CollectorRegistry()
    prometheus_registry.register(SlotMetricsCollector(registry, extra))
    return generate_latest(prometheus_registry)


async def serve_metrics(
    registry: SlotDirectory,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    extra: list[Any] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A minimal HTTP/1.0 server for ``GET /metrics`` (Prometheus scrapes need nothing more)."""

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(5):
                request = b""
                while b"\r\n\r\n" not in request and len(request) < 8192:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return
                    request += chunk
                line = request.split(b"\r\n", 1)[0].split()
                if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
                    body = render_metrics(registry, extra)
                    head = (
                        b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                    )
                    await stream.send_all(head + body)
                else:
                    await stream.send_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("metrics request failed")
        finally:
            await stream.aclose()

    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        task_status.started(bound_port)
