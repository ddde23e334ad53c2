"""``python -m bench [names...] [--quick]``: run the figures, write bench/results/*.json + *.png, print a table."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from types import ModuleType

from bench import (
    fig_cpu,
    fig_dump,
    fig_http_dump,
    fig_ingest,
    fig_memory,
    fig_persistence,
    fig_recover,
    fig_serving,
)
from bench.harness import RESULTS_DIR, FigureResult, run_figure, table

FIGURES: dict[str, ModuleType] = {
    module.NAME: module
    for module in (
        fig_ingest, fig_dump, fig_memory, fig_recover, fig_cpu, fig_serving, fig_http_dump, fig_persistence
    )
}


def dynamo_note() -> str:
    if importlib.util.find_spec("dynamo") is None:
        return "ai-dynamo-runtime is not installed: the optional Dynamo comparison was skipped."
    return "ai-dynamo-runtime is installed, but the Dynamo comparison is not implemented yet."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"figures to run (default: all of {', '.join(FIGURES)})")
    parser.add_argument("--quick", action="store_true", help="smaller traces and shorter windows")
    args = parser.parse_args(argv)
    names = args.names or list(FIGURES)
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
    print(dynamo_note())
    print(f"results in {RESULTS_DIR} ({time.perf_counter() - started:.0f} s total)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
