"""A bare clone stands alone: the test data is in the repository, `python -m kvagent` is the command, and a
test that hangs fails with its own name instead of stalling the run."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import kvagent
from tests.support.vectors import VECTORS_DIR, load_live, load_structs

REPO = Path(__file__).resolve().parents[2]
# A path that climbs out of the checkout to a sibling folder, as the vectors once did (the shared capture set).
BESIDE_THE_CHECKOUT = re.compile(r"\.parent\s*/\s*\"shared\"|\.\./shared/")


def test_vectors_live_inside_the_checkout() -> None:
    assert VECTORS_DIR.resolve().is_relative_to(REPO)
    sub, replay = load_live()
    assert len(sub) == 68 and replay  # the counts tests/data/vectors/README.md documents
    assert load_structs()


def test_no_test_reads_beside_the_checkout() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("*.py")
        if path.name != Path(__file__).name and BESIDE_THE_CHECKOUT.search(path.read_text())
    ]
    assert offenders == []


def test_python_dash_m_kvagent_is_the_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvagent", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert kvagent.__version__ in result.stdout


def test_a_hanging_test_fails_with_its_name(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(
        textwrap.dedent(
            """
            import threading

            def test_waits_forever():
                threading.Event().wait()
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--timeout=1", "-q", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 1, result.stdout
    assert "test_waits_forever" in result.stdout
    assert "Timeout" in result.stdout
