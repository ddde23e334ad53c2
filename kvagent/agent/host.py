"""Several slot agents in one process, each isolated in its own task.

A slot that crashes is recorded as failed and withdrawn from the registry; the other slots keep serving.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import structlog
import trio
import zmq

from kvagent.agent.config import SlotAgentConfig
from kvagent.agent.deadlines import StopDeadlines
from kvagent.agent.durable import open_slot_state
from kvagent.agent.groups import unwrap_sole_exception
from kvagent.agent.slot import SlotAgent, open_slot_agent
from kvagent.discovery.base import Discovery
from kvagent.discovery.ownership import SlotClaim, claim_slot
from kvagent.model.errors import KvAgentError
from kvagent.publish.sinks import EventSink
from kvagent.recovery.protocol import SlotSurface

__all__ = ["Host", "SinkFactory", "SlotRegistry", "SlotState", "SlotStateKind", "open_host"]

log = structlog.get_logger(__name__)


class SlotRegistry:
    """A :class:`kvagent.recovery.protocol.SlotDirectory`: slot name → surface.

    The host adds and removes its slots as they start and stop; a recovery server can also be given a
    registry filled by hand (tests, embedders serving slots they run themselves).
    """

    def __init__(self) -> None:
        self._slots: dict[str, SlotSurface] = {}

    def add(self, surface: SlotSurface) -> None:
        self._slots[surface.name] = surface

    def remove(self, name: str) -> None:
        self._slots.pop(name, None)

    def get(self, name: str) -> SlotSurface | None:
        return self._slots.get(name)

    def names(self) -> list[str]:
        return sorted(self._slots)


class SlotStateKind(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    STOPPED = "stopped"


@attrs.frozen(slots=True)
class SlotState:
    kind: SlotStateKind
    error: str | None = None


# Called with the slot's config and its publisher id (fixed by the host before the slot starts), so sinks
# that name their publisher, like the ZMQ event plane's, are built for it.
SinkFactory = Callable[[SlotAgentConfig, int], EventSink | None]


@attrs.define
class _SlotTask:
    stop: trio.Event = attrs.field(factory=trio.Event)
    stopped: trio.Event = attrs.field(factory=trio.Event)
    agent: SlotAgent | None = None


class Host:
    """The slots of one process. ``add_slot`` returns once the slot agent is running.

    The host is the :class:`kvagent.recovery.protocol.SlotDirectory` of its running slots (``get`` and
    ``names``), so a recovery server can serve it directly.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        discovery: Discovery,
        registry: SlotRegistry,
        sink_factory: SinkFactory | None,
        zmq_context: zmq.Context[Any] | None,
    ) -> None:
        self._nursery = nursery
        self._discovery = discovery
        self.registry = registry
        self._sink_factory = sink_factory
        self._zmq_context = zmq_context
        self._tasks: dict[str, _SlotTask] = {}
        self._states: dict[str, SlotState] = {}

    @property
    def states(self) -> dict[str, SlotState]:
        return dict(self._states)

    def agent(self, name: str) -> SlotAgent:
        task = self._tasks.get(name)
        if task is None or task.agent is None:
            raise KvAgentError(f"no running slot named {name!r}", code="bad_request")
        return task.agent

    @property
    def agents(self) -> list[SlotAgent]:
        return [task.agent for task in self._tasks.values() if task.agent is not None]

    # --- SlotDirectory ---------------------------------------------------------------------------
    def get(self, name: str) -> SlotSurface | None:
        return self.registry.get(name)

    def names(self) -> list[str]:
        return self.registry.names()

    async def add_slot(self, config: SlotAgentConfig) -> SlotAgent:
        if config.name in self._tasks and not self._tasks[config.name].stopped.is_set():
            raise KvAgentError(f"slot {config.name!r} already exists", code="conflict")
        task = _SlotTask()
        self._tasks[config.name] = task
        self._states[config.name] = SlotState(SlotStateKind.STARTING)
        agent: SlotAgent = await self._nursery.start(self._run_slot, config, task)
        return agent

    async def remove_slot(self, name: str) -> None:
        task = self._tasks.get(name)
        if task is None:
            return
        task.stop.set()
        await task.stopped.wait()

    async def _run_slot(
        self,
        config: SlotAgentConfig,
        task: _SlotTask,
        *,
        task_status: trio.TaskStatus[SlotAgent] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        started = False
        claim: SlotClaim | None = None
        try:
            # A single owner per slot: claimed before its state file is opened and anything is advertised.
            claim = await claim_slot(
                self._discovery,
                slot=config.name,
                cache_owner_id=str(config.cache_owner_id),
                url=config.recovery_url,
            )
            # The state file first: a restarted slot keeps its publisher id, which its sink must name.
            config, durable = await open_slot_state(config)
            publisher_id = config.publisher_id
            assert publisher_id is not None, "open_slot_state decides the publisher id"
            sink = self._sink_factory(config, publisher_id) if self._sink_factory is not None else None
            async with open_slot_agent(
                config, discovery=self._discovery, sink=sink, zmq_context=self._zmq_context, durable=durable
            ) as agent:
                task.agent = agent
                self.registry.add(agent)
                self._states[config.name] = SlotState(SlotStateKind.RUNNING)
                started = True
                task_status.started(agent)
                await task.stop.wait()
            self._states[config.name] = SlotState(SlotStateKind.STOPPED)
        except Exception as exc:
            if not started:
                self._states[config.name] = SlotState(SlotStateKind.FAILED, str(exc))
                raise
            # Isolation: one slot's crash is recorded and contained; the host keeps serving the others.
            log.exception("slot_failed", slot=config.name)
            self._states[config.name] = SlotState(SlotStateKind.FAILED, str(exc))
        finally:
            if claim is not None:  # after the slot's ads are withdrawn, never before
                with trio.move_on_after(StopDeadlines(config.shutdown_step_timeout).step, shield=True):
                    await claim.release()
            self.registry.remove(config.name)
            task.agent = None
            task.stopped.set()

    async def stop_all(self) -> None:
        for task in self._tasks.values():
            task.stop.set()
        for task in self._tasks.values():
            await task.stopped.wait()


@asynccontextmanager
async def open_host(
    *,
    discovery: Discovery,
    registry: SlotRegistry | None = None,
    sink_factory: SinkFactory | None = None,
    zmq_context: zmq.Context[Any] | None = None,
) -> AsyncIterator[Host]:
    """Host slot agents; on exit every slot shuts down in the seed's order.

    An exception from the block is re-raised as itself once every slot has stopped.
    """
    with unwrap_sole_exception():
        async with trio.open_nursery() as nursery:
            host = Host(
                nursery,
                discovery=discovery,
                registry=registry if registry is not None else SlotRegistry(),
                sink_factory=sink_factory,
                zmq_context=zmq_context,
            )
            try:
                yield host
            finally:
                with trio.CancelScope(shield=True):
                    await host.stop_all()
