"""Discovery in a shared directory: one JSON file per record at ``DIR/<topic>/<record_id>.json``.

Several processes may share one directory.  A record file appears atomically and complete: it is written
to a hidden temporary file in the same directory, closed, and then hard-linked into place, which fails if
the name already exists (so two writers racing on one id cannot overwrite each other; the loser compares
payloads instead).  Where hard links are unsupported it falls back to ``os.replace`` after a conflict check.
Readers skip hidden files and anything that does not parse.  This is the control path, so the blocking
file I/O runs in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from pathlib import Path

import structlog
import trio

from kvagent._util.sync import checkpoint
from kvagent.discovery.base import DiscoveryRecord, check_topic
from kvagent.discovery.ownership import SlotClaim, SlotHolder, ownership_refused
from kvagent.model.errors import DiscoveryConflict, DiscoveryError, SlotOwnershipError

__all__ = ["FileDiscovery"]

log = structlog.get_logger(__name__)

SUFFIX = ".json"
# Hidden, so listing (which skips hidden names) never mistakes it for a topic.
OWNERS_DIRECTORY = ".owners"


def _encode(record: DiscoveryRecord) -> bytes:
    return record.to_json().encode() + b"\n"


def _read_record(path: Path) -> DiscoveryRecord | None:
    """The record stored at ``path``; None if it vanished; raises DiscoveryError if it is unparsable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        record = DiscoveryRecord.from_json(data)
    except DiscoveryError as exc:
        raise DiscoveryError(f"unparsable discovery record {path}: {exc}") from None
    if path.parent.name != record.topic or path.name != f"{record.record_id}{SUFFIX}":
        raise DiscoveryError(f"discovery record {path} names topic {record.topic!r} id {record.record_id}")
    return record


def _write_temp(directory: Path, record: DiscoveryRecord) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{record.record_id}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            # No fsync: readers never see the file before it is complete (it is linked in only after the
            # write), and advertisements are hints from one incarnation, useless after a host crash anyway.
            file.write(_encode(record))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return Path(name)


def _check_same(existing: DiscoveryRecord, record: DiscoveryRecord) -> None:
    if existing != record:
        raise DiscoveryConflict(
            f"record {record.record_id} on topic {record.topic!r} is already registered with a different payload"
        )


