"""Sans-IO state of one slot's vLLM-format republisher: kvagent's seq space, the replay ring and a mirror.

:class:`RepublishState` turns each outbound batch of RouterEvents into one vLLM 0.32.0 ``KVEventBatch``
payload under a seq that kvagent owns (0, 1, 2, ... for the state's lifetime, never reused: engine restarts,
detaches and resets are ``AllBlocksCleared`` in the stream, not a new seq space). It keeps the newest
payloads in a ring for replay, and a mirror of the Worker-domain resident blocks (with their tokens) for
snapshots: a replay start older than the ring, or the request ``b"snapshot"``, is answered in the shape of
vLLM PR #50134 (``AllBlocksCleared``, then every resident block as ``BlockStored``, parents first).

Snapshot consistency without copying: a snapshot streams the mirror as it is after batch ``seq``; while any
snapshot stream is open, :meth:`RepublishState.publish` still assigns seqs and fills the ring, but the mirror
updates wait until the last open stream is finished or closed. Iteration therefore never sees the mirror
change, and memory stays bounded by the mirror itself plus the batches published meanwhile. A snapshot
started while another is open shows the same (older) state and says so in its seq.

A consumer that joins late, or rejoins after kvagent's own restart, may hold a state the stream cannot
repair by itself (a consumer without replay applies whatever arrives after a gap). A *resync* publishes the
whole state as ordinary live batches under the next seqs, as an engine would: ``AllBlocksCleared``, every
resident block parents first, then the batches published while the resync was being encoded, once more
(:meth:`RepublishState.begin_resync` freezes the mirror like a snapshot, the shell encodes a chunk at a time,
:meth:`RepublishState.finish_resync` numbers the batches). :class:`ResyncGate` decides when the shell may
send one (subscriptions coalesce, and the bytes sent bound how soon the next may go).

The mirror keeps each tier's blocks in flat columns (about 200 bytes a block of 16 tokens, tokens included):
see :class:`_TierBlocks`.

The trio/zmq shell (``kvagent.publish.republisher``) owns the sockets; nothing here does IO.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from itertools import compress, islice
from typing import TypeAlias

import attrs

from kvagent.model.events import Cleared, ResidencyDomain, RouterEvent, StorageTier, Stored
from kvagent.wire.vllm_events import (
    SNAPSHOT_REQUEST,
    SnapshotBlock,
    encode_publication,
    encode_snapshot_batches,
)

__all__ = [
    "MirrorRows",
    "RangeAnswer",
    "ReplayAnswer",
    "ResyncBuild",
    "ResyncGate",
    "RepublishState",
    "RepublishStatistics",
    "SnapshotAnswer",
    "SnapshotStream",
    "snapshot_frame_seq",
]

SNAPSHOT_MAX_BLOCKS = 512  # blocks per snapshot payload: bounded frames, few of them

_WORKER = ResidencyDomain.WORKER


def snapshot_frame_seq(included_seq: int) -> int:
    """The seq written on every frame of a snapshot that includes batches up to ``included_seq``.

    vLLM PR #50134 writes the *next* live seq there, but Dynamo 1.6.1's indexer then drops the live batch
    with that seq (a late-joining indexer missed blocks); the seq of the last batch the snapshot includes
    works. Flip it here (``included_seq + 1``) if a consumer needs #50134's form.
    """
    return included_seq


@attrs.frozen(slots=True)
class RepublishStatistics:
    """Counters of one :class:`RepublishState`; each has the name of its ``kvagent_republish_*`` family where it
    has one.

    Attributes:
        batches: batches published, resyncs' included (each took the next seq).
        events: events in the published batches.
        ring_batches, ring_bytes: batches and payload bytes in the replay ring.
        resident_blocks: blocks in the snapshot mirror.
        stores_without_tokens: stores published with ``token_ids=[]`` (Dynamo's indexer drops them).
        snapshots_served: replay answers served as snapshots.
        ranges_served: replay answers served as a range of the ring (empty ones included).
        snapshots_open: snapshot streams open (replay snapshots, a resync's build, persisted mirror rows).
        deferred_batches: published batches waiting for open snapshots before reaching the mirror.
        resyncs: whole-state resyncs published as live batches (``begin_resync``, ``finish_resync``).
        resync_batches, resync_bytes: the batches (and seqs) the resyncs took, and their payload bytes.
    """

    batches: int
    events: int
    ring_batches: int
    ring_bytes: int
    resident_blocks: int
    stores_without_tokens: int
    snapshots_served: int
    ranges_served: int
    snapshots_open: int = 0
    deferred_batches: int = 0
    resyncs: int = 0
    resync_batches: int = 0
    resync_bytes: int = 0


class SnapshotStream:
    """The payloads of one snapshot, lazily encoded; :meth:`close` (or exhaustion) releases the mirror.

    Not a generator so that a stream closed (or dropped) before its first ``next`` still releases the
    mirror: a generator's ``finally`` only runs once it has started.
    """

    def __init__(self, payloads: Generator[bytes, None, None], on_close: Callable[[], None]) -> None:
        self._payloads = payloads
        self._on_close: Callable[[], None] | None = on_close

    def __iter__(self) -> SnapshotStream:
        return self

    def __next__(self) -> bytes:
        if self._on_close is None:
            raise StopIteration
        try:
            return next(self._payloads)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self._on_close is None

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            self._payloads.close()
            on_close()

    def __del__(self) -> None:
        self.close()


class MirrorRows:
    """The republish mirror's blocks, frozen while open (see :meth:`RepublishState.mirror_rows`)."""

    def __init__(self, blocks: Generator[SnapshotBlock, None, None], on_close: Callable[[], None]) -> None:
        self._blocks = blocks
        self._on_close: Callable[[], None] | None = on_close

    def __iter__(self) -> Iterator[SnapshotBlock]:
        return self._blocks

    def close(self) -> None:
        """Unfreeze the mirror (on the event loop's thread); idempotent."""
        self._blocks.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __del__(self) -> None:
        self.close()


@attrs.frozen(slots=True)
class RangeAnswer:
    """Ring batches ``(seq, payload)`` from the requested start on (possibly none), then the end marker."""

    batches: Iterator[tuple[int, bytes]]

    def close(self) -> None:
        """Nothing to release (the batches were taken from the ring when the answer was made)."""


@attrs.frozen(slots=True)
class SnapshotAnswer:
    """Snapshot payloads, every frame carrying ``seq`` (see :func:`snapshot_frame_seq`), then the end marker.

    ``seq`` is the last batch the snapshot includes: ``last_seq`` when it was made, or older when another
    snapshot was still open then. Call :meth:`close` when the answer ends early: the mirror stays frozen
    while a snapshot is open.
    """

    seq: int
    payloads: SnapshotStream

    def close(self) -> None:
        self.payloads.close()


ReplayAnswer: TypeAlias = RangeAnswer | SnapshotAnswer


class ResyncBuild:
    """A resync being encoded (see :meth:`RepublishState.begin_resync`): the mirror stays frozen until
    :meth:`close` (which :meth:`RepublishState.finish_resync` calls)."""

    def __init__(self, cut: int, stream: SnapshotStream, on_close: Callable[[ResyncBuild], None]) -> None:
        self.cut = cut  # the last batch the encoded state includes
        self.payloads: list[bytes] = []
        self.catch_up: list[list[RouterEvent]] = []  # the Worker events published since the cut, in order
        self._stream = stream
        self._on_close: Callable[[ResyncBuild], None] | None = on_close

    def encode(self, count: int | None) -> bool:
        """Encode up to ``count`` more payloads (None: all); True once every payload is encoded."""
        if self._stream.closed:
            return True
        payloads = self._stream if count is None else islice(self._stream, count)
        before = len(self.payloads)
        self.payloads.extend(payloads)
        if count is not None and len(self.payloads) - before == count:
            return False
        self._stream.close()
        return True

    def close(self) -> None:
        self._stream.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(self)


@attrs.define
class ResyncGate:
    """When the next whole-state resync may go out (sans-IO: the caller passes the time).

    Subscriptions only mark a resync as wanted; every subscription noted before one is sent is served by it.
    After a resync of ``B`` bytes the next waits ``max(min_interval, B / bytes_per_second)``: a consumer that
    reconnects in a loop costs at most one resync per interval, and the resync traffic of a large state at
    most ``bytes_per_second`` on average.
    """

    min_interval: float
    bytes_per_second: float
    wanted: bool = False
    not_before: float = -math.inf

    def want(self) -> None:
        self.wanted = True

    def due(self, now: float) -> bool:
        return self.wanted and now >= self.not_before

    def sent(self, now: float, size: int) -> None:
        self.wanted = False
        self.not_before = now + max(self.min_interval, size / self.bytes_per_second)


class RepublishState:
    """kvagent's seq space, the replay ring and the Worker-domain mirror of one slot (sans-IO)."""

    def __init__(
        self,
        *,
        dp_rank: int,
        block_size: int,
        ring_batches: int = 10_000,
        ring_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ring_batches < 1 or ring_bytes < 1:
            raise ValueError("the replay ring must hold at least one batch and one byte")
        self.dp_rank = dp_rank
        self.block_size = block_size
        self._ring_limit = ring_batches
        self._ring_bytes_limit = ring_bytes
        self._clock = clock
        self._ring: deque[tuple[int, bytes]] = deque()
        self._ring_bytes = 0
        self._next_seq = 0
        self._mirror: dict[StorageTier, _TierBlocks] = {}
        self._mirror_seq: int | None = None  # the last batch applied to the mirror
        # Published batches not yet in the mirror (only while a snapshot is open).
        self._deferred: deque[tuple[int, list[RouterEvent]]] = deque()
        self._snapshots_open = 0
        self._applying = False
        self._batches = 0
        self._events = 0
        self._without_tokens = 0
        self._snapshots_served = 0
        self._ranges_served = 0
        self._resyncs = 0
        self._resync_batches = 0
        self._resync_bytes = 0
        self._resync: ResyncBuild | None = None  # the resync being encoded
        # Called when the last open snapshot closes and the mirror has caught up (the shell's wakeup).
        self.on_mirror_current: Callable[[], None] | None = None

    # --- publishing ---------------------------------------------------------------------------------------

    def publish(self, events: Sequence[RouterEvent]) -> tuple[int, bytes] | None:
        """The ``(seq, payload)`` to send for an outbound batch, or None when it holds nothing to republish."""
        worker = [event for event in events if event.residency_domain is _WORKER]
        if not worker:
            return None
        payload = encode_publication(
            worker, ts=self._clock(), dp_rank=self.dp_rank, block_size=self.block_size
        )
        if payload is None:
            return None
        seq = self._next_seq
        self._next_seq = seq + 1
        self._append_ring(seq, payload)
        published = without_tokens = 0
        for event in worker:
            data = event.data
            if type(data) is Cleared or data.block_hashes:
                published += 1
                if type(data) is Stored and data.token_bytes is None:
                    without_tokens += 1
        self._batches += 1
        self._events += published
        self._without_tokens += without_tokens
        self._deferred.append((seq, worker))
        if self._resync is not None:
            self._resync.catch_up.append(worker)
        self._apply_deferred()
        return seq, payload

    def begin_resync(self) -> ResyncBuild:
        """Start encoding a resync: the whole Worker state as live batches (see :meth:`finish_resync`).

        The mirror is frozen at the newest batch until the build is finished or closed, so the encoding can
        be drawn a chunk at a time between other work while batches go on being published. Raises
        RuntimeError unless :attr:`mirror_current` (an open snapshot stream holds the mirror back).
        """
        if self._deferred:
            raise RuntimeError("the republish mirror lags the published batches (a snapshot stream is open)")
        if self._resync is not None:
            raise RuntimeError("a resync is being built already")
        cut = self._next_seq - 1
        payloads = self._open_snapshot_payloads()
        self._resync = ResyncBuild(cut, SnapshotStream(payloads, self._snapshot_closed), self._resync_closed)
        return self._resync

    def _resync_closed(self, build: ResyncBuild) -> None:
        if self._resync is build:
            self._resync = None

    def finish_resync(self, build: ResyncBuild) -> list[tuple[int, bytes]]:
        """The resync's batches, each under the next seq, in the order to send them.

        ``AllBlocksCleared`` and every block resident at the build's cut, parents first (at most
        ``SNAPSHOT_MAX_BLOCKS`` blocks a batch), then the batches published since the cut once more: what a
        consumer applies to end exactly at the newest state whatever it held, and a no-op for one already
        there. The batches enter the ring like any other (a range replay across them stays contiguous).
        Draws whatever the build has not encoded yet, and releases its hold on the mirror.
        """
        if build is not self._resync:
            raise RuntimeError("this resync build was closed (or is not this state's)")
        try:
            build.encode(None)
            ts = self._clock()
            catch_up = [
                encode_publication(events, ts=ts, dp_rank=self.dp_rank, block_size=self.block_size)
                for events in build.catch_up
            ]
            published: list[tuple[int, bytes]] = []
            for payload in [*build.payloads, *[each for each in catch_up if each is not None]]:
                seq = self._next_seq
                self._next_seq = seq + 1
                self._append_ring(seq, payload)
                published.append((seq, payload))
                self._resync_bytes += len(payload)
            self._batches += len(published)
            self._resyncs += 1
            self._resync_batches += len(published)
            # The resync changes no state: the mirror has caught up with it once it has applied what precedes it.
            self._deferred.append((self._next_seq - 1, []))
            self._apply_deferred()
            return published
        finally:
            build.close()

    def _append_ring(self, seq: int, payload: bytes) -> None:
        ring = self._ring
        ring.append((seq, payload))
        self._ring_bytes += len(payload)
        # The newest batch always stays, however large: a consumer that saw its seq can still ask for it.
        while len(ring) > 1 and (len(ring) > self._ring_limit or self._ring_bytes > self._ring_bytes_limit):
            self._ring_bytes -= len(ring.popleft()[1])

    def _apply(self, events: Sequence[RouterEvent]) -> None:
        mirror = self._mirror
        for event in events:
            data = event.data
            if type(data) is Cleared:
                # AllBlocksCleared carries no medium on the wire: a consumer forgets every tier.
                mirror.clear()
                continue
            if not data.block_hashes:
                continue
            tier = event.storage_tier
            blocks = mirror.get(tier)
            if type(data) is Stored:
                if blocks is None:
                    blocks = mirror[tier] = _TierBlocks(4 * self.block_size)
                blocks.store(data)
            elif blocks is not None:
                blocks.remove(data.block_hashes)
                if not blocks.rows:
                    del mirror[tier]

    def _snapshot_closed(self) -> None:
        self._snapshots_open -= 1
        self._apply_deferred()
        if not self._deferred and not self._snapshots_open and self.on_mirror_current is not None:
            self.on_mirror_current()

    def _apply_deferred(self) -> None:
        """Apply the published batches, in order, unless a snapshot is open.

        Every batch goes through the queue, even with no snapshot open: a snapshot stream dropped in a
        reference cycle is closed by the garbage collector at whatever allocation triggers it, and queueing
        first keeps the order wherever that is. Re-entry (which that cannot cause today) does nothing.
        """
        if self._snapshots_open or self._applying:
            return
        self._applying = True
        try:
            deferred = self._deferred
            while deferred and not self._snapshots_open:
                seq, events = deferred.popleft()
                self._apply(events)
                self._mirror_seq = seq
        finally:
            self._applying = False

    # --- replay -------------------------------------------------------------------------------------------

    @property
    def last_seq(self) -> int | None:
        """The seq of the newest published batch, None before the first."""
        return self._next_seq - 1 if self._next_seq else None

    @property
    def oldest_seq(self) -> int | None:
        """The oldest seq still in the replay ring, None before the first batch."""
        return self._ring[0][0] if self._ring else None

    def answer(self, request: bytes) -> ReplayAnswer:
        """What a replay request (the frame after the DEALER's empty delimiter) is answered with.

        ``b"snapshot"`` → a snapshot. An 8-byte big-endian start seq: past the newest batch → an empty
        range; inside the ring → the ring's batches from it; older than the ring → a snapshot. With nothing
        published yet every request gets an empty range. Anything else raises ValueError.
        """
        if request == SNAPSHOT_REQUEST:
            return self._snapshot()
        if len(request) != 8:
            raise ValueError(
                f"a replay request is an 8-byte big-endian start seq or b'snapshot', got {len(request)} bytes"
            )
        start = int.from_bytes(request, "big")
        last, oldest = self.last_seq, self.oldest_seq
        if last is None or start > last:
            self._ranges_served += 1
            return RangeAnswer(iter(()))
        if oldest is None or start < oldest:  # (an empty ring after a restore: every batch is older)
            return self._snapshot()
        self._ranges_served += 1
        # References to the ring's entries (not copies): the ring may evict while the answer streams.
        return RangeAnswer(iter(list(islice(self._ring, start - oldest, None))))

    def _snapshot(self) -> ReplayAnswer:
        included = self._mirror_seq
        if included is None:  # nothing published: the consumer's empty state is already right
            self._ranges_served += 1
            return RangeAnswer(iter(()))
        self._snapshots_served += 1
        payloads = self._open_snapshot_payloads()
        return SnapshotAnswer(snapshot_frame_seq(included), SnapshotStream(payloads, self._snapshot_closed))

    # --- persistence (issue #17) ---------------------------------------------------------------------------

    @property
    def mirror_current(self) -> bool:
        """The mirror includes every published batch (no snapshot stream holds updates back)."""
        return not self._deferred

    def mirror_rows(self) -> MirrorRows:
        """The mirror as of the last published batch, frozen until the returned rows are closed.

        For a persisted snapshot: iterate it anywhere (a worker thread too: publishing meanwhile only queues
        its mirror updates), then ``close()`` it on the event loop's thread. Raises RuntimeError unless
        :attr:`mirror_current` (the rows would lag the index's state).
        """
        if self._deferred:
            raise RuntimeError("the republish mirror lags the published batches (a snapshot stream is open)")
        self._snapshots_open += 1
        return MirrorRows(self.snapshot_blocks(), self._snapshot_closed)

    def restore(
        self, mirror_rows: Iterable[SnapshotBlock], suffix_events: Iterable[RouterEvent], next_seq: int
    ) -> None:
        """A restarted agent's state: the persisted mirror, then the outbound events after it applied; the
        ring stays empty and seqs continue at ``next_seq`` (older starts are answered with snapshots).

        Rows are ``(tier, block hash, parent hash, token bytes)`` in :meth:`mirror_rows` order (parents
        first); empty token bytes mean unknown tokens.  Only before anything is published.
        """
        if self._next_seq or self._ring or self._mirror or self._deferred:
            raise RuntimeError("restore needs a republish state that has published nothing")
        if next_seq < 0:
            raise ValueError(f"next_seq must be >= 0, got {next_seq}")
        mirror = self._mirror
        for tier, block_hash, parent, tokens in mirror_rows:
            blocks = mirror.get(tier)
            if blocks is None:
                blocks = mirror[tier] = _TierBlocks(4 * self.block_size)
            blocks.store(Stored(parent, (block_hash,), (0,), token_bytes=tokens or None))
        self._apply([event for event in suffix_events if event.residency_domain is _WORKER])
        self._next_seq = next_seq
        self._mirror_seq = next_seq - 1 if next_seq else None

    def _open_snapshot_payloads(self) -> Generator[bytes, None, None]:
        """The Worker state as vLLM batches, encoded lazily; counted open until its stream closes."""
        self._snapshots_open += 1
        return encode_snapshot_batches(
            self.snapshot_blocks(),
            ts=self._clock(),
            dp_rank=self.dp_rank,
            block_size=self.block_size,
            max_blocks=SNAPSHOT_MAX_BLOCKS,
        )

    def snapshot_blocks(self) -> Generator[SnapshotBlock, None, None]:
        """Every mirrored block, parents first within each tier.

        Insertion order is parent-first except where a parent was (re-)stored after its child; such a
        child (and its descendants) waits until its parent has been yielded. A parent cycle, which only
        contradictory re-stores can build, is yielded last in any order. Only call with the mirror frozen
        (an open snapshot), or consume it before the next :meth:`publish`.
        """
        for tier, blocks in list(self._mirror.items()):
            yield from blocks.parents_first(tier)

    # --- reporting ----------------------------------------------------------------------------------------

    def resident_blocks(self) -> int:
        return sum([len(blocks.rows) for blocks in self._mirror.values()])

    def statistics(self) -> RepublishStatistics:
        return RepublishStatistics(
            batches=self._batches,
            events=self._events,
            ring_batches=len(self._ring),
            ring_bytes=self._ring_bytes,
            resident_blocks=self.resident_blocks(),
            stores_without_tokens=self._without_tokens,
            snapshots_served=self._snapshots_served,
            ranges_served=self._ranges_served,
            snapshots_open=self._snapshots_open,
            deferred_batches=len(self._deferred),
            resyncs=self._resyncs,
            resync_batches=self._resync_batches,
            resync_bytes=self._resync_bytes,
        )


_HAS_PARENT = 1
_HAS_TOKENS = 2
_DEAD = 4
_LIVE_MASK = bytes(0 if value & _DEAD else 1 for value in range(256))  # flags -> 1 for a live row
_COMPACT_MIN_DEAD = 4096  # below this many dead rows a compaction is not worth its rebuild


class _TierBlocks:
    """One tier's mirrored blocks as append-only rows; row order is insertion order.

    ``rows`` maps each resident hash to its row; the row's hash, parent, flags and tokens live in flat
    columns, so a block costs its dict entry, 17 bytes and its tokens, and no Python object of its own. A
    re-store keeps its row (taking the newest parent and tokens); a removed block's row is flagged dead and
    the columns are compacted, in order, once more than half of them are dead. The row order tells at
    snapshot time whether a block's parent was (re-)stored after it, which parents-first needs.
    """

    __slots__ = ("dead", "flags", "hashes", "parents", "rows", "tokens", "width")

    def __init__(self, width: int) -> None:
        self.width = width  # token bytes a block
        self.rows: dict[int, int] = {}
        self.hashes = array("Q")
        self.parents = array("Q")
        self.flags = bytearray()
        self.tokens = bytearray()
        self.dead = 0

    def store(self, data: Stored) -> None:
        hashes = data.block_hashes
        count = len(hashes)
        token_bytes = data.token_bytes
        if token_bytes is not None and len(token_bytes) != self.width * count:
            token_bytes = None  # not this slot's block size: no tokens rather than misaligned ones
        parent = data.parent_hash
        rows = self.rows
        if not rows.keys().isdisjoint(hashes):  # a re-store: block by block, each keeps its row
            width = self.width
            for index, block_hash in enumerate(hashes):
                tokens = None if token_bytes is None else token_bytes[index * width : (index + 1) * width]
                self._put(block_hash, parent, tokens)
                parent = block_hash
            return
        # The common case, new blocks: appended in bulk at C speed.
        flags = self.flags
        first = len(flags)
        resident = len(rows)
        row = first
        for block_hash in hashes:  # faster than dict.update(zip(...)) for the few blocks of a store
            rows[block_hash] = row
            row += 1
        self.hashes.extend(hashes)
        known = 0 if token_bytes is None else _HAS_TOKENS
        flags.append(known | (0 if parent is None else _HAS_PARENT))
        self.parents.append(0 if parent is None else parent)
        if count > 1:
            flags.extend(bytes((known | _HAS_PARENT,)) * (count - 1))
            self.parents.extend(hashes[:-1])
        self.tokens.extend(bytes(self.width * count) if token_bytes is None else token_bytes)
        if len(rows) != resident + count:
            self._bury_repeats(first, hashes)

    def _bury_repeats(self, first: int, hashes: Sequence[int]) -> None:
        """A hash repeated within one chain lives in its last row; its earlier rows are dead."""
        rows, flags = self.rows, self.flags
        for offset, block_hash in enumerate(hashes):
            if rows[block_hash] != first + offset:
                flags[first + offset] = _DEAD
                self.dead += 1

    def _put(self, block_hash: int, parent: int | None, tokens: bytes | None) -> None:
        flag = (0 if parent is None else _HAS_PARENT) | (0 if tokens is None else _HAS_TOKENS)
        row = self.rows.get(block_hash)
        if row is None:
            self.rows[block_hash] = len(self.hashes)
            self.hashes.append(block_hash)
            self.parents.append(0 if parent is None else parent)
            self.flags.append(flag)
            self.tokens.extend(bytes(self.width) if tokens is None else tokens)
            return
        self.parents[row] = 0 if parent is None else parent
        self.flags[row] = flag
        if tokens is not None:
            self.tokens[row * self.width : (row + 1) * self.width] = tokens

    def remove(self, hashes: Sequence[int]) -> None:
        pop = self.rows.pop
        flags = self.flags
        dead = self.dead
        for block_hash in hashes:
            row = pop(block_hash, None)
            if row is not None:
                flags[row] = _DEAD
                dead += 1
        self.dead = dead
        if dead >= _COMPACT_MIN_DEAD and 2 * dead > len(flags):
            self._compact()

    def _compact(self) -> None:
        live = self.flags.translate(_LIVE_MASK)
        width, tokens = self.width, self.tokens
        self.hashes = array("Q", compress(self.hashes, live))
        self.parents = array("Q", compress(self.parents, live))
        self.flags = bytearray(compress(self.flags, live))
        self.tokens = bytearray().join(
            compress((tokens[start : start + width] for start in range(0, len(tokens), width)), live)
        )
        self.rows = dict(zip(self.hashes, range(len(self.hashes)), strict=True))
        self.dead = 0

    def block(self, tier: StorageTier, row: int) -> SnapshotBlock:
        flag = self.flags[row]
        parent = self.parents[row] if flag & _HAS_PARENT else None
        width = self.width
        tokens = bytes(self.tokens[row * width : (row + 1) * width]) if flag & _HAS_TOKENS else None
        return tier, self.hashes[row], parent, tokens

    def parents_first(self, tier: StorageTier) -> Iterator[SnapshotBlock]:
        """Every live row in row order, except that a block whose parent is resident in a later row (or is
        itself waiting) waits until that parent has been yielded."""
        rows_get, hashes, parents, flags = self.rows.get, self.hashes, self.parents, self.flags
        tokens, width = self.tokens, self.width
        waiting: dict[int, list[int]] = {}  # parent hash -> rows of the children waiting for it
        held: set[int] = set()  # the hashes of every waiting child
        previous = None  # the hash yielded last in row order: a child right after it needs no lookup
        for row, (block_hash, parent_column, flag) in enumerate(zip(hashes, parents, flags, strict=True)):
            if flag & _DEAD:
                continue
            parent = parent_column if flag & _HAS_PARENT else None
            if parent is not None and parent != previous:
                parent_row = rows_get(parent)
                if parent_row is not None and (parent_row > row or parent in held):
                    waiting.setdefault(parent, []).append(row)
                    held.add(block_hash)
                    continue
            start = row * width
            yield (
                tier,
                block_hash,
                parent,
                bytes(tokens[start : start + width]) if flag & _HAS_TOKENS else None,
            )
            previous = block_hash
            if waiting:
                yield from self._released(tier, block_hash, waiting, held)
        while waiting:  # parent cycles, which only contradictory re-stores can build
            _, children = waiting.popitem()
            for row in children:
                block = self.block(tier, row)
                held.discard(block[1])
                yield block
                yield from self._released(tier, block[1], waiting, held)

    def _released(
        self, tier: StorageTier, parent: int, waiting: dict[int, list[int]], held: set[int]
    ) -> Iterator[SnapshotBlock]:
        """The children waiting for ``parent`` (just yielded), and theirs in turn."""
        stack = [parent]
        while stack:
            for row in waiting.pop(stack.pop(), ()):
                block = self.block(tier, row)
                held.discard(block[1])
                yield block
                stack.append(block[1])
