#!/usr/bin/env python3
"""A small prefill/decode proxy for vLLM's NIXL connectors, with per-leg timings.

    client --/v1/completions--> proxy --prefill leg--> P (max_tokens=1, do_remote_decode)
                                      <-- kv_transfer_params --
                                      --decode leg (original request + P's params)--> D
           <--------- D's response + "pd_proxy" timings ----------------------------

Pull mode (NixlConnector) and sequential push mode (NixlPushConnector) use the same
flow: in both, P's response carries the kv_transfer_params D needs (P's engine id,
side-channel host/port, tp/pp sizes, block ids). The proxy sends the same X-Request-Id
on both legs, which push mode needs (P's writer matches D's registration by the request
id stripped of vLLM's per-engine random suffix).

``--push-concurrent`` sends both legs at once, as vLLM's push demo proxy describes:
D is given P's coordinates from the command line, so it can register its blocks while
P is still prefilling. If P fails, the proxy closes D's connection, which makes vLLM
abort D's request instead of waiting for a push that will never come.

Unlike vLLM's toy proxies, this one refuses to forward a decode leg without
kv_transfer_params (D would silently recompute the prompt), and reports per-leg wall
times in response headers (X-PD-Prefill-Seconds, X-PD-Decode-Seconds,
X-PD-Total-Seconds) and, for JSON responses, in a "pd_proxy" field.

A client that goes away aborts the request on both legs: while a leg is upstream, a
watcher notices the client's connection closing and shuts the upstream connection down,
so vLLM (which aborts a request whose HTTP client disconnected) frees it instead of
finishing a prefill or a decode nobody reads, and no decode leg is sent afterwards. The
counts by leg are in /healthz (client_gone_prefill, client_gone_decode).

``--trace``: one line per request on stdout, ``pd_proxy trace {json}``, with the wall-clock
times (``time.time()``, comparable with the instances' ``KVCACHED_PD_TRACE`` lines) at which
the proxy had the client's request (``recv``), had sent P's leg (``p_sent``) and D's
(``d_sent``), read D's first bytes (``d_first``) and had written them to the client
(``out_first``): ``experiments/critical_path.py`` splits the way to P and D's way out
with them.

Standard library only (ThreadingHTTPServer + http.client): nothing to install.

usage: pd_proxy.py --port 19100 --prefill http://127.0.0.1:18100 --decode http://127.0.0.1:18101
"""

from __future__ import annotations

import argparse
import http.client
import json
import select
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Prefill-leg kv_transfer_params: the shape vLLM's own proxies send.
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class ProxyError(Exception):
    def __init__(self, status: int, message: str, leg: str, upstream_body: str | None = None):
        super().__init__(message)
        self.status = status
        self.leg = leg
        self.upstream_body = upstream_body


class ClientGone(Exception):
    """The client closed its connection: the request is abandoned."""


def _shutdown(conn: http.client.HTTPConnection, how: int = socket.SHUT_RDWR) -> None:
    """Send FIN now, whoever else still holds the socket (the response's file object
    keeps the descriptor open after conn.close())."""
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(how)
        except OSError:
            pass


class ClientWatch:
    """Watches one client connection while its request is upstream.

    The client has sent its whole request and only waits, so its socket becoming
    readable with nothing to read (EOF) or an error means it went away. Then every
    upstream connection attached so far is half-closed (FIN, SHUT_WR): vLLM's server
    takes that as a disconnect and aborts the request (uvicorn's is_disconnected() turned
    true ~0.1 s after a half-close, measured), while an answer P had already
    sent can still be read, so its KV is handed to D rather than stranded on P (a full
    shutdown discarded such answers: the fake's staging gauge caught it). Polls every
    20 ms: an abort reaches vLLM within ~20 ms.

    Its thread starts with the first attached leg, after that leg was sent: a thread
    started before it put a GIL hand-off (up to CPython's 5 ms switch interval in a
    proxy with dozens of threads) on every request's way to P.
    """

    POLL_S = 0.02

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.gone = threading.Event()
        self.leg = "prefill"  # which leg was upstream when the client went away
        self.gone_leg: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._upstream: list[http.client.HTTPConnection] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="client-watch")

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                readable, _, _ = select.select([self.sock], [], [], self.POLL_S)
            except (OSError, ValueError):
                return
            if not readable:
                continue
            try:
                data = self.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:  # the client sent more bytes (pipelining): it is still there
                return
            self._cut()
            return

    def _cut(self) -> None:
        with self._lock:
            if self.gone.is_set():
                return
            self.gone_leg = self.leg
            self.gone.set()
            conns = list(self._upstream)
        for conn in conns:
            _shutdown(conn, socket.SHUT_WR)

    def attach(self, conn: http.client.HTTPConnection, leg: str) -> bool:
        """Register a connected upstream connection. Returns False when the client has
        already gone (the connection is then not registered)."""
        with self._lock:
            self.leg = leg
            if self.gone.is_set():
                return False
            self._upstream.append(conn)
            if self._thread.ident is None:
                self._thread.start()
            return True

    def check(self) -> None:
        if self.gone.is_set():
            raise ClientGone(self.gone_leg or self.leg)

    def close(self) -> None:
        self._done.set()


