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
X-PD-Total-Seconds) and, for JSON responses, in a "pd_proxy" field. The response's head
goes to the client once P has answered (a streaming client's "headers" mark the end of
the prefill leg: load_client.py's decode-leg aborts count from it).

A client that goes away aborts the request on both legs: while a leg is upstream, the
proxy reads the client's connection, and its end (EOF) half-closes every upstream
connection of the request (FIN, SHUT_WR), so vLLM (which aborts a request whose HTTP
client disconnected: uvicorn's is_disconnected() turned true ~0.1 s after a half-close,
measured) frees it instead of finishing a prefill or a decode nobody reads, while an
answer P had already sent can still be read, so its KV is handed to D rather than
stranded on P (a full shutdown discarded such answers: the fake's staging gauge caught
it). No decode leg is sent after the client left. The counts by leg are in /healthz
(client_gone_prefill, client_gone_decode).

One thread, one asyncio event loop, every connection non-blocking. Why: on 2 x H100
(2026-11-28, tiny load, 16 requests at a time) the thread-per-connection proxy this
replaces took 4.8-10 ms p50 (push) and 2.0-3.6 ms (sequential) from having a request to
P's leg sent, and 2-8.5 ms from the client's send to having it: every thread it started
or woke (a handler per connection, a watcher per request, push's reader of P's answer)
waited for the GIL of a process running some fifty threads. Here nothing waits for a
thread, a client's end is seen at once (no 20 ms poll), and every socket has TCP_NODELAY
(asyncio's default).

``--trace``: one line per request on stdout, ``pd_proxy trace {json}``, with the wall-clock
times (``time.time()``, comparable with the instances' ``KVCACHED_PD_TRACE`` lines) at which
the proxy had the client's request (``recv``), had sent P's leg (``p_sent``) and D's
(``d_sent``), read D's first bytes (``d_first``) and had written them to the client
(``out_first``): ``experiments/critical_path.py`` splits the way to P and D's way out
with them.

Standard library only (asyncio streams, HTTP/1.1 by hand): nothing to install.

usage: pd_proxy.py --port 19100 --prefill http://127.0.0.1:18100 --decode http://127.0.0.1:18101
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http
import json
import socket
import sys
import threading
import time
import urllib.parse
import uuid

# Prefill-leg kv_transfer_params: the shape vLLM's own proxies send.
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

MAX_HEAD = 1 << 20  # a request's or a response's head, and a chunk-size line
MAX_BODY = 64 << 20  # a client's request body (a prompt of millions of tokens fits)
UPSTREAM_ERRORS = (OSError, EOFError, ValueError, asyncio.IncompleteReadError,
                   asyncio.LimitOverrunError, asyncio.TimeoutError)


class ProxyError(Exception):
    def __init__(self, status: int, message: str, leg: str, upstream_body: str | None = None):
        super().__init__(message)
        self.status = status
        self.leg = leg
        self.upstream_body = upstream_body


class ClientGone(Exception):
    """The client closed its connection: the request is abandoned."""


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


# ---- HTTP/1.1 on asyncio streams --------------------------------------------------------


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _head_bytes(first_line: str, headers: dict[str, str]) -> bytes:
    lines = [first_line] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse_headers(lines: list[bytes]) -> dict[str, str]:
    """Header fields, names lower-cased (the last of a repeated name wins)."""
    out: dict[str, str] = {}
    for raw in lines:
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or not name.strip():
            raise ValueError(f"malformed header line {raw[:80]!r}")
        out[name.strip().lower()] = value.strip()
    return out


def parse_request_head(head: bytes) -> tuple[str, str, bool, dict[str, str], int]:
    """(method, target, keep-alive, headers, body length) of a client's request head (up
    to and with its blank line); ValueError for anything else, which the proxy answers
    with 400 and a closed connection."""
    lines = head[:-4].split(b"\r\n") if head.endswith(b"\r\n\r\n") else None
    if not lines:
        raise ValueError("no request head")
    parts = lines[0].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    headers = _parse_headers(lines[1:])
    length = int(headers.get("content-length") or 0)
    if not 0 <= length <= MAX_BODY:
        raise ValueError(f"Content-Length {length} outside 0..{MAX_BODY}")
    keep_alive = version != "HTTP/1.0" and headers.get("connection", "").lower() != "close"
    return method, target, keep_alive, headers, length


class Upstream:
    """One exchange with an upstream vLLM server on a fresh connection (no stale
    keep-alive). Every read is bounded by the leg's timeout (an idle timer that aborts
    the connection, re-armed by each read, as a blocking socket's timeout would be)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout: float):
        self.reader = reader
        self.writer = writer
        self.timeout = timeout
        self.timed_out = False
        self._timer: asyncio.TimerHandle | None = None
        self.headers: dict[str, str] = {}

    @classmethod
    async def connect(cls, host: str, port: int, timeout: float) -> "Upstream":
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=MAX_HEAD), timeout)
        return cls(reader, writer, timeout)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.timeout, self._expire)

    def _expire(self) -> None:
        self.timed_out = True
        self.writer.transport.abort()

    def send(self, method: str, path: str, body: bytes, headers: dict[str, str],
             host: str) -> None:
        """Queue the whole request on the socket (written at once where it can be)."""
        h = {"Host": host, "Content-Length": str(len(body)), **headers}
        self.writer.write(_head_bytes(f"{method} {path} HTTP/1.1", h) + body)

    async def read_head(self) -> int:
        self._arm()
        try:
            line = await self.reader.readline()
            if not line:
                raise EOFError("connection closed before a response")
            parts = line.decode("latin-1").split(None, 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/"):
                raise ValueError(f"malformed status line {line[:80]!r}")
            status = int(parts[1])
            lines = []
            while True:
                raw = await self.reader.readline()
                if not raw:
                    raise EOFError("connection closed inside the response's head")
                if raw in (b"\r\n", b"\n"):
                    break
                lines.append(raw.rstrip(b"\r\n"))
            self.headers = _parse_headers(lines)
            return status
        finally:
            self._disarm()

    async def chunks(self):
        """The response body as it arrives (chunked, Content-Length or to EOF)."""
        te = self.headers.get("transfer-encoding", "").lower()
        try:
            if "chunked" in te:
                while True:
                    self._arm()
                    size_line = await self.reader.readline()
                    if not size_line:
                        raise EOFError("connection closed inside a chunked body")
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while (await self.reader.readline()) not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return
                    data = await self.reader.readexactly(size)
                    await self.reader.readexactly(2)
                    yield data
            elif "content-length" in self.headers:
                n = int(self.headers["content-length"])
                if n:
                    self._arm()
                    yield await self.reader.readexactly(n)
            else:
                while True:
                    self._arm()
                    data = await self.reader.read(65536)
                    if not data:
                        return
                    yield data
        finally:
            self._disarm()

    async def read_body(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.timed_out:
            raise TimeoutError(f"no answer within {self.timeout:g} s")

    def half_close(self) -> None:
        """FIN (SHUT_WR): vLLM aborts the request; what it already sent stays readable."""
        try:
            if not self.writer.is_closing() and self.writer.can_write_eof():
                self.writer.write_eof()
        except OSError:
            pass

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self.writer.close()
        except OSError:
            pass


class Backend:
    """An upstream vLLM server; one fresh connection per leg."""

    def __init__(self, url: str, timeout: float):
        parsed = urllib.parse.urlsplit(url)
        self.url = url.rstrip("/")
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 80
        self.timeout = timeout

    @property
    def netloc(self) -> str:
        return f"{self.host}:{self.port}"

    async def connect(self) -> Upstream:
        return await Upstream.connect(self.host, self.port, self.timeout)


class ClientWatch:
    """Watches one client connection while its request is upstream.

    The client has sent its whole request and only waits, so its connection ending
    (EOF, or an error) means it went away: every upstream connection attached so far is
    half-closed. Bytes instead (a pipelined next request) end the watch; they are kept
    for the next request's parse. The watch starts with the first attached leg, once
    that leg is sent: before, there is nothing upstream to abort.
    """

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader
        self.gone = False
        self.leg = "prefill"  # which leg was upstream when the client went away
        self.gone_leg: str | None = None
        self.pipelined = b""
        self._upstream: list[Upstream] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        try:
            data = await self.reader.read(1)
        except (OSError, asyncio.IncompleteReadError):
            data = b""
        if data:
            self.pipelined = data
            return
        self.gone = True
        self.gone_leg = self.leg
        for up in self._upstream:
            up.half_close()

    def attach(self, up: Upstream, leg: str) -> bool:
        """Register a sent leg. False when the client has already gone (the leg is then
        not registered)."""
        self.leg = leg
        if self.gone:
            return False
        self._upstream.append(up)
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return True

    def check(self) -> None:
        if self.gone:
            raise ClientGone(self.gone_leg or self.leg)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


class ClientConn:
    """The proxy's side of one client connection: writes answers, notes a write that
    failed (the client went away)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.keep_alive = True

    async def write(self, data: bytes) -> None:
        if self.writer.is_closing():
            raise ConnectionResetError("client connection closed")
        self.writer.write(data)
        await self.writer.drain()

    async def send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
                   content_type: str = "application/json") -> None:
        h = {"Content-Type": content_type, "Content-Length": str(len(body)),
             "Server": "kvcached-pd-proxy/2", **(headers or {})}
        if not self.keep_alive:
            h["Connection"] = "close"
        try:
            await self.write(_head_bytes(f"HTTP/1.1 {status} {_reason(status)}", h) + body)
        except OSError:  # the client went away; nothing left to tell it
            self.keep_alive = False


def _json_error(message: str, leg: str, status: int, upstream_body: str | None,
                timings: dict) -> bytes:
    err = {"error": {"message": message, "type": "pd_proxy_error", "leg": leg,
                     "upstream_status": status, "upstream_body": (upstream_body or "")[:4000]},
           "pd_proxy": timings}
    return json.dumps(err).encode()


def _timing_headers(timings: dict) -> dict[str, str]:
    names = {"prefill_s": "X-PD-Prefill-Seconds", "decode_s": "X-PD-Decode-Seconds",
             "total_s": "X-PD-Total-Seconds", "request_id": "X-PD-Request-Id"}
    return {h: str(timings[k]) for k, h in names.items() if k in timings}


class Exchange:
    """One client request through both legs (what a handler thread did before)."""

    def __init__(self, proxy: "PDProxy", client: ClientConn, path: str, request: dict,
                 request_id: str, watch: ClientWatch, marks: dict | None):
        self.p = proxy
        self.client = client
        self.path = path
        self.request = request
        self.request_id = request_id
        self.watch = watch
        self.marks = marks
        self.headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        self.timings: dict = {"request_id": request_id, "mode": proxy.mode}
        self.t0 = time.perf_counter()

    # ---- the prefill leg -----------------------------------------------------------------
    async def send_prefill(self) -> Upstream:
        """Connect to P and send its leg (nothing else runs before P has it)."""
        try:
            up = await self.p.prefill.connect()
        except UPSTREAM_ERRORS as exc:
            self.watch.check()
            raise ProxyError(502, f"prefill leg: {type(exc).__name__}: {exc}", "prefill") from exc
        try:
            self.watch.check()  # gone before P saw anything: nothing to abort
            up.send("POST", self.path, json.dumps(build_prefill_request(self.request)).encode(),
                    self.headers, self.p.prefill.netloc)
        except BaseException:
            up.close()
            raise
        if self.marks is not None:
            self.marks["p_sent"] = time.time()
        # Watched only once P has the request: a cut must never leave it half-sent.
        if not self.watch.attach(up, "prefill"):
            up.half_close()  # P gets the request and the disconnect
        return up

    async def finish_prefill(self, up: Upstream, t0: float) -> tuple[dict, float]:
        """P's answer to a leg :meth:`send_prefill` sent; closes the connection."""
        try:
            status = await up.read_head()
            data = await up.read_body()
        except UPSTREAM_ERRORS as exc:
            self.watch.check()
            raise ProxyError(502, f"prefill leg: {type(exc).__name__}: {exc}", "prefill") from exc
        finally:
            up.close()
        seconds = time.perf_counter() - t0
        text = data.decode("utf-8", "replace")
        # A whole answer from P stands even if the client has just left (the decode leg
        # then hands D the request and cuts it); a cut one is the client's doing.
        if status != 200:
            self.watch.check()
            raise ProxyError(status, f"prefill leg returned HTTP {status}", "prefill", text)
        try:
            return json.loads(text), seconds
        except ValueError as exc:
            self.watch.check()
            raise ProxyError(502, "prefill leg returned non-JSON", "prefill", text[:2000]) from exc

    # ---- the whole request ---------------------------------------------------------------
    async def run(self) -> bool:
        p = self.p
        try:
            if p.push_concurrent:
                return await self._push_concurrent()
            t_p = time.perf_counter()
            prefill_json, prefill_s = await self.finish_prefill(await self.send_prefill(), t_p)
            self.timings["prefill_s"] = round(prefill_s, 6)
            kv_params = prefill_json.get("kv_transfer_params")
            if not kv_params:
                raise ProxyError(502, "prefill returned no kv_transfer_params: refusing to let "
                                 "the decode instance recompute the prompt", "prefill",
                                 json.dumps(prefill_json)[:2000])
            return await self._decode_leg(dict(self.request, kv_transfer_params=kv_params))
        except (ClientGone, OSError) as exc:
            # ClientGone: the client's connection ended; OSError: writing to it failed
            w = self.watch
            leg = (w.gone_leg if w.gone_leg else
                   (exc.args[0] if isinstance(exc, ClientGone) and exc.args else "decode"))
            p.stats[f"client_gone_{leg}"] += 1
            print(f"pd_proxy: {self.request_id}: client went away during the {leg} leg: "
                  "upstream connection closed (vLLM aborts the request)", file=sys.stderr,
                  flush=True)
            self.client.keep_alive = False
            return False
        except ProxyError as exc:
            self.timings["total_s"] = round(time.perf_counter() - self.t0, 6)
            print(f"pd_proxy: {self.request_id}: {exc} ({exc.leg})", file=sys.stderr, flush=True)
            await self.client.send(exc.status if exc.status >= 400 else 502,
                                   _json_error(str(exc), exc.leg, exc.status, exc.upstream_body,
                                               self.timings), _timing_headers(self.timings))
            return False

    async def _push_concurrent(self) -> bool:
        cfg = self.p.push_concurrent
        decode_request = dict(self.request, kv_transfer_params=push_decode_params(
            self.request_id, cfg["engine_id"], cfg["host"], cfg["port"], cfg["tp_size"],
            cfg["pp_size"]))
        # Connect to D first, so a failing prefill can always cut the decode leg short.
        try:
            d_up = await self.p.decode.connect()
        except UPSTREAM_ERRORS as exc:
            raise ProxyError(502, f"decode leg: {type(exc).__name__}: {exc}", "decode") from exc
        t_p = time.perf_counter()
        try:
            p_up = await self.send_prefill()  # P's first: P's prefill is the critical path
        except BaseException:
            d_up.close()
            raise
        outcome: dict = {}

        async def prefill() -> None:
            try:
                _, outcome["prefill_s"] = await self.finish_prefill(p_up, t_p)
            except (ProxyError, ClientGone) as exc:
                outcome["error"] = exc
                d_up.close()  # vLLM aborts a request whose client went away

        task: list[asyncio.Task] = []

        def start() -> None:  # P's answer is read once D's leg is sent (or failed to be)
            if not task:
                task.append(asyncio.ensure_future(prefill()))

        try:
            return await self._decode_leg(decode_request, d_up, start, outcome, task)
        finally:
            start()
            await task[0]

    # ---- the decode leg ------------------------------------------------------------------
    async def _decode_leg(self, decode_request: dict, up: Upstream | None = None,
                          start_prefill=None, outcome: dict | None = None,
                          task: list | None = None) -> bool:
        """Send the decode leg and relay its answer. In push-concurrent mode P's answer
        is read meanwhile; its failure wins over D's."""
        p = self.p
        stream = bool(decode_request.get("stream"))
        t_dec = time.perf_counter()
        watch = self.watch

        async def prefill_error() -> Exception | None:
            if start_prefill is None:
                return None
            start_prefill()
            await task[0]
            return outcome.get("error")

        try:
            try:
                if up is None:
                    up = await p.decode.connect()
                up.send("POST", self.path, json.dumps(decode_request).encode(), self.headers,
                        p.decode.netloc)
            finally:
                if start_prefill is not None:
                    start_prefill()
            if self.marks is not None:
                self.marks["d_sent"] = time.time()
            if not watch.attach(up, "decode"):
                # The client left before D had the request, maybe right after P
                # answered. P then holds the prompt's KV for D; without a decode leg it
                # would keep it until vLLM's abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT,
                # 480 s by default). D gets the request and the disconnect at once: it
                # aborts the request and tells P to free.
                up.half_close()
                raise ClientGone("decode")
            status = await up.read_head()
            if stream and status == 200:
                err = await prefill_error()
                if err is not None:
                    raise err
                if outcome is not None:
                    self.timings["prefill_s"] = round(outcome.get("prefill_s", 0.0), 6)
                return await self._relay_stream(up, t_dec)
            data = await up.read_body()
        except UPSTREAM_ERRORS as exc:
            err = await prefill_error()
            if err is not None:
                raise err from exc
            watch.check()
            raise ProxyError(502, f"decode leg: {type(exc).__name__}: {exc}", "decode") from exc
        finally:
            if up is not None:
                up.close()  # also when leaving early (ClientGone): D must see the disconnect
        self.timings["decode_s"] = round(time.perf_counter() - t_dec, 6)
        err = await prefill_error()
        if err is not None:
            raise err
        watch.check()
        if outcome is not None:
            self.timings["prefill_s"] = round(outcome.get("prefill_s", 0.0), 6)
        self.timings["total_s"] = round(time.perf_counter() - self.t0, 6)
        text = data.decode("utf-8", "replace")
        if status != 200:
            raise ProxyError(status, f"decode leg returned HTTP {status}", "decode", text)
        body = data
        if p.json_timings:
            try:
                obj = json.loads(text)
                obj["pd_proxy"] = self.timings
                body = json.dumps(obj).encode()
            except ValueError:
                pass
        await self.client.send(200, body, _timing_headers(self.timings))
        return True

    async def _relay_stream(self, up: Upstream, t_dec: float) -> bool:
        """Relay D's server-sent events as they come; the timings go in the headers
        (prefill) and in a final SSE comment line (decode, total)."""
        client = self.client
        h = {"Content-Type": up.headers.get("content-type", "text/event-stream"),
             "Transfer-Encoding": "chunked", "Server": "kvcached-pd-proxy/2",
             **_timing_headers(self.timings)}

        async def out(data: bytes) -> None:
            try:
                await client.write(data)
            except OSError as exc:  # the client went away: _decode_leg closes D's connection
                raise ClientGone("decode") from exc

        def chunk(data: bytes) -> bytes:
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        await out(_head_bytes("HTTP/1.1 200 OK", h))
        first = True
        async with contextlib.aclosing(up.chunks()) as body:  # closed when leaving early
            async for data in body:
                self.watch.check()
                if first:
                    first = False
                    self.timings["decode_first_byte_s"] = round(time.perf_counter() - t_dec, 6)
                    if self.marks is not None:
                        self.marks["d_first"] = time.time()
                    await out(chunk(data))
                    if self.marks is not None:
                        self.marks["out_first"] = time.time()
                    continue
                await out(chunk(data))
        self.watch.check()  # a cut D connection ends the stream early
        self.timings["decode_s"] = round(time.perf_counter() - t_dec, 6)
        self.timings["total_s"] = round(time.perf_counter() - self.t0, 6)
        tail = chunk(f": pd_proxy {json.dumps(self.timings)}\n\n".encode()) \
            if self.p.json_timings else b""
        await out(tail + b"0\r\n\r\n")
        return True


class PDProxy:
    def __init__(self, prefill: str, decode: str, timeout: float = 600.0,
                 push_concurrent: dict | None = None, json_timings: bool = True,
                 trace: bool = False):
        self.prefill = Backend(prefill, timeout)
        self.decode = Backend(decode, timeout)
        self.push_concurrent = push_concurrent
        self.json_timings = json_timings
        self.trace = trace
        # only the loop's thread writes them; a reader in another thread sees whole ints
        self.stats = {"requests": 0, "ok": 0, "failed": 0, "client_gone_prefill": 0,
                      "client_gone_decode": 0}

    @property
    def mode(self) -> str:
        return "push-concurrent" if self.push_concurrent else "sequential"

    # ---- one client connection -----------------------------------------------------------
    async def serve_client(self, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        client = ClientConn(reader, writer)
        leftover = b""
        try:
            while client.keep_alive:
                try:
                    head = leftover + await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                    return
                leftover = b""
                recv = time.time()  # the request line and headers are read: --trace's "recv"
                try:
                    method, target, keep_alive, headers, length = parse_request_head(head)
                except ValueError as exc:
                    client.keep_alive = False
                    await client.send(400, json.dumps({"error": f"malformed request: {exc}"})
                                      .encode())
                    return
                client.keep_alive = keep_alive
                try:
                    raw = await reader.readexactly(length) if length else b""
                except (asyncio.IncompleteReadError, OSError):
                    return
                leftover = await self._dispatch(client, method, target, headers, raw, recv)
        finally:
            try:
                writer.close()
            except OSError:
                pass

    async def _dispatch(self, client: ClientConn, method: str, path: str,
                        headers: dict[str, str], raw: bytes, recv: float) -> bytes:
        """Answer one request; returns the bytes of a pipelined next request read while
        watching the client."""
        if method == "GET":
            if path in ("/health", "/healthz"):
                body = {"status": "ok", "mode": self.mode, "prefill": self.prefill.url,
                        "decode": self.decode.url, **self.stats}
                await client.send(200, json.dumps(body).encode())
            elif path == "/v1/models":
                await self._relay_get(client, self.decode, path)
            else:
                await client.send(404, b'{"error":"not found"}')
            return b""
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await client.send(404, b'{"error":"not found"}')
            return b""
        try:
            request = json.loads(raw.decode("utf-8") or "{}")
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError:
            await client.send(400, b'{"error":"body is not JSON"}')
            return b""
        self.stats["requests"] += 1
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        marks = {"recv": recv} if self.trace else None
        watch = ClientWatch(client.reader)
        try:
            ok = await Exchange(self, client, path, request, request_id, watch, marks).run()
        finally:
            await watch.close()
        self.stats["ok" if ok else "failed"] += 1
        if marks is not None:
            print("pd_proxy trace " + json.dumps(
                {"req": request_id, "ok": ok, **{k: round(v, 6) for k, v in marks.items()}}),
                flush=True)
        return watch.pipelined

    async def _relay_get(self, client: ClientConn, backend: Backend, path: str) -> None:
        up = None
        try:
            up = await backend.connect()
            up.send("GET", path, b"", {}, backend.netloc)
            status = await up.read_head()
            await client.send(status, await up.read_body())
        except UPSTREAM_ERRORS as exc:
            await client.send(502, json.dumps({"error": str(exc)}).encode())
        finally:
            if up is not None:
                up.close()


class ProxyServer:
    """The listening socket (bound at construction, so a client may connect before the
    loop runs: the kernel queues it) and the event loop that serves it, in the thread
    that calls :meth:`serve_forever`; :meth:`shutdown` from any other thread stops it
    (the interface of socketserver's servers, which the tests and main use)."""

    def __init__(self, host: str, port: int, proxy: PDProxy):
        self.proxy = proxy
        self.socket = socket.create_server((host, port), backlog=256, reuse_port=False)
        self.server_address = self.socket.getsockname()[:2]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._shutdown_asked = False

    def serve_forever(self, poll_interval: float = 0.5) -> None:  # noqa: ARG002 (API)
        try:
            asyncio.run(self._main())
        finally:
            self._done.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = self._loop.create_future()
        server = await asyncio.start_server(self.proxy.serve_client, sock=self.socket,
                                            limit=MAX_HEAD)
        self._ready.set()
        if self._shutdown_asked:
            self._stop.set_result(None)
        async with server:
            await self._stop
        # requests in flight are cancelled by asyncio.run's teardown

    def shutdown(self) -> None:
        self._shutdown_asked = True
        if self._ready.wait(timeout=30) and self._loop is not None:
            def stop() -> None:
                if self._stop is not None and not self._stop.done():
                    self._stop.set_result(None)
            try:
                self._loop.call_soon_threadsafe(stop)
            except RuntimeError:  # the loop has already ended
                pass
            self._done.wait(timeout=30)

    def server_close(self) -> None:
        try:
            self.socket.close()
        except OSError:
            pass


def make_server(host: str, port: int, proxy: PDProxy) -> ProxyServer:
    return ProxyServer(host, port, proxy)


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
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
