"""Where the side-by-side figure gets Dynamo's standalone indexer: a python with ``ai-dynamo-runtime`` installed.

In order: ``KVAGENT_DYNAMO_PYTHON`` (e.g. the interop venv that ``nox -s interop`` made), a venv this module
made before (``.nox/dynamo-peer``), the interop session's venv (``.nox/interop/dynamo``), else a new venv at
``.nox/dynamo-peer`` with ``ai-dynamo-runtime==1.6.1`` installed by pip (``KVAGENT_DYNAMO_PACKAGE`` overrides
what is installed, e.g. a downloaded wheel's path). Dynamo is never installed next to kvagent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import attrs

DYNAMO_RUNTIME = "ai-dynamo-runtime==1.6.1"  # the same pin as noxfile.py's interop session
PYTHON_ENV = "KVAGENT_DYNAMO_PYTHON"
PACKAGE_ENV = "KVAGENT_DYNAMO_PACKAGE"
ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = ROOT / ".nox" / "dynamo-peer"
INTEROP_VENV = ROOT / ".nox" / "interop" / "dynamo"
INSTALL_TIMEOUT = 900.0


@attrs.frozen
class DynamoPython:
    """The python to run ``-m dynamo.indexer`` with, or None and the reason it could not be had."""

    python: str | None
    note: str


def _has_dynamo(python: Path | str) -> bool:
    try:
        probe = subprocess.run(
            [str(python), "-c", "import dynamo.llm"],
            capture_output=True,
            timeout=120,
            env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _venv_python(location: Path) -> Path:
    return location / "bin" / "python"


def _create(location: Path) -> DynamoPython:
    package = os.environ.get(PACKAGE_ENV, DYNAMO_RUNTIME)
    python = _venv_python(location)
    print(f"   installing {package} into {location} (once; later runs reuse it)", flush=True)
    try:
        if not python.exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(location)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", package],
            check=True,
            timeout=INSTALL_TIMEOUT,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or exc.stdout or "").strip().splitlines()
        return DynamoPython(None, f"pip could not install {package}: {lines[-1] if lines else exc}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return DynamoPython(None, f"could not create the Dynamo venv at {location}: {exc}")
    if not _has_dynamo(python):
        return DynamoPython(None, f"{package} installed at {location}, but `import dynamo.llm` fails there")
    return DynamoPython(str(python), f"Dynamo's indexer from {package} in {location}")


def find_dynamo(*, install: bool = True) -> DynamoPython:
    """A python that can run Dynamo's indexer (installing it into its own venv if allowed and needed)."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        if _has_dynamo(named):
            return DynamoPython(named, f"Dynamo's indexer from {PYTHON_ENV}={named}")
        return DynamoPython(None, f"{PYTHON_ENV}={named} cannot import dynamo.llm")
    for location in (BENCH_VENV, INTEROP_VENV):
        python = _venv_python(location)
        if python.exists() and _has_dynamo(python):
            return DynamoPython(str(python), f"Dynamo's indexer from the venv {location}")
    if not install:
        return DynamoPython(None, f"no Dynamo venv found (set {PYTHON_ENV}, or run with --peer dynamo)")
    return _create(BENCH_VENV)


if __name__ == "__main__":  # `python -m bench.dynamo_env`: create (or find) the venv and print its python
    found = find_dynamo()
    print(found.note)
    sys.exit(0 if found.python else 1)
