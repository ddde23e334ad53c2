"""One slot's durable state in one SQLite database: identity, id leases, progress, snapshot and suffix.

Synchronous and sans-Trio: the persistence writer calls it from a worker thread (``trio.to_thread``), one
call at a time. Every method that writes is exactly one transaction, so a ``kill -9`` at any moment leaves
the database as it was after some committed call (WAL mode: a committed transaction is in the ``-wal`` file,
which the page cache keeps across a process kill; a torn or uncommitted tail is ignored by SQLite's own
recovery). ``synchronous=NORMAL`` does not fsync ordinary commits; lease extensions, the first
initialization and a clean stop are committed with ``synchronous=FULL`` because losing them to a power cut
would let a restarted agent reuse an outbound id.

The file's layout and the checks that refuse one are in :mod:`kvagent.persist.schema`, the bytes of its
rows in :mod:`kvagent.persist.codec` (event batches) and :mod:`kvagent.persist.columns` (snapshot and
mirror). A file that is not ours, newer than us, corrupt or undecodable is refused with a
:class:`StateFileError` naming it, and :meth:`SlotStore.set_aside` moves it out of the way.
"""

from __future__ import annotations

import datetime
import itertools
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Final, NamedTuple

import attrs

from kvagent._util.gcutil import gc_paused
from kvagent.index.recovery_index import DumpSnapshot
from kvagent.model.errors import CodecError
from kvagent.model.events import Cleared, ResidencyDomain, RouterEvent, Stored
from kvagent.persist.codec import decode_batch, encode_batch
from kvagent.persist.columns import (
    decode_mirror_chunk,
    decode_snapshot_chunk,
    encode_dump_chunks,
    encode_mirror_chunks,
    encode_snapshot_chunks,
)
from kvagent.persist.records import (
    AttachmentProgress,
    MirrorRow,
    SlotIdentityRecord,
    attachment_from_bytes,
    attachment_to_bytes,
)
from kvagent.persist.schema import (
    APPLICATION_ID,
    SCHEMA,
    SCHEMA_VERSION,
    Found,
    StateFileError,
    StateFileInUse,
    StoreWriteError,
    check_header,
    is_refusal,
    is_schema_error,
    prepare,
    suffix_count,
)

__all__ = [
    "LEASE_BLOCK",
    "SCHEMA_VERSION",
    "AttachmentProgress",
    "LoadedSlot",
    "MirrorRow",
    "SlotIdentityRecord",
    "SlotStore",
    "StateFileError",
    "StateFileInUse",
    "StoreWriteError",
]

LEASE_BLOCK: Final = 1 << 24  # outbound ids leased ahead of use, persisted before the first of them is used
_I64_MAX: Final = (1 << 63) - 1


@attrs.frozen(slots=True)
class LoadedSlot:
    """What a store held: the state equals the index after applying exactly the events up to
    ``last_event_id`` (P), that is the snapshot at ``snapshot_id`` then ``suffix_events``."""

    identity: SlotIdentityRecord
    lease_end: int
    republish_lease_end: int
    last_event_id: int | None  # P: the last persisted outbound id (None: no event yet)
    clean: bool  # the previous run stopped cleanly: lease_end == P + 1 (1 without events)
    attachment: AttachmentProgress | None
    snapshot_id: int | None
    snapshot_events: Sequence[RouterEvent]  # the tree dump at snapshot_id
    suffix_events: Sequence[RouterEvent]  # ids > snapshot_id, ascending, with token_bytes
    mirror: Sequence[MirrorRow]  # the republish mirror at snapshot_id (empty without republish)
    # The state carries the republished Worker state with its tokens (the mirror, then the suffix's stores):
    # every run since it was last complete republished. Recorded as such (schema version 2), never inferred
    # from the mirror's size: before the first compaction the mirror is empty whoever wrote the suffix.
    republished: bool = False


