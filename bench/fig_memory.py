"""Figure 3: memory per resident block at 1M blocks, vs a plain dict.

The headline (issue #18) is the RSS growth of a real ``kvagent serve`` process per resident block, default
configuration (persistence on, no republish), fed the ingest trace (bench/serve_memory.py).  The index alone
is measured too, each in a fresh spawned process so RSS is not polluted by earlier figures' heaps.
"""

from __future__ import annotations

import gc
import multiprocessing
import random
import tracemalloc
from typing import Any

from bench.harness import FigureResult, Row, median, rss_bytes
from bench.serve_memory import measure_serve

NAME = "memory"
TITLE = "Memory per resident block at 1M blocks"
BLOCKS = 1_000_000
# 50k batches of the ingest trace leave about 1.0M resident blocks; paced below the agent's rate (no shedding).
SERVE_BATCHES = 50_000
SERVE_RATE = 12_000.0


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
    random.seed(0)
    result.params.update(blocks=BLOCKS, serve_batches=SERVE_BATCHES, serve_rate_events_per_s=SERVE_RATE)
    rss_index, rss_dict = measure("index", BLOCKS, False), measure("dict", BLOCKS, False)
    serve_runs = [measure_serve(SERVE_BATCHES, SERVE_RATE) for _ in range(1 if quick else 3)]
    result.extra["serve_runs"] = serve_runs
    per_block = [run["bytes_per_block"] for run in serve_runs]
    lost = sum(run["lost_events"] for run in serve_runs)
    result.rows.append(
        Row(
            "serve RSS / resident block",
            median(per_block),
            "B",
            "dict[int, tuple[int, int]]",
            rss_dict / BLOCKS,
            target="<= 200 B (issue #25)",
            higher_is_better=False,
            samples=per_block,
            note=f"{serve_runs[0]['resident_blocks']} blocks, {lost} events lost",
        )
    )
    if quick:
        return
    traced_index, traced_dict = measure("index", BLOCKS, True), measure("dict", BLOCKS, True)
    result.rows += [
        Row(
            "index alone: RSS / block",
            rss_index / BLOCKS,
            "B",
            "dict[int, tuple[int, int]]",
            rss_dict / BLOCKS,
            higher_is_better=False,
        ),
        Row(
            "index alone: tracemalloc / block",
            traced_index / BLOCKS,
            "B",
            "dict[int, tuple[int, int]]",
            traced_dict / BLOCKS,
            higher_is_better=False,
        ),
    ]
