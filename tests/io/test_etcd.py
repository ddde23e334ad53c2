"""The etcd discovery backend against a real etcd server (see tests/etcd_server.py for where it comes from)."""

from __future__ import annotations

import base64
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import zmq

from kvagent import SlotAgentConfig
from kvagent.agent.host import open_host
from kvagent.discovery import open_discovery
from kvagent.discovery.base import DiscoveryRecord
from kvagent.discovery.etcd import (
    EtcdDiscovery,
    EtcdTarget,
    WatchEvent,
    open_etcd_discovery,
    parse_etcd_url,
)
from kvagent.model.errors import DiscoveryConflict, DiscoveryError
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC
from kvagent.model.ids import attachment_record_id
from kvagent.recovery.client import connect_slot
from kvagent.recovery.server import RecoveryServerInfo, serve_recovery
from tests.support.agent import XpubEngine, attach
from tests.support.etcd_server import EtcdEndpoint, PrivateEtcd, _free_ports
from tests.support.ids import OWNER

pytestmark = pytest.mark.etcd

SOURCES = "kv-state-sources-v2"
ATTACHMENTS = "kv-state-attachments-v2"


def record(record_id: int, topic: str = SOURCES, **metadata: object) -> DiscoveryRecord:
    return DiscoveryRecord(
        topic, record_id, "ns/component/kv_state_endpoint", {"publisher_id": record_id, **metadata}
    )


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def raw_get(endpoint: EtcdEndpoint, key: str) -> dict[str, Any] | None:
    """The etcd kv for ``key`` (value as text), read behind the backend's back."""
    async with httpx.AsyncClient(timeout=3) as client:
        response = await client.post(f"{endpoint.client_url}/v3/kv/range", json={"key": b64(key)})
    kvs = response.json().get("kvs", [])
    if not kvs:
        return None
    kv: dict[str, Any] = kvs[0]
    return {**kv, "value": base64.b64decode(kv["value"]).decode()}


async def raw_put(endpoint: EtcdEndpoint, key: str, value: str) -> None:
    async with httpx.AsyncClient(timeout=3) as client:
        response = await client.post(
            f"{endpoint.client_url}/v3/kv/put", json={"key": b64(key), "value": b64(value)}
        )
    response.raise_for_status()


async def lease_ttl(endpoint: EtcdEndpoint, lease: int) -> int:
    """Seconds left on ``lease`` according to etcd (-1 once it is gone)."""
    async with httpx.AsyncClient(timeout=3) as client:
        response = await client.post(f"{endpoint.client_url}/v3/lease/timetolive", json={"ID": str(lease)})
    return int(response.json().get("TTL", 0))


async def revoke(endpoint: EtcdEndpoint, lease: int) -> None:
    async with httpx.AsyncClient(timeout=3) as client:
        response = await client.post(f"{endpoint.client_url}/v3/lease/revoke", json={"ID": str(lease)})
    response.raise_for_status()


def record_key(endpoint: EtcdEndpoint, rec: DiscoveryRecord) -> str:
    return f"{endpoint.prefix}/v2/{rec.topic}/{rec.record_id}"


@asynccontextmanager
async def discovery_at(endpoint: EtcdEndpoint, **options: Any) -> AsyncIterator[EtcdDiscovery]:
    async with open_etcd_discovery(endpoint.discovery_url, **options) as discovery:
        yield discovery


# -- URL parsing (no server) -------------------------------------------------------------------------


def test_parse_etcd_url_defaults_and_members() -> None:
    assert parse_etcd_url("etcd://127.0.0.1:23790") == EtcdTarget(
        ("http://127.0.0.1:23790",), "/kvagent", False
    )
    assert parse_etcd_url("etcds://a:1,b,[::1]:3/team/kv/") == EtcdTarget(
        ("https://a:1", "https://b:2379", "https://[::1]:3"), "/team/kv", True
    )
    for bad in ("http://a:1", "etcd://", "etcd://a:1,,b:2", "etcd://a:notaport"):
        with pytest.raises(ValueError):
            parse_etcd_url(bad)


