"""Property tests over what crosses P's side channel (issue 21): the request frame
parser, the authentication check, the msgpack shape check and every msgpack record
decoder take any bytes a peer can send and either return a record or raise the wire's
own ``WireError``, nothing else; and the real listener answers every message, garbage
included, and then the next valid request. About 2,000 cases, a few seconds."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached_pd.connector.claim_board import ClaimBoard
from kvcached_pd.connector.side_channel import (
    HandshakeListener,
    parse_request,
    sign,
    verify,
)
from kvcached_pd.connector.wire import (
    MAX_MSGPACK_DEPTH,
    Claim,
    ClaimReply,
    RankHandshake,
    WireError,
    check_msgpack_shape,
)

SECRET = b"fuzzing-secret-of-32-bytes......"
PREFIXES = [b"", b"KVPD-HS1 ", b"KVPD-CLAIM1 ", b"KVPD-AUTH1 ", b"KVPD-AUTH1 " + b"0" * 64 + b" "]

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
           | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


def deep(n: int) -> bytes:
    return b"\x91" * n + b"\x00"


# records as peers send them, well formed, then bent
records = st.sampled_from([
    Claim(2, "cmpl-1-0", "p-engine").encode(),
    ClaimReply("cmpl-1-0", "ready", {"offset": 4096, "nbytes": 1 << 20}, 0.5).encode(),
    ClaimReply("cmpl-1-0", "gone", reason="lease").encode(),
    RankHandshake(2, "p", 0, 1, "agent", b"\x00" * 40, 1 << 30, 1 << 26, 0, "DRAM",
                  {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16",
                   "version": 1}, 0, 2, "0" * 16).encode(),
    # with the optional fields: the IPC export and the agent without its memory
    RankHandshake(3, "p", 0, 1, "agent", b"\x00" * 40, 1 << 30, 1 << 26, 0, "VRAM",
                  {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16",
                   "version": 3}, 0, 2, "0" * 16,
                  ipc={"host": "boot/ipc:1", "device_uuid": "GPU-0", "nbytes": 1 << 26,
                       "memory": [b"\x01" * 64, 1 << 26, 0, "ref", 0, b"\x02" * 64, True],
                       "events": [b"\x03" * 64]},
                  notify_metadata=b"\x04" * 30).encode(),
])


@st.composite
def peer_bytes(draw) -> bytes:
    """What a peer may send: random bytes, any msgpack, deep nesting, or a real record
    truncated, extended or with bytes replaced."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.binary(max_size=300))
    if kind == 1:
        return msgspec.msgpack.encode(draw(values))
    if kind == 2:
        return draw(st.sampled_from([b"\x81\xa1a", b"\x83", b"\xdc\xff\xff", b""])) + \
            deep(draw(st.integers(0, 3000)))
    data = bytearray(draw(records))
    if kind == 3:
        return bytes(data[:draw(st.integers(0, len(data)))]) + draw(st.binary(max_size=8))
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=300, deadline=None)
@given(values, st.integers(0, MAX_MSGPACK_DEPTH + 2))
def test_the_shape_check_accepts_exactly_msgpack_nested_within_the_bound(value, wraps):
    for _ in range(wraps):
        value = [value]
    data = msgspec.msgpack.encode(value)
    if depth(value) > MAX_MSGPACK_DEPTH:
        with pytest.raises(WireError, match="nested deeper"):
            check_msgpack_shape(data)
        return
    check_msgpack_shape(data)
    for cut in {0, len(data) // 2, len(data) - 1}:  # a strict prefix is never whole
        with pytest.raises(WireError):
            check_msgpack_shape(data[:cut])
    with pytest.raises(WireError, match="after the msgpack object"):
        check_msgpack_shape(data + b"\x00")


@pytest.mark.parametrize("record", [Claim, ClaimReply, RankHandshake])
@settings(max_examples=300, deadline=None)
@given(data=peer_bytes())
def test_a_record_decoder_raises_wire_error_and_nothing_else(record, data):
    try:
        decoded = record.decode(data)
    except WireError:
        return
    assert isinstance(decoded, record)


@settings(max_examples=400, deadline=None)
@given(prefix=st.sampled_from(PREFIXES), body=peer_bytes() | st.text(max_size=12).map(str.encode),
       secret=st.sampled_from([None, SECRET]), signed=st.booleans())
def test_the_request_parser_raises_wire_error_and_nothing_else(prefix, body, secret, signed):
    message = prefix + body
    if signed:
        message = sign(SECRET, message)
    try:
        kind, value = parse_request(verify(secret, message))
    except WireError:
        return
    assert (kind, type(value)) in (("handshake", int), ("claim", Claim))


@pytest.fixture(scope="module")
def listener():
    board = ClaimBoard("p-engine", keep_s=30.0)
    server = HandshakeListener("127.0.0.1", 0, {0: b"rank-0 handshake"}, board, hold_s=0.01)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    yield sock
    sock.close(0)
    server.close()
    board.close()


def exchange(sock, message: bytes) -> bytes:
    sock.send_multipart([b"", message])
    assert sock.poll(5000), f"no answer to {message[:40]!r}"
    return sock.recv_multipart()[-1]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(prefix=st.sampled_from(PREFIXES), body=peer_bytes())
def test_the_listener_answers_every_message_and_then_a_valid_request(listener, prefix, body):
    reply = exchange(listener, prefix + body)
    assert reply.startswith(b"ERR ") or reply == b"rank-0 handshake" or \
        ClaimReply.decode(reply).status in ("pending", "gone")
    assert exchange(listener, b"KVPD-HS1 0") == b"rank-0 handshake"
