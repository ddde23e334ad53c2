"""A pure-Python simulated vLLM engine, network and listener shell around :class:`SourceSync`.

:class:`SimEngine` publishes batches of block stores and removals over a block pool small enough that the
order of application matters (a block is stored, removed and stored again), keeps a vLLM-style replay
buffer (``deque(maxlen=buffer_steps)``) and its true resident set, and restarts as a new incarnation (seq 0,
empty buffer, empty cache).  A batch's digest is unique per (incarnation, seq), like the float timestamp in
every real payload.

:class:`SyncDriver` plays the network and the listener shell: live batches and SUB monitor events wait in
one in-flight queue (drops, duplicates, adjacent swaps and delays are decided when a batch is published),
replay answers are cut by a send HWM (the first ``hwm`` frames always get through; later ones, the end
marker included, only with some probability) or time out, and the sync's actions are executed against a
model index: Apply applies the batch's operations, a reset Signal clears it.
"""

from __future__ import annotations

import collections
import random
from typing import Literal

import attrs
import xxhash

from kvagent.model.events import SourceState
from kvagent.vllm.sequence import Apply, CancelReplay, RequestReplay, Signal, SourceSync

__all__ = ["CONNECT", "DISCONNECT", "END", "Answer", "SimBatch", "SimEngine", "SyncDriver", "apply_batch"]

DISCONNECT: Literal["disconnect"] = "disconnect"
CONNECT: Literal["connect"] = "connect"
END: Literal["end"] = "end"

@attrs.frozen
class SimBatch:
    """One published batch: ``ops`` are (stored?, block id) in order."""

    incarnation: int
    seq: int
    ops: tuple[tuple[bool, int], ...]

    @property
    def digest(self) -> int:
        return xxhash.xxh3_64_intdigest(f"{self.incarnation}:{self.seq}:{self.ops}".encode())

    @property
    def nbytes(self) -> int:
        return 64 + 16 * len(self.ops)


def apply_batch(index: set[int], batch: SimBatch) -> None:
    for stored, block in batch.ops:
        if stored:
            index.add(block)
        else:
            index.discard(block)


class SimEngine:
    """The publisher: seq from 0 per incarnation, a bounded replay buffer, the true resident set."""

    def __init__(self, rng: random.Random, *, buffer_steps: int = 10_000, pool: int = 24) -> None:
        self.rng = rng
        self.pool = pool
        self.buffer: collections.deque[SimBatch] = collections.deque(maxlen=buffer_steps)
        self.incarnation = 0
        self.next_seq = 0
        self.resident: set[int] = set()
        self.history: list[SimBatch] = []

    def publish(self) -> SimBatch:
        ops = []
        for _ in range(self.rng.randint(1, 3)):
            block = self.rng.randrange(self.pool)
            stored = block not in self.resident  # toggles: the order of application matters
            ops.append((stored, block))
            if stored:
                self.resident.add(block)
            else:
                self.resident.discard(block)
        batch = SimBatch(self.incarnation, self.next_seq, tuple(ops))
        self.next_seq += 1
        self.buffer.append(batch)
        self.history.append(batch)
        return batch

    def restart(self) -> None:
        """A new incarnation: seq 0, empty replay buffer, empty cache (no event says so)."""
        self.incarnation += 1
        self.next_seq = 0
        self.buffer.clear()
        self.resident = set()
        self.history = []

    def replay(self, start: int) -> list[SimBatch]:
        return [batch for batch in self.buffer if batch.seq >= start]


@attrs.define
class Answer:
    """The frames of one replay answer still to be delivered (an END frame is the end marker)."""

    frames: collections.deque[SimBatch | Literal["end"]]


