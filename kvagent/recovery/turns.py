"""Fair turns for the work of answering, so tree dumps never starve ingest or the small answers.

Trio runs every runnable task once per scheduling batch, in no particular order, which already makes
connections take turns frame by frame: a session computes one frame per step and yields between frames.
What that does not bound is the expensive work one batch can hold: a tree dump copies the index and
encodes megabytes, and when many clients fall out of the ring at once (a loaded server answers late, so
more requests miss the ring, so it gets slower) one batch would hold a dump for each of them while the
listener, the coordinator and every small answer wait behind it.

:class:`AnswerTurns` bounds that.  *Heavy* work (a tree dump, a follow backlog, the second and later
frames of any answer) is done only while holding one of ``tokens`` turns, and a turn is kept through the
schedule point between two frames (:meth:`Turn.pass_on`), so a batch holds at most ``tokens`` heavy steps.
*Light* answers (status, a buffered ``recover`` that fits one frame) take no turn: answers that arrive
together are written in the same batch, which measured far lower latency than spreading them over
batches that each also hold an ingest step of up to ~10 ms, and they never queue behind dumps.

Turns are handed out first come, first served (``trio.CapacityLimiter`` is FIFO), and a multi-frame answer
queues again after every frame: a large dump takes its turns between the others'.  A session never waits
for a slow peer or for live events while holding a turn.

Heavy work that cannot get its first turn within ``max_wait`` seconds is refused with error ``overloaded``
(the client retries later), so an overloaded server answers every request with an answer or a refusal,
instead of letting dumps queue without bound.
"""

from __future__ import annotations

import trio

from kvagent._util.sync import shielded_checkpoint
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
        """Give the turn back now (before waiting for something else than the event loop)."""
        if self.held:
            self.held = False
            self._turns.limiter.release_on_behalf_of(self)

    async def finish(self) -> None:
        """Keep the turn through the end of this step, then give it back: one frame per turn per batch."""
        if self.held:
            try:
                await shielded_checkpoint()
            finally:
                self.release()

    async def pass_on(self) -> None:
        """Between two frames: give the turn to the next in line and queue for another."""
        await self.finish()
        await self.acquire()


class AnswerTurns:
    """The turns of one server (a request refused as ``overloaded`` is counted by the server, in
    ``ServerStatistics.request_errors``)."""

    def __init__(self, tokens: int = 4, max_wait: float = 5.0) -> None:
        if tokens <= 0 or max_wait <= 0:
            raise ValueError(f"tokens and max_wait must be positive, got {tokens}, {max_wait}")
        self.limiter = trio.CapacityLimiter(tokens)
        self.max_wait = max_wait

    def turn(self) -> Turn:
        """A turn not held yet (a light answer never takes it)."""
        return Turn(self)

    async def admit(self, turn: Turn) -> bool:
        """Take ``turn`` for heavy work, or raise KvAgentError(overloaded) after ``max_wait`` in line.

        Returns whether it had to wait (a schedule point: what was read before may have changed).
        """
        if turn.held:
            return False
        try:
            self.limiter.acquire_on_behalf_of_nowait(turn)  # the usual case: no deadline to set up
            turn.held = True
            return False
        except trio.WouldBlock:
            pass
        with trio.move_on_after(self.max_wait):
            await turn.acquire()
        if not turn.held:
            raise KvAgentError(
                f"server overloaded: no answer slot within {self.max_wait:g} s; retry later",
                code="overloaded",
            )
        return True

    async def first(self) -> Turn:
        """A new turn, taken (see :meth:`admit`)."""
        turn = self.turn()
        await self.admit(turn)
        return turn

    @property
    def waiting(self) -> int:
        return self.limiter.statistics().tasks_waiting
