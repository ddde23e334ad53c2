"""One name per counter: each ``kvagent_republish_*`` family reads the statistics field of its own name."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from kvagent.agent.metrics import _REPUBLISH
from kvagent.publish.republish_state import RepublishStatistics
from kvagent.publish.republisher import RepublisherStatistics


def _numbered(cls: type[RepublishStatistics] | type[RepublisherStatistics], start: int) -> dict[str, int]:
    """A distinct value for every int field of ``cls``, so a family reading another field is caught."""
    return {field.name: start + i for i, field in enumerate(attrs.fields(cls)) if field.type in (int, "int")}


STATE = _numbered(RepublishStatistics, 1)
SHELL = _numbered(RepublisherStatistics, 1000)
SHELL_FIELDS: dict[str, Any] = SHELL  # the bool field keeps its default
STATISTICS = RepublisherStatistics(state=RepublishStatistics(**STATE), **SHELL_FIELDS)


@pytest.mark.parametrize(("name", "read"), [(name, read) for name, _doc, _counter, read in _REPUBLISH])
def test_a_republish_family_reads_the_counter_of_its_name(name: str, read: object) -> None:
    assert callable(read)
    expected = SHELL.get(name, STATE.get(name))
    assert expected is not None, f"kvagent_republish_{name} has no statistics field of that name"
    assert read(STATISTICS) == expected
