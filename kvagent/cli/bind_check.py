"""Two options that bind one TCP address, found before anything binds (issue #19)."""

from __future__ import annotations

import contextlib

from kvagent.agent.advertising import WILDCARD_HOSTS
from kvagent.cli.config import ServeConfig
from kvagent.cli.errors import EXIT_USAGE, CliError
from kvagent.model.errors import KvAgentError
from kvagent.publish.republisher import offset_endpoint

__all__ = ["check_distinct_addresses"]

def _tcp_host_port(address: str) -> tuple[str, int] | None:
    """``HOST:PORT`` or ``tcp://HOST:PORT`` as (host, port); None for ipc/inproc or what does not parse."""
    if "://" in address:
        scheme, _, address = address.partition("://")
        if scheme != "tcp":
            return None
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


def _bound_addresses(config: ServeConfig) -> list[tuple[str, str, int]]:
    """Every TCP address the process binds: (the option that names it, host, port)."""
    named: list[tuple[str, str]] = [(f"--listen {config.listen}", config.listen)]
    if config.http_listen:
        named.append((f"--http {config.http_listen}", config.http_listen))
    if config.publish:
        named.append((f"--publish {config.publish}", config.publish))
    for slot in config.slots:
        if slot.republish is None:
            continue
        for option, endpoint in (
            ("--republish", slot.republish.endpoint),
            ("--republish-replay", slot.republish.replay_endpoint),
        ):
            if endpoint is not None:
                with contextlib.suppress(KvAgentError):  # an endpoint that cannot be offset fails later
                    bound = offset_endpoint(endpoint, slot.dp_rank)
                    named.append((f"{option} {endpoint} (slot {slot.name} binds {bound})", bound))
    parsed = [(option, _tcp_host_port(address)) for option, address in named]
    return [(option, *host_port) for option, host_port in parsed if host_port is not None]


def check_distinct_addresses(config: ServeConfig) -> None:
    """Two options that bind one TCP address would fail as "already in use" by the process itself:
    said beforehand, naming both (a usage mistake, exit status 2)."""
    seen: list[tuple[str, str, int]] = []
    for option, host, port in _bound_addresses(config):
        for other, other_host, other_port in seen:
            overlap = host == other_host or host in WILDCARD_HOSTS or other_host in WILDCARD_HOSTS
            if port != 0 and port == other_port and overlap:
                raise CliError(
                    f"{option} and {other} bind the same address: give each its own port",
                    exit_status=EXIT_USAGE,
                )
        seen.append((option, host, port))
