#!/usr/bin/env python3
"""The harness proxy's own time on a request's way to P, on a CPU: stub P and D servers,
``pd_proxy.py --trace`` in front of them, a client sending N requests C at a time.

usage: bench_proxy.py [--proxy FILE ...] [--requests 320] [--concurrency 16] [--repeats 3]
                      [--port-base 16200]

Why: on 2 x H100 (2026-11-28, tiny load, 16 requests at a time) the proxy's marks showed
4.8-10 ms p50 from the proxy having a request to P's leg sent in push mode (both legs at
once), 2.0-3.6 ms sequentially: the proxy started a thread (the client watcher, and in
push mode the prefill leg's) before P's leg left, and each start waited for the GIL of a
process with dozens of threads. This bench measures that span (``proxy_p``, the proxy's
marks) and the client's send to the stub P's receipt (``to_p``), per proxy file given
(e.g. the tree before the change, ``git show REV:experiments/pd_proxy.py > old.py``),
interleaved across repeats. P answers after 20 ms; D streams 16 chunks 3 ms apart after
30 ms, as the tiny load's decode does. Timings of one host only: compare within a run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import textwrap
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from critical_path import read_proxy_marks  # noqa: E402
from pd_common import percentile  # noqa: E402
from pd_servers import ManagedProcess, PortAllocator, neutral_env, stop_all, \
    wait_until_ready  # noqa: E402

STUBS = textwrap.dedent('''
    import json, sys, time, threading
    from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
    arrivals = []
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def do_GET(self):
            b = json.dumps(arrivals if self.path == "/dump" else {}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(b)))
            self.end_headers(); self.wfile.write(b)
        def do_POST(self):
            t = time.time()
            n = int(self.headers.get("Content-Length", 0)); json.loads(self.rfile.read(n))
            arrivals.append((self.server.role, self.headers.get("X-Request-Id"), t))
            if self.server.role == "P":
                time.sleep(0.02)
                b = json.dumps({"choices": [{"text": "x"}],
                                "kv_transfer_params": {"remote_engine_id": "e"}}).encode()
                self.send_response(200); self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(b))); self.end_headers()
                self.wfile.write(b)
                return
            self.send_response(200); self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
            time.sleep(0.03)
            for i in range(17):
                d = (b"data: [DONE]\\n\\n" if i == 16 else
                     ("data: " + json.dumps({"choices": [{"text": "t", "token_ids": [i]}]})
                      + "\\n\\n").encode())
                self.wfile.write(f"{len(d):x}\\r\\n".encode() + d + b"\\r\\n")
                self.wfile.flush(); time.sleep(0.003)
            self.wfile.write(b"0\\r\\n\\r\\n"); self.wfile.flush()
    for port, role in ((int(sys.argv[1]), "P"), (int(sys.argv[2]), "D")):
        s = ThreadingHTTPServer(("127.0.0.1", port), H); s.role = role; s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
    time.sleep(10 ** 6)
''')


def one_run(proxy_file: str, push: bool, n: int, conc: int, ports: PortAllocator,
            logs: str) -> dict:
    p_port, d_port, x_port = ports.take(), ports.take(), ports.take()
    name = f"{len(os.listdir(logs))}-{'push' if push else 'seq'}"
    stubs = ManagedProcess(f"{name}-stubs", [sys.executable, "-c", STUBS, str(p_port),
                                             str(d_port)], neutral_env(),
                           os.path.join(logs, f"{name}-stubs.log"),
                           f"http://127.0.0.1:{d_port}/health")
    cmd = [sys.executable, proxy_file, "--port", str(x_port), "--trace",
           "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
    if push:
        cmd += ["--push-concurrent", "--prefill-engine-id", "e",
                "--prefill-side-channel-port", "5600"]
    proxy_log = os.path.join(logs, f"{name}-proxy.log")
    proxy = ManagedProcess(f"{name}-proxy", cmd, neutral_env(), proxy_log,
                           f"http://127.0.0.1:{x_port}/healthz")
    try:
        stubs.start()
        proxy.start()
        wait_until_ready([stubs, proxy], 30.0, poll_s=0.05)
        if stubs.state != "ready" or proxy.state != "ready":
            raise SystemExit(f"bench_proxy: stubs {stubs.state}, proxy {proxy.state} "
                             f"(logs in {logs})")
        sent: dict[str, float] = {}
        run_id = uuid.uuid4().hex[:12]

        def one(i: int) -> None:
            rid = f"load-{run_id}-{i}"  # the load client's form: read_proxy_marks finds it
            body = json.dumps({"model": "m", "prompt": "x" * 8000, "max_tokens": 16,
                               "stream": True}).encode()
            c = http.client.HTTPConnection("127.0.0.1", x_port, timeout=30)
            sent[rid] = time.time()
            c.request("POST", "/v1/completions", body,
                      {"Content-Type": "application/json", "X-Request-Id": rid})
            r = c.getresponse()
            r.read()
            c.close()

        with ThreadPoolExecutor(conc) as ex:
            list(ex.map(one, range(n)))
        arrivals = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{p_port}/dump", timeout=5).read())
    finally:
        stop_all([proxy, stubs], grace_s=3)
    marks = read_proxy_marks(proxy_log)
    to_p = sorted(1e3 * (t - sent[rid]) for role, rid, t in arrivals
                  if role == "P" and rid in sent)
    proxy_p = sorted(1e3 * (m["p_sent"] - m["recv"]) for m in marks.values() if "p_sent" in m)
    to_proxy = sorted(1e3 * (m["recv"] - sent[r]) for r, m in marks.items() if r in sent)
    return {"n": len(to_p), "to_p": to_p, "proxy_p": proxy_p, "to_proxy": to_proxy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proxy", action="append",
                    help="a pd_proxy.py to measure (repeatable; default: this tree's)")
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port-base", type=int, default=16200,
                    help="the stubs' and proxies' ports (below the ephemeral range)")
    a = ap.parse_args(argv)
    proxies = [os.path.abspath(p) for p in (a.proxy or [os.path.join(HERE, "pd_proxy.py")])]
    ports = PortAllocator(a.port_base)
    logs = tempfile.mkdtemp(prefix="bench-proxy-")
    print(f"# bench_proxy.py: {a.requests} requests, {a.concurrency} at a time, "
          f"{a.repeats} repeats interleaved, {os.cpu_count()} CPUs; ms p50 / p90")
    print(f"{'proxy':<28} {'mode':<16} {'to_proxy':>15} {'proxy_p':>15} {'to_p':>15}")
    for rep in range(a.repeats):
        for push in (False, True):
            for pf in proxies:
                r = one_run(pf, push, a.requests, a.concurrency, ports, logs)
                cells = " ".join(f"{percentile(r[k], 0.5):6.2f} / {percentile(r[k], 0.9):5.2f}"
                                 for k in ("to_proxy", "proxy_p", "to_p"))
                print(f"{os.path.relpath(pf)[-28:]:<28} "
                      f"{'push-concurrent' if push else 'sequential':<16} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
