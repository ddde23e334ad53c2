"""The attachment advertisement of one slot: registered only while the open attachment is ready.

:class:`AttachmentAdvertiser` is its one owner: a single task (:meth:`~AttachmentAdvertiser.run`) drives the
sans-IO :class:`~kvagent.discovery.advertisement.AdvertisementState` and makes every register and unregister
call.  Its inputs never wait on discovery:

- the slot task opens a generation at attach (its ad is wanted whenever the status cell says it is ready, at
  the current ``ready_at_outbound_cursor``) and closes it at detach, quarantine, rollback and shutdown (the
  fence: a closed generation is never advertised again); it then waits for ``withdrawn(g)`` where the seed
  orders it (7.4, 7.8);
- the coordinator asks (:meth:`~AttachmentAdvertiser.request_withdrawal`) that generation ``g``'s ad go when
  the attachment leaves ready or its ready cursor moves;
- the ladder stops it last (:meth:`~AttachmentAdvertiser.stop`): nothing is wanted, it ends once withdrawn.

Failed calls are retried with backoff (100 ms doubling to 5 s) for as long as they are due: an ad left
registered after its attachment failed would make routers trust a dead engine, so a withdrawal never gives up.

It also builds the URLs a slot advertises (:func:`recovery_base_url`, :func:`slot_recovery_url`,
:func:`advertised_zmq_endpoint`): a reachable host instead of a wildcard bind address, IPv6 in brackets,
the slot name percent-encoded as one path segment.
"""

from __future__ import annotations

import functools
import socket
from urllib.parse import quote

import attrs
import structlog
import trio

from kvagent._util.sync import Changed
from kvagent.coordinator.task import StatusCell
from kvagent.discovery.ads import attachment_advertisement
from kvagent.discovery.advertisement import (
    Action,
    AdvertisementState,
    Outcome,
    Register,
    WithdrawalStatistics,
)
from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.model.ids import KvStateAgentIdentity
from kvagent.model.status import Attachment

__all__ = [
    "INITIAL_BACKOFF",
    "MAX_BACKOFF",
    "AttachmentAdvertiser",
    "advertised_host",
    "advertised_zmq_endpoint",
    "http_url",
    "recovery_base_url",
    "slot_recovery_url",
    "url_host",
]

log = structlog.get_logger(__name__)

INITIAL_BACKOFF = 0.1  # after a failed discovery call, doubling up to:
MAX_BACKOFF = 5.0

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


