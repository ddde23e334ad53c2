"""A single owner per slot (issue 19): every discovery backend refuses a second claim of one CacheOwnerId.

Memory: a dict in one process.  File: an flock on ``DIR/.owners/<CacheOwnerId>.lock``, tried across two real
processes.  etcd: a key on the holder's lease, tried against a real etcd, including a holder killed with
SIGKILL (its claim expires with its lease).  And through ``kvagent serve``: a second process serving the same
slot is refused before it advertises anything.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent import SlotAgentConfig
from kvagent.agent.host import SlotStateKind, open_host
from kvagent.discovery import FileDiscovery, MemoryDiscovery, open_discovery
from kvagent.discovery.base import DiscoveryRecord
from kvagent.discovery.etcd import EtcdDiscovery, open_etcd_discovery
from kvagent.discovery.file import owner_lock_path
from kvagent.discovery.ownership import SlotClaim, SlotHolder, SlotOwnership, claim_slot
from kvagent.model.errors import DiscoveryError, KvAgentError, SlotOwnershipError
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC, KV_STATE_SOURCES_TOPIC
from kvagent.model.ids import CacheOwnerId, derive_cache_owner_id
from tests.io.test_etcd import lease_ttl, raw_get, revoke
from tests.support.agent import XpubEngine, attach, batch, gpu_store, is_store_of, wait_for_event
from tests.support.etcd_server import EtcdEndpoint
from tests.support.serve import serve

OWNER_A = str(derive_cache_owner_id("gpu0", kv_block_size=16))
OWNER_B = str(derive_cache_owner_id("gpu1", kv_block_size=16))


async def claim(
    discovery: object, slot: str = "gpu0", owner: str = OWNER_A, url: str = "ws://h:1"
) -> SlotClaim:
    return await claim_slot(discovery, slot=slot, cache_owner_id=owner, url=url)


def assert_one_line_refusal(error: SlotOwnershipError, slot: str) -> None:
    message = str(error)
    assert error.code == "slot_owned"
    assert "\n" not in message
    assert f"slot {slot!r}" in message
    assert " pid " in message
    assert "stop it or" in message


# -- every backend: the contract ------------------------------------------------------------------------


@pytest.fixture(params=["memory", "file"])
async def local_discovery(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SlotOwnership]:
    url = "memory" if request.param == "memory" else f"file:{tmp_path / 'discovery'}"
    async with open_discovery(url) as discovery:
        assert isinstance(discovery, SlotOwnership)
        yield discovery


async def test_a_second_claim_is_refused_until_the_first_is_released(local_discovery: SlotOwnership) -> None:
    first = await claim(local_discovery, url="ws://first:1/v1/slots/gpu0")
    with pytest.raises(SlotOwnershipError) as refused:
        await claim(local_discovery, url="ws://second:2/v1/slots/gpu0")
    assert_one_line_refusal(refused.value, "gpu0")
    assert "ws://first:1/v1/slots/gpu0" in str(refused.value)  # the holder, not the refused one
    assert "ws://second" not in str(refused.value)
    other = await claim(local_discovery, slot="gpu1", owner=OWNER_B)  # another CacheOwnerId is free
    await first.release()
    await first.release()  # idempotent
    again = await claim(local_discovery, url="ws://second:2/v1/slots/gpu0")
    await again.release()
    await other.release()


async def test_the_claim_is_keyed_by_cache_owner_id_not_by_name(local_discovery: SlotOwnership) -> None:
    held = await claim(local_discovery, slot="gpu0")
    with pytest.raises(SlotOwnershipError) as refused:
        await claim(local_discovery, slot="renamed", owner=OWNER_A)
    message = str(refused.value)
    assert "slot 'renamed' has the CacheOwnerId of slot 'gpu0'" in message
    assert "--cache-owner-id" in message
    # The same name under another CacheOwnerId (another model's gpu0) is not a collision.
    other_model = await claim(local_discovery, slot="gpu0", owner=OWNER_B)
    await other_model.release()
    await held.release()


async def test_memory_claims_are_visible_and_closed_backends_refuse() -> None:
    discovery = MemoryDiscovery()
    held = await claim(discovery)
    assert set(discovery.owners) == {OWNER_A}
    assert discovery.owners[OWNER_A].slot == "gpu0"
    assert discovery.attempts == []  # claims are not Discovery calls (tests count those)
    await held.release()
    assert discovery.owners == {}
    await discovery.aclose()
    with pytest.raises(DiscoveryError, match="closed"):
        await claim(discovery)


async def test_a_backend_without_claims_gets_a_no_op_claim() -> None:
    class PlainDiscovery:  # a custom Discovery without claim_slot
        pass

    released = await claim(PlainDiscovery())
    await released.release()


def test_holder_text_round_trips_and_garbage_is_an_unknown_holder() -> None:
    holder = SlotHolder.of_this_process("gpu 0/ü", OWNER_A, None)
    assert SlotHolder.from_json(holder.to_json()) == holder
    assert holder.describe().endswith(f"pid {os.getpid()}")
    for garbage in (
        b"",
        b"{",
        b"[]",
        b'{"slot": 1}',
        b'{"slot":"s","cache_owner_id":"o","hostname":"h","pid":"x"}',
    ):
        assert SlotHolder.from_json(garbage) is None


CLAIM_OPS = st.lists(
    st.tuples(st.sampled_from(["claim", "release"]), st.integers(0, 2), st.integers(0, 1), st.integers(0, 1)),
    max_size=25,
)
OWNERS = (OWNER_A, OWNER_B)


async def run_claims_against_a_model(
    backends: list[SlotOwnership], ops: list[tuple[str, int, int, int]]
) -> None:
    """Claimant ``c`` (a backend of its own: another "process") claims or releases ``OWNERS[o]`` under slot
    name ``n``; the model is a dict owner -> claimant, and a refusal must name the model's holder."""
    model: dict[str, tuple[int, str]] = {}
    held: dict[tuple[int, str], SlotClaim] = {}
    for op, claimant, owner_index, name_index in ops:
        owner, name = OWNERS[owner_index], f"slot{name_index}"
        backend = backends[claimant % len(backends)]
        if op == "claim":
            try:
                claim_ = await claim(backend, slot=name, owner=owner, url=f"ws://c{claimant}:1")
            except SlotOwnershipError as error:
                assert owner in model, f"refused a free CacheOwnerId: {error}"
                assert f"ws://c{model[owner][0]}:1" in str(error)
                continue
            assert owner not in model, "a held CacheOwnerId was claimed twice"
            model[owner] = (claimant, name)
            held[(claimant, owner)] = claim_
        elif (claimant, owner) in held:
            await held.pop((claimant, owner)).release()
            del model[owner]
    for claim_ in held.values():
        await claim_.release()


