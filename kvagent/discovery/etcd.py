"""etcd v3 discovery backend: records under one lease per process, over etcd's JSON gateway.

Trio-native (httpx on Trio, no threads); transport and failover live in etcd_gateway.py.  Key layout, lease
and re-registration behaviour, fencing and watch semantics: docs/discovery.md.
"""

from __future__ import annotations

import builtins
import json
import math
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal

import attrs
import httpx
import structlog
import trio

from kvagent._util.sync import Changed
from kvagent.discovery.base import DiscoveryRecord, check_topic
from kvagent.discovery.etcd_gateway import (
    EtcdApiError,
    EtcdGateway,
    EtcdTarget,
    EtcdUnreachable,
    JsonList,
    JsonObject,
    KeyTaken,
    StoredValue,
    b64,
    int_field,
    parse_etcd_url,
    prefix_range,
    stored_value,
    unb64,
)
from kvagent.discovery.ownership import SlotClaim, SlotHolder, ownership_refused
from kvagent.model.errors import DiscoveryConflict, DiscoveryError

__all__ = [
    "EtcdDiscovery",
    "EtcdStatistics",
    "EtcdTarget",
    "WatchEvent",
    "open_etcd_discovery",
    "parse_etcd_url",
]

log = structlog.get_logger(__name__)

KEY_LAYOUT_VERSION = "v2"
# Slot claims live beside the records' root, so neither list() nor a watch of the records sees them.
OWNERS_SEGMENT = "owners"
_LEASE_NOT_FOUND = "requested lease not found"
# A put races only with other writers of the same key; give up after this many lost races rather than spin.
_MAX_PUT_ATTEMPTS = 4
_WATCH_RETRY_CAP = 2.0


@attrs.frozen(slots=True)
class WatchEvent:
    """One change under the watched prefix. ``record`` is None for deletes."""

    kind: Literal["put", "delete"]
    topic: str
    record_id: int
    record: DiscoveryRecord | None
    revision: int


@attrs.frozen(slots=True)
class EtcdStatistics:
    """Lease health at one instant (trio ``statistics()`` style; the backend replaces it on every change).

    Attributes:
      keepalives: successful lease keepalives.
      keepalive_failures: keepalives that failed (etcd unreachable or erroring).
      lease_losses: leases given up as lost (expired, or overdue while etcd was unreachable).
      regrants: new leases granted after a loss.
      reregistrations: records put again under a re-granted lease.
      recoveries: re-grants whose re-registration has completed.
    """

    keepalives: int = 0
    keepalive_failures: int = 0
    lease_losses: int = 0
    regrants: int = 0
    reregistrations: int = 0
    recoveries: int = 0


def _encode_record(record: DiscoveryRecord) -> bytes:
    # to_json() is canonical, so an identical payload always stores the identical value.
    return record.to_json().encode()


