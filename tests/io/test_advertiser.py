"""The attachment advertiser (agent/advertising.py): the one task that registers and withdraws a slot's
attachment ad, against a real MemoryDiscovery and StatusCell.

Tests that involve backoff use pytest-trio's ``autojump_clock``: sleeps are instant and the backend records
each attempt's virtual time, so the backoff sequence is asserted exactly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import structlog.testing
import trio
import trio.testing

from kvagent.agent.advertising import AttachmentAdvertiser
from kvagent.coordinator.task import StatusCell
from kvagent.discovery.base import DiscoveryRecord
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.errors import DiscoveryError
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC, WorkerWithDpRank
from kvagent.model.ids import CacheOwnerId, KvStateAgentIdentity
from kvagent.model.status import AgentStatus, Attachment, AttachmentSource

OWNER = "ca8ed73fce11e9fdc547145070b9d5b7:7b61e56677a8609fec55d20fb2e1d8aa/0000000000000000/958f1c743b21ca2e5b5f1fd1ac4118ec"
IDENTITY = KvStateAgentIdentity(CacheOwnerId.parse(OWNER), 41)


def attachment(generation: int) -> Attachment:
    return Attachment(
        WorkerWithDpRank(17, 0), AttachmentSource("tcp://127.0.0.1:9"), generation=generation, ready=True
    )


class Rig:
    def __init__(self, discovery: MemoryDiscovery) -> None:
        self.discovery = discovery
        self.status = StatusCell(AgentStatus(IDENTITY))
        self.advertiser = AttachmentAdvertiser(
            identity=IDENTITY,
            kv_state_endpoint="tcp://127.0.0.1:5600",
            recovery_url=None,
            discovery=discovery,
            status=self.status,
        )

    def set_ready(self, generation: int, *, ready: bool = True, cursor: int = 0) -> Attachment:
        attached = attrs.evolve(attachment(generation), ready=ready, ready_at_outbound_cursor=cursor)
        self.status.set(AgentStatus(IDENTITY, attached.status()))
        return attached

    def ad(self, generation: int, cursor: int = 0) -> DiscoveryRecord:
        return self.advertiser.record_for(attachment(generation), cursor)

    def ads(self) -> list[DiscoveryRecord]:
        return [
            record for record in self.discovery.records.values() if record.topic == KV_STATE_ATTACHMENTS_TOPIC
        ]


@asynccontextmanager
async def running(discovery: MemoryDiscovery | None = None) -> AsyncIterator[Rig]:
    rig = Rig(discovery if discovery is not None else MemoryDiscovery())
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.advertiser.run)
        yield rig
        await rig.advertiser.stop()  # it ends by itself once nothing is registered


def gaps(times: list[float]) -> list[float]:
    return [round(later - earlier, 9) for earlier, later in zip(times, times[1:], strict=False)]


async def test_the_open_attachment_is_advertised_while_ready_at_its_cursor() -> None:
    with trio.fail_after(5):
        async with running() as rig:
            rig.advertiser.open(rig.set_ready(1, cursor=3))
            await rig.advertiser.wait_registration(1)
            assert rig.ads() == [rig.ad(1, 3)]
            rig.set_ready(1, ready=False)  # degraded: the coordinator asks for the withdrawal
            rig.advertiser.request_withdrawal(1)
            await rig.discovery.wait_for(lambda records: not records)
            rig.set_ready(1, cursor=8)  # ready again, at a new cursor
            await rig.discovery.wait_for(lambda records: bool(records))
            assert rig.ads() == [rig.ad(1, 8)]
        assert rig.ads() == []  # the stop withdrew it
        statistics = rig.advertiser.statistics()
        assert (statistics.registrations, statistics.withdrawals, statistics.required_withdrawals) == (
            2,
            2,
            1,
        )


async def test_a_withdrawal_request_of_another_generation_is_fenced_off() -> None:
    with trio.fail_after(5):
        async with running() as rig:
            rig.advertiser.open(rig.set_ready(2))
            await rig.advertiser.wait_registration(2)
            rig.advertiser.request_withdrawal(1)  # a late request about an older attachment
            await trio.testing.wait_all_tasks_blocked()
            assert rig.ads() == [rig.ad(2)]
            assert rig.advertiser.statistics().stale_withdrawals == 1


async def test_a_closed_generation_is_withdrawn_and_never_advertised_again() -> None:
    with trio.fail_after(5):
        async with running() as rig:
            rig.advertiser.open(rig.set_ready(1))
            await rig.advertiser.wait_registration(1)
            rig.advertiser.close(1)
            await rig.advertiser.wait_withdrawn(1)
            assert rig.ads() == []
            rig.set_ready(1, cursor=5)  # a late readiness of the closed generation
            await trio.testing.wait_all_tasks_blocked()
            assert rig.ads() == [] and rig.advertiser.record is None


async def withdraw_through_failures(discovery: MemoryDiscovery, failures: int) -> Rig:
    """Advertise generation 1, fail the next ``failures`` unregisters, close it and wait until it is withdrawn."""
    async with running(discovery) as rig:
        rig.advertiser.open(rig.set_ready(1))
        await rig.advertiser.wait_registration(1)
        discovery.fail_next(failures, on=("unregister",))
        rig.advertiser.close(1)
        await rig.advertiser.wait_withdrawn(1)
    return rig


async def test_failed_withdrawals_are_retried_with_backoff(autojump_clock: trio.testing.MockClock) -> None:
    discovery = MemoryDiscovery()
    with structlog.testing.capture_logs() as logs:
        rig = await withdraw_through_failures(discovery, 3)
    attempts = [a for a in discovery.attempts if a.operation == "unregister"]
    assert [a.failed for a in attempts] == [True, True, True, False]
    assert gaps([a.at for a in attempts]) == [0.1, 0.2, 0.4]
    assert rig.advertiser.statistics().retries == 3
    assert [(e["event"], e["generation"]) for e in logs if e["log_level"] == "warning"] == [
        ("withdrawal_retry", 1)
    ] * 3


async def test_backoff_is_capped_at_five_seconds(autojump_clock: trio.testing.MockClock) -> None:
    discovery = MemoryDiscovery()
    await withdraw_through_failures(discovery, 8)
    assert gaps(discovery.attempt_times("unregister")) == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


async def test_a_failed_registration_is_reported_to_the_waiter_and_retried() -> None:
    discovery = MemoryDiscovery()
    with trio.fail_after(5):
        async with running(discovery) as rig:
            discovery.fail_next(1, on=("register",))
            rig.advertiser.open(rig.set_ready(1))
            with pytest.raises(DiscoveryError):
                await rig.advertiser.wait_registration(1)
            await discovery.wait_for(lambda records: bool(records))  # the retry got through
            assert rig.ads() == [rig.ad(1)]


class HangingRegistration(MemoryDiscovery):
    """Registers the record, then never answers (an etcd that applied the write and stopped replying)."""

    async def register(self, record: DiscoveryRecord) -> None:
        await super().register(record)
        if record.topic == KV_STATE_ATTACHMENTS_TOPIC:
            await trio.sleep_forever()


async def test_closing_cancels_a_hung_registration_and_withdraws_what_it_may_have_registered() -> None:
    discovery = HangingRegistration()
    with trio.fail_after(5):
        async with running(discovery) as rig:
            rig.advertiser.open(rig.set_ready(1))
            await discovery.wait_for(lambda records: bool(records))
            assert rig.advertiser.record == rig.ad(1)
            rig.advertiser.close(1)  # never waits behind discovery
            await rig.advertiser.wait_withdrawn(1)
            assert rig.ads() == []


async def test_cancellation_stops_the_retries(autojump_clock: trio.testing.MockClock) -> None:
    discovery = MemoryDiscovery()
    rig = Rig(discovery)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.advertiser.run)
        rig.advertiser.open(rig.set_ready(1))
        await rig.advertiser.wait_registration(1)
        discovery.set_failing(True, on=("unregister",))
        await rig.advertiser.stop()
        await discovery.wait_for_attempts(3, "unregister")
        cancelled_at = trio.current_time()
        nursery.cancel_scope.cancel()
    assert max(discovery.attempt_times("unregister")) <= cancelled_at
    assert rig.advertiser.record == rig.ad(1)  # not withdrawn, and not forgotten
