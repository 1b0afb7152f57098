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
finished request's params on a :class:`ClaimBoard`; a claim that arrives earlier is
held, up to :data:`CLAIM_HOLD_S`, and answered the moment they are published, so D
learns of a finished prefill without polling every step.

Protocol: ``b"KVPD-HS1 <rank>"`` -> the encoded handshake, or ``b"ERR <reason>"``;
``b"KVPD-CLAIM1 " + Claim.encode()`` -> ``ClaimReply.encode()`` (or ``b"ERR ..."``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from kvcached_pd.connector.wire import Claim, ClaimReply, WireError

logger = logging.getLogger("kvcached_pd")

_REQUEST = b"KVPD-HS1 "
_CLAIM = b"KVPD-CLAIM1 "
# P's listener binds vLLM's NIXL side-channel port plus this (KVCACHED_PD_SIDE_CHANNEL_PORT
# unset), so that a D holding only P's vLLM address (push, concurrent legs) finds it.
# Far above the data-parallel ranks' ports (vLLM's base port + DP index).
CLAIM_PORT_OFFSET = 1000
CLAIM_HOLD_S = 1.0  # a held claim is answered "pending" after this; D asks again


def claim_port(vllm_side_channel_port: int) -> int:
    return int(vllm_side_channel_port) + CLAIM_PORT_OFFSET


@dataclass
class _Entry:
    params: dict[str, Any] | None  # None: gone
    at: float  # monotonic time of publishing (ready) or withdrawing (gone)
    reason: str = ""


class ClaimBoard:
    """What P's listener answers claims from; written by P's scheduler thread, read by
    the listener thread. Entries live for ``keep_s`` (P's lease: no READ may start
    later), so a claim arriving after P finished still finds its params."""

    def __init__(self, engine_id: str, keep_s: float) -> None:
        self.engine_id = engine_id
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def publish(self, key: str, params: dict[str, Any]) -> None:
        with self._lock:
            self._entries[key] = _Entry(params, time.monotonic())
        self._wake()

    def withdraw(self, key: str, reason: str) -> None:
        """The request's extent is released: a claim from now on is answered "gone"."""
        with self._lock:
            if key in self._entries and self._entries[key].params is None:
                return
            self._entries[key] = _Entry(None, time.monotonic(), reason)
        self._wake()

    def answer(self, claim: Claim, now: float | None = None) -> ClaimReply:
        now = time.monotonic() if now is None else now
        if claim.engine_id != self.engine_id:
            return ClaimReply(claim.key, "gone", reason=f"this is prefill {self.engine_id}, "
                              f"not {claim.engine_id}")
        with self._lock:
            self._expire(now)
            entry = self._entries.get(claim.key)
        if entry is None:
            return ClaimReply(claim.key, "pending")
        if entry.params is None:
            return ClaimReply(claim.key, "gone", reason=entry.reason)
        return ClaimReply(claim.key, "ready", params=entry.params, age_s=now - entry.at)

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if now - e.at > self.keep_s]:
            del self._entries[key]

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"!")
        except BlockingIOError:  # the listener has wake-ups pending already
            pass

    def drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    @property
    def wake_fd(self) -> socket.socket:
        return self._wake_r

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()


class HandshakeListener:
    """Serves encoded rank handshakes, and claims from ``board``, on ``host:port``
    (port 0: any free port)."""

    def __init__(self, host: str, port: int, handshakes: dict[int, bytes],
                 board: ClaimBoard | None = None, hold_s: float = CLAIM_HOLD_S) -> None:
        self._handshakes = dict(handshakes)
        self._board = board
        self._hold_s = hold_s
        self._held: list[tuple[bytes, Claim, float]] = []  # (identity, claim, expires)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
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
                try:
                    identity, _, message = self._sock.recv_multipart()
                except (ValueError, zmq.ZMQError):
                    continue
                reply = self._answer(identity, message)
                if reply is not None:
                    self._sock.send_multipart([identity, b"", reply])
            if self._held:
                self._answer_held()

    def _answer(self, identity: bytes, message: bytes) -> bytes | None:
        if message.startswith(_CLAIM):
            if self._board is None:
                return b"ERR this instance stages no prefill"
            try:
                claim = Claim.decode(message[len(_CLAIM):])
            except WireError as exc:
                return f"ERR {exc}".encode()
            reply = self._board.answer(claim)
            if reply.status == "pending":
                self._held.append((identity, claim, time.monotonic() + self._hold_s))
                return None
            return reply.encode()
        if not message.startswith(_REQUEST):
            return b"ERR not a kvcached-pd handshake request"
        rank = message[len(_REQUEST):].decode(errors="replace")
        if not rank.isdigit() or int(rank) not in self._handshakes:
            return f"ERR no rank {rank} here (ranks {sorted(self._handshakes)})".encode()
        return self._handshakes[int(rank)]

    def _answer_held(self) -> None:
        now = time.monotonic()
        still = []
        for identity, claim, expires in self._held:
            reply = self._board.answer(claim, now)
            if reply.status == "pending" and now < expires:
                still.append((identity, claim, expires))
                continue
            self._sock.send_multipart([identity, b"", reply.encode()])
        self._held = still

    def close(self) -> None:
        self._stop.set()
        if self._board is not None:
            self._board._wake()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()


