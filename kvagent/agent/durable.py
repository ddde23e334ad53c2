"""A slot's state directory: open and load its store, restore from it, and run its persistence task.

One SQLite file per slot (docs/durability.md). What this module decides:

- **Refused files.** A truncated, corrupt or newer-version file is logged as one line naming it, moved aside
  (``NAME.refused-<UTC timestamp>``) and the slot starts cold: never a crash loop.
- **Identity.** The persisted publisher id is kept; a file written for another CacheOwner (or for another
  explicitly configured publisher id) belongs to another slot and is set aside the same way.
- **Outbound ids.** After a clean stop the slot continues at ``last id + 1``; after a crash at ``lease_end``
  (the ids in between are skipped and stay empty: no id is ever issued twice).
- **Resume.** The first attach to the engine endpoint the state was attached to resumes from the persisted
  engine seq and batch digest; any other attach is a new engine as before.
- **Republished.** Whether the state carries the republished Worker state (tokens included) is a recorded
  fact (``LoadedSlot.republished``), kept by every republishing run and ended by the first that does not
  republish. A republishing slot resumes whenever it is set, before or after a compaction, after a clean
  stop or a crash; only a state without it (and with Worker blocks) attaches cold with a Worker reset.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import attrs
import structlog
import trio

from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.coordinator.machine import SlotCoordinator
from kvagent.coordinator.task import CoordinatorHandle
from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC
from kvagent.model.ids import attachment_record_id, new_publisher_id
from kvagent.model.status import Attachment
from kvagent.persist.store import (
    LEASE_BLOCK,
    AttachmentProgress,
    LoadedSlot,
    MirrorRow,
    SlotIdentityRecord,
    SlotStore,
    StateFileError,
    StoreWriteError,
)
from kvagent.persist.writer import (
    IO_ERRORS,
    LeaseHolder,
    MirrorSnapshot,
    PersistenceWriter,
    RepublishMirror,
)
from kvagent.publish.republish_state import MirrorRows
from kvagent.publish.republisher import VllmRepublisher

__all__ = [
    "DurableSlot",
    "decide_publisher_id",
    "open_durable_slot",
    "open_slot_state",
    "run_persistence",
    "slot_state_path",
    "withdraw_stale_records",
]

log = structlog.get_logger(__name__)


def slot_state_path(state_dir: Path, slot_name: str) -> Path:
    """``STATE_DIR/slots/<urlsafe slot name>.sqlite3``: one file per slot, any slot name."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else f"%{ord(ch):02X}" for ch in slot_name)
    return state_dir / "slots" / f"{safe}.sqlite3"


