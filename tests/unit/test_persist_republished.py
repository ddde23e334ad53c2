"""Issue #37: whether the persisted state carries the republished stream is recorded as its own fact.

Schema version 2 keeps ``slot.republished``; a version 1 file is migrated in place when opened and the fact
inferred from what it holds (a mirror, the suffix's tokens).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from kvagent.model.events import CLEARED, Removed, ResidencyDomain, RouterEvent, StorageTier
from kvagent.persist.records import MirrorRow
from kvagent.persist.store import SCHEMA_VERSION, SlotStore
from tests.support.ids import OWNER
from tests.support.persist import load_state_file
from tests.unit.test_persist_store import FIRST_LEASE, IDENTITY, PROGRESS, TOKENS, stored, worker_event


def open_store(path: Path, *, republished: bool) -> SlotStore:
    path.parent.mkdir(parents=True, exist_ok=True)
    store = SlotStore.open(path)
    store.initialize(IDENTITY, FIRST_LEASE, FIRST_LEASE, republished=republished)
    return store


def owner_cleared(event_id: int) -> RouterEvent:
    return RouterEvent(17, StorageTier.DEVICE, ResidencyDomain.CACHE_OWNER, event_id, CLEARED, 0, OWNER)


@pytest.mark.parametrize("republished", [False, True])
def test_a_new_state_records_whether_its_run_republishes(tmp_path: Path, republished: bool) -> None:
    path = tmp_path / "s.sqlite3"
    open_store(path, republished=republished).close()
    assert load_state_file(path).republished is republished


def test_appends_keep_it_events_without_tokens_end_it_a_worker_reset_with_tokens_starts_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.sqlite3"
    store = open_store(path, republished=True)
    store.append([stored(1, 10, tokens=TOKENS)], PROGRESS)  # before any compaction: the mirror is empty
    store.close()
    loaded = load_state_file(path)
    assert loaded.republished and not loaded.mirror, "an empty mirror says nothing about the run"

    store = SlotStore.open(path, create=False)
    store.append([stored(2, 11)], PROGRESS, tokens=False)  # a run that does not republish
    store.close()
    assert not load_state_file(path).republished

    store = SlotStore.open(path, create=False)
    store.append([stored(3, 12, tokens=TOKENS), owner_cleared(4)], PROGRESS)  # not the Worker's reset
    store.close()
    assert not load_state_file(path).republished

    store = SlotStore.open(path, create=False)
    store.append([worker_event(5, CLEARED), stored(6, 13, tokens=TOKENS)], PROGRESS)
    store.close()
    assert load_state_file(path).republished


def test_a_run_that_does_not_republish_ends_it_at_open_and_an_empty_state_can_be_marked(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.sqlite3"
    store = open_store(path, republished=True)
    store.extend_lease(FIRST_LEASE + 10, FIRST_LEASE + 10, republished=None)
    store.close()
    assert load_state_file(path).republished, "a republishing run keeps the recorded fact"
    store = SlotStore.open(path, create=False)
    store.extend_lease(FIRST_LEASE + 20, FIRST_LEASE + 20, republished=False)
    store.close()
    assert not load_state_file(path).republished
    store = SlotStore.open(path, create=False)
    store.mark_republished()
    store.close()
    assert load_state_file(path).republished


def downgrade_to_v1(path: Path) -> None:
    """What kvagent of schema version 1 wrote: no ``republished`` column, user_version 1."""
    with closing(sqlite3.connect(path)) as db:
        db.execute("ALTER TABLE slot DROP COLUMN republished")
        db.execute("PRAGMA user_version = 1")
        db.commit()


def v1_tokens_in_suffix(store: SlotStore) -> None:
    store.append([stored(1, 10, tokens=TOKENS), stored(2, 11, parent=10, tokens=TOKENS)], PROGRESS)


def v1_no_tokens(store: SlotStore) -> None:
    store.append([stored(1, 10), stored(2, 11, parent=10)], PROGRESS, tokens=False)


def v1_compacted_with_mirror(store: SlotStore) -> None:
    events = [stored(1, 10, tokens=TOKENS)]
    store.append(events, PROGRESS)
    store.write_snapshot(1, events, [MirrorRow(StorageTier.DEVICE, 10, None, TOKENS)], PROGRESS)


def v1_compacted_without_mirror(store: SlotStore) -> None:
    events = [stored(1, 10)]
    store.append(events, PROGRESS, tokens=False)
    store.write_snapshot(1, events, [], PROGRESS)


def v1_reset_after_a_run_without_tokens(store: SlotStore) -> None:
    store.append([stored(1, 10)], PROGRESS, tokens=False)
    store.append([worker_event(2, CLEARED), stored(3, 12, tokens=TOKENS)], PROGRESS)


def v1_nothing_resident(store: SlotStore) -> None:
    store.append([stored(1, 10), worker_event(2, Removed((10,)))], PROGRESS, tokens=False)


@pytest.mark.parametrize(
    ("write", "inferred"),
    [
        (v1_tokens_in_suffix, True),
        (v1_no_tokens, False),
        (v1_compacted_with_mirror, True),
        (v1_compacted_without_mirror, False),
        (v1_reset_after_a_run_without_tokens, True),
        (v1_nothing_resident, False),  # (stores without tokens: read as "did not", which only costs a resume)
    ],
)
def test_a_version_1_file_is_migrated_and_the_fact_inferred_from_what_it_holds(
    tmp_path: Path, write: Callable[[SlotStore], None], inferred: bool
) -> None:
    path = tmp_path / "s.sqlite3"
    store = open_store(path, republished=False)
    write(store)
    store.close()
    downgrade_to_v1(path)

    loaded = load_state_file(path)  # opening migrates
    assert loaded.republished is inferred
    assert loaded.identity == IDENTITY and loaded.attachment == PROGRESS
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert db.execute("SELECT republished FROM slot").fetchone() == (None,), "unknown stays unknown"
    # The migrated file is written as any other: the next append records the fact.
    store = SlotStore.open(path, create=False)
    store.append([worker_event(100, CLEARED)], PROGRESS)
    store.close()
    assert load_state_file(path).republished
