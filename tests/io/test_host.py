"""Several slots in one process: isolation and per-slot state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import trio
import zmq

from kvagent import AttachmentConfig, SlotAgentConfig
from kvagent.agent.host import SlotStateKind, open_host
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.ids import derive_cache_owner_id
from tests.support.agent import XpubEngine, batch, gpu_store, is_store_of, wait_for_event


def slot_config(name: str) -> SlotAgentConfig:
    return SlotAgentConfig(
        name=name, cache_owner_id=derive_cache_owner_id(name, kv_block_size=32), kv_block_size=32
    )


async def test_a_fault_in_one_slot_quarantines_that_slot_only() -> None:
    context: zmq.Context[Any] = zmq.Context()
    try:
        with trio.fail_after(20):
            discovery = MemoryDiscovery()
            async with open_host(discovery=discovery, zmq_context=context) as host:
                engines = {}
                for name in ("a", "b"):
                    agent = await host.add_slot(slot_config(name))
                    engine = engines[name] = XpubEngine(context)
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(engine.wait_subscribed)
                        await agent.attach(AttachmentConfig(worker_id=1, dp_rank=0, endpoint=engine.endpoint))
                assert set(host.registry.names()) == {"a", "b"}
                a, b = host.agent("a"), host.agent("b")
                await engines["a"].send_payload(batch([gpu_store([1])], rank=7))  # a rank fault in slot a
                await a.status_cell.wait_for(lambda s: s.attachment is not None and not s.attachment.ready)
                await engines["b"].send_payload(batch([gpu_store([2])]))
                await wait_for_event(b, is_store_of(2))
                status_b = b.status()
                assert status_b.attachment is not None and status_b.attachment.ready
                assert {k: v.kind for k, v in host.states.items()} == {
                    "a": SlotStateKind.RUNNING,
                    "b": SlotStateKind.RUNNING,
                }
                await host.remove_slot("a")
                assert host.states["a"].kind is SlotStateKind.STOPPED
                assert host.registry.names() == ["b"]
                for engine in engines.values():
                    engine.close()
            assert discovery.records == {}
    finally:
        context.destroy(linger=0)


async def test_a_slot_that_fails_to_start_is_reported_and_others_keep_running() -> None:
    discovery = MemoryDiscovery()
    async with open_host(discovery=discovery) as host:
        await host.add_slot(slot_config("good"))
        discovery.fail_next(1, on=("register",))
        try:
            await host.add_slot(slot_config("bad"))
        except Exception as exc:
            assert "failed to advertise persistent state source" in str(exc)
        else:
            raise AssertionError("the failing slot started")
        assert host.states["bad"].kind is SlotStateKind.FAILED
        assert host.states["good"].kind is SlotStateKind.RUNNING
        assert host.registry.names() == ["good"]


async def test_the_sink_the_identity_and_the_state_file_name_one_publisher_id(tmp_path: Path) -> None:
    """The publisher id is decided once (open_slot_state): the sink factory, the slot's identity and its
    state file agree; a restarted slot keeps it, a slot in memory only gets one of its own."""
    named: list[int] = []

    def sink_factory(config: SlotAgentConfig, publisher_id: int) -> None:
        assert config.publisher_id == publisher_id
        named.append(publisher_id)

    persisted = attrs.evolve(slot_config("kept"), state_path=tmp_path / "kept.sqlite3")
    identities: list[int] = []
    with trio.fail_after(20):
        for _run in range(2):
            async with open_host(discovery=MemoryDiscovery(), sink_factory=sink_factory) as host:
                kept = await host.add_slot(persisted)
                memory = await host.add_slot(slot_config("memory"))
                identities += [kept.identity.publisher_id, memory.identity.publisher_id]
                assert kept.durable is not None and kept.durable.publisher_id == kept.identity.publisher_id
    assert named == identities
    kept_ids, memory_ids = identities[0::2], identities[1::2]
    assert kept_ids[0] == kept_ids[1]  # restarted: the persisted id
    assert memory_ids[0] != memory_ids[1]  # in memory only: a new one each run
