"""Developer sessions: `nox -s lint typecheck tests`, plus `bench`, `fuzz`, `soak` and `interop`."""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True


# The tests that pin the pure-Python ingest path to the native core (kvagent/_native), and the ingest path's
# own: run a second time without the core (the first run uses it when it is built).
FALLBACK_TESTS = (
    "tests/unit/test_fast_path_batch.py",
    "tests/unit/test_fastpath.py",
    "tests/unit/test_native_ingest.py",
    "tests/unit/test_decode.py",
    "tests/unit/test_normalize.py",
    "tests/unit/test_coordinator.py",
    "tests/unit/test_coordinator_model.py",
    "tests/io/test_listener.py",
    "tests/unit/test_native_encode.py",
    "tests/unit/test_event_ring.py",
    "tests/unit/test_wire_columns.py",
    "tests/io/test_follow.py",
    "tests/io/test_dump_fast.py",
    "tests/unit/test_native_store.py",
    "tests/unit/test_stream_apply.py",
    "tests/unit/test_ring_retention.py",
)


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")  # the editable install builds the native core in place (setup.py)
    session.run("pytest", *session.posargs)
    if not session.posargs:
        session.run("pytest", *FALLBACK_TESTS, env={"KVAGENT_NO_NATIVE": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("-e", ".", "ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", "kvagent", "tests", "examples", "bench", "noxfile.py")
    # The layer rules of docs/architecture.md, as import-linter contracts in pyproject.toml.
    session.run("lint-imports")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[dev,bench]")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Every figure, ``ingest`` side by side with Dynamo's standalone indexer (docs/performance.md).

    Dynamo goes into a venv of its own (bench/dynamo_env.py: KVAGENT_DYNAMO_PYTHON, else the interop
    session's venv, else ``.nox/dynamo-peer`` with DYNAMO_RUNTIME or KVAGENT_DYNAMO_PACKAGE installed).
    ``nox -s bench -- ingest --quick`` runs just the side-by-side figure, quickly.
    """
    session.install("-e", ".[bench]")
    session.run("python", "-m", "bench", "--peer", "dynamo", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Long decoder/normalizer fuzz run (>= 1,000,000 inputs)."""
    session.install("-e", ".[test]")
    session.env["KVAGENT_FUZZ_INPUTS"] = session.posargs[0] if session.posargs else "1000000"
    session.run("python", "-m", "tests.support.fuzz_decoder")


@nox.session
def soak(session: nox.Session) -> None:
    """Bounded soak: steady ingest with churn and periodic reattach; RSS must stay flat."""
    session.install("-e", ".[test]")
    session.env["KVAGENT_SOAK_SECONDS"] = session.posargs[0] if session.posargs else "600"
    session.run("pytest", "-m", "slow", "tests/io/test_soak.py", "-s")


# Dynamo's standalone KV indexer, the real consumer `interop` runs against (docs/interop.md) and the peer of
# `bench` (bench/dynamo_env.py pins the same version).
DYNAMO_RUNTIME = "ai-dynamo-runtime==1.6.1"


@nox.session
def interop(session: nox.Session) -> None:
    """kvagent's streams against Dynamo's real standalone KV indexer, installed in a venv of its own.

    KVAGENT_DYNAMO_PACKAGE overrides what is installed there (e.g. a downloaded wheel's path).
    """
    session.install("-e", ".[test]")
    dynamo_venv = Path(session.virtualenv.location) / "dynamo"
    dynamo_python = dynamo_venv / "bin" / "python"
    if not dynamo_python.exists():
        session.run("python", "-m", "venv", str(dynamo_venv))
    package = os.environ.get("KVAGENT_DYNAMO_PACKAGE", DYNAMO_RUNTIME)
    session.run(str(dynamo_python), "-m", "pip", "install", "--quiet", package, external=True)
    session.env["KVAGENT_DYNAMO_PYTHON"] = str(dynamo_python)
    session.run("pytest", "tests/interop", *session.posargs)
