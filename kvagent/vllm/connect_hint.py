"""Why a slot's SUB has met no engine yet, and what to do about it (the ``vllm_endpoint_unreachable`` hint).

A ZMQ SUB retries its connection forever and says nothing about why it fails, so when no handshake came in
time the reader asks the network once: a plain TCP connect to the live endpoint (and to the replay endpoint,
when the slot has one). The common case is an engine that is simply not up yet (pods start in any order):
the port refuses and so does the replay port; that is said as such, and the slot keeps retrying. vLLM's
bind-address trap (it binds its KV event endpoint only for ``tcp://*:PORT``, ``::`` or ipc, and otherwise
*connects*) is blamed only when the evidence points at it: the engine's replay ROUTER, which vLLM always
binds, accepts a connection while the live port refuses.
"""

from __future__ import annotations

import enum
import errno
import socket

import trio

__all__ = ["Reach", "diagnose_unreachable", "probe", "tcp_address", "unreachable_endpoint_hint"]

PROBE_TIMEOUT = 1.0  # seconds a probe may take (name resolution and the connect together)


class Reach(enum.Enum):
    """What one TCP connect to an endpoint found."""

    ACCEPTED = "accepted"  # something listens there
    REFUSED = "refused"  # the host answered: nothing listens on that port
    UNREACHABLE = "unreachable"  # no route, network down, host down
    UNRESOLVED = "unresolved"  # the host name does not resolve
    TIMEOUT = "timeout"  # no answer in time (a firewall that drops, a host that is not up)
    NOT_TCP = "not_tcp"  # ipc, inproc or an endpoint form the probe does not read


def tcp_address(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of a plain ``tcp://HOST:PORT`` endpoint (``[v6]`` brackets dropped), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if ";" in host or not host or not port.isdigit():  # a source address, or not a port: leave it be
        return None
    return host.strip("[]"), int(port)


async def probe(endpoint: str) -> Reach:
    """One TCP connect to ``endpoint``, closed at once (a ZMQ peer sees a connection that never greets)."""
    address = tcp_address(endpoint)
    if address is None:
        return Reach.NOT_TCP
    host, port = address
    with trio.move_on_after(PROBE_TIMEOUT):
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return Reach.UNRESOLVED
        family, kind, proto, _, sockaddr = infos[0]
        with trio.socket.socket(family, kind, proto) as sock:
            try:
                await sock.connect(sockaddr)
            except ConnectionRefusedError:
                return Reach.REFUSED
            except OSError as exc:
                return Reach.TIMEOUT if exc.errno == errno.ETIMEDOUT else Reach.UNREACHABLE
            return Reach.ACCEPTED
    return Reach.TIMEOUT


def unreachable_endpoint_hint(
    endpoint: str, reach: Reach = Reach.NOT_TCP, replay: Reach | None = None
) -> tuple[str, str]:
    """``(reason, hint)`` for a SUB that met no engine at ``endpoint``, from what the probes found.

    ``replay`` is the engine's replay endpoint's reach (None: the slot has none).
    """
    retrying = "the slot keeps retrying and logs vllm_endpoint_connected once it meets the engine"
    if reach is Reach.NOT_TCP:
        return (
            "nothing_bound",
            f"nothing is bound at {endpoint} — is the engine running and publishing its KV events there?",
        )
    if reach is Reach.REFUSED and replay is Reach.ACCEPTED:
        port = endpoint.rpartition(":")[2]
        return (
            "engine_not_bound",
            f"nothing is bound at {endpoint} although the engine's replay endpoint answers; vLLM binds its KV"
            f" event endpoint only for tcp://*:PORT (or ::/ipc) and otherwise CONNECTS — start vLLM with"
            f" endpoint tcp://*:{port}",
        )
    if reach is Reach.REFUSED:
        return (
            "engine_not_up",
            f"no engine listens at {endpoint} yet (connection refused): it is probably still starting, as"
            f" pods start in any order; {retrying}",
        )
    if reach is Reach.ACCEPTED:
        return (
            "no_handshake",
            f"something accepts connections at {endpoint} but no ZMQ publisher answered: is it the engine's"
            f" KV event port (not its HTTP or replay port)? {retrying}",
        )
    if reach is Reach.UNRESOLVED:
        return ("host_unresolved", f"the host of {endpoint} does not resolve (yet); {retrying}")
    return (
        "host_unreachable",
        f"no answer from the host of {endpoint} ({reach.value}): is it up, and is the port open to this"
        f" host? {retrying}",
    )


async def diagnose_unreachable(endpoint: str, replay_endpoint: str | None) -> tuple[str, str]:
    """Probe the live (and replay) endpoint and say why the SUB met no engine: ``(reason, hint)``."""
    reach = await probe(endpoint)
    replay = None
    if reach is Reach.REFUSED and replay_endpoint is not None:
        replay = await probe(replay_endpoint)
    return unreachable_endpoint_hint(endpoint, reach, replay)
