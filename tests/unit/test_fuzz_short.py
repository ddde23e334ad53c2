"""CI's short fuzz run: generated and mutated inputs through decode + normalize + chunking."""

from __future__ import annotations

from tests.support.fuzz_decoder import run


def test_short_fuzz_run_has_no_unexpected_exceptions() -> None:
    assert run(3000, seed=2) == 0
