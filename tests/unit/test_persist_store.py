"""SlotStore: round trips of every record, the checks on writes, refused files, set_aside, compaction bound.

The compaction test drives a real RecoveryIndex the way the persistence writer does (append each drain's
ring tail, snapshot the tree dump when the suffix outgrows the resident state) and checks both that a load
rebuilds exactly the index's resident blocks and that the file stays within a small multiple of them.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import CodecError
from kvagent.model.events import (
    CLEARED,
    U64_MAX,
    EventData,
    MmExtraInfo,
    MmObject,
    Removed,
    ResidencyDomain,
    RouterEvent,
    StorageTier,
    Stored,
)
from kvagent.persist import codec, columns
from kvagent.persist.store import (
    LEASE_BLOCK,
    SCHEMA_VERSION,
    AttachmentProgress,
    LoadedSlot,
    MirrorRow,
    SlotIdentityRecord,
    SlotStore,
    StateFileError,
    StateFileInUse,
    StoreWriteError,
)
from tests.support.ids import OWNER, OWNER_TEXT
from tests.support.persist import load_state_file

IDENTITY = SlotIdentityRecord("slot-a", 41, OWNER_TEXT)
FIRST_LEASE = 1 + LEASE_BLOCK
PROGRESS = AttachmentProgress(17, 0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "", 3, 12, U64_MAX)
TOKENS = bytes(range(64))


def worker_event(event_id: int, data: EventData, tier: StorageTier = StorageTier.DEVICE) -> RouterEvent:
    return RouterEvent(17, tier, ResidencyDomain.WORKER, event_id, data, 0, OWNER)


def stored(
    event_id: int, *hashes: int, parent: int | None = None, tokens: bytes | None = None
) -> RouterEvent:
    data = Stored(parent, hashes, tuple(h ^ 0xFF for h in hashes), token_bytes=tokens)
    return worker_event(event_id, data)


def every_kind(first_id: int) -> list[RouterEvent]:
    """One event of each shape the outbound stream carries, ids first_id, first_id + 1, ..."""
    mm = MmExtraInfo((MmObject(U64_MAX, ((0, 4), (8, 16))),))
    shapes: list[RouterEvent] = [
        stored(0, 1, 2, 3, tokens=TOKENS * 3),
        stored(0, U64_MAX, parent=3),
        worker_event(0, Stored(None, (9, 10), (90, 100), (None, mm), start_position=32)),
        worker_event(0, Removed((2, U64_MAX))),
        worker_event(0, CLEARED),
        RouterEvent(
            17, StorageTier.HOST_PINNED, ResidencyDomain.CACHE_OWNER, 0, Stored(None, (5,), (6,)), 1, OWNER
        ),
        RouterEvent(17, StorageTier.DISK, ResidencyDomain.CACHE_OWNER, 0, CLEARED, 1, OWNER, "session-7"),
    ]
    return [attrs.evolve(event, event_id=first_id + n) for n, event in enumerate(shapes)]


def tokens_of(events: Iterable[RouterEvent]) -> list[bytes | None]:
    """Stored.token_bytes is not part of equality: compare it on its own."""
    return [event.data.token_bytes if type(event.data) is Stored else None for event in events]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "slots" / "slot-a.sqlite3"


@pytest.fixture
def store(path: Path) -> Iterator[SlotStore]:
    path.parent.mkdir()
    opened = SlotStore.open(path)
    opened.initialize(IDENTITY, FIRST_LEASE, FIRST_LEASE)
    yield opened
    opened.close()


def reopen(store: SlotStore) -> LoadedSlot:
    store.close()
    return load_state_file(store.path)


# --- round trips --------------------------------------------------------------------------------------


def test_a_new_file_loads_as_nothing_and_a_missing_one_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        SlotStore.open(tmp_path / "absent.sqlite3", create=False)
    assert not (tmp_path / "absent.sqlite3").exists()
    store = SlotStore.open(tmp_path / "new.sqlite3")
    assert store.load() is None
    assert store.suffix_length() == 0
    store.close()


def test_identity_and_leases_round_trip(store: SlotStore) -> None:
    with pytest.raises(ValueError, match="already initialized"):
        store.initialize(IDENTITY, FIRST_LEASE, FIRST_LEASE)
    loaded = reopen(store)
    assert loaded.identity == IDENTITY
    assert (loaded.lease_end, loaded.republish_lease_end) == (FIRST_LEASE, FIRST_LEASE)
    assert loaded.last_event_id is None and loaded.snapshot_id is None and loaded.attachment is None
    assert not loaded.clean  # ids below the lease may have been used
    assert (loaded.snapshot_events, loaded.suffix_events, loaded.mirror) == ((), (), ())


def test_a_u64_publisher_id_survives_sqlites_signed_integers(path: Path) -> None:
    store = SlotStore.open(path.parent.parent / "u64.sqlite3")
    identity = SlotIdentityRecord("slot-ü", U64_MAX, OWNER_TEXT)
    store.initialize(identity, 1, 1)
    assert reopen(store).identity == identity


def test_appended_events_and_progress_round_trip(store: SlotStore) -> None:
    first, second = every_kind(1), every_kind(8)
    store.append(first, PROGRESS)
    later = attrs.evolve(PROGRESS, replay_endpoint=None, engine_seq=None, digest=None, generation=4)
    store.append(second, later)
    store.append([], None)  # nothing at all: no transaction
    assert store.suffix_length() == len(first) + len(second)
    loaded = reopen(store)
    assert loaded.suffix_events == (*first, *second)
    assert tokens_of(loaded.suffix_events) == tokens_of([*first, *second])
    assert loaded.last_event_id == second[-1].event_id
    assert loaded.attachment == later


def test_an_append_without_tokens_keeps_everything_else(store: SlotStore) -> None:
    events = every_kind(1)
    assert any(tokens_of(events)), "the fixture has stores with tokens"
    store.append(events, PROGRESS, tokens=False)  # a slot that does not republish
    loaded = reopen(store)
    assert loaded.suffix_events == tuple(events)  # token_bytes takes no part in equality
    assert not any(tokens_of(loaded.suffix_events))


def test_progress_alone_is_recorded_and_none_keeps_it(store: SlotStore) -> None:
    store.append([], PROGRESS)  # a batch that dedup emptied still moves the engine seq
    store.append(every_kind(1), None)
    loaded = reopen(store)
    assert loaded.attachment == PROGRESS
    assert loaded.last_event_id == 7


@pytest.mark.parametrize(
    ("ids", "reason"),
    [((5, 4), "not above"), ((3, 3), "not above"), ((FIRST_LEASE,), "below the lease"), ((2,), "not above")],
)
def test_appends_that_break_the_id_order_are_refused_whole(
    store: SlotStore, ids: tuple[int, ...], reason: str
) -> None:
    store.append([stored(1, 1), stored(2, 2)], PROGRESS)
    with pytest.raises(ValueError, match=reason):
        store.append([stored(event_id, 100 + event_id) for event_id in ids], None)
    assert store.suffix_length() == 2
    assert reopen(store).last_event_id == 2


def test_a_snapshot_replaces_the_old_one_and_drops_the_covered_suffix(store: SlotStore) -> None:
    store.append([stored(n, n) for n in range(1, 5)], PROGRESS)
    store.append([stored(n, n) for n in range(5, 11)], PROGRESS)  # straddles the snapshot at 6
    dump = [stored(n, n, parent=n - 1 if n else None, tokens=TOKENS if n % 2 else None) for n in range(8)]
    odd = every_kind(8)  # not one-block runs: kept as maps, in their place
    mirror = [
        MirrorRow(StorageTier.DEVICE, 1, None, TOKENS),
        MirrorRow(StorageTier.DEVICE, 2, 1, None),
        MirrorRow(StorageTier.HOST_PINNED, U64_MAX, U64_MAX - 1, b""),
    ]
    store.write_snapshot(6, [*dump, *odd], mirror, None)
    assert store.suffix_length() == 6  # the straddling batch counts whole; 7..10 are loaded
    store.write_snapshot(6, [*dump, *odd], mirror, None)  # again at the same id: the same state
    loaded = reopen(store)
    assert loaded.snapshot_id == 6 and loaded.last_event_id == 10
    assert loaded.snapshot_events == (*dump, *odd)
    assert tokens_of(loaded.snapshot_events) == tokens_of([*dump, *odd])
    assert loaded.mirror == tuple(mirror)
    assert [event.event_id for event in loaded.suffix_events] == [7, 8, 9, 10]
    assert loaded.attachment == PROGRESS


def test_a_snapshot_past_the_suffix_empties_it(store: SlotStore) -> None:
    """The writer fell behind the ring: it snapshots the index at its newest id instead."""
    store.append([stored(n, n) for n in range(1, 4)], PROGRESS)
    store.write_snapshot(50, [stored(0, 1)], [], attrs.evolve(PROGRESS, engine_seq=99))
    loaded = reopen(store)
    assert (loaded.snapshot_id, loaded.last_event_id, loaded.suffix_events) == (50, 50, ())
    assert loaded.attachment is not None and loaded.attachment.engine_seq == 99


def test_a_snapshot_older_than_the_last_one_is_refused(store: SlotStore) -> None:
    store.write_snapshot(10, [], [], None)
    with pytest.raises(ValueError, match="outside"):
        store.write_snapshot(9, [], [], None)
    with pytest.raises(ValueError, match="outside"):
        store.write_snapshot(FIRST_LEASE, [], [], None)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(StorageTier)),
            st.integers(0, U64_MAX),
            st.none() | st.integers(0, U64_MAX),
            st.none() | st.binary(max_size=80),
        ),
        max_size=40,
    ),
    st.integers(1, 9),
)
def test_mirror_and_snapshot_chunks_round_trip(
    rows: list[tuple[StorageTier, int, int | None, bytes | None]], chunk: int
) -> None:
    mirror = [MirrorRow(*row) for row in rows]
    decoded = [
        r for body in columns.encode_mirror_chunks(mirror, chunk) for r in columns.decode_mirror_chunk(body)
    ]
    assert decoded == mirror
    events = [
        RouterEvent(
            3,
            tier,
            ResidencyDomain.WORKER,
            n + (n > 20),
            Stored(parent, (block,), (n,), token_bytes=tokens),
            0,
        )
        for n, (tier, block, parent, tokens) in enumerate(rows)
    ]
    chunks = list(columns.encode_snapshot_chunks(events, chunk))
    back = [event for body in chunks for event in columns.decode_snapshot_chunk(body)]
    assert back == events and tokens_of(back) == tokens_of(events)


def test_a_dump_snapshot_is_stored_as_the_tree_dumps_events_would_be(store: SlotStore) -> None:
    """The writer hands over the index's DumpSnapshot (a C-speed copy) instead of building the tree dump's
    events on the event loop: the rows are byte for byte those of the events, and load as the events."""
    index = RecoveryIndex(kv_block_size=16)
    rng, resident = random.Random(5), list[int]()
    drive(index, rng, resident, 1, 600)  # stores and removals: dead rows in the columns
    mm = MmExtraInfo((MmObject(7, ((0, 16),)),))
    with_info = Stored(resident[0], (11, 12, 13), (1, 2, 3), (None, mm, mm))
    index.apply(worker_event(601, with_info))
    owner_data = Stored(None, (21, 22), (1, 2))
    index.apply(RouterEvent(17, StorageTier.DISK, ResidencyDomain.CACHE_OWNER, 602, owner_data, 0, OWNER))
    index.apply(worker_event(603, Removed((12,))))
    snapshot, dump = index.dump_snapshot(), index.tree_dump()
    assert {len(group.columns.hashes) - group.columns.live for group in snapshot.groups} != {0}
    for rows in (1, 7, columns.CHUNK_ROWS):
        assert list(columns.encode_dump_chunks(snapshot, rows)) == list(
            columns.encode_snapshot_chunks(dump.events, rows)
        )
    store.append(drive(index, rng, resident, 604, 10), PROGRESS)
    store.write_snapshot(dump.last_event_id, snapshot, [], None)
    loaded = reopen(store)
    assert loaded.snapshot_events == dump.events and loaded.snapshot_id == 603
    assert [event.event_id for event in loaded.suffix_events] == list(range(604, 614))


route_events = st.builds(
    RouterEvent,
    st.integers(0, U64_MAX),
    st.sampled_from(list(StorageTier)),
    st.sampled_from(list(ResidencyDomain)),
    st.just(0),
    st.one_of(
        st.builds(
            lambda hashes, parent, tokens, start: Stored(parent, hashes, hashes[::-1], None, start, tokens),
            st.lists(st.integers(0, U64_MAX), max_size=5).map(tuple),
            st.none() | st.integers(0, U64_MAX),
            st.none() | st.binary(max_size=40),
            st.none() | st.integers(0, 1 << 32),
        ),
        st.builds(Removed, st.lists(st.integers(0, U64_MAX), max_size=5).map(tuple)),
        st.just(CLEARED),
    ),
    st.integers(0, 7),
    st.none() | st.just(OWNER),
    st.none() | st.text(max_size=8),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(route_events, max_size=12))
def test_batches_round_trip(events: list[RouterEvent]) -> None:
    numbered = [attrs.evolve(event, event_id=n) for n, event in enumerate(events, 1)]
    back = codec.decode_batch(codec.encode_batch(numbered))
    assert back == numbered and tokens_of(back) == tokens_of(numbered)


@pytest.mark.parametrize(
    "body",
    [
        [[], [[1, 0, 0]]],  # a route index with no route
        [[[17, "device", "worker", 0, None, None]], [[1, 0, 9]]],  # an unknown kind
        [[[17, "device", "worker", 0, None, None]], [[1, 0, 1, ["x"]]]],  # a hash that is not a u64
        [[[17, "device", "worker", 0, None, None]], [[-1, 0, 2]]],  # a negative id
        [[[17, "nowhere", "worker", 0, None, None]], [[1, 0, 2]]],  # an unknown tier
        [[[17, "device", "worker", 0, None, None]], [[1, 0, 0, None, [1], [1], "tokens", None, None]]],
        "not a batch",
    ],
)
def test_a_batch_row_that_is_not_one_does_not_decode(body: object) -> None:
    with pytest.raises(CodecError):
        codec.decode_batch(msgpack.packb(body))


# --- leases and clean stops ------------------------------------------------------------------------------


def test_leases_only_go_up_and_survive_a_reopen(store: SlotStore) -> None:
    store.extend_lease(FIRST_LEASE + LEASE_BLOCK)
    store.extend_lease(FIRST_LEASE + LEASE_BLOCK, FIRST_LEASE + 5)
    with pytest.raises(ValueError, match="never goes down"):
        store.extend_lease(FIRST_LEASE)
    with pytest.raises(ValueError, match="never goes down"):
        store.extend_lease(FIRST_LEASE + LEASE_BLOCK, FIRST_LEASE)
    loaded = reopen(store)
    assert (loaded.lease_end, loaded.republish_lease_end) == (FIRST_LEASE + LEASE_BLOCK, FIRST_LEASE + 5)


def test_a_clean_stop_continues_right_after_the_last_id(store: SlotStore) -> None:
    store.append([stored(n, n) for n in range(1, 6)], PROGRESS)
    store.mark_clean(5, last_republish_seq=2)
    loaded = reopen(store)
    assert loaded.clean and (loaded.lease_end, loaded.republish_lease_end) == (6, 3)


def test_a_clean_stop_with_unpersisted_events_loads_as_not_clean(store: SlotStore) -> None:
    store.append([stored(n, n) for n in range(1, 6)], PROGRESS)
    store.mark_clean(9)  # 6..9 were stamped but never appended: the next run must skip them
    loaded = reopen(store)
    assert not loaded.clean and loaded.lease_end == 10 and loaded.last_event_id == 5


def test_a_new_slot_that_stamped_nothing_stops_clean_at_one(store: SlotStore) -> None:
    store.mark_clean(None)
    loaded = reopen(store)
    assert loaded.clean and loaded.lease_end == 1 and loaded.republish_lease_end == FIRST_LEASE


def test_a_clean_stop_never_hands_out_ids_a_crashed_run_may_have_used(store: SlotStore) -> None:
    store.append([stored(n, n) for n in range(1, 6)], PROGRESS)
    store.close()  # a crash: ids 6..FIRST_LEASE-1 may have been published
    again = SlotStore.open(store.path)
    loaded = again.load()
    assert loaded is not None and not loaded.clean
    with pytest.raises(ValueError, match="outside the ids"):
        again.mark_clean(5)  # would restart at 6
    again.mark_clean(None)  # the restarted run stamped nothing: it resumes above the lease
    loaded = reopen(again)
    assert loaded.lease_end == FIRST_LEASE and not loaded.clean
    unloaded = SlotStore.open(store.path)  # the floor comes from the file, whether or not it was loaded
    with pytest.raises(ValueError, match="republish seq"):
        unloaded.mark_clean(None, last_republish_seq=FIRST_LEASE)  # beyond its lease
    with pytest.raises(ValueError, match="republish seq"):
        unloaded.mark_clean(None, last_republish_seq=3)  # below this run's first seq
    with pytest.raises(ValueError, match="outside the ids"):
        unloaded.mark_clean(5)
    unloaded.close()


def test_writes_after_a_clean_stop_clear_the_flag(store: SlotStore) -> None:
    store.mark_clean(None)
    store.extend_lease(1 + LEASE_BLOCK)
    assert not reopen(store).clean


def test_a_full_disk_fails_the_write_whole_and_the_store_stays_usable(store: SlotStore) -> None:
    store.append([stored(1, 1)], PROGRESS)
    db = store._connection()  # SQLite's page cap stands in for a full disk: the same SQLITE_FULL
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    db.execute(f"PRAGMA max_page_count = {pages + 2}")
    big = [stored(n, n, tokens=TOKENS * 64) for n in range(2, 200)]
    with pytest.raises(StoreWriteError, match="full"):
        store.append(big, attrs.evolve(PROGRESS, engine_seq=99))
    with pytest.raises(StoreWriteError, match="full"):
        store.write_snapshot(199, big, [], None)
    assert store.suffix_length() == 1
    db.execute("PRAGMA max_page_count = 1073741823")
    store.append(big, None)  # the retry
    loaded = reopen(store)
    assert [event.event_id for event in loaded.suffix_events] == list(range(1, 200))
    assert loaded.attachment == PROGRESS  # the failed write's progress never landed


def test_an_exclusive_store_keeps_every_other_opener_out(store: SlotStore) -> None:
    reader = SlotStore.open(store.path)  # a non-exclusive store leaves the file readable by others
    assert reader.load() is not None
    reader.close()
    store.close()
    agent = SlotStore.open(store.path, exclusive=True)
    for exclusive in (True, False):
        with pytest.raises(StateFileInUse, match="in use by another process") as caught:
            SlotStore.open(store.path, exclusive=exclusive)
        assert caught.value.code == "conflict"
    agent.close()
    again = SlotStore.open(store.path, exclusive=True)
    assert again.load() is not None  # the file was never refused
    again.close()


# --- refused files ------------------------------------------------------------------------------------------


def refused(path: Path) -> StateFileError:
    """The StateFileError that opening and loading ``path`` raises (the store is closed either way)."""
    with pytest.raises(StateFileError) as caught:
        SlotStore.open(path).load()
    error = caught.value
    assert "\n" not in str(error) and str(path) in str(error)
    assert error.path == path and error.code == "internal"
    return error


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "garbage.sqlite3"
    path.write_bytes(b"this is not sqlite\n" * 300)
    assert "not a SQLite database" in refused(path).reason
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)  # the magic, then garbage: SQLite's verdict
    assert "not a database" in refused(path).reason


def test_a_foreign_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "foreign.sqlite3"
    with sqlite3.connect(path) as other:
        other.execute("CREATE TABLE t (x)")
    other.close()
    assert refused(path).reason == "not a kvagent state file"


def test_a_newer_schema_version_is_refused(store: SlotStore) -> None:
    store.close()
    db = sqlite3.connect(store.path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    assert (
        refused(store.path).reason
        == f"schema version {SCHEMA_VERSION + 1} is newer than this kvagent's {SCHEMA_VERSION}"
    )


def test_a_truncated_file_is_refused(store: SlotStore) -> None:
    store.write_snapshot(0, [stored(n, n, tokens=TOKENS * 8) for n in range(5000)], [], PROGRESS)
    store.close()  # the last close checkpoints everything into the main file
    size = store.path.stat().st_size
    with store.path.open("r+b") as file:
        file.truncate(size // 2)
    refused(store.path)


def test_a_row_that_does_not_decode_is_refused_by_load(store: SlotStore) -> None:
    store.append([stored(1, 1)], PROGRESS)
    store.append([stored(2, 2)], PROGRESS)
    store.close()
    db = sqlite3.connect(store.path)
    db.execute("UPDATE batches SET body = x'c1' WHERE first_id = 2")  # 0xc1: never valid msgpack
    db.commit()
    db.close()
    opened = SlotStore.open(store.path)  # the file itself is sound
    with pytest.raises(StateFileError, match="row does not decode") as caught:
        opened.load()
    assert "\n" not in str(caught.value)
    SlotStore.set_aside(opened.path)  # load closed the store: the file can move at once


def test_rows_that_contradict_each_other_are_refused(store: SlotStore) -> None:
    store.append([stored(1, 1), stored(2, 2)], PROGRESS)
    store.close()
    db = sqlite3.connect(store.path)
    db.execute("UPDATE slot SET last_event_id = 7")
    db.commit()
    db.close()
    assert "disagree" in refused(store.path).reason


def test_set_aside_moves_the_file_and_its_wal_and_a_cold_start_follows(store: SlotStore) -> None:
    store.append([stored(1, 1)], PROGRESS)
    wal = store.path.with_name(store.path.name + "-wal")
    assert wal.exists()  # an open WAL-mode database with a commit in its log
    store.close()
    store.path.write_bytes(b"\0" * 100)  # damage it; keep a wal beside it
    wal.write_bytes(b"stale")
    refused(store.path)
    moved = SlotStore.set_aside(store.path)
    assert moved.name.startswith("slot-a.sqlite3.refused-") and moved.read_bytes() == b"\0" * 100
    assert moved.with_name(moved.name + "-wal").read_bytes() == b"stale"
    assert not store.path.exists() and not wal.exists()
    store.path.write_bytes(b"\1" * 100)
    second = SlotStore.set_aside(store.path)  # the same second: a different name, nothing overwritten
    assert second != moved and moved.read_bytes() == b"\0" * 100
    fresh = SlotStore.open(store.path)
    assert fresh.load() is None
    fresh.close()


# --- the compaction bound -----------------------------------------------------------------------------------


def drive(
    index: RecoveryIndex, rng: random.Random, resident: list[int], first_id: int, count: int
) -> list[RouterEvent]:
    """``count`` random outbound events (stores of chains, removals), applied to ``index``; ``resident``
    tracks the resident hashes (random u64s: distinct)."""
    events: list[RouterEvent] = []
    for event_id in range(first_id, first_id + count):
        data: EventData
        if rng.random() < (0.6 if len(resident) < 2500 else 0.4) or not resident:  # grow, then hover
            chain = tuple(rng.getrandbits(64) for _ in range(rng.randint(1, 6)))
            parent = rng.choice(resident) if resident and rng.random() < 0.5 else None
            data = Stored(parent, chain, chain, token_bytes=TOKENS * len(chain))
            resident.extend(chain)
        else:
            doomed = []
            for _ in range(min(len(resident), rng.randint(1, 6))):
                slot = rng.randrange(len(resident))
                resident[slot], resident[-1] = resident[-1], resident[slot]
                doomed.append(resident.pop())
            data = Removed(tuple(doomed))
        event = worker_event(event_id, data)
        index.apply(event)
        events.append(event)
    return events


def replay(loaded: LoadedSlot) -> frozenset[int]:
    """The resident Worker blocks that the loaded snapshot plus suffix describe."""
    blocks: set[int] = set()
    for event in (*loaded.snapshot_events, *loaded.suffix_events):
        if type(event.data) is Stored:
            blocks.update(event.data.block_hashes)
        elif type(event.data) is Removed:
            blocks.difference_update(event.data.block_hashes)
        else:
            blocks.clear()
    return frozenset(blocks)


def test_compaction_keeps_the_file_within_a_small_multiple_of_the_resident_state(store: SlotStore) -> None:
    index = RecoveryIndex(kv_block_size=16, ring_capacity=1 << 16)
    rng, resident = random.Random(17), list[int]()
    next_id, snapshots, peak_ratio = 1, 0, 0.0
    for _ in range(120):  # drains of 128 events, as the writer appends them
        store.append(drive(index, rng, resident, next_id, 128), PROGRESS)
        next_id += 128
        if store.suffix_length() > max(4096, 2 * index.resident_block_count):
            dump = index.tree_dump()
            store.write_snapshot(dump.last_event_id, dump.events, [], PROGRESS)
            snapshots += 1
            peak_ratio = max(peak_ratio, store.disk_bytes() / max(1, index.resident_block_count))
    assert snapshots >= 2
    # Right after a compaction the file holds the snapshot (about 25 bytes a block: the tree dump has no
    # tokens) and SQLite's own pages; the freed suffix pages went back to the file system.
    assert peak_ratio < 60, peak_ratio
    loaded = reopen(store)
    assert replay(loaded) == frozenset(block for _, _, block in index.resident_blocks())
    assert loaded.last_event_id == next_id - 1