class Backend:
    """An upstream vLLM server; one fresh connection per leg (no stale keep-alive)."""

    def __init__(self, url: str, timeout: float):
        parsed = urllib.parse.urlsplit(url)
        self.url = url.rstrip("/")
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 80
        self.timeout = timeout

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)


def build_prefill_request(request: dict) -> dict:
    body = dict(request)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("min_tokens", None)  # P generates exactly one token
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return body


def push_decode_params(request_id: str, engine_id: str, host: str, port: int,
                       tp_size: int, pp_size: int) -> dict:
    """What D needs in push mode before P has answered (vLLM 0.26 push_scheduler.py:
    update_state_after_alloc reads remote_engine_id/host/port, tp_size, pp_size)."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "pp_size": pp_size,
        "remote_request_id": request_id,
    }


class PDProxy:
    def __init__(self, prefill: str, decode: str, timeout: float = 600.0,
                 push_concurrent: dict | None = None, json_timings: bool = True,
                 trace: bool = False):
        self.prefill = Backend(prefill, timeout)
        self.decode = Backend(decode, timeout)
        self.push_concurrent = push_concurrent
        self.json_timings = json_timings
        self.trace = trace
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "ok": 0, "failed": 0, "client_gone_prefill": 0,
                      "client_gone_decode": 0}

    @property
    def mode(self) -> str:
        return "push-concurrent" if self.push_concurrent else "sequential"

    # ---- legs ------------------------------------------------------------------------
    def run_prefill(self, path: str, request: dict, headers: dict,
                    watch: ClientWatch | None = None, marks: dict | None = None
                    ) -> tuple[dict, float]:
        t0 = time.perf_counter()
        conn = self.send_prefill(path, request, headers, watch, marks)
        return self.finish_prefill(conn, t0, watch)

    def send_prefill(self, path: str, request: dict, headers: dict,
                     watch: ClientWatch | None = None, marks: dict | None = None
                     ) -> http.client.HTTPConnection:
        """Send P's leg from the calling thread (no thread hand-off before P has it)."""
        conn = self.prefill.connect()
        try:
            if watch is not None:
                watch.check()  # gone before P saw anything: nothing to abort
            conn.request("POST", path, json.dumps(build_prefill_request(request)).encode(), headers)
            if marks is not None:
                marks["p_sent"] = time.time()
            # Watched only once P has the request: a cut must never leave it half-sent.
            if watch is not None and not watch.attach(conn, "prefill"):
                _shutdown(conn, socket.SHUT_WR)  # P gets the request and the disconnect
        except (OSError, http.client.HTTPException) as exc:
            _shutdown(conn)
            conn.close()
            if watch is not None:
                watch.check()
            raise ProxyError(502, f"prefill leg: {type(exc).__name__}: {exc}", "prefill") from exc
        except BaseException:
            _shutdown(conn)
            conn.close()
            raise
        return conn

    def finish_prefill(self, conn: http.client.HTTPConnection, t0: float,
                       watch: ClientWatch | None = None) -> tuple[dict, float]:
        """P's answer to a leg :meth:`send_prefill` sent; closes the connection."""
        try:
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            if watch is not None:
                watch.check()
            raise ProxyError(502, f"prefill leg: {type(exc).__name__}: {exc}", "prefill") from exc
        finally:
            _shutdown(conn)
            conn.close()
        seconds = time.perf_counter() - t0
        text = data.decode("utf-8", "replace")
        # A whole answer from P stands even if the client has just left (the decode leg
        # then hands D the request and cuts it); a cut one is the client's doing.
        if resp.status != 200:
            if watch is not None:
                watch.check()
            raise ProxyError(resp.status, f"prefill leg returned HTTP {resp.status}", "prefill",
                             text)
        try:
            return json.loads(text), seconds
        except ValueError as exc:
            if watch is not None:
                watch.check()
            raise ProxyError(502, "prefill leg returned non-JSON", "prefill", text[:2000]) from exc


