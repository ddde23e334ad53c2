"""Interop tests against Dynamo's real standalone indexer: skipped unless KVAGENT_DYNAMO_PYTHON is set.

``nox -s interop`` creates a venv with ai-dynamo-runtime, points KVAGENT_DYNAMO_PYTHON at its python and
runs this directory. Every test here carries the ``interop`` marker (``-m "not interop"`` leaves them out).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interop.dynamo import DYNAMO_PYTHON_ENV, dynamo_python

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason=f"{DYNAMO_PYTHON_ENV} is not set (run `nox -s interop`)")
    for item in items:
        if _HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.interop)
            if dynamo_python() is None:
                item.add_marker(skip)


@pytest.fixture
def dynamo() -> str:
    """The python with ``dynamo`` installed."""
    python = dynamo_python()
    if python is None:  # pragma: no cover - collection already skipped these tests
        pytest.skip(f"{DYNAMO_PYTHON_ENV} is not set")
    return python
