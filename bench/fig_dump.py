"""Figure 2: tree dump of 10k / 100k / 1M resident blocks, in-process and through the real websocket server."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import msgpack
import trio

from bench.harness import FigureResult, Row, median
from bench.slot_fixture import BenchSlot, build_index

NAME = "dump"
TITLE = "Tree dump: websocket client receives the whole dump"


def _invalidate(index: Any) -> None:
    """Apply a no-op remove so the next dump is built from scratch (dumps are cached until an apply)."""
    from bench.agent_run import WORKER_ID
    from kvagent.model.events import Removed, ResidencyDomain, RouterEvent, StorageTier

    event_id = index.current_event_id() + 1
    index.apply(
        RouterEvent(WORKER_ID, StorageTier.DEVICE, ResidencyDomain.WORKER, event_id, Removed((1,)), 0)
    )


async def _client_dumps(index: Any, repetitions: int, dump_format: str, lazy: bool = False) -> list[float]:
    """Seconds until the client holds the whole dump: ``columns`` arrays, or ``events`` as wire maps.

    The events format is read with ``raw_events=True`` (no RouterEvent objects), as a router rebuilding its
    own tree would; RouterEvent decoding adds about 55 us per event on top.  ``lazy`` leaves the events
    encoded (server build + transfer only).
    """
    from kvagent.agent.host import SlotRegistry
    from kvagent.recovery.client import connect_slot
    from kvagent.recovery.server import serve_recovery

    registry = SlotRegistry()
    registry.add(BenchSlot(index))
    seconds: list[float] = []
    async with trio.open_nursery() as nursery:
        info = await nursery.start(partial(serve_recovery, registry, host="127.0.0.1", port=0))
        async with connect_slot(f"ws://127.0.0.1:{info.port}", "bench", encoding="msgpack") as client:
            for _ in range(repetitions):
                _invalidate(index)
                started = time.perf_counter()
                answer = await client.recover(
                    None, dump_format=dump_format, raw_events=True, lazy_events=lazy
                )
                seconds.append(time.perf_counter() - started)
                received = len(answer.wire_events) + sum(piece.live for piece in answer.dump)
                for blob in answer.events_msgpack:
                    unpacker = msgpack.Unpacker()
                    unpacker.feed(blob)
                    received += unpacker.read_array_header()
                if received != index.resident_block_count:
                    raise AssertionError(
                        f"dump had {received} events for {index.resident_block_count} blocks"
                    )
        nursery.cancel_scope.cancel()
    return seconds


async def _lite_dumps(index: Any, repetitions: int, dump_format: str) -> list[float]:
    """Seconds until a minimal client (bench/lite_ws.py) holds every frame of the dump, events left encoded.

    What the server and the transfer cost without the reference client's own work (trio-websocket and
    wsproto parse every 64 KiB websocket frame in Python, and the reference client walks each answer frame
    to find its end).  Each frame's events are counted from their msgpack array header (the header keys
    come first; ``more`` is the frame's last key).
    """
    from bench.lite_ws import LiteWebSocket
    from kvagent.agent.host import SlotRegistry
    from kvagent.recovery.server import serve_recovery

    registry = SlotRegistry()
    registry.add(BenchSlot(index))
    seconds: list[float] = []
    last_key = b"\xa4more"
    async with trio.open_nursery() as nursery:
        info = await nursery.start(partial(serve_recovery, registry, host="127.0.0.1", port=0))
        ws = await LiteWebSocket.connect("127.0.0.1", info.port, "/v1/slots/bench")
        for number in range(repetitions):
            _invalidate(index)
            started = time.perf_counter()
            await ws.send(
                msgpack.packb({"id": number, "op": "recover", "start": None, "dump_format": dump_format})
            )
            received = 0
            while True:
                frame = await ws.receive()
                unpacker = msgpack.Unpacker(max_buffer_size=len(frame))
                unpacker.feed(frame)
                for _ in range(unpacker.read_map_header()):
                    key = unpacker.unpack()
                    if key == "events":
                        received += unpacker.read_array_header()
                        break
                    if key == "groups":
                        received += sum(
                            piece["rows"] - piece["flags"].count(2) for piece in unpacker.unpack()
                        )
                        break
                    unpacker.unpack()
                if frame[-len(last_key) - 1 : -1] != last_key:
                    raise AssertionError("a dump frame must end with its more flag")
                if frame[-1] == 0xC2:  # more: false
                    break
            seconds.append(time.perf_counter() - started)
            if received != index.resident_block_count:
                raise AssertionError(f"dump had {received} events for {index.resident_block_count} blocks")
        await ws.aclose()
        nursery.cancel_scope.cancel()
    return seconds


def _baseline(blocks: int, repetitions: int) -> list[float]:
    """msgpack-encode ``blocks`` plain block dicts: the floor for any dump encoding."""
    import random

    rng = random.Random(3)
    dicts = [
        {
            "block_hash": rng.getrandbits(64),
            "parent_hash": rng.getrandbits(64),
            "tokens_hash": rng.getrandbits(64),
        }
        for _ in range(blocks)
    ]
    seconds = []
    for _ in range(repetitions):
        started = time.perf_counter()
        msgpack.packb(dicts)
        seconds.append(time.perf_counter() - started)
    return seconds


def run(result: FigureResult, *, quick: bool) -> None:
    sizes = [10_000, 100_000] if quick else [10_000, 100_000, 1_000_000]
    result.params["sizes"] = sizes
    for blocks in sizes:
        repetitions = 3 if blocks < 1_000_000 else 2
        index = build_index(blocks)
        in_process = []
        snapshots = []
        for _ in range(repetitions):
            _invalidate(index)
            started = time.perf_counter()
            index.dump_snapshot()
            snapshots.append(time.perf_counter() - started)
            started = time.perf_counter()
            index.tree_dump()
            in_process.append(time.perf_counter() - started)
        base = _baseline(blocks, repetitions)
        label = f"{blocks // 1000}k" if blocks < 1_000_000 else f"{blocks // 1_000_000}M"
        variants = (
            ("columns", False, "<= 1 s" if blocks == 1_000_000 else ""),
            ("events", False, ""),
            ("events", True, ""),
        )
        for dump_format, lazy, target in variants:
            name = f"ws dump {label} ({dump_format}{', undecoded' if lazy else ''})"
            try:
                client = trio.run(_client_dumps, index, repetitions, dump_format, lazy)
            except Exception as exc:
                result.rows.append(Row(name, None, "s", note=f"error: {type(exc).__name__}: {exc}"))
                continue
            result.rows.append(
                Row(
                    name,
                    median(client),
                    "s",
                    "msgpack encode of block dicts",
                    median(base),
                    target=target,
                    higher_is_better=False,
                    samples=client,
                    baseline_samples=base,
                )
            )
        for dump_format in ("columns", "events"):
            name = f"ws dump {label} ({dump_format}, lite client, undecoded)"
            target = ("<= 0.1 s" if dump_format == "columns" else "<= 0.3 s") if blocks == 1_000_000 else ""
            try:
                lite = trio.run(_lite_dumps, index, repetitions, dump_format)
            except Exception as exc:
                result.rows.append(Row(name, None, "s", note=f"error: {type(exc).__name__}: {exc}"))
                continue
            result.rows.append(
                Row(
                    name,
                    median(lite),
                    "s",
                    "msgpack encode of block dicts",
                    median(base),
                    target=target,
                    higher_is_better=False,
                    samples=lite,
                    baseline_samples=base,
                )
            )
        result.rows.append(
            Row(
                f"dump_snapshot() {label}",
                median(snapshots),
                "s",
                "msgpack encode of block dicts",
                median(base),
                higher_is_better=False,
                samples=snapshots,
                baseline_samples=base,
            )
        )
        result.rows.append(
            Row(
                f"tree_dump() {label}",
                median(in_process),
                "s",
                "msgpack encode of block dicts",
                median(base),
                higher_is_better=False,
                samples=in_process,
                baseline_samples=base,
            )
        )
        del index
