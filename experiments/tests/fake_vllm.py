#!/usr/bin/env python3
"""A CPU-only stand-in for `vllm serve`, just real enough to test the harness offline.

It accepts `vllm serve`'s command line (MODEL --port N --kv-transfer-config JSON ...,
everything else ignored) and emulates what the harness relies on:
- GET /health (after FAKE_VLLM_START_DELAY seconds);
- POST /v1/completions, greedy and deterministic: the "KV cache" of a prompt is its
  token list (BOS + one token per byte), each generated token is a hash of the tokens
  before it, so a corrupted KV changes the output;
- PD: a prefill request (kv_transfer_params.do_remote_decode) keeps its KV and answers
  with kv_transfer_params pointing at its side channel (VLLM_NIXL_SIDE_CHANNEL_PORT, a
  tiny HTTP server here); a decode request (do_remote_prefill) fetches the KV from there;
- Prometheus /metrics with the vLLM 0.26 names the harness reads;
- a "Registering KV_Caches" ... "Created N blocks for src engine" log sequence.

Failure knobs (environment): FAKE_VLLM_EXIT_AT_START=1 (die while starting),
FAKE_VLLM_PD_ALWAYS=1 (log "kvcached-pd: applied" even with KVCACHED_PD=0),
FAKE_VLLM_SINGLE_SKEW=1 (the no-PD instance flips its 21st output token),
FAKE_VLLM_KVCACHED_SINGLE_SKEW=1 (a no-PD instance with kvcached on flips its first),
FAKE_VLLM_DIE_AFTER=N (a decode instance exits on its N+1-th request),
FAKE_VLLM_RECOMPUTE=1 (decode ignores the transferred KV and recomputes; the external
prefix cache counters then stay at zero), KVCACHED_PD_TEST_CORRUPT=1 (decode flips one
transferred token, like the real negative control), FAKE_VLLM_NO_KV_PARAMS=1 (prefill
returns no kv_transfer_params), FAKE_VLLM_CORRUPT_DECODE=1 (like the negative control, but
on every decode instance whatever its mode).

Load and aborts (pd_load.py): FAKE_VLLM_PREFILL_MS_PER_KTOK=M (a prefill leg takes M ms
per 1000 prompt tokens), FAKE_VLLM_TOKEN_MS=T (a streamed token every T ms). A client that
disconnects meanwhile aborts the request (vllm:request_success_total{finished_reason=
"abort"}), as vLLM does. Staged instances (KVCACHED_PD=1, KVCACHED_PD_TRANSPORT=staged)
export kvcached-pd's staging gauges: P holds a prompt's bytes from its prefill until D
fetched them (or VLLM_NIXL_ABORT_REQUEST_TIMEOUT passed), D while it fetches;
FAKE_VLLM_STAGING_LEAK=1 makes P never release. The fallback counter is exported (always
0); the staging-wait counter is not (to exercise "absent").

The staged wire (kvcached-pd's KVCACHED_PD_WIRE=auto|nixl|ipc on D): a staged D logs once
per peer "kvcached-pd: staged peer ENGINE rank 0: ... wire ipc|nixl"; auto resolves to
FAKE_VLLM_AUTO_WIRE (default nixl, a peer on another host); on the IPC wire no NIXL READ is
counted. FAKE_VLLM_IPC_FAILS=1: opening the peer's staging fails, the peer falls back to
NIXL and vllm:kvcached_pd_wire_fallbacks_total counts it; FAKE_VLLM_NO_WIRE_COUNTER=1: that
counter is not exported.

UCX fault injection, emulated: with UCX_FAULT_ENABLED=1 and an LD_PRELOAD naming
"fake_ucx_fault", the instance logs the injector's start line and a decode instance fails
the KV fetches that UCX_FAULT_PATTERN marks X (a failed transfer: the request fails,
vllm:nixl_num_failed_transfers grows, the server lives on).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 32000


def tokenize(text: str) -> list[int]:
    return [1] + [4 + b for b in text.encode("utf-8")]


def next_token(seq: list[int]) -> int:
    digest = hashlib.sha256(json.dumps(seq[-64:] + [len(seq)]).encode()).digest()
    return 4 + int.from_bytes(digest[:4], "little") % (VOCAB - 4)


def generate(kv: list[int], max_tokens: int) -> list[int]:
    seq, out = list(kv), []
    for _ in range(max_tokens):
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
    return out


def fetch_kv(url: str, wait_s: float) -> list[int]:
    """Pull mode: the KV must be there. Push mode (no remote_block_ids yet): wait for P."""
    import urllib.error
    import urllib.request
    t_end = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.loads(r.read())["kv"]
        except urllib.error.HTTPError as exc:
            if exc.code != 404 or time.monotonic() > t_end:
                raise
            time.sleep(0.02)


class State:
    def __init__(self, args, kv_config):
        self.args = args
        self.kv_config = kv_config or {}
        self.engine_id = self.kv_config.get("engine_id", f"fake-{os.getpid()}")
        self.side_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
        self.store: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.c = {"ext_hits": 0, "ext_queries": 0, "local": 0, "external": 0,
                  "queue_sum": 0.0, "queue_count": 0, "xfer_sum": 0.0, "xfer_count": 0,
                  "bytes_sum": 0.0, "descs_sum": 0.0, "success": 0,
                  "pack_sum": 0.0, "pack_count": 0, "unpack_sum": 0.0, "unpack_count": 0,
                  "handoff_sum": 0.0}
        # kvcached-pd's staged transport (what its connector adds to a real instance; the
        # staged READ is counted in vLLM's NIXL series here, where the connector's own
        # agent counts it in kvcached_pd_read_seconds: bench_transfer reads either)
        self.staged = (os.environ.get("KVCACHED_PD") == "1"
                       and os.environ.get("KVCACHED_PD_TRANSPORT") == "staged")
        self.counter = 0
        self.aborts = 0
        self.fetches = 0
        self.failed_xfers = 0
        self.fault_pattern = os.environ.get("UCX_FAULT_PATTERN", "") if (
            os.environ.get("UCX_FAULT_ENABLED") == "1"
            and "fake_ucx_fault" in os.environ.get("LD_PRELOAD", "")) else ""
        self.held: dict[str, tuple[int, float]] = {}  # P: rid -> (staged bytes, since)
        self.alias: dict[str, str] = {}  # P: the proxy's X-Request-Id -> rid (push)
        self.d_staging = 0  # D: bytes of fetches in flight
        self.abort_timeout = float(os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480"))
        self.peer_wires: dict[str, str] = {}  # D: peer engine -> the wire serving it
        self.wire_fallbacks = 0

    def wire_for(self, peer: str) -> str:
        """D's wire for a staged peer, chosen (and logged) once per peer."""
        with self.lock:
            if peer in self.peer_wires:
                return self.peer_wires[peer]
            wire = os.environ.get("KVCACHED_PD_WIRE", "auto")
            if wire == "auto":
                wire = os.environ.get("FAKE_VLLM_AUTO_WIRE", "nixl")
            if wire == "ipc" and os.environ.get("FAKE_VLLM_IPC_FAILS"):
                wire = "nixl"
                self.wire_fallbacks += 1
            self.peer_wires[peer] = wire
        print(f"INFO kvcached-pd: staged peer {peer} rank 0: 2048 MiB staging, wire version 2, "
              f"wire {wire}", flush=True)
        return wire

    def release(self, rid: str) -> None:
        if os.environ.get("FAKE_VLLM_STAGING_LEAK"):
            return
        with self.lock:
            self.held.pop(self.alias.get(rid, rid), None)

    def expire(self) -> None:
        """vLLM frees what no D asked for within the abort timeout."""
        now = time.monotonic()
        with self.lock:
            for rid in [r for r, (_, t) in self.held.items() if now - t > self.abort_timeout]:
                if not os.environ.get("FAKE_VLLM_STAGING_LEAK"):
                    del self.held[rid]


