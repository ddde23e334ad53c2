"""``kvagent top`` in a real pseudo-terminal (pexpect) against a running ``kvagent serve --simulate``.

The screen is read as a user's terminal receives it (escape sequences stripped); pexpect is synchronous,
so it runs in a worker thread while the agent's stderr keeps being read by Trio.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pexpect
import trio

from tests.support.serve import serve

TIMEOUT = 120  # a bound, not a wait: the machine is shared and can be slow
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-Za-z]")
# One table row: slot, state, generation, cursor (cells separated by box lines).
ROW = re.compile(r"│ (?P<slot>[^│]+?)\s+│ (?P<state>\w+)\s+│\s+(?P<gen>\d+) │\s+(?P<cursor>\d+) │[^\n]*")


class Screen:
    """A ``kvagent top`` process in a pty, and everything it has drawn so far (as text)."""

    def __init__(self, url: str, *extra: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERM": "xterm-256color", "LANG": "C.UTF-8"}
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "kvagent.cli.main", "top", "--url", url, "--interval", "0.2", *extra],
            env=env,
            dimensions=(40, 160),
        )
        self.raw = b""

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", errors="replace"))

    def wait_for(self, found: Callable[[str], bool], timeout: float = 30) -> str:
        """Read until ``found(text)`` holds (bounded by ``timeout``; reads block on the pty, no sleeps)."""
        deadline = time.monotonic() + timeout
        while not found(self.text):
            left = deadline - time.monotonic()
            assert left > 0, f"screen never matched:\n{self.text[-3000:]}"
            try:
                self.raw += self.child.read_nonblocking(65536, timeout=min(left, 1.0))
            except pexpect.TIMEOUT:
                continue
            except pexpect.EOF:
                assert found(self.text), f"top exited; screen:\n{self.text[-3000:]}"
        return self.text

    def wait_exit(self) -> int:
        self.wait_for(lambda _: not self.child.isalive() and self.child.eof(), timeout=20)
        self.child.close()
        status = self.child.exitstatus
        assert isinstance(status, int), (status, self.child.signalstatus)
        return status

    def rows(self, slot: str) -> list[re.Match[str]]:
        return [m for m in ROW.finditer(self.text) if m["slot"] == slot]


def cursors(screen: Screen, slot: str) -> list[int]:
    return [int(m["cursor"]) for m in screen.rows(slot)]


def moving(slot: str, screen: Screen) -> Callable[[str], bool]:
    return lambda _: len(set(cursors(screen, slot))) >= 2


T = TypeVar("T")


async def in_thread(function: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(function)


async def test_top_shows_every_slot_its_state_and_a_moving_cursor_then_q_quits(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "demo", "--slot", "gpu 1", "--simulate") as agent:
            screen = Screen(agent.url)
            await in_thread(lambda: screen.wait_for(moving("demo", screen)))
            await in_thread(lambda: screen.wait_for(moving("gpu 1", screen)))
            for slot in ("demo", "gpu 1"):
                rows = screen.rows(slot)
                assert {m["state"] for m in rows} == {"ready"}
                assert {m["gen"] for m in rows} == {"1"}
                seen = cursors(screen, slot)
                assert seen == sorted(seen) and seen[-1] > seen[0]  # the cursor only moves forward
            # The follow streams fill in the resident blocks per tier (the simulator stores on the GPU).
            await in_thread(lambda: screen.wait_for(lambda text: re.search(r"│ dev \d+", text) is not None))
            screen.child.send("q")
            assert await in_thread(screen.wait_exit) == 0


async def test_ctrl_c_quits_cleanly(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "demo", "--simulate") as agent:
            screen = Screen(agent.url)
            await in_thread(lambda: screen.wait_for(lambda _: bool(screen.rows("demo"))))
            screen.child.sendintr()
            assert await in_thread(screen.wait_exit) == 0
            assert "Traceback" not in screen.text


async def test_the_agent_stopping_under_top_is_one_error_line(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "demo", "--simulate") as agent:
            screen = Screen(agent.url)
            await in_thread(lambda: screen.wait_for(lambda _: bool(screen.rows("demo"))))
            agent.process.send_signal(signal.SIGTERM)
            assert await in_thread(screen.wait_exit) == 1
            errors = [line for line in screen.text.splitlines() if "kvagent: error:" in line]
            assert len(errors) == 1 and agent.url in errors[0], screen.text[-2000:]
            assert "Traceback" not in screen.text


def run_top(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvagent.cli.main", "top", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


async def test_nothing_listening_is_one_line(tmp_path: Path) -> None:
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening: connections are refused
        result = await in_thread(lambda: run_top("--url", url))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("kvagent: error: cannot reach an agent at " + url)
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    bad = await in_thread(lambda: run_top("--url", "http://127.0.0.1:1"))
    assert bad.returncode == 2 and bad.stderr.startswith("kvagent: error: --url must be ws://")


async def test_once_without_a_terminal_prints_one_table(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with serve(tmp_path, "--slot", "demo", "--simulate") as agent:
            result = await in_thread(lambda: run_top("--url", agent.url, "--once"))
    assert result.returncode == 0, result.stderr
    rows = [m for m in ROW.finditer(result.stdout) if m["slot"] == "demo"]
    assert len(rows) == 1 and rows[0]["state"] == "ready"
    assert "\x1b[" not in result.stdout  # not a terminal: plain text
