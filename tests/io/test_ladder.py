"""The nursery ladder: rungs start outermost first, stop innermost first; a stop is graceful, then bounded."""

from __future__ import annotations

import pytest
import structlog.testing
import trio
import trio.testing

from kvagent.agent.ladder import Child, Rung, run_ladder


class Component:
    """A child that records its life in ``journal``; with ``graceful`` it ends when asked to stop."""

    def __init__(self, name: str, journal: list[str], *, graceful: bool = True, stuck: bool = False) -> None:
        self.name = name
        self.journal = journal
        self.graceful = graceful
        self.stuck = stuck
        self._asked = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.journal.append(f"start {self.name}")
        task_status.started()
        ended = False
        try:
            await self._asked.wait()
            if self.stuck:
                await trio.sleep_forever()
            self.journal.append(f"end {self.name}")
            ended = True
        finally:
            if not ended:
                self.journal.append(f"cancelled {self.name}")

    async def stop(self) -> None:
        self.journal.append(f"stop {self.name}")
        self._asked.set()

    def child(self) -> Child:
        return Child(self.name, self.run, stop=self.stop if self.graceful else None)


async def test_rungs_start_outermost_first_and_stop_innermost_first() -> None:
    journal: list[str] = []
    outer = [Component("supervisor", journal), Component("republisher", journal, graceful=False)]
    inner = [Component("coordinator", journal)]
    rungs = [Rung("outer", [c.child() for c in outer]), Rung("inner", [c.child() for c in inner])]
    with trio.fail_after(5):
        async with run_ladder(rungs, slot="s", step_timeout=1.0):
            assert journal == ["start supervisor", "start republisher", "start coordinator"]
            journal.append("body")
    assert journal == [
        "start supervisor",
        "start republisher",
        "start coordinator",
        "body",
        "stop coordinator",
        "end coordinator",
        "stop supervisor",
        "end supervisor",
        "cancelled republisher",  # no graceful stop: cancelled with its rung, after the graceful ones
    ]


async def test_a_child_that_does_not_stop_in_time_is_cancelled_and_logged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal: list[str] = []
    stuck = Component("stuck", journal, stuck=True)
    started = trio.current_time()
    with structlog.testing.capture_logs() as logs:
        async with run_ladder([Rung("only", [stuck.child()])], slot="s", step_timeout=2.0):
            pass
    assert trio.current_time() - started == pytest.approx(2.0)
    assert journal == ["start stuck", "stop stuck", "cancelled stuck"]
    assert [(e["event"], e["child"], e["timeout"]) for e in logs] == [
        ("slot_child_stop_timed_out", "stuck", 2.0)
    ]


async def test_a_crashing_child_ends_the_ladder_with_its_exception() -> None:
    journal: list[str] = []
    survivor = Component("survivor", journal)

    async def crash(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        raise RuntimeError("boom")

    rungs = [Rung("outer", [survivor.child()]), Rung("inner", [Child("crash", crash)])]
    with (
        trio.fail_after(5),
        pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="boom"), flatten_subgroups=True),
    ):
        async with run_ladder(rungs, slot="s", step_timeout=1.0):
            await trio.sleep_forever()
    assert journal == ["start survivor", "stop survivor", "end survivor"]  # still stopped gracefully
