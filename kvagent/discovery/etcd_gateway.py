"""Transport for the etcd discovery backend: etcd's v3 JSON gateway over httpx, with failover.

Every request has its own timeout and is tried against the configured members in order, starting with
the last one that answered, so a dead member never hangs a caller.  No threads: httpx runs on Trio.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from kvagent.model.errors import DiscoveryError

__all__ = [
    "EtcdApiError",
    "EtcdGateway",
    "EtcdTarget",
    "EtcdUnreachable",
    "JsonList",
    "JsonObject",
    "KeyTaken",
    "StoredValue",
    "b64",
    "int_field",
    "parse_etcd_url",
    "prefix_range",
    "stored_value",
    "unb64",
]

DEFAULT_PREFIX = "/kvagent"
DEFAULT_PORT = 2379
# gRPC status codes the gateway reports in error bodies.
_GRPC_UNAVAILABLE = 14
_GRPC_UNAUTHENTICATED = 16

JsonObject = dict[str, Any]
JsonList = list[JsonObject]


@attrs.frozen(slots=True)
class EtcdTarget:
    """A parsed ``etcd://`` / ``etcds://`` URL: base URLs of the members and the key prefix."""

    endpoints: tuple[str, ...]
    prefix: str
    tls: bool


def parse_etcd_url(url: str) -> EtcdTarget:
    """``etcd://HOST[:PORT][,HOST[:PORT]...][/PREFIX]`` (``etcds://`` for TLS); default prefix /kvagent."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "etcds"):
        raise ValueError(f"not an etcd discovery URL (etcd:// or etcds://): {url!r}")
    hosts, slash, path = rest.partition("/")
    http_scheme = "https" if scheme == "etcds" else "http"
    endpoints = []
    for member in hosts.split(","):
        host, port = _split_host_port(member.strip(), url)
        endpoints.append(f"{http_scheme}://{host}:{port}")
    prefix = "/" + path.strip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    return EtcdTarget(endpoints=tuple(endpoints), prefix=prefix, tls=scheme == "etcds")


def _split_host_port(member: str, url: str) -> tuple[str, int]:
    if not member:
        raise ValueError(f"etcd URL has an empty member: {url!r}")
    if member.startswith("["):  # [IPv6]:PORT
        host, _, port_text = member[1:].partition("]")
        host, port_text = f"[{host}]", port_text.removeprefix(":")
    else:
        host, _, port_text = member.partition(":")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad port {port_text!r} in etcd URL {url!r}")
    return host, int(port_text)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range(prefix: bytes) -> tuple[str, str]:
    """(key, range_end) covering every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b64(prefix), b64(b"\0")  # all keys from prefix on
    end[-1] += 1
    return b64(prefix), b64(bytes(end))


def int_field(obj: Mapping[str, Any], field: str) -> int:
    # The gateway renders int64 as JSON strings and omits zero values entirely.
    return int(obj.get(field, 0))


@attrs.frozen(slots=True)
class StoredValue:
    """One key's value as etcd stores it, with the fences a txn compares against."""

    value: bytes
    mod_revision: int
    lease: int


def stored_value(kv: Mapping[str, Any]) -> StoredValue:
    return StoredValue(
        value=unb64(kv.get("value")), mod_revision=int_field(kv, "mod_revision"), lease=int_field(kv, "lease")
    )


class KeyTaken(Exception):
    """A put-if-absent found another value at the key (``existing``, as stored)."""

    def __init__(self, existing: bytes) -> None:
        super().__init__("key taken")
        self.existing = existing


class EtcdUnreachable(DiscoveryError):
    """No endpoint answered (connection refused, timeout, unavailable)."""


