"""``kvagent serve``: the process nursery (recovery server, HTTP surface, host of slot agents, simulator)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import trio
import zmq

from kvagent._util.malloc import keep_large_allocations_mapped
from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.agent.durable import slot_state_path
from kvagent.agent.host import Host, open_host
from kvagent.agent.http import serve_http
from kvagent.agent.metrics import MetricSources
from kvagent.agent.slot import SlotAgent
from kvagent.cli.config import STATE_DIR_NONE, ServeConfig, SlotConfig, resolve_cache_owner_id
from kvagent.cli.logs import configure_logging
from kvagent.discovery import Discovery, open_discovery
from kvagent.discovery.etcd import EtcdDiscovery
from kvagent.model.events import IngressProtocol
from kvagent.model.ids import derive_worker_id
from kvagent.publish.sinks import EventSink
from kvagent.publish.zmq_plane import ZmqEventPlane
from kvagent.recovery.server import ServerStats, ServingOptions, serve_recovery
from kvagent.vllm.fake_engine import FakeVllmEngine, SimulatedWorkload, run_simulated_engine
from kvagent.vllm.listener import ListenerOptions

__all__ = ["load_or_create_token", "run_serve"]

log = structlog.get_logger(__name__)


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


def _split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _state_dir(serve: ServeConfig) -> Path | None:
    return None if serve.state_dir == STATE_DIR_NONE else Path(serve.state_dir).expanduser()


def slot_agent_config(slot: SlotConfig, serve: ServeConfig, *, recovery_url: str) -> SlotAgentConfig:
    state_dir = _state_dir(serve)
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
        republish=None if slot.republish is None else slot.republish.to_config(),
        state_path=None if state_dir is None else slot_state_path(state_dir, slot.name),
    )


def _print_republish(agent: SlotAgent) -> None:
    """The bound republish endpoints (resolved: a port 0 shows the port it got), once at start."""
    republisher = agent.republisher
    if republisher is None:
        return
    replay = "" if republisher.replay_endpoint is None else f" replay {republisher.replay_endpoint}"
    print(
        f"kvagent: slot {agent.name} republishes vLLM KV events on {republisher.endpoint}{replay}",
        file=sys.stderr,
        flush=True,
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
        log.info("slot_attached", slot=slot.name, endpoint=engine.endpoint, generation=status.generation)
    elif not slot.simulate and (persisted := agent.persisted_attachment()) is not None:
        # A restarted slot without a configured engine goes back to the engine its state follows.
        status = await agent.attach(persisted)
        log.info("slot_reattached", slot=slot.name, endpoint=persisted.endpoint, generation=status.generation)
    elif slot.simulate:
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
            "slot_attached",
            slot=slot.name,
            endpoint=fake.endpoint,
            generation=status.generation,
            simulated=True,
        )


async def _status_lines(host: Host, interval: float) -> None:
    """One console line per slot every ``interval`` seconds (stderr, not the log)."""
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
            if attachment is None:
                state = "detached"
            else:  # anything but ready is shouted: a router must not trust the slot then
                shown = attachment.state if attachment.ready else attachment.state.upper()
                state = f"gen {attachment.generation} {shown}"
            coordinator = agent.statistics().coordinator
            faults = sum(coordinator.quarantines.values())
            republish = "" if status.republish is None else f" republish seq {status.republish.seq}"
            print(
                f"[{agent.name}] {state} cursor {status.outbound_cursor} ({rate:.0f} ev/s) "
                f"blocks {agent.index.resident_block_count} dropped {coordinator.dropped_events} "
                f"quarantines {faults} cache_owner {'ready' if status.cache_owner_ready else 'UNREADY'}"
                f"{republish}",
                file=sys.stderr,
                flush=True,
            )


async def _start_servers(
    nursery: trio.Nursery,
    config: ServeConfig,
    host: Host,
    *,
    token: str,
    discovery: Discovery,
    event_plane: ZmqEventPlane | None,
) -> str:
    """Start the recovery server (and the HTTP surface if configured); the recovery base URL."""
    listen_host, listen_port = _split_host_port(config.listen)
    server_stats = ServerStats()
    options = ServingOptions(
        max_connections=config.max_connections,
        max_message_size=config.max_message_bytes,
        max_pending_handshakes=config.max_pending_handshakes,
        handshake_timeout=config.handshake_timeout,
        send_deadline=config.send_deadline,
        outbound_queue_bytes=config.outbound_queue_bytes,
        shutdown_timeout=config.shutdown_timeout,
    )
    server = await nursery.start(
        partial(
            serve_recovery,
            host,
            host=listen_host,
            port=listen_port,
            token=token,
            options=options,
            stats=server_stats,
        )
    )
    if config.http_listen:
        sources = MetricSources(
            slots=lambda: host.agents,
            server=server_stats.statistics,
            event_plane=None if event_plane is None else event_plane.statistics,
            etcd=discovery.statistics if isinstance(discovery, EtcdDiscovery) else None,
            slot_states=lambda: host.states,
        )
        http_host, http_port = _split_host_port(config.http_listen)
        bound = await nursery.start(partial(serve_http, sources, host=http_host, port=http_port))
        print(f"kvagent: HTTP surface on http://{http_host}:{bound}", file=sys.stderr, flush=True)
    return f"ws://{listen_host}:{server.port}"


async def _serve_slots(
    config: ServeConfig, token: str, context: zmq.Context[Any], signals: AsyncIterator[int]
) -> None:
    """Host the configured slots behind the recovery server until a signal arrives."""
    state_dir = _state_dir(config)
    if state_dir is not None:
        # Created here (the CLI owns the state root); a slot opens or creates its own file in it.
        (state_dir / "slots").mkdir(parents=True, exist_ok=True)
    event_plane = ZmqEventPlane(config.publish, context=context) if config.publish else None

    def sink_factory(slot_config: SlotAgentConfig, publisher_id: int) -> EventSink | None:
        return None if event_plane is None else event_plane.sink_for(publisher_id)

    try:
        async with open_discovery(config.discovery) as discovery, trio.open_nursery() as nursery:
            async with open_host(discovery=discovery, sink_factory=sink_factory, zmq_context=context) as host:
                base_url = await _start_servers(
                    nursery, config, host, token=token, discovery=discovery, event_plane=event_plane
                )
                for slot in config.slots:
                    agent_config = slot_agent_config(
                        slot, config, recovery_url=f"{base_url}/v1/slots/{slot.name}"
                    )
                    agent = await host.add_slot(agent_config)
                    _print_republish(agent)
                    await _attach_configured_engine(nursery, agent, slot, context)
                print(
                    f"kvagent: serving {len(config.slots)} slot(s) on {base_url}/v1/slots "
                    f"(discovery {config.discovery})",
                    file=sys.stderr,
                    flush=True,
                )
                nursery.start_soon(_status_lines, host, config.status_interval)
                async for signum in signals:
                    log.info("shutdown_signal", signal=signal.Signals(signum).name)
                    break
            # Slots are shut down (in the seed's order) by open_host's exit; now stop the servers.
            nursery.cancel_scope.cancel()
    finally:
        if event_plane is not None:
            event_plane.close()


async def run_serve(config: ServeConfig) -> int:
    configure_logging(config.log_format, logging.getLevelNamesMapping()[config.log_level.upper()])
    keep_large_allocations_mapped()  # resident state: about 45 B less RSS per block (docs/performance.md)
    token, generated = load_or_create_token(config.token_file)
    if generated and config.token_file is None:
        # Printed once on the console (not through logging, so it never reaches log sinks).
        print(
            f"kvagent: control token (pass with --token-file or Authorization: Bearer): {token}",
            file=sys.stderr,
        )
    context: zmq.Context[Any] = zmq.Context()
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            await _serve_slots(config, token, context, signals)
    except KeyboardInterrupt:
        # A second SIGINT during the clean stop (a double Ctrl-C, or `timeout` signalling the process and
        # its group) is redelivered by trio when the receiver closes: the stop is already done.
        pass
    finally:
        context.destroy(linger=0)
    print("kvagent: stopped", file=sys.stderr, flush=True)
    return 0
