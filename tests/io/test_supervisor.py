"""Required withdrawal (7.4 step 2) and the generation-fenced withdrawal supervisor (7.6).

Tests that involve backoff use pytest-trio's ``autojump_clock``: sleeps are instant and the backend
records each attempt's virtual time, so the backoff sequence is asserted exactly.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import structlog
import structlog.testing
import trio
import trio.testing

from kvagent.discovery.base import DiscoveryRecord
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.discovery.withdrawal import (
    AttachmentRecordHolder,
    run_withdrawal_supervisor,
    unregister_required,
)
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC, KV_STATE_SOURCES_TOPIC
from kvagent.model.ids import attachment_record_id

PUBLISHER = 41


@pytest.fixture
def discovery() -> MemoryDiscovery:
    return MemoryDiscovery()


@pytest.fixture
def holder() -> AttachmentRecordHolder:
    return AttachmentRecordHolder()


def ad(generation: int, topic: str = KV_STATE_ATTACHMENTS_TOPIC) -> DiscoveryRecord:
    return DiscoveryRecord(
        topic, attachment_record_id(PUBLISHER, generation), "ep", {"attachment_generation": generation}
    )


def gaps(times: list[float]) -> list[float]:
    return [round(later - earlier, 9) for earlier, later in zip(times, times[1:], strict=False)]


async def held(discovery: MemoryDiscovery, holder: AttachmentRecordHolder, record: DiscoveryRecord) -> None:
    await discovery.register(record)
    holder.set(record)


@asynccontextmanager
async def supervisor(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder
) -> AsyncIterator[trio.MemorySendChannel[int]]:
    """Run the supervisor; leaving the block closes its channel and waits for it to drain and end."""
    # Unbounded like the agent's: the coordinator never waits on withdrawals.
    send, receive = trio.open_memory_channel[int](math.inf)
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: run_withdrawal_supervisor(
                discovery=discovery,
                holder=holder,
                publisher_id=PUBLISHER,
                requests=receive,
                task_status=task_status,
            )
        )
        with send:
            yield send


# -- holder ------------------------------------------------------------------------------------------


def test_holder_forgets_only_the_same_record(holder: AttachmentRecordHolder) -> None:
    holder.set(ad(2))
    assert not holder.forget_if(ad(1))
    assert holder.record == ad(2)
    assert holder.forget_if(ad(2))
    assert [holder.record] == [None]  # (a list, so mypy does not keep the narrowing from above)
    assert not holder.forget_if(ad(2))


def test_holder_change_event_fires_on_each_change_of_the_record(holder: AttachmentRecordHolder) -> None:
    first = holder.change()
    holder.set(None)  # unchanged: no event
    assert not first.is_set()
    holder.set(ad(1))
    assert first.is_set()
    second = holder.change()
    assert second is not first and not second.is_set()
    holder.set(holder.record)  # the same record again: no event
    assert not holder.forget_if(ad(2)) and not second.is_set()
    assert holder.forget_if(ad(1)) and second.is_set()


# -- supervisor --------------------------------------------------------------------------------------


async def test_withdrawal_of_the_current_generation_removes_its_record(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder
) -> None:
    await held(discovery, holder, ad(1))
    await discovery.register(DiscoveryRecord(KV_STATE_SOURCES_TOPIC, PUBLISHER, "ep", {"source": True}))
    with trio.fail_after(5):
        async with supervisor(discovery, holder) as requests:
            requests.send_nowait(1)
            await discovery.wait_for(lambda records: ad(1).key not in records)
    assert holder.record is None
    assert set(discovery.records) == {(KV_STATE_SOURCES_TOPIC, PUBLISHER)}  # the source ad is untouched
    assert (
        holder.statistics().withdrawals,
        holder.statistics().stale_withdrawals,
        holder.statistics().retries,
    ) == (1, 0, 0)


async def test_a_stale_generation_never_removes_a_newer_record(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder
) -> None:
    await held(discovery, holder, ad(2))
    with trio.fail_after(5):
        async with supervisor(discovery, holder) as requests:
            requests.send_nowait(1)  # generation 1 was quarantined long ago; its ad is already gone
    assert holder.record == ad(2)
    assert set(discovery.records) == {ad(2).key}
    assert [a.operation for a in discovery.attempts] == ["register"]  # not even an unregister attempt
    assert holder.statistics().stale_withdrawals == 1
    assert holder.statistics().withdrawals == 0


async def test_the_fence_also_checks_the_topic_and_an_empty_holder(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder
) -> None:
    # Same record id as generation 1's attachment ad, but on another topic: not an attachment ad.
    impostor = ad(1, topic=KV_STATE_SOURCES_TOPIC)
    await held(discovery, holder, impostor)
    with trio.fail_after(5):
        async with supervisor(discovery, holder) as requests:
            requests.send_nowait(1)
            holder.set(None)
            requests.send_nowait(1)
    assert discovery.records == {impostor.key: impostor}
    assert holder.statistics().stale_withdrawals == 2


async def test_queued_requests_are_handled_in_order_before_the_supervisor_ends(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder
) -> None:
    await held(discovery, holder, ad(3))
    with trio.fail_after(5):
        async with supervisor(discovery, holder) as requests:
            for generation in (1, 2, 3, 3):
                requests.send_nowait(generation)
    assert discovery.records == {}
    assert (holder.statistics().stale_withdrawals, holder.statistics().withdrawals) == (3, 1)


async def test_failed_withdrawals_are_retried_with_backoff(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder, autojump_clock: trio.testing.MockClock
) -> None:
    await held(discovery, holder, ad(1))
    discovery.fail_next(3, on=("unregister",))
    with structlog.testing.capture_logs() as logs:
        async with supervisor(discovery, holder) as requests:
            requests.send_nowait(1)
            await discovery.wait_for(lambda records: ad(1).key not in records)
    attempts = [a for a in discovery.attempts if a.operation == "unregister"]
    assert [a.failed for a in attempts] == [True, True, True, False]
    assert gaps([a.at for a in attempts]) == [0.1, 0.2, 0.4]
    assert holder.record is None
    assert (holder.statistics().retries, holder.statistics().withdrawals) == (3, 1)
    assert [(e["event"], e["log_level"], e["generation"]) for e in logs] == [
        ("withdrawal_retry", "warning", 1)
    ] * 3


async def test_backoff_is_capped_at_five_seconds(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder, autojump_clock: trio.testing.MockClock
) -> None:
    await held(discovery, holder, ad(1))
    discovery.fail_next(8, on=("unregister",))
    async with supervisor(discovery, holder) as requests:
        requests.send_nowait(1)
    assert gaps(discovery.attempt_times("unregister")) == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert discovery.records == {}


async def test_backoff_restarts_for_each_generation(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder, autojump_clock: trio.testing.MockClock
) -> None:
    await held(discovery, holder, ad(1))
    discovery.fail_next(2, on=("unregister",))
    async with supervisor(discovery, holder) as requests:
        requests.send_nowait(1)
        await discovery.wait_for(lambda records: not records)
        await held(discovery, holder, ad(2))
        discovery.fail_next(1, on=("unregister",))
        requests.send_nowait(2)
    times = discovery.attempt_times("unregister")
    assert len(times) == 5
    assert gaps(times[:3]) == [0.1, 0.2]
    assert gaps(times[3:]) == [0.1]


async def test_cancellation_stops_the_retries(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder, autojump_clock: trio.testing.MockClock
) -> None:
    await held(discovery, holder, ad(1))
    discovery.set_failing(True, on=("unregister",))
    send, receive = trio.open_memory_channel[int](math.inf)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: run_withdrawal_supervisor(
                discovery=discovery, holder=holder, publisher_id=PUBLISHER, requests=receive
            )
        )
        send.send_nowait(1)
        await discovery.wait_for_attempts(3, "unregister")
        cancelled_at = trio.current_time()
        nursery.cancel_scope.cancel()
    # The nursery closing proves the supervisor ended; it made no attempt after the cancellation.
    assert max(discovery.attempt_times("unregister")) <= cancelled_at
    assert holder.record == ad(1)  # not withdrawn, and not forgotten
    # The supervisor owned its receive channel and closed it: late requests fail loudly.
    with pytest.raises(trio.BrokenResourceError):
        send.send_nowait(2)


# -- unregister_required -----------------------------------------------------------------------------


async def test_unregister_required_retries_until_withdrawn(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder, autojump_clock: trio.testing.MockClock
) -> None:
    await held(discovery, holder, ad(1))
    discovery.fail_next(3, on=("unregister",))
    with structlog.testing.capture_logs() as logs:
        await unregister_required(discovery, holder, ad(1))
    assert gaps(discovery.attempt_times("unregister")) == [0.1, 0.2, 0.4]
    assert discovery.records == {}
    assert holder.record is None
    assert [(e["event"], e["log_level"], e["record_id"]) for e in logs] == [
        ("required_withdrawal_retry", "warning", ad(1).record_id)
    ] * 3


async def test_unregister_required_keeps_a_record_replaced_meanwhile(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder, autojump_clock: trio.testing.MockClock
) -> None:
    await held(discovery, holder, ad(1))
    discovery.fail_next(1, on=("unregister",))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(unregister_required, discovery, holder, ad(1))
        await discovery.wait_for_attempts(1, "unregister")
        holder.set(ad(2))  # a newer attachment was recorded while the withdrawal was retrying
    assert holder.record == ad(2)
    assert ad(1).key not in discovery.records


async def test_unregister_required_is_cancellable(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder, autojump_clock: trio.testing.MockClock
) -> None:
    await held(discovery, holder, ad(1))
    discovery.set_failing(True, on=("unregister",))
    with trio.move_on_after(1.0) as scope:
        await unregister_required(discovery, holder, ad(1))
    assert scope.cancelled_caught
    # 0, 0.1, 0.3, 0.7 fit in one second; the next attempt (1.5) never happens.
    assert gaps(discovery.attempt_times("unregister")) == [0.1, 0.2, 0.4]
    assert holder.record == ad(1)
    assert ad(1).key in discovery.records


async def test_unregister_required_with_nothing_to_withdraw(
    discovery: MemoryDiscovery, holder: AttachmentRecordHolder
) -> None:
    await unregister_required(discovery, holder, None)
    assert discovery.attempts == []
