"""A nursery ladder: rungs of child tasks, outermost first; each rung outlives every rung inside it.

A slot declares its ladder as data (:func:`kvagent.agent.slot.slot_rungs`): a list of :class:`Rung`, each a
list of :class:`Child`.  :func:`run_ladder` starts the rungs outermost first (each child with
``nursery.start``, so a child is running, e.g. bound, before the next one starts) and stops them innermost
first when the block ends.  Stopping one rung: each child's ``stop`` (a graceful request: close its input,
send it a shutdown command) in reverse start order, then a bounded wait for those children to end, then
the rung's nursery is cancelled.  Every wait is shielded and bounded by ``step_timeout``, so a stuck child
cannot hang the process.

Adding a component to a slot is adding one :class:`Child` to the rung whose lifetime it needs (see the slot
module's docstring for what each rung guarantees).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import structlog
import trio

__all__ = ["Child", "Rung", "run_ladder"]

log = structlog.get_logger(__name__)


@attrs.frozen
class Child:
    """One task of a rung.

    ``run(*, task_status)`` is the component (Trio house style).  ``stop`` (optional) asks it to end by
    itself; the ladder then waits (bounded) for it.  A child without ``stop`` is cancelled with its rung.
    """

    name: str
    run: Callable[..., Awaitable[None]]
    stop: Callable[[], Awaitable[None]] | None = None
    stop_timeout: float | None = None  # the wait for it to end after ``stop`` (None: the ladder's step)


@attrs.frozen
class Rung:
    """Children that start together and stop together, after every rung inside them has stopped."""

    name: str
    children: Sequence[Child]


async def _run_child(
    child: Child,
    slot: str,
    done: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``child`` as a task whose log lines all carry the slot (bound in the new task's own context)."""
    structlog.contextvars.bind_contextvars(slot=slot)
    try:
        await child.run(task_status=task_status)
    finally:
        done.set()


async def _stop_rung(
    rung: Rung, done: Sequence[trio.Event], step_timeout: float, nursery: trio.Nursery
) -> None:
    stopping = [(child, ended) for child, ended in zip(rung.children, done, strict=False) if child.stop]
    for child, ended in reversed(stopping):
        if ended.is_set() or child.stop is None:
            continue
        timeout = step_timeout if child.stop_timeout is None else child.stop_timeout
        with trio.move_on_after(timeout, shield=True) as bounded:
            await child.stop()
            await ended.wait()
        if bounded.cancelled_caught:
            log.warning("slot_child_stop_timed_out", child=child.name, rung=rung.name, timeout=timeout)
    nursery.cancel_scope.cancel()


@asynccontextmanager
async def run_ladder(rungs: Sequence[Rung], *, slot: str, step_timeout: float) -> AsyncIterator[None]:
    """Run ``rungs`` (outermost first) around the block; stop them innermost first when it ends."""
    if not rungs:
        yield
        return
    rung, inner = rungs[0], rungs[1:]
    done = [trio.Event() for _ in rung.children]
    async with trio.open_nursery() as nursery:
        try:
            for child, ended in zip(rung.children, done, strict=True):
                await nursery.start(_run_child, child, slot, ended)
            async with run_ladder(inner, slot=slot, step_timeout=step_timeout):
                yield
        finally:
            await _stop_rung(rung, done, step_timeout, nursery)