# -- register / list / unregister ----------------------------------------------------------------------


async def test_register_list_unregister_round_trip(etcd_endpoint: EtcdEndpoint) -> None:
    source, attachment = record(1), record(2, ATTACHMENTS, generation=3)
    async with discovery_at(etcd_endpoint) as discovery:
        assert await discovery.list() == []
        await discovery.register(attachment)
        await discovery.register(source)
        assert await discovery.list() == [attachment, source]  # ordered by (topic, record_id)
        assert await discovery.list(SOURCES) == [source]
        await discovery.unregister(SOURCES, 1)
        assert await discovery.list() == [attachment]
        await discovery.unregister(SOURCES, 1)  # absent: no-op
        await discovery.unregister(SOURCES, 99)
        assert await discovery.list() == [attachment]


async def test_key_layout_value_and_lease(etcd_endpoint: EtcdEndpoint) -> None:
    rec = record(2**53 - 1, ATTACHMENTS, nested={"a": [1, 2]})
    async with discovery_at(etcd_endpoint) as discovery:
        await discovery.register(rec)
        stored = await raw_get(etcd_endpoint, f"{etcd_endpoint.prefix}/v2/{ATTACHMENTS}/{2**53 - 1}")
        assert stored is not None
        assert stored["value"] == rec.to_json()
        assert int(stored["lease"]) == discovery.lease_id


async def test_register_is_idempotent_and_refuses_a_different_payload(etcd_endpoint: EtcdEndpoint) -> None:
    rec = record(5)
    async with discovery_at(etcd_endpoint) as discovery:
        await discovery.register(rec)
        before = await raw_get(etcd_endpoint, record_key(etcd_endpoint, rec))
        await discovery.register(record(5))  # equal payload, separately built
        after = await raw_get(etcd_endpoint, record_key(etcd_endpoint, rec))
        assert before is not None and after is not None
        assert after["mod_revision"] == before["mod_revision"]  # a true no-op: no new revision
        with pytest.raises(DiscoveryConflict):
            await discovery.register(record(5, changed=True))
        assert await discovery.list() == [rec]


async def test_conflict_with_another_process_record(etcd_endpoint: EtcdEndpoint) -> None:
    async with discovery_at(etcd_endpoint) as first, discovery_at(etcd_endpoint) as second:
        await first.register(record(8))
        with pytest.raises(DiscoveryConflict):
            await second.register(record(8, other=1))
        await second.register(record(8))  # identical payload from another process is accepted
        assert await first.list() == [record(8)]


async def test_foreign_and_corrupt_values_are_skipped(etcd_endpoint: EtcdEndpoint) -> None:
    root = f"{etcd_endpoint.prefix}/v2/{SOURCES}"
    await raw_put(etcd_endpoint, f"{root}/5", "not json")
    await raw_put(etcd_endpoint, f"{root}/not-an-id", record(6).to_json())
    await raw_put(etcd_endpoint, f"{root}/7", record(8).to_json())  # says id 8 but sits at id 7
    async with discovery_at(etcd_endpoint) as discovery:
        await discovery.register(record(9))
        assert await discovery.list() == [record(9)]
        with pytest.raises(DiscoveryConflict):  # an unreadable value is still not ours to overwrite
            await discovery.register(record(5))


async def test_closing_revokes_the_lease(etcd_endpoint: EtcdEndpoint) -> None:
    async with discovery_at(etcd_endpoint) as observer:
        async with discovery_at(etcd_endpoint) as discovery:
            await discovery.register(record(1))
            lease = discovery.lease_id
            assert lease is not None
        assert await observer.list() == []
        assert await lease_ttl(etcd_endpoint, lease) == -1
        with pytest.raises(DiscoveryError):
            await discovery.register(record(2))


async def test_open_discovery_dispatches_etcd_urls(etcd_endpoint: EtcdEndpoint) -> None:
    async with open_discovery(etcd_endpoint.discovery_url, ttl=5) as discovery:
        assert isinstance(discovery, EtcdDiscovery)
        await discovery.register(record(3))
        assert await discovery.list(SOURCES) == [record(3)]


