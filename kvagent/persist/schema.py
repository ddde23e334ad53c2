"""The state file itself (sans-IO): its schema, the checks that refuse it, and the errors they raise.

Schema version 2: a single ``slot`` row (identity, leases, the last persisted outbound id P, the snapshot
id S, the clean flag, the attachment progress, whether the state carries the republished stream),
``batches`` (the outbound events with id > S, one row per append), ``snapshot`` and ``mirror`` (the
compacted state at S, in column chunks). The file carries an application id and the schema version in
``user_version``; a file that is not ours, newer than us or corrupt is refused with a
:class:`StateFileError` naming it. An older file is migrated in place when opened (:func:`prepare`), in one
transaction.

``slot.republished`` (version 2) records whether the persisted state carries the republished Worker state
with its tokens (the mirror at S plus the suffix's stores rebuild it): 1 only while every run since the
state was complete republished; NULL in a file migrated from version 1 (unknown: the loader infers it).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final, NamedTuple

from kvagent.model.errors import KvAgentError

__all__ = [
    "APPLICATION_ID",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Found",
    "StateFileError",
    "StateFileInUse",
    "StoreWriteError",
    "check_header",
    "is_refusal",
    "is_schema_error",
    "prepare",
    "suffix_count",
]

SCHEMA_VERSION: Final = 2
APPLICATION_ID: Final = 0x6B764147  # "kvAG": marks a kvagent state file in the SQLite header
JOURNAL_SIZE_LIMIT: Final = 4 << 20  # the WAL is truncated back to this after a checkpoint

# SQLite result codes that mean "this file is not a usable database" (the primary code, low byte).
_SQLITE_CORRUPT: Final = 11
_SQLITE_NOTADB: Final = 26
_SQLITE_BUSY: Final = 5
_SQLITE_LOCKED: Final = 6
_SQLITE_MAGIC: Final = b"SQLite format 3\x00"

SCHEMA = (
    """CREATE TABLE slot (
    singleton INTEGER PRIMARY KEY CHECK (singleton = 0),
    name TEXT NOT NULL,
    publisher_id INTEGER NOT NULL,
    cache_owner_id TEXT NOT NULL,
    lease_end INTEGER NOT NULL,
    republish_lease_end INTEGER NOT NULL,
    last_event_id INTEGER,
    snapshot_id INTEGER,
    clean INTEGER NOT NULL,
    attachment BLOB,
    republished INTEGER
    )""",
    # One row per append: its events' ids are first_id..last_id (ascending), ``count`` of them.
    "CREATE TABLE batches (first_id INTEGER PRIMARY KEY, last_id INTEGER NOT NULL, count INTEGER NOT NULL,"
    " body BLOB NOT NULL)",
    "CREATE TABLE snapshot (chunk INTEGER PRIMARY KEY, body BLOB NOT NULL)",
    "CREATE TABLE mirror (chunk INTEGER PRIMARY KEY, body BLOB NOT NULL)",
)


class StateFileError(KvAgentError):
    """A state file that cannot be used; ``str()`` is one line naming the file and the reason."""

    default_code = "internal"

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = " ".join(reason.split())  # one line, whatever SQLite said
        super().__init__(f"refused state file {path}: {self.reason}")


class StateFileInUse(KvAgentError):
    """Another process holds the state file (two agents configured with one state directory); the file is
    fine and must not be set aside."""

    default_code = "conflict"


class StoreWriteError(KvAgentError):
    """A write that failed (disk full, I/O error) and was rolled back; the store stays usable."""

    default_code = "internal"


class Found(NamedTuple):
    """What opening an existing state file reads besides the checks."""

    suffix_count: int
    lease_end: int
    republish_lease_end: int


def is_refusal(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


def is_schema_error(exc: sqlite3.Error) -> bool:
    """A missing table or column in a file that claims our schema version: it is not what it says."""
    return isinstance(exc, sqlite3.OperationalError) and "no such" in str(exc)


def check_header(path: Path) -> None:
    """Refuse a file that is not SQLite before SQLite sees it: SQLite would delete a -wal beside it, and
    the refused file is kept with its WAL for inspection."""
    try:
        with path.open("rb") as file:
            header = file.read(len(_SQLITE_MAGIC))
    except FileNotFoundError:
        return
    if header and header != _SQLITE_MAGIC:
        raise StateFileError(path, "not a SQLite database (bad header)")


def prepare(path: Path, db: sqlite3.Connection, *, exclusive: bool) -> Found | None:
    """Set the connection up and check the file's header and integrity (None: a new file)."""
    try:
        if exclusive:
            # One agent per state file: the first access takes a lock kept until the connection closes
            # (in WAL mode without a shared-memory index, so no -shm file either); other openers get BUSY.
            db.execute("PRAGMA locking_mode = EXCLUSIVE")
        # auto_vacuum takes effect only if set before the first table is made, and before WAL mode
        # writes the header; on an existing file it is a no-op without a VACUUM.
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        db.execute("PRAGMA journal_mode = WAL").fetchone()
        application_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = db.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0]
        if application_id == 0 and version == 0 and tables == 0:
            _configure(db)
            _take_lock(db)
            return None
        if application_id != APPLICATION_ID:
            raise StateFileError(path, "not a kvagent state file")
        if version > SCHEMA_VERSION:
            raise StateFileError(
                path, f"schema version {version} is newer than this kvagent's {SCHEMA_VERSION}"
            )
        if version < 1:
            raise StateFileError(path, f"unknown schema version {version}")
        problems = [row[0] for row in db.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise StateFileError(path, f"integrity check failed: {'; '.join(problems)}")
        _configure(db)
        if version < SCHEMA_VERSION:
            _migrate(db, version)
        row = db.execute("SELECT lease_end, republish_lease_end FROM slot").fetchone()
        if row is None or not all(isinstance(value, int) for value in row):
            raise StateFileError(path, "the slot row is missing")
        _take_lock(db)
        return Found(suffix_count(db), *row)
    except sqlite3.DatabaseError as exc:
        if is_refusal(exc) or is_schema_error(exc):
            raise StateFileError(path, str(exc)) from exc
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED):
            raise StateFileInUse(f"state file {path} is in use by another process") from exc
        raise


def _migrate(db: sqlite3.Connection, version: int) -> None:
    """Bring a file of an older schema version to :data:`SCHEMA_VERSION`, in one transaction."""
    db.execute("BEGIN IMMEDIATE")
    try:
        if version < 2:
            # Version 1 did not record whether a run republished: NULL says "unknown" (see LoadedSlot).
            db.execute("ALTER TABLE slot ADD COLUMN republished INTEGER")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _take_lock(db: sqlite3.Connection) -> None:
    """Take the write lock once: BUSY now if another connection writes; in exclusive locking mode the lock
    is then kept until the connection closes."""
    db.execute("BEGIN IMMEDIATE")
    db.execute("COMMIT")


def _configure(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")


def suffix_count(db: sqlite3.Connection) -> int:
    """The events stored after the snapshot (a batch that straddles the snapshot id counts whole)."""
    (count,) = db.execute("SELECT coalesce(sum(count), 0) FROM batches").fetchone()
    return int(count)
