"""Type stubs of the compiled columnar encoders and ring append (kvagent/_native/_columns.pyx).

Twins: kvagent/recovery/wire_columns.py (the encoders), kvagent/index/store.py (``BlockStore.rows_parent_first``)
and kvagent/index/ring.py (``RingSegment.append``); tests/unit/test_native_twins.py lists them.
"""

from array import array
from typing import Any

from kvagent.model.events import RouterEvent

def encode_ring_events(
    out: bytearray,
    ends: array[int],
    heads: list[bytes],
    tails: list[bytes],
    templates: Any,
    ids: array[int],
    routes: array[int],
    kinds: bytearray,
    parents: array[int],
    offsets: array[int],
    hashes: array[int],
    tokens: array[int],
    first: int,
    end: int,
) -> None: ...
def encode_dump_msgpack(
    out: bytearray,
    ends: array[int],
    template: Any,
    hashes: array[int],
    parents: array[int],
    tokens: array[int],
    flags: bytes,
    first: int,
    end: int,
    event_id: int,
) -> int: ...
def encode_dump_json(
    out: bytearray,
    ends: array[int],
    template: Any,
    hashes: array[int],
    parents: array[int],
    tokens: array[int],
    flags: bytes,
    first: int,
    end: int,
    event_id: int,
) -> int: ...
def parents_first(
    hashes: array[int], parents: array[int], flags: bytes | bytearray, slots: dict[int, int], span: int
) -> bool: ...
def ring_append(segment: Any, event: RouterEvent) -> None: ...
def encode_batch_rows(
    out: bytearray,
    route_map: array[int],
    ids: array[int],
    routes: array[int],
    kinds: bytes | bytearray | array[int],
    parents: array[int],
    offsets: array[int],
    hashes: array[int],
    tokens: array[int],
    first: int,
    end: int,
) -> None: ...