def _register_sync(root: Path, record: DiscoveryRecord) -> None:
    directory = root / record.topic
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{record.record_id}{SUFFIX}"
    temp = _write_temp(directory, record)
    try:
        try:
            os.link(temp, target)
            return
        except FileExistsError:
            existing = _read_record(target)
            if existing is None:  # withdrawn between our link attempt and the read: try once more
                try:
                    os.link(temp, target)
                    return
                except FileExistsError:
                    existing = _read_record(target)
            if existing is None:
                raise DiscoveryError(f"record file {target} keeps changing; register again") from None
            _check_same(existing, record)
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
                raise
        # No hard links here: check, then atomically move into place (a concurrent different writer
        # could still win this narrow race; hard-link capable filesystems do not have it).
        existing = _read_record(target)
        if existing is not None:
            _check_same(existing, record)
            return
        os.replace(temp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


def _unregister_sync(root: Path, topic: str, record_id: int) -> None:
    (root / topic / f"{record_id}{SUFFIX}").unlink(missing_ok=True)


def _record_id_of(name: str) -> int | None:
    stem = name[: -len(SUFFIX)]
    return int(stem) if name.endswith(SUFFIX) and stem.isdigit() else None


def _list_sync(root: Path, topic: str | None) -> list[DiscoveryRecord]:
    if topic is not None:
        directories = [root / topic]
    else:
        try:
            directories = [
                entry for entry in root.iterdir() if entry.is_dir() and not entry.name.startswith(".")
            ]
        except FileNotFoundError:
            return []
    records: list[DiscoveryRecord] = []
    for directory in directories:
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            if name.startswith(".") or _record_id_of(name) is None:
                continue  # temporary files of in-flight writes, and strays
            try:
                record = _read_record(directory / name)
            except DiscoveryError as exc:
                log.warning("discovery_record_file_skipped", error=str(exc))
                continue
            except OSError as exc:
                log.warning("discovery_record_file_unreadable", path=str(directory / name), error=str(exc))
                continue
            if record is not None:
                records.append(record)
    records.sort(key=lambda record: record.key)
    return records


def owner_lock_path(root: Path, cache_owner_id: str) -> Path:
    """The lock file of a CacheOwnerId (its text made a file name: ':' and '/' become '-')."""
    return root / OWNERS_DIRECTORY / f"{cache_owner_id.replace(':', '-').replace('/', '-')}.lock"


def _read_holder(fd: int) -> SlotHolder | None:
    with contextlib.suppress(OSError):
        return SlotHolder.from_json(os.pread(fd, 4096, 0))
    return None


def _claim_sync(root: Path, holder: SlotHolder) -> int:
    """Lock the CacheOwnerId's file and write ``holder`` into it; the open descriptor holds the claim.

    The lock file is never unlinked (unlinking races with a contender that has it open: both could end up
    "holding" different inodes); a released claim is an empty, unlocked file.
    """
    path = owner_lock_path(root, holder.cache_owner_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ownership_refused(holder, _read_holder(fd), hint=f" (lock {path})") from None
        os.ftruncate(fd, 0)
        data = holder.to_json() + b"\n"
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    except BaseException:
        os.close(fd)  # closing drops the lock
        raise
    return fd


def _release_sync(fd: int) -> None:
    try:
        # A stale holder text only misnames a holder; the lock is what counts.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


class _FileClaim:
    def __init__(self, discovery: FileDiscovery, fd: int) -> None:
        self._discovery = discovery
        self._fd: int | None = fd

    def _take(self) -> int | None:
        """The descriptor, once (in the Trio thread, so the backend's claim set is never shared)."""
        fd, self._fd = self._fd, None
        self._discovery._claims.discard(self)
        return fd

    def release_now(self) -> None:
        fd = self._take()
        if fd is not None:
            _release_sync(fd)

    async def release(self) -> None:
        fd = self._take()
        if fd is None:
            await checkpoint()
            return
        await trio.to_thread.run_sync(_release_sync, fd)


class FileDiscovery:
    """Discovery records as files under ``directory`` (created if missing)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()
        self._closed = False
        self._claims: set[_FileClaim] = set()

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError("file discovery is closed")

    async def register(self, record: DiscoveryRecord) -> None:
        self._check_open()
        try:
            await trio.to_thread.run_sync(_register_sync, self.directory, record)
        except OSError as exc:
            raise DiscoveryError(
                f"file discovery could not write record {record.record_id} in {self.directory}: "
                f"{_describe_os_error(exc)}"
            ) from exc

    async def unregister(self, topic: str, record_id: int) -> None:
        self._check_open()
        check_topic(topic)
        try:
            await trio.to_thread.run_sync(_unregister_sync, self.directory, topic, record_id)
        except OSError as exc:
            raise DiscoveryError(
                f"file discovery could not remove record {record_id} in {self.directory}: "
                f"{_describe_os_error(exc)}"
            ) from exc

    async def list(self, topic: str | None = None) -> list[DiscoveryRecord]:
        self._check_open()
        if topic is not None:
            check_topic(topic)
        return await trio.to_thread.run_sync(_list_sync, self.directory, topic)

    async def claim_slot(self, holder: SlotHolder) -> SlotClaim:
        """Hold ``DIR/.owners/<CacheOwnerId>.lock`` (flock) for the claim's life: the kernel drops it when
        this process dies, so a killed agent never leaves its slot claimed."""
        self._check_open()
        try:
            fd = await trio.to_thread.run_sync(_claim_sync, self.directory, holder)
        except SlotOwnershipError:
            raise
        except OSError as exc:
            raise DiscoveryError(
                f"file discovery could not claim slot {holder.slot!r} in {self.directory}: "
                f"{_describe_os_error(exc)}"
            ) from exc
        claim = _FileClaim(self, fd)
        self._claims.add(claim)
        return claim

    async def aclose(self) -> None:
        await checkpoint()
        self._closed = True
        for claim in list(self._claims):  # claims outliving the backend: give them up with it
            claim.release_now()


def _describe_os_error(exc: OSError) -> str:
    """One line: the errno text and the path it concerns (``str(OSError)`` without the ``[Errno n]``)."""
    text = exc.strerror or str(exc)
    return f"{text} ({exc.filename})" if exc.filename else text
