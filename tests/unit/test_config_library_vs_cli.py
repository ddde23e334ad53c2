"""A library user and a ``kvagent serve`` user who set nothing get the same agent (issue #35 item 1).

The serve settings take every runtime option from its one declaration (kvagent/model/options.py), so what
``kvagent serve --slot NAME=ENDPOINT`` builds equals what ``open_slot_agent(SlotAgentConfig(name, id))``
runs, but for what only a deployment has: where the slot is reached and where its state is kept.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from kvagent.agent.config import AttachmentConfig, SlotAgentConfig
from kvagent.cli.config import SERVE_OPTIONS
from kvagent.cli.main import build_parser, serve_config_from_args
from kvagent.cli.serve import engine_attachment, slot_agent_config
from kvagent.model.errors import ConfigError
from kvagent.model.ids import derive_cache_owner_id, derive_worker_id
from kvagent.model.options import configured, declared
from kvagent.recovery.server import ServingOptions
from kvagent.stream.writer import StreamConfig
from kvagent.vllm.listener import ListenerOptions

ENDPOINT = "tcp://127.0.0.1:5557"
RECOVERY_URL = "ws://127.0.0.1:8765/v1/slots/gpu0"


@pytest.fixture(autouse=True)
def _state_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVAGENT_STATE_DIR", str(tmp_path))


def test_serve_without_flags_builds_the_library_s_default_slot_agent() -> None:
    serve = serve_config_from_args(build_parser().parse_args(["serve", "--slot", f"gpu0={ENDPOINT}", "--model", "m"]))
    (slot,) = serve.slots
    from_cli = slot_agent_config(slot, serve, recovery_url=RECOVERY_URL)

    library = SlotAgentConfig(name="gpu0", cache_owner_id=derive_cache_owner_id("gpu0", kv_block_size=16, model="m"))
    # What only a deployment has: where the slot is reached and where its state is kept.
    deployed = attrs.evolve(
        library,
        kv_state_endpoint=from_cli.kv_state_endpoint,
        recovery_url=from_cli.recovery_url,
        state_path=from_cli.state_path,
    )
    assert deployed == from_cli
    assert from_cli.listener == ListenerOptions()
    assert (from_cli.listener.shed_after, from_cli.listener.coalesce_window) == (5.0, 0.02)

    library_attachment = AttachmentConfig(worker_id=derive_worker_id("gpu0", ENDPOINT), dp_rank=0, endpoint=ENDPOINT)
    assert slot.engine is not None
    assert engine_attachment(slot, slot.engine) == library_attachment
    assert configured(ServingOptions, serve) == ServingOptions()


def test_a_flag_reaches_the_runtime_class_it_declares() -> None:
    argv = ["serve", "--slot", "gpu0", "--shed-after", "0", "--coalesce-window", "0", "--block-size", "32"]
    serve = serve_config_from_args(build_parser().parse_args(argv))
    agent = slot_agent_config(serve.slots[0], serve, recovery_url=RECOVERY_URL)
    assert (agent.listener.shed_after, agent.listener.coalesce_window, agent.kv_block_size) == (0.0, 0.0, 32)


def test_every_serve_option_of_a_runtime_class_has_its_default() -> None:
    """Each settings field standing for a runtime option has that option's declaration and default."""
    runtime_classes = {AttachmentConfig, ListenerOptions, ServingOptions, SlotAgentConfig, StreamConfig}
    seen: set[type] = set()
    for _, field, option in SERVE_OPTIONS:
        if option.source is None:
            continue
        runtime, name = option.source
        seen.add(runtime)
        runtime_field = attrs.fields_dict(runtime)[name]
        assert declared(runtime_field) == attrs.evolve(option, source=None) or name == "ingress_bytes"
        if (runtime, name) != (AttachmentConfig, "worker_id"):  # serve derives it when it is not set
            assert field.default == runtime_field.default, (runtime.__name__, name)
    assert runtime_classes <= seen


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: AttachmentConfig(worker_id=1, dp_rank=0, endpoint="tcp://*:5557"), "is a bind address"),
        (lambda: ListenerOptions(coalesce_window=2), "coalesce_window: must be 0..1 seconds, got 2"),
        (lambda: ListenerOptions(shed_after=-1), "shed_after: must be >= 0 seconds"),
        (lambda: ServingOptions(max_connections=0), "max_connections: must be > 0, got 0"),
    ],
)
def test_the_library_refuses_what_serve_refuses_with_the_same_words(build: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("*", r"\*")):
        build()  # type: ignore[operator]
    argv = {
        "is a bind address": ["--slot", "a=tcp://*:5557"],
        "coalesce_window": ["--slot", "a", "--coalesce-window", "2"],
        "shed_after": ["--slot", "a", "--shed-after", "-1"],
        "max_connections": ["--slot", "a", "--max-connections", "0"],
    }
    (flags,) = [flags for key, flags in argv.items() if key in message]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("*", r"\*")):
        serve_config_from_args(build_parser().parse_args(["serve", *flags]))
