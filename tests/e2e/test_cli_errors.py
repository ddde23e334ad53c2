"""Every mistake a user can make with `kvagent serve` ends in one line (issue #19), through the real CLI.

Each case runs `python -m kvagent.cli.main serve ...` as a subprocess and asserts: exactly one stderr line,
starting `kvagent: error: `, naming the option (and the address or path), no traceback, and the exit status
(2 for a usage mistake, 1 for what fails at run time). The runs use `--log-level warning` so that the
INFO records a start writes before it fails (`recovery_server_listening`, ...) stay out of the count;
`test_at_the_default_level_the_error_is_the_last_line` covers the default level. Then `--debug`, and the
console under `--log-format json`: every line JSON, the control token only in its 0600 file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

import kvagent.model.errors
from tests.support.etcd_server import EtcdEndpoint
from tests.support.ports import free_port, port_in_use
from tests.support.serve import LineLog

TIMEOUT = 60

# Runs the CLI with a file size limit of 0 bytes: every write fails with EFBIG, as on a full disk
# (SIGXFSZ ignored, so the write reports the error instead of killing the process).
_WITH_NO_FILE_SPACE = (
    "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)); "
    "from kvagent.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


def serve_command(
    tmp_path: Path, *args: str, launcher: tuple[str, ...] = ("-m", "kvagent.cli.main")
) -> list[str]:
    defaults = {
        "--listen": "127.0.0.1:0",
        "--discovery": f"file:{tmp_path / 'discovery'}",
        "--token-file": str(tmp_path / "token"),
        "--state-dir": str(tmp_path / "state"),
        "--log-level": "warning",
    }
    given = {arg for arg in args if arg.startswith("--")}
    options = [item for key, value in defaults.items() if key not in given for item in (key, value)]
    return [sys.executable, *launcher, "serve", *options, *args]


async def run_cli(command: list[str]) -> tuple[int, str]:
    with trio.fail_after(TIMEOUT):
        result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    return result.returncode, result.stderr.decode(errors="replace")


async def serve_fails(tmp_path: Path, *args: str) -> tuple[int, str]:
    """The exit status and the one error line of a `kvagent serve` that must fail."""
    status, stderr = await run_cli(serve_command(tmp_path, *args))
    return status, one_error_line(stderr)


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("kvagent: error: "), stderr
    return lines[0]


# -- addresses in use --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "scheme", "extra"),
    [
        ("--listen", "", ()),
        ("--http", "", ()),
        ("--publish", "tcp://", ()),
        ("--republish", "tcp://", ()),
        ("--republish-replay", "tcp://", ("--republish", "tcp://127.0.0.1:0")),
    ],
)
async def test_an_address_in_use_names_the_option_and_the_address(
    tmp_path: Path, option: str, scheme: str, extra: tuple[str, ...]
) -> None:
    with port_in_use() as address:
        status, line = await serve_fails(
            tmp_path, "--slot", "s", "--simulate", *extra, option, scheme + address
        )
    assert status == 1
    assert f"{option} {scheme}{address}" in line
    assert "already in use" in line and "choose another port" in line


async def test_an_address_not_of_this_machine_says_so(tmp_path: Path) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never assigned to a local interface.
    status, line = await serve_fails(tmp_path, "--slot", "s", "--simulate", "--listen", "192.0.2.1:8765")
    assert status == 1
    assert "--listen 192.0.2.1:8765" in line and "not an address of this machine" in line


async def test_two_options_on_one_address_are_a_usage_error_naming_both(tmp_path: Path) -> None:
    port = free_port()
    status, line = await serve_fails(
        tmp_path, "--slot", "s", "--simulate", "--listen", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{port}"
    )
    assert status == 2
    assert f"--http 127.0.0.1:{port} and --listen 127.0.0.1:{port} bind the same address" in line


# -- the configuration ---------------------------------------------------------------------------------


async def test_a_missing_config_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "kvagent.toml"
    status, line = await serve_fails(tmp_path, "--config", str(missing))
    assert status == 2
    assert str(missing) in line and "No such file" in line


async def test_an_unreadable_config_file_names_it(tmp_path: Path) -> None:
    status, line = await serve_fails(tmp_path, "--config", str(tmp_path))  # a directory: cannot be read
    assert status == 2
    assert str(tmp_path) in line and "cannot read config file" in line


async def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "kvagent.toml"
    config.write_text("listen = [\n")
    status, line = await serve_fails(tmp_path, "--config", str(config))
    assert status == 2
    assert f"{config}: invalid TOML" in line


async def test_several_config_problems_are_still_one_line_naming_each_key(tmp_path: Path) -> None:
    config = tmp_path / "kvagent.toml"
    config.write_text('listen = 3\nmax_connections = "many"\n[[slots]]\nname = "s"\nreplay_endpiont = "x"\n')
    status, line = await serve_fails(tmp_path, "--config", str(config))
    assert status == 2
    for key in ("listen", "max_connections", "replay_endpiont"):
        assert key in line


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--slot", ""], "--slot"),
        (["--slot", "s="], "--slot"),
        (["--slot", "bad/name"], "slots[0].name"),
        (["--slot", "s=not-an-endpoint"], "not-an-endpoint"),
        (["--slot", "s", "--block-size", "0"], "kv_block_size"),
        (["--slot", "s", "--block-size", "sixteen"], "--block-size"),
        (["--slot", "s", "--listen", "nonsense"], "listen"),
        (["--slot", "s", "--discovery", "zookeeper://x"], "zookeeper://x"),
        (["--slot", "s", "--log-level", "loud"], "--log-level"),
        (["--slot", "s", "--ingest-budget", "16MiB"], "ingest_budget: must be at least 32MiB"),
        (["--slot", "s", "--ingest-budget", "lots"], "--ingest-budget"),
        (["--slot", "s", "--no-such-flag"], "--no-such-flag"),
        ([], "--slot"),
    ],
)
async def test_a_usage_mistake_is_one_line_with_status_2(tmp_path: Path, argv: list[str], named: str) -> None:
    status, line = await serve_fails(tmp_path, *argv)
    assert status == 2
    assert named in line


# -- discovery -----------------------------------------------------------------------------------------


async def test_unreachable_etcd_names_the_discovery_url(tmp_path: Path) -> None:
    url = f"etcd://127.0.0.1:{free_port()}"
    status, line = await serve_fails(tmp_path, "--slot", "s", "--simulate", "--discovery", url)
    assert status == 1
    assert f"--discovery {url}" in line and "etcd" in line


def _without_root_overrides() -> tuple[str, ...]:
    """A prefix that runs a command without root's power to write anywhere (nothing when not root)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made to refuse writes")
    return (setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner")


async def test_a_read_only_discovery_directory_names_the_option_and_the_path(tmp_path: Path) -> None:
    prefix = _without_root_overrides()
    directory = tmp_path / "discovery"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        command = [*prefix, *serve_command(tmp_path, "--slot", "s", "--simulate", "--state-dir", "none")]
        status, stderr = await run_cli(command)
    finally:
        directory.chmod(0o755)
    line = one_error_line(stderr)
    assert status == 1
    assert f"--discovery file:{directory}" in line and str(directory) in line
    assert "Permission denied" in line


async def test_a_full_disk_under_file_discovery_names_the_option(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("a-token-written-before-the-disk-filled\n")
    (tmp_path / "token").chmod(0o600)
    command = serve_command(
        tmp_path, "--slot", "s", "--simulate", "--state-dir", "none", launcher=("-c", _WITH_NO_FILE_SPACE)
    )
    status, stderr = await run_cli(command)
    line = one_error_line(stderr)
    assert status == 1
    assert f"--discovery file:{tmp_path / 'discovery'}" in line and "File too large" in line


async def test_a_discovery_path_through_a_file_names_the_option(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a directory")
    url = f"file:{tmp_path / 'plain' / 'discovery'}"
    status, line = await serve_fails(tmp_path, "--slot", "s", "--simulate", "--discovery", url)
    assert status == 1
    assert f"--discovery {url}" in line and "not a directory" in line


needs_slot_ownership = pytest.mark.skipif(
    not hasattr(kvagent.model.errors, "SlotOwnershipError"),
    reason="slot ownership (SlotOwnershipError) is not in this tree yet",
)


async def second_serve_of_the_same_slot(tmp_path: Path, discovery: str) -> tuple[int, str]:
    """The exit status and stderr of a second `serve --slot gpu0` while a first one serves it."""
    common = ("--slot", "gpu0", "--simulate", "--state-dir", "none", "--discovery", discovery)
    async with running(serve_command(tmp_path, *common, "--log-level", "info")) as log:
        await log.wait_for(lambda line: "serving" in line)
        return await run_cli(serve_command(tmp_path, *common))


@needs_slot_ownership
async def test_a_second_serve_of_the_same_slot_under_file_discovery_is_one_line(tmp_path: Path) -> None:
    status, stderr = await second_serve_of_the_same_slot(tmp_path, f"file:{tmp_path / 'discovery'}")
    line = one_error_line(stderr)
    assert status == 1
    assert "gpu0" in line and "--slot" in line  # the slot, and what to do: stop the holder or choose another


@needs_slot_ownership
async def test_a_second_serve_of_the_same_slot_under_etcd_is_one_line(
    tmp_path: Path, etcd_endpoint: EtcdEndpoint
) -> None:
    status, stderr = await second_serve_of_the_same_slot(tmp_path, etcd_endpoint.discovery_url)
    line = one_error_line(stderr)
    assert status == 1
    assert "gpu0" in line and "--slot" in line


# -- state and token -----------------------------------------------------------------------------------


async def test_an_unusable_state_dir_names_the_option(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a directory")
    state = tmp_path / "plain" / "state"
    status, line = await serve_fails(tmp_path, "--slot", "s", "--simulate", "--state-dir", str(state))
    assert status == 1
    assert f"--state-dir {state}" in line and "'none' keeps it in memory" in line


async def test_an_empty_token_file_says_what_to_do(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("\n")
    status, line = await serve_fails(tmp_path, "--slot", "s", "--simulate", "--token-file", str(token))
    assert status == 2
    assert f"--token-file {token} is empty" in line and "delete it" in line


async def test_a_token_file_that_cannot_be_created_names_the_option(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a directory")
    token = tmp_path / "plain" / "token"
    status, line = await serve_fails(tmp_path, "--slot", "s", "--simulate", "--token-file", str(token))
    assert status == 1
    assert f"--token-file {token}" in line


# -- the default level, --debug, and json -----------------------------------------------------------------


async def test_at_the_default_level_the_error_is_the_last_line(tmp_path: Path) -> None:
    with port_in_use() as address:
        status, stderr = await run_cli(
            serve_command(tmp_path, "--slot", "s", "--simulate", "--log-level", "info", "--http", address)
        )
    assert status == 1 and "Traceback" not in stderr
    lines = stderr.splitlines()
    assert [line for line in lines if line.startswith("kvagent: error: ")] == [lines[-1]]
    assert f"--http {address}" in lines[-1]


async def test_debug_shows_the_traceback_instead(tmp_path: Path) -> None:
    with port_in_use() as address:
        status, stderr = await run_cli(serve_command(tmp_path, "--slot", "s", "--debug", "--listen", address))
    assert status == 1
    assert "Traceback" in stderr and "--listen" in stderr
    assert not any(line.startswith("kvagent: error: ") for line in stderr.splitlines())


async def test_the_global_debug_flag_works_for_usage_errors_from_the_config_too(tmp_path: Path) -> None:
    status, stderr = await run_cli(
        [sys.executable, "-m", "kvagent.cli.main", "--debug", "serve", "--slot", "s", "--block-size", "0"]
    )
    assert status == 1  # an uncaught exception: Python's own status
    assert "Traceback" in stderr and "ConfigError" in stderr


async def test_with_json_logs_the_error_is_one_json_line(tmp_path: Path) -> None:
    with port_in_use() as address:
        status, stderr = await run_cli(
            serve_command(tmp_path, "--slot", "s", "--simulate", "--log-format", "json", "--listen", address)
        )
    assert status == 1
    [line] = stderr.splitlines()
    record = json.loads(line)
    assert record["event"] == "error" and record["level"] == "error"
    assert record["message"].startswith(f"--listen {address}")


async def test_with_json_logs_a_config_error_is_one_json_line_too(tmp_path: Path) -> None:
    status, stderr = await run_cli(
        serve_command(tmp_path, "--slot", "s", "--log-format", "json", "--block-size", "0")
    )
    assert status == 2
    [line] = stderr.splitlines()
    record = json.loads(line)
    assert record["event"] == "error" and "kv_block_size" in record["message"]


@asynccontextmanager
async def running(command: list[str]) -> AsyncIterator[LineLog]:
    """A `kvagent serve` process whose stderr lines arrive in a LineLog; killed at the end if still up."""
    log = LineLog()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, env=env)
        assert process.stderr is not None

        async def read() -> None:
            buffer = b""
            assert process.stderr is not None
            async for chunk in process.stderr:
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    log.append(line.decode(errors="replace"))

        nursery.start_soon(read)
        try:
            with trio.fail_after(TIMEOUT):
                yield log
                process.send_signal(signal.SIGINT)
                assert await process.wait() == 0, "\n".join(log.lines)
        finally:
            if process.poll() is None:
                process.kill()
            with trio.move_on_after(10, shield=True):
                await process.wait()
            nursery.cancel_scope.cancel()


def _status_lines(log: LineLog) -> int:
    return sum('"slot_status"' in line for line in log.lines)


async def test_json_logs_make_every_stderr_line_json_and_never_show_the_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    command = serve_command(
        tmp_path,
        "--slot",
        "s",
        "--simulate",
        "--log-format",
        "json",
        "--log-level",
        "info",
        "--status-interval",
        "0.2",
        "--http",
        "127.0.0.1:0",
        "--republish",
        "tcp://127.0.0.1:0",
    )
    async with running(command) as log:
        await log.wait_for(lambda line: '"event": "serving"' in line)
        await log.wait_for(lambda _: _status_lines(log) >= 2)
    records = [json.loads(line) for line in log.lines]  # each line parses, or this fails
    assert all(isinstance(record, dict) and "event" in record and "level" in record for record in records)
    events = {record["event"] for record in records}
    assert {"control_token", "serving", "slot_status", "republishing", "stopped"} <= events
    token = token_file.read_text().strip()
    assert token and not any(token in line for line in log.lines)
    [announced] = [record for record in records if record["event"] == "control_token"]
    assert announced["path"] == str(token_file) and announced["created"] is True
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    [serving] = [record for record in records if record["event"] == "serving"]
    assert serving["url"].startswith("ws://127.0.0.1:") and serving["slots"] == ["s"]


async def test_the_token_defaults_to_a_0600_file_in_the_state_root_and_only_its_path_is_printed(
    tmp_path: Path,
) -> None:
    root = Path(os.environ["KVAGENT_STATE_DIR"])  # per test (tests/conftest.py); the child inherits it
    command = [
        sys.executable,
        "-m",
        "kvagent.cli.main",
        "serve",
        "--slot",
        "s",
        "--simulate",
        "--listen",
        "127.0.0.1:0",
    ]
    async with running(command) as log:
        first = await log.wait_for(lambda line: "control token" in line)
        await log.wait_for(lambda line: "serving" in line)
    token_file = root / "token"
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert f"created in {token_file}" in first
    assert token and not any(token in line for line in log.lines)
    async with running(command) as again:  # a restart keeps the token: clients need not be told anew
        line = await again.wait_for(lambda line: "control token" in line)
        await again.wait_for(lambda line: "serving" in line)
    assert f"read from {token_file}" in line
    assert token_file.read_text().strip() == token
