"""The one way the figures start ``kvagent serve`` as a process, know it is up, and stop it.

:func:`start_serve` runs ``python -m kvagent serve ARGS`` (or another entry: :data:`NEVER_SHED_ENTRY`, a
profiling script) in a work directory and waits for its ``kvagent: serving N slot(s) on ws://...`` line.
That line is the process's own statement that it is up: it is printed once the websocket server (and the
HTTP surface, whose ``kvagent: HTTP surface on http://...`` line comes first) listens, every slot was added
and every configured engine attached. So the addresses are read from the process (``--listen`` and
``--http`` may be port 0: no port is picked in advance and raced for), nothing is polled, and a process that
exits or does not get there within the timeout fails with the tail of its log. The child's stdout and
stderr go to ``workdir/serve.log`` through a reader thread, which keeps draining them after the start so the
child never blocks on a full pipe. :meth:`ServeProcess.stop` sends SIGTERM (the clean shutdown) and waits a
bounded time, then kills.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

__all__ = [
    "INSTALLED_ENTRY",
    "NEVER_SHED_ENTRY",
    "SCRIPT_VARIABLE",
    "START_TIMEOUT",
    "ServeProcess",
    "server_entry",
    "start_serve",
]

INSTALLED_ENTRY = ("-m", "kvagent")  # the command as installed
NEVER_SHED_ENTRY = ("-m", "bench.serve_entry")  # the listener never sheds (bench/serve_entry.py)
# A script run in place of the entry with the same arguments (a profiling or tracing wrapper).
SCRIPT_VARIABLE = "KVAGENT_BENCH_SERVER_SCRIPT"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
# On the child's path, so this tree's kvagent and bench import whatever its working directory is.
ROOT = Path(__file__).resolve().parents[1]

_SERVING = re.compile(r"kvagent: serving \d+ slot\(s\) on (ws://\S+?)/v1/slots")
_HTTP = re.compile(r"kvagent: HTTP surface on (http://\S+)")


def server_entry(default: Sequence[str] = INSTALLED_ENTRY) -> tuple[str, ...]:
    """``[$KVAGENT_BENCH_SERVER_SCRIPT]`` when set, else ``default``."""
    script = os.environ.get(SCRIPT_VARIABLE)
    return (script,) if script else tuple(default)


class ServeProcess:
    """A started ``kvagent serve``: its process, its websocket base URL (``ws://host:port``), its HTTP URL
    (``http://host:port``, None without ``--http``) and its log."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log = log
        self.ws_url = ""
        self.http_url: str | None = None
        self._up = threading.Event()
        self._reader = threading.Thread(target=self._read, name="serve-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with self.log.open("wb") as log:
            for raw in self.process.stdout:
                log.write(raw)
                log.flush()
                if self._up.is_set():
                    continue
                line = raw.decode(errors="replace")
                if (http := _HTTP.search(line)) is not None:
                    self.http_url = http.group(1)
                elif (serving := _SERVING.search(line)) is not None:
                    self.ws_url = serving.group(1)
                    self._up.set()
        self._up.set()  # the output ended: the process is gone (wait_up tells which)

    def wait_up(self, timeout: float) -> None:
        """Until the serving line; raises (the process stopped) when it exits or the timeout passes first."""
        if self._up.wait(timeout) and self.ws_url:
            return
        if self._up.is_set():  # its output ended: it is exiting (reaped within the stop's bound)
            self.stop()
            what = f"exited with {self.process.returncode}"
        else:
            self.stop()
            what = f"was not serving after {timeout:.0f} s"
        raise RuntimeError(f"kvagent serve {what}:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, then at most ``timeout`` seconds for a clean exit, then SIGKILL; the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        return self.process.returncode

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


def start_serve(
    args: Sequence[str],
    workdir: Path,
    *,
    entry: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = START_TIMEOUT,
) -> ServeProcess:
    """``python ENTRY serve ARGS`` in ``workdir``, once it is serving (see the module docstring).

    ``entry`` defaults to :func:`server_entry` (``-m kvagent``, or the profiling script); ``env`` replaces
    the environment (``PYTHONUNBUFFERED=1`` is added so its lines arrive as printed, and the repository root
    to ``PYTHONPATH``). Paths in ``args`` are relative to ``workdir``.
    """
    command = [sys.executable, *(server_entry() if entry is None else entry), "serve", *args]
    environment = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    workdir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment
    )
    serve = ServeProcess(process, workdir / "serve.log")
    serve.wait_up(timeout)
    return serve