@settings(max_examples=40, deadline=None)
@given(ops=CLAIM_OPS)
def test_memory_claims_follow_a_dict_model(ops: list[tuple[str, int, int, int]]) -> None:
    backends: list[SlotOwnership] = [MemoryDiscovery()]  # one process: its claimants share the backend
    trio.run(run_claims_against_a_model, backends, ops)


@settings(max_examples=40, deadline=None)
@given(ops=CLAIM_OPS)
def test_file_claims_follow_a_dict_model(ops: list[tuple[str, int, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        backends: list[SlotOwnership] = [FileDiscovery(directory) for _ in range(3)]
        trio.run(run_claims_against_a_model, backends, ops)


# -- host: the claim comes before the state file and every advertisement ----------------------------------


def slot_config(name: str, owner: str | None = None, state_path: Path | None = None) -> SlotAgentConfig:
    return SlotAgentConfig(
        name=name,
        cache_owner_id=CacheOwnerId.parse(owner or str(derive_cache_owner_id(name, kv_block_size=16))),
        kv_block_size=16,
        recovery_url=f"ws://127.0.0.1:1/v1/slots/{name}",
        state_path=state_path,
    )


async def test_host_refuses_a_slot_whose_cache_owner_is_served_before_it_opens_or_advertises(
    tmp_path: Path,
) -> None:
    discovery = MemoryDiscovery()
    async with open_host(discovery=discovery) as host:
        await host.add_slot(slot_config("a"))
        records_before = discovery.records
        assert set(discovery.owners) == {str(derive_cache_owner_id("a", kv_block_size=16))}
        state_path = tmp_path / "b.kvstate"
        twin = slot_config(
            "b", owner=str(derive_cache_owner_id("a", kv_block_size=16)), state_path=state_path
        )
        with pytest.raises(SlotOwnershipError) as refused:
            await host.add_slot(twin)
        assert "slot 'b' has the CacheOwnerId of slot 'a'" in str(refused.value)
        assert host.states["b"].kind is SlotStateKind.FAILED
        assert host.states["a"].kind is SlotStateKind.RUNNING
        assert discovery.records == records_before  # nothing of b's was advertised
        assert not state_path.exists()  # and its state file was never opened
        await host.remove_slot("a")
        assert discovery.owners == {}  # released on a clean stop
        await host.add_slot(twin)  # now free
    assert discovery.owners == {} and discovery.records == {}


# -- file backend -----------------------------------------------------------------------------------------


async def test_file_claims_in_one_process_conflict_across_descriptors(tmp_path: Path) -> None:
    first, second = FileDiscovery(tmp_path), FileDiscovery(tmp_path)
    held = await claim(first, url="ws://holder:9/v1/slots/gpu0")
    lock = owner_lock_path(tmp_path, OWNER_A)
    assert lock.parent.name == ".owners" and lock.exists()
    assert SlotHolder.from_json(lock.read_bytes()) is not None
    with pytest.raises(SlotOwnershipError) as refused:
        await claim(second)
    assert_one_line_refusal(refused.value, "gpu0")
    assert f"lock {lock}" in str(refused.value) and "ws://holder:9" in str(refused.value)
    assert await first.list() == []  # the owners directory is hidden from listing
    await held.release()
    assert lock.read_bytes() == b""  # no stale holder text after release (the file stays: see _claim_sync)
    held = await claim(second)
    await second.aclose()  # closing the backend gives its claims up too
    await (await claim(first)).release()
    del held


CLAIMING_CHILD = """
import sys, trio
from kvagent.discovery import open_discovery
from kvagent.discovery.ownership import claim_slot

async def main():
    async with open_discovery(sys.argv[1], **({"ttl": 2} if sys.argv[1].startswith("etcd") else {})) as d:
        await claim_slot(d, slot="gpu0", cache_owner_id=sys.argv[2], url="ws://child:7/v1/slots/gpu0")
        print("ready", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@asynccontextmanager
async def claiming_child(url: str) -> AsyncIterator[trio.Process]:
    """A separate process holding the gpu0 claim in ``url`` until killed."""
    child = await trio.lowlevel.open_process(
        [sys.executable, "-c", CLAIMING_CHILD, url, OWNER_A], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        output = b""
        with trio.fail_after(30):
            while b"ready\n" not in output:
                chunk = await child.stdout.receive_some()
                assert chunk, f"child exited before claiming: {output!r}"
                output += chunk
        yield child
    finally:
        if child.returncode is None:
            child.kill()
            with trio.move_on_after(5, shield=True):
                await child.wait()


async def test_file_claim_of_another_process_is_refused_and_freed_when_it_dies(tmp_path: Path) -> None:
    async with claiming_child(f"file:{tmp_path}") as child:
        with pytest.raises(SlotOwnershipError) as refused:
            await claim(FileDiscovery(tmp_path))
        assert f"pid {child.pid}" in str(refused.value) and "ws://child:7" in str(refused.value)
        child.send_signal(signal.SIGKILL)  # no clean release: the kernel drops the lock with the process
        await child.wait()
    held = await claim(FileDiscovery(tmp_path))
    await held.release()


# -- file backend on a read-only or full file system (a tmpfs of our own; needs mount rights) --------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs; skipped where this process may not mount (not root, no CAP_SYS_ADMIN)."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> None:
    """Write until the file system is full (ENOSPC); unbuffered, so nothing is left to flush at close."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def remount_read_only(mount_point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)


def record(record_id: int = 5) -> DiscoveryRecord:
    return DiscoveryRecord("kv-state-sources-v2", record_id, "ws://slot", {"publisher_id": record_id})


def assert_one_line(error: KvAgentError, *fragments: str) -> None:
    message = str(error)
    assert "\n" not in message and "Traceback" not in message
    for fragment in fragments:
        assert fragment in message, message


async def test_file_discovery_on_an_unusable_path_fails_with_one_line(tmp_path: Path) -> None:
    """Needs no mount rights: the discovery "directory" is a regular file."""
    not_a_directory = tmp_path / "discovery"
    not_a_directory.write_text("")
    discovery = FileDiscovery(not_a_directory)
    with pytest.raises(DiscoveryError) as claimed:
        await claim(discovery)
    assert_one_line(claimed.value, "could not claim slot 'gpu0'", "Not a directory", str(not_a_directory))
    with pytest.raises(DiscoveryError) as registered:
        await discovery.register(record())
    assert_one_line(registered.value, "could not write record 5", "Not a directory", str(not_a_directory))


async def test_file_discovery_on_a_read_only_directory_fails_with_one_line(tiny_tmpfs: Path) -> None:
    directory = tiny_tmpfs / "discovery"
    directory.mkdir()
    remount_read_only(tiny_tmpfs)
    async with open_discovery(f"file:{directory}") as discovery:
        with pytest.raises(DiscoveryError) as claimed:
            await claim(discovery)
        assert not isinstance(claimed.value, SlotOwnershipError)
        assert_one_line(claimed.value, "could not claim slot 'gpu0'", str(directory), "Read-only file system")
        with pytest.raises(DiscoveryError) as registered:
            await discovery.register(record())
        assert_one_line(registered.value, "could not write record 5", "Read-only file system", str(directory))


async def test_file_discovery_on_a_full_disk_fails_with_one_line(tiny_tmpfs: Path) -> None:
    directory = tiny_tmpfs / "discovery"
    async with open_discovery(f"file:{directory}") as discovery:
        await discovery.register(record(1))
        held = await claim(discovery)  # before the disk fills up
        fill(tiny_tmpfs)
        with pytest.raises(DiscoveryError) as registered:
            await discovery.register(record(2))
        assert_one_line(
            registered.value, "could not write record 2", "No space left on device", str(directory)
        )
        assert await discovery.list() == [record(1)]  # nothing half-written became visible
        await held.release()
        (tiny_tmpfs / "filler").unlink()
        await discovery.register(record(2))
        assert await discovery.list() == [record(1), record(2)]


async def test_a_claim_on_a_full_disk_fails_with_one_line(tiny_tmpfs: Path) -> None:
    directory = tiny_tmpfs / "discovery"
    (directory / ".owners").mkdir(parents=True)
    fill(tiny_tmpfs)
    discovery = FileDiscovery(directory)
    with pytest.raises(DiscoveryError) as claimed:
        await claim(discovery)
    assert not isinstance(claimed.value, SlotOwnershipError)
    assert_one_line(claimed.value, "could not claim slot 'gpu0'", "No space left on device")
    (tiny_tmpfs / "filler").unlink()
    await (await claim(discovery)).release()


# -- etcd backend ----------------------------------------------------------------------------------------


@asynccontextmanager
async def etcd_at(endpoint: EtcdEndpoint, ttl: float = 10) -> AsyncIterator[EtcdDiscovery]:
    async with open_etcd_discovery(endpoint.discovery_url, ttl=ttl) as discovery:
        yield discovery


@pytest.mark.etcd
async def test_etcd_claim_is_a_key_on_the_holders_lease_and_refuses_a_second_process(
    etcd_endpoint: EtcdEndpoint,
) -> None:
    async with etcd_at(etcd_endpoint) as first, etcd_at(etcd_endpoint) as second:
        held = await claim(first, url="ws://first:1/v1/slots/gpu0")
        key = first.owner_key(OWNER_A)
        assert key == f"{etcd_endpoint.prefix}/owners/{OWNER_A}"
        stored = await raw_get(etcd_endpoint, key)
        assert stored is not None and int(stored["lease"]) == first.lease_id
        assert SlotHolder.from_json(stored["value"].encode()) is not None
        with pytest.raises(SlotOwnershipError) as refused:
            await claim(second)
        assert_one_line_refusal(refused.value, "gpu0")
        assert "ws://first:1" in str(refused.value) and f"etcd key {key}" in str(refused.value)
        with pytest.raises(SlotOwnershipError, match="in this process"):
            await claim(first)
        assert await first.list() == []  # claims are not records
        await held.release()
        assert await raw_get(etcd_endpoint, key) is None
        taken = await claim(second)
        stored = await raw_get(etcd_endpoint, key)
        assert stored is not None and int(stored["lease"]) == second.lease_id
        await held.release()  # a stale release never deletes the successor's claim
        assert await raw_get(etcd_endpoint, key) is not None
        await taken.release()


@pytest.mark.etcd
async def test_etcd_claim_goes_with_the_lease_on_close(etcd_endpoint: EtcdEndpoint) -> None:
    async with etcd_at(etcd_endpoint) as first:
        held = await claim(first)
        key = first.owner_key(OWNER_A)
    assert await raw_get(etcd_endpoint, key) is None  # revoked with the lease on a clean stop
    await held.release()  # after close: a no-op
    async with etcd_at(etcd_endpoint) as second:
        await (await claim(second)).release()


@pytest.mark.etcd
async def test_etcd_claim_follows_a_regranted_lease(etcd_endpoint: EtcdEndpoint) -> None:
    async with etcd_at(etcd_endpoint, ttl=2) as discovery:
        held = await claim(discovery)
        old_lease = discovery.lease_id
        assert old_lease is not None
        await revoke(etcd_endpoint, old_lease)  # etcd deletes the claim with the lease
        with trio.fail_after(10):
            await discovery.wait_for_statistics(lambda c: c.recoveries >= 1)
        stored = await raw_get(etcd_endpoint, discovery.owner_key(OWNER_A))
        assert stored is not None and int(stored["lease"]) == discovery.lease_id != old_lease
        await held.release()


@pytest.mark.etcd
async def test_etcd_claim_lost_while_the_lease_was_gone_is_not_taken_back(
    etcd_endpoint: EtcdEndpoint,
) -> None:
    async with etcd_at(etcd_endpoint, ttl=2) as first, etcd_at(etcd_endpoint) as second:
        await claim(first, url="ws://first:1")
        old_lease = first.lease_id
        assert old_lease is not None
        await revoke(etcd_endpoint, old_lease)
        successor = await claim(second, url="ws://second:2")  # the slot was free in between
        with trio.fail_after(10):
            await first.wait_for_statistics(lambda c: c.recoveries >= 1)
        stored = await raw_get(etcd_endpoint, first.owner_key(OWNER_A))
        assert stored is not None and "ws://second:2" in stored["value"]
        await successor.release()


@pytest.mark.etcd
async def test_etcd_claim_of_a_killed_process_expires_with_its_lease(etcd_endpoint: EtcdEndpoint) -> None:
    async with etcd_at(etcd_endpoint) as discovery:
        async with claiming_child(etcd_endpoint.discovery_url) as child:
            with pytest.raises(SlotOwnershipError) as refused:
                await claim(discovery)
            assert f"pid {child.pid}" in str(refused.value)
            stored = await raw_get(etcd_endpoint, discovery.owner_key(OWNER_A))
            assert stored is not None and await lease_ttl(etcd_endpoint, int(stored["lease"])) > 0
            child.send_signal(signal.SIGKILL)
            await child.wait()
        # Only the lease (TTL 2 s) can free it now: poll the real claim, bounded.
        with trio.fail_after(2 + 5):
            while True:
                try:
                    held = await claim(discovery)
                    break
                except SlotOwnershipError:
                    await trio.sleep(0.2)
        await held.release()


# -- through `kvagent serve`: a second process for the same slot ----------------------------------------


async def run_second_serve(tmp_path: Path, discovery_url: str) -> subprocess.CompletedProcess[bytes]:
    command = [
        sys.executable,
        "-m",
        "kvagent.cli.main",
        "serve",
        "--slot",
        "s0",
        "--simulate",
        "--listen",
        "127.0.0.1:0",
        "--discovery",
        discovery_url,
        "--token-file",
        str(tmp_path / "second-token"),
        "--state-dir",
        str(tmp_path / "second-state"),
    ]
    with trio.fail_after(60):
        return await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)


@pytest.mark.parametrize("backend", ["file", pytest.param("etcd", marks=pytest.mark.etcd)])
async def test_a_second_serve_of_the_same_slot_is_refused(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "etcd":
        endpoint: EtcdEndpoint = request.getfixturevalue("etcd_endpoint")
        url = endpoint.discovery_url
    else:
        url = f"file:{tmp_path / 'discovery'}"
    async with serve(tmp_path, "--slot", "s0", "--simulate", "--discovery", url) as first:
        second = await run_second_serve(tmp_path, url)
        assert second.returncode != 0
        stderr = second.stderr.decode()
        assert "slot 's0' is already served by" in stderr, stderr
        assert f"pid {first.process.pid}" in stderr and first.url in stderr
        assert "stop it or choose another --slot" in stderr
        assert first.process.poll() is None  # the holder keeps serving
        assert not (tmp_path / "second-state" / "slots" / "s0.sqlite3").exists()  # refused before opening it
        first.process.send_signal(signal.SIGTERM)  # a clean stop releases the claim
        with trio.fail_after(30):
            await first.process.wait()
    async with serve(tmp_path, "--slot", "s0", "--simulate", "--discovery", url) as successor:
        assert successor.process.poll() is None


async def test_a_full_disk_while_running_refuses_the_advertisement_and_the_slot_keeps_serving(
    tiny_tmpfs: Path,
) -> None:
    context: zmq.Context[Any] = zmq.Context()
    discovery = FileDiscovery(tiny_tmpfs / "discovery")
    try:
        with trio.fail_after(30):
            async with open_host(discovery=discovery, zmq_context=context) as host:
                agent = await host.add_slot(slot_config("s"))
                assert [r.topic for r in await discovery.list()] == [KV_STATE_SOURCES_TOPIC]
                fill(tiny_tmpfs)
                refused_engine = XpubEngine(context)
                refused: list[BaseException] = []
                try:
                    await attach(agent, refused_engine)  # its ad cannot be written: attach is rolled back
                except* KvAgentError as group:
                    refused.extend(group.exceptions)
                assert len(refused) == 1 and "failed to advertise" in str(refused[0])
                cause = refused[0].__cause__
                assert isinstance(cause, DiscoveryError)
                assert_one_line(cause, "could not write record", "No space left on device")
                refused_engine.close()
                assert host.states["s"].kind is SlotStateKind.RUNNING  # the process keeps serving
                assert agent.status().attachment is None
                (tiny_tmpfs / "filler").unlink()
                engine = XpubEngine(context)
                await attach(agent, engine)
                assert KV_STATE_ATTACHMENTS_TOPIC in [r.topic for r in await discovery.list()]
                await engine.send_payload(batch([gpu_store([5], block_size=16)]))
                await wait_for_event(agent, is_store_of(5))
                engine.close()
    finally:
        context.destroy(linger=0)
