"""Reading a slot's state file back the way a restarted agent would, for the persistence tests."""

from __future__ import annotations

from pathlib import Path

from kvagent.persist.store import LoadedSlot, SlotStore

__all__ = ["load_state_file"]


def load_state_file(path: Path) -> LoadedSlot:
    """Open the existing state file at ``path``, load it and close it; the file must hold a slot."""
    store = SlotStore.open(path, create=False)
    try:
        loaded = store.load()
    finally:
        store.close()
    assert loaded is not None
    return loaded