# -- fencing -------------------------------------------------------------------------------------------


async def test_fenced_delete_spares_a_newer_value(etcd_endpoint: EtcdEndpoint) -> None:
    rec = record(11)
    async with discovery_at(etcd_endpoint) as discovery:
        await discovery.register(rec)
        read = await discovery.read(SOURCES, 11)
        assert read is not None and read[0] == rec
        newer = record(11, by="another writer").to_json()
        await raw_put(etcd_endpoint, record_key(etcd_endpoint, rec), newer)
        assert await discovery.delete_if_unchanged(SOURCES, 11, read[1]) is False
        stored = await raw_get(etcd_endpoint, record_key(etcd_endpoint, rec))
        assert stored is not None and stored["value"] == newer
        current = await discovery.read(SOURCES, 11)
        assert current is not None
        assert await discovery.delete_if_unchanged(SOURCES, 11, current[1]) is True
        assert await discovery.list() == []


async def test_unregister_racing_another_writer_does_not_delete_its_value(
    etcd_endpoint: EtcdEndpoint,
) -> None:
    """Another writer replaces the value between unregister's read and its delete (injected with an
    httpx request hook, so the race is exact): the delete is fenced off and the newer value survives."""
    rec = record(12)
    newer = record(12, by="another writer").to_json()
    raced = trio.Event()

    async def replace_before_delete(request: httpx.Request) -> None:
        if (
            request.url.path == "/v3/kv/txn"
            and b"request_delete_range" in request.content
            and not raced.is_set()
        ):
            raced.set()
            await raw_put(etcd_endpoint, record_key(etcd_endpoint, rec), newer)

    async with (
        httpx.AsyncClient(event_hooks={"request": [replace_before_delete]}) as client,
        discovery_at(etcd_endpoint, client=client) as discovery,
    ):
        await discovery.register(rec)
        await discovery.unregister(SOURCES, 12)
        assert raced.is_set()
        stored = await raw_get(etcd_endpoint, record_key(etcd_endpoint, rec))
        assert stored is not None and stored["value"] == newer
        # (Stale generations at the record-id level are the attachment advertiser's generation fence, not this one.)


# -- leases --------------------------------------------------------------------------------------------

