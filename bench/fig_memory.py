"""Figure 3: memory per resident block at 1M blocks (RSS delta and tracemalloc), vs a plain dict.

Each measurement runs in a fresh spawned process so RSS is not polluted by earlier figures' heaps.
"""

from __future__ import annotations

import gc
import multiprocessing
import random
import tracemalloc
from typing import Any

from bench.harness import FigureResult, Row, rss_bytes

NAME = "memory"
TITLE = "Memory per resident block at 1M blocks"
BLOCKS = 1_000_000


def _build(kind: str, blocks: int, traced: bool) -> int:
    """Bytes attributed to ``blocks`` resident blocks of ``kind`` (RSS delta, or tracemalloc when traced)."""
    from bench.slot_fixture import stored_events

    gc.collect()
    if traced:
        tracemalloc.start()
    before = rss_bytes()
    keep: Any
    if kind == "index":
        from kvagent.index.recovery_index import RecoveryIndex

        keep = RecoveryIndex(16)
        for event in stored_events(blocks):
            keep.apply(event)
    else:
        # The same blocks as the index holds: hash → (parent hash, tokens hash).
        keep = {}
        for event in stored_events(blocks):
            parent = event.data.parent_hash or 0
            for block, tokens in zip(event.data.block_hashes, event.data.tokens_hashes, strict=True):
                keep[block] = (parent, tokens)
                parent = block
    gc.collect()
    if traced:
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        used = size
    else:
        used = rss_bytes() - before
    del keep
    return used


def _child(conn: Any, kind: str, blocks: int, traced: bool) -> None:
    try:
        conn.send(("ok", _build(kind, blocks, traced)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def measure(kind: str, blocks: int, traced: bool) -> int:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_child, args=(child, kind, blocks, traced))
    process.start()
    child.close()
    if not parent.poll(600):
        process.kill()
        raise TimeoutError(f"memory measurement of {kind} did not finish")
    status, value = parent.recv()
    process.join()
    if status != "ok":
        raise RuntimeError(value)
    return int(value)


def run(result: FigureResult, *, quick: bool) -> None:
    del quick  # the figure is defined at 1M blocks; one repetition each (RSS deltas are deterministic enough)
    random.seed(0)
    result.params["blocks"] = BLOCKS
    rss_index, rss_dict = measure("index", BLOCKS, False), measure("dict", BLOCKS, False)
    traced_index, traced_dict = measure("index", BLOCKS, True), measure("dict", BLOCKS, True)
    result.rows += [
        Row("RSS / block", rss_index / BLOCKS, "B", "dict[int, tuple[int, int]]", rss_dict / BLOCKS,
            target="<= 200 B", higher_is_better=False),
        Row("tracemalloc / block", traced_index / BLOCKS, "B", "dict[int, tuple[int, int]]",
            traced_dict / BLOCKS, target="<= 200 B", higher_is_better=False),
    ]
