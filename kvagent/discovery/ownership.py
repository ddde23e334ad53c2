"""A single owner per slot: the claim an agent takes in its discovery namespace before it advertises.

Two agents serving one CacheOwnerId under one discovery namespace (one etcd prefix, one discovery directory,
one in-process memory backend) would advertise the same cache owner twice and corrupt every router's view of
it.  So a slot first *claims* its CacheOwnerId: the etcd backend puts a lease-guarded key, the file backend
holds an OS file lock, the memory backend keeps a dict; a second claim is refused with
:class:`SlotOwnershipError`, one line naming the slot and the holder.  The claim is keyed by CacheOwnerId, not
by slot name: that is the identity that collides (two hosts' ``gpu0`` of different models do not; two names
given one explicit ``--cache-owner-id`` do).  docs/discovery.md, "A single owner per slot".
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from typing import Protocol, runtime_checkable

import attrs
import structlog

from kvagent._util.sync import checkpoint
from kvagent.model.convert import register_object, structure, unstructure
from kvagent.model.errors import SlotOwnershipError

__all__ = [
    "SlotClaim",
    "SlotHolder",
    "SlotOwnership",
    "claim_slot",
    "ownership_refused",
]

log = structlog.get_logger(__name__)


@attrs.frozen(slots=True)
class SlotHolder:
    """Who holds (or wants) a slot: stored as the claim's value so a refused agent can name the holder.

    ``nonce`` tells two claims of one process apart (same host, pid and URL).
    """

    slot: str
    cache_owner_id: str
    hostname: str
    pid: int
    url: str | None
    nonce: str

    @classmethod
    def of_this_process(cls, slot: str, cache_owner_id: str, url: str | None) -> SlotHolder:
        return cls(slot, cache_owner_id, socket.gethostname(), os.getpid(), url, secrets.token_hex(8))

    def to_json(self) -> bytes:
        return json.dumps(unstructure(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SlotHolder | None:
        """The holder stored in ``data``; None for anything else (a claim written by another version, a
        file caught between truncate and write): the refusal then names an unknown holder."""
        try:
            return structure(json.loads(data), cls, what="slot holder", error=SlotOwnershipError)
        except (ValueError, SlotOwnershipError):
            return None

    def describe(self) -> str:
        where = f"{self.hostname} pid {self.pid}"
        return where if self.url is None else f"{where} ({self.url})"


register_object(SlotHolder)


def ownership_refused(wanted: SlotHolder, holder: SlotHolder | None, *, hint: str = "") -> SlotOwnershipError:
    """The one-line refusal: the slot, the holder (``hint``: where the claim is), and what to do."""
    who = "an unknown holder" if holder is None else holder.describe()
    if holder is not None and holder.slot != wanted.slot:
        return SlotOwnershipError(
            f"slot {wanted.slot!r} has the CacheOwnerId of slot {holder.slot!r}, already served by {who}{hint}; "
            "stop it or give this slot another name or --cache-owner-id"
        )
    return SlotOwnershipError(
        f"slot {wanted.slot!r} is already served by {who}{hint}; stop it or choose another --slot"
    )


class SlotClaim(Protocol):
    """A held claim; :meth:`release` gives the slot up (idempotent)."""

    async def release(self) -> None: ...


@runtime_checkable
class SlotOwnership(Protocol):
    """A discovery backend that can claim slots (all of kvagent's can; a custom backend need not)."""

    async def claim_slot(self, holder: SlotHolder) -> SlotClaim:
        """Claim ``holder.cache_owner_id`` for ``holder``; raises SlotOwnershipError if someone holds it."""
        ...


class _NoClaim:
    async def release(self) -> None:
        await checkpoint()


async def claim_slot(discovery: object, *, slot: str, cache_owner_id: str, url: str | None) -> SlotClaim:
    """Claim the slot in ``discovery`` for this process (a backend without claims: a no-op claim)."""
    if not isinstance(discovery, SlotOwnership):
        log.info("slot_ownership_unsupported", slot=slot, backend=type(discovery).__name__)
        await checkpoint()
        return _NoClaim()
    claim = await discovery.claim_slot(SlotHolder.of_this_process(slot, cache_owner_id, url))
    log.info("slot_claimed", slot=slot, cache_owner_id=cache_owner_id)
    return claim