class AttachmentAdvertiser:
    """The one owner of the slot's attachment advertisement (module doc): one task, inputs that never wait."""

    def __init__(
        self,
        *,
        identity: KvStateAgentIdentity,
        kv_state_endpoint: str,
        recovery_url: str | None,
        discovery: Discovery,
        status: StatusCell,
        initial_backoff: float = INITIAL_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
    ) -> None:
        self._identity = identity
        self._kv_state_endpoint = kv_state_endpoint
        self._recovery_url = recovery_url
        self._discovery = discovery
        self._status = status
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._state = AdvertisementState()
        self._open: Attachment | None = None  # the generation whose ad is wanted while it is ready
        self._in_flight: trio.CancelScope | None = None
        self._registration_error: Exception | None = None  # why the last failed registration failed
        self.changed = Changed()  # any input, or a discovery call ended

    # --- the slot task's side --------------------------------------------------------------------------
    def open(self, attached: Attachment) -> None:
        """``attached`` is the slot's attachment: advertise it whenever it is ready."""
        self._open = attached
        self._update(derive=True)

    def close(self, generation: int) -> None:
        """``generation`` (and every older one) is closed: withdraw its ad, never advertise it again."""
        if self._open is not None and self._open.generation <= generation:
            self._open = None
        self._state.close(generation)
        self._update(derive=True)

    async def wait_registration(self, generation: int) -> None:
        """Attach's wait: return once ``generation``'s ad is registered (or no longer due); raise what
        discovery raised if the registration failed (the driver retries it while it stays due)."""
        after = self._state.completed_registrations
        while True:
            since = self.changed.version
            outcome = self._state.registration_outcome(generation, after=after)
            if outcome is True:
                return
            if outcome is False:
                assert self._registration_error is not None, "a failed registration keeps its error"
                raise self._registration_error
            await self.changed.wait(since)

    async def wait_withdrawn(self, generation: int) -> None:
        """Return once no ad of ``generation`` is, or may be, registered (after :meth:`close`)."""
        await self.changed.wait_for(lambda: self._state.withdrawn(generation))

    @property
    def record(self) -> DiscoveryRecord | None:
        """The ad that is, or may be, registered (counting one being registered now)."""
        return self._state.held

    def record_for(self, attached: Attachment, ready_at_outbound_cursor: int) -> DiscoveryRecord:
        return attachment_advertisement(
            identity=self._identity,
            attachment=attrs.evolve(attached, ready_at_outbound_cursor=ready_at_outbound_cursor),
            kv_state_endpoint=self._kv_state_endpoint,
            recovery_url=self._recovery_url,
        )

    # --- the coordinator's side ------------------------------------------------------------------------
    def request_withdrawal(self, generation: int) -> None:
        """Withdraw ``generation``'s ad (fenced: another generation's stays).  Never waits.

        Called from inside a coordinator step, whose status may be half-updated: the wanted ad is derived
        again by the driver task, not here.
        """
        self._state.withdraw(generation)
        self._update(derive=False)

    # --- the ladder's side -----------------------------------------------------------------------------
    async def stop(self) -> None:
        """Nothing is wanted any more; :meth:`run` ends once whatever may be registered is withdrawn."""
        self._open = None
        self._state.close_all()
        self._update(derive=False)

    def statistics(self) -> WithdrawalStatistics:
        return self._state.statistics()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The driver: one discovery call at a time, as the state asks; failures back off."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_status)
            task_status.started()
            delay = self._initial_backoff
            while True:
                since = self.changed.version
                self._state.want(self._wanted())
                action = self._state.next_action()
                if action is None:
                    if self._state.finished:
                        break
                    await self.changed.wait(since)
                    continue
                outcome = await self._perform(action)
                self._state.done(action, outcome)
                since = self.changed.version
                self.changed.notify()  # waiters (attach, detach, shutdown) look again
                if outcome == "failed":
                    with trio.move_on_after(delay):
                        await self.changed.wait(since + 1)  # a new input acts at once
                    delay = min(delay * 2, self._max_backoff)
                else:
                    delay = self._initial_backoff
            nursery.cancel_scope.cancel()

    # --- internals -------------------------------------------------------------------------------------
    def _wanted(self) -> DiscoveryRecord | None:
        """The open attachment's ad, if the status cell says it is ready now."""
        attached, status = self._open, self._status.get().attachment
        if attached is None or status is None or status.generation != attached.generation or not status.ready:
            return None
        return self.record_for(attached, status.ready_at_outbound_cursor)

    def _update(self, *, derive: bool) -> None:
        if derive:
            self._state.want(self._wanted())
        if self._state.obsolete and self._in_flight is not None:
            self._in_flight.cancel()  # never wait on discovery for an ad nobody wants any more
        self.changed.notify()

    async def _follow_status(self) -> None:
        """The wanted ad follows the attachment's readiness (the cell's change event is not set by cursor
        advances alone)."""
        changes = self._status.attachment_changed
        while True:
            await changes.wait(changes.version)
            self._update(derive=True)

    async def _perform(self, action: Action) -> Outcome:
        record = action.record
        generation = record.metadata.get("attachment_generation")
        with trio.CancelScope() as scope:
            self._in_flight = scope
            try:
                if isinstance(action, Register):
                    await self._discovery.register(record)
                    log.info("attachment_ad_registered", generation=generation, record_id=record.record_id)
                else:
                    await self._discovery.unregister(record.topic, record.record_id)
                    log.info("attachment_ad_withdrawn", generation=generation, record_id=record.record_id)
                return "ok"
            except Exception as exc:  # any backend failure is retried; Cancelled is not an Exception
                event = "withdrawal_retry"
                if isinstance(action, Register):
                    event, self._registration_error = "attachment_ad_registration_failed", exc
                log.warning(event, generation=generation, record_id=record.record_id, error=str(exc))
                return "failed"
            finally:
                self._in_flight = None
        return "cancelled"