class EtcdDiscovery:
    """Discovery over etcd; use :func:`open_etcd_discovery`, which runs the lease keepalive."""

    def __init__(self, gateway: EtcdGateway, *, prefix: str, ttl: float) -> None:
        self._gateway = gateway
        self._root = f"{prefix}/{KEY_LAYOUT_VERSION}/"
        self._ttl = ttl
        self._lease_id: int | None = None
        self._lease_ttl = ttl  # as granted by etcd (it rounds up to whole seconds and a minimum)
        self._last_keepalive = 0.0
        self._stale_leases: builtins.list[int] = []
        self._needs_reregistration = False
        # Records this process registered and has not unregistered: re-registered under a new lease.
        self._registered: dict[str, DiscoveryRecord] = {}
        # Slot claims this process holds, by owner key: put again under a re-granted lease, like records.
        self._owned: dict[str, SlotHolder] = {}
        # One writer at a time: re-registration must never resurrect a record being unregistered.
        self._lock = trio.Lock()
        self._statistics = EtcdStatistics()
        self._statistics_changed = Changed()
        self._closed = False

    # -- introspection -----------------------------------------------------------------------------------

    @property
    def lease_id(self) -> int | None:
        """The current lease, or None while it is lost and not yet re-granted."""
        return self._lease_id

    def statistics(self) -> EtcdStatistics:
        return self._statistics

    @property
    def prefix(self) -> str:
        return self._root.removesuffix(f"/{KEY_LAYOUT_VERSION}/")

    async def wait_for_statistics(self, predicate: Callable[[EtcdStatistics], bool]) -> EtcdStatistics:
        """Wait (without polling) until ``predicate(statistics)`` holds; returns that snapshot."""
        await self._statistics_changed.wait_for(lambda: predicate(self._statistics))
        return self._statistics

    def _count(self, **increments: int) -> None:
        current = attrs.asdict(self._statistics)
        self._statistics = EtcdStatistics(**{k: v + increments.get(k, 0) for k, v in current.items()})
        self._statistics_changed.notify()

    def key_for(self, topic: str, record_id: int) -> str:
        return f"{self._topic_prefix(topic)}{record_id}"

    def owner_key(self, cache_owner_id: str) -> str:
        """The key of a CacheOwnerId's slot claim: ``<prefix>/owners/<CacheOwnerId>``."""
        return f"{self.prefix}/{OWNERS_SEGMENT}/{cache_owner_id}"

    def _topic_prefix(self, topic: str) -> str:
        return f"{self._root}{check_topic(topic)}/"

    def _parse_key(self, key: str) -> tuple[str, int] | None:
        topic, slash, id_text = key.removeprefix(self._root).partition("/")
        if not key.startswith(self._root) or not slash or not id_text.isdigit():
            return None
        return topic, int(id_text)

    # -- Discovery ---------------------------------------------------------------------------------------

    async def register(self, record: DiscoveryRecord) -> None:
        """Put ``record`` under this process's lease; same payload again: no-op; different: conflict."""
        key = self.key_for(record.topic, record.record_id)
        async with self._lock:
            self._check_open()
            try:
                await self._put_on_lease_locked(key, _encode_record(record), self._same_record(key, record))
            except KeyTaken:
                raise DiscoveryConflict(f"{key} is already registered with a different payload") from None
            self._registered[key] = record

    # -- SlotOwnership -----------------------------------------------------------------------------------

    async def claim_slot(self, holder: SlotHolder) -> SlotClaim:
        """Put ``<prefix>/owners/<CacheOwnerId>`` if absent, on this process's lease: it vanishes when the
        lease does (a killed holder frees the slot within the TTL); a held key refuses the claim."""
        key = self.owner_key(holder.cache_owner_id)
        async with self._lock:
            self._check_open()
            if key in self._owned:
                raise ownership_refused(holder, self._owned[key], hint=" (in this process)")
            value = holder.to_json()
            try:
                await self._put_on_lease_locked(key, value, value.__eq__)
            except KeyTaken as taken:
                hint = f" (etcd key {key}; a dead holder's claim expires within its lease TTL)"
                raise ownership_refused(holder, SlotHolder.from_json(taken.existing), hint=hint) from None
            self._owned[key] = holder
        return _EtcdClaim(self, key, holder)

    async def _release_claim(self, key: str, holder: SlotHolder) -> None:
        """Delete the claim only while it still holds our value (never a successor's claim)."""
        async with self._lock:
            if self._owned.get(key) is not holder:
                return
            del self._owned[key]
            if self._closed:  # the lease is revoked: the key went with it
                return
            key_b64 = b64(key.encode())
            same = {"key": key_b64, "target": "VALUE", "result": "EQUAL", "value": b64(holder.to_json())}
            try:
                await self._txn([same], success=[{"request_delete_range": {"key": key_b64}}], failure=[])
            except DiscoveryError as error:  # the claim still goes with our lease (revoked at close)
                log.warning("etcd_slot_release_failed", slot=holder.slot, key=key, error=str(error))

    async def unregister(self, topic: str, record_id: int) -> None:
        """Delete the record if present, fenced on the revision read (a newer value is never deleted)."""
        key = self.key_for(topic, record_id)
        async with self._lock:
            self._check_open()
            current = await self._get(key)
            if current is not None:
                await self._delete_if_unchanged_locked(key, current.mod_revision)
            self._registered.pop(key, None)

    async def list(self, topic: str | None = None) -> builtins.list[DiscoveryRecord]:
        """Every parseable record (of ``topic``, or all), sorted by (topic, record_id)."""
        self._check_open()
        prefix = self._root if topic is None else self._topic_prefix(topic)
        key, range_end = prefix_range(prefix.encode())
        answer = await self._gateway.call("/v3/kv/range", {"key": key, "range_end": range_end})
        records = []
        for kv in answer.get("kvs", []):
            record = self._decode_record(unb64(kv.get("key")).decode(), unb64(kv.get("value")))
            if record is not None:
                records.append(record)
        return sorted(records, key=lambda r: (r.topic, r.record_id))

    async def aclose(self) -> None:
        """Revoke the lease (its records vanish at once) and refuse further calls. Idempotent."""
        async with self._lock:  # never while a keepalive tick is re-granting
            if self._closed:
                return
            self._closed = True
            leases = [*self._stale_leases, *([self._lease_id] if self._lease_id is not None else [])]
            self._lease_id = None
            self._stale_leases.clear()
            for lease in leases:
                await self._revoke_quietly(lease)

    # -- fenced primitives (unregister is read + delete_if_unchanged) ---------------------------------------

    async def read(self, topic: str, record_id: int) -> tuple[DiscoveryRecord, int] | None:
        """The record and its mod_revision (the fence for :meth:`delete_if_unchanged`), or None."""
        self._check_open()
        key = self.key_for(topic, record_id)
        current = await self._get(key)
        if current is None:
            return None
        record = self._decode_record(key, current.value)
        if record is None:
            raise DiscoveryError(f"undecodable discovery record at {key}")
        return record, current.mod_revision

    async def delete_if_unchanged(self, topic: str, record_id: int, mod_revision: int) -> bool:
        """Delete the record only if it is still at ``mod_revision``; True if it was deleted."""
        key = self.key_for(topic, record_id)
        async with self._lock:
            self._check_open()
            deleted = await self._delete_if_unchanged_locked(key, mod_revision)
            if deleted:
                self._registered.pop(key, None)
            return deleted

    async def revision(self) -> int:
        """etcd's current revision (a watch from ``revision() + 1`` misses nothing after this call)."""
        answer = await self._gateway.call("/v3/kv/range", {"key": b64(self._root.encode()), "limit": 1})
        return int_field(answer["header"], "revision")

    # -- watch -------------------------------------------------------------------------------------------

    async def watch(
        self, prefix_topic: str | None = None, *, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Puts and deletes under the prefix (or one topic), in revision order, from ``start_revision``
        (default: the revision after the current one). Reconnects and resumes where it left off if the
        stream breaks; raises DiscoveryError if the resume revision was compacted away. Iterate it under
        ``contextlib.aclosing`` so the HTTP stream closes when you stop."""
        prefix = self._root if prefix_topic is None else self._topic_prefix(prefix_topic)
        key, range_end = prefix_range(prefix.encode())
        next_revision = start_revision if start_revision is not None else await self.revision() + 1
        delay = 0.1
        while True:
            self._check_open()
            request = {
                "create_request": {"key": key, "range_end": range_end, "start_revision": str(next_revision)}
            }
            try:
                async with self._gateway.stream("/v3/watch", request) as lines:
                    async for line in lines:
                        if not line.strip():
                            continue
                        result = self._watch_result(json.loads(line))
                        batch_revision = next_revision - 1
                        for event in result.get("events", []):
                            batch_revision = max(
                                batch_revision, int_field(event.get("kv", {}), "mod_revision")
                            )
                            watch_event = self._watch_event(event)
                            if watch_event is not None:
                                yield watch_event
                        # Resume after the whole batch: one txn's events share a revision.
                        next_revision = batch_revision + 1
                        delay = 0.1
            except (httpx.TransportError, EtcdUnreachable) as error:
                log.warning("etcd_watch_resumed", revision=next_revision, error=repr(error))
            # The stream ended (member restarted, connection dropped): back off a little, then resume.
            await trio.sleep(delay)
            delay = min(delay * 2, _WATCH_RETRY_CAP)

    @staticmethod
    def _watch_result(message: JsonObject) -> JsonObject:
        if "error" in message:
            error = message["error"]
            raise DiscoveryError(f"etcd watch failed: {error.get('message', error)}")
        result: JsonObject = message.get("result", {})
        if result.get("canceled"):
            compacted = int_field(result, "compact_revision")
            reason = result.get("cancel_reason") or (
                f"compacted through revision {compacted}" if compacted else ""
            )
            raise DiscoveryError(f"etcd watch canceled: {reason}")
        return result

    def _watch_event(self, event: JsonObject) -> WatchEvent | None:
        """The event for a record key; None for keys and values that are not ours to report."""
        kv = event.get("kv", {})
        revision = int_field(kv, "mod_revision")
        key = unb64(kv.get("key")).decode()
        parsed = self._parse_key(key)
        if parsed is None:
            return None
        topic, record_id = parsed
        if event.get("type") == "DELETE":
            return WatchEvent("delete", topic, record_id, None, revision)
        record = self._decode_record(key, unb64(kv.get("value")))
        return None if record is None else WatchEvent("put", topic, record_id, record, revision)

    # -- lease -------------------------------------------------------------------------------------------

    async def _grant_initial_lease(self) -> None:
        async with self._lock:
            await self._grant_locked()

    async def keep_lease_alive(self) -> None:
        """Keepalive every ttl/3 until cancelled; re-grants and re-registers after a loss."""
        while True:
            await trio.sleep(self._ttl / 3)
            async with self._lock:
                if self._closed:
                    return
                await self._keepalive_tick_locked()

    async def _keepalive_tick_locked(self) -> None:
        if self._lease_id is not None:
            try:
                answer = await self._gateway.call("/v3/lease/keepalive", {"ID": str(self._lease_id)})
            except DiscoveryError as error:
                self._count(keepalive_failures=1)
                overdue = trio.current_time() - self._last_keepalive > self._lease_ttl
                log.warning("etcd_keepalive_failed", lease=self._lease_id, overdue=overdue, error=str(error))
                if overdue:  # etcd may have expired it already; assume so and start over once reachable
                    self._lose_lease_locked("keepalive failing past the lease TTL")
                return
            if int_field(answer.get("result", {}), "TTL") > 0:
                self._last_keepalive = trio.current_time()
                self._count(keepalives=1)
            else:
                self._lose_lease_locked("etcd reports the lease expired")
        try:
            await self._ensure_lease_locked()
        except DiscoveryError as error:
            log.warning("etcd_lease_recovery_failed", error=str(error))

    def _lose_lease_locked(self, reason: str) -> None:
        if self._lease_id is None:
            return
        log.warning("etcd_lease_lost", lease=self._lease_id, reason=reason, records=len(self._registered))
        self._stale_leases.append(self._lease_id)
        self._lease_id = None
        self._count(lease_losses=1)

    async def _ensure_lease_locked(self) -> int:
        """A live lease with every remembered record on it (re-grants and re-registers if needed)."""
        if self._lease_id is None:
            await self._grant_locked()
            self._needs_reregistration = True
            self._count(regrants=1)
        assert self._lease_id is not None
        if self._needs_reregistration:
            await self._reregister_locked()
            self._needs_reregistration = False
            self._count(recoveries=1)
            for stale in self._stale_leases:  # our records have moved to the new lease
                await self._revoke_quietly(stale)
            self._stale_leases.clear()
        return self._lease_id

    async def _grant_locked(self) -> None:
        answer = await self._gateway.call("/v3/lease/grant", {"TTL": math.ceil(self._ttl)})
        self._lease_id = int_field(answer, "ID")
        self._lease_ttl = float(int_field(answer, "TTL"))
        self._last_keepalive = trio.current_time()
        log.info("etcd_lease_granted", lease=self._lease_id, ttl=self._lease_ttl)

    async def _reregister_locked(self) -> None:
        for key, holder in builtins.list(self._owned.items()):
            value = holder.to_json()
            try:
                await self._put_locked(key, value, value.__eq__)
            except KeyTaken as taken:
                # Another process claimed the slot while our lease was lost: two agents now serve it.
                other = SlotHolder.from_json(taken.existing)
                log.error(
                    "etcd_slot_ownership_lost",
                    slot=holder.slot,
                    key=key,
                    holder=None if other is None else other.describe(),
                )
                del self._owned[key]
        for key, record in builtins.list(self._registered.items()):
            try:
                changed = await self._put_locked(key, _encode_record(record), self._same_record(key, record))
            except KeyTaken:
                # Someone else now owns this id with another payload; it is no longer ours to restore.
                log.error(
                    "etcd_reregistration_conflict", key=key, error="registered with a different payload"
                )
                del self._registered[key]
                continue
            if changed:
                self._count(reregistrations=1)
        log.info("etcd_records_reregistered", lease=self._lease_id, records=len(self._registered))

    async def _revoke_quietly(self, lease: int) -> None:
        try:
            await self._gateway.call("/v3/lease/revoke", {"ID": str(lease)})
        except DiscoveryError as error:  # it expires on its own anyway
            log.info("etcd_lease_revoke_failed", lease=lease, error=str(error))

    # -- kv primitives -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError("etcd discovery is closed")

    def _decode_record(self, key: str, value: bytes) -> DiscoveryRecord | None:
        """The record stored at ``key``; None (logged) for a foreign or corrupt value, so that one bad key
        does not fail every list()."""
        parsed = self._parse_key(key)
        if parsed is None:
            return None
        try:
            record = DiscoveryRecord.from_json(value)
        except DiscoveryError as error:
            log.warning("etcd_record_undecodable", key=key, error=repr(error))
            return None
        if record.key != parsed:
            log.warning("etcd_record_key_mismatch", key=key, record=record.key)
            return None
        return record

    async def _get(self, key: str) -> StoredValue | None:
        answer = await self._gateway.call("/v3/kv/range", {"key": b64(key.encode())})
        kvs = answer.get("kvs", [])
        return stored_value(kvs[0]) if kvs else None

    def _same_record(self, key: str, record: DiscoveryRecord) -> Callable[[bytes], bool]:
        return lambda stored: self._decode_record(key, stored) == record

    async def _put_on_lease_locked(self, key: str, value: bytes, same: Callable[[bytes], bool]) -> None:
        """:meth:`_put_locked` on a live lease (granted or recovered first); raises KeyTaken."""
        await self._ensure_lease_locked()
        try:
            await self._put_locked(key, value, same)
        except EtcdApiError as error:
            if _LEASE_NOT_FOUND not in error.etcd_message:
                raise
            # etcd expired the lease before our keepalive noticed: recover, then try once more.
            self._lose_lease_locked("lease not found on put")
            await self._ensure_lease_locked()
            await self._put_locked(key, value, same)

    async def _put_locked(self, key: str, value: bytes, same: Callable[[bytes], bool]) -> bool:
        """Put-if-absent under our lease; a value ``same`` accepts moves to our lease, any other raises
        KeyTaken. True if etcd changed."""
        lease = self._lease_id
        assert lease is not None
        key_b64 = b64(key.encode())
        put = [{"request_put": {"key": key_b64, "value": b64(value), "lease": str(lease)}}]
        absent = {"key": key_b64, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        compare = absent
        for _ in range(_MAX_PUT_ATTEMPTS):
            answer = await self._txn([compare], success=put, failure=[{"request_range": {"key": key_b64}}])
            if answer.get("succeeded"):
                return True
            kvs = answer["responses"][0]["response_range"].get("kvs", [])
            if not kvs:  # deleted since our compare: absent again
                compare = absent
                continue
            existing = stored_value(kvs[0])
            if not same(existing.value):
                raise KeyTaken(existing.value)
            if existing.lease == lease:
                return False
            # Identical payload on another (e.g. our lost) lease: move it to ours, fenced on what we read.
            compare = {
                "key": key_b64,
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": str(existing.mod_revision),
            }
        raise DiscoveryError(f"{key} kept changing while registering; giving up")

    async def _delete_if_unchanged_locked(self, key: str, mod_revision: int) -> bool:
        key_b64 = b64(key.encode())
        answer = await self._txn(
            [{"key": key_b64, "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            success=[{"request_delete_range": {"key": key_b64}}],
            failure=[],
        )
        if not answer.get("succeeded"):
            log.info("etcd_fenced_delete_skipped", key=key)
            return False
        return True

    async def _txn(self, compare: JsonList, *, success: JsonList, failure: JsonList) -> JsonObject:
        return await self._gateway.call(
            "/v3/kv/txn", {"compare": compare, "success": success, "failure": failure}
        )


@asynccontextmanager
async def open_etcd_discovery(
    url: str,
    *,
    ttl: float = 10.0,
    username: str | None = None,
    password: str | None = None,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    client: httpx.AsyncClient | None = None,
    request_timeout: float = 3.0,
) -> AsyncIterator[EtcdDiscovery]:
    """Grant this process's lease, keep it alive for the life of the context, revoke it on exit.

    Raises DiscoveryError on entry if no endpoint answers. ``client`` (optional) is used as is (its TLS
    settings win; the TLS options here only configure a client we create)."""
    target = parse_etcd_url(url)
    if not target.tls and (ca_file or cert_file or key_file):
        raise ValueError("ca_file/cert_file/key_file need an etcds:// URL")
    if (username is None) != (password is None):
        raise ValueError("username and password go together")
    if ttl < 1:
        raise ValueError(f"etcd lease ttl must be at least 1 second, got {ttl}")
    own_client = client is None
    if client is None:
        verify: ssl.SSLContext | bool = True
        if target.tls:
            verify = ssl.create_default_context(cafile=ca_file)
            if cert_file:
                verify.load_cert_chain(cert_file, key_file)
        client = httpx.AsyncClient(verify=verify, timeout=request_timeout)
    try:
        gateway = EtcdGateway(
            client, target.endpoints, request_timeout=request_timeout, username=username, password=password
        )
        discovery = EtcdDiscovery(gateway, prefix=target.prefix, ttl=ttl)
        await discovery._grant_initial_lease()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(discovery.keep_lease_alive)
                yield discovery
                nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(request_timeout, shield=True):
                await discovery.aclose()
    finally:
        if own_client:
            with trio.move_on_after(1, shield=True):
                await client.aclose()


class _EtcdClaim:
    def __init__(self, discovery: EtcdDiscovery, key: str, holder: SlotHolder) -> None:
        self._discovery = discovery
        self._key = key
        self._holder = holder

    async def release(self) -> None:
        await self._discovery._release_claim(self._key, self._holder)
