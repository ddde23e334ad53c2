"""Public test helpers (in the spirit of :mod:`trio.testing`): doubles for tests, examples and embedders.

- :class:`RecordingSink`: an :class:`~kvagent.publish.sinks.EventSink` that records what it is given and can
  be told to fail;
- :class:`FakeVllmEngine`, :class:`SimulatedWorkload` and :func:`run_simulated_engine`: a fake vLLM engine
  speaking the real KV event wire protocol (with fault injection: drops, swaps, duplicates, restarts, a
  killed and revived process, vLLM's replay HWM ``VLLM_REPLAY_HWM``), and a realistic workload to drive it;
  ``FakeVllmEngine.truth`` (a :class:`ResidentTruth`) is what the engine really holds.

Nothing in kvagent's production code imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvagent._util.sync import Changed
from kvagent.model.errors import SinkError
from kvagent.model.events import RouterEvent
from kvagent.simulator.engine import (
    VLLM_REPLAY_HWM,
    FakeVllmEngine,
    ResidentTruth,
    SimulatedWorkload,
    run_simulated_engine,
)

__all__ = [
    "VLLM_REPLAY_HWM",
    "FakeVllmEngine",
    "RecordingSink",
    "ResidentTruth",
    "SimulatedWorkload",
    "run_simulated_engine",
]


class RecordingSink:
    """Counts every publish call (failed ones too) and records the events of the successful ones.

    Set ``fail = True`` to make each later call raise :class:`~kvagent.model.errors.SinkError`.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.events: list[RouterEvent] = []
        self.fail = False
        self._called = Changed()  # publish was called

    def publish(self, events: Sequence[RouterEvent]) -> None:
        self.calls += 1
        self._called.notify()
        if self.fail:
            raise SinkError("injected publication failure")
        self.events.extend(events)

    async def wait_for_calls(self, count: int) -> None:
        """Return once ``publish`` has been called ``count`` times in all."""
        await self._called.wait_for(lambda: self.calls >= count)
