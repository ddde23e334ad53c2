"""``kvagent serve``: the process nursery (recovery server, metrics, host of slot agents, simulator)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import blake3
import trio
import zmq

from kvagent.agent.host import Host, SlotRegistry, open_host
from kvagent.agent.slot import AttachmentConfig, SlotAgent, SlotAgentConfig
from kvagent.cli.config import ServeConfig, SlotConfig, resolve_cache_owner_id
from kvagent.cli.logs import configure_logging
from kvagent.discovery import open_discovery
from kvagent.model.errors import KvAgentError
from kvagent.model.events import IngressProtocol
from kvagent.publish.sinks import EventSink
from kvagent.recovery.server import ServerStats, serve_recovery
from kvagent.vllm.listener import ListenerOptions

__all__ = ["derive_worker_id", "load_or_create_token", "run_serve"]

log = logging.getLogger("kvagent.cli.serve")


def load_or_create_token(token_file: str | None) -> tuple[str, bool]:
    """The control token, and whether it was freshly generated (so the caller prints it once)."""
    if token_file is not None:
        path = Path(token_file)
        if path.exists():
            token = path.read_text().strip()
            if not token:
                raise SystemExit(f"kvagent serve: token file {token_file} is empty")
            return token, False
        token = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        return token, True
    return secrets.token_urlsafe(32), True


def derive_worker_id(slot: str, endpoint: str) -> int:
    """A stable default worker id for an engine attached from the command line (JSON-safe)."""
    digest = blake3.blake3(f"kvagent/worker/{slot}@{endpoint}".encode()).digest()
    return int.from_bytes(digest[:6], "big") or 1


def _split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def slot_agent_config(slot: SlotConfig, serve: ServeConfig, *, recovery_url: str) -> SlotAgentConfig:
    return SlotAgentConfig(
        name=slot.name,
        cache_owner_id=resolve_cache_owner_id(slot),
        kv_block_size=slot.kv_block_size,
        dp_rank=slot.dp_rank,
        ring_capacity=slot.ring_capacity,
        ingress_protocol=IngressProtocol(slot.ingress_protocol),
        strict_cache_owner=slot.strict_cache_owner,
        kv_state_endpoint=serve.publish or recovery_url,
        recovery_url=recovery_url,
        listener=ListenerOptions(rcvhwm=serve.rcvhwm),
    )


async def _attach_configured_engine(
    nursery: trio.Nursery, agent: SlotAgent, slot: SlotConfig, context: zmq.Context[Any]
) -> None:
    if slot.engine is not None:
        engine = slot.engine
        worker_id = (
            engine.worker_id if engine.worker_id is not None else derive_worker_id(slot.name, engine.endpoint)
        )
        status = await agent.attach(
            AttachmentConfig(
                worker_id=worker_id,
                dp_rank=slot.dp_rank,
                endpoint=engine.endpoint,
                topic=engine.topic,
                replay_endpoint=engine.replay_endpoint,
                image_token_id=engine.image_token_id,
                video_token_id=engine.video_token_id,
            )
        )
        log.info("slot %s attached to %s (generation %d)", slot.name, engine.endpoint, status.generation)
    elif slot.simulate:
        from kvagent.vllm.fake_engine import FakeVllmEngine, SimulatedWorkload, run_simulated_engine

        fake = FakeVllmEngine(
            endpoint="tcp://127.0.0.1:0",
            replay_endpoint="tcp://127.0.0.1:0",
            dp_rank=slot.dp_rank,
            block_size=slot.kv_block_size,
            context=context,
        )
        await nursery.start(fake.run)
        workload = SimulatedWorkload(
            seed=derive_worker_id(slot.name, "simulate"), block_size=slot.kv_block_size
        )
        nursery.start_soon(partial(run_simulated_engine, fake, workload))
        status = await agent.attach(
            AttachmentConfig(
                worker_id=derive_worker_id(slot.name, fake.endpoint),
                dp_rank=slot.dp_rank,
                endpoint=fake.endpoint,
                topic="",
                replay_endpoint=fake.replay_endpoint,
            )
        )
        log.info(
            "slot %s attached to the simulated engine at %s (generation %d)",
            slot.name,
            fake.endpoint,
            status.generation,
        )


async def _status_lines(host: Host, interval: float) -> None:
    last: dict[str, tuple[float, int]] = {}
    while True:
        await trio.sleep(interval)
        now = trio.current_time()
        for agent in host.agents:
            status = agent.status()
            previous_time, previous_cursor = last.get(agent.name, (now - interval, status.outbound_cursor))
            rate = (status.outbound_cursor - previous_cursor) / max(now - previous_time, 1e-9)
            last[agent.name] = (now, status.outbound_cursor)
            attachment = status.attachment
            state = (
                "detached"
                if attachment is None
                else f"gen {attachment.generation} {'ready' if attachment.ready else 'UNREADY'}"
            )
            counters = agent.core.counters
            faults = sum(counters.quarantines.values())
            print(
                f"[{agent.name}] {state} cursor {status.outbound_cursor} ({rate:.0f} ev/s) "
                f"blocks {agent.index.resident_block_count} dropped {counters.dropped_events} "
                f"quarantines {faults} cache_owner {'ready' if status.cache_owner_ready else 'UNREADY'}",
                file=sys.stderr,
                flush=True,
            )


async def run_serve(config: ServeConfig) -> int:
    configure_logging(config.log_format)
    token, generated = load_or_create_token(config.token_file)
    if generated and config.token_file is None:
        # Printed once on the console (not through logging, so it never reaches log sinks).
        print(
            f"kvagent: control token (pass with --token-file or Authorization: Bearer): {token}",
            file=sys.stderr,
        )
    listen_host, listen_port = _split_host_port(config.listen)
    context: zmq.Context[Any] = zmq.Context()
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_discovery(config.discovery) as discovery, trio.open_nursery() as nursery:
                registry = SlotRegistry()
                server_stats = ServerStats()
                server = await nursery.start(
                    partial(
                        serve_recovery,
                        registry,
                        host=listen_host,
                        port=listen_port,
                        token=token,
                        max_connections=config.max_connections,
                        max_message_size=config.max_message_bytes,
                        stats=server_stats,
                    )
                )
                base_url = f"ws://{listen_host}:{server.port}"
                sink_factory = None
                event_plane = None
                if config.publish:
                    from kvagent.publish.zmq_plane import ZmqEventPlane

                    event_plane = ZmqEventPlane(config.publish, context=context)
                    plane = event_plane

                    def sink_factory(slot_config: SlotAgentConfig) -> EventSink | None:
                        # The host gives every slot its publisher id before it builds the slot's sink.
                        if slot_config.publisher_id is None:
                            raise KvAgentError(f"slot {slot_config.name!r} has no publisher id", code="internal")
                        return plane.sink_for(slot_config.publisher_id)

                if config.metrics:
                    from kvagent.agent.metrics import serve_metrics

                    metrics_host, metrics_port = _split_host_port(config.metrics)
                    extra: list[Any] = [server_stats]
                    if event_plane is not None:
                        extra.append(event_plane)
                    await nursery.start(
                        partial(serve_metrics, registry, host=metrics_host, port=metrics_port, extra=extra)
                    )
                async with open_host(
                    discovery=discovery, registry=registry, sink_factory=sink_factory, zmq_context=context
                ) as host:
                    for slot in config.slots:
                        agent_config = slot_agent_config(
                            slot, config, recovery_url=f"{base_url}/v1/slots/{slot.name}"
                        )
                        agent = await host.add_slot(agent_config)
                        await _attach_configured_engine(nursery, agent, slot, context)
                    print(
                        f"kvagent: serving {len(config.slots)} slot(s) on {base_url}/v1/slots "
                        f"(discovery {config.discovery})",
                        file=sys.stderr,
                        flush=True,
                    )
                    nursery.start_soon(_status_lines, host, config.status_interval)
                    async for signum in signals:
                        log.info("received %s; shutting down", signal.Signals(signum).name)
                        break
                # Slots are shut down (in the seed's order) by open_host's exit; now stop the servers.
                nursery.cancel_scope.cancel()
                if event_plane is not None:
                    event_plane.close()
    finally:
        context.destroy(linger=0)
    print("kvagent: stopped", file=sys.stderr, flush=True)
    return 0