@attrs.define
class DurableSlot:
    """An open slot store and what it held at start (``loaded`` is None for a cold start)."""

    path: Path
    store: SlotStore
    loaded: LoadedSlot | None
    publisher_id: int
    first_outbound_id: int
    lease_end: int
    republish_next_seq: int
    republish_lease_end: int
    _resume_pending: bool = True
    writer: PersistenceWriter | None = None

    @property
    def restored(self) -> bool:
        return self.loaded is not None

    def restore(
        self, index: RecoveryIndex, core: SlotCoordinator, republisher: VllmRepublisher | None
    ) -> None:
        """Load the persisted index, coordinator and republish mirror; skip the ids a crash left unpersisted.

        Call before any task runs.
        """
        loaded = self.loaded
        if loaded is None:
            return
        index.restore(loaded.snapshot_events, loaded.suffix_events, snapshot_id=loaded.snapshot_id)
        if self.first_outbound_id - 1 > index.current_event_id():
            index.skip_to(self.first_outbound_id - 1)
        generation = 0 if loaded.attachment is None else loaded.attachment.generation
        core.restore(next_generation=generation + 1, worker_blocks=index.resident_worker_blocks())
        if republisher is not None and not loaded.republished:
            if next(index.resident_worker_blocks(), None) is not None:
                # A run since the state was complete did not republish, so it kept no tokens: the
                # republished stream cannot show the restored Worker blocks. Attach cold instead (a Worker
                # reset, then the engine's history with its tokens) rather than republish a state without
                # them; the reset, persisted with tokens after it, makes the state complete again.
                log.warning(
                    "republish_enabled_on_restart",
                    slot=str(self.path),
                    resume="skipped",
                    reason="a previous run did not republish: the state has Worker blocks without tokens",
                )
                self._resume_pending = False
            else:
                # No Worker block lacks its tokens: the state is complete as it is (before any task runs,
                # so this one synchronous write has the store to itself). Should the disk refuse, the fact
                # stays unrecorded and the next restart attaches cold: exact, only not a resume.
                try:
                    self.store.mark_republished()
                except IO_ERRORS as exc:
                    log.warning("republished_fact_not_recorded", path=str(self.path), error=str(exc))
        if republisher is not None:
            rows = [(r.tier, r.block_hash, r.parent_hash, r.token_bytes) for r in loaded.mirror]
            republisher.state.restore(rows, loaded.suffix_events, self.republish_next_seq)

    def persisted_attachment(self) -> AttachmentConfig | None:
        """The engine the state was attached to (for a slot configured without an engine)."""
        progress = None if self.loaded is None else self.loaded.attachment
        if progress is None:
            return None
        return AttachmentConfig(
            worker_id=progress.worker_id,
            dp_rank=progress.dp_rank,
            endpoint=progress.endpoint,
            topic=progress.topic,
            replay_endpoint=progress.replay_endpoint,
        )

    def take_resume_point(self, config: AttachmentConfig) -> tuple[int, int] | None:
        """(engine seq, digest) to resume ``config`` from; only for the first attach, to the same engine."""
        pending, self._resume_pending = self._resume_pending, False
        progress = None if self.loaded is None else self.loaded.attachment
        if not pending or progress is None or progress.engine_seq is None or progress.digest is None:
            return None
        same = (
            progress.endpoint == config.endpoint
            and progress.worker_id == config.worker_id
            and progress.dp_rank == config.dp_rank
            and progress.topic == config.topic
        )
        return (progress.engine_seq, progress.digest) if same else None

    def start_writer(
        self,
        *,
        index: RecoveryIndex,
        wait_until: Callable[[Callable[[], bool]], Awaitable[object]],
        progress: Callable[[], AttachmentProgress | None],
        lease: LeaseHolder,
        republish: RepublishMirror | None,
    ) -> PersistenceWriter:
        loaded = self.loaded
        self.writer = PersistenceWriter(
            self.store,
            index=index,
            wait_until=wait_until,
            progress=progress,
            lease=lease,
            persisted_id=index.current_event_id(),
            first_id=self.first_outbound_id,
            republish_first_seq=self.republish_next_seq,
            lease_end=self.lease_end,
            republish_lease_end=self.republish_lease_end,
            suffix_length=0 if loaded is None else len(loaded.suffix_events),
            republish=republish,
        )
        return self.writer

    async def close(self) -> None:
        await trio.to_thread.run_sync(self.store.close)


def attachment_progress(
    attachment: Attachment | None, source: tuple[int, int, int] | None
) -> AttachmentProgress | None:
    """The attachment's persisted form: where it reads and how far (``source``: generation, seq, digest)."""
    if attachment is None:
        return None
    generation, seq, digest = source if source is not None else (attachment.generation, None, None)
    return AttachmentProgress(
        worker_id=attachment.worker.worker_id,
        dp_rank=attachment.worker.dp_rank,
        endpoint=attachment.source.endpoint,
        replay_endpoint=attachment.source.replay_endpoint,
        topic=attachment.source.topic,
        generation=generation,
        engine_seq=seq,
        digest=digest,
    )


async def withdraw_stale_records(
    discovery: Discovery, durable: DurableSlot | None, source_record: DiscoveryRecord
) -> None:
    """Withdraw the ads a killed previous run of this slot left behind.

    They are ours (the publisher id is kept) and would conflict with this run's (the recovery URL may have
    changed); withdrawing an absent record is a no-op.
    """
    loaded = None if durable is None else durable.loaded
    if durable is None or loaded is None:
        return
    stale = [(source_record.topic, source_record.record_id)]
    if loaded.attachment is not None:
        record_id = attachment_record_id(durable.publisher_id, loaded.attachment.generation)
        stale.append((KV_STATE_ATTACHMENTS_TOPIC, record_id))
    for topic, record_id in stale:
        try:
            await discovery.unregister(topic, record_id)
        except Exception as exc:
            log.warning("stale_record_withdrawal_failed", topic=topic, record_id=record_id, error=str(exc))


