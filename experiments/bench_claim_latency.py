#!/usr/bin/env python3
"""How long a push-mode claim's answer takes from P's publishing to D's scheduler, with
the engines' main threads idle or busy (CPU only: kvcached-pd's real ClaimBoard,
HandshakeListener and ClaimClient, over ZMQ on localhost, in two processes).

usage: bench_claim_latency.py [--requests 200] [--busy-ms 4] [--switch-ms 5,0.5]

Why: on one H200 (2026-11-28, ``experiments/results/2026-11-28-h200x2-session/``) the
claim's answer took 3.7-6.3 ms (median per run) from P's ``p_finished`` to D's
scheduler holding it, on a path that moves ~1 KiB over localhost. Both ends are Python
threads (P's listener, D's claim thread) in processes whose main thread runs vLLM's
engine loop. A thread woken by its socket must take the GIL from a main thread that is
running Python; CPython makes the waiter ask after ``sys.getswitchinterval()`` (5 ms by
default) and the holder let go at its next bytecode boundary. This bench separates that
from everything else.

Each process's main thread plays its engine: P publishes one request's params, then its
main thread runs ``--busy-ms`` of pure Python (an engine step's host work) before the next
request, or sleeps that long (``idle``: the GIL is free); D's main thread polls
``ClaimClient.take()`` between ``--busy-ms`` slices of Python (a scheduler that asks every
step) or between sleeps. D claims each request before P publishes it (the concurrent
legs' order: the claim is held at P until published). Reported: publish (P's clock) to
the scheduler's ``take()`` seeing the answer (D's clock; one host), p50 / p90 / max, per
mode and switch interval (both processes). The scheduler's own polling period bounds the
answer from below by up to one slice in every mode; compare the modes, not the absolute.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from statistics import median

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ENGINE = "bench-p"


def _spin(ms: float) -> None:
    """Pure Python for ``ms`` milliseconds: holds the GIL except at switch requests."""
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i * i


def _wait(ms: float, busy: bool) -> None:
    if busy:
        _spin(ms)
    else:
        time.sleep(ms / 1e3)


def prefill_side(port_q, go, n: int, busy: bool, busy_ms: float, switch_s: float,
                 out_q) -> None:
    sys.setswitchinterval(switch_s)
    from kvcached_pd.connector.claim_board import ClaimBoard
    from kvcached_pd.connector.side_channel import HandshakeListener

    board = ClaimBoard(ENGINE, keep_s=30.0)
    listener = HandshakeListener("127.0.0.1", 0, {0: b"hs"}, board)
    port_q.put(listener.port)
    published = {}
    try:
        for i in range(n):
            req = f"cmpl-bench-{i}-0"
            board.expect(req)
            if not go.wait(10):  # D has claimed it (held at P); else D is gone
                break
            go.clear()
            _wait(busy_ms / 2, busy)
            published[req] = time.time()
            board.publish(req, {"request_id": req, "offset": 0, "nbytes": 1 << 20})
            _wait(busy_ms, busy)
        out_q.put(published)
        _wait(200, False)
    finally:
        listener.close()
        board.close()


def decode_side(port: int, go, n: int, busy: bool, busy_ms: float, switch_s: float,
                out_q) -> None:
    sys.setswitchinterval(switch_s)
    from kvcached_pd.connector.side_channel import ClaimClient
    from kvcached_pd.connector.wire import Claim

    client = ClaimClient(timeout_s=5.0)
    seen = {}
    try:
        for i in range(n):
            req = f"cmpl-bench-{i}-0"
            client.submit(req, "127.0.0.1", port, Claim(2, req, ENGINE))
            time.sleep(0.002)  # the claim reaches P and is held there
            go.set()
            deadline = time.monotonic() + 5.0
            while req not in seen and time.monotonic() < deadline:
                for rid, reply in client.take().items():
                    seen[rid] = (time.time(), getattr(reply, "status", repr(reply)))
                if req not in seen:
                    _wait(busy_ms / 4, busy)  # the scheduler's step, then it asks again
        out_q.put(seen)
    finally:
        client.close()


def run(n: int, busy: bool, busy_ms: float, switch_s: float) -> dict:
    ctx = mp.get_context("spawn")
    port_q, out_p, out_d, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=prefill_side, args=(port_q, go, n, busy, busy_ms, switch_s, out_p))
    p.start()
    port = port_q.get(timeout=30)
    d = ctx.Process(target=decode_side, args=(port, go, n, busy, busy_ms, switch_s, out_d))
    d.start()
    try:
        published, seen = out_p.get(timeout=120), out_d.get(timeout=120)
    except Exception:  # noqa: BLE001 - a side that died reports nothing: n 0
        published, seen = {}, {}
    for proc in (p, d):
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    lat = sorted(1e3 * (seen[r][0] - t) for r, t in published.items()
                 if r in seen and seen[r][1] == "ready")
    if not lat:
        return {"n": 0}
    return {"n": len(lat), "p50_ms": round(median(lat), 3),
            "p90_ms": round(lat[int(0.9 * (len(lat) - 1))], 3), "max_ms": round(lat[-1], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--busy-ms", type=float, default=4.0,
                    help="one engine step's host work (D polls every quarter of it)")
    ap.add_argument("--switch-ms", default="5,0.5",
                    help="sys.setswitchinterval values to run, ms (5: CPython's default)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    for switch_ms in [float(x) for x in a.switch_ms.split(",")]:
        for busy in (False, True):
            r = run(a.requests, busy, a.busy_ms, switch_ms / 1e3)
            r.update(mode="busy" if busy else "idle", switch_ms=switch_ms)
            rows.append(r)
            print(f"{r['mode']:<5} switch {switch_ms:>4} ms: publish -> take p50 "
                  f"{r.get('p50_ms')} ms, p90 {r.get('p90_ms')}, max {r.get('max_ms')} "
                  f"(n {r['n']})", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["n"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
