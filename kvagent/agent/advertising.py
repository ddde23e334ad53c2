"""The attachment advertisement of one slot: registered only while the attachment is ready.

The coordinator asks the withdrawal supervisor to withdraw the ad when the attachment leaves ready, or when
its ``ready_at_outbound_cursor`` moves while ready (so withdrawals never wait on discovery).  The
:class:`AttachmentAdKeeper` registers it again, with the current cursor, once the open attachment is ready
and its ad is missing.  The registration is a step of the slot task (:mod:`kvagent.agent.lifecycle`), in
order with attach, detach and quarantine, so it never advertises a generation that a detach or quarantine
has closed; a lifecycle call interrupts (:meth:`~AttachmentAdKeeper.interrupt`) a registration that discovery
keeps waiting rather than queue behind it.

It also builds the URLs a slot advertises (:func:`recovery_base_url`, :func:`slot_recovery_url`,
:func:`advertised_zmq_endpoint`): a reachable host instead of a wildcard bind address, IPv6 in brackets,
the slot name percent-encoded as one path segment.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import quote

import attrs
import structlog
import trio

from kvagent.coordinator.task import StatusCell
from kvagent.discovery.ads import attachment_advertisement
from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.discovery.withdrawal import INITIAL_BACKOFF, MAX_BACKOFF, AttachmentRecordHolder
from kvagent.model.errors import KvAgentError
from kvagent.model.ids import KvStateAgentIdentity
from kvagent.model.status import Attachment

__all__ = [
    "AttachmentAdKeeper",
    "advertised_host",
    "advertised_zmq_endpoint",
    "http_url",
    "recovery_base_url",
    "slot_recovery_url",
    "url_host",
]

log = structlog.get_logger(__name__)

# Bind addresses that mean "every interface": no client can connect to them, so they are never advertised.
WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


@functools.cache  # one lookup (and one log line) per process, however many URLs use it
def _machine_hostname() -> str:
    hostname = socket.getfqdn()
    log.info(
        "advertising_machine_hostname",
        host=hostname,
        hint="the listen address is a wildcard; pass --advertise HOST to advertise another name",
    )
    return hostname


def url_host(host: str) -> str:
    """``host`` as it goes into a URL: an IPv6 address in brackets (``[::1]``), anything else as is."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def advertised_host(bind_host: str, advertise: str | None = None) -> str:
    """The host clients are told to connect to: ``advertise``, else the bind host unless it is a wildcard
    (then this machine's fully qualified name), in URL form."""
    if advertise is not None:
        return url_host(advertise)
    if bind_host in WILDCARD_HOSTS:
        return url_host(_machine_hostname())
    return url_host(bind_host)


def recovery_base_url(bind_host: str, port: int, advertise: str | None = None) -> str:
    """``ws://HOST:PORT`` of the websocket server bound at ``bind_host:port``."""
    return f"ws://{advertised_host(bind_host, advertise)}:{port}"


def http_url(bind_host: str, port: int, advertise: str | None = None) -> str:
    """``http://HOST:PORT`` of the HTTP surface bound at ``bind_host:port``."""
    return f"http://{advertised_host(bind_host, advertise)}:{port}"


def slot_recovery_url(base_url: str, slot_name: str) -> str:
    """The slot's websocket URL; the name is one percent-encoded path segment (spaces, ``ü``, ``%``...)."""
    return f"{base_url}/v1/slots/{quote(slot_name, safe='')}"


