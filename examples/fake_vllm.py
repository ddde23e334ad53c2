"""A fake vLLM engine publishing a simulated prefix-caching workload over vLLM 0.32.0's KV event protocol.

Point a kvagent slot (or any vLLM KV event subscriber) at it:

    python examples/fake_vllm.py --endpoint tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --rate 20
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from functools import partial

import trio

from kvagent.testing import FakeVllmEngine, SimulatedWorkload, run_simulated_engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="PUB bind address")
    parser.add_argument("--replay", default=None, help="replay ROUTER bind address (default: no replay)")
    parser.add_argument("--topic", default="kv-events", help="topic frame of every live message")
    parser.add_argument("--rate", type=float, default=20.0, help="engine steps per second")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    parser.add_argument("--dp-rank", type=int, default=0, help="data_parallel_rank written into every batch")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same events)")
    parser.add_argument(
        "--legacy", action="store_true", help="positional-array events (before vLLM PR #42892)"
    )
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    engine = FakeVllmEngine(
        endpoint=args.endpoint,
        replay_endpoint=args.replay,
        topic=args.topic,
        dp_rank=args.dp_rank,
        block_size=args.block_size,
        mode="legacy" if args.legacy else "map",
    )
    workload = SimulatedWorkload(seed=args.seed, block_size=args.block_size)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        print(
            f"publishing on {engine.endpoint}"
            + (f", replay on {engine.replay_endpoint}" if args.replay else "")
        )
        await nursery.start(partial(run_simulated_engine, engine, workload, steps_per_second=args.rate))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main, parse_args())
