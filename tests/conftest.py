"""Fixtures shared by every level: the seed identities, a status cell, a recording sink, a fake engine.

The values come from tests/support/ids.py (Hypothesis strategies and parametrizations import them from
there); the etcd fixtures (``etcd_endpoint``, ``private_etcd``) come from tests/support/etcd_server.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import zmq

from kvagent.coordinator.task import StatusCell
from kvagent.model.events import WorkerWithDpRank
from kvagent.model.ids import CacheOwnerId, KvStateAgentIdentity
from kvagent.model.status import AgentStatus
from kvagent.testing import RecordingSink
from tests.support import ids
from tests.support.agent import XpubEngine

pytest_plugins = ["tests.support.etcd_server", "tests.support.redis_server"]


@pytest.fixture(autouse=True)
def _private_state_root(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets its own default state root: a `kvagent serve` (also in a subprocess) persists its
    slots under it by default, and must neither read nor leave state in the user's ~/.local/state."""
    monkeypatch.setenv("KVAGENT_STATE_DIR", str(tmp_path_factory.mktemp("state-root")))


@pytest.fixture
def owner() -> CacheOwnerId:
    """The seed CacheOwner (``01``*16 : ``02``*16 / DC 3 / ``04``*16)."""
    return ids.OWNER


@pytest.fixture
def identity() -> KvStateAgentIdentity:
    """The seed agent identity: the seed owner with publisher id 41."""
    return ids.IDENTITY


@pytest.fixture
def worker() -> WorkerWithDpRank:
    """Worker 17 on dp rank 0."""
    return ids.WORKER


@pytest.fixture
def status_cell(identity: KvStateAgentIdentity) -> StatusCell:
    """A status cell holding the seed identity, not attached."""
    return StatusCell(AgentStatus(identity))


@pytest.fixture
def recording_sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[Any]]:
    """A private ZMQ context, destroyed without linger after the test."""
    context: zmq.Context[Any] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture
async def fake_engine(zmq_context: zmq.Context[Any]) -> AsyncIterator[XpubEngine]:
    """A vLLM-like XPUB publisher on a loopback port of its own context (for an agent in another process)."""
    engine = XpubEngine(zmq_context)
    try:
        yield engine
    finally:
        engine.close()
