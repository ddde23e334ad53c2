"""One line per failure (issue #19): ``kvagent: error: …`` naming the flag and what to do.

A failure deep inside ``kvagent serve`` arrives as an ExceptionGroup (Trio nurseries wrap what their tasks
raise) around an ``OSError`` or ``zmq.ZMQError`` that names neither the flag nor the address. The CLI wraps
each place that binds or opens something an option names in :func:`blaming`, which turns such an error
into a :class:`CliError` saying which option, which address and what to do; :func:`explain` turns
whatever reaches ``main()`` into the one line and the exit status (2: a usage mistake, 1: at run time).
"""

from __future__ import annotations

import argparse
import errno
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import zmq
from trio_websocket import ConnectionClosed, ConnectionRejected

from kvagent.model.errors import ConfigError, IdentityError, KvAgentError

__all__ = [
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "CliError",
    "OneLineArgumentParser",
    "agent_connection_problem",
    "blame",
    "blaming",
    "describe",
    "explain",
    "find_cause",
    "one_line",
    "system_error",
]

EXIT_USAGE = 2
EXIT_RUNTIME = 1

def agent_connection_problem(url: str, exc: BaseException) -> str:
    """One line for a websocket connection to the agent at ``url`` that failed (``kvagent query`` and
    ``kvagent top``): refused at the handshake, closed by the agent, or never made."""
    if isinstance(exc, ConnectionRejected):
        body = (exc.body or b"").decode(errors="replace").strip()
        return f"{url} refused the connection: HTTP {exc.status_code} {body}".rstrip()
    if isinstance(exc, ConnectionClosed):
        reason = exc.reason
        detail = (
            ""
            if reason is None
            else f" (close code {reason.code}{f' {reason.reason}' if reason.reason else ''})"
        )
        return f"the agent at {url} closed the connection{detail}"
    cause = exc.__cause__ or exc.__context__ or exc
    return f"cannot reach an agent at {url}: {cause}"


# What to do about an errno (said after the system's own text), for every option that binds or opens.
_ADVICE = {
    errno.EADDRINUSE: "another process listens there: stop it or choose another port",
    errno.EADDRNOTAVAIL: "not an address of this machine: use one of its addresses, 127.0.0.1 or 0.0.0.0",
    errno.EROFS: "a read-only file system: choose a writable directory",
    errno.ENOSPC: "the disk is full: free space or choose another directory",
    errno.EDQUOT: "the disk quota is used up: free space or choose another directory",
    errno.EFBIG: "a file size limit (ulimit -f) is in force: raise it",
    errno.ENOTDIR: "a component of the path is a file, not a directory",
    errno.EEXIST: "it exists and is not a directory",
    errno.ECONNREFUSED: "is the service running there?",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n, LimitNOFILE=)",
}
_FILE_ACCESS = "make it writable for this user or choose another path"
_PORT_ACCESS = "ports below 1024 need privileges"


class CliError(KvAgentError):
    """A failure the CLI has already explained: the message names the option and what to do."""

    def __init__(self, message: str, *, exit_status: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (not the usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"kvagent: error: {message} (see `{self.prog} --help`)\n")


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def find_cause(exc: BaseException) -> BaseException | None:
    """The error to report from ``exc`` or the group it is: an explained CliError first, then any
    KvAgentError, then an OSError or ZMQError; None when there is none of them."""
    leaves = list(_leaves(exc))
    for kinds in (CliError, KvAgentError, (OSError, zmq.ZMQError)):
        for leaf in leaves:
            if isinstance(leaf, kinds):
                return leaf
    return None


def system_error(exc: BaseException) -> OSError | zmq.ZMQError | None:
    """The OSError/ZMQError at the root of ``exc`` (itself, or what it was raised from)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError | zmq.ZMQError):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


def _advice(system: OSError | zmq.ZMQError) -> str | None:
    if system.errno in (errno.EACCES, errno.EPERM):
        return _FILE_ACCESS if getattr(system, "filename", None) else _PORT_ACCESS
    return _ADVICE.get(system.errno or 0)


def _system_text(system: OSError | zmq.ZMQError) -> str:
    if isinstance(system, OSError) and system.strerror:
        return f"{system.filename}: {system.strerror}" if system.filename else system.strerror
    return str(system)


def describe(exc: BaseException) -> str:
    """A short text for ``exc`` that stands on its own after ``OPTION VALUE: ``: the messages of the
    chain it was raised from (each once), the system's error text, and what to do about that errno."""
    if isinstance(exc, CliError):
        return exc.message
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError | zmq.ZMQError):
            break
        text = current.message if isinstance(current, KvAgentError) else str(current)
        if text and not any(text in part for part in parts):
            parts.append(text)
        current = current.__cause__
    system = system_error(exc)
    if system is not None:
        strerror = getattr(system, "strerror", None)  # ZMQError has one too
        if not strerror or not any(strerror in part for part in parts):
            parts.append(_system_text(system))
        advice = _advice(system)
        if advice:
            parts[-1] = f"{parts[-1]}; {advice}"
    if not parts:
        return type(exc).__name__
    return ": ".join(parts)


@contextmanager
def blaming(
    option: str, value: object, *, what: str = "", fix: str = "", usage: tuple[type[Exception], ...] = ()
) -> Iterator[None]:
    """A KvAgentError, OSError or ZMQError in the block becomes a CliError naming ``option`` and
    ``value``; ``what`` says what the option is for, ``fix`` what to do. An error of a ``usage`` type
    (a value the option's code refuses) becomes one too, with exit status 2. A CliError (already
    explained) and other errors pass unchanged."""
    try:
        yield
    except Exception as exc:
        refused = next((leaf for leaf in _leaves(exc) if isinstance(leaf, usage)), None) if usage else None
        if refused is not None:
            prefix = f"{option} {value}" + (f" ({what})" if what else "")
            raise CliError(f"{prefix}: {refused}", exit_status=EXIT_USAGE) from exc
        cause = find_cause(exc)
        if cause is None or isinstance(cause, CliError):
            raise
        raise blame(option, value, cause, what=what, fix=fix) from exc


def blame(option: str, value: object, cause: BaseException, *, what: str = "", fix: str = "") -> CliError:
    """``cause`` explained as a failure of ``option`` set to ``value``."""
    prefix = f"{option} {value}" + (f" ({what})" if what else "")
    return CliError(f"{prefix}: {describe(cause)}" + (f"; {fix}" if fix else ""))


def explain(exc: BaseException) -> tuple[str, int]:
    """The one line (without the ``kvagent: error: `` prefix) and the exit status for ``exc``."""
    cause = find_cause(exc) or exc
    if isinstance(cause, CliError):
        return cause.message, cause.exit_status
    if isinstance(cause, ConfigError | IdentityError):
        return describe(cause), EXIT_USAGE
    if isinstance(cause, KvAgentError | OSError | zmq.ZMQError):
        return describe(cause), EXIT_RUNTIME
    return (
        f"unexpected {type(cause).__name__}: {cause} (rerun with --debug for the traceback and report it)",
        EXIT_RUNTIME,
    )


def one_line(message: str) -> str:
    """``message`` on one line: a listing (a config with several problems) is joined with ``; ``."""
    first, *rest = message.strip().splitlines() or [""]
    listing = "; ".join(line.strip() for line in rest if line.strip())
    return f"{first} {listing}" if listing else first
