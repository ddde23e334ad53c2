"""kvagent._util.malloc: with the mmap threshold fixed, freed big buffers leave the process (glibc)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvagent._util.malloc import keep_large_allocations_mapped

# Frees one 16 MiB mapping (which, untuned, raises glibc's mmap threshold to 16 MiB), then allocates 200
# buffers of 256 KiB with a small malloc'd object after each (so freed buffers cannot merge into the heap's top),
# frees the buffers and prints how much of their 50 MiB the process still holds.
_PROBE = """
import sys
from kvagent._util.malloc import keep_large_allocations_mapped
tuned = sys.argv[1] == "tuned" and keep_large_allocations_mapped()
def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096
big = bytearray(16 << 20)
del big
before = rss()
buffers, pins = [], []
for _ in range(200):
    buffers.append(bytearray(1 << 18))  # zero-filled, so its pages are touched
    pins.append(bytearray(1000))  # over 512 B: from malloc, between the buffers
del buffers
print(tuned, (rss() - before) >> 20)
"""


def _held_mib(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    tuned, held = out.stdout.split()
    return tuned == "True", int(held)


@pytest.mark.skipif(not keep_large_allocations_mapped(), reason="glibc's mallopt is not available")
def test_freed_big_buffers_are_returned_once_the_threshold_is_fixed() -> None:
    tuned, held = _held_mib("tuned")
    assert tuned
    assert held < 10  # of 50 MiB freed: only the small pinned objects and noise remain
    # Untuned, glibc keeps some or all of them in its heap (17 to 50 MiB here, depending on the heap's
    # history), which is why nothing is asserted about that case.
    untuned, _ = _held_mib("untuned")
    assert not untuned


def test_it_is_idempotent_and_reports_the_same_answer() -> None:
    first = keep_large_allocations_mapped()
    assert keep_large_allocations_mapped() is first
