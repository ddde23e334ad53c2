"""What one slot agent runs as (:class:`SlotAgentConfig`) and what it attaches to (:class:`AttachmentConfig`).

Both validate on construction and raise :class:`~kvagent.model.errors.KvAgentError` (``bad_request``), so
a control request with bad fields is refused before anything happens.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from kvagent.model.errors import KvAgentError
from kvagent.model.events import U32_MAX, U64_MAX, IngressProtocol, WorkerWithDpRank
from kvagent.model.ids import CacheOwnerId
from kvagent.model.status import Attachment, AttachmentSource
from kvagent.publish.republisher import RepublishConfig
from kvagent.stream.writer import StreamConfig
from kvagent.vllm.listener import ListenerOptions

__all__ = ["AttachmentConfig", "SlotAgentConfig"]


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise KvAgentError(f"{attribute.name} must be > 0, got {value}", code="bad_request")


def _u32(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= U32_MAX:
        raise KvAgentError(f"{attribute.name} must be in 0..{U32_MAX}, got {value}", code="bad_request")


def _u64(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= U64_MAX:
        raise KvAgentError(f"{attribute.name} must be a u64, got {value}", code="bad_request")


def _endpoint(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise KvAgentError(
            f"{attribute.name} must be a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH or inproc://NAME), got {value!r}",
            code="bad_request",
        )
    if value.startswith("tcp://"):
        host, sep, port = value[len("tcp://") :].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KvAgentError(f"{attribute.name} must be tcp://HOST:PORT, got {value!r}", code="bad_request")


def _optional_endpoint(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None:
        _endpoint(instance, attribute, value)  # type: ignore[arg-type]


@attrs.frozen(slots=True)
class SlotAgentConfig:
    """One stable DP slot: its identity, geometry and local recovery settings."""

    name: str
    cache_owner_id: CacheOwnerId
    kv_block_size: int = attrs.field(validator=_positive)
    dp_rank: int = attrs.field(default=0, validator=_u32)
    ring_capacity: int = attrs.field(default=1024, validator=_positive)
    ingress_protocol: IngressProtocol = IngressProtocol.VLLM_RESIDENCY_V1
    strict_cache_owner: bool = False
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
    silence_warning: float = 60.0
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
        if not self.silence_warning > 0:
            raise KvAgentError(
                f"silence_warning must be > 0 seconds, got {self.silence_warning}", code="bad_request"
            )
        if self.ingress_protocol is not IngressProtocol.VLLM_RESIDENCY_V1:
            raise KvAgentError(
                "external state-agent slots require vllm_residency_v1 ingress", code="bad_request"
            )


@attrs.frozen(slots=True)
class AttachmentConfig:
    """One engine incarnation to attach: who it is and where its raw KV events are published."""

    worker_id: int = attrs.field(validator=_u64)
    dp_rank: int = attrs.field(validator=_u32)
    endpoint: str = attrs.field(validator=_endpoint)
    topic: str = ""
    replay_endpoint: str | None = attrs.field(default=None, validator=_optional_endpoint)
    producer_instance: str = ""
    intent_incarnation: int | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
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