class _Leases(NamedTuple):
    """The slot row's id bounds, as read inside a write transaction."""

    lease_end: int
    republish_lease_end: int
    last_event_id: int | None
    snapshot_id: int | None


def _sidecars(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")


class SlotStore:
    """The state database of one slot. Not thread-safe: one call at a time, from any one thread."""

    def __init__(self, path: Path, db: sqlite3.Connection, found: Found | None) -> None:
        """Use :meth:`open`. ``found`` None: the file holds no state yet."""
        self.path = path
        self._db: sqlite3.Connection | None = db
        self._initialized = found is not None
        self._suffix_count = 0 if found is None else found.suffix_count
        # The first outbound id (republished seq) this run may use, the lease ends found at open: a clean
        # stop never lowers a lease below them, since a crashed run before may have used ids up to there.
        self._run_floor = 1 if found is None else found.lease_end
        self._republish_floor = 0 if found is None else found.republish_lease_end

    # --- opening and refusing --------------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path, *, create: bool = True, exclusive: bool = False) -> SlotStore:
        """Open (or with ``create``, create) the state file; :class:`StateFileError` if it is refused.

        With ``exclusive`` (what an agent should use) the store holds the file from open to close, so a
        second agent configured with the same state directory gets :class:`StateFileInUse` instead of
        sharing an id space; without it, other connections may read the file meanwhile (tests, tools), and
        a writer that holds it also makes this raise StateFileInUse. A missing file with ``create=False``
        raises FileNotFoundError. Other SQLite failures (an I/O error) propagate as ``sqlite3.Error``: they
        say nothing about the file's content.
        """
        path = Path(path)
        if not create and not path.exists():
            raise FileNotFoundError(f"no state file {path}")
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        check_header(path)
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            found = prepare(path, db, exclusive=exclusive)
        except BaseException:
            db.close()
            raise
        return cls(path, db, found)

    @staticmethod
    def set_aside(path: Path) -> Path:
        """Move a refused file (and its -wal/-shm) to ``NAME.refused-<UTC timestamp>``; the new path.

        The store on it must be closed. The WAL keeps its ``-wal`` suffix next to the new name, so the
        ``sqlite3`` CLI still opens the pair for inspection.
        """
        path = Path(path)
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        target = path.with_name(f"{path.name}.refused-{stamp}")
        attempt = 1
        while target.exists() or any(p.exists() for p in _sidecars(target)):
            attempt += 1
            target = path.with_name(f"{path.name}.refused-{stamp}-{attempt}")
        for source, destination in zip((path, *_sidecars(path)), (target, *_sidecars(target)), strict=True):
            if source.exists():
                source.rename(destination)
        return target

    # --- reading ----------------------------------------------------------------------------------------

    def load(self) -> LoadedSlot | None:
        """The persisted state, or None for a new store; :class:`StateFileError` (store closed) if a row
        does not decode or the rows contradict each other."""
        db = self._connection()
        if not self._initialized:
            return None
        try:
            with self._read(), gc_paused():  # millions of acyclic objects: see gc_paused
                row = db.execute(
                    "SELECT name, publisher_id, cache_owner_id, lease_end, republish_lease_end,"
                    " last_event_id, snapshot_id, clean, attachment, republished FROM slot"
                ).fetchone()
                if row is None:
                    return None
                loaded = _loaded_slot(db, row)
        except (CodecError, ValueError, TypeError, sqlite3.DatabaseError) as exc:
            if isinstance(exc, sqlite3.Error) and not is_refusal(exc) and not is_schema_error(exc):
                raise
            self.close()
            raise StateFileError(self.path, f"row does not decode: {exc}") from exc
        self._suffix_count = len(loaded.suffix_events)
        return loaded

    def suffix_length(self) -> int:
        """Events stored after the snapshot (the compaction measure)."""
        return self._suffix_count

    def disk_bytes(self) -> int:
        """The database file plus its WAL, in bytes."""
        wal, _ = _sidecars(self.path)
        return sum(p.stat().st_size for p in (self.path, wal) if p.exists())

    # --- writing ----------------------------------------------------------------------------------------

    def initialize(
        self,
        identity: SlotIdentityRecord,
        lease_end: int,
        republish_lease_end: int,
        *,
        republished: bool = False,
    ) -> None:
        """Create the slot's state (durable on return); ValueError if the store already holds one.

        ``republished``: the run creating it republishes (an empty state is trivially complete).
        """
        _check_id(lease_end, "lease_end")
        _check_id(republish_lease_end, "republish_lease_end")
        with self._transaction(durable=True) as db:
            if self._initialized:
                raise ValueError(f"state file {self.path} is already initialized")
            for statement in SCHEMA:  # one by one: executescript would commit first
                db.execute(statement)
            db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute(
                "INSERT INTO slot (singleton, name, publisher_id, cache_owner_id, lease_end,"
                " republish_lease_end, clean, republished) VALUES (0, ?, ?, ?, ?, ?, 0, ?)",
                (
                    identity.slot,
                    _to_i64(identity.publisher_id),
                    identity.cache_owner_id,
                    lease_end,
                    republish_lease_end,
                    int(republished),
                ),
            )
        self._initialized = True
        self._run_floor, self._republish_floor = 1, 0
        self._suffix_count = 0

    def extend_lease(
        self,
        lease_end: int,
        republish_lease_end: int | None = None,
        *,
        republished: bool | None = None,
    ) -> None:
        """Raise the leases (durable on return); ValueError if one would go down.

        ``republished`` False records that this run does not republish (its events carry no tokens, its
        snapshots no mirror); None keeps the recorded fact.
        """
        _check_id(lease_end, "lease_end")
        with self._transaction(durable=True) as db:
            current = self._leases(db)
            republish = current.republish_lease_end if republish_lease_end is None else republish_lease_end
            _check_id(republish, "republish_lease_end")
            if lease_end < current.lease_end or republish < current.republish_lease_end:
                raise ValueError(f"a lease never goes down: ({lease_end}, {republish}) < {current}")
            db.execute(
                "UPDATE slot SET lease_end = ?, republish_lease_end = ?, clean = 0,"
                " republished = coalesce(?, republished)",
                (lease_end, republish, None if republished is None else int(republished)),
            )

    def mark_republished(self) -> None:
        """Record that the persisted state carries the republished Worker state (durable on return).

        Only for a republishing run whose restored state holds no Worker block: nothing lacks its tokens.
        """
        with self._transaction(durable=True) as db:
            self._leases(db)
            db.execute("UPDATE slot SET republished = 1")

    def append(
        self, events: Sequence[RouterEvent], attachment: AttachmentProgress | None, *, tokens: bool = True
    ) -> None:
        """Persist the next outbound events (ids ascending, above P, below the lease) and the progress
        they reflect, in one transaction. ``attachment`` None keeps the recorded progress; ``tokens`` False
        leaves the stores' tokens out (a slot that does not republish never reads them back).

        The republished fact follows: events without tokens end it; a Worker ``Cleared`` with tokens (the
        Worker reset of a republishing run that restored a state without them) starts it, since everything
        the reset leaves resident is stored after it, with tokens."""
        if not events and attachment is None:
            return
        body = encode_batch(events, tokens=tokens) if events else b""
        worker_reset = any(
            type(event.data) is Cleared and event.residency_domain is ResidencyDomain.WORKER for event in events
        )
        self.append_encoded(
            [event.event_id for event in events], body, attachment, tokens=tokens, worker_reset=worker_reset
        )

    def append_encoded(
        self,
        ids: Sequence[int],
        body: bytes,
        attachment: AttachmentProgress | None,
        *,
        tokens: bool = False,
        worker_reset: bool = False,
    ) -> None:
        """:meth:`append` of events already encoded (``ids``, and ``body`` as ``encode_batch`` writes them:
        the persistence writer encodes straight from the ring's columns without tokens, persist/columns.py).
        ``tokens``: the body carries the stores' tokens; ``worker_reset``: the events hold a Worker
        ``Cleared``. The republished fact follows as :meth:`append` says."""
        if not ids and attachment is None:
            return
        progress = None if attachment is None else attachment_to_bytes(attachment)
        republished: int | None = None  # None: unchanged
        if ids and not tokens:
            republished = 0
        elif worker_reset:
            republished = 1
        with self._transaction() as db:
            current = self._leases(db)
            new_last = current.last_event_id
            if ids:
                floor = max(current.last_event_id or 0, current.snapshot_id or 0)
                _check_ascending(ids, floor, current.lease_end)
                new_last = ids[-1]
                db.execute(
                    "INSERT INTO batches (first_id, last_id, count, body) VALUES (?, ?, ?, ?)",
                    (ids[0], new_last, len(ids), body),
                )
            db.execute(
                "UPDATE slot SET last_event_id = ?, attachment = coalesce(?, attachment), clean = 0,"
                " republished = coalesce(?, republished)",
                (new_last, progress, republished),
            )
        self._suffix_count += len(ids)

    def write_snapshot(
        self,
        at_id: int,
        events: Iterable[RouterEvent] | DumpSnapshot,
        mirror: Iterable[MirrorRow],
        attachment: AttachmentProgress | None,
    ) -> None:
        """Replace the snapshot with the state at outbound id ``at_id`` and drop the suffix <= ``at_id``, in
        one transaction; then give the freed pages back to the file system.

        ``events`` is the tree dump at ``at_id``: its events, or (much cheaper, and the same rows) the
        index's :class:`~kvagent.index.recovery_index.DumpSnapshot`, which is a copy safe to read here.
        """
        chunks = (
            encode_dump_chunks(events) if isinstance(events, DumpSnapshot) else encode_snapshot_chunks(events)
        )
        _check_id(at_id, "snapshot id", minimum=0)
        progress = None if attachment is None else attachment_to_bytes(attachment)
        with self._transaction() as db:
            current = self._leases(db)
            if at_id >= current.lease_end or at_id < (current.snapshot_id or 0):
                raise ValueError(
                    f"snapshot id {at_id} is outside [{current.snapshot_id}, {current.lease_end})"
                )
            db.execute("DELETE FROM batches WHERE last_id <= ?", (at_id,))
            db.execute("DELETE FROM snapshot")
            db.execute("DELETE FROM mirror")
            db.executemany("INSERT INTO snapshot (chunk, body) VALUES (?, ?)", enumerate(chunks))
            db.executemany(
                "INSERT INTO mirror (chunk, body) VALUES (?, ?)", enumerate(encode_mirror_chunks(mirror))
            )
            db.execute(
                "UPDATE slot SET snapshot_id = ?, last_event_id = ?, attachment = coalesce(?, attachment),"
                " clean = 0",
                (at_id, max(at_id, current.last_event_id or 0), progress),
            )
            count = suffix_count(db)
        self._suffix_count = count
        self._shrink()

    def mark_clean(self, last_event_id: int | None, *, last_republish_seq: int | None = None) -> None:
        """Record a clean stop (durable on return): the next run continues at ``last_event_id + 1``.

        ``last_event_id`` is the last id the coordinator stamped in this run (None: it stamped none); every
        event up to it must have been appended, else the load reports the run as not clean. With
        ``last_republish_seq`` the republish lease likewise ends right after it.
        """
        with self._transaction(durable=True) as db:
            current = self._leases(db)
            new_end = self._run_floor if last_event_id is None else last_event_id + 1
            if (
                new_end < max(self._run_floor, (current.last_event_id or 0) + 1)
                or new_end > current.lease_end
            ):
                raise ValueError(
                    f"clean stop at {last_event_id}: outside the ids this run may have used "
                    f"(from {self._run_floor}, {current})"
                )
            republish_end = current.republish_lease_end
            new_republish_end = republish_end if last_republish_seq is None else last_republish_seq + 1
            if not self._republish_floor <= new_republish_end <= republish_end:
                raise ValueError(
                    f"republish seq {last_republish_seq} is outside the seqs this run may have used "
                    f"[{self._republish_floor}, {republish_end})"
                )
            db.execute(
                "UPDATE slot SET lease_end = ?, republish_lease_end = ?, clean = 1",
                (new_end, new_republish_end),
            )

    def close(self) -> None:
        """Close the connection (idempotent); SQLite checkpoints the WAL on the last close."""
        db, self._db = self._db, None
        if db is not None:
            db.close()

    # --- internals --------------------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"state store {self.path} is closed")
        return self._db

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: every row read in it belongs to the same committed state."""
        db = self._connection()
        db.execute("BEGIN")
        try:
            yield db
        finally:
            db.execute("COMMIT")

    @contextmanager
    def _transaction(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction, rolled back on any error; a SQLite failure becomes StoreWriteError."""
        db = self._connection()
        try:
            if db.in_transaction:  # a ROLLBACK that failed after an earlier failure: try it again
                db.execute("ROLLBACK")
            if durable:
                db.execute("PRAGMA synchronous = FULL")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                self._commit(db)
            except BaseException:
                with suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreWriteError(f"state file {self.path}: write failed: {exc}") from exc
        finally:
            if durable:
                with suppress(sqlite3.Error):
                    db.execute("PRAGMA synchronous = NORMAL")

    def _commit(self, db: sqlite3.Connection) -> None:
        """The one COMMIT of every write (the crash tests hook in here)."""
        db.execute("COMMIT")

    def _leases(self, db: sqlite3.Connection) -> _Leases:
        if not self._initialized:
            raise RuntimeError(f"state file {self.path} is not initialized")
        row = db.execute(
            "SELECT lease_end, republish_lease_end, last_event_id, snapshot_id FROM slot"
        ).fetchone()
        return _Leases(*row)

    def _shrink(self) -> None:
        """Return free pages and the WAL's excess to the file system (after a snapshot freed them)."""
        db = self._connection()
        with suppress(sqlite3.Error):  # only space is at stake; the next snapshot tries again
            # executescript steps the pragma to completion; execute() would free a single page
            db.executescript("PRAGMA incremental_vacuum")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


def _loaded_slot(db: sqlite3.Connection, row: tuple[object, ...]) -> LoadedSlot:
    (
        name,
        publisher_id,
        cache_owner_id,
        lease_end,
        republish_end,
        last,
        snapshot_id,
        clean,
        attachment,
        republished,
    ) = row
    if not (
        isinstance(name, str)
        and isinstance(publisher_id, int)
        and isinstance(cache_owner_id, str)
        and isinstance(lease_end, int)
        and isinstance(republish_end, int)
        and (last is None or isinstance(last, int))
        and (snapshot_id is None or isinstance(snapshot_id, int))
        and (attachment is None or isinstance(attachment, bytes))
        and (republished is None or isinstance(republished, int))
    ):
        raise CodecError("the slot row has fields of the wrong type")
    snapshot_events = [
        event
        for (body,) in db.execute("SELECT body FROM snapshot ORDER BY chunk")
        for event in decode_snapshot_chunk(body)
    ]
    mirror = [
        row
        for (body,) in db.execute("SELECT body FROM mirror ORDER BY chunk")
        for row in decode_mirror_chunk(body)
    ]
    suffix = _suffix_after(db, snapshot_id or 0)
    _check_consistent(suffix, last, snapshot_id, lease_end)
    return LoadedSlot(
        identity=SlotIdentityRecord(name, _from_i64(publisher_id), cache_owner_id),
        lease_end=lease_end,
        republish_lease_end=republish_end,
        last_event_id=last,
        clean=bool(clean) and lease_end == (last or 0) + 1,
        attachment=None if attachment is None else attachment_from_bytes(attachment),
        snapshot_id=snapshot_id,
        snapshot_events=tuple(snapshot_events),
        suffix_events=tuple(suffix),
        mirror=tuple(mirror),
        republished=(
            bool(republished)
            if republished is not None
            else _inferred_republished(snapshot_events, mirror, suffix)
        ),
    )


def _inferred_republished(
    snapshot: Sequence[RouterEvent], mirror: Sequence[MirrorRow], suffix: Sequence[RouterEvent]
) -> bool:
    """Whether a file of schema version 1 (which did not record it) carries the republished Worker state.

    Version 1 kept tokens only for a slot that republishes, and a mirror only in its snapshots: the state is
    complete if the snapshot's Worker blocks are in a mirror (or there are none), and every Worker store
    after it, or after the last Worker ``Cleared``, has its tokens. Anything else reads as "did not": the
    restarted slot then attaches cold, which is exact, only not a resume.
    """
    worker = ResidencyDomain.WORKER
    complete = bool(mirror) or not any(
        type(event.data) is Stored and event.residency_domain is worker for event in snapshot
    )
    for event in suffix:
        if event.residency_domain is not worker:
            continue
        data = event.data
        if type(data) is Cleared:
            complete = True
        elif type(data) is Stored and data.token_bytes is None:
            complete = False
    return complete


def _suffix_after(db: sqlite3.Connection, snapshot_id: int) -> list[RouterEvent]:
    """The stored events with ids above the snapshot's, checked against their rows' id ranges."""
    suffix: list[RouterEvent] = []
    previous = -1
    for first_id, last_id, count, body in db.execute(
        "SELECT first_id, last_id, count, body FROM batches ORDER BY first_id"
    ):
        events = decode_batch(body)
        ids = [event.event_id for event in events]
        if len(ids) != count or not ids or (ids[0], ids[-1]) != (first_id, last_id) or first_id <= previous:
            raise CodecError(f"batch row {first_id}..{last_id} does not hold its events")
        if any(later <= earlier for earlier, later in itertools.pairwise(ids)):
            raise CodecError(f"batch row {first_id}..{last_id} has ids out of order")
        previous = last_id
        # A batch that straddles the snapshot keeps only its events after it.
        suffix.extend(events if first_id > snapshot_id else [e for e in events if e.event_id > snapshot_id])
    return suffix


def _check_consistent(
    suffix: Sequence[RouterEvent], last: int | None, snapshot_id: int | None, lease_end: int
) -> None:
    """The rows agree: the suffix lies in (S, P], P is its last id (or S), and P is below the lease."""
    floor = snapshot_id if snapshot_id is not None else 0
    if suffix and (suffix[0].event_id <= floor or suffix[-1].event_id != last):
        raise CodecError(
            f"suffix ids {suffix[0].event_id}..{suffix[-1].event_id} disagree with P={last}, S={snapshot_id}"
        )
    if not suffix and last != snapshot_id and not (last is None and snapshot_id is None):
        raise CodecError(f"no suffix, but P={last} differs from S={snapshot_id}")
    if last is not None and last >= lease_end:
        raise CodecError(f"P={last} is not below the lease end {lease_end}")


def _check_id(value: int, what: str, *, minimum: int = 1) -> None:
    if not minimum <= value <= _I64_MAX:
        raise ValueError(f"{what} must be in [{minimum}, 2^63), got {value}")


def _check_ascending(ids: Sequence[int], floor: int, lease_end: int | None) -> None:
    previous = floor
    for event_id in ids:
        if event_id <= previous:
            raise ValueError(f"event id {event_id} is not above {previous}: ids must ascend past P")
        previous = event_id
    if ids and lease_end is not None and ids[-1] >= lease_end:
        raise ValueError(f"event id {ids[-1]} is not below the lease end {lease_end}")


def _to_i64(value: int) -> int:
    """A u64 as SQLite's signed INTEGER (two's complement)."""
    return value - (1 << 64) if value > _I64_MAX else value


def _from_i64(value: int) -> int:
    return value + (1 << 64) if value < 0 else value
