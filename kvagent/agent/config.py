"""What one slot agent runs as (:class:`SlotAgentConfig`) and what it attaches to (:class:`AttachmentConfig`).

Both validate on construction and raise :class:`~kvagent.model.errors.KvAgentError` (``bad_request``), so
a control request with bad fields is refused before anything happens.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from kvagent.model.errors import KvAgentError
from kvagent.model.events import U32_MAX, IngressProtocol, WorkerWithDpRank
from kvagent.model.ids import CacheOwnerId
from kvagent.model.options import connect_endpoint, in_range, option, positive, u32, u64
from kvagent.model.status import Attachment, AttachmentSource
from kvagent.publish.republisher import RepublishConfig
from kvagent.stream.writer import StreamConfig
from kvagent.vllm.listener import ListenerOptions

__all__ = ["AttachmentConfig", "SlotAgentConfig"]


def _block_size(value: int) -> str | None:
    return "must be > 0" if value <= 0 else in_range(1, U32_MAX)(value)


@attrs.frozen(slots=True)
class SlotAgentConfig:
    """One stable DP slot: its identity, geometry and local recovery settings."""

    name: str
    cache_owner_id: CacheOwnerId
    kv_block_size: int = option(
        16,
        help="KV block size in tokens",
        flags=("--block-size",),
        parse=int,
        check=_block_size,
    )
    dp_rank: int = option(
        0,
        help="the slot's global data-parallel rank",
        flags=("--dp-rank",),
        parse=int,
        check=u32,
        slot_key="rank",
        exclusive=True,
    )
    ring_capacity: int = option(
        1024,
        help="recovery ring buffer size in events",
        flags=("--ring-capacity",),
        parse=int,
        check=positive,
    )
    ingress_protocol: IngressProtocol = IngressProtocol.VLLM_RESIDENCY_V1
    strict_cache_owner: bool = option(
        False,
        help="refuse engine events whose cache owner differs from the slot's instead of counting them",
        flags=("--strict-cache-owner",),
        switch=True,
    )
    publisher_id: int | None = None
    kv_state_endpoint: str = ""
    recovery_url: str | None = None
    listener: ListenerOptions = ListenerOptions()
    shutdown_step_timeout: float = 5.0
    # Seconds one step of a lifecycle call (the attach barrier, the listener start, the ad registration, a
    # coordinator command) may take before the call fails and is rolled back (the detach's required ad
    # withdrawal is not bounded: it retries until discovery answers, docs/spec/agent-semantics.md 7.4).
    lifecycle_step_timeout: float = 30.0
    # The vLLM-compatible stream of this slot (endpoints of dp_rank 0: the slot offsets them by its dp_rank).
    republish: RepublishConfig | None = None
    # The slot's SQLite state file (docs/durability.md); None keeps every state in memory only.
    state_path: Path | None = None
    # Seconds an attached engine may publish nothing before the slot logs one WARNING (docs/metrics.md).
    silence_warning: float = option(
        60.0,
        help="warn once when an attached engine has published nothing for this long",
        flags=("--silence-warning",),
        metavar="SECONDS",
        parse=float,
        check=positive,
    )
    # The slot's Redis/Valkey event stream (docs/fleet.md); None: no stream.
    stream: StreamConfig | None = None

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise KvAgentError("slot name must not be empty", code="bad_request")
        if not self.lifecycle_step_timeout > 0:
            raise KvAgentError(
                f"lifecycle_step_timeout must be > 0 seconds, got {self.lifecycle_step_timeout}",
                code="bad_request",
            )
        if self.ingress_protocol is not IngressProtocol.VLLM_RESIDENCY_V1:
            raise KvAgentError(
                "external state-agent slots require vllm_residency_v1 ingress", code="bad_request"
            )


@attrs.frozen(slots=True)
class AttachmentConfig:
    """One engine incarnation to attach: who it is and where its raw KV events are published."""

    worker_id: int = option(
        help="worker id of the engine attached at start (default: derived from slot and endpoint)",
        flags=("--worker-id",),
        parse=int,
        check=u64,
        slot_key="worker",
        exclusive=True,
    )
    dp_rank: int = option(help="the engine's data-parallel rank (the slot's)", check=u32)
    endpoint: str = option(
        help="the engine's KV event (PUB) endpoint (--slot NAME=ENDPOINT)",
        check=connect_endpoint,
    )
    topic: str = option(
        "",
        help="raw vLLM topic filter (default: everything)",
        flags=("--topic",),
        slot_key="topic",
        default_text='"" (everything)',
    )
    replay_endpoint: str | None = option(
        None,
        help="vLLM replay (ROUTER) endpoint for gap repair",
        flags=("--replay",),
        metavar="ENDPOINT",
        check=connect_endpoint,
        slot_key="replay",
        exclusive=True,
    )
    producer_instance: str = ""
    intent_incarnation: int | None = None
    image_token_id: int | None = option(
        None, help="the engine's image placeholder token id", check=u32
    )
    video_token_id: int | None = option(
        None, help="the engine's video placeholder token id", check=u32
    )
    ingress_protocol: IngressProtocol = IngressProtocol.VLLM_RESIDENCY_V1

    def to_attachment(self) -> Attachment:
        source = AttachmentSource(
            endpoint=self.endpoint,
            topic=self.topic,
            replay_endpoint=self.replay_endpoint,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            ingress_protocol=self.ingress_protocol,
        )
        return Attachment(
            worker=WorkerWithDpRank(self.worker_id, self.dp_rank),
            source=source,
            producer_instance=self.producer_instance or f"kvagent/{self.worker_id}",
            intent_incarnation=self.worker_id if self.intent_incarnation is None else self.intent_incarnation,
        )
