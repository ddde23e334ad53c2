"""A fake vLLM engine that speaks vLLM 0.32.0's KV event wire protocol, and a workload to drive it.

:class:`FakeVllmEngine` follows docs/spec/vllm-wire.md §13: live batches ``[topic, seq8, payload]`` on a PUB-like
socket (an XPUB, so :meth:`FakeVllmEngine.wait_for_subscriber` knows when a SUB has really subscribed —
the slow-joiner fix for tests), a ``deque(maxlen=buffer_steps)`` replay buffer served over a ROUTER, and
fault injection (skipped seqs, live drops kept for replay, used-up seqs, adjacent swaps, duplicates,
restarts, a killed and revived process, raw frames). Its ``truth`` is what it really holds.

:class:`SimulatedWorkload` produces realistic GPU prefix-cache events: requests sharing system prompts,
chained block hashes derived as vLLM's ``sha256_cbor`` does (§7.2), LRU evictions at capacity with one
remove per block (§8), rare prefix-cache resets, and some CPU offload stores/removes. The hash and event
builders live in :mod:`kvagent.simulator.events` (re-exported here).
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgpack
import structlog
import trio
import zmq

from kvagent._util.sync import Changed, checkpoint
from kvagent._util.zmqtrio import TrioSocket
from kvagent.simulator.events import (
    NONE_HASH,
    Event,
    ResidentTruth,
    all_blocks_cleared,
    block_removed,
    block_stored,
    cbor_encode,
    chain_block_hash,
    fold_hash,
    to_legacy,
)
from kvagent.wire.vllm_events import END_SEQ

__all__ = [
    "NONE_HASH",
    "VLLM_REPLAY_HWM",
    "FakeVllmEngine",
    "ResidentTruth",
    "SimulatedWorkload",
    "all_blocks_cleared",
    "block_removed",
    "block_stored",
    "cbor_encode",
    "chain_block_hash",
    "fold_hash",
    "run_simulated_engine",
    "to_legacy",
]

log = structlog.get_logger(__name__)


# --- the engine ------------------------------------------------------------------------------------------

# vLLM's replay ROUTER runs at libzmq's default send HWM and drops silently beyond it (docs/spec/vllm-wire.md §9.1).
VLLM_REPLAY_HWM = 1000
_REBIND_TIMEOUT = 10.0


class FakeVllmEngine:
    """One DP rank's vLLM KV event publisher: XPUB for live batches, optional ROUTER for replay.

    ``kill()`` closes both sockets (connected SUBs see the TCP connection drop, as after a SIGKILL) and
    ``revive(restart=...)`` binds the same ports again: the same engine coming back, or with ``restart`` a
    new one (seq 0, empty replay buffer and cache). ``swap_rate`` and ``duplicate_rate`` make the live path
    send a batch after its successor, or twice (drawn from ``fault_seed``); ``truth`` is the engine's real
    residency, whatever reached the subscribers.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = None,
        topic: bytes | str = b"kv-events",
        dp_rank: int = 0,
        block_size: int = 16,
        mode: Literal["map", "legacy"] = "map",
        buffer_steps: int = 10_000,
        replay_layout: Literal["v0.26", "v0.25", "sglang"] = "v0.26",  # sglang: the 3-frame v0.25 form
        context: zmq.Context[Any] | None = None,
        *,
        replay_hwm: int | None = None,
        swap_rate: float = 0.0,
        duplicate_rate: float = 0.0,
        fault_seed: int = 0,
        buffer_in_send_order: bool = False,
    ) -> None:
        self.configured_endpoint = endpoint
        self.configured_replay_endpoint = replay_endpoint
        self.topic = topic.encode() if isinstance(topic, str) else topic
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.mode = mode
        self.replay_layout = replay_layout
        self.context = context if context is not None else zmq.Context.instance()
        # vLLM's ROUTER runs at the libzmq default (VLLM_REPLAY_HWM) and drops silently beyond it; by default
        # the fake lets one whole buffer through so simulated cold attaches are complete.
        self.replay_hwm = replay_hwm if replay_hwm is not None else buffer_steps + 2
        self.swap_rate = swap_rate
        # A swapped batch enters the replay buffer when it is sent (after its successor), as in a publisher
        # that buffers what it sends: replay answers then carry the same swaps.
        self.buffer_in_send_order = buffer_in_send_order
        self.duplicate_rate = duplicate_rate
        self._faults = random.Random(fault_seed)
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.truth = ResidentTruth()
        self.next_seq = 0
        self.published = 0
        self.replay_requests = 0
        self.replay_starts: list[int] = []
        self.subscriptions = 0
        self.swapped = 0
        self.duplicated = 0
        self.incarnation = 0  # bumped by every restart: a new engine
        self._held_back: list[bytes] | None = None  # a live message that goes out after its successor
        self._held_back_lost = False
        self._last_stamp = 0.0
        self._pub: TrioSocket | None = None
        self._sockets: list[TrioSocket] = []
        self._scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._endpoint: str | None = None
        self._replay_endpoint: str | None = None
        self._subscription_changed = Changed()  # a subscription was counted
        self.replay_served = Changed()  # a replay request was answered

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("the fake engine is not running yet")
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        if self.configured_replay_endpoint is None:
            return None
        if self._replay_endpoint is None:
            raise RuntimeError("the fake engine is not running yet")
        return self._replay_endpoint

    @property
    def alive(self) -> bool:
        return self._pub is not None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._bind()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self.kill()

    def _bind(self) -> None:
        """Bind both sockets (the ports of the first bind ever after) and start serving them."""
        sockets: list[TrioSocket] = []
        try:
            xpub = self.context.socket(zmq.XPUB)
            sockets.append(TrioSocket(xpub))
            xpub.setsockopt(zmq.LINGER, 0)
            xpub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first per topic
            xpub.bind(self._endpoint or self.configured_endpoint)
            router: TrioSocket | None = None
            if self.configured_replay_endpoint is not None:
                raw_router = self.context.socket(zmq.ROUTER)
                router = TrioSocket(raw_router)
                sockets.append(router)
                raw_router.setsockopt(zmq.LINGER, 0)
                raw_router.setsockopt(zmq.SNDHWM, self.replay_hwm)
                raw_router.bind(self._replay_endpoint or self.configured_replay_endpoint)
                self._replay_endpoint = raw_router.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        self._endpoint = xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sockets = sockets
        self._pub = sockets[0]
        self.subscriptions = 0
        assert self._nursery is not None
        self._scope = trio.CancelScope()
        self._nursery.start_soon(self._serve, self._scope, sockets[0], router)

    async def _serve(self, scope: trio.CancelScope, pub: TrioSocket, router: TrioSocket | None) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_subscriptions, pub)
                if router is not None:
                    nursery.start_soon(self._serve_replay, router)

    def kill(self) -> None:
        """Die like a SIGKILLed process: both sockets close now, anything held back is never sent."""
        if self._scope is not None:
            self._scope.cancel()  # first, so no task is still waiting on a socket being closed
            self._scope = None
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        self._pub = None
        self._held_back = None

    async def revive(self, *, restart: bool) -> None:
        """Bind the same ports again: the same engine (``restart=False``) or a new one."""
        if self.alive:
            raise RuntimeError("the fake engine is still running")
        if self._nursery is None:
            raise RuntimeError("the fake engine's run() has ended")
        if restart:
            self.restart()
        with trio.fail_after(_REBIND_TIMEOUT):
            while True:
                try:
                    self._bind()
                    return
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE:
                        raise
                # libzmq releases a closed socket's port in its I/O thread, a moment after close().
                await trio.sleep(0.01)

    # -- subscriptions ----------------------------------------------------------------------------------

    def _drain_subscriptions(self) -> None:
        pub = self._pub
        if pub is None:
            return
        while True:
            try:
                message = pub.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self.subscriptions += 1
                self._subscription_changed.notify()

    async def _watch_subscriptions(self, pub: TrioSocket) -> None:
        # The only task that waits on the XPUB's FD. Sends (in publish_batch) never wait, and they drain
        # subscriptions themselves because a send can consume the FD's edge (pyzmq's documentation of zmq.FD).
        # kill() closes the socket while this task may be runnable (its cancellation then comes at the next
        # checkpoint): check before touching it (wait_readable checks too, and re-reads EVENTS before waiting).
        while not pub.socket.closed:
            self._drain_subscriptions()
            await pub.wait_readable()

    async def wait_for_subscriber(self, count: int = 1) -> None:
        """Return once ``count`` subscriptions have reached this incarnation of the publisher socket."""
        self._drain_subscriptions()
        await self._subscription_changed.wait_for(lambda: self.subscriptions >= count)

    # -- live path --------------------------------------------------------------------------------------

    def encode_batch(self, events: Sequence[Event], *, ts: float | None = None) -> bytes:
        encoded = [to_legacy(e) for e in events] if self.mode == "legacy" else list(events)
        if ts is None:
            # Strictly increasing, as an engine's clock is between steps: no two batches ever share bytes.
            ts = max(time.time(), self._last_stamp + 1e-6)
            self._last_stamp = ts
        return bytes(msgpack.packb([float(ts), encoded, self.dp_rank], use_bin_type=True))

    def _send(self, frames: list[bytes]) -> None:
        pub = self._pub
        if pub is None:
            raise RuntimeError("the fake engine is not running")
        pub.try_send_multipart(frames)  # a PUB drops at its HWM; so does this
        self._drain_subscriptions()

    def _send_live(
        self, frames: list[bytes] | None, *, swap: bool = False, duplicate: bool = False, lost: bool = False
    ) -> None:
        """Send one live message (None: nothing to send), after which any held-back one goes out.

        ``lost``: sent, so buffered in send order (``buffer_in_send_order``), but lost on the way."""
        held, held_lost = self._held_back, self._held_back_lost
        self._held_back, self._held_back_lost = None, False
        if frames is not None:
            if held is None and (swap or self._draw(self.swap_rate)):
                self.swapped += 1
                self._held_back, self._held_back_lost = frames, lost
                return
            self._deliver(frames, lost=lost, duplicate=duplicate)
        if held is not None:
            self._deliver(held, lost=held_lost, duplicate=False)

    def _deliver(self, frames: list[bytes], *, lost: bool, duplicate: bool) -> None:
        if self.buffer_in_send_order:
            self.buffer.append((int.from_bytes(frames[1], "big"), frames[2]))
        if lost:
            return
        self._send(frames)
        if duplicate or self._draw(self.duplicate_rate):
            self.duplicated += 1
            self._send(frames)

    def _draw(self, rate: float) -> bool:
        return rate > 0.0 and self._faults.random() < rate

    def flush_live(self) -> None:
        """Send a live message held back for a swap now (its successor never came)."""
        self._send_live(None)

    async def publish_batch(
        self,
        events: Sequence[Event],
        *,
        skip_seq: bool = False,
        drop_live: bool = False,
        unbuffered: bool = False,
        swap_with_next: bool = False,
        duplicate: bool = False,
    ) -> int:
        """Publish one engine step; returns the seq it used.

        ``skip_seq``: a seq number is used up before this batch (a gap replay cannot fill).
        ``drop_live``: not sent live but kept in the replay buffer (a recoverable HWM/slow-joiner drop).
        ``unbuffered``: the seq is used up and nothing is sent or buffered (an encode/send failure).
        ``swap_with_next``: sent live right after the next batch; ``duplicate``: sent live twice.
        The events are part of the engine's ``truth`` whatever happens to the batch.
        """
        await checkpoint()
        if skip_seq:
            self.next_seq += 1
        seq = self.next_seq
        self.next_seq += 1
        self.truth.apply(events)
        if unbuffered:
            return seq
        payload = self.encode_batch(events)
        frames = [self.topic, seq.to_bytes(8, "big"), payload]
        if self.buffer_in_send_order:  # buffered when sent, even if then lost on the way (drop_live)
            self._send_live(frames, swap=swap_with_next, duplicate=duplicate, lost=drop_live)
        else:
            self._send_live(None if drop_live else frames, swap=swap_with_next, duplicate=duplicate)
            self.buffer.append((seq, payload))
        self.published += 1
        return seq

    def publish_burst(self, steps: Iterable[Sequence[Event]]) -> list[int]:
        """Publish several engine steps at once, without yielding: a burst as an engine in its own process
        sends it, faster than any subscriber on this event loop reads. Returns the seqs used."""
        seqs = []
        for events in steps:
            seq = self.next_seq
            self.next_seq += 1
            self.truth.apply(events)
            payload = self.encode_batch(events)
            self._send_live([self.topic, seq.to_bytes(8, "big"), payload])
            if not self.buffer_in_send_order:
                self.buffer.append((seq, payload))
            self.published += 1
            seqs.append(seq)
        return seqs

    async def publish_frames(self, frames: Sequence[bytes]) -> None:
        """Send raw frames on the live socket (malformed messages; nothing is buffered)."""
        await checkpoint()
        self._send(list(frames))

    publish_raw = publish_frames

    async def send_payload(self, payload: bytes, *, seq: int | None = None) -> int:
        """Publish an already-encoded batch payload under the next seq (or ``seq``) and buffer it."""
        await checkpoint()
        if seq is None:
            seq = self.next_seq
        self.next_seq = seq + 1
        self._send([self.topic, seq.to_bytes(8, "big"), payload])
        self.buffer.append((seq, payload))
        self.published += 1
        return seq

    async def publish_frames_sequence(self, messages: Sequence[Sequence[bytes]]) -> None:
        """Send captured live messages verbatim (e.g. the ``sub`` lines of the 0.32.0 capture), in order."""
        for frames in messages:
            await self.publish_frames(frames)

    def load_replay_buffer(self, pairs: Iterable[tuple[int, bytes]]) -> None:
        """Serve replay from these ``(seq, payload)`` pairs (e.g. the capture's ``replay`` lines)."""
        self.buffer.clear()
        self.buffer.extend(pairs)
        if self.buffer:
            self.next_seq = max(self.next_seq, self.buffer[-1][0] + 1)

    def restart(self) -> None:
        """A new engine on the same sockets: seq back to 0, replay buffer and cache gone, no AllBlocksCleared."""
        self.next_seq = 0
        self.buffer.clear()
        self.truth.clear()
        self.incarnation += 1
        self._held_back = None

    # -- replay -----------------------------------------------------------------------------------------

    def replay_replies(self, start: int) -> list[list[bytes]]:
        """The DEALER-side frames for a request from ``start`` (identity not included)."""
        v26 = self.replay_layout == "v0.26"
        replies = [
            [b"", self.topic, seq.to_bytes(8, "big"), payload]
            if v26
            else [b"", seq.to_bytes(8, "big"), payload]
            for seq, payload in self.buffer
            if seq >= start
        ]
        replies.append([b"", b"", END_SEQ, b""] if v26 else [b"", END_SEQ, b""])
        return replies

    async def _serve_replay(self, router: TrioSocket) -> None:
        while True:
            request = await router.recv_multipart()
            if router.closed:
                # kill() ran while this task was being resumed with the request: a dead engine answers nothing.
                return
            if len(request) != 3 or request[1] != b"":
                log.warning("fake_engine_invalid_replay_request", frames=len(request))
                continue  # vLLM answers nothing at all
            identity = request[0]
            start = int.from_bytes(request[2], "big")
            self.replay_requests += 1
            self.replay_starts.append(start)
            # Served in one go like vLLM's publisher thread; ROUTER drops beyond its HWM instead of blocking.
            for reply in self.replay_replies(start):
                router.try_send_multipart([identity, *reply])
            self.replay_served.notify()


