"""The websocket server's CPU per answered request, for one or more kvagent checkouts side by side.

``python -m bench.ws_request_cpu [TREE ...]`` (default: this checkout; e.g. an export of another commit
beside it).  Each run serves one in-memory slot (300 blocks, no ingest) from a fresh server process of
that tree, and 64 ``lite`` clients send back-to-back ``recover`` requests (the last 200 events, msgpack,
``dump_format: "columns"``) for 4 s; the figure is the server process's CPU seconds over that window
divided by the answers.  The trees alternate within every repetition, so foreign load on a shared
machine falls on each alike.  CPU per request is far less sensitive to that load than latency is (it
still falls as more requests share a scheduling round).
"""

from __future__ import annotations

import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import trio

CLIENTS = 64
SECONDS = 4.0
REPETITIONS = 5
BLOCKS = 300


async def _serve(tree: str) -> None:
    from kvagent.agent.host import SlotRegistry
    from kvagent.recovery.server import RecoveryServerInfo, serve_recovery
    from tests.support.recovery import FakeSlot

    slot = FakeSlot()
    for block in range(BLOCKS):
        slot.store_worker(block)
    registry = SlotRegistry()
    registry.add(slot)
    async with trio.open_nursery() as nursery:
        info: RecoveryServerInfo = await nursery.start(
            partial(serve_recovery, registry, host="127.0.0.1", port=0, max_connections=1024)
        )
        sys.stdout.write(f"PORT {info.port} {time.process_time()}\n")
        sys.stdout.flush()
        await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes our stdin
        sys.stdout.write(f"CPU {time.process_time()}\n")
        sys.stdout.flush()
        nursery.cancel_scope.cancel()


async def _clients(port: int) -> int:
    from bench.lite_ws import LiteWebSocket
    from bench.serving_clients import _frame_head

    answered = 0
    deadline = trio.current_time() + SECONDS

    async def one() -> None:
        nonlocal answered
        ws = await LiteWebSocket.connect("127.0.0.1", port, "/v1/slots/a")
        request_id = 0
        while trio.current_time() < deadline:
            request_id += 1
            await ws.send(
                msgpack.packb({"id": request_id, "op": "recover", "start": 100, "dump_format": "columns"})
            )
            while True:
                head = _frame_head(await ws.receive())
                if head.get("id") == request_id and not head.get("more"):
                    break
            answered += 1
        await ws.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(CLIENTS):
            nursery.start_soon(one)
    return answered


def _line(process: subprocess.Popen[str], tag: str) -> list[str]:
    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the server ended before printing {tag}")
        if line.startswith(tag + " "):
            return line.split()[1:]


def one_run(tree: str) -> dict[str, Any]:
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.ws_request_cpu", "--serve", tree],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tree,
    )
    port, cpu_started = _line(server, "PORT")
    answered = trio.run(_clients, int(port))
    assert server.stdin is not None
    server.stdin.close()
    (cpu_ended,) = _line(server, "CPU")
    server.wait()
    cpu = float(cpu_ended) - float(cpu_started)
    return {"answered": answered, "server_cpu_seconds": cpu, "us_per_request": cpu / answered * 1e6}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--serve"]:
        sys.path.insert(0, argv[1])
        trio.run(_serve, argv[1])
        return
    trees = argv or [str(Path(__file__).resolve().parents[1])]
    results: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for _ in range(REPETITIONS):
        for tree in trees:
            run = one_run(tree)
            results[tree].append(run)
            print(
                f"{tree}: {run['answered']} answers, {run['us_per_request']:.0f} us of server CPU each",
                flush=True,
            )
    for tree, runs in results.items():
        costs = sorted(run["us_per_request"] for run in runs)
        print(
            f"{tree}: median {costs[len(costs) // 2]:.0f} us per request ({', '.join(f'{c:.0f}' for c in costs)})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