CHILD = """
import sys, trio
from kvagent.discovery.base import DiscoveryRecord
from kvagent.discovery.etcd import open_etcd_discovery

async def main():
    async with open_etcd_discovery(sys.argv[1], ttl=2) as discovery:
        await discovery.register(DiscoveryRecord(sys.argv[2], 77, "child", {"pid": 1}))
        print("ready", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_record_of_a_killed_process_expires_with_its_lease(etcd_endpoint: EtcdEndpoint) -> None:
    child = await trio.lowlevel.open_process(
        [sys.executable, "-c", CHILD, etcd_endpoint.discovery_url, SOURCES], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        output = b""
        with trio.fail_after(20):
            while b"ready\n" not in output:
                chunk = await child.stdout.receive_some()
                assert chunk, f"child exited before registering: {output!r}"
                output += chunk
        async with discovery_at(etcd_endpoint) as observer:
            start = await observer.revision() + 1
            child.send_signal(signal.SIGKILL)
            await child.wait()
            assert [r.record_id for r in await observer.list()] == [77]  # only the lease can remove it now
            killed_at = trio.current_time()
            with trio.fail_after(2 + 3):  # lease TTL + etcd's expiry sweep + margin
                async with aclosing(observer.watch(start_revision=start)) as events:
                    first = await anext(events)
            assert (first.kind, first.record_id) == ("delete", 77)
            assert trio.current_time() - killed_at > 1  # expired with the lease, not removed by anyone
            assert await observer.list() == []
    finally:
        if child.returncode is None:
            child.kill()
            with trio.move_on_after(5, shield=True):
                await child.wait()


async def test_keepalive_holds_the_lease_past_its_ttl(etcd_endpoint: EtcdEndpoint) -> None:
    async with discovery_at(etcd_endpoint, ttl=2) as discovery:
        await discovery.register(record(1))
        lease = discovery.lease_id
        with trio.fail_after(10):
            counters = await discovery.wait_for_statistics(lambda c: c.keepalives >= 4)  # > 2 s: past the TTL
        assert counters.lease_losses == 0 and counters.keepalive_failures == 0
        assert discovery.lease_id == lease
        assert await discovery.list() == [record(1)]
        assert await lease_ttl(etcd_endpoint, lease or 0) > 0


async def test_lease_revoked_behind_our_back_is_regranted_and_records_restored(
    etcd_endpoint: EtcdEndpoint,
) -> None:
    async with discovery_at(etcd_endpoint, ttl=2) as discovery:
        await discovery.register(record(1))
        await discovery.register(record(2))
        await discovery.unregister(SOURCES, 2)  # withdrawn: must not come back
        old_lease = discovery.lease_id
        assert old_lease is not None
        await revoke(etcd_endpoint, old_lease)  # etcd deletes the records with the lease
        with trio.fail_after(10):
            counters = await discovery.wait_for_statistics(lambda c: c.recoveries >= 1)
        assert counters.lease_losses == 1 and counters.regrants == 1 and counters.reregistrations == 1
        assert discovery.lease_id not in (None, old_lease)
        assert await discovery.list() == [record(1)]
        stored = await raw_get(etcd_endpoint, record_key(etcd_endpoint, record(1)))
        assert stored is not None and int(stored["lease"]) == discovery.lease_id


async def test_register_on_an_expired_lease_regrants_first(etcd_endpoint: EtcdEndpoint) -> None:
    async with discovery_at(etcd_endpoint, ttl=30) as discovery:  # keepalive would not notice for 10 s
        await discovery.register(record(1))
        old_lease = discovery.lease_id
        assert old_lease is not None
        await revoke(etcd_endpoint, old_lease)
        await discovery.register(record(2))
        assert discovery.statistics().regrants == 1 and discovery.statistics().reregistrations == 1
        assert await discovery.list() == [record(1), record(2)]


async def test_etcd_restart_mid_run(private_etcd: PrivateEtcd) -> None:
    """etcd down for longer than the TTL, then back on the same ports and data: the outage surfaces as
    DiscoveryError, the client re-grants and re-registers, and a watch resumes without losing events."""
    endpoint = private_etcd.endpoint("/restart")
    async with discovery_at(endpoint, ttl=2) as discovery, trio.open_nursery() as nursery:
        start = await discovery.revision() + 1
        send, receive = trio.open_memory_channel[WatchEvent](16)  # the test expects 5 events

        async def watch_all() -> None:
            async with send, aclosing(discovery.watch(start_revision=start)) as events:
                async for event in events:
                    await send.send(event)

        nursery.start_soon(watch_all)
        await discovery.register(record(1))
        await discovery.register(record(2))
        old_lease = discovery.lease_id
        await private_etcd.stop(signal.SIGKILL)

        with pytest.raises(DiscoveryError):
            await discovery.unregister(SOURCES, 2)
        with pytest.raises(DiscoveryError):
            await discovery.register(record(3))
        with trio.fail_after(10):  # keepalive gives the lease up once it has failed for longer than the TTL
            counters = await discovery.wait_for_statistics(lambda c: c.lease_losses >= 1)
        lease_while_down = discovery.lease_id
        assert counters.keepalive_failures >= 2 and lease_while_down is None

        await private_etcd.start()  # same ports, same data dir; down for about 3 s in all
        with trio.fail_after(10):
            counters = await discovery.wait_for_statistics(lambda c: c.recoveries >= 1)
        assert counters.reregistrations == 2
        assert discovery.lease_id not in (None, old_lease)
        assert await discovery.list() == [record(1), record(2)]
        for rec in (record(1), record(2)):
            stored = await raw_get(endpoint, record_key(endpoint, rec))
            assert stored is not None and int(stored["lease"]) == discovery.lease_id
        assert await lease_ttl(endpoint, old_lease or 0) == -1  # revoked, not left to linger

        await discovery.unregister(SOURCES, 2)  # the retry the attachment advertiser would make
        assert await discovery.list() == [record(1)]

        with trio.fail_after(10):  # the watch reconnects with backoff (capped at 2 s)
            seen = [await receive.receive() for _ in range(5)]
        # Before the outage, the two registrations; after it, both moved to the new lease; then the delete.
        assert [(e.kind, e.record_id) for e in seen] == [
            ("put", 1),
            ("put", 2),
            ("put", 1),
            ("put", 2),
            ("delete", 2),
        ]
        nursery.cancel_scope.cancel()


async def test_websocket_quarantine_returns_while_etcd_is_down(private_etcd: PrivateEtcd) -> None:
    """The quarantine op is answered with etcd dead; the attachment advertiser removes the ad once it is back."""
    endpoint = private_etcd.endpoint("/quarantine")
    token = "etcd-quarantine-test-token"
    context: zmq.Context[Any] = zmq.Context()
    config = SlotAgentConfig(name="s0", cache_owner_id=OWNER, kv_block_size=32)
    try:
        with trio.fail_after(60):
            async with (
                discovery_at(endpoint) as discovery,
                open_host(discovery=discovery, zmq_context=context) as host,
                trio.open_nursery() as nursery,
            ):
                agent = await host.add_slot(config)
                engine = XpubEngine(context)
                generation = await attach(agent, engine)
                record_id = attachment_record_id(agent.identity.publisher_id, generation)
                ad_key = f"{endpoint.prefix}/v2/{KV_STATE_ATTACHMENTS_TOPIC}/{record_id}"
                assert await raw_get(endpoint, ad_key) is not None
                info: RecoveryServerInfo = await nursery.start(
                    partial(serve_recovery, host, host="127.0.0.1", port=0, token=token)
                )
                await private_etcd.stop(signal.SIGKILL)
                async with connect_slot(f"ws://127.0.0.1:{info.port}", "s0", token=token) as client:
                    await client.quarantine(generation, "operator")
                    status = await client.status()
                assert status.attachment is not None and status.attachment.state == "unready"
                advertiser = agent._advertiser
                assert advertiser.record is not None  # the withdrawal is owed
                await private_etcd.start()
                # Until the advertiser's retry gets through.
                await advertiser.changed.wait_for(lambda: advertiser.record is None)
                assert await raw_get(endpoint, ad_key) is None
                assert agent.statistics().withdrawal.retries >= 1
                nursery.cancel_scope.cancel()
                engine.close()
    finally:
        context.destroy(linger=0)


async def enable_auth(server: PrivateEtcd, password: str) -> None:
    """Turn on etcd authentication with a root user (the gateway's own API, as etcdctl would)."""
    async with httpx.AsyncClient(base_url=server.client_url, timeout=3) as client:
        for path, body in (
            ("/v3/auth/user/add", {"name": "root", "password": password}),
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ):
            (await client.post(path, json=body)).raise_for_status()


async def test_authenticates_and_renews_an_invalid_token(private_etcd: PrivateEtcd) -> None:
    await enable_auth(private_etcd, "s3cret")
    url = private_etcd.endpoint("/auth").discovery_url
    with pytest.raises(DiscoveryError, match="authentication failed"):
        async with open_etcd_discovery(url, username="root", password="wrong"):
            pytest.fail("opened with a wrong password")
    async with open_etcd_discovery(url, username="root", password="s3cret") as discovery:
        await discovery.register(record(1))
        # Simulate an expired token (etcd's simple tokens lapse after 5 idle minutes): etcd answers
        # "invalid auth token" and the gateway must authenticate again rather than fail the call.
        discovery._gateway._token = "expired.1"
        assert await discovery.list() == [record(1)]
    async with httpx.AsyncClient(timeout=3) as client:  # and without credentials etcd refuses us
        response = await client.post(f"{private_etcd.client_url}/v3/kv/range", json={"key": b64("/auth/")})
        assert response.status_code in (400, 401)


# -- endpoints and timeouts ------------------------------------------------------------------------------


async def test_fails_over_past_a_dead_member(etcd_endpoint: EtcdEndpoint) -> None:
    (dead_port,) = _free_ports(1)
    url = f"etcd://127.0.0.1:{dead_port},{etcd_endpoint.host_port}{etcd_endpoint.prefix}"
    async with open_etcd_discovery(url) as discovery:
        await discovery.register(record(4))
        assert await discovery.list() == [record(4)]


async def test_unreachable_etcd_fails_open_with_discovery_error() -> None:
    (dead_port,) = _free_ports(1)
    with trio.fail_after(5), pytest.raises(DiscoveryError, match="unreachable"):
        async with open_etcd_discovery(f"etcd://127.0.0.1:{dead_port}"):
            pytest.fail("opened against a dead port")


async def test_silent_server_times_out_instead_of_hanging() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepted: list[trio.SocketStream] = []

        async def accept_and_ignore() -> None:
            while True:  # accepts, never answers
                accepted.append(await listeners[0].accept())

        nursery.start_soon(accept_and_ignore)
        with trio.fail_after(5), pytest.raises(DiscoveryError, match="unreachable"):
            async with open_etcd_discovery(f"etcd://127.0.0.1:{port}", request_timeout=0.5):
                pytest.fail("opened against a silent server")
        nursery.cancel_scope.cancel()
    for stream in accepted:
        await stream.aclose()
    await listeners[0].aclose()


# -- watch ---------------------------------------------------------------------------------------------


def expected_events(
    start: int, puts: list[DiscoveryRecord], deletes: list[DiscoveryRecord]
) -> list[WatchEvent]:
    events = [WatchEvent("put", r.topic, r.record_id, r, start + i) for i, r in enumerate(puts)]
    base = start + len(puts)
    return events + [
        WatchEvent("delete", r.topic, r.record_id, None, base + i) for i, r in enumerate(deletes)
    ]


async def test_watch_sees_every_put_and_delete_in_order(etcd_endpoint: EtcdEndpoint) -> None:
    recs = [record(1), record(2), record(3)]
    async with discovery_at(etcd_endpoint) as discovery:
        start = await discovery.revision() + 1
        for rec in recs:
            await discovery.register(rec)
        await discovery.unregister(SOURCES, 1)
        await discovery.unregister(SOURCES, 3)
        seen: list[WatchEvent] = []
        with trio.fail_after(5):
            async with aclosing(discovery.watch(start_revision=start)) as events:
                async for event in events:
                    seen.append(event)
                    if len(seen) == 5:
                        break
        assert seen == expected_events(start, recs, [recs[0], recs[2]])


async def test_watch_streams_live_changes_of_one_topic(etcd_endpoint: EtcdEndpoint) -> None:
    """Each change is made only after the previous one was seen, so every event arrives live."""
    mine = [record(1), record(2), record(3)]
    async with discovery_at(etcd_endpoint) as discovery:
        start = await discovery.revision() + 1
        send, receive = trio.open_memory_channel[WatchEvent](0)  # lock-step: the test reads each one

        async def watch_sources() -> None:
            async with send, aclosing(discovery.watch(SOURCES, start_revision=start)) as events:
                async for event in events:
                    await send.send(event)

        seen: list[WatchEvent] = []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_sources)
                for rec in mine:
                    await discovery.register(record(rec.record_id, ATTACHMENTS))  # other topic: filtered out
                    await discovery.register(rec)
                    seen.append(await receive.receive())
                for rec in (mine[1], mine[0]):
                    await discovery.unregister(SOURCES, rec.record_id)
                    seen.append(await receive.receive())
                nursery.cancel_scope.cancel()
        assert [(e.kind, e.record_id, e.record) for e in seen] == [
            ("put", 1, mine[0]),
            ("put", 2, mine[1]),
            ("put", 3, mine[2]),
            ("delete", 2, None),
            ("delete", 1, None),
        ]
        assert all(e.topic == SOURCES for e in seen)
        revisions = [e.revision for e in seen]
        assert revisions == sorted(revisions) and len(set(revisions)) == 5 and revisions[0] > start