@attrs.define
class SyncDriver:
    """Network + shell around one SourceSync; checks the action contract as it executes actions."""

    sync: SourceSync[SimBatch]
    engine: SimEngine
    rng: random.Random
    hwm: int = 1000
    tail_delivery: float = 0.0  # chance that a frame past the HWM still gets through
    end_delivery: float = 1.0  # chance that the end marker gets through once the HWM was exceeded
    silence: float = 0.0  # chance that an answer never comes (the shell's idle timeout ends it)
    # A killed engine answers nothing until the shell has seen its connection drop: the monitor reports a
    # drop within milliseconds, a new engine takes seconds to start.
    engine_dead: bool = False
    now: float = 0.0
    connected: bool = True
    index: set[int] = attrs.Factory(set)
    applied: list[tuple[int, int]] = attrs.Factory(list)  # (incarnation, seq) applied since the last reset
    state: SourceState = SourceState.READY
    signals: list[Signal] = attrs.Factory(list)
    requests: list[int] = attrs.Factory(list)
    answer: Answer | None = None
    live: collections.deque[SimBatch | Literal["disconnect", "connect"]] = attrs.Factory(collections.deque)
    delayed: list[SimBatch] = attrs.Factory(list)

    # -- executing the sync's actions ----------------------------------------------------------------------

    def execute(self) -> None:
        for action in self.sync.take_actions():
            if isinstance(action, Apply):
                batch = action.message
                assert batch.seq == action.seq
                if self.applied:
                    previous = self.applied[-1][1]
                    assert action.seq == previous + 1, f"Apply {action.seq} after {previous}: not in order"
                apply_batch(self.index, batch)
                self.applied.append((batch.incarnation, batch.seq))
            elif isinstance(action, Signal):
                self.signals.append(action)
                if action.reset:
                    self.index.clear()
                    self.applied.clear()
                if action.state is not None:
                    self.state = action.state
            elif isinstance(action, RequestReplay):
                assert self.answer is None, "a second replay request while one is outstanding"
                self.requests.append(action.start)
                self.answer = self._answer(action.start)
            else:
                assert isinstance(action, CancelReplay)
                assert self.answer is not None, "CancelReplay with nothing outstanding"
                self.answer = None

    def _answer(self, start: int) -> Answer:
        frames: collections.deque[SimBatch | Literal["end"]] = collections.deque()
        if not self.connected or self.engine_dead or self.rng.random() < self.silence:
            return Answer(frames)  # silence: the shell's idle timeout ends it
        replies = self.engine.replay(start)
        frames.extend(replies[: self.hwm])
        over = len(replies) > self.hwm
        frames.extend(reply for reply in replies[self.hwm :] if self.rng.random() < self.tail_delivery)
        if not over or self.rng.random() < self.end_delivery:
            frames.append(END)
        return Answer(frames)

    # -- the network ---------------------------------------------------------------------------------------

    def publish(self, *, drop: bool = False, duplicate: bool = False, swap: bool = False, delay: bool = False) -> SimBatch:
        """The engine publishes one batch; its fate on the way to the SUB is decided now."""
        batch = self.engine.publish()
        if not self.connected or drop:
            return batch
        if delay:
            self.delayed.append(batch)
            return batch
        if swap and self.live and isinstance(self.live[-1], SimBatch):
            self.live.insert(len(self.live) - 1, batch)
        else:
            self.live.append(batch)
        if duplicate:
            self.live.append(batch)
        return batch

    def release_delayed(self) -> None:
        self.live.extend(self.delayed)
        self.delayed.clear()

    def disconnect(self, *, queued_after: int = 0) -> None:
        """The connection drops; the monitor event lands ``queued_after`` batches before the queue's end."""
        markers = [i for i, item in enumerate(self.live) if not isinstance(item, SimBatch)]
        position = max(markers[-1] + 1 if markers else 0, len(self.live) - queued_after)
        self.live.insert(position, DISCONNECT)
        self.connected = False

    def reconnect(self, *, early_batches: int = 0) -> None:
        """The connection is back; ``early_batches`` published before the connect event is handled."""
        self.connected = True
        for _ in range(early_batches):
            self.publish()
        self.live.append(CONNECT)

    def restart(self, *, missed: int, early_batches: int = 0, queued_after: int = 0) -> None:
        """The engine is killed and a new one starts; ``missed`` of its batches go by unseen."""
        self.live = collections.deque(
            item for item in self.live if not isinstance(item, SimBatch) or item.incarnation == self.engine.incarnation
        )
        self.release_delayed()  # nothing of the old engine is delivered after the new one's batches
        if self.connected:
            self.disconnect(queued_after=queued_after)
        self.engine_dead = DISCONNECT in self.live
        self.engine.restart()
        for _ in range(missed):
            self.engine.publish()
        self.reconnect(early_batches=early_batches)

    # -- delivery --------------------------------------------------------------------------------------------

    def deliver_live(self, count: int | None = None) -> None:
        delivered = 0
        while self.live and (count is None or delivered < count):
            item = self.live.popleft()
            delivered += 1
            if item == DISCONNECT:
                self.engine_dead = DISCONNECT in self.live  # the new engine answers once its drop is seen
                self.sync.on_disconnected(self.now)
            elif item == CONNECT:
                self.sync.on_connected(self.now)
            else:
                assert isinstance(item, SimBatch)
                self.sync.on_live(item.seq, item.digest, item.nbytes, item, self.now)
            self.execute()

    def deliver_replay(self, count: int | None = None) -> None:
        delivered = 0
        while self.answer is not None and (count is None or delivered < count):
            answer = self.answer
            if not answer.frames:  # silence: the idle timeout
                self.answer = None
                self.sync.on_replay_end(False, self.now)
            else:
                frame = answer.frames.popleft()
                if frame == END:
                    self.answer = None
                    self.sync.on_replay_end(True, self.now)
                else:
                    assert isinstance(frame, SimBatch)
                    self.sync.on_replay_reply(frame.seq, frame.digest, frame.nbytes, frame, self.now)
            delivered += 1
            self.execute()

    def time_out_replay(self) -> None:
        if self.answer is not None:
            self.answer = None
            self.sync.on_replay_end(False, self.now)
            self.execute()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        deadline = self.sync.deadline
        if deadline is not None and self.now >= deadline:
            self.sync.on_timer(self.now)
            self.execute()

    def quiesce(self, *, limit: int = 100_000) -> None:
        """Deliver everything in flight (delayed batches too), answer every request, run out every deadline."""
        self.release_delayed()
        for _ in range(limit):
            if self.live:
                self.deliver_live()
            elif self.answer is not None:
                self.deliver_replay()
            elif self.sync.deadline is not None:
                self.now = max(self.now, self.sync.deadline)
                self.sync.on_timer(self.now)
                self.execute()
            else:
                return
        raise AssertionError("the sync never became quiescent")

    # -- what the invariant compares ---------------------------------------------------------------------------

    def full_history(self) -> list[tuple[int, int]]:
        return [(batch.incarnation, batch.seq) for batch in self.engine.history]

    def lost_reported(self) -> int:
        return sum(signal.lost_batches for signal in self.signals)

    def resets(self) -> int:
        return sum(signal.reset for signal in self.signals)