class _Progress:
    """The attachment progress the writer persists (None: keep the recorded one)."""

    def __init__(self, coordinator: CoordinatorHandle, attachment: Callable[[], Attachment | None]) -> None:
        self._coordinator = coordinator
        self._attachment = attachment

    def __call__(self) -> AttachmentProgress | None:
        # Detached or not yet re-attached: the engine recorded stays the one to resume. The source progress
        # is None after a Worker reset and while degraded: then nothing may be resumed (seq None).
        return attachment_progress(self._attachment(), self._coordinator.source_progress())


class _RepublishMirror:
    """The republisher's seq and mirror, as the writer wants them."""

    def __init__(self, republisher: VllmRepublisher) -> None:
        self._state = republisher.state

    def last_seq(self) -> int | None:
        return self._state.last_seq

    def open_mirror(self) -> MirrorSnapshot | None:
        if not self._state.mirror_current:
            return None
        return _MirrorRows(self._state.mirror_rows())


class _MirrorRows:
    def __init__(self, rows: MirrorRows) -> None:
        self._rows = rows

    def __iter__(self) -> Iterator[MirrorRow]:
        for tier, block_hash, parent_hash, token_bytes in self._rows:
            yield MirrorRow(tier, block_hash, parent_hash, token_bytes)

    def close(self) -> None:
        self._rows.close()


