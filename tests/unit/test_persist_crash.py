"""Crash safety of the slot store: whatever a kill leaves on disk loads as a committed, prefix-consistent state.

A ``kill -9`` leaves the files as the page cache holds them (the cache survives the process), so a crash is
simulated by copying the database and its WAL to a new place at the chosen moment and loading the copy:

- between two writes: the copy must load as exactly the state after the last write;
- inside a write, before its COMMIT (with a tiny page cache, so uncommitted pages spill into the WAL): the
  state before the write;
- while the WAL is being written: the main file as it was before the write, and a WAL whose first k bytes
  are new and the rest old (a write() that stopped part way): the state before or after the write.

"Prefix-consistent" is checked twice: the loaded store is one of the committed states (leases, progress,
snapshot, mirror, suffix, tokens), and its snapshot plus suffix rebuild exactly the resident blocks that
the model holds after applying the events up to the loaded last id P. A last test kills a child process
that appends continuously with a real SIGKILL and checks the same of what it left.
"""

from __future__ import annotations

import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvagent.model.events import (
    CLEARED,
    EventData,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.persist.store import (
    LEASE_BLOCK,
    AttachmentProgress,
    LoadedSlot,
    MirrorRow,
    SlotIdentityRecord,
    SlotStore,
)
from tests.support.ids import OWNER_TEXT

REPO = Path(__file__).resolve().parents[2]
IDENTITY = SlotIdentityRecord("slot-crash", 41, OWNER_TEXT)
TIERS = (StorageTier.DEVICE, StorageTier.HOST_PINNED)
HASH_POOL = 48  # few distinct hashes, so that removals hit resident blocks


# --- the model: the events, the resident blocks they leave, and what each committed write recorded -----


def event_data(rng: random.Random, resident: set[tuple[StorageTier, int]]) -> tuple[StorageTier, EventData]:
    tier = rng.choice(TIERS)
    roll = rng.random()
    if roll < 0.6:
        hashes = tuple(rng.sample(range(1, HASH_POOL), rng.randint(1, 4)))
        tokens = bytes(rng.getrandbits(8) for _ in range(4 * len(hashes))) if rng.random() < 0.8 else None
        return tier, Stored(rng.choice([None, *range(1, HASH_POOL)]), hashes, hashes, token_bytes=tokens)
    if roll < 0.97:
        present = sorted(block for block_tier, block in resident if block_tier is tier)
        return tier, Removed(tuple(present[: rng.randint(1, 3)]) or (1,))
    return tier, CLEARED


def apply(resident: set[tuple[StorageTier, int]], event: RouterEvent) -> None:
    data = event.data
    if type(data) is Stored:
        resident.update((event.storage_tier, block) for block in data.block_hashes)
    elif type(data) is Removed:
        resident.difference_update((event.storage_tier, block) for block in data.block_hashes)
    else:
        resident.clear()


def make_events(
    rng: random.Random, resident: set[tuple[StorageTier, int]], first_id: int, count: int
) -> list[RouterEvent]:
    """``count`` events from ``first_id`` on, applied to ``resident`` as they are made."""
    events = []
    for event_id in range(first_id, first_id + count):
        tier, data = event_data(rng, resident)
        event = RouterEvent(17, tier, ResidencyDomain.WORKER, event_id, data, 0)
        apply(resident, event)
        events.append(event)
    return events


def dump_of(resident: set[tuple[StorageTier, int]]) -> list[RouterEvent]:
    """The resident blocks as a tree dump would send them: one-block Stored events numbered from 0."""
    return [
        RouterEvent(17, tier, ResidencyDomain.WORKER, n, Stored(None, (block,), (block,)), 0)
        for n, (tier, block) in enumerate(sorted(resident, key=lambda tb: (tb[0].value, tb[1])))
    ]


def mirror_of(resident: set[tuple[StorageTier, int]]) -> list[MirrorRow]:
    return [
        MirrorRow(tier, block, None, block.to_bytes(4, "little")) for tier, block in sorted(resident, key=str)
    ]


def progress_at(seq: int) -> AttachmentProgress:
    return AttachmentProgress(17, 0, "tcp://127.0.0.1:5557", None, "", 1, seq, seq * 7919)


def replay(loaded: LoadedSlot) -> set[tuple[StorageTier, int]]:
    resident: set[tuple[StorageTier, int]] = set()
    for event in (*loaded.snapshot_events, *loaded.suffix_events):
        apply(resident, event)
    return resident


def observable(loaded: LoadedSlot | None) -> tuple[object, ...] | None:
    """Everything a load reports, tokens included (they are not part of Stored equality)."""
    if loaded is None:
        return None
    tokens = tuple(e.data.token_bytes if type(e.data) is Stored else None for e in loaded.suffix_events)
    fields = attrs.astuple(loaded, recurse=False)
    return (*fields, tokens)


# --- crash copies -----------------------------------------------------------------------------------------


def wal_of(path: Path) -> Path:
    return path.with_name(path.name + "-wal")


def read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def crash_copy(target: Path, db: bytes, wal: bytes) -> Path:
    """Lay down ``db`` and ``wal`` as a crashed agent would have left them (no -shm: it is rebuilt)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in (target, wal_of(target), target.with_name(target.name + "-shm")):
        stale.unlink(missing_ok=True)
    target.write_bytes(db)
    if wal:
        wal_of(target).write_bytes(wal)
    return target


def load_copy(target: Path) -> LoadedSlot | None:
    store = SlotStore.open(target)
    try:
        return store.load()
    finally:
        store.close()


class CrashingStore(SlotStore):
    """A store whose every COMMIT leaves behind the files as they were just before it and just after it."""

    before_commit: tuple[bytes, bytes] | None = None
    after_commit_wal: bytes = b""

    def _commit(self, db: sqlite3.Connection) -> None:
        self.before_commit = (read(self.path), read(wal_of(self.path)))
        super()._commit(db)
        self.after_commit_wal = read(wal_of(self.path))


# --- the Hypothesis test: random writes, a crash at every point of each -------------------------------------


@attrs.frozen
class Write:
    kind: str  # "append" | "progress" | "snapshot" | "lease" | "clean"
    size: int


writes = st.lists(
    st.builds(
        Write,
        st.sampled_from(["append", "append", "append", "progress", "snapshot", "lease"]),
        st.integers(1, 300),
    ),
    min_size=1,
    max_size=10,
)
# A clean stop, if any, is the last write of a run (it lowers the lease to right after the last id).
plans = st.tuples(writes, st.booleans()).map(lambda pair: pair[0] + [Write("clean", 0)] * pair[1])


class Driver:
    """Performs writes on a store and keeps, per committed write, the model's view at its P."""

    def __init__(self, store: SlotStore, seed: int) -> None:
        self.store, self.rng = store, random.Random(seed)
        self.resident: set[tuple[StorageTier, int]] = set()
        self.resident_at: dict[int | None, set[tuple[StorageTier, int]]] = {None: set()}
        self.next_id, self.seq, self.clean = 1, 0, False
        self.lease_end = self.republish_lease_end = 1 + LEASE_BLOCK
        store.initialize(IDENTITY, self.lease_end, self.republish_lease_end)

    def perform(self, write: Write) -> None:
        if write.kind == "append":
            events = make_events(self.rng, self.resident, self.next_id, write.size)
            self.next_id += write.size
            self.seq += 1
            self.store.append(events, progress_at(self.seq))
            self.resident_at[self.next_id - 1] = set(self.resident)
        elif write.kind == "progress":
            self.seq += 1
            self.store.append([], progress_at(self.seq))
        elif write.kind == "snapshot":
            at_id = self.next_id - 1
            self.store.write_snapshot(at_id, dump_of(self.resident), mirror_of(self.resident), None)
            self.resident_at[at_id] = set(self.resident)
        elif write.kind == "lease":
            self.lease_end += write.size
            self.republish_lease_end += 2 * write.size
            self.store.extend_lease(self.lease_end, self.republish_lease_end)
        else:
            self.store.mark_clean(self.next_id - 1 if self.next_id > 1 else None)
            self.lease_end, self.clean = self.next_id, True

    def check_latest(self, loaded: LoadedSlot | None) -> None:
        assert loaded is not None
        assert (loaded.last_event_id or 1) == max(1, self.next_id - 1)
        assert loaded.attachment == (progress_at(self.seq) if self.seq else None)
        assert (loaded.lease_end, loaded.republish_lease_end) == (self.lease_end, self.republish_lease_end)
        assert loaded.clean is self.clean


def check_prefix(
    loaded: LoadedSlot | None, driver: Driver, allowed: Sequence[tuple[object, ...] | None]
) -> None:
    assert observable(loaded) in allowed
    if loaded is not None:
        last = loaded.last_event_id or None  # a snapshot at 0 records P = 0: no event yet
        assert replay(loaded) == driver.resident_at[last]


def torn_wals(old: bytes, new: bytes, cut: int) -> list[bytes]:
    """The WALs a write() of ``new`` over ``old`` stopped after ``cut`` bytes can leave.

    Appending frames leaves new[:cut] + old[cut:] (the old part is a prefix of new). Restarting the log
    (new salts in the header: every old frame was checkpointed) writes from the start over the old
    frames; the file may also have been cut back to the new bytes first (``journal_size_limit``).
    """
    overwritten = new[:cut] + old[cut:]
    if new[:32] == old[:32]:
        return [overwritten]
    return [overwritten, new[:cut]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans, st.randoms(use_true_random=False), st.data())
def test_a_crash_at_any_point_loads_a_committed_prefix(
    tmp_path: Path, plan: list[Write], rng: random.Random, data: st.DataObject
) -> None:
    work = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh place for every example, replays included
    store = CrashingStore.open(work / "slot.sqlite3")
    assert isinstance(store, CrashingStore)
    store._connection().execute("PRAGMA cache_size = 8")  # spill uncommitted pages into the WAL early
    driver = Driver(store, rng.getrandbits(32))
    crash = work / "crash" / "slot.sqlite3"
    before = observable(load_copy(crash_copy(crash, read(store.path), read(wal_of(store.path)))))
    for write in plan:
        at_rest = (read(store.path), read(wal_of(store.path)))
        driver.perform(write)
        assert store.before_commit is not None
        latest = load_copy(crash_copy(crash, read(store.path), read(wal_of(store.path))))
        driver.check_latest(latest)  # between writes: exactly the last one
        now = observable(latest)
        # Inside the write, before its COMMIT: the state before it.
        check_prefix(load_copy(crash_copy(crash, *store.before_commit)), driver, [before])
        cut = data.draw(st.integers(0, len(store.after_commit_wal)), label="WAL torn at")
        for torn in torn_wals(at_rest[1], store.after_commit_wal, cut):
            check_prefix(load_copy(crash_copy(crash, at_rest[0], torn)), driver, [before, now])
        complete = torn_wals(at_rest[1], store.after_commit_wal, len(store.after_commit_wal))[0]
        check_prefix(load_copy(crash_copy(crash, at_rest[0], complete)), driver, [now])
        before = now
    store.close()
    shutil.rmtree(work)


# --- a real SIGKILL ---------------------------------------------------------------------------------------------

CHILD_BATCH = 128
CHILD_SNAPSHOT_EVERY = 5


def child_batches(seed: int) -> Iterator[tuple[int, list[RouterEvent], set[tuple[StorageTier, int]]]]:
    """(batch number, its events, the resident blocks after it): the child's deterministic stream."""
    rng, resident = random.Random(seed), set[tuple[StorageTier, int]]()
    for number in range(10_000):
        events = make_events(rng, resident, 1 + number * CHILD_BATCH, CHILD_BATCH)
        yield number, events, set(resident)


def run_child(path: str, seed: int) -> None:
    """Append batches (snapshotting now and then) until killed, saying on stdout which batch committed."""
    store = SlotStore.open(Path(path))
    store.initialize(IDENTITY, 1 + LEASE_BLOCK, 1 + LEASE_BLOCK)
    for number, events, resident in child_batches(seed):
        store.append(events, progress_at(number))
        if number % CHILD_SNAPSHOT_EVERY == CHILD_SNAPSHOT_EVERY - 1:
            store.write_snapshot(events[-1].event_id, dump_of(resident), mirror_of(resident), None)
        sys.stdout.write(f"{number}\n")
        sys.stdout.flush()
    store.close()


def test_a_child_killed_with_sigkill_mid_append_leaves_a_committed_prefix(tmp_path: Path) -> None:
    rng = random.Random(1717)
    for trial in range(4):
        path, seed = tmp_path / f"slot-{trial}.sqlite3", rng.getrandbits(32)
        code = f"from tests.unit.test_persist_crash import run_child; run_child({str(path)!r}, {seed})"
        child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        reported = -1
        for _ in range(rng.randint(1, 25)):
            line = child.stdout.readline()
            assert line, f"the child ended early (exit code {child.wait()})"
            reported = int(line)
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        child.stdout.close()

        loaded = load_copy(path)
        assert loaded is not None and loaded.last_event_id is not None
        number, remainder = divmod(loaded.last_event_id, CHILD_BATCH)
        assert remainder == 0 and number - 1 >= reported  # whole batches, at least those reported
        expected = next(resident for n, _, resident in child_batches(seed) if n == number - 1)
        assert replay(loaded) == expected
        assert loaded.attachment == progress_at(number - 1)
        assert not loaded.clean
