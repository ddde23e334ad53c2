"""Type stubs of the compiled ingest core (kvagent/_native/_ingest.pyx)."""

from collections.abc import Callable, Sequence
from typing import Any

from kvagent.model.events import PlacementEvent, RouterEvent, Stored

XXH3_SOURCE: str  # "libxxhash" (compiled in from the system's header) or "xxhash package" (setup.py)

def configure(
    stored: type,
    removed: type,
    placement: type,
    router: type,
    device: object,
    worker: object,
    cleared: object,
    fields: tuple[tuple[str, ...], ...],
) -> None: ...
def build_stored(parent: int | None, hashes: tuple[int, ...], tokens_hashes: tuple[int, ...], token_bytes: bytes) -> Stored: ...
def build_router(
    worker_id: int, tier: object, domain: object, event_id: int, data: object, rank: int, owner: object, session: str | None
) -> RouterEvent: ...
def normalize_payload(
    payload: bytes, block_size: int, rank: int, groups: dict[Any, Any]
) -> tuple[int | None, list[PlacementEvent], int, list[tuple[tuple[int, int], tuple[str, int | None]]]] | None: ...
def stamp_plain_chunk(
    events: Sequence[PlacementEvent],
    slot_rank: int,
    worker_id: int,
    owner: object,
    first_id: int,
    id_limit: int,
    dedup: Any,
    coalesce: Callable[[Sequence[PlacementEvent]], Sequence[PlacementEvent]],
    ids_taken: Callable[[int], None],
) -> tuple[list[RouterEvent], int] | None: ...
def chunk_blocks(events: Sequence[PlacementEvent]) -> int: ...
def encode_router_events(events: Sequence[RouterEvent]) -> bytes | None: ...
