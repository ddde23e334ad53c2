"""``[stream]`` / ``--stream``: every slot's events into its own Redis/Valkey stream (docs/fleet.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import attrs

from kvagent._util.redis_target import StreamTarget, parse_stream_url
from kvagent.model.errors import ConfigError
from kvagent.publish.stream_writer import StreamConfig

__all__ = ["StreamSettings", "add_stream_arguments", "apply_stream_args", "stream_config", "stream_problems"]


@attrs.frozen(slots=True)
class StreamSettings:
    """``[stream]``: the server, and how each slot's stream is kept (docs/fleet.md)."""

    url: str  # redis://HOST:PORT[/DB] or rediss://...
    password_file: str | None = None  # read at start; the password never sits in the config or argv
    username: str | None = None
    prefix: str = "kvagent"
    maxlen: int = 10_000  # entries kept per stream (approximate)
    entry_events: int = 256
    heartbeat_interval: float = 5.0


def stream_problems(settings: StreamSettings) -> list[str]:
    errors: list[str] = []
    try:
        parse_stream_url(settings.url)
    except ConfigError as exc:
        errors.append(f"stream.url (--stream): {exc}")
    if not settings.prefix or any(c in settings.prefix for c in "{} "):
        errors.append(f"stream.prefix: must be non-empty, without braces or spaces, got {settings.prefix!r}")
    for key in ("maxlen", "entry_events", "heartbeat_interval"):
        value = getattr(settings, key)
        if not value > 0:
            errors.append(f"stream.{key}: must be > 0, got {value}")
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
    target = StreamTarget(settings.url, password=password, username=settings.username)
    return StreamConfig(
        target,
        prefix=settings.prefix,
        maxlen=settings.maxlen,
        entry_events=settings.entry_events,
        heartbeat_interval=settings.heartbeat_interval,
    )


def add_stream_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("event streams in Redis/Valkey (TOML [stream]; docs/fleet.md)")
    group.add_argument(
        "--stream",
        metavar="redis://HOST:PORT[/DB]",
        help="append every slot's events to its own stream there",
    )
    group.add_argument("--stream-password-file", metavar="FILE", help="file holding the server's password")
    group.add_argument("--stream-prefix", metavar="PREFIX", help="key prefix (default kvagent)")


def apply_stream_args(data: dict[str, Any], args: argparse.Namespace) -> None:
    """The command line's stream options override the ``[stream]`` table key by key."""
    given = {
        key: value
        for key, value in (
            ("url", args.stream),
            ("password_file", args.stream_password_file),
            ("prefix", args.stream_prefix),
        )
        if value is not None
    }
    if given:
        table = data.get("stream")
        data["stream"] = {**(table if isinstance(table, dict) else {}), **given}