class EtcdApiError(DiscoveryError):
    """etcd answered with an error (the request reached the server and was refused)."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(f"etcd error (HTTP {status}, code {code}): {message}")
        self.grpc_code = code
        self.etcd_message = message


class EtcdGateway:
    """JSON calls to etcd's v3 gateway with per-request timeouts, endpoint failover and auth tokens."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        endpoints: tuple[str, ...],
        *,
        request_timeout: float,
        username: str | None,
        password: str | None,
    ) -> None:
        self._client = client
        self._endpoints = endpoints
        self._preferred = 0  # index of the last endpoint that answered
        self._timeout = httpx.Timeout(request_timeout)
        self._username = username
        self._password = password
        self._token: str | None = None

    def _endpoint_order(self) -> list[str]:
        n = len(self._endpoints)
        return [self._endpoints[(self._preferred + i) % n] for i in range(n)]

    async def call(self, path: str, body: JsonObject) -> JsonObject:
        """POST ``body`` to ``path``; refreshes the auth token once if etcd says it is invalid."""
        if self._username is not None and self._token is None:
            await self._authenticate()
        try:
            return await self._call_any(path, body, authenticated=True)
        except EtcdApiError as error:
            if self._username is None or error.grpc_code != _GRPC_UNAUTHENTICATED:
                raise
        self._token = None
        await self._authenticate()
        return await self._call_any(path, body, authenticated=True)

    async def _authenticate(self) -> None:
        answer = await self._call_any(
            "/v3/auth/authenticate", {"name": self._username, "password": self._password}, authenticated=False
        )
        self._token = str(answer["token"])

    def _headers(self, authenticated: bool) -> dict[str, str]:
        return {"Authorization": self._token} if authenticated and self._token else {}

    async def _call_any(self, path: str, body: JsonObject, *, authenticated: bool) -> JsonObject:
        failures: list[str] = []
        for index, endpoint in enumerate(self._endpoint_order()):
            try:
                response = await self._client.post(
                    endpoint + path, json=body, headers=self._headers(authenticated), timeout=self._timeout
                )
                answer = decode_answer(response)
            except (httpx.TransportError, EtcdUnreachable) as error:
                failures.append(f"{endpoint}: {error!r}")
                continue
            self._preferred = (self._preferred + index) % len(self._endpoints)
            return answer
        raise EtcdUnreachable(f"etcd unreachable ({path}): " + "; ".join(failures))

    @asynccontextmanager
    async def stream(self, path: str, body: JsonObject) -> AsyncIterator[AsyncIterator[str]]:
        """Open a streaming POST (watch) on the first endpoint that accepts it; yields its lines."""
        if self._username is not None and self._token is None:
            await self._authenticate()
        # Connecting is bounded; after that a watch may legitimately stay silent for as long as it likes.
        timeout = httpx.Timeout(self._timeout.connect, read=None)
        failures: list[str] = []
        for index, endpoint in enumerate(self._endpoint_order()):
            request = self._client.build_request(
                "POST", endpoint + path, json=body, headers=self._headers(True), timeout=timeout
            )
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TransportError as error:
                failures.append(f"{endpoint}: {error!r}")
                continue
            try:
                if response.status_code != 200:
                    await response.aread()
                    try:
                        decode_answer(response)
                    except EtcdUnreachable as error:
                        failures.append(f"{endpoint}: {error}")
                        continue
                self._preferred = (self._preferred + index) % len(self._endpoints)
                yield response.aiter_lines()
                return
            finally:
                with trio.move_on_after(1, shield=True):
                    await response.aclose()
        raise EtcdUnreachable(f"etcd unreachable ({path}): " + "; ".join(failures))


def decode_answer(response: httpx.Response) -> JsonObject:
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise EtcdUnreachable(f"etcd gateway answered HTTP {response.status_code} without a JSON object")
    error = answer.get("error")
    if response.status_code == 200 and error is None:
        return answer
    # Streaming endpoints wrap errors: {"error": {"grpc_code": .., "message": ..}}.
    if isinstance(error, dict):
        code, message = int(error.get("grpc_code", 0)), str(error.get("message", ""))
    else:
        code, message = int(answer.get("code", 0)), str(answer.get("message", error))
    if code == _GRPC_UNAVAILABLE or (response.status_code >= 500 and code == 0):
        raise EtcdUnreachable(f"etcd unavailable (HTTP {response.status_code}): {message}")
    raise EtcdApiError(response.status_code, code, message)
