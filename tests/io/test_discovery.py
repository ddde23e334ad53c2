"""Discovery backends: one contract suite for memory and file, then backend-specific behaviour."""

from __future__ import annotations

import errno
import json
import os
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import trio

import kvagent.discovery.etcd
from kvagent.discovery import FileDiscovery, MemoryDiscovery, check_discovery_url, open_discovery
from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.discovery.memory import InjectedFailure
from kvagent.model.errors import DiscoveryConflict, DiscoveryError
from kvagent.model.ids import MAX_JSON_SAFE_ID

TOPIC = "kv-state-sources-v2"
OTHER_TOPIC = "kv-state-attachments-v2"


def record(
    record_id: int = 7, topic: str = TOPIC, scope: str = "ws://slot", **metadata: object
) -> DiscoveryRecord:
    return DiscoveryRecord(
        topic, record_id, scope, metadata or {"publisher_id": record_id, "worker": {"id": 1}}
    )


@pytest.fixture(params=["memory", "file"])
def discovery_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield "memory" if request.param == "memory" else f"file:{tmp_path / 'discovery'}"


@pytest.fixture
async def discovery(discovery_url: str) -> AsyncIterator[Discovery]:
    async with open_discovery(discovery_url) as backend:
        yield backend


# -- the contract, for every backend ----------------------------------------------------------------


async def test_register_then_list(discovery: Discovery) -> None:
    first, second, other = record(7), record(3), record(5, topic=OTHER_TOPIC)
    for r in (first, second, other):
        await discovery.register(r)
    assert await discovery.list() == [other, second, first]  # sorted by (topic, record_id)
    assert await discovery.list(TOPIC) == [second, first]
    assert await discovery.list(OTHER_TOPIC) == [other]
    assert await discovery.list("kv-state-hosts-v2") == []


async def test_reregistering_an_equal_payload_is_a_noop(discovery: Discovery) -> None:
    await discovery.register(record(7))
    await discovery.register(record(7))
    assert await discovery.list() == [record(7)]


@pytest.mark.parametrize(
    "changed",
    [
        DiscoveryRecord(TOPIC, 7, "ws://slot", {"publisher_id": 8}),
        DiscoveryRecord(TOPIC, 7, "ws://other-scope", {"publisher_id": 7, "worker": {"id": 1}}),
    ],
    ids=["metadata", "scope"],
)
async def test_a_different_payload_under_the_same_id_conflicts(
    discovery: Discovery, changed: DiscoveryRecord
) -> None:
    await discovery.register(record(7))
    with pytest.raises(DiscoveryConflict):
        await discovery.register(changed)
    assert await discovery.list() == [record(7)]


async def test_the_same_id_on_another_topic_is_another_record(discovery: Discovery) -> None:
    await discovery.register(record(7))
    await discovery.register(record(7, topic=OTHER_TOPIC, note="different"))
    assert len(await discovery.list()) == 2


async def test_unregister(discovery: Discovery) -> None:
    await discovery.register(record(7))
    await discovery.register(record(8))
    await discovery.unregister(TOPIC, 7)
    assert await discovery.list() == [record(8)]
    await discovery.unregister(TOPIC, 7)  # absent: no-op
    await discovery.unregister(OTHER_TOPIC, 8)  # absent on this topic: no-op
    assert await discovery.list() == [record(8)]
    # Once withdrawn, the id may carry a new payload.
    await discovery.register(record(7, note="second incarnation"))
    assert record(7, note="second incarnation") in await discovery.list()


async def test_listed_metadata_is_json_normalized_and_detached(discovery: Discovery) -> None:
    metadata: dict[str, Any] = {"offsets": (1, 2), "nested": {"a": [1]}}
    original = DiscoveryRecord(TOPIC, 1, "s", metadata)
    metadata["nested"]["a"].append(2)  # the caller mutating its dict must not change the record
    await discovery.register(original)
    [listed] = await discovery.list()
    assert listed.metadata == {"offsets": [1, 2], "nested": {"a": [1]}}
    assert listed == original


async def test_unsafe_topics_are_rejected(discovery: Discovery) -> None:
    with pytest.raises(DiscoveryError):
        await discovery.unregister("../escape", 1)
    with pytest.raises(DiscoveryError):
        await discovery.list("a/b")


async def test_closed_backend_refuses_operations(discovery_url: str) -> None:
    async with open_discovery(discovery_url) as backend:
        pass
    with pytest.raises(DiscoveryError):
        await backend.register(record())


# -- DiscoveryRecord ---------------------------------------------------------------------------------


