"""The websocket connection core without sockets or Trio: limits in bytes, extensions, the close machine.

A wsproto client connection plays the peer: its bytes go into :meth:`WebSocketCore.receive_data`, and the
core's outgoing frames go back into the client, so every check is on what a real peer would see.  Time is
a plain number passed in.
"""

from __future__ import annotations

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

from kvagent.recovery.wscore import (
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TRY_AGAIN_LATER,
    FRAGMENT_BYTES,
    MESSAGE_OVERHEAD,
    ConnectionClosed,
    MessageTooBig,
    QueueFull,
    SendLimits,
    WebSocketCore,
    accept_response,
    utf8_length,
)

LIMITS = SendLimits(queue_bytes=1 << 20, send_deadline=10.0, close_grace=2.0)


def upgraded(*, offer_deflate: bool = False) -> tuple[WSConnection, WSConnection, bytes]:
    """(server, client, the server's 101 response) after a completed upgrade."""
    server, client = WSConnection(ConnectionType.SERVER), WSConnection(ConnectionType.CLIENT)
    extensions = [PerMessageDeflate()] if offer_deflate else []
    server.receive_data(client.send(Request(host="localhost", target="/v1/slots/a", extensions=extensions)))
    assert any(isinstance(event, Request) for event in server.events())
    response = accept_response(server)
    client.receive_data(response)
    assert any(isinstance(event, AcceptConnection) for event in client.events())
    return server, client, response


def make_core(max_message_size: int = 1000, **kwargs: int) -> tuple[WebSocketCore, WSConnection]:
    server, client, _ = upgraded()
    return WebSocketCore(server, max_message_size=max_message_size, limits=LIMITS, **kwargs), client


def drain(core: WebSocketCore, client: WSConnection, now: float = 0.0) -> list[Event]:
    """Write everything the core has to the client (a peer that reads at once); the client's events."""
    while (buffers := core.outgoing(now)) is not None:
        data = b"".join(bytes(buffer) for buffer in buffers)
        core.sent(len(data), now)
        client.receive_data(data)
    return list(client.events())


def test_an_offered_permessage_deflate_is_declined() -> None:
    server, client, response = upgraded(offer_deflate=True)
    head = response.lower()
    assert b" 101 " in head.split(b"\r\n", 1)[0]
    assert b"sec-websocket-extensions" not in head
    # Nothing was negotiated, so a frame with RSV1 set (a compressed message) is a protocol error.
    core = WebSocketCore(server, max_message_size=1000, limits=LIMITS)
    rsv1_text = bytes([0xC1, 0x80 | 2]) + b"\0\0\0\0" + b"hi"
    core.receive_data(rsv1_text, 0.0)
    assert core.close_received and core.close_reason is not None
    assert core.close_reason.code == CLOSE_PROTOCOL_ERROR
    assert core.next_message() is None


def test_the_message_limit_counts_utf8_bytes_not_characters() -> None:
    core, client = make_core(max_message_size=10)
    assert utf8_length("éééééé") == 12
    core.receive_data(client.send(TextMessage(data="éééééé")), 0.0)  # 6 characters, 12 bytes
    too_big = core.next_message()
    assert isinstance(too_big, MessageTooBig) and not too_big.binary
    core.receive_data(client.send(TextMessage(data="ééééé")), 0.0)  # 10 bytes: at the limit
    assert core.next_message() == "ééééé"
    core.receive_data(client.send(BytesMessage(data=b"x" * 11)), 0.0)
    too_big = core.next_message()
    assert isinstance(too_big, MessageTooBig) and too_big.binary
    assert core.inbound_bytes == 0


def test_an_oversized_message_is_dropped_as_it_arrives_and_the_connection_stays_usable() -> None:
    core, client = make_core(max_message_size=100)
    for part in range(50):  # 50 fragments of 100 bytes: never more than the limit is held
        core.receive_data(client.send(BytesMessage(data=b"y" * 100, message_finished=part == 49)), 0.0)
        assert core.inbound_bytes <= 100
    assert isinstance(core.next_message(), MessageTooBig)
    core.receive_data(client.send(BytesMessage(data=b"ok")), 0.0)
    assert core.next_message() == b"ok"


def test_reading_stops_at_the_inbound_byte_bound_and_resumes_when_the_session_takes_a_request() -> None:
    core, client = make_core(max_message_size=1000, inbound_bytes_limit=3000)
    sent = 0
    while core.wants_data:
        core.receive_data(client.send(BytesMessage(data=bytes(900))), 0.0)
        sent += 1
    assert sent == 4  # 4 * (900 + overhead) passes 3000; the fourth was already read
    assert core.inbound_bytes == 4 * (900 + MESSAGE_OVERHEAD)
    assert core.next_message() == bytes(900)
    assert core.inbound_bytes == 3 * (900 + MESSAGE_OVERHEAD)  # below the bound again: reading resumes
    assert core.wants_data


def test_with_no_request_queued_the_core_reads_a_whole_message_even_past_the_bound() -> None:
    # The session waits for a request; refusing to read would deadlock, and the message being assembled is
    # bounded by the message limit anyway.
    core, client = make_core(max_message_size=1000, inbound_bytes_limit=100)
    for _ in range(9):
        core.receive_data(client.send(BytesMessage(data=bytes(100), message_finished=False)), 0.0)
        assert core.wants_data
    core.receive_data(client.send(BytesMessage(data=bytes(100), message_finished=True)), 0.0)
    assert not core.wants_data
    assert core.next_message() == bytes(1000)
    assert core.wants_data


