"""The Prometheus rendering: every family and label read from the components' statistics() snapshots."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TypeVar

import attrs
import pytest

from kvagent.agent.host import SlotState, SlotStateKind
from kvagent.agent.http_routes import answer_request
from kvagent.agent.metrics import (
    _SLOT_COUNTERS,
    _SLOT_GAUGES,
    HttpStatistics,
    MetricSources,
    readiness,
    render_metrics,
)
from kvagent.agent.slot import SlotStatistics
from kvagent.coordinator.machine import CoordinatorStatistics
from kvagent.discovery.advertisement import WithdrawalStatistics
from kvagent.discovery.etcd import EtcdStatistics
from kvagent.model.events import WorkerWithDpRank
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.publish.zmq_plane import EventPlaneStatistics
from kvagent.recovery.http import parse_request
from kvagent.recovery.protocol import ServerStatistics
from kvagent.vllm.listener import ListenerStatistics
from tests.support.ids import IDENTITY

T = TypeVar("T")

COORDINATOR = CoordinatorStatistics(
    events_in=10,
    events_published=11,
    events_out_ids=12,
    events_filtered={"attention_group": 3},
    dropped_events=4,
    quarantines={"rank mismatch": 1},
    attachments=2,
    restarts=5,
    publications=6,
    publication_failures=7,
    source_losses=8,
    ingress_chunks=9,
    ingress_queue_depth=13,
    degradations=14,
    disconnects=15,
    resyncs=16,
    source_resets=17,
    signals_ignored=18,
    ingress_bytes=19,
)
LISTENER = ListenerStatistics(
    messages=100,
    batches=101,
    decode_errors=102,
    gaps=103,
    repaired_batches=104,
    lost_batches=105,
    restarts_seen=0,
    duplicates=0,
    shed_held_batches=0,
    filtered={},
    unpublished_blocks=0,
)


class _Slot:
    """What the collector reads of a slot agent: name, status, statistics and the index size."""

    def __init__(self, name: str, *, attached: bool, state: str = "ready") -> None:
        self.name = name
        self.attached = attached
        self.state = state
        self.index = SimpleNamespace(resident_block_count=77)

    def status(self) -> AgentStatus:
        attachment = (
            AttachmentStatus(3, WorkerWithDpRank(1, 0), self.state == "ready", 5, self.state)
            if self.attached
            else None
        )
        return AgentStatus(IDENTITY, attachment, cache_owner_ready=False, outbound_cursor=99)

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(
            coordinator=COORDINATOR,
            listener=LISTENER if self.attached else None,
            withdrawal=WithdrawalStatistics(
                withdrawals=20, retries=21, stale_withdrawals=22, required_withdrawals=23
            ),
        )


def _scrape() -> set[str]:
    sources = MetricSources(
        slots=lambda: [_Slot("b", attached=True), _Slot("a", attached=False)],  # type: ignore[list-item]
        server=lambda: ServerStatistics(
            1,
            2,
            {503: 4},
            {"status": 5},
            {"internal": 6},
            1.5,
            handshakes_pending=7,
            handshake_timeouts=8,
            handshakes_dropped=9,
            send_overruns=10,
            ping_timeouts=11,
            accept_capacity_errors=12,
        ),
        event_plane=lambda: EventPlaneStatistics(
            subscriptions=1, messages_sent=30, events_sent=31, dropped_messages=32, dropped_events=33
        ),
        etcd=lambda: EtcdStatistics(
            keepalives=40,
            keepalive_failures=41,
            lease_losses=42,
            regrants=43,
            reregistrations=44,
            recoveries=45,
        ),
        http=lambda: HttpStatistics(
            connections_open=50,
            connections_total=51,
            connections_refused=52,
            requests={"dump": 53},
            responses={503: 54},
            request_timeouts=55,
            send_timeouts=56,
            dump_bytes=57,
        ),
    )
    return {line for line in render_metrics(sources).decode().splitlines() if not line.startswith("#")}


def test_each_snapshot_field_lands_in_its_family() -> None:
    samples = _scrape()
    expected = {
        'kvagent_events_in_total{slot="b"} 10.0',
        'kvagent_dropped_events_total{slot="a"} 4.0',
        'kvagent_source_losses_total{slot="b"} 8.0',
        'kvagent_ingress_queue_depth{slot="b"} 13.0',
        'kvagent_events_filtered_total{reason="attention_group",slot="b"} 3.0',
        'kvagent_quarantines_total{reason="rank mismatch",slot="a"} 1.0',
        'kvagent_outbound_cursor{slot="a"} 99.0',
        'kvagent_resident_blocks{slot="b"} 77.0',
        'kvagent_cache_owner_ready{slot="b"} 0.0',
        'kvagent_attachment_ready{slot="b"} 1.0',
        'kvagent_attachment_ready{slot="a"} 0.0',
        'kvagent_attachment_generation{slot="b"} 3.0',
        'kvagent_messages_total{slot="b"} 100.0',
        'kvagent_lost_batches_total{slot="b"} 105.0',
        'kvagent_withdrawal_retries_total{slot="a"} 21.0',
        'kvagent_degradations_total{slot="b"} 14.0',
        'kvagent_disconnects_total{slot="b"} 15.0',
        'kvagent_resyncs_total{slot="b"} 16.0',
        'kvagent_source_resets_total{slot="b"} 17.0',
        'kvagent_signals_ignored_total{slot="b"} 18.0',
        'kvagent_ingress_bytes{slot="b"} 19.0',
        'kvagent_stale_withdrawals_total{slot="b"} 22.0',
        "kvagent_recovery_connections_open 1.0",
        "kvagent_recovery_connections_total 2.0",
        'kvagent_recovery_rejected_total{status="503"} 4.0',
        'kvagent_recovery_requests_total{op="status"} 5.0',
        'kvagent_recovery_request_errors_total{code="internal"} 6.0',
        "kvagent_recovery_request_seconds_total 1.5",
        "kvagent_recovery_handshakes_pending 7.0",
        "kvagent_recovery_handshake_timeouts_total 8.0",
        "kvagent_recovery_handshakes_dropped_total 9.0",
        "kvagent_recovery_send_overruns_total 10.0",
        "kvagent_recovery_ping_timeouts_total 11.0",
        "kvagent_recovery_accept_capacity_errors_total 12.0",
        "kvagent_event_plane_events_sent_total 31.0",
        "kvagent_event_plane_dropped_events_total 33.0",
        "kvagent_etcd_keepalive_failures_total 41.0",
        "kvagent_etcd_recoveries_total 45.0",
        "kvagent_http_connections_open 50.0",
        "kvagent_http_connections_total 51.0",
        "kvagent_http_connections_refused_total 52.0",
        'kvagent_http_requests_total{route="dump"} 53.0',
        'kvagent_http_responses_total{status="503"} 54.0',
        "kvagent_http_request_timeouts_total 55.0",
        "kvagent_http_send_timeouts_total 56.0",
        "kvagent_http_dump_bytes_total 57.0",
    }
    assert expected <= samples, sorted(expected - samples)


def test_a_slot_that_never_attached_has_no_listener_samples() -> None:
    samples = _scrape()
    assert not [line for line in samples if line.startswith("kvagent_messages_total") and 'slot="a"' in line]
    assert not [line for line in samples if line.startswith("kvagent_gaps_total") and 'slot="a"' in line]


def _states(samples: set[str], slot: str) -> dict[str, float]:
    prefix = "kvagent_attachment_state{"
    found: dict[str, float] = {}
    for line in samples:
        if line.startswith(prefix) and f'slot="{slot}"' in line:
            state = line.split('state="', 1)[1].split('"', 1)[0]
            found[state] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.parametrize("state", ["ready", "degraded", "disconnected", "unready"])
def test_attachment_state_is_one_hot(state: str) -> None:
    sources = MetricSources(
        slots=lambda: [_Slot("b", attached=True, state=state), _Slot("a", attached=False)]  # type: ignore[list-item]
    )
    samples = {line for line in render_metrics(sources).decode().splitlines() if not line.startswith("#")}
    everything = {"ready", "degraded", "disconnected", "unready", "detached"}
    assert _states(samples, "b") == {name: float(name == state) for name in everything}
    assert _states(samples, "a") == {name: float(name == "detached") for name in everything}
    assert f'kvagent_attachment_ready{{slot="b"}} {float(state == "ready")}' in samples


REASONS = {
    "degraded": "history was lost: the Worker state is a subset of the engine's until it resynchronises",
    "disconnected": "the engine's connection dropped",
    "unready": "the attachment is attaching, detaching or quarantined",
    "detached": "no engine is attached",
}


def _get(sources: MetricSources, path: bytes, method: bytes = b"GET") -> tuple[int, bytes]:
    request = parse_request(method + b" " + path + b" HTTP/1.1\r\nHost: x")
    assert request is not None
    response = answer_request(sources, request)
    return response.status, response.body


@pytest.mark.parametrize(
    ("slots", "ready"),
    [
        ([("a", "ready"), ("b", "ready")], True),
        ([("a", "ready"), ("b", "degraded")], False),
        ([("a", "disconnected")], False),
        ([("a", "unready")], False),
        ([("a", None)], False),
        ([], False),
    ],
)
def test_readyz_is_200_only_when_every_slot_is_ready(
    slots: list[tuple[str, str | None]], ready: bool
) -> None:
    agents = [_Slot(name, attached=state is not None, state=state or "ready") for name, state in slots]
    sources = MetricSources(slots=lambda: agents)  # type: ignore[arg-type,return-value]
    expected = {
        "ready": ready,
        "slots": {
            name: {
                "ready": state == "ready",
                "state": state or "detached",
                "reason": REASONS.get(state or "detached"),
            }
            for name, state in slots
        },
    }
    assert readiness(agents) == (ready, expected)  # type: ignore[arg-type]
    status, body = _get(sources, b"/readyz")
    assert status == (200 if ready else 503)
    assert json.loads(body) == expected
    assert _get(sources, b"/healthz")[0] == 200
    assert _get(sources, b"/nothing")[0] == 404
    assert _get(sources, b"/readyz", b"POST")[0] == 405


def test_readyz_names_a_slot_the_host_could_not_run() -> None:
    agents = [_Slot("a", attached=True)]
    states = {
        "a": SlotState(SlotStateKind.RUNNING),
        "b": SlotState(SlotStateKind.FAILED, "engine endpoint refused"),
        "c": SlotState(SlotStateKind.STARTING),
    }
    ready, body = readiness(agents, states)  # type: ignore[arg-type]
    assert not ready
    assert body["slots"] == {
        "a": {"ready": True, "state": "ready", "reason": None},
        "b": {"ready": False, "state": "failed", "reason": "engine endpoint refused"},
        "c": {"ready": False, "state": "starting", "reason": "the slot is starting"},
    }


def _numbered(cls: type[T], start: int, **fixed: object) -> T:
    """An instance of the frozen statistics class ``cls`` whose int fields hold distinct values."""
    values: dict[str, object] = {}
    for offset, field in enumerate(attrs.fields(cls)):  # type: ignore[arg-type]
        if field.name in fixed:
            values[field.name] = fixed[field.name]
        elif field.type in (int, "int"):
            values[field.name] = start + offset
    return cls(**values)


def test_each_slot_counter_has_one_name_from_statistics_to_metric() -> None:
    """A counter is called the same in its component's statistics() and in its metric family (issue #26
    item 7): reading each family back from statistics whose fields all differ finds the field of that name."""
    coordinator = _numbered(CoordinatorStatistics, 1000, events_filtered={}, quarantines={})
    listener = _numbered(ListenerStatistics, 2000, filtered={})
    withdrawal = _numbered(WithdrawalStatistics, 3000)
    stats = SlotStatistics(coordinator=coordinator, listener=listener, withdrawal=withdrawal)
    view = SimpleNamespace(statistics=stats)
    by_value = {
        getattr(component, field.name): (prefix, field.name)
        for component, prefix in ((coordinator, ""), (listener, ""), (withdrawal, "withdrawal_"))
        for field in attrs.fields(type(component))
        if isinstance(getattr(component, field.name), int)
    }
    for family, _help, read in (*_SLOT_COUNTERS, *_SLOT_GAUGES):
        try:
            value = read(view)  # type: ignore[arg-type]
        except AttributeError:
            continue  # a gauge read from the status or the index, not from statistics()
        if value not in by_value:
            continue
        prefix, field_name = by_value[value]
        assert family in (field_name, prefix + field_name), (
            f"kvagent_{family} reads the statistic {field_name!r}: one counter, two names"
        )
