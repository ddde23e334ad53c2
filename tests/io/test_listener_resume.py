"""The listener resumed from a restarted agent's persisted point, over real sockets (issue #17).

The capture's live batches on a fake engine's PUB, its replay lines on a real ROUTER: a listener resumed at
seq 19 with the digest of batch 19 asks the replay socket from 19, finds the same bytes and continues at 20
with no reset; with a digest that does not match it takes the new-engine path (a reset, history from 0).
Every chunk carries its batch's payload digest.
"""

from __future__ import annotations

import trio
from xxhash import xxh3_64_intdigest

from kvagent.model.events import SourceState
from kvagent.vllm.listener import ListenerOptions, run_listener
from tests.io.test_listener import LIVE, Harness, harness, start_router
from tests.support.ids import ready_attachment, status_for

READY = SourceState.READY
RESUMED = "resumed: the engine's replay continues the applied history"


async def start_resumed(h: Harness, replay_endpoint: str, resume: tuple[int, int]) -> None:
    attachment = ready_attachment(h.engine.endpoint, replay_endpoint=replay_endpoint)
    status = status_for(attachment)

    async def run(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await run_listener(
            attachment=attachment,
            kv_block_size=32,
            coordinator=h.coordinator.as_handle(),
            status=status,
            options=ListenerOptions(cold_bootstrap=False),
            stats=h.stats,
            resume=resume,
            task_status=task_status,
        )

    await h.nursery.start(run)
    await h.engine.wait_for_subscriber()


def payload_digest(seq: int) -> int:
    return xxh3_64_intdigest(LIVE[seq][2])


async def test_a_resume_proven_by_the_replay_continues_after_the_persisted_batch_without_reset() -> None:
    async with harness() as h:
        router = await start_router(h)
        await start_resumed(h, router.endpoint, (19, payload_digest(19)))
        await h.publish_live(range(40, 68))
        await h.coordinator.wait_for(lambda c: 67 in c.cursors())
        assert router.requests[0] == 19, "the anchor: the persisted batch itself"
        assert h.coordinator.cursors() == list(range(20, 68)), "each missed batch once, in order"
        assert [(s.state, s.reset, s.lost_batches, s.reason) for s in h.coordinator.signals] == [
            (READY, False, 0, RESUMED)
        ]
        for chunk in h.coordinator.chunks:
            assert chunk.source_digest == payload_digest(chunk.source_cursor)
        stats = h.stats.statistics()
        assert stats.lost_batches == 0 and stats.restarts_seen == 0


async def test_a_resume_whose_digest_differs_is_a_new_engine_replayed_from_zero() -> None:
    async with harness() as h:
        router = await start_router(h)
        await start_resumed(h, router.endpoint, (19, payload_digest(19) ^ 1))
        await h.publish_live(range(40, 68))
        await h.coordinator.wait_for(lambda c: 67 in c.cursors())
        assert router.requests[:2] == [19, 0]
        assert h.coordinator.cursors() == list(range(68))
        first = h.coordinator.signals[0]
        assert (first.state, first.reset, first.lost_batches) == (READY, True, 0)
        assert h.coordinator.items.index(first) == 0, "the reset comes before any batch"
