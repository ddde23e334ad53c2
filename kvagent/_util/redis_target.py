"""Where a slot's event stream lives: a Redis/Valkey URL (one server, or a cluster), its password, and the
sync client built from them.

redis-py's sync client is used from worker threads (``trio.to_thread.run_sync``), owned by one Trio task;
its asyncio client does not run under Trio.  The client does no retries of its own: the owner task backs off
and decides what to re-read after a failure.  A cluster client (``cluster=True``: ``--stream-cluster``, or a
``redis+cluster://`` / ``rediss+cluster://`` URL) follows MOVED and ASK redirections and refreshes its slot map
itself; it too never retries a command on another node after a connection error (a master killed mid-write:
the owner must re-read the stream's top from the replica that took over before it writes again).
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import attrs
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvagent.model.errors import ConfigError

__all__ = [
    "REDIS_ERRORS",
    "OwnedClient",
    "RedisClient",
    "StreamTarget",
    "describe_redis_error",
    "doorbell_channel",
    "parse_stream_url",
]

RedisClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster
# What a Redis call may raise: the server's or the socket's errors, and the cluster client's own (it raises
# RedisClusterException, not a RedisError, when no startup node answers or the node is not a cluster's).
REDIS_ERRORS = (redis.RedisError, OSError, redis.exceptions.RedisClusterException)

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def _split_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``url`` with its first node only, and the further ``HOST:PORT`` nodes a cluster URL may list
    (``redis+cluster://a:7000,b:7000,c:7000``: any one that answers is enough to find the cluster)."""
    parsed = urllib.parse.urlsplit(url)
    first, *rest = parsed.netloc.split(",")
    extra: list[tuple[str, int]] = []
    for node in rest:
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"stream URL {url!r}: a further node must be HOST:PORT, got {node!r}")
        extra.append((host.strip("[]"), int(port)))
    return urllib.parse.urlunsplit(parsed._replace(netloc=first)), extra


def parse_stream_url(url: str) -> str:
    """``url`` checked: ``redis://HOST:PORT[/DB]``, ``rediss://`` (TLS), or ``redis+cluster://HOST:PORT``
    (``rediss+cluster://``; ``,HOST:PORT`` may name further nodes), without a password in it."""
    parsed = urllib.parse.urlsplit(_split_nodes(url)[0])
    if parsed.scheme not in ("redis", "rediss", *_CLUSTER_SCHEMES):
        raise ConfigError(
            f"stream URL must be redis://HOST:PORT[/DB], rediss://... or redis+cluster://HOST:PORT, got {url!r}"
        )
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
    if parsed.scheme in _CLUSTER_SCHEMES and path not in ("", "0"):
        raise ConfigError(f"stream URL {url!r}: a cluster has only database 0")
    return url


