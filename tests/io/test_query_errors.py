"""`kvagent query` mistakes end in one line `kvagent: error: ...`: exit 2 for usage, 1 for run time (issue #19)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio

from kvagent.cli.main import main
from kvagent.model.events import RouterEvent
from tests.support.recovery import FakeSlot, start_server


async def query(*args: str) -> int:
    """``kvagent query ...`` as the command line runs it (its own trio.run, so in a thread)."""
    return await trio.to_thread.run_sync(partial(main, ["query", *args]))


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("kvagent: error: ")
    return err


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_an_unknown_slot_names_the_slot_and_how_to_list_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with trio.open_nursery() as nursery:
        url = await start_server(nursery, FakeSlot("a"))
        assert await query("--url", url, "nope", "status") == 1
        err = one_error_line(capsys)
        assert "'nope'" in err and "kvagent query - list" in err
        nursery.cancel_scope.cancel()


async def test_nothing_listening_names_the_url(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"ws://127.0.0.1:{closed_port()}"
    assert await query("--url", url, "a", "status") == 1
    assert url in one_error_line(capsys)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8765", "127.0.0.1:8765"])
async def test_a_url_that_is_not_websocket_is_a_usage_error(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await query("--url", url, "a", "status") == 2
    assert "--url must be ws://" in one_error_line(capsys)


async def test_a_missing_token_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "token"
    assert await query("--token-file", str(missing), "a", "status") == 2
    err = one_error_line(capsys)
    assert "--token-file" in err and str(missing) in err


async def test_detach_without_a_generation_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    async with trio.open_nursery() as nursery:
        url = await start_server(nursery, FakeSlot("a"))
        assert await query("--url", url, "a", "detach") == 2
        assert "--generation is required" in one_error_line(capsys)
        nursery.cancel_scope.cancel()


async def test_the_agent_stopping_during_follow_is_one_line_naming_the_close(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    slot = FakeSlot("a")
    following = trio.Event()
    subscribe = slot.index.subscribe

    def subscribe_and_tell(callback: Callable[[RouterEvent], None]) -> Callable[[], None]:
        unsubscribe = subscribe(callback)
        following.set()  # the server's session (in this Trio run) now streams live events to the query
        return unsubscribe

    monkeypatch.setattr(slot.index, "subscribe", subscribe_and_tell)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server_scope = trio.CancelScope()
            url_box: list[str] = []
            started = trio.Event()

            async def server() -> None:
                with server_scope:
                    async with trio.open_nursery() as inner:
                        url_box.append(await start_server(inner, slot))
                        started.set()
                        await trio.sleep_forever()

            nursery.start_soon(server)
            await started.wait()
            result: list[int] = []
            done = trio.Event()

            async def follow() -> None:
                result.append(await query("--url", url_box[0], "a", "follow"))
                done.set()

            nursery.start_soon(follow)
            await following.wait()
            server_scope.cancel()  # a clean server stop: every client gets 1001 "going away"
            await done.wait()
    assert result == [1]
    err = one_error_line(capsys)
    assert "closed the connection (close code 1001 going away)" in err


async def test_a_reader_that_stops_early_ends_the_query_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvagent query SLOT follow | head -1`: exit 0 and nothing on stderr once the pipe closes."""
    slot = FakeSlot("a")
    for block in range(
        1, 3001
    ):  # a dump far larger than a pipe's buffer, so writing must hit the closed pipe
        slot.store_worker(block, block - 1 if block > 1 else None)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, slot)
            command = [sys.executable, "-m", "kvagent.cli.main", "query", "--url", url, "a", "follow"]
            process = await trio.lowlevel.open_process(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            assert process.stdout is not None and process.stderr is not None
            first = await process.stdout.receive_some(1024)
            assert first.startswith(b'{"kind":"tree_dump"')
            await process.stdout.aclose()  # the reader (`head -1`) is gone
            assert await process.wait() == 0
            assert await process.stderr.receive_some(65536) == b""
            nursery.cancel_scope.cancel()
