"""P's side channel (ZMQ over TCP, like vLLM's NIXL): handshakes and claims.

P's scheduler process owns the listener: vLLM hands it every worker rank's
:class:`~kvcached_pd.connector.wire.RankHandshake` (``set_xfer_handshake_metadata``),
so one port serves all ranks of an engine and the port can go into each request's
params. D's worker asks for one rank and gets that rank's encoded handshake, once per
(peer engine, rank); every later request from that peer reuses it.

Push mode with concurrent legs (a proxy sends the decode leg before P has answered, as
vLLM's push design allows): D has no staged params yet, only P's vLLM side-channel
address from the proxy. It finds this listener at that port plus
:data:`CLAIM_PORT_OFFSET` (where P binds by default) and claims the request's params by
its base id (:class:`~kvcached_pd.connector.wire.Claim`). P's scheduler publishes each
finished request's params on a :class:`~.claim_board.ClaimBoard`; a claim that arrives earlier is
held, up to :data:`CLAIM_HOLD_S`, and answered the moment they are published, so D
learns of a finished prefill without polling every step.

Protocol: ``b"KVPD-HS1 <rank>"`` -> the encoded handshake, or ``b"ERR <reason>"``;
``b"KVPD-CLAIM1 " + Claim.encode()`` -> ``ClaimReply.encode()`` (or ``b"ERR ..."``).
With a shared secret (``KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE``) D sends either request
as ``b"KVPD-AUTH1 <HMAC-SHA256 hex> " + request`` (:func:`sign`) and a P with the secret
answers nothing else; a P without one strips the prefix unchecked, so Ds can be given
the secret before the Ps.

Everything a peer sends is untrusted: each message gets its own answer (an ``ERR`` for
one that is not a request), no message can stop the listener, and every map a peer
can grow is bounded.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from kvcached_pd.connector.claim_board import ClaimBoard
from kvcached_pd.connector.wire import Claim, ClaimReply, WireError

logger = logging.getLogger("kvcached_pd")

_REQUEST = b"KVPD-HS1 "
_CLAIM = b"KVPD-CLAIM1 "
_AUTH = b"KVPD-AUTH1 "
_MAC_CONTEXT = b"kvcached-pd side channel request\0"
_MAC_HEX = 64  # HMAC-SHA256, hex
MAX_RANK_DIGITS = 4  # a TP rank below 10000
# Largest request P's listener takes (zmq.MAXMSGSIZE: ZMQ drops the connection of a
# peer that sends more, before the bytes are buffered whole; one 1 GiB frame otherwise
# grew P by 1 GiB). A claim is the request's base id (a client's X-Request-Id, which
# HTTP servers cap at 8-16 KiB of headers) plus an engine id and ~50 bytes of framing;
# a handshake request is ~20 bytes; the MAC adds 76.
MAX_REQUEST_BYTES = 64 << 10
# Largest reply D takes. A handshake is ~0.6 KiB on this CPU host (its NIXL agent
# metadata: 498 bytes); a GPU host's UCX worker address over several transports and
# rails adds a few KiB, a claim reply is ~1 KiB. 4 MiB is three orders of magnitude
# above that and still not a memory lever.
MAX_REPLY_BYTES = 4 << 20
MAX_HELD_CLAIMS = 4096  # claims a listener holds at once; more are answered "pending"
# P's listener binds vLLM's NIXL side-channel port plus this (KVCACHED_PD_SIDE_CHANNEL_PORT
# unset), so that a D holding only P's vLLM address (push, concurrent legs) finds it.
# Far above the data-parallel ranks' ports (vLLM's base port + DP index).
CLAIM_PORT_OFFSET = 1000
CLAIM_HOLD_S = 1.0  # a held claim is answered "pending" after this; D asks again


def claim_port(vllm_side_channel_port: int) -> int:
    return int(vllm_side_channel_port) + CLAIM_PORT_OFFSET


def sign(secret: bytes, request: bytes) -> bytes:
    """``request`` as D sends it to a P that shares ``secret``."""
    mac = hmac.new(secret, _MAC_CONTEXT + request, hashlib.sha256).hexdigest().encode()
    return _AUTH + mac + b" " + request


def verify(secret: bytes | None, message: bytes) -> bytes:
    """The request inside ``message``; :class:`WireError` when ``secret`` is set and the
    message does not prove it (compared in constant time)."""
    signed = message.startswith(_AUTH)
    if signed:
        body = message[len(_AUTH):]
        mac, request = body[:_MAC_HEX], body[_MAC_HEX + 1:]
        if len(body) <= _MAC_HEX or body[_MAC_HEX:_MAC_HEX + 1] != b" ":
            raise WireError("malformed authenticated request")
    else:
        mac, request = b"", message
    if secret is None:
        return request
    if not signed:
        raise WireError("this listener requires the shared secret "
                        "(KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE) on the decode instance")
    expected = hmac.new(secret, _MAC_CONTEXT + request, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(mac, expected):
        raise WireError("wrong shared secret (KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE differs "
                        "between this prefill and the decode instance)")
    return request


def parse_request(request: bytes) -> tuple[str, Any]:
    """``("handshake", rank)`` or ``("claim", Claim)``; :class:`WireError` for anything
    else. The rank is ASCII digits only (``str.isdigit`` also accepts "²", which
    ``int`` refuses) and at most :data:`MAX_RANK_DIGITS` of them."""
    if request.startswith(_CLAIM):
        return "claim", Claim.decode(request[len(_CLAIM):])
    if not request.startswith(_REQUEST):
        raise WireError("not a kvcached-pd handshake request")
    rank = request[len(_REQUEST):]
    if not (0 < len(rank) <= MAX_RANK_DIGITS and rank.isascii() and rank.isdigit()):
        raise WireError(f"rank {rank[:16]!r} is not a TP rank")
    return "handshake", int(rank)


class HandshakeListener:
    """Serves encoded rank handshakes, and claims from ``board``, on ``host:port``
    (port 0: any free port); with ``secret``, only to requests that prove it."""

    def __init__(self, host: str, port: int, handshakes: dict[int, bytes],
                 board: ClaimBoard | None = None, hold_s: float = CLAIM_HOLD_S,
                 secret: bytes | None = None) -> None:
        self._handshakes = dict(handshakes)
        self._board = board
        self._hold_s = hold_s
        self._secret = secret
        self._held: list[tuple[bytes, Claim, float]] = []  # (identity, claim, expires)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        bind_host = "*" if host in ("", "0.0.0.0") else host
        if port:
            self._sock.bind(f"tcp://{bind_host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvcached-pd-handshake",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._board is not None:
            poller.register(self._board.wake_fd, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._step(poller)
            except Exception:  # noqa: BLE001 - one message never stops the listener
                logger.exception("kvcached-pd: the staged handshake listener on port %d "
                                 "failed on one message; it goes on serving", self.port)

    def _step(self, poller: zmq.Poller) -> None:
        # with a board, publishing (and close) wakes the poll: held claims are
        # answered the moment their params exist, not at the next tick
        timeout = 100 if self._board is None else 1000
        if self._held:
            timeout = max(1, min(timeout, int(1e3 * (min(h[2] for h in self._held)
                                                     - time.monotonic())) + 1))
        events = dict(poller.poll(timeout))
        if self._board is not None and events.get(self._board.wake_fd.fileno()):
            self._board.drain_wakeups()
        if self._sock in events:
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 3 and frames[1] == b"":
                    reply = self._answer(frames[0], frames[2])
                else:  # not a REQ/DEALER envelope around one message
                    reply = b"ERR not one kvcached-pd request per message"
                if reply is not None:
                    self._send(frames[0], reply)
        if self._held:
            self._answer_held()

    def _send(self, identity: bytes, reply: bytes) -> None:
        try:
            self._sock.send_multipart([identity, b"", reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone (or not reading): its reply is dropped

    def _answer(self, identity: bytes, message: bytes) -> bytes | None:
        try:
            kind, value = parse_request(verify(self._secret, message))
        except WireError as exc:
            return f"ERR {exc}".encode()
        if kind == "claim":
            if self._board is None:
                return b"ERR this instance stages no prefill"
            reply = self._board.answer(value)
            if reply.status == "pending" and len(self._held) < MAX_HELD_CLAIMS:
                self._held.append((identity, value, time.monotonic() + self._hold_s))
                return None
            return reply.encode()
        if value not in self._handshakes:
            return f"ERR no rank {value} here (ranks {sorted(self._handshakes)})".encode()
        return self._handshakes[value]

    def _answer_held(self) -> None:
        now = time.monotonic()
        still = []
        for identity, claim, expires in self._held:
            reply = self._board.answer(claim, now)
            if reply.status == "pending" and now < expires:
                still.append((identity, claim, expires))
                continue
            self._send(identity, reply.encode())
        self._held = still

    def close(self) -> None:
        self._stop.set()
        if self._board is not None:
            self._board._wake()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()


def fetch_handshake(host: str, port: int, rank: int, timeout_s: float = 5.0,
                    secret: bytes | None = None) -> bytes:
    """One rank's encoded handshake from P's listener; raises ``TimeoutError`` or
    ``ConnectionError`` (with the peer's reason) when there is none."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    request = _REQUEST + str(rank).encode()
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(request if secret is None else sign(secret, request))
        try:
            reply = sock.recv()
        except zmq.Again as exc:
            raise TimeoutError(f"no kvcached-pd handshake from {host}:{port} within "
                               f"{timeout_s:.0f} s") from exc
    finally:
        sock.close(0)
    if reply.startswith(b"ERR "):
        raise ConnectionError(f"{host}:{port}: {reply[4:].decode(errors='replace')}")
    return reply


class ClaimClient:
    """D's claims, for one worker: one thread, one DEALER socket per P listener.

    ``submit`` queues a claim; the thread sends it, asks again on every "pending"
    (P holds each for :data:`CLAIM_HOLD_S`, so this is a long poll, not a busy one) and
    files the final reply, which ``take`` hands out. A listener that answers nothing
    for ``timeout_s`` past its hold is taken for gone (an error is filed). ``cancel``
    forgets a claim (its request was aborted); a reply that still comes is dropped.
    How long a claim may stay pending in all is the caller's to bound.

    The listener a request names is the request's choice, so anything it answers is
    untrusted: a reply that is no claim reply (or over :data:`MAX_REPLY_BYTES`, which
    ZMQ refuses) fails the claims waiting on that listener, never the thread. A socket
    is closed once no claim waits on it: at once after an error or a time-out (a dead
    or hostile target), after :data:`IDLE_CLOSE_S` otherwise.

    ``threaded=False``: no thread; ``submit``, ``cancel`` and ``take`` do the socket work
    themselves, without blocking, in the caller's thread (D's scheduler, which asks
    every step while a claim is pending; idle sockets close at its next call, not on a
    clock). Why: a reply that reaches a thread must wait
    for the GIL of a process whose main thread runs vLLM's engine loop; CPython makes it
    wait up to its switch interval (5 ms). ``experiments/bench_claim_latency.py``, both
    engines modelled busy: 3.4-3.5 ms p50 from P's publishing to D's ``take`` polled,
    4.6-5.1 with the thread; P and D on one H100 under load (2026-11-28): 4.2 / 5.8 ms
    polled against 5.2 / 7.5 with the thread, in neighbouring runs (p90 mixed)."""

    IDLE_CLOSE_S = 30.0

    def __init__(self, timeout_s: float = 5.0, secret: bytes | None = None,
                 threaded: bool = True) -> None:
        self._timeout_s = timeout_s
        self._secret = secret
        self._lock = threading.Lock()
        self._submitted: list[tuple[str, str, int, Claim]] = []  # (req id, host, port, claim)
        self._cancelled: set[str] = set()
        self._results: dict[str, ClaimReply | Exception] = {}
        self._sockets: dict[tuple[str, int], Any] = {}  # the thread's own
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        # (host, port) -> key -> _Asked: one claim on the wire per key at a time; and
        # when each socket last carried a claim. The thread's own, or the caller's.
        self._asked: dict[tuple[str, int], dict[str, _Asked]] = {}
        self._used: dict[tuple[str, int], float] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="kvcached-pd-claims",
                                            daemon=True)
            self._thread.start()

    def submit(self, req_id: str, host: str, port: int, claim: Claim) -> None:
        with self._lock:
            self._submitted.append((req_id, host, port, claim))
        self._kick()

    def cancel(self, req_id: str) -> None:
        with self._lock:
            self._cancelled.add(req_id)
            self._results.pop(req_id, None)
        self._kick()

    def take(self) -> dict[str, ClaimReply | Exception]:
        """Final replies (ready or gone) and errors since the last call, by request id."""
        if self._thread is None:
            self._pump()
        with self._lock:
            results, self._results = self._results, {}
        return results

    def _kick(self) -> None:
        if self._thread is None:
            self._pump()
        else:
            self._wake()

    def _pump(self) -> None:
        """One non-blocking round of the socket work, in the caller's thread."""
        try:
            self._step(0)
        except Exception:  # noqa: BLE001 - a reply never fails the caller (vLLM's scheduler)
            logger.exception("kvcached-pd: the claim client failed on one round; it goes on")

    def open_sockets(self) -> int:
        """How many listeners this client holds a connection to."""
        return len(self._sockets)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"!")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._step(50)
                except Exception:  # noqa: BLE001 - a reply never stops D's claims
                    logger.exception("kvcached-pd: the claim thread failed on one step; "
                                     "it goes on")
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets = {}

    def _step(self, timeout_ms: int) -> None:
        """One round: send what was submitted, read replies, time out, close idle
        sockets; waits up to ``timeout_ms`` for a socket (0: the polled client)."""
        poller, asked, used = self._poller, self._asked, self._used
        events = dict(poller.poll(timeout_ms))
        if events.get(self._wake_r.fileno()):
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        with self._lock:
            submitted, self._submitted = self._submitted, []
            cancelled, self._cancelled = self._cancelled, set()
        now = time.monotonic()
        for by_key in asked.values():
            for key in list(by_key):
                by_key[key].req_ids -= cancelled
                if not by_key[key].req_ids:
                    del by_key[key]  # its reply, if any comes, is dropped
        broken: set[tuple[str, int]] = set()
        for req_id, host, port, claim in submitted:
            if req_id in cancelled:
                continue
            addr = (host, port)
            by_key = asked.setdefault(addr, {})
            if claim.key in by_key:
                # two requests of one id: one extent cannot serve both
                self._file({req_id}, ConnectionError(
                    f"another request with id {claim.key!r} is claiming from {host}:{port}"))
                continue
            sock = self._sockets.get(addr)
            if sock is None:
                sock = self._sockets[addr] = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
                poller.register(sock, zmq.POLLIN)
                try:
                    sock.connect(f"tcp://{host}:{port}")
                except zmq.ZMQError as exc:  # not an address at all
                    self._file({req_id}, ConnectionError(f"{host}:{port}: {exc}"))
                    broken.add(addr)
                    continue
            by_key[claim.key] = _Asked(claim, {req_id}, now)
            used[addr] = now
            self._send(sock, claim)
        for addr, sock in list(self._sockets.items()):
            if sock in events and not self._receive(addr, sock, asked.setdefault(addr, {})):
                broken.add(addr)
        broken |= self._time_out(asked, time.monotonic())
        self._close_idle(poller, asked, used, broken, time.monotonic())

    def _send(self, sock: Any, claim: Claim) -> None:
        request = _CLAIM + claim.encode()
        sock.send_multipart([b"", request if self._secret is None
                             else sign(self._secret, request)])

    def _receive(self, addr: tuple[str, int], sock: Any, by_key: dict[str, "_Asked"]) -> bool:
        """Take the replies waiting on ``sock``; False when the listener answered
        something that is no claim reply (the claims waiting on it have failed)."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            data = frames[-1]
            if len(frames) != 2 or frames[0] != b"" or data.startswith(b"ERR "):
                # a listener that does not answer claims: every claim to it fails
                reason = (data[4:].decode(errors="replace")[:512] if data.startswith(b"ERR ")
                          else "not a claim reply")
                self._fail_all(by_key, ConnectionError(f"{addr[0]}:{addr[1]}: {reason}"))
                return False
            try:
                reply = ClaimReply.decode(data)
            except WireError as exc:
                logger.warning("kvcached-pd: %s:%d: %s", addr[0], addr[1], exc)
                self._fail_all(by_key, ConnectionError(f"{addr[0]}:{addr[1]}: {exc}"))
                return False
            entry = by_key.get(reply.key)
            if entry is None:
                continue  # cancelled meanwhile
            if reply.status == "pending":
                entry.sent = time.monotonic()
                self._send(sock, entry.claim)
                continue
            self._file(by_key.pop(reply.key).req_ids, reply)

    def _fail_all(self, by_key: dict[str, "_Asked"], error: Exception) -> None:
        for key in list(by_key):
            self._file(by_key.pop(key).req_ids, error)

    def _time_out(self, asked: dict[tuple[str, int], dict[str, "_Asked"]],
                  now: float) -> set[tuple[str, int]]:
        """File a time-out for each claim unanswered too long; the listeners concerned."""
        limit = self._timeout_s + CLAIM_HOLD_S
        dead = set()
        for addr, by_key in asked.items():
            for key in [k for k, e in by_key.items() if now - e.sent > limit]:
                dead.add(addr)
                self._file(by_key.pop(key).req_ids, TimeoutError(
                    f"no answer from {addr[0]}:{addr[1]} within {limit:.0f} s"))
        return dead

    def _close_idle(self, poller: zmq.Poller, asked: dict[tuple[str, int], dict[str, "_Asked"]],
                    used: dict[tuple[str, int], float], broken: set[tuple[str, int]],
                    now: float) -> None:
        for addr in list(self._sockets):
            if asked.get(addr) or (addr not in broken
                                   and now - used.get(addr, 0.0) < self.IDLE_CLOSE_S):
                continue
            sock = self._sockets.pop(addr)
            poller.unregister(sock)
            sock.close(0)
            asked.pop(addr, None)
            used.pop(addr, None)

    def _file(self, req_ids: set[str], result: ClaimReply | Exception) -> None:
        with self._lock:
            for req_id in req_ids:
                if req_id not in self._cancelled:
                    self._results[req_id] = result

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        else:
            self._close_sockets()
        self._wake_r.close()
        self._wake_w.close()


@dataclass
class _Asked:
    claim: Claim
    req_ids: set[str]
    sent: float  # when it last went on the wire
