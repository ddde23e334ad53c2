"""``kvagent top``: a live terminal view of every slot of a running agent.

Two websocket sources, both the documented protocol (docs/protocol.md): the ``list`` op on ``/v1/slots``,
polled every ``--interval`` (state, generation, cursor; the outbound cursor's growth is the events/s
sparkline), and one ``follow`` stream per slot (its tree-dump backlog, then live events), from which the
resident blocks per storage tier are kept.  ``q`` or Ctrl-C quits; ``--once`` prints one table and exits.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import termios
import tty
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import trio
from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError

from kvagent._util.sync import Changed
from kvagent.cli.errors import agent_connection_problem
from kvagent.model.errors import FollowOverrun, RecoveryClientError
from kvagent.model.events import Cleared, ResidencyDomain, RouterEvent, StorageTier, Stored
from kvagent.recovery.client import connect_slot
from kvagent.recovery.protocol import DEFAULT_URL

__all__ = ["SlotResidency", "SlotRow", "TopState", "add_top_parser", "render_table", "run_top", "sparkline"]

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 30  # samples in a sparkline
TIER_LABELS = {
    StorageTier.DEVICE: "dev",
    StorageTier.HOST_PINNED: "host",
    StorageTier.DISK: "disk",
    StorageTier.EXTERNAL: "ext",
}
# Why a slot is not ready (the same words as /readyz, docs/http.md).
STATE_REASONS = {
    "ready": "",
    "degraded": "history lost: Worker state is a subset until it resynchronises",
    "disconnected": "the engine's connection dropped",
    "unready": "attaching, detaching or quarantined",
    "detached": "no engine attached",
}
STATE_STYLES = {
    "ready": "green",
    "degraded": "yellow",
    "disconnected": "red",
    "unready": "red",
    "detached": "dim",
}


def add_top_parser(sub: Any) -> None:
    """Register ``kvagent top`` on the top-level subparsers."""
    top = sub.add_parser("top", help="a live view of every slot of a running agent (q or Ctrl-C quits)")
    top.add_argument("--url", default=DEFAULT_URL, help="agent websocket base URL")
    top.add_argument("--once", action="store_true", help="print one table and exit (no follow streams)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument(
        "--no-blocks",
        action="store_true",
        help="skip the per-tier block counts (no follow stream: nothing is dumped from a large index)",
    )


def sparkline(values: list[float]) -> str:
    """One character per value, scaled to the largest (an all-zero history is a flat baseline)."""
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, math.ceil(v / top * (len(SPARK) - 1)))] for v in values)


# --- the model: sans-IO, fed by the two sources ---------------------------------------------------


class SlotResidency:
    """Resident block hashes by store, as the agent's index keys them, kept from one slot's follow stream.

    A Worker store is (worker id, rank, tier), a CacheOwner store (owner, tier) whatever the worker; a
    Worker ``Cleared`` drops every Worker store of its rank, a CacheOwner one that owner's stores
    (kvagent/index/recovery_index.py, pinned by tests/unit/test_top_model.py); a ``Removed`` of a hash
    not held is ignored.
    """

    def __init__(self) -> None:
        # (Worker domain?, rank or CacheOwner, worker id or None, tier) -> resident hashes
        self._stores: dict[tuple[bool, object, int | None, StorageTier], set[int]] = {}
        self.last_event_id: int | None = None
        self.resets = 0  # Cleared events seen live: a Worker reset (degradation, restart) or a cache clear

    def apply(self, event: RouterEvent, *, live: bool) -> None:
        self.last_event_id = event.event_id
        worker = event.residency_domain is ResidencyDomain.WORKER
        owner: object = event.dp_rank if worker else event.state_source
        key = (worker, owner, event.worker_id if worker else None, event.storage_tier)
        data = event.data
        if isinstance(data, Stored):
            self._stores.setdefault(key, set()).update(data.block_hashes)
        elif isinstance(data, Cleared):
            self.resets += live
            for doomed in [k for k in self._stores if k[:2] == (worker, owner)]:
                del self._stores[doomed]
        else:
            self._stores.get(key, set()).difference_update(data.block_hashes)

    def by_tier(self) -> dict[StorageTier, int]:
        counts: dict[StorageTier, int] = {}
        for (_worker, _owner, _worker_id, tier), hashes in self._stores.items():
            counts[tier] = counts.get(tier, 0) + len(hashes)
        return counts


@attrs.define
class SlotRow:
    """What the table shows of one slot; ``status`` is the raw status object of the ``list`` answer."""

    name: str
    status: Mapping[str, Any] = attrs.field(factory=dict)
    rates: deque[float] = attrs.field(factory=lambda: deque(maxlen=HISTORY))
    residency: SlotResidency | None = None
    follow_error: str = ""
    _last_sample: tuple[float, int] | None = None

    def sample(self, status: Mapping[str, Any], now: float) -> None:
        """A new status; the outbound cursor's growth since the last one is this interval's events/s."""
        self.status = status
        cursor = int(status.get("outbound_cursor") or 0)
        if self._last_sample is not None:
            then, before = self._last_sample
            if now > then and cursor >= before:  # a restart lowers the cursor: no rate for that interval
                self.rates.append((cursor - before) / (now - then))
        self._last_sample = (now, cursor)

    @property
    def attachment(self) -> Mapping[str, Any] | None:
        value = self.status.get("attachment")
        return value if isinstance(value, Mapping) else None

    @property
    def state(self) -> str:
        attachment = self.attachment
        return "detached" if attachment is None else str(attachment.get("state", "unready"))

    def reason(self) -> str:
        words = [STATE_REASONS.get(self.state, "")]
        for key in ("reason", "quarantine_reason", "degraded_reason"):  # shown when an agent reports them
            extra = self.status.get(key) or (self.attachment or {}).get(key)
            if extra:
                words.append(str(extra))
        if self.residency is not None and self.residency.resets:
            words.append(f"{self.residency.resets} reset(s) seen")
        if self.follow_error:
            words.append(self.follow_error)
        return "; ".join(word for word in words if word)


@attrs.define
class TopState:
    url: str
    rows: dict[str, SlotRow] = attrs.field(factory=dict)
    updated: Changed = attrs.field(factory=Changed)

    def apply_list(self, slots: list[dict[str, Any]], now: float) -> list[str]:
        """The ``list`` answer; returns the names of slots seen for the first time."""
        new: list[str] = []
        for entry in slots:
            name = str(entry.get("name"))
            if name not in self.rows:
                self.rows[name] = SlotRow(name)
                new.append(name)
            status = entry.get("status")
            self.rows[name].sample(status if isinstance(status, Mapping) else {}, now)
        self.changed()
        return new

    def changed(self) -> None:
        self.updated.notify()


# --- rendering ---------------------------------------------------------------------------------------


def _blocks(row: SlotRow) -> str:
    if row.residency is None:
        return "-"
    counts = row.residency.by_tier()
    if not counts:
        return "0"
    return " ".join(f"{TIER_LABELS[tier]} {counts[tier]}" for tier in TIER_LABELS if tier in counts)


def _age(status: Mapping[str, Any]) -> str:
    age = status.get("last_event_age_s")
    return "-" if not isinstance(age, int | float) else f"{age:.0f}s"


def _persist_lag(status: Mapping[str, Any]) -> str:
    persistence = status.get("persistence")
    if not isinstance(persistence, Mapping) or persistence.get("state") == "off":
        return "-"
    return str(persistence.get("lag_events", "-"))


def render_table(state: TopState) -> Table:
    table = Table(title=f"kvagent top  {state.url}  (q quits)", box=box.SQUARE, title_justify="left")
    for column in ("slot", "state", "gen", "cursor", "ev/s", "history", "blocks", "age", "lag", "reason"):
        table.add_column(
            column, no_wrap=column != "reason", justify="right" if column in ("gen", "cursor") else "left"
        )
    for name in sorted(state.rows):
        row = state.rows[name]
        attachment = row.attachment or {}
        rates = list(row.rates)
        table.add_row(
            name,
            Text(row.state, style=STATE_STYLES.get(row.state, "")),
            str(attachment.get("generation", "-")),
            str(row.status.get("outbound_cursor", "-")),
            f"{rates[-1]:.0f}" if rates else "-",
            sparkline(rates),
            _blocks(row),
            _age(row.status),
            _persist_lag(row.status),
            row.reason(),
        )
    return table


# --- I/O -----------------------------------------------------------------------------------------------


class TopError(Exception):
    """A failure to report in one line (exit status 1)."""


@contextmanager
def _client_errors(url: str) -> Iterator[None]:
    """Websocket failures as one TopError line each (the wording of ``kvagent query``)."""
    try:
        yield
    except RecoveryClientError as exc:
        raise TopError(f"{exc.code}: {exc.message}") from None
    except (ConnectionRejected, ConnectionClosed, HandshakeError, OSError) as exc:
        raise TopError(agent_connection_problem(url, exc)) from None


async def _poll_list(state: TopState, interval: float, nursery: trio.Nursery, follow: bool) -> None:
    with _client_errors(state.url):
        async with connect_slot(state.url, None, encoding="msgpack") as client:
            while True:
                for name in state.apply_list(await client.list_slots(), trio.current_time()):
                    if follow:
                        nursery.start_soon(_follow_slot, state, name)
                await trio.sleep(interval)


async def _follow_slot(state: TopState, name: str) -> None:
    """Keep one slot's per-tier residency from its follow stream; restart (with a new dump) on overrun."""
    row = state.rows[name]
    while True:
        residency = SlotResidency()
        try:
            async with connect_slot(state.url, name, encoding="msgpack") as client:
                async for item in client.follow(None):
                    for event in item.events:
                        residency.apply(event, live=item.kind == "live")
                    if item.kind == "live" or not item.more:
                        row.residency, row.follow_error = residency, ""
                        state.changed()
        except FollowOverrun:
            row.follow_error = "block view overran; re-reading"
            state.changed()
            await trio.sleep(1)  # each retry re-reads a whole dump: not in a tight loop
            continue
        except (RecoveryClientError, ConnectionRejected, ConnectionClosed, HandshakeError, OSError) as exc:
            # The slot went away (or the agent is stopping): the list poll reports the agent itself.
            row.residency, row.follow_error = None, f"block view stopped: {type(exc).__name__}"
            state.changed()
            return


