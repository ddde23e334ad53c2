"""The examples run as shipped."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import trio

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def test_trio_host_example_runs_two_slots(capfd: object) -> None:
    namespace = runpy.run_path(str(EXAMPLES / "trio_host.py"), run_name="example")
    with trio.fail_after(30):
        await namespace["main"](rounds=2)
    out = capfd.readouterr().out  # type: ignore[attr-defined]
    assert "slot-a: cursor" in out and "slot-b: cursor" in out


async def test_fake_vllm_example_starts() -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, str(EXAMPLES / "fake_vllm.py"), "--help"], stdout=-1
    )
    with trio.fail_after(30):
        assert await process.wait() == 0
