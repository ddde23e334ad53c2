"""HTTP tree dump of 1M resident blocks (``GET /v1/slots/{slot}/dump``): time and the server's peak memory.

The server runs in its own process (``python -m bench.fig_http_dump --serve BLOCKS``: an index built
directly, served by :func:`kvagent.agent.http_routes.serve_http`), so its memory is measured apart from the
client's: after the index is built its peak-RSS mark is reset (``/proc/PID/clear_refs``), and after each
dump ``VmHWM - VmRSS(before)`` is what answering cost it.  The baseline of the memory rows is the body
size: a server that buffered its answer would need at least that much more.  The client streams the body
and counts its events without keeping it (JSON: the event openings; msgpack: a streaming unpacker).

Run alone: ``python -m bench.fig_http_dump [--blocks N] [--quick]`` (writes bench/results/http_dump.json).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NAME = "http_dump"
TITLE = "HTTP tree dump: streamed, bounded server memory"
_EVENT_OPENING = b'{"worker_id":'


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _serve(blocks: int) -> None:
    """The server process: build the index, serve HTTP on port 0, print the port, run until killed."""
    from functools import partial

    import trio

    from bench.slot_fixture import BenchSlot, build_index
    from kvagent.agent.http_routes import serve_http
    from kvagent.agent.metrics import MetricSources

    class ColdSlot(BenchSlot):
        """Each dump is built from scratch: a no-op apply first drops the index's cached snapshot."""

        @property
        def index(self) -> Any:
            from bench.fig_dump import _invalidate

            _invalidate(self._index)
            return self._index

        @index.setter
        def index(self, value: Any) -> None:
            self._index = value

    slot = ColdSlot(build_index(blocks))

    async def main() -> None:
        sources = MetricSources(slots=lambda: [slot])  # type: ignore[list-item]
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, sources, port=0))
            print(f"PORT {port}", flush=True)

    trio.run(main)


def _count_json(stream: Any) -> tuple[int, int, float]:
    """(body bytes, events, seconds to the first byte) of a streamed JSON dump."""
    started = time.perf_counter()
    first = 0.0
    size = events = 0
    carry = b""
    for chunk in stream:
        if not size:
            first = time.perf_counter() - started
        size += len(chunk)
        data = carry + chunk
        events += data.count(_EVENT_OPENING)
        # Keep a tail shorter than the marker so a marker cut in two is counted once, in the next round.
        carry = data[-(len(_EVENT_OPENING) - 1) :]
    return size, events, first


def _count_msgpack(stream: Any) -> tuple[int, int, float]:
    import msgpack

    started = time.perf_counter()
    first = 0.0
    size = 0
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64 << 20)
    header: int | None = None
    fields_left = -1
    events = skipped = 0
    for chunk in stream:
        if not size:
            first = time.perf_counter() - started
        size += len(chunk)
        unpacker.feed(chunk)
        try:
            if header is None:
                header = unpacker.read_map_header()
                fields_left = header
            while fields_left > 0 and not events:
                key = unpacker.unpack()
                fields_left -= 1
                if key == "events":
                    events = unpacker.read_array_header()
                else:
                    unpacker.skip()
            while skipped < events:
                unpacker.skip()
                skipped += 1
        except msgpack.OutOfData:
            continue
    return size, skipped, first


def _dump_once(port: int, pid: int, msgpack_wanted: bool) -> dict[str, float]:
    import httpx

    before = _status_kib(pid, "VmRSS")
    reset = _reset_peak(pid)
    headers = {"accept": "application/msgpack"} if msgpack_wanted else {}
    started = time.perf_counter()
    with httpx.stream(
        "GET", f"http://127.0.0.1:{port}/v1/slots/bench/dump", headers=headers, timeout=120
    ) as response:
        response.raise_for_status()
        count = _count_msgpack if msgpack_wanted else _count_json
        size, events, first = count(response.iter_raw(1 << 20))
    seconds = time.perf_counter() - started
    peak = _status_kib(pid, "VmHWM")
    return {
        "seconds": seconds,
        "first_byte_seconds": first,
        "body_mib": size / (1 << 20),
        "events": events,
        "rss_before_mib": before / 1024,
        "peak_growth_mib": (peak - before) / 1024 if reset else float("nan"),
    }


def measure(blocks: int, repetitions: int) -> dict[str, list[dict[str, float]]]:
    """Start the server process, dump ``repetitions`` times in each encoding, stop it."""
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.fig_http_dump", "--serve", str(blocks)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = ""
        while not line.startswith("PORT "):  # the server's log lines come first
            line = server.stdout.readline()
            if not line:
                raise RuntimeError("the dump server exited before it listened")
        port = int(line.split()[1])
        runs: dict[str, list[dict[str, float]]] = {"json": [], "msgpack": []}
        for _ in range(repetitions):
            for encoding in runs:
                run = _dump_once(port, server.pid, encoding == "msgpack")
                if run["events"] != blocks:
                    raise AssertionError(f"{encoding} dump had {run['events']} events for {blocks} blocks")
                runs[encoding].append(run)
        return runs
    finally:
        server.kill()
        server.wait()


def run(result: Any, *, quick: bool, blocks: int | None = None) -> None:
    from bench.harness import Row, median

    blocks = blocks or (100_000 if quick else 1_000_000)
    repetitions = 2 if quick else 3
    result.params.update(blocks=blocks, repetitions=repetitions)
    runs = measure(blocks, repetitions)
    result.extra["runs"] = runs
    label = f"{blocks // 1000}k" if blocks < 1_000_000 else f"{blocks / 1_000_000:g}M"
    for encoding, samples in runs.items():
        seconds = [s["seconds"] for s in samples]
        growth = [s["peak_growth_mib"] for s in samples]
        body = median([s["body_mib"] for s in samples])
        result.rows.append(
            Row(
                f"http dump {label} ({encoding})",
                median(seconds),
                "s",
                higher_is_better=False,
                samples=seconds,
            )
        )
        result.rows.append(
            Row(
                f"server peak RSS growth, {label} ({encoding})",
                median(growth),
                "MiB",
                "body size",
                body,
                higher_is_better=False,
                samples=growth,
                note=f"first byte after {median([s['first_byte_seconds'] for s in samples]) * 1000:.0f} ms; "
                f"server RSS before {median([s['rss_before_mib'] for s in samples]):.0f} MiB",
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fig_http_dump", description=__doc__)
    parser.add_argument("--serve", type=int, metavar="BLOCKS", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, help="resident blocks (default 1M; 100k with --quick)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.serve is not None:
        _serve(args.serve)
        return 0
    from bench.harness import run_figure, table

    result = run_figure(NAME, TITLE, lambda figure: run(figure, quick=args.quick, blocks=args.blocks))
    print(table([result]))
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