def describe_redis_error(exc: BaseException, *, cluster: bool) -> str:
    """One line a person can act on, for the errors a wrong setup gives (else the error's own text)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, redis.exceptions.MovedError | redis.exceptions.AskError) and not cluster:
        return (
            f"{type(exc).__name__}: the server is a Redis Cluster node: use a redis+cluster:// URL, "
            "or --stream-cluster (TOML stream.cluster = true; stream-follow --cluster)"
        )
    if (
        cluster
        and isinstance(exc, redis.exceptions.RedisClusterException | redis.ResponseError)
        and ("cluster mode is not enabled" in text.lower() or "cluster support disabled" in text.lower())
    ):
        return (
            f"{type(exc).__name__}: the server is not a Redis Cluster node: "
            f"use a redis:// URL without --stream-cluster ({text})"
        )
    lowered = text.lower()
    if isinstance(exc, redis.AuthenticationError) or any(
        word in lowered for word in ("username-password", "wrongpass", "noauth", "invalid password", "noperm")
    ):
        return f"{type(exc).__name__}: the server refused the credentials (--stream-password-file, username): {text}"
    return f"{type(exc).__name__}: {text}"


def doorbell_channel(tag: str) -> str:
    """The sharded pub/sub channel (``SPUBLISH``/``SSUBSCRIBE``) that a slot's writer rings after appending to
    its stream on a cluster: ``tag`` is the slot's hash tag, so the channel lives on the stream's shard."""
    return f"{tag}:ring"


def _cluster_url(url: str) -> str:
    parsed = urllib.parse.urlsplit(_split_nodes(url)[0])
    scheme = _CLUSTER_SCHEMES.get(parsed.scheme, parsed.scheme)
    return urllib.parse.urlunsplit((scheme, parsed.netloc, "", "", ""))


@attrs.frozen(slots=True)
class StreamTarget:
    """A Redis/Valkey server, or a Redis/Valkey cluster (reached through any of its nodes), and how to talk to
    it."""

    url: str = attrs.field(converter=parse_stream_url)
    password: str | None = attrs.field(default=None, repr=False)
    username: str | None = None
    socket_timeout: float = 5.0
    cluster: bool = False

    def __attrs_post_init__(self) -> None:
        if _split_nodes(self.url)[1] and not self.is_cluster:
            raise ConfigError(f"stream URL {self.url!r} names several nodes: only a cluster's URL may")

    @property
    def is_cluster(self) -> bool:
        """A cluster: said by the flag, or by the URL's scheme."""
        return self.cluster or urllib.parse.urlsplit(self.url).scheme in _CLUSTER_SCHEMES

    def client(self) -> RedisClient:
        """A new sync client.  A plain one connects at its first command; a cluster one reads the cluster's
        slot map from the URL's node now (blocking: call it from a worker thread; raises what a command
        would)."""
        # No retry of redis-py's own: the caller's failure path decides (and a cluster re-reads its map).
        settings: dict[str, Any] = {
            "password": self.password,
            "username": self.username,
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        if self.is_cluster:
            return redis.cluster.RedisCluster.from_url(
                _cluster_url(self.url),
                startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in _split_nodes(self.url)[1]],  # type: ignore[no-untyped-call]
                **settings,
            )
        return redis.Redis.from_url(self.url, **settings)


_T = TypeVar("_T")


class OwnedClient:
    """The client of one Trio task, made, refreshed and used only inside that task's worker-thread calls.

    After a failure (:meth:`failed`), a plain client is replaced by a new one (its sockets may hang); a
    cluster client is kept and re-reads the cluster's slot map at the next call, from every node it has
    learned (the URL's node may be the master that was killed).
    """

    def __init__(self, factory: Callable[[], RedisClient]) -> None:
        self._factory = factory
        self._client: RedisClient | None = None
        self._stale: list[RedisClient] = []
        self._refresh = False

    def call(self, fn: Callable[[RedisClient], _T]) -> _T:
        """Run ``fn`` with the client (blocking: from a worker thread, one call at a time)."""
        while self._stale:  # clients dropped after a failure: closed here, off the Trio thread
            with contextlib.suppress(*REDIS_ERRORS):
                self._stale.pop().close()
        client = self._client
        if client is None:
            client = self._client = self._factory()  # a cluster client reads the slot map now
        elif self._refresh and isinstance(client, redis.cluster.RedisCluster):
            client.nodes_manager.initialize()
        self._refresh = False
        return fn(client)

    def failed(self) -> None:
        """A call failed: refresh (a cluster client) or replace (a plain one) before the next call."""
        if isinstance(self._client, redis.cluster.RedisCluster):
            self._refresh = True
        elif self._client is not None:
            self._stale.append(self._client)
            self._client = None

    def close(self) -> None:
        """Close every client (blocking)."""
        self.failed()
        if self._client is not None:
            self._stale.append(self._client)
            self._client = None
        while self._stale:
            with contextlib.suppress(*REDIS_ERRORS):
                self._stale.pop().close()
