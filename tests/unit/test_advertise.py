"""Advertised addresses: a reachable host instead of a wildcard, IPv6 in brackets, slot names percent-encoded.

tests/e2e/test_serve_addresses.py checks the same through a real ``kvagent serve``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from kvagent.agent import advertising
from kvagent.agent.advertising import (
    advertised_host,
    advertised_zmq_endpoint,
    http_url,
    recovery_base_url,
    slot_recovery_url,
    url_host,
)


@pytest.fixture
def machine_name(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This machine's name as the advertiser looks it up (a fixed fake; the lookup cache reset around it)."""
    advertising._machine_hostname.cache_clear()
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "node-7.cluster.example")
    yield "node-7.cluster.example"
    advertising._machine_hostname.cache_clear()


def test_ipv6_hosts_are_bracketed_in_urls() -> None:
    assert url_host("::1") == "[::1]"
    assert url_host("[::1]") == "[::1]"
    assert url_host("fd00::5") == "[fd00::5]"
    assert url_host("127.0.0.1") == "127.0.0.1"
    assert url_host("node-3.example") == "node-3.example"
    assert recovery_base_url("::1", 8765) == "ws://[::1]:8765"
    assert http_url("::1", 9100) == "http://[::1]:9100"
    assert recovery_base_url("127.0.0.1", 8765) == "ws://127.0.0.1:8765"


def test_advertise_wins_over_any_bind_host(machine_name: str) -> None:
    assert advertised_host("0.0.0.0", "node-3.example") == "node-3.example"
    assert advertised_host("127.0.0.1", "10.0.0.7") == "10.0.0.7"
    assert advertised_host("::", "fd00::5") == "[fd00::5]"
    assert recovery_base_url("0.0.0.0", 1, "[fd00::5]") == "ws://[fd00::5]:1"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]", "*", ""])
def test_a_wildcard_bind_advertises_the_machine_name_and_says_so_once(
    machine_name: str, wildcard: str
) -> None:
    with structlog.testing.capture_logs() as logs:
        assert advertised_host(wildcard) == machine_name
        assert recovery_base_url(wildcard, 8765) == f"ws://{machine_name}:8765"
        assert advertised_zmq_endpoint("tcp://*:5600") == f"tcp://{machine_name}:5600"
    assert [(entry["event"], entry["log_level"], entry["host"]) for entry in logs] == [
        ("advertising_machine_hostname", "info", machine_name)
    ]
    assert "--advertise" in logs[0]["hint"]


def test_zmq_endpoints_get_the_advertised_host() -> None:
    assert advertised_zmq_endpoint("tcp://127.0.0.1:5600") == "tcp://127.0.0.1:5600"
    assert advertised_zmq_endpoint("tcp://0.0.0.0:5600", "node-3") == "tcp://node-3:5600"
    assert advertised_zmq_endpoint("tcp://[::]:5600", "fd00::5") == "tcp://[fd00::5]:5600"
    assert advertised_zmq_endpoint("tcp://[::1]:5600") == "tcp://[::1]:5600"
    assert advertised_zmq_endpoint("ipc:///tmp/kv", "node-3") == "ipc:///tmp/kv"


def test_slot_names_are_one_percent_encoded_path_segment() -> None:
    assert slot_recovery_url("ws://h:1", "gpu 0") == "ws://h:1/v1/slots/gpu%200"
    assert slot_recovery_url("ws://h:1", "ü") == "ws://h:1/v1/slots/%C3%BC"
    assert slot_recovery_url("ws://h:1", "a%2Fb?#") == "ws://h:1/v1/slots/a%252Fb%3F%23"
    assert slot_recovery_url("ws://h:1", "gpu0") == "ws://h:1/v1/slots/gpu0"


@given(st.text(st.characters(codec="utf-8"), min_size=1, max_size=30))
def test_any_slot_name_survives_the_url(name: str) -> None:
    url = slot_recovery_url("ws://[::1]:8765", name)
    assert url.isascii() and " " not in url
    parts = urlsplit(url)
    assert (parts.hostname, parts.port, parts.query, parts.fragment) == ("::1", 8765, "", "")
    prefix, _, segment = parts.path.rpartition("/")
    assert prefix == "/v1/slots" and unquote(segment) == name
