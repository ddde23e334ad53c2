"""Shared by the recovery tests: a fake slot over a real RecoveryIndex, a server on port 0, a raw request."""

from __future__ import annotations

import json
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import attrs
import msgpack
import structlog
import trio
from trio_websocket import open_websocket_url

from kvagent.agent.host import SlotRegistry
from kvagent.coordinator.task import StatusCell
from kvagent.index.recovery_index import RecoveryIndex
from kvagent.model.errors import KvAgentError
from kvagent.model.events import ResidencyDomain, RouterEvent, StorageTier, Stored, WorkerWithDpRank
from kvagent.model.ids import (
    CacheOwnerId,
    StableDpSlotId,
)
from kvagent.model.status import AgentStatus, AttachmentStatus
from kvagent.recovery.server import RecoveryServerInfo, serve_recovery
from tests.support.ids import IDENTITY, OWNER, WORKER

__all__ = [
    "OTHER_OWNER",
    "TOKEN",
    "FakeSlot",
    "raw_request",
    "start_server",
    "structlog_via_stdlib",
]

OTHER_OWNER = CacheOwnerId(OWNER.pool, StableDpSlotId(bytes([9] * 16)))
TOKEN = "s3cret-token-value-never-logged"


class FakeSlot:
    """A SlotSurface over a real RecoveryIndex; ``apply`` simulates the coordinator's ingest."""

    def __init__(self, name: str = "a", *, ring_capacity: int = 1024) -> None:
        self._name = name
        self._index = RecoveryIndex(16, ring_capacity)
        self.cell = StatusCell(AgentStatus(IDENTITY))
        self.next_id = 1
        self.control_calls: list[tuple[Any, ...]] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def slot_rank(self) -> int:
        return 0

    @property
    def index(self) -> RecoveryIndex:
        return self._index

    def status(self) -> AgentStatus:
        return self.cell.get()

    def set_status(self, **changes: Any) -> None:
        self.cell.set(attrs.evolve(self.cell.get(), **changes))

    def apply(self, event: RouterEvent) -> None:
        self._index.apply(event)
        self.next_id = event.event_id + 1
        self.set_status(outbound_cursor=event.event_id)

    def store_worker(self, block_hash: int, parent: int | None = None) -> RouterEvent:
        return self._store(ResidencyDomain.WORKER, StorageTier.DEVICE, block_hash, parent, OWNER)

    def store_cache_owner(self, block_hash: int, owner: CacheOwnerId = OWNER) -> RouterEvent:
        return self._store(ResidencyDomain.CACHE_OWNER, StorageTier.HOST_PINNED, block_hash, None, owner)

    def _store(
        self,
        domain: ResidencyDomain,
        tier: StorageTier,
        block_hash: int,
        parent: int | None,
        source: CacheOwnerId,
    ) -> RouterEvent:
        """One block stored by WORKER as the next event (local hash = block hash + 1)."""
        data = Stored(parent, (block_hash,), (block_hash + 1,))
        event = RouterEvent(WORKER.worker_id, tier, domain, self.next_id, data, WORKER.dp_rank, source)
        self.apply(event)
        return event

    def attach_ready(self, generation: int = 1) -> None:
        self.set_status(attachment=AttachmentStatus(generation, WORKER, True, self.next_id - 1))

    async def control_attach(
        self, *, worker_id: int, dp_rank: int, endpoint: str, topic: str, replay_endpoint: str | None
    ) -> AttachmentStatus:
        await trio.lowlevel.checkpoint()
        self.control_calls.append(("attach", worker_id, dp_rank, endpoint, topic, replay_endpoint))
        attachment = AttachmentStatus(7, WorkerWithDpRank(worker_id, dp_rank), True, self.next_id - 1)
        self.set_status(attachment=attachment)
        return attachment

    async def control_detach(self, generation: int) -> int:
        await trio.lowlevel.checkpoint()
        self.control_calls.append(("detach", generation))
        attachment = self.status().attachment
        if attachment is None or attachment.generation != generation:
            raise KvAgentError("state-agent attachment generation is not current", code="generation_mismatch")
        self.set_status(attachment=None)
        return self.next_id - 1

    async def control_quarantine(self, generation: int, reason: str) -> None:
        await trio.lowlevel.checkpoint()
        self.control_calls.append(("quarantine", generation, reason))
        if reason == "explode":
            raise RuntimeError("surface bug")


async def start_server(nursery: trio.Nursery, *slots: FakeSlot, **options: Any) -> str:
    registry = SlotRegistry()
    for slot in slots:
        registry.add(slot)
    options.setdefault("token", TOKEN)
    info: RecoveryServerInfo = await nursery.start(
        partial(serve_recovery, registry, host="127.0.0.1", port=0, **options)
    )
    assert info.port > 0
    return f"ws://127.0.0.1:{info.port}"


async def raw_request(url: str, request: Any, *, binary: bool = False) -> list[dict[str, Any]]:
    """Send one request on a fresh connection and read frames until one without ``more``."""
    frames: list[dict[str, Any]] = []
    async with open_websocket_url(url, max_message_size=4 << 20) as ws:
        await ws.send_message(msgpack.packb(request) if binary else json.dumps(request))
        while True:
            message = await ws.get_message()
            assert isinstance(message, bytes) == binary
            frame = msgpack.unpackb(message, strict_map_key=False) if binary else json.loads(message)
            frames.append(frame)
            if not frame.get("more"):
                return frames


def _to_stdlib(_logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    exc_info = event_dict.pop("exc_info", None)
    words = [str(event_dict.pop("event"))] + [f"{key}={value!r}" for key, value in event_dict.items()]
    return (" ".join(words),), {"exc_info": exc_info}


@contextmanager
def structlog_via_stdlib() -> Iterator[None]:
    """Route structlog calls to stdlib logging (every keyword in the message, exc_info kept) for ``caplog``."""
    structlog.configure(
        processors=[_to_stdlib],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    try:
        yield
    finally:
        structlog.reset_defaults()