# --- the workload ----------------------------------------------------------------------------------------


class SimulatedWorkload:
    """Deterministic (per seed) engine steps with prefix sharing, LRU eviction and some CPU offload."""

    def __init__(
        self,
        seed: int,
        block_size: int,
        capacity_blocks: int = 512,
        system_prompts: int = 3,
        *,
        clear_probability: float = 0.002,
        offload_probability: float = 0.1,
        cpu_capacity_blocks: int | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.clear_probability = clear_probability
        self.offload_probability = offload_probability
        self.cpu_capacity_blocks = cpu_capacity_blocks if cpu_capacity_blocks is not None else capacity_blocks
        rng = self.rng
        self.system_prompts = [
            [rng.randrange(1, 50_000) for _ in range(block_size * rng.randint(2, 6))]
            for _ in range(system_prompts)
        ]
        # folded hash -> (parent folded hash, tokens, physical copies); insertion order is LRU order.
        self.gpu: collections.OrderedDict[int, tuple[int | None, tuple[int, ...], int]] = (
            collections.OrderedDict()
        )
        self.cpu: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.steps = 0

    def _request_tokens(self) -> list[int]:
        rng = self.rng
        prompt = list(rng.choice(self.system_prompts))
        user_blocks = rng.randint(1, 4)
        # A little extra beyond full blocks: partial blocks are never hashed or stored.
        prompt += [
            rng.randrange(1, 50_000)
            for _ in range(user_blocks * self.block_size + rng.randrange(self.block_size))
        ]
        return prompt

    def _schedule_request(self, events: list[dict[str, Any]]) -> None:
        tokens = self._request_tokens()
        size = self.block_size
        parent_digest: bytes | None = None
        parent: int | None = None
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        store_parent: int | None = None
        for start in range(0, len(tokens) - size + 1, size):
            block = tuple(tokens[start : start + size])
            parent_digest = chain_block_hash(parent_digest, block)
            folded = fold_hash(parent_digest)
            if not new_hashes and folded in self.gpu:
                self.gpu.move_to_end(folded)  # a prefix-cache hit: no event
            else:
                if not new_hashes:
                    store_parent = parent
                new_hashes.append(folded)
                new_tokens.extend(block)
                # Past the first miss vLLM allocates fresh blocks even for hashes it already caches: a
                # second physical copy, stored again and evicted (removed) separately.
                copies = self.gpu.pop(folded, (parent, block, 0))[2]
                self.gpu[folded] = (parent, block, copies + 1)
            parent = folded
        if new_hashes:
            events.append(block_stored(new_hashes, store_parent, new_tokens, size))
        while len(self.gpu) > self.capacity_blocks:
            evicted, (_, _, copies) = self.gpu.popitem(last=False)
            events.extend(block_removed([evicted]) for _ in range(copies))

    def _offload(self, events: list[dict[str, Any]]) -> None:
        candidates = [h for h in self.gpu if h not in self.cpu]
        if not candidates:
            return
        chosen = self.rng.choice(candidates)
        parent, block, _ = self.gpu[chosen]
        # A self-describing CPU store from the offloading connector (framework-owned: no ownership key).
        events.append(block_stored([chosen], parent, block, self.block_size, medium="CPU"))
        self.cpu[chosen] = None
        while len(self.cpu) > self.cpu_capacity_blocks:
            evicted, _ = self.cpu.popitem(last=False)
            events.append(block_removed([evicted], medium="CPU"))

    def next_step(self) -> list[dict[str, Any]]:
        """The events of one engine step (possibly none: an idle step publishes nothing)."""
        self.steps += 1
        rng = self.rng
        events: list[dict[str, Any]] = []
        if self.gpu and rng.random() < self.clear_probability:
            # reset_prefix_cache(): one AllBlocksCleared; the source's tiers are gone.
            events.append(all_blocks_cleared())
            self.gpu.clear()
            self.cpu.clear()
        for _ in range(rng.randint(0, 3)):
            self._schedule_request(events)
        if rng.random() < self.offload_probability:
            self._offload(events)
        return events


async def run_simulated_engine(
    engine: FakeVllmEngine,
    workload: SimulatedWorkload,
    *,
    steps_per_second: float = 20.0,
    max_steps: int | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish one batch per engine step that has events; ``engine.run`` must already have started."""
    task_status.started()
    interval = 1.0 / steps_per_second if steps_per_second > 0 else 0.0
    deadline = trio.current_time()
    steps = 0
    while max_steps is None or steps < max_steps:
        events = workload.next_step()
        steps += 1
        if events:
            await engine.publish_batch(events)
        # Pacing, not synchronization: a fixed engine step rate without drift.
        deadline += interval
        await trio.sleep_until(deadline)