def test_record_json_round_trip() -> None:
    original = record(MAX_JSON_SAFE_ID)
    text = original.to_json()
    assert json.loads(text) == {
        "topic": TOPIC,
        "record_id": MAX_JSON_SAFE_ID,
        "scope": "ws://slot",
        "metadata": {"publisher_id": MAX_JSON_SAFE_ID, "worker": {"id": 1}},
    }
    assert DiscoveryRecord.from_json(text) == original
    assert DiscoveryRecord.from_json(text.encode()) == original
    assert DiscoveryRecord.from_json(original.to_dict()) == original
    assert hash(DiscoveryRecord.from_json(text)) == hash(original)


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        '{"topic": "t", "record_id": 1, "scope": "s"}',
        '{"topic": "t", "record_id": 1, "scope": "s", "metadata": {}, "extra": 1}',
        '{"topic": "t", "record_id": -1, "scope": "s", "metadata": {}}',
        '{"topic": "t", "record_id": 9007199254740992, "scope": "s", "metadata": {}}',
        '{"topic": "t", "record_id": true, "scope": "s", "metadata": {}}',
        '{"topic": "t", "record_id": 1, "scope": "s", "metadata": []}',
        '{"topic": "../t", "record_id": 1, "scope": "s", "metadata": {}}',
    ],
)
def test_malformed_records_raise_discovery_error(text: str) -> None:
    with pytest.raises(DiscoveryError):
        DiscoveryRecord.from_json(text)


def test_metadata_must_be_json() -> None:
    with pytest.raises(DiscoveryError, match="JSON"):
        DiscoveryRecord(TOPIC, 1, "s", {"bad": object()})
    with pytest.raises(DiscoveryError, match="JSON"):
        DiscoveryRecord(TOPIC, 1, "s", {"bad": float("nan")})


# -- open_discovery ----------------------------------------------------------------------------------


async def test_open_discovery_url_forms(tmp_path: Path) -> None:
    async with open_discovery("memory") as memory:
        assert isinstance(memory, MemoryDiscovery)
    for url, directory in (
        (f"file:{tmp_path / 'a'}", tmp_path / "a"),
        (f"file://{tmp_path / 'b'}", tmp_path / "b"),
    ):
        async with open_discovery(url) as backend:
            assert isinstance(backend, FileDiscovery)
            assert backend.directory == directory
            assert directory.is_dir()


@pytest.mark.parametrize("url", ["", "file:", "file://", "zookeeper://x", "etcd://", "memory:"])
async def test_open_discovery_rejects_unknown_urls(url: str) -> None:
    with pytest.raises(ValueError):
        check_discovery_url(url)
    with pytest.raises(ValueError):
        async with open_discovery(url):
            pass


async def test_open_discovery_dispatches_etcd_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    fake = MemoryDiscovery()

    @asynccontextmanager
    async def fake_open(url: str, **options: Any) -> AsyncIterator[MemoryDiscovery]:
        calls.append((url, options))
        yield fake

    monkeypatch.setattr(kvagent.discovery.etcd, "open_etcd_discovery", fake_open)
    async with open_discovery("etcd://127.0.0.1:2379/kv", ttl=3.0) as backend:
        assert backend is fake
    assert calls == [("etcd://127.0.0.1:2379/kv", {"ttl": 3.0})]


# -- memory backend ----------------------------------------------------------------------------------


async def test_memory_fault_injection() -> None:
    backend = MemoryDiscovery()
    backend.fail_next(2)
    with pytest.raises(InjectedFailure):
        await backend.register(record(1))
    with pytest.raises(InjectedFailure):
        await backend.unregister(TOPIC, 1)
    await backend.register(record(1))
    assert [a.failed for a in backend.attempts] == [True, True, False]

    backend.fail_next(1, on=("unregister",))
    await backend.register(record(2))  # not an injected operation
    with pytest.raises(InjectedFailure):
        await backend.unregister(TOPIC, 2)
    await backend.unregister(TOPIC, 2)

    backend.set_failing(True)
    for _ in range(3):
        with pytest.raises(InjectedFailure):
            await backend.register(record(3))
    await backend.list()  # list is not failing unless asked for
    backend.set_failing(False)
    await backend.register(record(3))
    assert set(backend.records) == {(TOPIC, 1), (TOPIC, 3)}
    with pytest.raises(ValueError):
        backend.fail_next(1, on=("frobnicate",))