def _json_error(message: str, leg: str, status: int, upstream_body: str | None,
                timings: dict) -> bytes:
    err = {"error": {"message": message, "type": "pd_proxy_error", "leg": leg,
                     "upstream_status": status, "upstream_body": (upstream_body or "")[:4000]},
           "pd_proxy": timings}
    return json.dumps(err).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kvcached-pd-proxy/1"
    proxy: PDProxy  # set on the subclass by make_server
    watch: ClientWatch | None = None  # the current request's client watcher
    marks: dict | None = None  # --trace: the current request's wall-clock marks

    def log_message(self, fmt, *args):  # quiet access log; errors are logged explicitly
        pass

    # ---- plumbing --------------------------------------------------------------------
    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client went away; nothing left to tell it
            self.close_connection = True

    def _read_json(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw.decode("utf-8") or "{}")

    # ---- routes ----------------------------------------------------------------------
    def do_GET(self):
        if self.path in ("/health", "/healthz"):
            p = self.proxy
            body = {"status": "ok", "mode": p.mode, "prefill": p.prefill.url,
                    "decode": p.decode.url, **p.stats}
            self._send(200, json.dumps(body).encode())
        elif self.path == "/v1/models":
            self._relay_get(self.proxy.decode, self.path)
        else:
            self._send(404, b'{"error":"not found"}')

    def _relay_get(self, backend: Backend, path: str) -> None:
        conn = backend.connect()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            self._send(resp.status, resp.read())
        except (OSError, http.client.HTTPException) as exc:
            self._send(502, json.dumps({"error": str(exc)}).encode())
        finally:
            conn.close()

    def do_POST(self):
        recv = time.time()  # the request line and headers are read: --trace's "recv"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._send(404, b'{"error":"not found"}')
            return
        try:
            request = self._read_json()
        except ValueError:
            self._send(400, b'{"error":"body is not JSON"}')
            return
        p = self.proxy
        with p.lock:
            p.stats["requests"] += 1
        request_id = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        self.marks = {"recv": recv} if p.trace else None
        watch = ClientWatch(self.connection)
        try:
            ok = self._handle_pd(self.path, request, request_id, watch)
        finally:
            watch.close()
        with p.lock:
            p.stats["ok" if ok else "failed"] += 1
            if self.marks is not None:
                print("pd_proxy trace " + json.dumps(
                    {"req": request_id, "ok": ok,
                     **{k: round(v, 6) for k, v in self.marks.items()}}), flush=True)

    def _handle_pd(self, path: str, request: dict, request_id: str,
                   watch: ClientWatch | None = None) -> bool:
        p = self.proxy
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        timings: dict = {"request_id": request_id, "mode": p.mode}
        t0 = time.perf_counter()
        self.watch = watch
        try:
            if p.push_concurrent:
                return self._push_concurrent(path, request, headers, timings, t0)
            prefill_json, prefill_s = p.run_prefill(path, request, headers, watch, self.marks)
            timings["prefill_s"] = round(prefill_s, 6)
            kv_params = prefill_json.get("kv_transfer_params")
            if not kv_params:
                raise ProxyError(502, "prefill returned no kv_transfer_params: refusing to let "
                                 "the decode instance recompute the prompt", "prefill",
                                 json.dumps(prefill_json)[:2000])
            decode_request = dict(request, kv_transfer_params=kv_params)
            return self._decode_leg(path, decode_request, headers, timings, t0)
        except (ClientGone, OSError) as exc:
            # ClientGone: the watcher saw the client leave; OSError: writing to it failed
            leg = (watch.gone_leg if watch is not None and watch.gone_leg else
                   (exc.args[0] if isinstance(exc, ClientGone) and exc.args else "decode"))
            with p.lock:
                p.stats[f"client_gone_{leg}"] += 1
            print(f"pd_proxy: {request_id}: client went away during the {leg} leg: upstream "
                  "connection closed (vLLM aborts the request)", file=sys.stderr, flush=True)
            self.close_connection = True
            return False
        except ProxyError as exc:
            timings["total_s"] = round(time.perf_counter() - t0, 6)
            print(f"pd_proxy: {request_id}: {exc} ({exc.leg})", file=sys.stderr, flush=True)
            self._send(exc.status if exc.status >= 400 else 502,
                       _json_error(str(exc), exc.leg, exc.status, exc.upstream_body, timings),
                       self._timing_headers(timings))
            return False

    def _push_concurrent(self, path, request, headers, timings, t0) -> bool:
        p = self.proxy
        cfg = p.push_concurrent
        decode_request = dict(request, kv_transfer_params=push_decode_params(
            headers["X-Request-Id"], cfg["engine_id"], cfg["host"], cfg["port"],
            cfg["tp_size"], cfg["pp_size"]))
        # Connect to D first, so a failing prefill can always cut the decode leg short.
        decode_conn = p.decode.connect()
        try:
            decode_conn.connect()
        except OSError as exc:
            raise ProxyError(502, f"decode leg: {type(exc).__name__}: {exc}", "decode") from exc
        # Both legs leave from this thread, P's first: P's prefill is the request's
        # critical path, and a thread started before either send cost each request a GIL
        # hand-off (2 x H100, 2026-11-28, 16 requests at a time: the proxy took 4.8-10 ms
        # p50 from having the request to P's leg sent, 2.0-3.6 sequentially). P's answer
        # is read by a thread started once D's leg is sent too.
        t_p = time.perf_counter()
        try:
            prefill_conn = p.send_prefill(path, request, headers, self.watch, self.marks)
        except BaseException:
            _shutdown(decode_conn)
            decode_conn.close()
            raise
        outcome: dict = {}

        def prefill_thread():
            try:
                _, outcome["prefill_s"] = p.finish_prefill(prefill_conn, t_p, self.watch)
            except (ProxyError, ClientGone) as exc:
                outcome["error"] = exc
                try:  # vLLM aborts a request whose client went away
                    decode_conn.sock.shutdown(socket.SHUT_RDWR)
                except (OSError, AttributeError):
                    pass

        th = threading.Thread(target=prefill_thread, daemon=True)
        try:
            return self._decode_leg(path, decode_request, headers, timings, t0,
                                    decode_conn, th, outcome)
        finally:
            if th.ident is None:
                th.start()
            th.join()

    def _decode_leg(self, path, decode_request, headers, timings, t0, conn=None,
                    prefill_thread=None, prefill_outcome=None) -> bool:
        """Send the decode leg and relay its answer. In push-concurrent mode the prefill
        leg runs meanwhile in ``prefill_thread``; its failure wins over D's."""
        p = self.proxy
        stream = bool(decode_request.get("stream"))
        t_dec = time.perf_counter()
        watch = self.watch
        conn = conn or p.decode.connect()

        def start_prefill() -> None:
            if prefill_thread is not None and prefill_thread.ident is None:
                prefill_thread.start()

        def prefill_error() -> ProxyError | None:
            if prefill_thread is None:
                return None
            start_prefill()
            prefill_thread.join()
            return prefill_outcome.get("error")

        try:
            try:
                conn.request("POST", path, json.dumps(decode_request).encode(), headers)
            finally:
                start_prefill()  # push: P's answer is read meanwhile (sent or not, D's leg)
            if self.marks is not None:
                self.marks["d_sent"] = time.time()
            if watch is not None and not watch.attach(conn, "decode"):
                # The client left before D had the request, maybe right after P
                # answered. P then holds the prompt's KV for D; without a decode leg it
                # would keep it until vLLM's abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT,
                # 480 s by default). D gets the request and the disconnect at once: it
                # aborts the request and tells P to free.
                _shutdown(conn, socket.SHUT_WR)
                raise ClientGone("decode")
            resp = conn.getresponse()
            if stream and resp.status == 200:
                err = prefill_error()
                if err is not None:
                    raise err
                if prefill_outcome is not None:
                    timings["prefill_s"] = round(prefill_outcome.get("prefill_s", 0.0), 6)
                return self._relay_stream(resp, timings, t0, t_dec)
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            err = prefill_error()
            if err is not None:
                raise err from exc
            if watch is not None:
                watch.check()
            raise ProxyError(502, f"decode leg: {type(exc).__name__}: {exc}", "decode") from exc
        finally:
            _shutdown(conn)  # also when leaving early (ClientGone): D must see the disconnect
            conn.close()
        timings["decode_s"] = round(time.perf_counter() - t_dec, 6)
        err = prefill_error()
        if err is not None:
            raise err
        if watch is not None:
            watch.check()
        if prefill_outcome is not None:
            timings["prefill_s"] = round(prefill_outcome.get("prefill_s", 0.0), 6)
        timings["total_s"] = round(time.perf_counter() - t0, 6)
        text = data.decode("utf-8", "replace")
        if resp.status != 200:
            raise ProxyError(resp.status, f"decode leg returned HTTP {resp.status}", "decode", text)
        body = data
        if p.json_timings:
            try:
                obj = json.loads(text)
                obj["pd_proxy"] = timings
                body = json.dumps(obj).encode()
            except ValueError:
                pass
        self._send(200, body, self._timing_headers(timings))
        return True

    def _relay_stream(self, resp, timings, t0, t_dec) -> bool:
        """Relay D's server-sent events as they come; the timings go in the headers
        (prefill) and in a final SSE comment line (decode, total)."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", resp.getheader("Content-Type", "text/event-stream"))
            self.send_header("Transfer-Encoding", "chunked")
            for k, v in self._timing_headers(timings).items():
                self.send_header(k, v)
            self.end_headers()
        except OSError as exc:
            raise ClientGone("decode") from exc

        def chunk(data: bytes) -> None:
            try:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            except OSError as exc:  # the client went away: _decode_leg closes D's connection
                raise ClientGone("decode") from exc

        first = None
        while True:
            data = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
            if not data:
                break
            if self.watch is not None:
                self.watch.check()
            if first is None:
                first = time.perf_counter()
                timings["decode_first_byte_s"] = round(first - t_dec, 6)
                if self.marks is not None:
                    self.marks["d_first"] = time.time()
                chunk(data)
                if self.marks is not None:
                    self.marks["out_first"] = time.time()
                continue
            chunk(data)
        if self.watch is not None:
            self.watch.check()  # a cut D connection ends the stream early
        timings["decode_s"] = round(time.perf_counter() - t_dec, 6)
        timings["total_s"] = round(time.perf_counter() - t0, 6)
        if self.proxy.json_timings:
            chunk(f": pd_proxy {json.dumps(timings)}\n\n".encode())
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError as exc:
            raise ClientGone("decode") from exc
        return True

    @staticmethod
    def _timing_headers(timings: dict) -> dict[str, str]:
        names = {"prefill_s": "X-PD-Prefill-Seconds", "decode_s": "X-PD-Decode-Seconds",
                 "total_s": "X-PD-Total-Seconds", "request_id": "X-PD-Request-Id"}
        return {h: str(timings[k]) for k, h in names.items() if k in timings}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a burst of concurrent clients must not be refused
    allow_reuse_address = True


def make_server(host: str, port: int, proxy: PDProxy) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"proxy": proxy})
    return _Server((host, port), handler)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="P's base URL, e.g. http://127.0.0.1:18100")
    ap.add_argument("--decode", required=True, help="D's base URL")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-leg upstream timeout (s)")
    ap.add_argument("--no-json-timings", action="store_true",
                    help="do not add the pd_proxy field to JSON bodies (headers only)")
    ap.add_argument("--push-concurrent", action="store_true",
                    help="NixlPushConnector: send both legs at once; needs P's coordinates")
    ap.add_argument("--prefill-engine-id",
                    help="P's kv-transfer-config engine_id (push-concurrent)")
    ap.add_argument("--prefill-kv-host", default="127.0.0.1",
                    help="P's VLLM_NIXL_SIDE_CHANNEL_HOST (push-concurrent)")
    ap.add_argument("--prefill-side-channel-port", type=int,
                    help="P's VLLM_NIXL_SIDE_CHANNEL_PORT (push-concurrent)")
    ap.add_argument("--trace", action="store_true",
                    help="a line per request on stdout: when each leg was sent, D's first "
                    "bytes read and relayed (wall clock)")
    ap.add_argument("--prefill-tp-size", type=int, default=1)
    ap.add_argument("--prefill-pp-size", type=int, default=1)
    a = ap.parse_args(argv)
    if a.push_concurrent and (not a.prefill_engine_id or a.prefill_side_channel_port is None):
        ap.error("--push-concurrent needs --prefill-engine-id and --prefill-side-channel-port")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    push = None
    if a.push_concurrent:
        push = {"engine_id": a.prefill_engine_id, "host": a.prefill_kv_host,
                "port": a.prefill_side_channel_port, "tp_size": a.prefill_tp_size,
                "pp_size": a.prefill_pp_size}
    proxy = PDProxy(a.prefill, a.decode, a.timeout, push, not a.no_json_timings, a.trace)
    server = make_server(a.host, a.port, proxy)
    print(f"pd_proxy listening on http://{a.host}:{a.port} mode={proxy.mode} "
          f"prefill={a.prefill} decode={a.decode}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
