"""Loopback TCP ports for the tests that need one nothing listens on, or one something holds."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["free_port", "port_in_use"]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound and let go: a connection to it is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def port_in_use() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a TCP port that something else listens on (and never answers) while inside."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield f"127.0.0.1:{taken.getsockname()[1]}"
