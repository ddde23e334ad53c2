"""``kvagent serve --stream`` and ``[stream]``: merged, validated, and given to every slot (docs/fleet.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvagent.cli.config import ServeConfig, load_config_file
from kvagent.cli.main import build_parser, serve_config_from_args
from kvagent.cli.serve import slot_agent_config
from kvagent.cli.stream_settings import stream_config
from kvagent.model.errors import ConfigError


def _serve(*argv: str) -> ServeConfig:
    return serve_config_from_args(build_parser().parse_args(["serve", "--slot", "a", "--simulate", *argv]))


def test_command_line_stream_reaches_every_slot(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    config = _serve("--stream", "redis://127.0.0.1:6379/2", "--stream-password-file", str(secret))
    assert config.stream is not None and config.stream.url == "redis://127.0.0.1:6379/2"
    slot = slot_agent_config(config.slots[0], config, recovery_url="ws://x")
    assert slot.stream is not None
    assert slot.stream.target.password == "s3cret" and "s3cret" not in repr(slot.stream)
    assert slot.stream.prefix == "kvagent" and slot.stream.maxlen == 10_000


def test_no_stream_by_default() -> None:
    config = _serve()
    assert config.stream is None
    assert slot_agent_config(config.slots[0], config, recovery_url="ws://x").stream is None


def test_toml_table_and_command_line_override(tmp_path: Path) -> None:
    path = tmp_path / "kvagent.toml"
    path.write_text(
        '[[slots]]\nname = "a"\nkv_block_size = 16\nsimulate = true\n'
        '[stream]\nurl = "rediss://cache:6380/1"\nprefix = "fleet"\nmaxlen = 500\n'
    )
    config = load_config_file(path)
    assert config.stream is not None and (config.stream.prefix, config.stream.maxlen) == ("fleet", 500)
    merged = serve_config_from_args(
        build_parser().parse_args(["serve", "--config", str(path), "--stream-prefix", "other"])
    )
    assert merged.stream is not None
    assert (merged.stream.url, merged.stream.prefix, merged.stream.maxlen) == (
        "rediss://cache:6380/1",
        "other",
        500,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stream", "redis://:pw@h:1/0"], "password"),
        (["--stream", "http://h:1"], "redis://"),
        (["--stream", "redis://h:1/x"], "database"),
        (["--stream", "redis://h:1", "--stream-prefix", "a{b}"], "prefix"),
    ],
)
def test_bad_stream_options_name_the_key(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _serve(*argv)


def test_missing_password_file_is_a_config_error(tmp_path: Path) -> None:
    config = _serve("--stream", "redis://h:1", "--stream-password-file", str(tmp_path / "absent"))
    assert config.stream is not None
    with pytest.raises(ConfigError, match="password_file"):
        stream_config(config.stream)
