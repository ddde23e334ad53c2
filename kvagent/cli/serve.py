"""``kvagent serve``: the process nursery (recovery server, HTTP surface, host of slot agents, simulator)."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import trio
import zmq

from kvagent import _native
from kvagent._util.malloc import keep_large_allocations_mapped
from kvagent.agent.advertising import advertised_zmq_endpoint, http_url, recovery_base_url, slot_recovery_url
from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.agent.durable import slot_state_path
from kvagent.agent.host import Host, open_host
from kvagent.agent.http_routes import serve_http
from kvagent.agent.metrics import MetricSources
from kvagent.agent.slot import SlotAgent
from kvagent.cli.bind_check import check_distinct_addresses
from kvagent.cli.config import (
    STATE_DIR_NONE,
    EngineConfig,
    ServeConfig,
    SlotConfig,
    discovery_options,
    resolve_cache_owner_id,
    warn_if_models_unnamed,
)
from kvagent.cli.control_token import ControlToken, load_or_create_token, token_path
from kvagent.cli.errors import CliError, blame, blaming, find_cause, system_error
from kvagent.cli.logs import Console, configure_logging
from kvagent.cli.stream_settings import stream_config
from kvagent.discovery import Discovery, file_discovery_directory, open_discovery
from kvagent.discovery.etcd import EtcdDiscovery
from kvagent.model.errors import DiscoveryError
from kvagent.model.events import IngressProtocol
from kvagent.model.ids import derive_worker_id
from kvagent.model.options import configured
from kvagent.publish.sinks import EventSink
from kvagent.publish.zmq_plane import ZmqEventPlane
from kvagent.recovery.server import ServerStats, ServingOptions, serve_recovery
from kvagent.simulator.engine import FakeVllmEngine, SimulatedWorkload, run_simulated_engine
from kvagent.vllm.listener import ListenerOptions

__all__ = ["run_serve"]

log = structlog.get_logger(__name__)

SLOT_OWNED = "slot_owned"  # the code of SlotOwnershipError: a second process for a served slot


def _split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _state_dir(serve: ServeConfig) -> Path | None:
    return None if serve.state_dir == STATE_DIR_NONE else Path(serve.state_dir).expanduser()


def slot_agent_config(
    slot: SlotConfig, serve: ServeConfig, *, recovery_url: str, publish_endpoint: str | None = None
) -> SlotAgentConfig:
    """The slot's agent config; ``publish_endpoint`` is where the event plane bound ``--publish`` (its port 0
    resolved), which the slot advertises as its kv-state endpoint."""
    state_dir = _state_dir(serve)
    publish = serve.publish if publish_endpoint is None else publish_endpoint
    # Each option comes from the settings field standing for it (kvagent/model/options.py, option_from);
    # what no setting gives is resolved here.
    return configured(
        SlotAgentConfig,
        slot,
        serve,
        name=slot.name,
        cache_owner_id=resolve_cache_owner_id(slot),
        ingress_protocol=IngressProtocol(slot.ingress_protocol),
        kv_state_endpoint=advertised_zmq_endpoint(publish, serve.advertise) if publish else recovery_url,
        recovery_url=recovery_url,
        listener=configured(ListenerOptions, serve),
        republish=None if slot.republish is None else slot.republish.to_config(),
        state_path=None if state_dir is None else slot_state_path(state_dir, slot.name),
        stream=None if serve.stream is None else stream_config(serve.stream),
    )


def engine_attachment(slot: SlotConfig, engine: EngineConfig) -> AttachmentConfig:
    """The attachment of the slot's configured engine (its worker id derived from slot and endpoint unless
    given)."""
    worker_id = engine.worker_id if engine.worker_id is not None else derive_worker_id(slot.name, engine.endpoint)
    return configured(AttachmentConfig, engine, worker_id=worker_id, dp_rank=slot.dp_rank)


def _print_republish(console: Console, agent: SlotAgent) -> None:
    """The bound republish endpoints (resolved: a port 0 shows the port it got), once at start."""
    republisher = agent.republisher
    if republisher is None:
        return
    replay = "" if republisher.replay_endpoint is None else f" replay {republisher.replay_endpoint}"
    console.line(
        "republishing",
        f"kvagent: slot {agent.name} republishes vLLM KV events on {republisher.endpoint}{replay}",
        slot=agent.name,
        endpoint=republisher.endpoint,
        replay_endpoint=republisher.replay_endpoint,
        logged=True,
    )


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__
    return chain


def _blame_slot_failure(cause: BaseException, slot: SlotConfig, serve: ServeConfig) -> CliError | None:
    """A failure while adding ``slot`` attributed to the option it comes from (None: to none of them)."""
    chain = _chain(cause)
    republish = slot.republish
    if republish is not None and system_error(cause) is not None and "republish" in str(cause):
        replay = "replay" in str(cause) and republish.replay_endpoint is not None
        option, value = (
            ("--republish-replay", republish.replay_endpoint)
            if replay
            else ("--republish", republish.endpoint)
        )
        where = f"slot {slot.name}" + (
            f", bound at PORT + its dp_rank {slot.dp_rank}" if slot.dp_rank else ""
        )
        return blame(option, value, cause, what=where)
    if any(getattr(error, "code", None) == SLOT_OWNED for error in chain):
        return None  # another process serves the slot: its message names the slot, the holder, what to do
    texts = " ".join([str(error) for error in chain] + [str(getattr(system_error(cause), "filename", ""))])
    directory = file_discovery_directory(serve.discovery)
    if any(isinstance(error, DiscoveryError) for error in chain) or (
        directory is not None and str(directory) in texts
    ):
        return blame("--discovery", serve.discovery, cause, what=f"advertising slot {slot.name}")
    state_dir = _state_dir(serve)
    if state_dir is not None and str(state_dir) in texts:
        return blame("--state-dir", state_dir, cause, what=f"slot {slot.name}'s state")
    return None


async def _add_slot(host: Host, config: SlotAgentConfig, slot: SlotConfig, serve: ServeConfig) -> SlotAgent:
    """Add one slot; a failure that comes from an option (a republish endpoint in use, a discovery
    directory not writable, a state directory unusable) is explained naming that option."""
    try:
        return await host.add_slot(config)
    except Exception as exc:
        cause = find_cause(exc)
        explained = None if cause is None else _blame_slot_failure(cause, slot, serve)
        if explained is None:
            raise
        raise explained from exc


async def _attach_configured_engine(
    nursery: trio.Nursery, agent: SlotAgent, slot: SlotConfig, context: zmq.Context[Any]
) -> None:
    if slot.engine is not None:
        await agent.attach(engine_attachment(slot, slot.engine))  # the agent logs slot_attached itself
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
        await agent.attach(
            AttachmentConfig(
                worker_id=derive_worker_id(slot.name, fake.endpoint),
                dp_rank=slot.dp_rank,
                endpoint=fake.endpoint,
                topic="",
                replay_endpoint=fake.replay_endpoint,
            )
        )
        log.info("simulated_engine", slot=slot.name, endpoint=fake.endpoint)


async def _status_lines(console: Console, host: Host, interval: float) -> None:
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
            blocks = agent.index.resident_block_count
            republish = "" if status.republish is None else f" republish seq {status.republish.seq}"
            writer = agent.statistics().stream  # the Redis stream's lag (docs/fleet.md); DOWN while failing
            down = "" if writer is None or writer.connected else " DOWN"
            stream = "" if writer is None else f" stream lag {writer.lag_events}{down}"
            console.line(
                "slot_status",
                f"[{agent.name}] {state} cursor {status.outbound_cursor} ({rate:.0f} ev/s) "
                f"blocks {blocks} dropped {coordinator.dropped_events} "
                f"quarantines {faults} cache_owner {'ready' if status.cache_owner_ready else 'UNREADY'}"
                f"{republish}{stream}",
                slot=agent.name,
                generation=None if attachment is None else attachment.generation,
                state="detached" if attachment is None else attachment.state,
                ready=attachment is not None and attachment.ready,
                cursor=status.outbound_cursor,
                events_per_s=round(rate, 1),
                blocks=blocks,
                dropped=coordinator.dropped_events,
                quarantines=faults,
                cache_owner_ready=status.cache_owner_ready,
                republish_seq=None if status.republish is None else status.republish.seq,
                stream_lag=None if writer is None else writer.lag_events,
            )


async def _start_servers(
    nursery: trio.Nursery,
    console: Console,
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
    options = configured(ServingOptions, config)
    with blaming("--listen", config.listen, what="the websocket API"):
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
        with blaming("--http", config.http_listen, what="metrics, health and status"):
            bound = await nursery.start(partial(serve_http, sources, host=http_host, port=http_port))
        url = http_url(http_host, bound, config.advertise)
        console.line("http_listening", f"kvagent: HTTP surface on {url}", url=url, logged=True)
    return recovery_base_url(listen_host, server.port, config.advertise)


def _create_state_dir(config: ServeConfig) -> None:
    """Created here (the CLI owns the state root); a slot opens or creates its own file in it."""
    state_dir = _state_dir(config)
    if state_dir is not None:
        with blaming(
            "--state-dir", state_dir, what="where slots persist their state; 'none' keeps it in memory"
        ):
            (state_dir / "slots").mkdir(parents=True, exist_ok=True)


async def _serve_slots(
    console: Console,
    config: ServeConfig,
    token: ControlToken,
    context: zmq.Context[Any],
    signals: AsyncIterator[int],
) -> None:
    """Host the configured slots behind the recovery server until a signal arrives."""
    _create_state_dir(config)
    event_plane = None
    if config.publish:
        with blaming("--publish", config.publish, what="the outbound event plane"):
            event_plane = ZmqEventPlane(config.publish, context=context)

    def sink_factory(slot_config: SlotAgentConfig, publisher_id: int) -> EventSink | None:
        return None if event_plane is None else event_plane.sink_for(publisher_id)

    try:
        async with (
            _opened_discovery(config.discovery, discovery_options(config)) as discovery,
            trio.open_nursery() as nursery,
        ):
            async with open_host(discovery=discovery, sink_factory=sink_factory, zmq_context=context) as host:
                base_url = await _start_servers(
                    nursery,
                    console,
                    config,
                    host,
                    token=token.value,
                    discovery=discovery,
                    event_plane=event_plane,
                )
                for slot in config.slots:
                    agent_config = slot_agent_config(
                        slot,
                        config,
                        recovery_url=slot_recovery_url(base_url, slot.name),
                        publish_endpoint=None if event_plane is None else event_plane.last_endpoint,
                    )
                    agent = await _add_slot(host, agent_config, slot, config)
                    _print_republish(console, agent)
                    await _attach_configured_engine(nursery, agent, slot, context)
                token.announce(console)  # with the serving line: a start that fails ends in its error alone
                console.line(
                    "serving",
                    f"kvagent: serving {len(config.slots)} slot(s) on {base_url}/v1/slots "
                    f"(discovery {config.discovery})",
                    url=f"{base_url}/v1/slots",
                    slots=[slot.name for slot in config.slots],
                    discovery=config.discovery,
                )
                nursery.start_soon(_status_lines, console, host, config.status_interval)
                async for signum in signals:
                    log.info("shutdown_signal", signal=signal.Signals(signum).name)
                    break
            # Slots are shut down (in the seed's order) by open_host's exit; now stop the servers.
            nursery.cancel_scope.cancel()
    finally:
        if event_plane is not None:
            event_plane.close()


@asynccontextmanager
async def _opened_discovery(url: str, options: dict[str, Any]) -> AsyncIterator[Discovery]:
    """The discovery backend; failing to open it (etcd unreachable, a directory not writable) names
    --discovery. Failures later, inside the block, pass unchanged."""
    async with AsyncExitStack() as stack:
        fix = "check that etcd runs there and the URL is right" if url.startswith("etcd") else ""
        # A ValueError is an option the backend refuses (TLS files without etcds://, a ttl below 1 s).
        with blaming("--discovery", url, what="where slots are advertised", fix=fix, usage=(ValueError,)):
            discovery = await stack.enter_async_context(open_discovery(url, **options))
        yield discovery


async def run_serve(config: ServeConfig) -> int:
    configure_logging(config.log_format, logging.getLevelNamesMapping()[config.log_level.upper()])
    keep_large_allocations_mapped()  # resident state: about 45 B less RSS per block (docs/performance.md)
    # The pure-Python ingest path works the same, at a higher CPU cost per event: worth a warning unless the
    # operator chose it (KVAGENT_NO_NATIVE; `kvagent --version` says which core runs either way).
    if not _native.NATIVE and not _native.DISABLED:
        log.warning("native_core_unavailable", reason=_native.REASON)
    warn_if_models_unnamed(config)
    check_distinct_addresses(config)
    console = Console(config.log_format)
    path = token_path(config)
    value, created = load_or_create_token(path)
    token = ControlToken(value=value, path=path, created=created)
    context: zmq.Context[Any] = zmq.Context()
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            await _serve_slots(console, config, token, context, signals)
    except KeyboardInterrupt:
        # A second SIGINT during the clean stop (a double Ctrl-C, or `timeout` signalling the process and
        # its group) is redelivered by trio when the receiver closes: the stop is already done.
        pass
    finally:
        context.destroy(linger=0)
    console.line("stopped", "kvagent: stopped")
    return 0
