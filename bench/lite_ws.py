"""A minimal websocket client for load generation: the same bytes on the wire, a fraction of the CPU.

The reference client (trio-websocket + wsproto) parses every frame in Python; at 256 clients paced at
5 requests/s it needs more than a core of its own, which the 2-core bench machine does not have beside
the server.  This client speaks just enough RFC 6455 for the recovery protocol: the upgrade, masked
binary frames out, unmasked frames in (fragments joined), pong for ping, the close handshake.
"""

from __future__ import annotations

import base64
import contextlib
import os
import struct

import trio

RECEIVE_BYTES = 256 << 10


class Rejected(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"handshake refused with HTTP {status}")
        self.status = status


class Closed(Exception):
    def __init__(self, code: int | None) -> None:
        super().__init__(f"closed with {code}")
        self.code = code


def _masked(opcode: int, payload: bytes) -> bytes:
    length = len(payload)
    if length < 126:
        header = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
    elif length < 1 << 16:
        header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
    key = os.urandom(4)
    if not payload:
        return header + key
    stream = (key * (length // 4 + 1))[:length]
    masked = (int.from_bytes(payload, "little") ^ int.from_bytes(stream, "little")).to_bytes(length, "little")
    return header + key + masked


class LiteWebSocket:
    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    @classmethod
    async def connect(
        cls, host: str, port: int, path: str, *, receive_buffer: int | None = None
    ) -> LiteWebSocket:
        """Upgrade to ``path``; ``receive_buffer`` fixes SO_RCVBUF first (a stalled peer fills sooner)."""
        if receive_buffer is None:
            stream = await trio.open_tcp_stream(host, port)
        else:
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, receive_buffer)
            await sock.connect((host, port))
            stream = trio.SocketStream(sock)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        await stream.send_all(request.encode())
        ws = cls(stream)
        head = await ws._read_until(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 101:
            await stream.aclose()
            raise Rejected(status)
        return ws

    async def _fill(self) -> None:
        data = await self._stream.receive_some(RECEIVE_BYTES)
        if not data:
            raise Closed(None)
        self._buffer += data

    async def _read_until(self, marker: bytes) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            await self._fill()
        head = bytes(self._buffer[: end + len(marker)])
        del self._buffer[: end + len(marker)]
        return head

    async def _read_exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            await self._fill()
        data = bytes(self._buffer[:count])
        del self._buffer[:count]
        return data

    async def send(self, payload: bytes) -> None:
        await self._stream.send_all(_masked(0x2, payload))

    async def receive(self) -> bytes:
        """The next data message (fragments joined); answers pings; Closed on a close frame."""
        parts: list[bytes] = []
        while True:
            first, second = await self._read_exactly(2)
            length = second & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", await self._read_exactly(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", await self._read_exactly(8))
            payload = await self._read_exactly(length)
            opcode = first & 0x0F
            if opcode == 0x9:  # ping
                await self._stream.send_all(_masked(0xA, payload))
            elif opcode == 0x8:  # close: answer it and report the code
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._stream.send_all(_masked(0x8, payload[:2]))
                raise Closed(code)
            elif opcode in (0x0, 0x1, 0x2):
                parts.append(payload)
                if first & 0x80:
                    return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._stream.send_all(_masked(0x8, struct.pack("!H", 1000)))
        await self._stream.aclose()
