"""The pieces behind one-line CLI errors: finding the cause in a group, describing it, blaming an option."""

from __future__ import annotations

import errno
import json
import stat
from pathlib import Path

import pytest
import structlog
import zmq
from hypothesis import given
from hypothesis import strategies as st
from trio_websocket import CloseReason, ConnectionClosed, ConnectionRejected, HandshakeError

from kvagent.cli.bind_check import check_distinct_addresses
from kvagent.cli.config import ServeConfig, structure_serve_config
from kvagent.cli.control_token import load_or_create_token
from kvagent.cli.errors import (
    EXIT_RUNTIME,
    EXIT_USAGE,
    CliError,
    OneLineArgumentParser,
    agent_connection_problem,
    blaming,
    describe,
    explain,
    find_cause,
    one_line,
)
from kvagent.cli.logs import Console
from kvagent.model.errors import ConfigError, DiscoveryError, KvAgentError


def in_use() -> OSError:
    return OSError(errno.EADDRINUSE, "Address already in use")


def test_the_cause_in_nested_groups_prefers_an_explained_error_then_kvagent_then_os() -> None:
    explained = CliError("--listen x: taken")
    kvagent_error = KvAgentError("slot s is owned by host h")
    os_error = in_use()
    group = ExceptionGroup("outer", [ValueError("noise"), ExceptionGroup("inner", [os_error, kvagent_error])])
    assert find_cause(group) is kvagent_error
    assert find_cause(ExceptionGroup("g", [group, ExceptionGroup("h", [explained])])) is explained
    assert find_cause(ExceptionGroup("g", [ValueError("a"), os_error])) is os_error
    assert find_cause(ExceptionGroup("g", [ValueError("a")])) is None
    assert find_cause(os_error) is os_error


def test_a_chain_is_described_once_per_message_with_the_system_text_and_advice() -> None:
    denied = PermissionError(errno.EACCES, "Permission denied", "/srv/discovery/x.json")
    try:
        try:
            try:
                raise denied
            except OSError as exc:
                raise DiscoveryError(f"could not register record 7 in /srv/discovery: {exc}") from exc
        except DiscoveryError as exc:
            raise KvAgentError("failed to advertise") from exc
    except KvAgentError as exc:
        text = describe(exc)
    assert text.startswith("failed to advertise: could not register record 7 in /srv/discovery: ")
    assert text.count("Permission denied") == 1  # the system text is in the middle message already
    assert text.endswith("make it writable for this user or choose another path")


def test_a_bind_error_is_described_with_what_to_do() -> None:
    assert describe(in_use()) == (
        "Address already in use; another process listens there: stop it or choose another port"
    )
    zmq_error = zmq.ZMQError(errno.EADDRINUSE)
    assert "choose another port" in describe(zmq_error)
    assert describe(PermissionError(errno.EACCES, "Permission denied")).endswith(
        "ports below 1024 need privileges"
    )


def test_blaming_names_the_option_value_and_purpose_and_keeps_the_cause() -> None:
    original = in_use()
    with pytest.raises(CliError) as raised, blaming("--http", "0.0.0.0:9464", what="metrics"):
        raise ExceptionGroup("nursery", [original])
    assert raised.value.message.startswith("--http 0.0.0.0:9464 (metrics): Address already in use")
    assert raised.value.exit_status == EXIT_RUNTIME
    assert find_cause(raised.value.__cause__ or raised.value) is original


def test_blaming_passes_other_errors_and_explained_ones_unchanged() -> None:
    with pytest.raises(ValueError, match="a bug"), blaming("--listen", "x"):
        raise ValueError("a bug")
    explained = CliError("--token-file t is empty", exit_status=EXIT_USAGE)
    with pytest.raises(CliError) as raised, blaming("--token-file", "t"):
        raise explained
    assert raised.value is explained


def test_explain_gives_usage_status_to_config_errors_and_run_time_status_to_the_rest() -> None:
    assert explain(ConfigError("listen: expected HOST:PORT")) == ("listen: expected HOST:PORT", EXIT_USAGE)
    assert explain(ExceptionGroup("g", [in_use()]))[1] == EXIT_RUNTIME
    message, status = explain(RuntimeError("boom"))
    assert status == EXIT_RUNTIME and "unexpected RuntimeError: boom" in message and "--debug" in message


def test_a_failed_agent_connection_is_one_line_for_query_and_top() -> None:
    url = "ws://127.0.0.1:1"
    rejected = ConnectionRejected(503, (), b"too many connections\n")
    assert (
        agent_connection_problem(url, rejected)
        == f"{url} refused the connection: HTTP 503 too many connections"
    )
    assert (
        agent_connection_problem(url, ConnectionRejected(403, (), None))
        == f"{url} refused the connection: HTTP 403"
    )
    closed = ConnectionClosed(CloseReason(1001, "going away"))
    assert (
        agent_connection_problem(url, closed)
        == f"the agent at {url} closed the connection (close code 1001 going away)"
    )
    assert (
        agent_connection_problem(url, ConnectionClosed(None)) == f"the agent at {url} closed the connection"
    )
    try:
        raise HandshakeError() from ConnectionRefusedError(111, "Connection refused")
    except HandshakeError as unreachable:
        problem = agent_connection_problem(url, unreachable)
    assert problem == f"cannot reach an agent at {url}: [Errno 111] Connection refused"


