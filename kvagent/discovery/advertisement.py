"""The attachment advertisement of one slot, as sans-IO state: what should be in discovery, what may be, and
the generation fence; it says which discovery call to make next (docs/spec/agent-semantics.md 6.3, 7.4, 7.6).

One task drives it (:class:`kvagent.agent.advertising.AttachmentAdvertiser`): it feeds the inputs, asks
:meth:`AdvertisementState.next_action` for the one :class:`Register` or :class:`Unregister` to make, makes it,
and reports how it went with :meth:`AdvertisementState.done`.  Nothing else registers or withdraws the ad.

The inputs:

- :meth:`~AdvertisementState.want`: the ad that should exist now (the open attachment's, while it is ready,
  at its ``ready_at_outbound_cursor``), or None;
- :meth:`~AdvertisementState.withdraw`: the coordinator's request that generation ``g``'s ad go (it left
  ready, or its ready cursor moved): whatever of ``g`` may be registered is withdrawn, even if it is wanted
  again right after (then it is registered anew);
- :meth:`~AdvertisementState.close`: the slot task closed generation ``g`` (detach, quarantine, a rolled
  back attach, the shutdown).  The fence: no generation up to ``g`` is ever wanted again, so a late
  readiness can never resurrect a closed attachment's ad;
- :meth:`~AdvertisementState.close_all`: the slot is stopping; nothing is wanted any more.

The state keeps ``registered``, the record that *may* be in discovery: a registration whose outcome is
unknown (it failed, or was cancelled) counts, so it is withdrawn before anything else is registered and
``withdrawn(g)`` is never claimed early.  A registration in flight whose record is no longer wanted is
:attr:`~AdvertisementState.obsolete`: the driver cancels it rather than wait for a discovery that hangs.
"""

from __future__ import annotations

from typing import Literal

import attrs

from kvagent.discovery.base import DiscoveryRecord

__all__ = [
    "Action",
    "AdvertisementState",
    "Outcome",
    "Register",
    "Unregister",
    "WithdrawalStatistics",
    "ad_generation",
]

Outcome = Literal["ok", "failed", "cancelled"]


@attrs.frozen(slots=True)
class Register:
    """Register ``record`` (the driver calls ``discovery.register``)."""

    record: DiscoveryRecord


@attrs.frozen(slots=True)
class Unregister:
    """Withdraw ``record`` (the driver calls ``discovery.unregister``)."""

    record: DiscoveryRecord


Action = Register | Unregister


@attrs.frozen(slots=True)
class WithdrawalStatistics:
    """The advertisement counters of one slot at one instant (never reset).

    Attributes:
      withdrawals: attachment ads withdrawn (every successful unregister).
      retries: failed withdrawals, retried with backoff.
      stale_withdrawals: withdrawal requests fenced off: nothing of that generation was registered.
      required_withdrawals: withdrawals of a generation the slot task closed (detach, quarantine, rollback,
        shutdown), which it may wait for.
      registrations: successful registrations.
      registration_failures: failed registrations (retried while the ad is wanted).
    """

    withdrawals: int
    retries: int
    stale_withdrawals: int
    required_withdrawals: int
    registrations: int = 0
    registration_failures: int = 0


def ad_generation(record: DiscoveryRecord) -> int:
    """The attachment generation an attachment ad names (``attachment_generation``, ads.py)."""
    generation = record.metadata["attachment_generation"]
    if not isinstance(generation, int):
        raise TypeError(f"not an attachment ad: {record!r}")
    return generation


