"""bench/serve_process.py, the one way the figures start ``kvagent serve``: up at its own serving line with
the addresses it bound, a failed start reported with its log, SIGTERM a clean stop."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from bench.serve_process import NEVER_SHED_ENTRY, start_serve

pytestmark = pytest.mark.timeout(120)

SIMULATED = ["--slot", "demo", "--simulate", "--listen", "127.0.0.1:0", "--discovery", "memory"]
QUIET = ["--state-dir", "none", "--token-file", "token", "--status-interval", "3600"]


@pytest.mark.parametrize("entry", [None, NEVER_SHED_ENTRY], ids=["installed", "never-shed"])
def test_a_started_serve_answers_at_the_addresses_it_printed_and_stops_cleanly(
    tmp_path: Path, entry: tuple[str, ...] | None
) -> None:
    with start_serve([*SIMULATED, "--http", "127.0.0.1:0", *QUIET], tmp_path, entry=entry) as serve:
        assert serve.ws_url.startswith("ws://127.0.0.1:") and serve.http_url is not None
        # The serving line comes after every slot was added: the slot is there at once.
        with urllib.request.urlopen(f"{serve.http_url}/v1/slots", timeout=10) as answer:
            assert [slot["name"] for slot in json.loads(answer.read())] == ["demo"]
        assert (tmp_path / "token").exists()  # relative paths are the work directory's
    assert serve.process.returncode == 0  # SIGTERM: the clean shutdown
    assert "kvagent: stopped" in serve.tail()


def test_a_serve_without_http_has_no_http_url(tmp_path: Path) -> None:
    with start_serve([*SIMULATED, *QUIET], tmp_path) as serve:
        assert serve.http_url is None and serve.ws_url


def test_a_serve_that_does_not_start_fails_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited with 2:[\s\S]*--no-such-flag"):
        start_serve([*SIMULATED, "--no-such-flag"], tmp_path)
