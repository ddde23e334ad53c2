"""The ``--slot`` grammar: ``NAME[=ENGINE_ENDPOINT][,KEY=VALUE...]`` (docs/configuration.md, README).

Each key overrides, for its slot only, the global flag that is otherwise every slot's default.
"""

from __future__ import annotations

import re

import attrs

from kvagent.model.errors import ConfigError
from kvagent.model.events import U32_MAX, U64_MAX

__all__ = ["SLOT_KEYS", "SlotSpec", "parse_slot_spec"]


def _slot_head(head: str, text: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME=ENGINE_ENDPOINT`` (the endpoint may itself contain ``=``)."""
    name, sep, endpoint = head.partition("=")
    if not name:
        raise ConfigError(f"--slot {text!r}: slot name must not be empty")
    if not sep:
        return name, None
    if not endpoint:
        raise ConfigError(f"--slot {text!r}: engine endpoint after '=' must not be empty")
    return name, endpoint


@attrs.frozen(slots=True)
class SlotSpec:
    """One ``--slot NAME[=ENDPOINT][,KEY=VALUE...]``; None: the key was not given (the global flag applies)."""

    name: str
    endpoint: str | None = None
    replay: str | None = None
    worker: int | None = None
    rank: int | None = None
    topic: str | None = None
    model: str | None = None


# The --slot keys: what each sets, and whether it needs an engine endpoint (it configures the attachment).
SLOT_KEYS = {
    "replay": ("the engine's replay endpoint (--replay)", True),
    "worker": ("the engine's worker id (--worker-id)", True),
    "rank": ("the slot's dp rank (--dp-rank)", False),
    "topic": ("the engine's topic filter (--topic)", True),
    "model": ("the served model (--model)", False),
}
# A comma starts a new key only where a ``key=`` follows, so endpoints and names keep their other commas.
_SLOT_KEY_SEPARATOR = re.compile(r",(?=[A-Za-z_][A-Za-z0-9_-]*=)")


def _slot_int(text: str, key: str, value: str, high: int) -> int:
    if not value.isdigit() or int(value) > high:
        raise ConfigError(f"--slot {text!r}: {key} must be an integer 0..{high}, got {value!r}")
    return int(value)


def parse_slot_spec(text: str) -> SlotSpec:
    """``NAME[=ENGINE_ENDPOINT][,replay=ENDPOINT][,worker=N][,rank=N][,topic=T][,model=M]``."""
    head, *pairs = _SLOT_KEY_SEPARATOR.split(text)
    name, endpoint = _slot_head(head, text)
    values: dict[str, str] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in SLOT_KEYS:
            raise ConfigError(f"--slot {text!r}: unknown key {key!r} (known: {', '.join(SLOT_KEYS)})")
        if key in values:
            raise ConfigError(f"--slot {text!r}: {key} is given twice")
        if not value and key != "topic":
            raise ConfigError(f"--slot {text!r}: {key} needs a value ({SLOT_KEYS[key][0]})")
        if endpoint is None and SLOT_KEYS[key][1]:
            raise ConfigError(
                f"--slot {text!r}: {key} configures the engine, so the slot needs one: "
                f"{name}=tcp://HOST:PORT,{pair}"
            )
        values[key] = value
    return SlotSpec(
        name=name,
        endpoint=endpoint,
        replay=values.get("replay"),
        worker=None if "worker" not in values else _slot_int(text, "worker", values["worker"], U64_MAX),
        rank=None if "rank" not in values else _slot_int(text, "rank", values["rank"], U32_MAX),
        topic=values.get("topic"),
        model=values.get("model"),
    )
