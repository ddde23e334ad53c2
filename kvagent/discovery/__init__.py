"""Discovery backends behind one URL: ``memory``, ``file:DIR`` (or ``file://DIR``), ``etcd://...``."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from kvagent.discovery.base import Discovery, DiscoveryRecord
from kvagent.discovery.file import FileDiscovery
from kvagent.discovery.memory import MemoryDiscovery
from kvagent.model.errors import DiscoveryConflict, DiscoveryError

__all__ = [
    "Discovery",
    "DiscoveryConflict",
    "DiscoveryError",
    "DiscoveryRecord",
    "FileDiscovery",
    "MemoryDiscovery",
    "check_discovery_url",
    "file_discovery_directory",
    "open_discovery",
]

DISCOVERY_URL_FORMS = "memory, file:DIR, file://DIR or etcd://HOST:PORT[,HOST:PORT][/PREFIX]"


def file_discovery_directory(url: str) -> Path | None:
    """The directory of a ``file:`` URL, or None if ``url`` is not one."""
    if url.startswith("file://"):
        rest = url[len("file://") :]
    elif url.startswith("file:"):
        rest = url[len("file:") :]
    else:
        return None
    if not rest:
        raise ValueError(f"discovery URL {url!r} names no directory (expected file:DIR)")
    return Path(rest).expanduser()


def check_discovery_url(url: str) -> None:
    """Raise ValueError unless ``url`` has a known discovery scheme (does not connect)."""
    if url == "memory" or file_discovery_directory(url) is not None:
        return
    if url.startswith(("etcd://", "etcds://")):
        if not url.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(f"discovery URL {url!r} names no etcd endpoint")
        return
    raise ValueError(f"unknown discovery URL {url!r} (expected {DISCOVERY_URL_FORMS})")


@asynccontextmanager
async def open_discovery(url: str, **options: Any) -> AsyncIterator[Discovery]:
    """Open the backend named by ``url`` for the duration of the block, closing it on exit."""
    check_discovery_url(url)
    if url.startswith(("etcd://", "etcds://")):
        # Imported lazily: the etcd backend pulls in an HTTP client and is owned by its own module.
        etcd_module = importlib.import_module("kvagent.discovery.etcd")
        opened: Any = etcd_module.open_etcd_discovery(url, **options)
        if hasattr(opened, "__aenter__"):  # an async context manager (the expected form)
            async with opened as etcd:
                yield etcd
            return
        etcd = await opened
        try:
            yield etcd
        finally:
            with trio.move_on_after(5, shield=True):
                await etcd.aclose()
        return
    if options:
        raise ValueError(f"discovery {url!r} takes no options, got {sorted(options)}")
    directory = file_discovery_directory(url)
    discovery: Discovery
    if directory is None:
        discovery = MemoryDiscovery()
    else:
        await trio.Path(directory).mkdir(parents=True, exist_ok=True)
        discovery = FileDiscovery(directory)
    try:
        yield discovery
    finally:
        with trio.move_on_after(5, shield=True):
            await discovery.aclose()