@contextmanager
def _cbreak(fd: int) -> Iterator[bool]:
    """Single keys without Enter (Ctrl-C still signals); the terminal is restored however we leave."""
    if not os.isatty(fd):
        yield False
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _until_quit(fd: int, keys: bool, signals: AsyncIterator[int]) -> None:
    """Returns on ``q`` (when reading keys) or a signal."""
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            async for _ in signals:
                nursery.cancel_scope.cancel()

        async def on_key() -> None:
            while True:
                # The terminal's own FD (FdStream would make the shared tty non-blocking for the shell too).
                await trio.lowlevel.wait_readable(fd)
                typed = os.read(fd, 32)
                if not typed or b"q" in typed.lower():
                    nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        if keys:
            nursery.start_soon(on_key)


async def _live(state: TopState, args: argparse.Namespace, console: Console) -> None:
    stdin = sys.stdin.fileno()
    # Ctrl-C (and SIGTERM) end the view like ``q`` from the first frame on, never as a KeyboardInterrupt.
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        _cbreak(stdin) as keys,
        Live(render_table(state), console=console, auto_refresh=False) as live,
    ):
        async with trio.open_nursery() as nursery:

            async def quit_then_stop() -> None:
                await _until_quit(stdin, keys, signals)
                nursery.cancel_scope.cancel()

            async def redraw() -> None:
                while True:
                    drawn = state.updated.version  # this frame shows every change up to here
                    live.update(render_table(state), refresh=True)
                    await state.updated.wait(drawn)
                    await trio.sleep(0.1)  # at most ten redraws a second, however busy the streams are

            nursery.start_soon(quit_then_stop)
            if not args.no_blocks:
                for name in state.rows:  # slots of the first list; the poll starts the ones that appear later
                    nursery.start_soon(_follow_slot, state, name)
            nursery.start_soon(_poll_list, state, args.interval, nursery, not args.no_blocks)
            nursery.start_soon(redraw)