def advertised_zmq_endpoint(endpoint: str, advertise: str | None = None) -> str:
    """A bound ``tcp://HOST:PORT`` endpoint with the advertised host (other transports as they are)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep:
        return endpoint
    return f"tcp://{advertised_host(host.strip('[]'), advertise)}:{port}"


class AttachmentAdKeeper:
    """Keeps the attachment ad registered exactly while the open attachment is ready (see module doc).

    ``attached`` reads the slot's current attachment (the slot task sets it at attach, clears it at
    detach); ``registered`` is the record this keeper, or attach, last registered successfully.  The
    registration itself (:meth:`register_due`) is a step of the slot task; :meth:`run` only watches for an
    ad falling due and hands the slot task that step.
    """

    def __init__(
        self,
        *,
        identity: KvStateAgentIdentity,
        kv_state_endpoint: str,
        recovery_url: str | None,
        discovery: Discovery,
        holder: AttachmentRecordHolder,
        status: StatusCell,
        request_withdrawal: Callable[[int], None],
        attached: Callable[[], Attachment | None],
    ) -> None:
        self._identity = identity
        self._kv_state_endpoint = kv_state_endpoint
        self._recovery_url = recovery_url
        self._discovery = discovery
        self._holder = holder
        self._status = status
        self._request_withdrawal = request_withdrawal
        self._attached = attached
        self.registered: DiscoveryRecord | None = None
        self._closing = False
        self._wakeup = trio.Event()  # set by lifecycle steps: look again
        self._registration: trio.CancelScope | None = None

    def record(self, attached: Attachment, ready_at_outbound_cursor: int) -> DiscoveryRecord:
        return attachment_advertisement(
            identity=self._identity,
            attachment=attrs.evolve(attached, ready_at_outbound_cursor=ready_at_outbound_cursor),
            kv_state_endpoint=self._kv_state_endpoint,
            recovery_url=self._recovery_url,
        )

    def still_wanted(self, record: DiscoveryRecord, attached: Attachment) -> bool:
        """``record`` is the ad of ``attached`` as it is now: ready, at the same cursor."""
        status = self._status.get().attachment
        return (
            status is not None
            and status.generation == attached.generation
            and status.ready
            and self.record(attached, status.ready_at_outbound_cursor) == record
        )

    def note_registered(self, record: DiscoveryRecord, attached: Attachment) -> None:
        """``record`` was registered; if the attachment left ready (or moved) meanwhile, have it withdrawn."""
        self._holder.set(record)
        self.registered = record
        if not self.still_wanted(record, attached):
            self._request_withdrawal(attached.generation)

    def wake(self) -> None:
        self._wakeup.set()

    def interrupt(self) -> None:
        """Cancel a registration in progress, so a lifecycle call never waits behind discovery."""
        if self._registration is not None:
            self._registration.cancel()

    def close(self) -> None:
        """Nothing is due any more (the slot is shutting down); a registration in progress is interrupted."""
        self._closing = True
        self.interrupt()
        self.wake()

    def due(self) -> tuple[DiscoveryRecord, Attachment] | None:
        """The ad to register now: the attachment is open and ready, and its ad is not registered."""
        attached, status = self._attached(), self._status.get().attachment
        if self._closing or attached is None or status is None:
            return None
        if status.generation != attached.generation or not status.ready:
            return None
        record = self.record(attached, status.ready_at_outbound_cursor)
        held = self._holder.record
        if held is None:
            return record, attached
        if held != record:
            return None  # an older ad of this attachment is still being withdrawn (the coordinator asked)
        return None if held is self.registered else (record, attached)

    async def run(
        self,
        register: Callable[[], Awaitable[bool | None]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Each time the ad falls due, ``register()`` (the slot task runs :meth:`register_due`); failures
        back off.  Ends when the slot refuses (it is shutting down)."""
        task_status.started()
        delay = INITIAL_BACKOFF
        while True:
            await self._wait_until_due()
            try:
                outcome = await register()
            except KvAgentError:
                return  # the slot task is shutting down: nothing will be due any more
            if outcome is False:
                await trio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF)
            elif outcome:
                delay = INITIAL_BACKOFF

    async def register_due(self) -> bool | None:
        """The slot task's step: register the ad if it is (still) due.

        True once registered (or nothing is due any more), False if discovery failed, None if a lifecycle
        call interrupted it.
        """
        due = self.due()
        if due is None:
            return True
        record, attached = due
        generation = attached.generation
        with trio.CancelScope() as scope:
            self._registration = scope
            try:
                await self._discovery.register(record)
            except Exception as exc:
                log.warning("attachment_ad_registration_failed", generation=generation, error=str(exc))
            else:
                log.info("attachment_ad_registered", generation=generation, record_id=record.record_id)
                self.note_registered(record, attached)
                return True
            finally:
                self._registration = None
        # Failed or interrupted, it may have been registered all the same: every withdrawal targets it, and
        # the keeper registers it again while the attachment stays ready.
        self._holder.set(record)
        return None if scope.cancelled_caught else False

    async def _wait_until_due(self) -> None:
        while True:
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
            # Taken before looking, so a change in between sets one of them.
            changes = (self._status.attachment_change(), self._holder.change(), self._wakeup)
            if self.due() is not None:
                return
            await _wait_any(*changes)


async def _wait_any(*events: trio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with trio.open_nursery() as nursery:

        async def wait_one(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait_one, event)
