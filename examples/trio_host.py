"""Two slot agents embedded in your own Trio program.

Each slot attaches to its own simulated vLLM engine; the program prints both slots' cursors a few times
and exits, shutting both agents down in the seed's order.

    python examples/trio_host.py
"""

from __future__ import annotations

import trio

from kvagent import AttachmentConfig, MemoryDiscovery, SlotAgentConfig, derive_cache_owner_id, open_host
from kvagent.testing import FakeVllmEngine, SimulatedWorkload, run_simulated_engine

BLOCK_SIZE = 16


async def main(rounds: int = 5) -> None:
    discovery = MemoryDiscovery()
    async with trio.open_nursery() as engines, open_host(discovery=discovery) as host:
        for rank, name in enumerate(["slot-a", "slot-b"]):
            engine = FakeVllmEngine(dp_rank=rank, block_size=BLOCK_SIZE)
            await engines.start(engine.run)
            engines.start_soon(run_simulated_engine, engine, SimulatedWorkload(seed=rank, block_size=BLOCK_SIZE))
            agent = await host.add_slot(
                SlotAgentConfig(
                    name=name,
                    cache_owner_id=derive_cache_owner_id(name, kv_block_size=BLOCK_SIZE),
                    kv_block_size=BLOCK_SIZE,
                    dp_rank=rank,
                )
            )
            await agent.attach(AttachmentConfig(worker_id=100 + rank, dp_rank=rank, endpoint=engine.endpoint))
        for _ in range(rounds):
            await trio.sleep(1)
            for agent in host.agents:
                status = agent.status()
                print(f"{agent.name}: cursor {status.outbound_cursor}, blocks {agent.index.resident_block_count}")
        await host.stop_all()
        engines.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