def test_a_listing_becomes_one_line() -> None:
    listing = "kvagent.toml: invalid configuration (2 problems):\n  listen: bad\n  slots[0].name: bad"
    assert (
        one_line(listing)
        == "kvagent.toml: invalid configuration (2 problems): listen: bad; slots[0].name: bad"
    )


@given(st.text())
def test_one_line_never_breaks_a_line(text: str) -> None:
    assert len(one_line(text).splitlines()) <= 1


def test_a_usage_mistake_in_argparse_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineArgumentParser(prog="kvagent serve")
    parser.add_argument("--block-size", type=int)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--block-size", "x"])
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("kvagent: error: argument --block-size: invalid int value: 'x'")
    assert "kvagent serve --help" in err


def test_console_lines_are_text_or_json_objects(capsys: pytest.CaptureFixture[str]) -> None:
    Console("text").line("serving", "kvagent: serving 1 slot(s)", url="ws://h:1/v1/slots")
    Console("text").error("--listen x: taken")
    assert capsys.readouterr().err.splitlines() == [
        "kvagent: serving 1 slot(s)",
        "kvagent: error: --listen x: taken",
    ]
    Console("json").line("serving", "kvagent: serving 1 slot(s)", url="ws://h:1/v1/slots")
    Console("json").line("http_listening", "kvagent: HTTP surface on ...", logged=True)  # the log says it
    Console("json").error("--listen x: taken")
    serving, error = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert (
        serving["event"] == "serving" and serving["url"] == "ws://h:1/v1/slots" and serving["level"] == "info"
    )
    assert error == {**error, "event": "error", "level": "error", "message": "--listen x: taken"}
    assert serving["timestamp"].endswith("Z")


def test_a_token_file_is_created_0600_then_read_and_a_readable_one_is_warned_about(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "token"
    token, created = load_or_create_token(path)
    assert created and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_token(path) == (token, False)
    path.chmod(0o644)
    with structlog.testing.capture_logs() as logs:
        assert load_or_create_token(path) == (token, False)
    assert [entry["event"] for entry in logs] == ["token_file_readable_by_others"]
    assert token not in repr(logs)


def serve_config(**data: object) -> ServeConfig:
    return structure_serve_config({"slots": [{"name": "a"}], **data})


@pytest.mark.parametrize(
    "data",
    [
        {"listen": "127.0.0.1:8765", "http": "127.0.0.2:8765"},  # another host, same port
        {"listen": "127.0.0.1:0", "http": "127.0.0.1:0", "publish": "tcp://127.0.0.1:0"},  # ephemeral ports
        {"listen": "127.0.0.1:8765", "publish": "ipc:///tmp/kvagent-plane"},
    ],
)
def test_distinct_addresses_pass(data: dict[str, object]) -> None:
    check_distinct_addresses(serve_config(**data))


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"listen": "127.0.0.1:8765", "http": "127.0.0.1:8765"}, ("--http 127.0.0.1:8765", "--listen")),
        (
            {"listen": "0.0.0.0:8765", "publish": "tcp://127.0.0.1:8765"},
            ("--publish", "--listen 0.0.0.0:8765"),
        ),
        (
            {
                "http": "127.0.0.1:5601",
                "slots": [{"name": "a", "dp_rank": 1, "republish": {"endpoint": "tcp://127.0.0.1:5600"}}],
            },
            ("--republish tcp://127.0.0.1:5600 (slot a binds tcp://127.0.0.1:5601)", "--http 127.0.0.1:5601"),
        ),
    ],
)
def test_two_options_binding_one_address_are_a_usage_error_naming_both(
    data: dict[str, object], named: tuple[str, str]
) -> None:
    with pytest.raises(CliError) as raised:
        check_distinct_addresses(serve_config(**data))
    assert raised.value.exit_status == EXIT_USAGE
    assert all(option in raised.value.message for option in named)
    assert "give each its own port" in raised.value.message


def test_blaming_turns_a_refused_value_into_a_usage_error() -> None:
    with (
        pytest.raises(CliError) as raised,
        blaming("--discovery", "etcd://h:2379", usage=(ValueError,)),
    ):
        raise ExceptionGroup("open", [ValueError("ca_file/cert_file/key_file need an etcds:// URL")])
    assert raised.value.exit_status == EXIT_USAGE
    assert (
        raised.value.message == "--discovery etcd://h:2379: ca_file/cert_file/key_file need an etcds:// URL"
    )
