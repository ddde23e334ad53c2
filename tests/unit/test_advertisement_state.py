"""The sans-IO attachment advertisement (discovery/advertisement.py): examples of each input, then a Hypothesis
state machine against a model discovery whose calls succeed, fail (having taken effect or not) or are cancelled.

The properties, checked after every step:

- discovery never holds an ad the state does not count as (possibly) registered, so it holds at most one;
- ``withdrawn(g)`` is never claimed while discovery may still hold an ad of ``g``;
- the fence: no registration is ever asked for a closed generation (nor once closing), and a closed
  generation is never wanted;
- one call at a time; a registration in flight is obsolete exactly when its record is no longer wanted or
  its generation's withdrawal was asked;
- liveness: once calls succeed, the state settles with discovery holding exactly the wanted ad.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvagent.discovery.advertisement import (
    Action,
    AdvertisementState,
    Outcome,
    Register,
    Unregister,
    ad_generation,
)
from kvagent.discovery.base import DiscoveryRecord
from kvagent.model.events import KV_STATE_ATTACHMENTS_TOPIC


def ad(generation: int, cursor: int = 0) -> DiscoveryRecord:
    metadata = {"attachment_generation": generation, "ready_at_outbound_cursor": cursor}
    return DiscoveryRecord(KV_STATE_ATTACHMENTS_TOPIC, 1000 + generation, "tcp://slot", metadata)


def step(state: AdvertisementState, outcome: Outcome = "ok") -> Action | None:
    """Make the next call and report ``outcome``."""
    action = state.next_action()
    if action is not None:
        state.done(action, outcome)
    return action


def settle(state: AdvertisementState) -> list[Action]:
    actions: list[Action] = []
    while (action := step(state)) is not None:
        actions.append(action)
        assert len(actions) < 10, actions
    return actions


# -- examples ----------------------------------------------------------------------------------------


def test_a_wanted_ad_is_registered_once() -> None:
    state = AdvertisementState()
    state.want(ad(1))
    assert settle(state) == [Register(ad(1))]
    state.want(ad(1))
    assert state.next_action() is None and state.statistics().registrations == 1


def test_a_moved_cursor_withdraws_the_old_ad_before_registering_the_new() -> None:
    state = AdvertisementState()
    state.want(ad(1, cursor=5))
    settle(state)
    state.withdraw(1)  # the coordinator: the ready cursor moved
    state.want(ad(1, cursor=9))
    assert settle(state) == [Unregister(ad(1, cursor=5)), Register(ad(1, cursor=9))]


def test_a_withdrawal_request_removes_the_ad_even_if_it_is_wanted_again_unchanged() -> None:
    state = AdvertisementState()
    state.want(ad(1))
    settle(state)
    state.withdraw(1)
    state.want(ad(1))
    assert settle(state) == [Unregister(ad(1)), Register(ad(1))]


def test_a_withdrawal_request_for_another_generation_is_fenced_off() -> None:
    state = AdvertisementState()
    state.want(ad(2))
    settle(state)
    state.withdraw(1)
    assert state.next_action() is None
    assert state.statistics().stale_withdrawals == 1


def test_a_failed_registration_counts_as_registered_until_withdrawn() -> None:
    state = AdvertisementState()
    state.want(ad(1))
    assert step(state, "failed") == Register(ad(1))
    assert not state.withdrawn(1) and not state.confirmed
    assert state.registration_outcome(1, after=0) is False
    state.close(1)
    assert settle(state) == [Unregister(ad(1))]
    assert state.withdrawn(1)
    assert state.statistics().required_withdrawals == 1


def test_a_failed_registration_is_retried_while_wanted() -> None:
    state = AdvertisementState()
    state.want(ad(1))
    step(state, "failed")
    assert settle(state) == [Register(ad(1))]
    assert state.registration_outcome(1, after=1) is True and state.confirmed


def test_a_closed_generation_is_never_wanted_again() -> None:
    state = AdvertisementState()
    state.want(ad(3))
    settle(state)
    state.close(3)
    state.want(ad(3))  # a late readiness
    assert state.wanted is None
    assert settle(state) == [Unregister(ad(3))]
    state.want(ad(4))
    assert settle(state) == [Register(ad(4))]


def test_a_registration_in_flight_is_obsolete_once_closed_or_withdrawn() -> None:
    state = AdvertisementState()
    state.want(ad(1))
    action = state.next_action()
    assert action == Register(ad(1))
    assert [state.obsolete] == [False]  # (a list: mypy would keep the narrowing across withdraw())
    assert state.held == ad(1) and not state.withdrawn(1)
    assert state.registration_outcome(1, after=0) is None
    state.withdraw(1)
    assert state.obsolete
    state.done(action, "cancelled")
    assert state.registered == ad(1)  # it may have been registered all the same
    assert settle(state) == [Unregister(ad(1))]


def test_the_outcome_for_an_ad_no_longer_due_is_true() -> None:
    state = AdvertisementState()
    state.want(ad(1))
    state.want(None)  # it left ready before anything was tried: attach then checks the attachment itself
    assert state.registration_outcome(1, after=0) is True


def test_closing_withdraws_and_finishes() -> None:
    state = AdvertisementState()
    state.want(ad(1))
    settle(state)
    state.close_all()
    state.want(ad(2))
    assert not state.finished
    assert settle(state) == [Unregister(ad(1))]
    assert state.finished


def test_done_refuses_an_action_that_is_not_in_flight() -> None:
    state = AdvertisementState()
    with pytest.raises(ValueError, match="not the action in flight"):
        state.done(Register(ad(1)), "ok")


# -- the state machine -------------------------------------------------------------------------------

GENERATIONS = st.integers(min_value=1, max_value=4)
OUTCOMES = st.sampled_from(["ok", "failed", "cancelled"])


class AdvertisementMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = AdvertisementState()
        self.discovery: dict[int, DiscoveryRecord] = {}  # record id -> record
        self.pending: Action | None = None

    # inputs
    @rule(generation=GENERATIONS, cursor=st.integers(min_value=0, max_value=2))
    def want(self, generation: int, cursor: int) -> None:
        self.state.want(ad(generation, cursor))

    @rule()
    def want_nothing(self) -> None:
        self.state.want(None)

    @rule(generation=GENERATIONS)
    def withdraw(self, generation: int) -> None:
        self.state.withdraw(generation)

    @rule(generation=GENERATIONS)
    def close(self, generation: int) -> None:
        self.state.close(generation)
        assert self.state.wanted is None or ad_generation(self.state.wanted) > generation

    @rule()
    def close_all(self) -> None:
        self.state.close_all()

    # the driver
    @precondition(lambda self: self.pending is None)
    @rule()
    def begin(self) -> None:
        action = self.state.next_action()
        if isinstance(action, Register):
            generation = ad_generation(action.record)
            assert generation > self.state.fence and not self.state.closing, "the fence was crossed"
            assert action.record == self.state.wanted
        self.pending = action

    @precondition(lambda self: self.pending is not None)
    @rule(outcome=OUTCOMES, took_effect=st.booleans())
    def end(self, outcome: Outcome, took_effect: bool) -> None:
        action = self.pending
        assert action is not None
        if outcome == "ok" or took_effect:  # a failed or cancelled call may have reached discovery
            record = action.record
            if isinstance(action, Register):
                self.discovery[record.record_id] = record
            else:
                self.discovery.pop(record.record_id, None)
        self.state.done(action, outcome)
        self.pending = None

    @precondition(lambda self: self.pending is None)
    @rule()
    def settle_with_a_healthy_discovery(self) -> None:
        for _ in range(10):
            action = self.state.next_action()
            if action is None:
                break
            self.pending = action
            self.end("ok", True)
        assert self.state.next_action() is None
        wanted = self.state.wanted
        assert self.discovery == ({} if wanted is None else {wanted.record_id: wanted})
        assert self.state.registered == wanted and (wanted is None or self.state.confirmed)
        assert self.state.finished == self.state.closing

    # properties
    @invariant()
    def discovery_holds_at_most_what_may_be_registered(self) -> None:
        registered = self.state.registered
        allowed = {} if registered is None else {registered.record_id: registered}
        in_flight = self.state.in_flight
        if isinstance(in_flight, Register):  # about to be counted as (possibly) registered
            allowed[in_flight.record.record_id] = in_flight.record
        assert all(allowed.get(key) == record for key, record in self.discovery.items())
        assert len(self.discovery) <= 1

    @invariant()
    def withdrawn_is_never_claimed_early(self) -> None:
        for generation in range(1, 5):
            if self.state.withdrawn(generation):
                assert all(ad_generation(record) != generation for record in self.discovery.values())

    @invariant()
    def a_closed_generation_is_never_wanted(self) -> None:
        wanted = self.state.wanted
        assert wanted is None or (ad_generation(wanted) > self.state.fence and not self.state.closing)

    @invariant()
    def obsolete_only_for_a_registration_in_flight(self) -> None:
        if self.state.obsolete:
            assert isinstance(self.state.in_flight, Register)
            assert self.state.in_flight.record != self.state.wanted or not self.state.withdrawn(
                ad_generation(self.state.in_flight.record)
            )

    @invariant()
    def the_pending_call_is_the_one_in_flight(self) -> None:
        assert self.state.in_flight == self.pending


AdvertisementMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_advertisement_state_machine = AdvertisementMachine.TestCase
