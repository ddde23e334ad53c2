"""Model-based test of the whole agent: real listener over loopback ZMQ, coordinator, index, supervisor.

Hypothesis generates operation sequences — ingest (Worker and CacheOwner stores/removes), raw sequence
gaps, operator quarantine followed by detach and reattach, plain detach/reattach, and the listener's source
verdicts (degraded with a reset then resynchronised, disconnected then reconnected) — and after every step
the agent is checked against a reference model:

- outbound ids strictly increase and are never reused;
- the index equals the model (Worker residency refcounted per worker, CacheOwner residency set-like and
  surviving worker replacement);
- a tree dump replayed into a fresh index, plus nothing else, equals the live index;
- the buffered tail from any cursor is gap-free (consecutive ids through the newest);
- the attachment ad is registered, at the status's ``ready_at_outbound_cursor``, exactly while the attachment
  is ready (waited for: the attachment advertiser runs asynchronously).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvagent.discovery.base import DiscoveryRecord
from kvagent.index.recovery_index import EventsAnswer, RecoveryIndex
from kvagent.model.events import (
    KV_STATE_ATTACHMENTS_TOPIC,
    ResidencyOwner,
    RouterEvent,
    SourceSignal,
    SourceState,
    StorageTier,
    WorkerWithDpRank,
)
from kvagent.model.status import AgentStatus
from kvagent.testing import RecordingSink
from tests.support.agent import (
    XpubEngine,
    attach,
    batch,
    gpu_store,
    is_store_of,
    kvcr_store,
    running_agent,
    wait_for_event,
)
from tests.support.ids import OWNER

POOL = 12

ingest = st.tuples(
    st.just("ingest"),
    st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(1, POOL)), min_size=1, max_size=6),
)
operation = st.one_of(
    ingest,
    ingest,
    ingest,
    st.tuples(st.just("gap"), st.integers(1, 3)),
    st.tuples(st.just("quarantine_reattach"), st.just(0)),
    st.tuples(st.just("reattach"), st.just(0)),
    st.tuples(st.just("resync"), st.just(0)),
    st.tuples(st.just("reconnect"), st.just(0)),
)


def in_state(state: str, status: AgentStatus) -> bool:
    return status.attachment is not None and status.attachment.state == state


async def scenario(operations: list[tuple[Any, ...]]) -> None:
    sink = RecordingSink()
    context: zmq.Context[Any] = zmq.Context()
    async with running_agent(sink=sink) as (agent, discovery, _sink, _ctx):
        worker_id = 100
        engine = XpubEngine(context)
        generation = await attach(agent, engine, worker_id=worker_id)
        worker_refs: dict[int, int] = {}
        owner_blocks: set[int] = set()
        sentinel = 1 << 40

        async def flush() -> None:
            nonlocal sentinel
            sentinel += 1
            await engine.send_payload(batch([gpu_store([sentinel])]))
            await wait_for_event(agent, is_store_of(sentinel))
            worker_refs[sentinel] = worker_refs.get(sentinel, 0) + 1

        def ads_match(records: dict[tuple[str, int], DiscoveryRecord]) -> bool:
            """The attachment ad is there, at the ready cursor, exactly while the attachment is ready."""
            cursors = [
                record.metadata["ready_at_outbound_cursor"]
                for (topic, _), record in records.items()
                if topic == KV_STATE_ATTACHMENTS_TOPIC
            ]
            attachment = agent.status().attachment
            if attachment is None or not attachment.ready:
                return cursors == []
            return cursors == [attachment.ready_at_outbound_cursor]

        async def verdicts(*signals: SourceSignal) -> None:
            """The listener's verdicts, each waited for until its ad change is visible."""
            for verdict in signals:
                assert verdict.state is not None
                agent._coordinator.admit_nowait(verdict)
                await agent.status_cell.wait_for(partial(in_state, verdict.state.value))
                await discovery.wait_for(ads_match)

        def check() -> None:
            expected: set[tuple[ResidencyOwner, StorageTier, int]] = {
                (WorkerWithDpRank(worker_id, 0), StorageTier.DEVICE, h)
                for h, n in worker_refs.items()
                if n > 0
            }
            expected |= {(OWNER, StorageTier.HOST_PINNED, h) for h in owner_blocks}
            assert agent.index.resident_blocks() == expected
            ids = [e.event_id for e in sink.events]
            assert ids == sorted(set(ids)), "outbound ids must strictly increase"
            dump = agent.index.tree_dump()
            replica = RecoveryIndex(32)
            for n, event in enumerate(dump.events, start=1):
                source = event.state_source if event.state_source is not None else OWNER
                replica.apply(
                    RouterEvent(
                        event.worker_id,
                        event.storage_tier,
                        event.residency_domain,
                        n,
                        event.data,
                        event.dp_rank,
                        source,
                    )
                )
            assert replica.resident_blocks() == agent.index.resident_blocks()
            oldest = agent.index.oldest_buffered_id()
            if oldest is not None:
                tail = agent.index.events_in_range(oldest, None)
                assert isinstance(tail, EventsAnswer)
                tail_ids = [e.event_id for e in tail.events]
                assert tail_ids == list(range(oldest, agent.index.current_event_id() + 1))

        for op in operations:
            if op[0] == "ingest":
                events = []
                for is_store, cache_owner, block in op[1]:
                    if cache_owner:
                        if is_store:
                            events.append(kvcr_store([block]))
                            owner_blocks.add(block)
                        else:
                            events.append(
                                {
                                    "type": "BlockRemoved",
                                    "block_hashes": [block],
                                    "medium": "CPU_PINNED",
                                    "locality": "LOCAL",
                                    "ownership": "kvcr",
                                }
                            )
                            owner_blocks.discard(block)
                    elif is_store:
                        events.append(gpu_store([block]))
                        worker_refs[block] = worker_refs.get(block, 0) + 1
                    else:
                        events.append({"type": "BlockRemoved", "block_hashes": [block], "medium": "GPU"})
                        if worker_refs.get(block, 0) > 0:
                            worker_refs[block] -= 1
                await engine.send_payload(batch(events))
                await flush()
            elif op[0] == "gap":
                engine.seq += op[1]  # the engine's publisher lost batches; without a replay socket: history lost
                worker_refs.clear()  # the listener resets Worker residency and degrades before the next batch
                await flush()
                assert in_state("degraded", agent.status())
            elif op[0] == "resync":
                await verdicts(
                    SourceSignal(generation, state=SourceState.DEGRADED, reset=True, lost_batches=1),
                    SourceSignal(generation, state=SourceState.READY, reset=True),
                )
                worker_refs.clear()  # both resets cleared Worker residency; CacheOwner survives
            elif op[0] == "reconnect":
                await verdicts(
                    SourceSignal(generation, state=SourceState.DISCONNECTED),
                    SourceSignal(generation, state=SourceState.READY),
                )
            else:
                if op[0] == "quarantine_reattach":
                    await agent.quarantine(generation, "model test")
                    status = agent.status()
                    assert status.attachment is not None and not status.attachment.ready
                await agent.detach(generation)
                engine.close()
                worker_refs.clear()  # the detach barrier reset Worker residency; CacheOwner survives
                worker_id += 1
                engine = XpubEngine(context)
                generation = await attach(agent, engine, worker_id=worker_id)
            check()
            await discovery.wait_for(ads_match)
        engine.close()
    context.destroy(linger=0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=10))
def test_whole_agent_matches_the_reference_model(operations: list[tuple[Any, ...]]) -> None:
    async def main() -> None:
        with trio.fail_after(60):
            await scenario(operations)

    trio.run(main)
