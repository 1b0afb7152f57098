#!/usr/bin/env python3
"""How long a push-mode claim's answer takes from P's publishing to D's scheduler, with
the engines' main threads idle or busy (CPU only: kvcached-pd's real ClaimBoard,
HandshakeListener and ClaimClient, over ZMQ on localhost, in two processes).

usage: bench_claim_latency.py [--requests 200] [--p-step 15,4] [--d-step 2,2]
                              [--switch-ms 5,0.5] [--d-client thread,polled]

Why: on one H200 (2026-11-28, ``experiments/results/2026-11-28-h200x2-session/``) the
claim's answer took 3.7-6.3 ms (median per run) from P's ``p_finished`` to D's
scheduler holding it, on a path that moves ~1 KiB over localhost. Both ends are Python
threads (P's listener, D's claim thread) in processes whose main thread runs vLLM's
engine loop. A thread woken by its socket must take the GIL from a main thread that is
running Python; CPython makes the waiter ask after ``sys.getswitchinterval()`` (5 ms by
default) and the holder let go at its next bytecode boundary. This bench separates that
from everything else.

Each process's main thread plays its engine, step after step: blocked for the GPU's part
of a step (the GIL free), then running Python for the host's part (``--p-step``,
``--d-step``: ms blocked, ms of Python; ``idle`` mode sleeps through the Python part too).
P publishes a request at a random point of its output processing; D's scheduler calls
``take()`` once a step at a random point (vLLM asks a waiting request's connector every
step). D claims each request before P publishes it (the concurrent legs' order: the
claim is held at P until published). Reported: publish (P's clock) to D's ``take()``
returning the answer (D's clock; one host), p50 / p90 / max, per mode, switch interval
(both processes), D's client (``thread``: the claim thread files replies for ``take``, as
D's workers use it; ``polled``: ``ClaimClient(threaded=False)``, ``take`` reads the socket
itself, as D's scheduler does since 2026-11-28; a tree before that says it cannot). D's
own step bounds the answer from below by up to one step in every mode: compare the modes.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pd_common import percentile  # noqa: E402

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


def prefill_side(port_q, go, done, n: int, busy: bool, step: tuple[float, float],
                 switch_s: float, out_q) -> None:
    """P's engine, step after step: ``step[0]`` ms blocked (the GPU's step: the GIL is
    free), then ``step[1]`` ms of Python (its output processed, a request published at a
    random point of the first half, the next step scheduled)."""
    import random

    sys.setswitchinterval(switch_s)
    from kvcached_pd.connector.claim_board import ClaimBoard
    from kvcached_pd.connector.side_channel import HandshakeListener

    rng = random.Random(1)
    board = ClaimBoard(ENGINE, keep_s=30.0)
    listener = HandshakeListener("127.0.0.1", 0, {0: b"hs"}, board)
    port_q.put(listener.port)
    published = {}
    gpu_ms, py_ms = step
    deadline = time.monotonic() + 60 + n * (gpu_ms + py_ms) / 1e3 * 4
    i = 0
    board.expect(f"cmpl-bench-{i}-0")
    try:
        while i < n and time.monotonic() < deadline and not done.is_set():
            time.sleep(gpu_ms / 1e3)
            before = rng.uniform(0, py_ms / 2)
            _wait(before, busy)
            if go.is_set():  # D's claim for request i is held at P: publish it now
                go.clear()
                req = f"cmpl-bench-{i}-0"
                published[req] = time.time()
                board.publish(req, {"request_id": req, "offset": 0, "nbytes": 1 << 20})
                i += 1
                board.expect(f"cmpl-bench-{i}-0")
            _wait(py_ms - before, busy)
        out_q.put(published)
        time.sleep(0.2)
    finally:
        listener.close()
        board.close()


def decode_side(port: int, go, done, n: int, busy: bool, step: tuple[float, float],
                switch_s: float, out_q, threaded: bool = True) -> None:
    """D's engine, step after step: ``step[0]`` ms blocked, ``step[1]`` ms of Python with
    one ``take()`` (the scheduler asking for the waiting request) at a random point. The
    claim for the next request goes out once the last is answered; ``go`` tells P a
    moment later (the claim is held there by then)."""
    import random

    sys.setswitchinterval(switch_s)
    from kvcached_pd.connector.side_channel import ClaimClient
    from kvcached_pd.connector.wire import Claim

    rng = random.Random(2)
    if threaded:
        client = ClaimClient(timeout_s=5.0)
    else:
        try:
            client = ClaimClient(timeout_s=5.0, threaded=False)
        except TypeError:  # a tree before 2026-11-28: its client has only its thread
            out_q.put({})
            done.set()
            raise SystemExit("that tree's ClaimClient has only its thread: no --d-client polled")
    gpu_ms, py_ms = step
    seen = {}
    i, claimed_at, told = 0, None, -1
    deadline = time.monotonic() + 60 + n * 0.1
    try:
        while i < n and time.monotonic() < deadline:
            req = f"cmpl-bench-{i}-0"
            if claimed_at is None:
                client.submit(req, "127.0.0.1", port, Claim(2, req, ENGINE))
                claimed_at = time.monotonic()
            elif told != i and time.monotonic() - claimed_at > 0.002:
                go.set()  # P may publish request i now: its claim is held there
                told = i
            time.sleep(gpu_ms / 1e3)
            at = rng.uniform(0, py_ms)
            _wait(at, busy)
            for rid, reply in client.take().items():
                seen[rid] = (time.time(), getattr(reply, "status", repr(reply)))
            _wait(py_ms - at, busy)
            if req in seen:
                i, claimed_at = i + 1, None
        out_q.put(seen)
    finally:
        done.set()  # P stops waiting for claims that will not come
        client.close()


def run(n: int, busy: bool, p_step: tuple[float, float], d_step: tuple[float, float],
        switch_s: float, threaded: bool = True) -> dict:
    ctx = mp.get_context("spawn")
    port_q, out_p, out_d = ctx.Queue(), ctx.Queue(), ctx.Queue()
    go, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=prefill_side,
                    args=(port_q, go, done, n, busy, p_step, switch_s, out_p))
    p.start()
    port = port_q.get(timeout=30)
    d = ctx.Process(target=decode_side,
                    args=(port, go, done, n, busy, d_step, switch_s, out_d, threaded))
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
            "p90_ms": round(percentile(lat, 0.9), 3), "max_ms": round(lat[-1], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--p-step", default="15,4",
                    help="P's step: ms blocked on the GPU, ms of Python (15,4: a prefill "
                         "step of the tiny load on one H200, 2026-11-28)")
    ap.add_argument("--d-step", default="2,2",
                    help="D's step: ms blocked, ms of Python (D's steps took ~4 ms)")
    ap.add_argument("--switch-ms", default="5,0.5",
                    help="sys.setswitchinterval values to run, ms (5: CPython's default)")
    ap.add_argument("--d-client", default="thread",
                    help="D's claim client(s) to run: thread, polled (comma-separated)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    clients = a.d_client.split(",")
    p_step = tuple(float(x) for x in a.p_step.split(","))
    d_step = tuple(float(x) for x in a.d_step.split(","))
    if not set(clients) <= {"thread", "polled"}:
        ap.error(f"--d-client: thread or polled, not {a.d_client!r}")
    rows = []
    for client in clients:
        for switch_ms in [float(x) for x in a.switch_ms.split(",")]:
            for busy in (False, True):
                r = run(a.requests, busy, p_step, d_step, switch_ms / 1e3, client == "thread")
                r.update(mode="busy" if busy else "idle", switch_ms=switch_ms, client=client)
                rows.append(r)
                print(f"{client:<6} {r['mode']:<5} switch {switch_ms:>4} ms: publish -> take "
                      f"p50 {r.get('p50_ms')} ms, p90 {r.get('p90_ms')}, max "
                      f"{r.get('max_ms')} (n {r['n']})", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["n"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
