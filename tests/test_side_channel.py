"""P's side channel on its own (real ZMQ over TCP on localhost): the claims a decode leg
sent before P answered makes (push mode, concurrent legs), and how each end copes with
a peer that answers late, wrongly or not at all."""

from __future__ import annotations

import time

import pytest

from kvcached_pd.connector.claim_board import ClaimBoard
from kvcached_pd.connector.side_channel import (
    CLAIM_HOLD_S,
    ClaimClient,
    HandshakeListener,
)
from kvcached_pd.connector.wire import Claim, ClaimReply, base_request_id
from tests.support.dead_ports import dead_ports

ENGINE = "p-engine"
PARAMS = {"request_id": "cmpl-7-0-1a2b3c4d", "offset": 4096, "nbytes": 1 << 20}


def claim(key: str, engine: str = ENGINE) -> Claim:
    return Claim(2, key, engine)


def wait_for(client: ClaimClient, req_id: str, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    got: dict = {}
    while time.monotonic() < deadline and req_id not in got:
        got.update(client.take())
        time.sleep(0.002)
    return got.get(req_id)


@pytest.fixture(params=[True, False], ids=["claim thread", "polled by the caller"])
def channel(request):
    """P's board and listener on localhost, and D's claim client: with its thread (D's
    workers) and without one, polled by whoever takes (D's scheduler)."""
    board = ClaimBoard(ENGINE, keep_s=30.0)
    listener = HandshakeListener("127.0.0.1", 0, {0: b"hs"}, board)
    client = ClaimClient(timeout_s=2.0, threaded=request.param)
    yield board, listener.port, client
    client.close()
    listener.close()
    board.close()


def test_base_request_id_strips_only_vllms_random_suffix():
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("x-1A2B3C4D") == "x"
    assert base_request_id("x-1a2b3c4") == "x-1a2b3c4"  # 7 hex digits: not vLLM's suffix


def test_a_claim_answered_before_its_publishing_time_has_age_zero():
    """The listener reads the clock once for all its held claims; P's scheduler may
    publish a request after that reading. The age answered is then 0, never negative
    (D refused such answers: a push request's load failed)."""
    board = ClaimBoard(ENGINE, keep_s=10.0)
    try:
        before = time.monotonic()
        board.publish("r1", PARAMS)
        reply = board.answer(claim("r1"), now=before)
        assert reply.status == "ready" and reply.age_s == 0.0
    finally:
        board.close()


def test_board_answers_pending_ready_and_gone_and_forgets_after_the_lease():
    board = ClaimBoard(ENGINE, keep_s=10.0)
    try:
        assert board.answer(claim("r1")).status == "pending"  # P has not seen it yet
        board.publish("r1", PARAMS)
        reply = board.answer(claim("r1"), now=time.monotonic() + 2)
        assert reply.status == "ready" and reply.params == PARAMS
        assert 1.9 < reply.age_s < 2.5
        board.withdraw("r1", "P aborted it")
        reply = board.answer(claim("r1"))
        assert (reply.status, reply.reason) == ("gone", "P aborted it")
        assert board.answer(claim("r1", "another-p")).status == "gone"
        # after the lease nothing can be read any more: P's step drops the entry
        board.expire(now=time.monotonic() + 11)
        assert len(board) == 0
        assert board.answer(claim("r1")).status == "pending"
    finally:
        board.close()


def test_a_held_claim_is_answered_as_soon_as_p_publishes(channel):
    board, port, client = channel
    client.submit("d-1", "127.0.0.1", port, claim("r2"))
    time.sleep(0.2)
    assert client.take() == {}  # held by P's listener, not answered "pending"
    t0 = time.monotonic()
    board.publish("r2", PARAMS)
    reply = wait_for(client, "d-1")
    assert isinstance(reply, ClaimReply) and reply.status == "ready"
    assert reply.params == PARAMS
    assert time.monotonic() - t0 < CLAIM_HOLD_S / 2, "the held claim waited for its hold"
    # a claim kept pending past the hold is asked again, not failed
    board.expect("r3")  # P admitted it
    client.submit("d-2", "127.0.0.1", port, claim("r3"))
    time.sleep(CLAIM_HOLD_S * 1.5)
    assert client.take() == {}
    board.withdraw("r3", "P's lease ran out")
    reply = wait_for(client, "d-2")
    assert reply.status == "gone" and "lease" in reply.reason


def test_a_cancelled_claim_files_nothing(channel):
    board, port, client = channel
    client.submit("d-3", "127.0.0.1", port, claim("r4"))
    time.sleep(0.1)
    client.cancel("d-3")
    board.publish("r4", PARAMS)
    time.sleep(0.3)
    assert client.take() == {}


@pytest.mark.parametrize("threaded", [True, False], ids=["claim thread", "polled"])
def test_a_listener_without_claims_and_no_listener_at_all_fail_the_claim(threaded):
    listener = HandshakeListener("127.0.0.1", 0, {0: b"hs"})  # no board: answers ERR
    client = ClaimClient(timeout_s=0.3, threaded=threaded)
    try:
        client.submit("d-4", "127.0.0.1", listener.port, claim("r5"))
        error = wait_for(client, "d-4")
        assert isinstance(error, ConnectionError) and "stages no prefill" in str(error)
        with dead_ports() as (dead,):  # a port nobody listens on
            t0 = time.monotonic()
            client.submit("d-5", "127.0.0.1", dead, claim("r6"))
            error = wait_for(client, "d-5", timeout_s=10)
        assert isinstance(error, TimeoutError)
        assert 0.3 + CLAIM_HOLD_S - 0.1 < time.monotonic() - t0 < 0.3 + CLAIM_HOLD_S + 2
    finally:
        client.close()
        listener.close()


# --------------------------------------------------------------------------------------
# Hostile peers and clients (issue 21): every test below goes through the real listener,
# board and claim client on loopback.

HANDSHAKE = b"a rank-0 handshake"
SECRET = b"0123456789abcdef0123456789abcdef"


def ask(port: int, *frames: bytes, timeout_s: float = 5.0) -> bytes | None:
    """One request to P's listener from a fresh REQ socket; its reply, None if none."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(list(frames))
        return sock.recv()
    except zmq.Again:
        return None
    finally:
        sock.close(0)


def nested(depth: int) -> bytes:
    """msgpack: ``depth`` nested one-element arrays around 0."""
    return b"\x91" * depth + b"\x00"


def claim_with(field: bytes, value: bytes) -> bytes:
    """A msgpack Claim map with one more field holding ``value`` (raw msgpack)."""
    import msgspec

    body = msgspec.msgpack.encode({"wire_version": 2, "key": "k", "engine_id": ENGINE})
    return bytes([body[0] + 1]) + body[1:] + msgspec.msgpack.encode(field.decode()) + value


BAD_MESSAGES = {
    "superscript rank": b"KVPD-HS1 \xc2\xb2",
    "5000-digit rank": b"KVPD-HS1 " + b"9" * 5000,
    "negative rank": b"KVPD-HS1 -1",
    "nested claim field": b"KVPD-CLAIM1 " + claim_with(b"x", nested(30_000)),
    "nested claim": b"KVPD-CLAIM1 " + nested(30_000),
    "claim of wrong types": b"KVPD-CLAIM1 \x83\xa3key\xc0\xa9engine_id\x01\xacwire_version\xa1x",
    "truncated claim": b"KVPD-CLAIM1 \x83\xa3key",
    "unknown": b"\xff\x00 hello",
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(BAD_MESSAGES))
def test_one_bad_message_gets_an_error_and_the_next_request_its_answer(channel, name):
    """Each of these stopped P's listener thread for good (every later handshake and
    claim timed out until P restarted)."""
    board, port, client = channel
    reply = ask(port, BAD_MESSAGES[name])
    assert reply is not None and reply.startswith(b"ERR "), reply
    assert ask(port, b"KVPD-HS1 0") == b"hs"
    board.publish("r9", PARAMS)
    client.submit("d-9", "127.0.0.1", port, claim("r9"))
    assert wait_for(client, "d-9").status == "ready"


def test_a_message_of_several_frames_gets_an_error():
    listener = HandshakeListener("127.0.0.1", 0, {0: HANDSHAKE})
    try:
        reply = ask(listener.port, b"KVPD-HS1 0", b"more")
        assert reply is not None and reply.startswith(b"ERR "), reply
        assert ask(listener.port, b"KVPD-HS1 0") == HANDSHAKE
    finally:
        listener.close()


def test_a_frame_over_the_limit_is_dropped_unread():
    """One 1 GiB frame grew P by 1 GiB; ZMQ now drops a peer that sends more than
    MAX_REQUEST_BYTES before buffering it, and answers the next one."""
    import zmq

    from kvcached_pd.connector.side_channel import MAX_REQUEST_BYTES

    listener = HandshakeListener("127.0.0.1", 0, {0: HANDSHAKE})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{listener.port}")
        sock.send_multipart([b"", b"KVPD-HS1 0" + b" " * MAX_REQUEST_BYTES])
        assert ask(listener.port, b"KVPD-HS1 0") == HANDSHAKE  # the listener lives on
        # and the oversized request was never read (it would have got an ERR)
        assert not sock.poll(500)
    finally:
        sock.close(0)
        listener.close()


def test_with_a_secret_only_requests_that_prove_it_are_answered():
    from kvcached_pd.connector.side_channel import fetch_handshake, sign

    board = ClaimBoard(ENGINE, keep_s=30.0)
    listener = HandshakeListener("127.0.0.1", 0, {0: HANDSHAKE}, board, secret=SECRET)
    open_listener = HandshakeListener("127.0.0.1", 0, {0: HANDSHAKE})  # no secret
    good, wrong = ClaimClient(timeout_s=2.0, secret=SECRET), ClaimClient(timeout_s=2.0)
    try:
        port = listener.port
        for message in (b"KVPD-HS1 0", sign(b"another secret of 32 bytes......", b"KVPD-HS1 0"),
                        sign(SECRET, b"KVPD-HS1 1"), sign(SECRET, b"KVPD-HS1 0")[:-1] + b"1",
                        b"KVPD-AUTH1 " + b"0" * 64 + b"KVPD-HS1 0", b"KVPD-AUTH1 x"):
            reply = ask(port, message)
            assert reply is not None and reply.startswith(b"ERR "), (message, reply)
        with pytest.raises(ConnectionError, match="requires the shared secret"):
            fetch_handshake("127.0.0.1", port, 0, 2.0)
        with pytest.raises(ConnectionError, match="wrong shared secret"):
            fetch_handshake("127.0.0.1", port, 0, 2.0, secret=SECRET[::-1])
        assert fetch_handshake("127.0.0.1", port, 0, 2.0, secret=SECRET) == HANDSHAKE
        # a prefill without the secret answers a decode that has it (Ds are given it first)
        assert fetch_handshake("127.0.0.1", open_listener.port, 0, 2.0, SECRET) == HANDSHAKE
        board.publish("r10", PARAMS)
        wrong.submit("d-10", "127.0.0.1", port, claim("r10"))
        error = wait_for(wrong, "d-10")
        assert isinstance(error, ConnectionError) and "secret" in str(error)
        good.submit("d-11", "127.0.0.1", port, claim("r10"))
        assert wait_for(good, "d-11").status == "ready"
    finally:
        good.close()
        wrong.close()
        open_listener.close()
        listener.close()
        board.close()


def test_a_claim_is_answered_ready_once_per_decode_rank():
    """A replayed claim got the request's params every time until P's lease ran out."""
    board = ClaimBoard(ENGINE, keep_s=30.0, readers=2)
    try:
        board.expect("r11-0a0b0c0d")
        assert board.answer(claim("r11")).status == "pending"
        board.publish("r11-0a0b0c0d", PARAMS)
        assert [board.answer(claim("r11")).status for _ in range(3)] == \
            ["ready", "ready", "gone"]
        assert "claimed already" in board.answer(claim("r11")).reason
    finally:
        board.close()


def test_two_requests_with_one_id_never_get_each_others_params():
    """The board was keyed by the base id, which a client chooses (X-Request-Id): the
    second request's params replaced the first's, and releasing one made the other's
    claim answer "gone"."""
    board = ClaimBoard(ENGINE, keep_s=30.0)
    try:
        board.expect("same-0a0b0c0d")
        board.expect("same-1a1b1c1d")
        board.publish("same-0a0b0c0d", PARAMS)
        reply = board.answer(claim("same"))
        assert reply.status == "gone" and "cannot tell them apart" in reply.reason
        board.publish("same-1a1b1c1d", {**PARAMS, "offset": 8192})
        assert board.answer(claim("same")).status == "gone"
        # once one is released the other is the only one of that id in flight
        board.withdraw("same-0a0b0c0d", "read")
        reply = board.answer(claim("same"))
        assert reply.status == "ready" and reply.params["offset"] == 8192
    finally:
        board.close()


def test_one_decode_claims_one_id_for_one_request_only(channel):
    board, port, client = channel
    client.submit("d-12", "127.0.0.1", port, claim("r12"))
    client.submit("d-13", "127.0.0.1", port, claim("r12"))
    error = wait_for(client, "d-13")
    assert isinstance(error, ConnectionError) and "another request" in str(error)
    board.publish("r12", PARAMS)
    assert wait_for(client, "d-12").status == "ready"


def test_the_board_forgets_on_ps_step_and_holds_a_bounded_number_of_released():
    """The board expired entries only inside answer(): in push mode with no claims,
    100k requests left 100k entries."""
    board = ClaimBoard(ENGINE, keep_s=10.0, max_gone=50)
    try:
        for i in range(200):
            board.expect(f"r{i}")
            board.publish(f"r{i}", PARAMS)
        for i in range(100):
            board.withdraw(f"r{i}", "read")
        assert len(board) == 100 + 50  # in flight, and the 50 latest released
        assert board.answer(claim("r99")).status == "gone"
        assert board.answer(claim("r0")).status == "pending"  # forgotten first
        board.expire(time.monotonic() + 11)
        assert len(board) == 0
    finally:
        board.close()


def hostile_listener(reply: bytes):
    """A listener a request may name: answers every message with ``reply``."""
    import threading

    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if sock.poll(50):
                identity, *_ = sock.recv_multipart()
                sock.send_multipart([identity, b"", reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close():
        stop.set()
        thread.join()
        sock.close(0)
        ctx.term()
    return port, close


def ready_reply_with(value: bytes) -> bytes:
    """A msgpack "ready" ClaimReply for r14 whose params hold ``value`` (raw msgpack)."""
    import msgspec

    head = msgspec.msgpack.encode({"key": "r14", "status": "ready", "params": {"a": 0}})
    return head[:-1] + value  # the params' last value, 0, is the last byte


@pytest.mark.parametrize("reply", [ready_reply_with(nested(100_000)), nested(100_000),
                                   b"x" * (5 << 20)], ids=["nested params", "nested", "5 MiB"])
def test_a_hostile_listener_fails_its_claim_and_not_the_claim_thread(channel, reply):
    """A nested reply killed D's claim thread (RecursionError): that worker's later
    claims all waited out their deadline."""
    board, port, client = channel
    hostile, close = hostile_listener(reply)
    try:
        client.submit("d-14", "127.0.0.1", hostile, claim("r14"))
        error = wait_for(client, "d-14", timeout_s=10)
        assert isinstance(error, (ConnectionError, TimeoutError)), error
        board.publish("r15", PARAMS)
        client.submit("d-15", "127.0.0.1", port, claim("r15"))
        assert wait_for(client, "d-15").status == "ready"
    finally:
        close()


@pytest.mark.parametrize("threaded", [True, False], ids=["claim thread", "polled"])
def test_sockets_to_dead_targets_are_closed(threaded):
    """One DEALER per request-supplied host:port, never closed: 300 dead targets left
    297 live sockets."""
    client = ClaimClient(timeout_s=0.1, threaded=threaded)
    try:
        with dead_ports(20) as dead:
            for i, port in enumerate(dead):
                client.submit(f"d-{i}", "127.0.0.1", port, claim(f"r{i}"))
            results: dict = {}
            deadline = time.monotonic() + 20
            while len(results) < len(dead) and time.monotonic() < deadline:
                results.update(client.take())
                time.sleep(0.01)
        assert len(results) == len(dead)
        assert all(isinstance(r, TimeoutError) for r in results.values()), results
        deadline = time.monotonic() + 5
        while client.open_sockets() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.open_sockets() == 0
    finally:
        client.close()


def test_ps_scheduler_enters_each_admitted_request_and_expires_the_board_every_step():
    """What P's scheduler tells the board: a request is known from its admission (so a
    claim for a second request of one id is refused before the first is staged), gone
    when it ends unstaged, and forgotten by P's own step once the lease has passed."""
    from types import SimpleNamespace

    from kvcached_pd.connector.prefill import PrefillScheduler
    from kvcached_pd.connector.wire import format_hash
    from kvcached_pd.transport.format import PackedFormat
    from kvcached_pd.transport.staging import ExtentAllocator

    fmt = PackedFormat(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
    board = ClaimBoard(ENGINE, keep_s=30.0)
    p = PrefillScheduler(fmt=fmt, digest=format_hash(fmt, 0, 2), block_size=16,
                         allocator=ExtentAllocator(64 << 20, 4096), engine_id=ENGINE,
                         tp_size=1, lease_s=30.0, host="127.0.0.1", port=1, board=board)
    try:
        requests = [SimpleNamespace(request_id=f"same-{i:08x}", num_prompt_tokens=16,
                                    status="FINISHED_ABORTED") for i in range(2)]
        assert p.admit(requests[0])
        assert board.answer(claim("same")).status == "pending"
        assert p.admit(requests[1])
        assert board.answer(claim("same")).status == "gone"  # two of one id in flight
        p.on_finished(requests[0], delay_free=False, params=None)  # ended unstaged
        p.on_finished(requests[1], delay_free=False, params=None)
        reply = board.answer(claim("same"))
        assert reply.status == "gone" and "without packing" in reply.reason
        assert len(board) == 2
        p.expire(time.monotonic() + 31)  # P's step (build_connector_meta)
        assert len(board) == 0
    finally:
        board.close()
