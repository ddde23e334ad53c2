"""docs/protocol.md's close-code table lists exactly the codes the server sends."""

from __future__ import annotations

import re
from pathlib import Path

from kvagent.recovery import websocket

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_the_close_code_table_matches_the_codes_sent() -> None:
    section = DOC.read_text().split("## Close codes", 1)[1]
    documented = {int(code) for code in re.findall(r"^\| (\d{4}) \|", section, flags=re.MULTILINE)}
    sent = {
        value
        for name, value in vars(websocket).items()
        if name.startswith("CLOSE_") and isinstance(value, int) and value != websocket.CLOSE_ABNORMAL
    }
    assert documented == sent