async def test_memory_wait_for_observes_changes_without_sleeping() -> None:
    backend = MemoryDiscovery()
    seen: list[int] = []

    async def watcher(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        records = await backend.wait_for(lambda records: (TOPIC, 9) in records)
        seen.append(len(records))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(watcher)
            await backend.register(record(1))
            assert seen == []
            await backend.register(record(9))
    assert seen == [2]


# -- file backend ------------------------------------------------------------------------------------


async def test_file_layout_is_one_json_file_per_record(tmp_path: Path) -> None:
    backend = FileDiscovery(tmp_path)
    await backend.register(record(7))
    path = tmp_path / TOPIC / "7.json"
    assert DiscoveryRecord.from_json(path.read_bytes()) == record(7)
    assert [p.name for p in (tmp_path / TOPIC).iterdir()] == ["7.json"]  # no temporary files left behind
    await backend.unregister(TOPIC, 7)
    assert not path.exists()


async def test_file_list_skips_stray_and_partial_files(tmp_path: Path) -> None:
    backend = FileDiscovery(tmp_path)
    await backend.register(record(7))
    directory = tmp_path / TOPIC
    good = (directory / "7.json").read_text()
    (directory / "8.json").write_text(good[: len(good) // 2])  # a torn write from some other tool
    (directory / "9.json").write_text(good)  # a complete record stored under the wrong id
    (directory / ".10.json.abc.tmp").write_text(good[:5])  # an in-flight write: hidden, never parsed
    (directory / "notes.txt").write_text("hello")
    (tmp_path / "stray-file").write_text("x")  # not a topic directory
    with structlog.testing.capture_logs() as logs:
        assert await backend.list() == [record(7)]
        assert await backend.list(TOPIC) == [record(7)]
    assert [(e["event"], e["log_level"]) for e in logs] == [("discovery_record_file_skipped", "warning")] * 4
    skipped = [e["error"] for e in logs]
    assert any("8.json" in m for m in skipped) and any("9.json" in m for m in skipped)
    # Registering over an unparsable file is refused rather than silently overwritten.
    with pytest.raises(DiscoveryError):
        await backend.register(record(8))


async def test_file_backend_without_hard_links_falls_back_to_replace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(source: object, target: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    backend = FileDiscovery(tmp_path)
    await backend.register(record(7))
    await backend.register(record(7))
    with pytest.raises(DiscoveryConflict):
        await backend.register(record(7, note="changed"))
    assert await backend.list() == [record(7)]
    assert [p.name for p in (tmp_path / TOPIC).iterdir()] == ["7.json"]


async def test_file_list_of_missing_directory_is_empty(tmp_path: Path) -> None:
    assert await FileDiscovery(tmp_path / "nowhere").list() == []
    assert await FileDiscovery(tmp_path / "nowhere").list(TOPIC) == []


WRITER = textwrap.dedent(
    """
    import sys
    import trio
    from kvagent.discovery.base import DiscoveryConflict, DiscoveryRecord
    from kvagent.discovery.file import FileDiscovery

    async def main(directory, writer, count):
        backend = FileDiscovery(directory)
        for i in range(count):
            # Large enough that a non-atomic write would be caught half-done by the reader.
            metadata = {"writer": writer, "i": i, "pad": "x" * 4000}
            await backend.register(DiscoveryRecord("race", writer * 100_000 + i, "s", metadata))
        try:
            await backend.register(DiscoveryRecord("race", 1, "s", {"winner": writer}))
            print("won")
        except DiscoveryConflict:
            print("conflict")

    trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    """
)


async def test_file_backend_is_safe_across_processes(tmp_path: Path) -> None:
    count = 120
    directory = tmp_path / "shared"
    directory.mkdir()
    reader = FileDiscovery(directory)
    outputs: dict[int, bytes] = {}
    done = trio.Event()
    scans = partial_views = 0

    async def write(writer: int) -> None:
        result = await trio.run_process(
            [sys.executable, "-c", WRITER, str(directory), str(writer), str(count)], capture_stdout=True
        )
        outputs[writer] = result.stdout

    def raw_scan() -> int:
        """Parse every visible record file directly: a partially written one would fail here."""
        topic = directory / "race"
        if not topic.is_dir():
            return 0
        visible = 0
        for path in topic.iterdir():
            if path.name.startswith("."):
                continue
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            DiscoveryRecord.from_json(data)  # raises on a torn file
            visible += 1
        return visible

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def writers() -> None:
                async with trio.open_nursery() as inner:
                    inner.start_soon(write, 1)
                    inner.start_soon(write, 2)
                done.set()

            nursery.start_soon(writers)
            while not done.is_set():
                visible = await trio.to_thread.run_sync(raw_scan)
                listed = await reader.list("race")
                for r in listed:
                    if r.record_id != 1:
                        writer, i = divmod(r.record_id, 100_000)
                        assert r.metadata == {"writer": writer, "i": i, "pad": "x" * 4000}
                scans += 1
                partial_views += 0 < visible < 2 * count
    final = await reader.list("race")
    assert len(final) == 2 * count + 1
    # Exactly one writer won the contested id; the other saw a conflict instead of overwriting it.
    assert sorted(outputs.values()) == [b"conflict\n", b"won\n"]
    [contested] = [r for r in final if r.record_id == 1]
    winner = 1 if outputs[1] == b"won\n" else 2
    assert contested.metadata == {"winner": winner}
    assert partial_views > 0, f"the reader never overlapped the writers ({scans} scans)"
