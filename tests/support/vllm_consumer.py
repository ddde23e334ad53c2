"""A plain vLLM-style KV event consumer: SUB for live batches, DEALER for replay, as vLLM's docs show.

It is written the way vLLM's example subscriber (``kv_events_subscriber.py``) works, with that example's
known bugs fixed (docs/spec/vllm-wire.md §14): it tracks ``last_seq`` on the live path, replays with a DEALER sending
``[b"", start_seq]``, parses the 4-frame (or 3-frame legacy) replies and ends on the ``ff×8`` seq.  It knows
nothing of kvagent: a late join (and its own restart) asks replay from seq 0, a gap asks from ``last + 1``,
every replayed frame with ``seq >= start`` is applied (so a snapshot answer, whose frames all carry one seq,
is applied whole), and ``AllBlocksCleared`` empties its view. Without a replay endpoint it is a SUB alone and
applies whatever follows a gap (as Dynamo's indexer does without one). Its view outlives :meth:`run`: running
it again is the same consumer rejoining with a new SUB.
"""

from __future__ import annotations

from typing import Any

import msgpack
import trio
import zmq

from kvagent._util.zmqtrio import TrioSocket

END_SEQ = b"\xff" * 8
REPLAY_TIMEOUT = 20.0


class VllmStyleConsumer:
    """The resident set one vLLM-format stream describes: ``{(medium, block_hash)}``."""

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: bytes = b"",
        legacy_replay: bool = False,
        rcvhwm: int = 100_000,
        rcvbuf: int = -1,
    ) -> None:
        self.context = context
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.legacy_replay = legacy_replay
        self.rcvhwm = rcvhwm
        self.rcvbuf = rcvbuf  # -1: the OS default
        self.resident: set[tuple[str, int]] = set()
        self.last_seq: int | None = None
        self.clears = 0
        self.replays: list[int] = []  # the start of every replay asked
        self.snapshot_answers = 0  # answers not starting at the seq asked (a snapshot)
        self.stores_without_tokens = 0
        self.gaps_unrepaired = 0  # gaps seen without a replay endpoint (what followed was applied as is)
        self.token_counts_ok = True
        self._progress = trio.Event()
        self.joined = trio.Event()  # set once the first replay (the late join) has been applied

    # --- applying ---------------------------------------------------------------------------------
    def apply(self, payload: bytes) -> None:
        _ts, events, _rank = msgpack.unpackb(payload)
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                hashes = event["block_hashes"]
                if not event["token_ids"]:
                    self.stores_without_tokens += 1
                elif len(event["token_ids"]) != len(hashes) * event["block_size"]:
                    self.token_counts_ok = False
                self.resident.update((event["medium"], block_hash) for block_hash in hashes)
            elif kind == "BlockRemoved":
                self.resident.difference_update(
                    (event["medium"], block_hash) for block_hash in event["block_hashes"]
                )
            elif kind == "AllBlocksCleared":
                self.resident.clear()
                self.clears += 1

    def _advance(self, seq: int) -> None:
        self.last_seq = seq if self.last_seq is None else max(self.last_seq, seq)
        self._progress.set()
        self._progress = trio.Event()

    async def wait_for_seq(self, seq: int) -> None:
        while self.last_seq is None or self.last_seq < seq:
            await self._progress.wait()

    def hashes(self) -> set[int]:
        return {block_hash for _, block_hash in self.resident}

    async def wait_for_hashes(self, expected: set[int]) -> None:
        """Return once the resident hashes are exactly ``expected`` (checked after every applied batch)."""
        while self.hashes() != expected:
            await self._progress.wait()

    # --- replay -----------------------------------------------------------------------------------
    async def replay(self, dealer: TrioSocket, start: int) -> None:
        """Ask ``[b"", start]`` and apply every reply with ``seq >= start`` until the end marker."""
        self.replays.append(start)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        seqs: list[int] = []
        with trio.fail_after(REPLAY_TIMEOUT):
            while True:
                frames = await dealer.recv_multipart()
                assert frames[0] == b"", frames
                if self.legacy_replay:
                    assert len(frames) == 3, frames
                    seq_frame, payload = frames[1], frames[2]
                else:
                    assert len(frames) == 4, frames
                    assert frames[1] in (self.topic, b""), frames
                    seq_frame, payload = frames[2], frames[3]
                if seq_frame == END_SEQ:
                    assert payload == b""
                    break
                assert payload, "a data reply must carry a payload"
                seq = int.from_bytes(seq_frame, "big")
                seqs.append(seq)
                if seq >= start:
                    self.apply(payload)
        if seqs and seqs[0] != start:  # a range answer starts at the start asked; a snapshot does not
            self.snapshot_answers += 1
        if seqs:
            self._advance(max(seqs))
        else:
            self._progress.set()
            self._progress = trio.Event()

    # --- the task ---------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.replay_endpoint is None:
            await self._run_without_replay(task_status)
            return
        sub = self.context.socket(zmq.SUB)
        dealer = self.context.socket(zmq.DEALER)
        for sock in (sub, dealer):
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.RCVBUF, self.rcvbuf)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        dealer.connect(self.replay_endpoint)
        with TrioSocket(sub) as live, TrioSocket(dealer) as replies:
            task_status.started()
            await self.replay(replies, 0)  # a late join: everything from the beginning
            self.joined.set()
            while True:
                topic, seq_frame, payload = await live.recv_multipart()
                assert topic.startswith(self.topic)
                seq = int.from_bytes(seq_frame, "big")
                last = -1 if self.last_seq is None else self.last_seq
                if seq <= last:
                    continue  # already applied (replay overlap)
                if seq > last + 1:
                    await self.replay(replies, last + 1)  # a gap: ask for what is missing
                    if self.last_seq is not None and seq <= self.last_seq:
                        continue
                self.apply(payload)
                self._advance(seq)

    async def _run_without_replay(self, task_status: trio.TaskStatus[None]) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        with TrioSocket(sub) as live:
            task_status.started()
            self.joined.set()
            while True:
                topic, seq_frame, payload = await live.recv_multipart()
                assert topic.startswith(self.topic)
                seq = int.from_bytes(seq_frame, "big")
                if self.last_seq is not None and seq <= self.last_seq:
                    continue  # stale, as Dynamo's watermark drops it
                if self.last_seq is not None and seq > self.last_seq + 1:
                    self.gaps_unrepaired += 1
                self.apply(payload)
                self._advance(seq)
