"""A raw websocket peer for the serving tests: it completes the upgrade and then does exactly what a test
says (send a request and never read, read later, never answer pings), which a real client library won't."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
from typing import Any

import trio

OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x1, 0x2, 0x8, 0x9, 0xA


def masked_frame(opcode: int, payload: bytes) -> bytes:
    """A client-to-server frame (clients must mask)."""
    length = len(payload)
    if length < 126:
        header = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
    elif length < 1 << 16:
        header = struct.pack("!BBH", 0x80 | opcode, 0xFE, length)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 0xFF, length)
    key = os.urandom(4)
    return header + key + bytes(byte ^ key[i % 4] for i, byte in enumerate(payload))


def parse_frames(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """(opcode, payload) of every whole server frame in ``data``, and the incomplete rest."""
    frames: list[tuple[int, bytes]] = []
    position = 0
    while len(data) - position >= 2:
        first, second = data[position], data[position + 1]
        length, header = second & 0x7F, 2
        if length == 126:
            if len(data) - position < 4:
                break
            (length,) = struct.unpack_from("!H", data, position + 2)
            header = 4
        elif length == 127:
            if len(data) - position < 10:
                break
            (length,) = struct.unpack_from("!Q", data, position + 2)
            header = 10
        if len(data) - position < header + length:
            break
        frames.append((first & 0x0F, data[position + header : position + header + length]))
        position += header + length
    return frames, data[position:]


class RawPeer:
    """One TCP connection speaking as little websocket as a test needs."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    @classmethod
    async def connect(cls, url: str, path: str, *, receive_buffer: int | None = None) -> RawPeer:
        """Upgrade to ``path``; ``receive_buffer`` shrinks SO_RCVBUF first (a peer that stalls sooner)."""
        host, port = url.removeprefix("ws://").rsplit(":", 1)
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect((host, int(port)))
        peer = cls(trio.SocketStream(sock))
        await peer.stream.send_all(upgrade_request(host, int(port), path))
        while b"\r\n\r\n" not in peer.buffer:
            chunk = await peer.stream.receive_some(4096)
            if not chunk:
                raise ConnectionError("closed during the handshake")
            peer.buffer += chunk
        head, peer.buffer = peer.buffer.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(head.decode(errors="replace"))
        return peer

    async def send_json(self, value: Any) -> None:
        await self.stream.send_all(masked_frame(OP_TEXT, json.dumps(value).encode()))

    async def read_until_closed(self) -> list[tuple[int, bytes]]:
        """Every frame up to the end of the connection (the server's close frame included)."""
        data = self.buffer
        while True:
            try:
                chunk = await self.stream.receive_some(1 << 16)
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                frames, _ = parse_frames(data)
                return frames
            data += chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


def upgrade_request(host: str, port: int, path: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def close_code(frames: list[tuple[int, bytes]]) -> tuple[int, str] | None:
    """The code and reason of the close frame among ``frames``, if there is one."""
    for opcode, payload in frames:
        if opcode == OP_CLOSE and len(payload) >= 2:
            return struct.unpack("!H", payload[:2])[0], payload[2:].decode()
    return None