async def run_persistence(
    durable: DurableSlot,
    *,
    index: RecoveryIndex,
    coordinator: CoordinatorHandle,
    republisher: VllmRepublisher | None,
    attachment: Callable[[], Attachment | None],
    step_timeout: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The slot's persistence task: persist until cancelled, then stop cleanly and close the state file.

    A child of the slot's ladder outside the coordinator's rung, so it is cancelled once nothing applies any
    more (the clean stop records ``lease_end = last id + 1``).  ``attachment`` reads the slot's current
    attachment (the engine to resume after a restart).
    """
    try:

        async def wait_until(predicate: Callable[[], bool]) -> None:
            while not predicate():
                await (
                    coordinator.wait_progress()
                )  # after each drain or command, and when blocked on the lease

        writer = durable.start_writer(
            index=index,
            wait_until=wait_until,
            progress=_Progress(coordinator, attachment),
            lease=coordinator,
            republish=None if republisher is None else _RepublishMirror(republisher),
        )
        await writer.run(task_status=task_status)
    finally:
        with trio.move_on_after(step_timeout, shield=True) as stopping:
            if durable.writer is not None:
                try:
                    await durable.writer.close_clean()
                except IO_ERRORS as exc:
                    log.error("persistence_clean_stop_failed", path=str(durable.path), error=str(exc))
            await durable.close()
        if stopping.cancelled_caught:
            log.warning("persistence_clean_stop_timed_out", timeout=step_timeout)


def _open_or_refuse(path: Path) -> SlotStore:
    """Open the store; a refused file is logged as one line, moved aside, and a new store opened."""
    try:
        return SlotStore.open(path, exclusive=True)
    except StateFileError as exc:
        moved = SlotStore.set_aside(path)
        log.error("state_file_refused", error=str(exc), moved_to=str(moved))
        return SlotStore.open(path, exclusive=True)


def _belongs(loaded: LoadedSlot, config: SlotAgentConfig) -> str | None:
    """None when ``loaded`` is this slot's state, else why not."""
    identity = loaded.identity
    if identity.cache_owner_id != str(config.cache_owner_id):
        return f"CacheOwnerId {identity.cache_owner_id} is not the slot's {config.cache_owner_id}"
    if config.publisher_id is not None and identity.publisher_id != config.publisher_id:
        return f"publisher id {identity.publisher_id} is not the configured {config.publisher_id}"
    return None


def _open_sync(path: Path, config: SlotAgentConfig, new_publisher: int) -> DurableSlot:
    store = _open_or_refuse(path)
    try:
        loaded = store.load()
    except StateFileError as exc:  # a row that does not decode is found only while loading
        store.close()
        moved = SlotStore.set_aside(path)
        log.error("state_file_refused", error=str(exc), moved_to=str(moved))
        store, loaded = SlotStore.open(path, exclusive=True), None
    if loaded is not None and (reason := _belongs(loaded, config)) is not None:
        store.close()
        moved = SlotStore.set_aside(path)
        log.error("state_file_refused", error=f"{path}: {reason}", moved_to=str(moved))
        store, loaded = SlotStore.open(path, exclusive=True), None
    if loaded is None:
        publisher_id = new_publisher
        identity = SlotIdentityRecord(config.name, publisher_id, str(config.cache_owner_id))
        store.initialize(identity, 1 + LEASE_BLOCK, LEASE_BLOCK, republished=config.republish is not None)
        return DurableSlot(path, store, None, publisher_id, 1, 1 + LEASE_BLOCK, 0, LEASE_BLOCK)
    # A clean stop recorded lease_end = last id + 1, so both cases continue at lease_end; the next lease
    # is durable before the coordinator stamps any id from it.
    first, republish_next = loaded.lease_end, loaded.republish_lease_end
    # A run that does not republish ends the republished fact before it writes anything without tokens; a
    # republishing one keeps what is recorded (its appends set it once a Worker reset makes it true).
    republished = None if config.republish is not None else False
    store.extend_lease(first + LEASE_BLOCK, republish_next + LEASE_BLOCK, republished=republished)
    return DurableSlot(
        path,
        store,
        loaded,
        loaded.identity.publisher_id,
        first_outbound_id=first,
        lease_end=first + LEASE_BLOCK,
        republish_next_seq=republish_next,
        republish_lease_end=republish_next + LEASE_BLOCK,
    )


def decide_publisher_id(config: SlotAgentConfig) -> int:
    """A slot's publisher id before its state file is read: the configured one, else a new random one."""
    return config.publisher_id if config.publisher_id is not None else new_publisher_id()


async def open_slot_state(config: SlotAgentConfig) -> tuple[SlotAgentConfig, DurableSlot | None]:
    """Open the slot's state file and fix its publisher id: the one place it is decided.

    A restarted slot keeps its persisted id; a new state file (or a slot in memory only) takes
    :func:`decide_publisher_id`'s.  Returns the config with ``publisher_id`` set (everything downstream,
    the sinks included, takes it from there; ``state_path`` None when the slot runs in memory only) and
    the opened state (None: in memory only).  Calling it again with the returned config changes nothing.
    """
    candidate = decide_publisher_id(config)
    durable = await open_durable_slot(config, candidate)
    if durable is None:
        # In memory only, decided: opening the config again opens nothing (and cannot refuse a state file
        # for a publisher id decided here).
        return attrs.evolve(config, publisher_id=candidate, state_path=None), None
    return attrs.evolve(config, publisher_id=durable.publisher_id), durable


async def open_durable_slot(config: SlotAgentConfig, new_publisher: int) -> DurableSlot | None:
    """The slot's store (None when the slot keeps its state in memory only), opened in a worker thread.

    ``new_publisher``: the publisher id a new state file records (see :func:`decide_publisher_id`).
    """
    if config.state_path is None:
        return None
    try:
        durable = await trio.to_thread.run_sync(_open_sync, config.state_path, config, new_publisher)
    except (OSError, sqlite3.Error, StoreWriteError) as exc:
        # Not the file's content (that is refused and set aside above) but the disk or the directory: the
        # slot still serves, from memory only, rather than not at all.
        log.error("state_file_unusable", path=str(config.state_path), error=str(exc), persistence="off")
        return None
    if durable.loaded is not None:
        loaded = durable.loaded
        log.info(
            "state_loaded",
            path=str(durable.path),
            publisher_id=durable.publisher_id,
            clean=loaded.clean,
            last_event_id=loaded.last_event_id,
            next_outbound_id=durable.first_outbound_id,
            resident_events=len(loaded.snapshot_events) + len(loaded.suffix_events),
            republished=loaded.republished,
            republish_next_seq=durable.republish_next_seq,
        )
    return durable
