"""``python -m bench [names...] [--quick] [--peer dynamo|none]``: run the figures, write bench/results/*.json
+ *.png, print a table.

``--peer dynamo`` makes ``ingest`` the side-by-side figure (``peer``: kvagent serve and Dynamo's standalone
indexer on the same stream, burst + paced 2k/10k + RSS per block) and installs Dynamo into a venv of its own
when none is found (bench/dynamo_env.py); ``python -m bench peer`` runs that figure with a Dynamo venv that
already exists, else kvagent alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import ModuleType

from bench import (
    fig_cpu,
    fig_dump,
    fig_fleet,
    fig_http_dump,
    fig_ingest,
    fig_memory,
    fig_peer,
    fig_persistence,
    fig_recover,
    fig_serving,
    fig_stream_entries,
)
from bench.harness import RESULTS_DIR, FigureResult, run_figure, table

FIGURES: dict[str, ModuleType] = {
    module.NAME: module
    for module in (
        fig_ingest, fig_peer, fig_dump, fig_memory, fig_recover, fig_cpu, fig_serving, fig_http_dump,
        fig_persistence, fig_fleet, fig_stream_entries,
    )
}


def peer_note(results: list[FigureResult]) -> str:
    for result in results:
        if result.name == fig_peer.NAME:
            return f"side-by-side peer: {result.params.get('peer', 'not run')}"
    return "the side-by-side Dynamo figure was not run (python -m bench ingest --peer dynamo)."


def selected(names: list[str], peer: str | None) -> list[str]:
    """The figures to run; with --peer, ``ingest`` is the side-by-side figure."""
    chosen = names or list(FIGURES)
    if peer is not None:
        chosen = [fig_peer.NAME if name == fig_ingest.NAME else name for name in chosen]
    return list(dict.fromkeys(chosen))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"figures to run (default: all of {', '.join(FIGURES)})")
    parser.add_argument("--quick", action="store_true", help="smaller traces and shorter windows")
    parser.add_argument("--peer", choices=("dynamo", "none"),
                        help="ingest side by side with Dynamo's indexer (installed if needed), or kvagent alone")
    parser.add_argument("--slots", type=int, help="fleet: N slots on a private 3-master Redis Cluster")
    args = parser.parse_args(argv)
    fig_peer.peer_choice = args.peer
    fig_fleet.slots_choice = args.slots
    names = selected(args.names, args.peer)
    unknown = [name for name in names if name not in FIGURES]
    if unknown:
        parser.error(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    results: list[FigureResult] = []
    started = time.perf_counter()
    for name in names:
        module = FIGURES[name]
        print(f"== {name}: {module.TITLE}", flush=True)

        def body(result: FigureResult, module: ModuleType = module) -> None:
            result.params["quick"] = args.quick
            module.run(result, quick=args.quick)

        result = run_figure(name, module.TITLE, body)
        results.append(result)
        status = f"error: {result.error}" if result.error else "ok"
        print(f"   {status} ({result.seconds:.1f} s)", flush=True)
    print()
    print(table(results))
    print()
    print(peer_note(results))
    print(f"results in {RESULTS_DIR} ({time.perf_counter() - started:.0f} s total)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
