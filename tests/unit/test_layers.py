"""The one layer rule import-linter cannot check: only ``kvagent.cli`` reads the environment or prints.

The file discovery backend and the persistence store are the other modules that touch the filesystem: a
directory or a state file is their storage.  Everything else gets paths, tokens and settings passed in,
and reports through return values, exceptions, logs and ``statistics()``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvagent

PACKAGE = Path(kvagent.__file__).parent
# The discovery backends own their storage directory (file: backend) and resolve ``file:DIR`` URLs; the
# persistence store owns its state file.
STORAGE_OWNERS = {"discovery/file.py", "discovery/__init__.py", "persist/store.py", "persist/schema.py"}
# The switch that forces the pure-Python ingest path (KVAGENT_NO_NATIVE=1) must hold for every embedder and
# test process, before anything ingests: kvagent/_native reads it when it is imported.
ENVIRONMENT_READERS = {"_native/__init__.py"}
CONSOLE_CALLS = {"print", "input", "breakpoint"}
ENVIRONMENT = {("os", "environ"), ("os", "getenv"), ("os", "putenv"), ("sys", "stdout"), ("sys", "stderr"), ("sys", "argv")}
FILE_METHODS = {"read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "unlink", "iterdir", "expanduser", "home"}


def _offences(tree: ast.AST, *, may_touch_files: bool, may_read_environment: bool = False) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called = node.func.id
            if called in CONSOLE_CALLS or (called == "open" and not may_touch_files):
                found.append(f"line {node.lineno}: {called}()")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (node.value.id, node.attr) in ENVIRONMENT
            and not (may_read_environment and (node.value.id, node.attr) == ("os", "environ"))
        ):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        if isinstance(node, ast.Attribute) and node.attr in FILE_METHODS and not may_touch_files:
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "cli")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_cli_reads_the_environment_or_prints(path: Path) -> None:
    relative = path.relative_to(PACKAGE).as_posix()
    offences = _offences(
        ast.parse(path.read_text()),
        may_touch_files=relative in STORAGE_OWNERS,
        may_read_environment=relative in ENVIRONMENT_READERS,
    )
    assert not offences, f"{relative}: {offences}"


def test_the_check_catches_each_kind_of_offence() -> None:
    source = "import os, sys\nprint(1)\nos.environ['X']\nsys.stderr.write('x')\nopen('f')\nPath('f').read_text()\n"
    assert len(_offences(ast.parse(source), may_touch_files=False)) == 5
    assert len(_offences(ast.parse(source), may_touch_files=True)) == 3
    assert len(_offences(ast.parse(source), may_touch_files=True, may_read_environment=True)) == 2