def test_a_flood_of_empty_messages_is_bounded_by_their_overhead() -> None:
    core, client = make_core(max_message_size=1000, inbound_bytes_limit=640)
    read = 0
    while core.wants_data:
        core.receive_data(client.send(BytesMessage(data=b"")), 0.0)
        read += 1
    assert read == 640 // MESSAGE_OVERHEAD


def test_the_outbound_queue_is_bounded_in_bytes_and_frames_are_fragments() -> None:
    core, client = make_core()
    big = bytes(LIMITS.queue_bytes + 1)
    core.queue_message(big)  # larger than the bound: admitted alone into an empty queue
    with pytest.raises(QueueFull):
        core.queue_message(b"x")
    buffers = core.outgoing(0.0)
    assert buffers is not None and len(buffers[1]) == FRAGMENT_BYTES
    events = drain(core, client)
    assert b"".join(bytes(e.data) for e in events if isinstance(e, BytesMessage)) == big
    assert core.queued_bytes == 0
    core.queue_message(b"x")


def test_pings_and_pongs_go_between_fragments_of_a_long_message() -> None:
    core, client = make_core()
    core.queue_message(bytes(3 * FRAGMENT_BYTES))
    first = core.outgoing(0.0)
    assert first is not None
    assert not make_core()[0].control_pending
    core.receive_data(client.send(Ping(payload=b"p")), 0.0)
    assert core.control_pending  # the pong: the driver wakes its writer
    core.start_ping(b"q")
    data = b"".join(bytes(b) for b in first)
    core.sent(len(data), 0.0)
    client.receive_data(data)
    for opcode in (0xA, 0x9):  # the pong and our ping come next, before the second fragment
        control = core.outgoing(0.0)
        assert control is not None
        data = b"".join(bytes(buffer) for buffer in control)
        assert data[0] & 0x0F == opcode
        core.sent(len(data), 0.0)
        client.receive_data(data)
    events = list(client.events())
    assert any(isinstance(e, Pong) for e in events) and any(isinstance(e, Ping) for e in events)
    assert core.awaiting_pong
    core.receive_data(client.send(Pong(payload=b"q")), 0.0)
    assert not core.awaiting_pong


def test_a_missed_send_deadline_closes_with_1013_after_the_frame_in_flight_then_aborts() -> None:
    core, client = make_core()
    core.queue_message(bytes(2 * FRAGMENT_BYTES))
    core.queue_message(b"queued behind")
    buffers = core.outgoing(5.0)
    assert buffers is not None
    frame = b"".join(bytes(buffer) for buffer in buffers)
    core.sent(10, 5.0)  # the peer's window closes after 10 bytes
    assert core.write_deadline == 5.0 + LIMITS.send_deadline
    assert not core.write_timed_out(15.0)
    assert core.overrun and core.close_reason is not None
    assert core.close_reason.code == CLOSE_TRY_AGAIN_LATER
    assert core.write_deadline == 15.0 + LIMITS.close_grace  # the frame in flight now waits for the abort
    with pytest.raises(ConnectionClosed):
        core.queue_message(b"late")
    # When the peer reads again, it gets the rest of the frame in flight, then the close: nothing queued.
    client.receive_data(frame[:10])
    events = drain(core, client, 16.0)
    closes = [e for e in events if isinstance(e, CloseConnection)]
    assert [c.code for c in closes] == [CLOSE_TRY_AGAIN_LATER]
    assert all(not (isinstance(e, BytesMessage) and e.data == b"queued behind") for e in events)
    # Had it not read, the abort time would have passed.
    core2, _ = make_core()
    core2.queue_message(bytes(10))
    core2.outgoing(0.0)
    assert not core2.write_timed_out(LIMITS.send_deadline)
    assert core2.write_timed_out(LIMITS.send_deadline + LIMITS.close_grace)


def test_the_peers_close_is_answered_at_once_and_queued_messages_are_dropped() -> None:
    core, client = make_core()
    core.queue_message(b"never sent")
    core.receive_data(client.send(CloseConnection(code=1000, reason="bye")), 3.0)
    assert core.peer_closed and core.close_received and not core.wants_data
    assert core.abort_at == 3.0 + LIMITS.close_grace
    events = drain(core, client, 3.0)
    assert [type(e) for e in events] == [CloseConnection]
    assert core.close_complete


def test_a_normal_close_waits_for_queued_messages_and_an_urgent_one_does_not() -> None:
    core, client = make_core()
    core.queue_message(b"first")
    core.close(1000, now=0.0)
    assert core.abort_at == LIMITS.send_deadline + LIMITS.close_grace
    events = drain(core, client)
    assert [type(e) for e in events] == [BytesMessage, CloseConnection]
    core2, client2 = make_core()
    core2.queue_message(b"dropped")
    core2.close(1001, "going away", now=0.0, urgent=True)
    assert core2.abort_at == LIMITS.close_grace
    events = drain(core2, client2)
    assert [type(e) for e in events] == [CloseConnection]
    # Once our close is out, the peer has the close grace to answer it.
    assert core2.close_sent and not core2.close_complete
    core2.receive_data(client2.send(CloseConnection(code=1001)), 1.0)
    assert core2.close_complete