class AdvertisementState:
    """Wanted record, registered record and generation fence, giving the next discovery call (module doc)."""

    def __init__(self) -> None:
        self.wanted: DiscoveryRecord | None = None
        self.registered: DiscoveryRecord | None = None  # may be in discovery
        self.confirmed = False  # ``registered`` is known to be in discovery
        self.fence = 0  # generations up to this one are closed: never wanted again
        self.closing = False
        self.in_flight: Action | None = None
        self._withdraw_due: int | None = None  # the coordinator asked this generation's ad to go
        self._completed_registrations = 0  # attempts that ended, whatever the outcome
        self._last_registration: tuple[int, bool] = (0, True)  # (generation, not failed)
        self._withdrawals = 0
        self._retries = 0
        self._stale = 0
        self._required = 0
        self._registrations = 0
        self._registration_failures = 0

    # --- inputs ----------------------------------------------------------------------------------------
    def want(self, record: DiscoveryRecord | None) -> None:
        """The ad that should exist now; one of a closed generation (or any, once closing) is refused."""
        if record is not None and (self.closing or ad_generation(record) <= self.fence):
            record = None
        self.wanted = record

    def withdraw(self, generation: int) -> None:
        """The coordinator's request: ``generation``'s ad goes (fenced: another generation's is left alone)."""
        if self.wanted is not None and ad_generation(self.wanted) == generation:
            self.wanted = None
        if self.withdrawn(generation):
            self._stale += 1  # nothing of it is, or may be, registered
            return
        self._withdraw_due = generation

    def close(self, generation: int) -> None:
        """The slot task closed ``generation`` (and every older one): their ads go and never come back."""
        self.fence = max(self.fence, generation)
        self.want(self.wanted)

    def close_all(self) -> None:
        """The slot is stopping: nothing is wanted any more."""
        self.closing = True
        self.wanted = None

    # --- the driver ------------------------------------------------------------------------------------
    def next_action(self) -> Action | None:
        """The one discovery call to make now (then it is in flight until :meth:`done`), or None."""
        if self.in_flight is not None:
            return None
        registered, wanted = self.registered, self.wanted
        action: Action | None = None
        if registered is not None and (
            registered != wanted or self._withdraw_due == ad_generation(registered)
        ):
            action = Unregister(registered)
        elif wanted is not None and not (self.confirmed and registered == wanted):
            action = Register(wanted)
        self.in_flight = action
        return action

    @property
    def obsolete(self) -> bool:
        """The registration in flight is no longer wanted: cancel it (its record then counts as registered)."""
        record = self._registering()
        return record is not None and (record != self.wanted or self._withdraw_due == ad_generation(record))

    def done(self, action: Action, outcome: Outcome) -> None:
        """How the in-flight ``action`` went."""
        if action != self.in_flight:
            raise ValueError(f"{action!r} is not the action in flight ({self.in_flight!r})")
        self.in_flight = None
        record = action.record
        generation = ad_generation(record)
        if isinstance(action, Register):
            # Failed or cancelled, it may have been registered all the same: it is withdrawn before anything else.
            self.registered = record
            self.confirmed = outcome == "ok"
            self._completed_registrations += 1
            self._last_registration = (generation, outcome != "failed")
            if outcome == "ok":
                self._registrations += 1
            elif outcome == "failed":
                self._registration_failures += 1
            return
        if outcome == "ok":
            self.registered = None
            self.confirmed = False
            self._withdrawals += 1
            if generation <= self.fence or self.closing:
                self._required += 1
            if self._withdraw_due == generation:
                self._withdraw_due = None
        elif outcome == "failed":
            self._retries += 1

    # --- what callers wait for -------------------------------------------------------------------------
    def withdrawn(self, generation: int) -> bool:
        """No ad of ``generation`` is, or may be, in discovery (nor being registered)."""
        return all(
            record is None or ad_generation(record) != generation
            for record in (self.registered, self._registering())
        )

    @property
    def held(self) -> DiscoveryRecord | None:
        """The ad that is, or may be, in discovery, counting one being registered now."""
        return self.registered if self.registered is not None else self._registering()

    @property
    def finished(self) -> bool:
        """Closing, and nothing is, or may be, registered: the driver is done."""
        return self.closing and self.registered is None and self.in_flight is None

    @property
    def completed_registrations(self) -> int:
        """Registration attempts ended so far (note it before waiting on :meth:`registration_outcome`)."""
        return self._completed_registrations

    def registration_outcome(self, generation: int, *, after: int) -> bool | None:
        """After ``after`` completed attempts: True if ``generation``'s ad got registered, or is no longer
        due; False if its registration failed; None while it is due or in flight."""
        if self._completed_registrations > after and self._last_registration[0] == generation:
            return self._last_registration[1]
        wanted = self.wanted
        due = wanted is not None and ad_generation(wanted) == generation
        due = due and not (self.confirmed and self.registered == wanted)
        registering = self._registering()
        if due or (registering is not None and ad_generation(registering) == generation):
            return None
        return True

    def statistics(self) -> WithdrawalStatistics:
        return WithdrawalStatistics(
            withdrawals=self._withdrawals,
            retries=self._retries,
            stale_withdrawals=self._stale,
            required_withdrawals=self._required,
            registrations=self._registrations,
            registration_failures=self._registration_failures,
        )

    def _registering(self) -> DiscoveryRecord | None:
        return self.in_flight.record if isinstance(self.in_flight, Register) else None
