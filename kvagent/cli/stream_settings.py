"""``[stream]`` / ``--stream``: every slot's events into its own Redis/Valkey stream (docs/fleet.md)."""

from __future__ import annotations

from pathlib import Path

import attrs

from kvagent._util.redis_target import StreamTarget, parse_stream_url
from kvagent.cli.options import setting
from kvagent.model.errors import ConfigError
from kvagent.model.options import configured, field_problems, option_from
from kvagent.stream.writer import StreamConfig

__all__ = ["StreamSettings", "stream_config", "stream_problems"]


@attrs.frozen(slots=True)
class StreamSettings:
    """``[stream]``: the server, and how each slot's stream is kept (docs/fleet.md)."""

    url: str = setting(
        help="append every slot's events to its own stream there (redis://HOST:PORT[/DB], rediss://, redis+cluster://)",
        flags=("--stream",),
        metavar="redis://HOST:PORT[/DB]",
    )
    # Read at start; the password never sits in the config or argv.
    password_file: str | None = setting(
        None,
        help="file holding the stream server's password",
        flags=("--stream-password-file",),
        metavar="FILE",
    )
    username: str | None = setting(None, help="the stream server's user (ACL), with password_file")
    cluster: bool = setting(
        False,
        help="the URL is a node of a Redis/Valkey Cluster: shard the slots over it (as a redis+cluster:// URL does)",
        flags=("--stream-cluster",),
        switch=True,
    )
    prefix: str = option_from(StreamConfig, "prefix")
    maxlen: int = option_from(StreamConfig, "maxlen")
    entry_events: int = option_from(StreamConfig, "entry_events")
    heartbeat_interval: float = option_from(StreamConfig, "heartbeat_interval")


def stream_problems(settings: StreamSettings) -> list[str]:
    errors: list[str] = []
    try:
        parse_stream_url(settings.url)
    except ConfigError as exc:
        errors.append(f"stream.url (--stream): {exc}")
    errors.extend(field_problems(settings, "stream"))
    return errors


def stream_config(settings: StreamSettings) -> StreamConfig:
    """The writer's config, with the password read from its file."""
    password = None
    if settings.password_file is not None:
        try:
            password = Path(settings.password_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"stream.password_file {settings.password_file}: {exc.strerror or exc}"
            ) from None
    target = StreamTarget(settings.url, password=password, username=settings.username, cluster=settings.cluster)
    return configured(StreamConfig, settings, target=target)
