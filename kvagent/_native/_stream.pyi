"""Type stubs of the compiled stream-entry apply loop (kvagent/_native/_stream.pyx)."""

from collections.abc import Sequence

from kvagent.index.store import ResidentStore
from kvagent.model.events import StoredExtra

def run_ops(
    stores: Sequence[ResidentStore | None],
    kinds: bytes,
    codes: Sequence[int],
    counts: Sequence[int],
    hashes: Sequence[int],
    tokens: Sequence[int],
    parents: Sequence[int],
    extras: dict[int, StoredExtra],
    position: int,
    offsets: tuple[int, int, int],
) -> tuple[int, tuple[int, int, int]]: ...
