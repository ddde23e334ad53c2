"""Fair turns for the work of answering requests, so recovery never starves ingest or one client another.

Trio runs every runnable task once per scheduling batch, in no particular order.  With hundreds of
connections answering at once, a batch would hold hundreds of answer steps, and the listener and the
coordinator, which also get one step per batch, would fall behind.  :class:`AnswerTurns` bounds that: a
session computes and encodes a frame only while it holds a turn, and at most ``tokens`` turns are out at a
time, so a batch holds at most ``tokens`` answer steps and ingest keeps its share of the loop.

Turns are handed out first come, first served (``trio.CapacityLimiter`` is FIFO), and a multi-frame answer
gives its turn back after every frame and queues again: a large dump takes its turns between the frames of
everyone else's answers.  A session never waits for a slow peer while holding a turn.

A request that cannot get its first turn within ``max_wait`` seconds is refused with error ``overloaded``
(the client retries later), so an overloaded server answers every request with an answer or a refusal,
instead of letting them queue without bound.
"""

from __future__ import annotations

import trio

from kvagent.model.errors import KvAgentError

__all__ = ["AnswerTurns", "Turn"]


class Turn:
    """A session's hold on one of the turns; :meth:`pass_on` queues again behind the others."""

    def __init__(self, turns: AnswerTurns) -> None:
        self._turns = turns
        self.held = False

    async def acquire(self) -> None:
        limiter = self._turns.limiter
        try:
            limiter.acquire_on_behalf_of_nowait(self)  # free tokens mean nobody is waiting: still fair
        except trio.WouldBlock:
            await limiter.acquire_on_behalf_of(self)
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._turns.limiter.release_on_behalf_of(self)

    async def pass_on(self) -> None:
        """Give the turn to the next in line and queue for another (a schedule point either way)."""
        self.release()
        await trio.lowlevel.checkpoint()
        await self.acquire()


class AnswerTurns:
    """The turns of one server; ``waited_too_long`` counts the requests refused as ``overloaded``."""

    def __init__(self, tokens: int = 4, max_wait: float = 5.0) -> None:
        if tokens <= 0 or max_wait <= 0:
            raise ValueError(f"tokens and max_wait must be positive, got {tokens}, {max_wait}")
        self.limiter = trio.CapacityLimiter(tokens)
        self.max_wait = max_wait
        self.waited_too_long = 0

    async def first(self) -> Turn:
        """A turn for a new request, or KvAgentError(overloaded) after ``max_wait`` seconds in line."""
        turn = Turn(self)
        try:
            self.limiter.acquire_on_behalf_of_nowait(turn)  # the usual case: no deadline to set up
            turn.held = True
            return turn
        except trio.WouldBlock:
            pass
        with trio.move_on_after(self.max_wait):
            await turn.acquire()
        if not turn.held:
            self.waited_too_long += 1
            raise KvAgentError(
                f"server overloaded: no answer slot within {self.max_wait:g} s; retry later", code="overloaded"
            )
        return turn

    @property
    def waiting(self) -> int:
        return self.limiter.statistics().tasks_waiting