def client_gone(sock: socket.socket) -> bool:
    """The client closed its connection (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def metrics_text(st: State) -> str:
    c = st.c
    lbl = f'engine="0",model_name="{st.args.model}"'
    lines = [
        "# HELP vllm:external_prefix_cache_hits_total fake",
        f"vllm:external_prefix_cache_hits_total{{{lbl}}} {c['ext_hits']}",
        f"vllm:external_prefix_cache_queries_total{{{lbl}}} {c['ext_queries']}",
        f'vllm:prompt_tokens_by_source_total{{{lbl},source="local_compute"}} {c["local"]}',
        f'vllm:prompt_tokens_by_source_total{{{lbl},source="local_cache_hit"}} 0.0',
        f'vllm:prompt_tokens_by_source_total{{{lbl},source="external_kv_transfer"}} '
        f'{c["external"]}',
        f"vllm:request_queue_time_seconds_sum{{{lbl}}} {c['queue_sum']}",
        f"vllm:request_queue_time_seconds_count{{{lbl}}} {c['queue_count']}",
        f'vllm:request_success_total{{{lbl},finished_reason="length"}} {c["success"]}',
        f'vllm:request_success_total{{{lbl},finished_reason="abort"}} {st.aborts}',
    ]
    if st.kv_config:
        lines += [
            f"vllm:nixl_xfer_time_seconds_sum{{{lbl}}} {c['xfer_sum']}",
            f"vllm:nixl_xfer_time_seconds_count{{{lbl}}} {c['xfer_count']}",
            f"vllm:nixl_bytes_transferred_sum{{{lbl}}} {c['bytes_sum']}",
            f"vllm:nixl_num_descriptors_sum{{{lbl}}} {c['descs_sum']}",
            f"vllm:nixl_num_failed_transfers_total{{{lbl}}} {float(st.failed_xfers)}",
        ]
    if st.kv_config and st.staged:
        lines += [
            f"vllm:kvcached_pd_pack_seconds_sum{{{lbl}}} {c['pack_sum']}",
            f"vllm:kvcached_pd_pack_seconds_count{{{lbl}}} {c['pack_count']}",
            f"vllm:kvcached_pd_unpack_seconds_sum{{{lbl}}} {c['unpack_sum']}",
            f"vllm:kvcached_pd_unpack_seconds_count{{{lbl}}} {c['unpack_count']}",
            f"vllm:kvcached_pd_handoff_seconds_sum{{{lbl}}} {c['handoff_sum']}",
            f"vllm:kvcached_pd_direct_fallbacks_total{{{lbl}}} 0.0",
            f"vllm:kvcached_pd_graph_fallbacks_total{{{lbl}}} 0.0",
        ]
        if not os.environ.get("FAKE_VLLM_NO_WIRE_COUNTER"):
            lines.append(f"vllm:kvcached_pd_wire_fallbacks_total{{{lbl}}} "
                         f"{float(st.wire_fallbacks)}")
        st.expire()
        with st.lock:
            if st.kv_config.get("kv_role") == "kv_producer":
                held = sum(b for b, _ in st.held.values())
                lines.append(f"vllm:kvcached_pd_prefill_staging_bytes{{{lbl}}} {float(held)}")
            else:
                lines.append(f"vllm:kvcached_pd_decode_staging_bytes{{{lbl}}} "
                             f"{float(st.d_staging)}")
    return "\n".join(lines) + "\n"


def make_handler(st: State):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code, obj, ctype="application/json"):
            body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                self._send(200, metrics_text(st).encode(), "text/plain")
            elif self.path.startswith("/kv/"):  # the fake "side channel": KV by request id
                rid = self.path[4:]
                with st.lock:
                    kv = st.store.get(rid)
                if kv is not None:
                    st.release(rid)  # D has the bytes: P's extent is free
                self._send(200 if kv is not None else 404, {"kv": kv})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            die_after = os.environ.get("FAKE_VLLM_DIE_AFTER")
            if die_after and st.kv_config and st.kv_config.get("kv_role") == "kv_consumer" \
                    and st.counter >= int(die_after):
                print("fake: simulated crash while serving", flush=True)
                os._exit(9)
            t_arrival = time.time()
            prompt_ids = tokenize(req["prompt"])
            if len(prompt_ids) + req.get("max_tokens", 16) > st.args.max_model_len:
                self._send(400, {"error": "too long"})
                return
            kvp = req.get("kv_transfer_params") or {}
            max_tokens = int(req.get("max_tokens", 16))
            with st.lock:
                st.counter += 1
                rid = f"cmpl-{self.headers.get('X-Request-Id', st.counter)}-0-{os.getpid():08x}"
            kv = prompt_ids
            if kvp.get("do_remote_decode"):
                ms_per_ktok = float(os.environ.get("FAKE_VLLM_PREFILL_MS_PER_KTOK", "0"))
                t_end = time.monotonic() + ms_per_ktok * len(prompt_ids) / 1e6
                while time.monotonic() < t_end:
                    if client_gone(self.connection):  # vLLM aborts a disconnected request
                        with st.lock:
                            st.aborts += 1
                        self.close_connection = True
                        return
                    time.sleep(0.002)
            if kvp.get("do_remote_prefill") and not os.environ.get("FAKE_VLLM_RECOMPUTE"):
                t0 = time.perf_counter()
                url = f"http://{kvp['remote_host']}:{kvp['remote_port']}/kv/{kvp['remote_request_id']}"
                nbytes = len(prompt_ids) * 32768 if st.staged else 0
                with st.lock:
                    st.d_staging += nbytes
                with st.lock:
                    st.fetches += 1
                    fault = bool(st.fault_pattern) and \
                        st.fault_pattern[(st.fetches - 1) % len(st.fault_pattern)] == "X"
                    if fault:
                        st.failed_xfers += 1
                        st.d_staging -= nbytes
                if fault:
                    print("[FAULT] INJECTED: ucp_get_nbx (fake)", flush=True)
                    self._send(500, {"error": "KV load failed: injected UCX fault"})
                    return
                try:
                    kv = fetch_kv(url, wait_s=10.0 if "remote_block_ids" not in kvp else 0.0)
                except Exception as exc:  # kv_load_failure_policy=fail
                    self._send(500, {"error": f"KV load failed: {exc}"})
                    return
                finally:
                    with st.lock:
                        st.d_staging -= nbytes
                xfer = time.perf_counter() - t0
                ipc = st.staged and "kvcached_pd" in kvp and \
                    st.wire_for(kvp.get("remote_engine_id", "?")) == "ipc"
                if os.environ.get("KVCACHED_PD_TEST_CORRUPT") == "1" or \
                        os.environ.get("FAKE_VLLM_CORRUPT_DECODE") == "1":
                    kv = list(kv)
                    kv[len(kv) // 2] ^= 0x1
                    print("WARNING kvcached-pd TEST: corrupted block 0 of 8 layers", flush=True)
                with st.lock:
                    st.c["ext_hits"] += len(prompt_ids)
                    st.c["ext_queries"] += len(prompt_ids)
                    st.c["external"] += len(prompt_ids)
                    if not ipc:  # the IPC wire reads P's staging in place: no NIXL READ
                        st.c["xfer_sum"] += xfer
                        st.c["xfer_count"] += 1
                        st.c["bytes_sum"] += len(prompt_ids) * 32768
                        st.c["descs_sum"] += 2 * (len(prompt_ids) + 15) // 16
                    st.c["queue_sum"] += time.time() - t_arrival
                    st.c["queue_count"] += 1
                    if st.staged and "kvcached_pd" in kvp:
                        st.c["unpack_sum"] += 0.0005
                        st.c["unpack_count"] += 1
                        st.c["handoff_sum"] += xfer + 0.001
            else:
                with st.lock:
                    st.c["local"] += len(prompt_ids)
                    st.c["queue_sum"] += 0.0001
                    st.c["queue_count"] += 1
            if kvp.get("do_remote_decode"):
                max_tokens = 1
            out = generate(kv, max_tokens)
            if os.environ.get("FAKE_VLLM_SINGLE_SKEW") and not st.kv_config and len(out) > 20:
                out[20] += 1  # a late one-token flip on the no-PD instance (numerics-like)
            if (os.environ.get("FAKE_VLLM_KVCACHED_SINGLE_SKEW") and not st.kv_config
                    and os.environ.get("ENABLE_KVCACHED") == "true" and out):
                out[0] += 1  # the no-PD kvcached instance answers wrongly
            body = {
                "id": rid, "object": "text_completion", "model": st.args.model,
                "choices": [{"index": 0, "text": "".join(chr(32 + t % 90) for t in out),
                             "finish_reason": "length",
                             "token_ids": out if req.get("return_token_ids") else None}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out),
                          "total_tokens": len(prompt_ids) + len(out)},
            }
            if kvp.get("do_remote_decode") and not os.environ.get("FAKE_VLLM_NO_KV_PARAMS"):
                xrid = self.headers.get("X-Request-Id", rid)
                with st.lock:  # by our id (pull) and by the proxy's X-Request-Id (push)
                    st.store[rid] = prompt_ids
                    st.store[xrid] = prompt_ids
                    if st.staged:
                        st.held[rid] = (len(prompt_ids) * 32768, time.monotonic())
                        st.alias[xrid] = rid
                body["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_block_ids": [list(range((len(prompt_ids) + 15) // 16))],
                    "remote_engine_id": st.engine_id, "remote_request_id": rid,
                    "remote_host": "127.0.0.1", "remote_port": st.side_port,
                    "tp_size": 1}
                if st.staged:
                    body["kv_transfer_params"]["kvcached_pd"] = {
                        "offset": 0, "nbytes": len(prompt_ids) * 32768}
                    with st.lock:
                        st.c["pack_sum"] += 0.00025
                        st.c["pack_count"] += 1
            if req.get("stream"):
                if self._stream(body, out, req):
                    with st.lock:
                        st.c["success"] += 1
                else:
                    with st.lock:
                        st.aborts += 1
            else:
                with st.lock:
                    st.c["success"] += 1
                self._send(200, body)

        def _stream(self, body, out, req) -> bool:
            """Stream the tokens (one every FAKE_VLLM_TOKEN_MS); False when the client
            went away first (an abort)."""
            token_s = float(os.environ.get("FAKE_VLLM_TOKEN_MS", "0")) / 1000
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = []
            for tok in out:
                events.append({"id": body["id"], "object": "text_completion",
                               "choices": [{"index": 0, "text": chr(32 + tok % 90),
                                            "token_ids": [tok], "finish_reason": None}]})
            events[-1]["choices"][0]["finish_reason"] = "length"
            if (req.get("stream_options") or {}).get("include_usage"):
                events.append({"id": body["id"], "object": "text_completion", "choices": [],
                               "usage": body["usage"]})
            try:
                for ev in events:
                    if token_s:
                        time.sleep(token_s)
                        if client_gone(self.connection):
                            self.close_connection = True
                            return False
                    data = f"data: {json.dumps(ev)}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                data = b"data: [DONE]\n\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
            except OSError:
                self.close_connection = True
                return False
            return True

    return H


def main():
    ap = argparse.ArgumentParser()
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.argv.pop(1)
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-transfer-config", default=None)
    args, _unknown = ap.parse_known_args()
    print(f"fake vllm serve {args.model} port={args.port} pid={os.getpid()}", flush=True)
    if os.environ.get("UCX_FAULT_ENABLED") == "1" and \
            "fake_ucx_fault" in os.environ.get("LD_PRELOAD", ""):
        print("INFO UCX fault injector loaded (fake)", flush=True)
    if os.environ.get("FAKE_VLLM_EXIT_AT_START"):
        print("fake: simulated crash during startup", flush=True)
        sys.exit(3)
    if os.environ.get("KVCACHED_PD") == "1" or os.environ.get("FAKE_VLLM_PD_ALWAYS"):
        print("INFO kvcached-pd: applied nixl_layout (fake)", flush=True)
    kv_config = json.loads(args.kv_transfer_config) if args.kv_transfer_config else None
    st = State(args, kv_config)
    time.sleep(float(os.environ.get("FAKE_VLLM_START_DELAY", "0.3")))
    if kv_config:
        print("INFO Registering KV_Caches. use_mla: False", flush=True)
        time.sleep(0.05)
        print("DEBUG Registering descs: [...]", flush=True)
        print("DEBUG Done registering descs", flush=True)
        print("DEBUG Created 64 blocks for src engine fake and rank 0", flush=True)
        side = ThreadingHTTPServer(("127.0.0.1", st.side_port), make_handler(st))
        threading.Thread(target=side.serve_forever, daemon=True).start()
    srv = ThreadingHTTPServer((args.host, args.port), make_handler(st))
    srv.daemon_threads = True
    print("INFO Application startup complete.", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
