"""Where a slot's event stream lives: a Redis/Valkey URL, its password, and the sync client built from them.

redis-py's sync client is used from one worker thread at a time (``trio.to_thread.run_sync``), owned by one
Trio task; its asyncio client does not run under Trio.  The client does no retries of its own: the owner
task backs off and decides what to re-read after a failure.
"""

from __future__ import annotations

import urllib.parse

import attrs
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvagent.model.errors import ConfigError

__all__ = ["StreamTarget", "parse_stream_url"]


def parse_stream_url(url: str) -> str:
    """``url`` checked: ``redis://HOST:PORT[/DB]`` or ``rediss://`` (TLS), without a password in it."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("redis", "rediss"):
        raise ConfigError(f"stream URL must be redis://HOST:PORT[/DB] or rediss://..., got {url!r}")
    if not parsed.hostname:
        raise ConfigError(f"stream URL {url!r} names no host")
    if parsed.password:
        raise ConfigError(
            "stream URL must not carry a password (it would show in the process list): "
            "put it in a file and name the file (--stream-password-file, or [stream] password_file)"
        )
    try:
        _ = parsed.port
    except ValueError as exc:
        raise ConfigError(f"stream URL {url!r}: {exc}") from None
    path = parsed.path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"stream URL database must be a number, got {path!r}")
    return url


@attrs.frozen(slots=True)
class StreamTarget:
    """A Redis/Valkey server (or a Valkey/Redis cluster's entry node) and how to talk to it."""

    url: str = attrs.field(converter=parse_stream_url)
    password: str | None = attrs.field(default=None, repr=False)
    username: str | None = None
    socket_timeout: float = 5.0

    def client(self) -> redis.Redis:
        """A new sync client (no connection is made until its first command)."""
        return redis.Redis.from_url(
            self.url,
            password=self.password,
            username=self.username,
            socket_timeout=self.socket_timeout,
            socket_connect_timeout=self.socket_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
