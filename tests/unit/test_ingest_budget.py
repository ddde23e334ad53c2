"""The ingest budget: one setting (``ListenerOptions.ingress_bytes``), its split owned by IngestBudget."""

from __future__ import annotations

import pytest

from kvagent.vllm.budget import MIN_RCVHWM, IngestBudget
from kvagent.vllm.listener import ListenerOptions

MiB = 1 << 20


def test_the_split_adds_up_and_each_share_holds_two_of_the_largest_batches() -> None:
    budget = IngestBudget(total=64 * MiB + 1, max_payload_bytes=8 * MiB)
    assert budget.listener_bytes + budget.coordinator_bytes == budget.total
    assert min(budget.listener_bytes, budget.coordinator_bytes) >= 2 * budget.max_payload_bytes
    assert budget.reply_bytes == budget.libzmq_bytes == budget.listener_bytes // 4


def test_a_budget_too_small_for_the_largest_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 4 x max_payload_bytes"):
        IngestBudget(total=4 * MiB - 1, max_payload_bytes=MiB)
    with pytest.raises(ValueError, match="at least 4 x max_payload_bytes"):
        ListenerOptions(ingress_bytes=4 * MiB - 1, max_payload_bytes=MiB)


def test_the_rcvhwm_holds_libzmqs_share_in_the_largest_message_seen() -> None:
    budget = IngestBudget(total=64 * MiB, max_payload_bytes=8 * MiB)
    assert budget.libzmq_bytes == 8 * MiB and budget.smallest_fitted_message == 256 << 10
    assert budget.rcvhwm(1000, 0) == 32  # before any message: fitted to 1/32 of the largest allowed
    assert budget.rcvhwm(1000, 10_000) == 32  # small messages: never fitted to less than that
    assert budget.rcvhwm(1000, MiB) == 8  # 8 MiB / 1 MiB
    assert budget.rcvhwm(1000, 4 * MiB) == MIN_RCVHWM
    assert budget.rcvhwm(2, 2 * MiB) == 2  # never above the configured bound
    small = IngestBudget(total=256 * MiB, max_payload_bytes=MiB)
    assert small.rcvhwm(1000, 100) == 1000  # 32 MiB / 32 KiB = 1024, bounded by the configured 1000
    assert small.rcvhwm(0, 100) == 1024  # 0: no configured bound


def test_listener_options_derive_their_budget_from_the_one_setting() -> None:
    options = ListenerOptions(ingress_bytes=32 * MiB, max_payload_bytes=MiB)
    assert options.budget == IngestBudget(32 * MiB, MiB)
    assert not hasattr(options, "batch_messages")
