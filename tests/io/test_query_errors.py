"""`kvagent query` mistakes end in one line `kvagent: error: ...`: exit 2 for usage, 1 for run time (issue #19)."""

from __future__ import annotations

import socket
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