def fetch_handshake(host: str, port: int, rank: int, timeout_s: float = 5.0) -> bytes:
    """One rank's encoded handshake from P's listener; raises ``TimeoutError`` or
    ``ConnectionError`` (with the peer's reason) when there is none."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(_REQUEST + str(rank).encode())
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
    How long a claim may stay pending in all is the caller's to bound."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._submitted: list[tuple[str, str, int, Claim]] = []  # (req id, host, port, claim)
        self._cancelled: set[str] = set()
        self._results: dict[str, ClaimReply | Exception] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcached-pd-claims",
                                        daemon=True)
        self._thread.start()

    def submit(self, req_id: str, host: str, port: int, claim: Claim) -> None:
        with self._lock:
            self._submitted.append((req_id, host, port, claim))
        self._wake()

    def cancel(self, req_id: str) -> None:
        with self._lock:
            self._cancelled.add(req_id)
            self._results.pop(req_id, None)
        self._wake()

    def take(self) -> dict[str, ClaimReply | Exception]:
        """Final replies (ready or gone) and errors since the last call, by request id."""
        with self._lock:
            results, self._results = self._results, {}
        return results

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"!")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sockets: dict[tuple[str, int], Any] = {}
        # (host, port) -> key -> _Asked: one claim on the wire per key at a time
        asked: dict[tuple[str, int], dict[str, _Asked]] = {}
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(50))
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
                for req_id, host, port, claim in submitted:
                    if req_id in cancelled:
                        continue
                    addr = (host, port)
                    if addr not in sockets:
                        sock = ctx.socket(zmq.DEALER)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(f"tcp://{host}:{port}")
                        sockets[addr] = sock
                        poller.register(sock, zmq.POLLIN)
                    by_key = asked.setdefault(addr, {})
                    if claim.key in by_key:
                        by_key[claim.key].req_ids.add(req_id)
                        continue
                    by_key[claim.key] = _Asked(claim, {req_id}, now)
                    sockets[addr].send_multipart([b"", _CLAIM + claim.encode()])
                for addr, sock in sockets.items():
                    if sock in events:
                        self._receive(addr, sock, asked.setdefault(addr, {}))
                self._time_out(asked, time.monotonic())
        finally:
            for sock in sockets.values():
                sock.close(0)

    def _receive(self, addr: tuple[str, int], sock: Any, by_key: dict[str, "_Asked"]) -> None:
        while True:
            try:
                _, data = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except (ValueError, zmq.ZMQError):
                continue
            if data.startswith(b"ERR "):
                # a listener that does not answer claims: every claim to it fails
                error = ConnectionError(f"{addr[0]}:{addr[1]}: "
                                        f"{data[4:].decode(errors='replace')}")
                for key in list(by_key):
                    self._file(by_key.pop(key).req_ids, error)
                continue
            try:
                reply = ClaimReply.decode(data)
            except WireError as exc:
                logger.warning("kvcached-pd: %s:%d: %s", addr[0], addr[1], exc)
                continue
            entry = by_key.get(reply.key)
            if entry is None:
                continue  # cancelled meanwhile
            if reply.status == "pending":
                entry.sent = time.monotonic()
                sock.send_multipart([b"", _CLAIM + entry.claim.encode()])
                continue
            self._file(by_key.pop(reply.key).req_ids, reply)

    def _time_out(self, asked: dict[tuple[str, int], dict[str, "_Asked"]], now: float) -> None:
        limit = self._timeout_s + CLAIM_HOLD_S
        for addr, by_key in asked.items():
            for key in [k for k, e in by_key.items() if now - e.sent > limit]:
                self._file(by_key.pop(key).req_ids, TimeoutError(
                    f"no answer from {addr[0]}:{addr[1]} within {limit:.0f} s"))

    def _file(self, req_ids: set[str], result: ClaimReply | Exception) -> None:
        with self._lock:
            for req_id in req_ids:
                if req_id not in self._cancelled:
                    self._results[req_id] = result

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._wake_r.close()
        self._wake_w.close()


@dataclass
class _Asked:
    claim: Claim
    req_ids: set[str]
    sent: float  # when it last went on the wire
