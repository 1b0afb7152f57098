"""P's handshake listener and D's one-shot fetch (ZMQ over TCP, like vLLM's NIXL).

P's scheduler process owns the listener: vLLM hands it every worker rank's
:class:`~kvcached_pd.connector.wire.RankHandshake` (``set_xfer_handshake_metadata``),
so one port serves all ranks of an engine and the port can go into each request's
params. D's worker asks for one rank and gets that rank's encoded handshake, once per
(peer engine, rank); every later request from that peer reuses it.

Protocol: request ``b"KVPD-HS1 <rank>"``; reply the encoded handshake, or
``b"ERR <reason>"``. No state is kept per client.
"""

from __future__ import annotations

import logging
import threading

import zmq

logger = logging.getLogger("kvcached_pd")

_REQUEST = b"KVPD-HS1 "


class HandshakeListener:
    """Serves encoded rank handshakes on ``host:port`` (port 0: any free port)."""

    def __init__(self, host: str, port: int, handshakes: dict[int, bytes]) -> None:
        self._handshakes = dict(handshakes)
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
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            try:
                identity, _, message = self._sock.recv_multipart()
            except (ValueError, zmq.ZMQError):
                continue
            self._sock.send_multipart([identity, b"", self._answer(message)])

    def _answer(self, message: bytes) -> bytes:
        if not message.startswith(_REQUEST):
            return b"ERR not a kvcached-pd handshake request"
        rank = message[len(_REQUEST):].decode(errors="replace")
        if not rank.isdigit() or int(rank) not in self._handshakes:
            return f"ERR no rank {rank} here (ranks {sorted(self._handshakes)})".encode()
        return self._handshakes[int(rank)]

    def close(self) -> None:
        self._stop.set()
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
