"""The agent's HTTP routes (``kvagent serve --http HOST:PORT``): metrics, health, readiness, slot status and
dumps, answered by the HTTP server of ``kvagent/recovery/http.py`` (h11, deadlines, bounds: docs/http.md).

Routes (GET and HEAD; any other method is 405, an unknown path or slot 404, both with a JSON body)::

    /metrics                    Prometheus text (kvagent.agent.metrics)
    /healthz                    200 while the process serves
    /readyz                     200 iff every slot is attached and ready, else 503; JSON names each slot
    /v1/slots                   JSON list: each slot's name, state, readiness and status
    /v1/slots/{slot}/status     the websocket ``status`` op's status object
    /v1/slots/{slot}/dump       the tree dump as one JSON document (msgpack with Accept: application/msgpack)

``{slot}`` is percent-decoded. The dump is the websocket dump's content (the same events, ids from 0, the
same header fields), taken at one point of the slot's outbound stream (``last_event_id``: the index's
snapshot is a copy of its columns, about 25 bytes a block) and streamed; at most ``max_dumps`` stream at
once (more get 503 with Retry-After).
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import attrs
import trio

from kvagent.agent.metrics import MetricSources, readiness, render_metrics
from kvagent.agent.slot import SlotAgent
from kvagent.index.recovery_index import DumpSnapshot, TreeDumpFailedAnswer
from kvagent.model.events import RESET_ALL
from kvagent.recovery.dump import dump_document, snapshot_header
from kvagent.recovery.http import (
    JSON,
    HttpOptions,
    HttpRequest,
    HttpStats,
    Response,
    error_response,
    json_response,
    run_http_server,
)
from kvagent.wire.router_event import Encoding

__all__ = ["answer_request", "serve_http"]

MSGPACK = b"application/msgpack"


# --- routes -------------------------------------------------------------------------------------------


def _slot_entry(agent: SlotAgent) -> dict[str, object]:
    status = agent.status()
    return {
        "name": agent.name,
        "state": status.state,
        "ready": status.state == "ready",
        "status": status.to_json(),
    }


def _dump(agent: SlotAgent, msgpack_wanted: bool) -> Response:
    """The slot's tree dump at one point of its stream, unfenced (the operator's full view), streamed."""
    # A copy of the columns (a stale cached one is released first): later applies do not change it.
    snapshot = agent.index.range_or_snapshot(None, None)
    if isinstance(snapshot, TreeDumpFailedAnswer):  # never an empty dump in its place
        return error_response(500, "internal", f"worker tree dump failed: {snapshot.message}", "dump")
    if not isinstance(snapshot, DumpSnapshot):  # impossible: a range without a start is always a dump
        return error_response(500, "internal", "the index answered a dump request with events", "dump")
    header = {"kind": "tree_dump", **snapshot_header(snapshot, RESET_ALL)}
    encoding = Encoding.MSGPACK if msgpack_wanted else Encoding.JSON
    pieces = dump_document(encoding, header, snapshot.groups)
    content_type = MSGPACK if msgpack_wanted else JSON
    return Response(
        200, content_type, stream=pieces, headers=_last_event_header(snapshot.last_event_id), route="dump"
    )


def _last_event_header(last_event_id: int) -> tuple[tuple[bytes, bytes], ...]:
    return ((b"x-kvagent-last-event-id", str(last_event_id).encode()),)


def _slot_route(
    sources: MetricSources, segments: list[str], request: HttpRequest, dumps_allowed: bool
) -> Response:
    """``/v1/slots/{slot}/status`` and ``/v1/slots/{slot}/dump``."""
    name, action = segments
    route = action if action in ("status", "dump") else "other"
    if route == "other":
        return error_response(404, "not_found", "unknown path: use /v1/slots/{slot}/status or /dump")
    agent = next((agent for agent in sources.slots() if agent.name == name), None)
    if agent is None:
        return error_response(404, "not_found", f"no slot named {name!r} is served here", route)
    if route == "status":
        return json_response(200, agent.status().to_json(), route)
    if request.method == b"HEAD":  # the headers a GET would get, without taking a snapshot
        content_type = MSGPACK if request.wants_msgpack() else JSON
        headers = _last_event_header(agent.index.current_event_id())
        return Response(200, content_type, stream=(), headers=headers, route=route)
    if not dumps_allowed:  # refused before the snapshot is copied
        return error_response(
            503, "overloaded", "too many dumps are streaming; retry shortly", route, retry_after=b"1"
        )
    return _dump(agent, request.wants_msgpack())


def answer_request(sources: MetricSources, request: HttpRequest, *, dumps_allowed: bool = True) -> Response:
    """The response to one parsed request (a dump's body is still to be produced).

    ``dumps_allowed`` False: a dump request is answered 503 (too many are streaming; the server's
    ``streams_allowed``).
    """
    if request.method not in (b"GET", b"HEAD"):
        return error_response(405, "method_not_allowed", "only GET and HEAD are served", allow=b"GET, HEAD")
    try:
        path = urlsplit(request.target.decode("ascii")).path
    except (UnicodeDecodeError, ValueError):
        return error_response(400, "bad_request", "the request target is not a valid URL")
    if path == "/metrics":
        return Response(
            200, b"text/plain; version=0.0.4; charset=utf-8", render_metrics(sources), route="metrics"
        )
    if path == "/healthz":
        return Response(200, b"text/plain; charset=utf-8", b"ok\n", route="healthz")
    if path == "/readyz":
        states = None if sources.slot_states is None else sources.slot_states()
        ready, body = readiness(sources.slots(), states)
        return json_response(200 if ready else 503, body, "readyz")
    segments = path.strip("/").split("/")
    if segments[:2] == ["v1", "slots"]:
        if len(segments) == 2:
            agents = sorted(sources.slots(), key=lambda agent: agent.name)
            return json_response(200, [_slot_entry(agent) for agent in agents], "slots")
        if len(segments) == 4:
            # Split first, decode each segment after: an encoded '/' stays inside its segment.
            return _slot_route(sources, [unquote(segments[2]), segments[3]], request, dumps_allowed)
    return error_response(404, "not_found", f"unknown path {path!r}")


async def serve_http(
    sources: MetricSources,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    options: HttpOptions | None = None,
    stats: HttpStats | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the agent's routes until cancelled; ``started`` gets the bound port.

    Unless ``sources`` already names an HTTP statistics source, ``/metrics`` includes this server's own.
    """
    stats = stats if stats is not None else HttpStats()
    if sources.http is None:
        sources = attrs.evolve(sources, http=stats.statistics)
    routes = sources

    def answer(request: HttpRequest, *, streams_allowed: bool) -> Response:
        return answer_request(routes, request, dumps_allowed=streams_allowed)

    await run_http_server(answer, host=host, port=port, options=options, stats=stats, task_status=task_status)
