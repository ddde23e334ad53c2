"""The Prometheus rendering: every family and label read from the components' statistics() snapshots."""

from __future__ import annotations

from types import SimpleNamespace

from kvagent.agent.metrics import MetricSources, render_metrics
from kvagent.agent.slot import SlotStatistics
from kvagent.coordinator.machine import CoordinatorStatistics
from kvagent.discovery.etcd import EtcdStatistics
from kvagent.discovery.withdrawal import WithdrawalStatistics
from kvagent.model.events import WorkerWithDpRank
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.publish.zmq_plane import EventPlaneStatistics
from kvagent.recovery.protocol import ServerStatistics
from kvagent.vllm.listener import ListenerStatistics
from tests.support.ids import IDENTITY

COORDINATOR = CoordinatorStatistics(
    events_in=10,
    events_published=11,
    events_out_ids=12,
    filtered={"attention_group": 3},
    dropped_events=4,
    quarantines={"rank mismatch": 1},
    attachments=2,
    restarts=5,
    publications=6,
    publication_failures=7,
    source_losses=8,
    ingress_chunks=9,
    ingress_queue_depth=13,
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
    reorder_overflows=0,
    filtered={},
    unpublished_blocks=0,
)


class _Slot:
    """What the collector reads of a slot agent: name, status, statistics and the index size."""

    def __init__(self, name: str, *, attached: bool) -> None:
        self.name = name
        self.attached = attached
        self.index = SimpleNamespace(resident_block_count=77)

    def status(self) -> AgentStatus:
        attachment = AttachmentStatus(3, WorkerWithDpRank(1, 0), True, 5) if self.attached else None
        return AgentStatus(IDENTITY, attachment, cache_owner_ready=False, outbound_cursor=99)

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(
            coordinator=COORDINATOR,
            listener=LISTENER if self.attached else None,
            withdrawal=WithdrawalStatistics(withdrawals=20, retries=21, stale_noops=22, required_withdrawals=23),
        )


def _scrape() -> set[str]:
    sources = MetricSources(
        slots=lambda: [_Slot("b", attached=True), _Slot("a", attached=False)],  # type: ignore[list-item]
        server=lambda: ServerStatistics(1, 2, {503: 4}, {"status": 5}, {"internal": 6}, 1.5),
        event_plane=lambda: EventPlaneStatistics(
            subscriptions=1, messages_sent=30, events_sent=31, dropped_messages=32, dropped_events=33
        ),
        etcd=lambda: EtcdStatistics(
            keepalives=40, keepalive_failures=41, lease_losses=42, regrants=43, reregistrations=44, recoveries=45
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
        'kvagent_stale_withdrawals_total{slot="b"} 22.0',
        "kvagent_recovery_connections_open 1.0",
        "kvagent_recovery_connections_total 2.0",
        'kvagent_recovery_rejected_total{status="503"} 4.0',
        'kvagent_recovery_requests_total{op="status"} 5.0',
        'kvagent_recovery_request_errors_total{code="internal"} 6.0',
        "kvagent_recovery_request_seconds_total 1.5",
        "kvagent_event_plane_events_sent_total 31.0",
        "kvagent_event_plane_dropped_events_total 33.0",
        "kvagent_etcd_keepalive_failures_total 41.0",
        "kvagent_etcd_recoveries_total 45.0",
    }
    assert expected <= samples, sorted(expected - samples)


def test_a_slot_that_never_attached_has_no_listener_samples() -> None:
    samples = _scrape()
    assert not [line for line in samples if line.startswith("kvagent_messages_total") and 'slot="a"' in line]
    assert not [line for line in samples if line.startswith("kvagent_gaps_total") and 'slot="a"' in line]
