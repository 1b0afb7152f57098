"""P's side channel on its own (real ZMQ over TCP on localhost): the claims a decode leg
sent before P answered makes (push mode, concurrent legs), and how each end copes with
a peer that answers late, wrongly or not at all."""

from __future__ import annotations

import time

import pytest

from kvcached_pd.connector.side_channel import (
    CLAIM_HOLD_S,
    ClaimBoard,
    ClaimClient,
    HandshakeListener,
)
from kvcached_pd.connector.wire import Claim, ClaimReply, base_request_id

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


@pytest.fixture
def channel():
    """P's board and listener on localhost, and D's claim client."""
    board = ClaimBoard(ENGINE, keep_s=30.0)
    listener = HandshakeListener("127.0.0.1", 0, {0: b"hs"}, board)
    client = ClaimClient(timeout_s=2.0)
    yield board, listener.port, client
    client.close()
    listener.close()
    board.close()


def test_base_request_id_strips_only_vllms_random_suffix():
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("x-1A2B3C4D") == "x"
    assert base_request_id("x-1a2b3c4") == "x-1a2b3c4"  # 7 hex digits: not vLLM's suffix


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
        # after the lease nothing can be read any more: the entry is dropped
        assert board.answer(claim("r1"), now=time.monotonic() + 11).status == "pending"
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


def test_a_listener_without_claims_and_no_listener_at_all_fail_the_claim():
    listener = HandshakeListener("127.0.0.1", 0, {0: b"hs"})  # no board: answers ERR
    client = ClaimClient(timeout_s=0.3)
    try:
        client.submit("d-4", "127.0.0.1", listener.port, claim("r5"))
        error = wait_for(client, "d-4")
        assert isinstance(error, ConnectionError) and "stages no prefill" in str(error)
        import socket

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        t0 = time.monotonic()
        client.submit("d-5", "127.0.0.1", dead, claim("r6"))
        error = wait_for(client, "d-5", timeout_s=10)
        assert isinstance(error, TimeoutError)
        assert 0.3 + CLAIM_HOLD_S - 0.1 < time.monotonic() - t0 < 0.3 + CLAIM_HOLD_S + 2
    finally:
        client.close()
        listener.close()