async def run_top(args: argparse.Namespace) -> int:
    if not args.url.startswith(("ws://", "wss://")):
        print(
            f"kvagent: error: --url must be ws://HOST:PORT or wss://HOST:PORT, got {args.url!r}",
            file=sys.stderr,
        )
        return 2
    if not args.interval > 0:
        print(
            f"kvagent: error: --interval must be a positive number of seconds, got {args.interval}",
            file=sys.stderr,
        )
        return 2
    state = TopState(args.url)
    console = Console()
    failure: TopError | None = None
    try:
        await _show(state, args, console)
    except* TopError as group:  # raised here, or inside the view's nurseries (then grouped)
        failure = _first(group)
    if failure is not None:
        print(f"kvagent: error: {failure}", file=sys.stderr)
        return 1
    return 0


async def _show(state: TopState, args: argparse.Namespace, console: Console) -> None:
    with _client_errors(args.url):
        async with connect_slot(args.url, None, encoding="msgpack") as client:
            state.apply_list(await client.list_slots(), trio.current_time())
    if args.once or not console.is_terminal:
        console.print(render_table(state))
    else:
        await _live(state, args, console)


def _first(group: BaseExceptionGroup[TopError]) -> TopError:
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, TopError)  # split by except* TopError: every leaf is one
    return leaf
