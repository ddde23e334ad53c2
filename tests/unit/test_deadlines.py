"""StopDeadlines: every stop deadline of a slot comes from one number, and the nested ones fit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvagent.agent.deadlines import StopDeadlines


@given(st.floats(min_value=1e-3, max_value=600))
def test_the_nested_deadlines_fit(step: float) -> None:
    deadlines = StopDeadlines(step)
    # The slot task's shutdown runs a quarantine and an ad withdrawal (a step each), then joins the listener.
    assert 2 * deadlines.step + deadlines.listener_join < deadlines.slot_task_shutdown
    assert deadlines.listener_join < deadlines.step
    # The ladder waits for the slot task's shutdown after the command in progress (itself a step at most).
    assert deadlines.slot_task_shutdown + deadlines.step <= deadlines.slot_task_stop


def test_the_default_step_gives_the_documented_figures() -> None:
    deadlines = StopDeadlines(5.0)
    assert (deadlines.listener_join, deadlines.slot_task_shutdown, deadlines.slot_task_stop) == (
        2.0,
        15.0,
        20.0,
    )


@pytest.mark.parametrize("step", [0.0, -1.0, float("nan")])
def test_a_step_must_be_positive(step: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        StopDeadlines(step)
