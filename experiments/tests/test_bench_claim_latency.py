"""bench_claim_latency runs kvcached-pd's real claim board, listener and client in two
processes and reports every claim answered (its timings are the bench's, not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

EXP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_every_claim_is_answered_in_each_mode(tmp_path):
    out = tmp_path / "claims.json"
    res = subprocess.run([sys.executable, os.path.join(EXP, "bench_claim_latency.py"),
                          "--requests", "6", "--p-step", "3,2", "--d-step", "1,1",
                          "--switch-ms", "5", "--d-client", "thread,polled", "--json",
                          str(out)],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out.read_text())
    # both of D's clients: the workers' (a thread) and the scheduler's (polled by take)
    assert sorted((r["client"], r["mode"], r["switch_ms"], r["n"]) for r in rows) == [
        ("polled", "busy", 5.0, 6), ("polled", "idle", 5.0, 6),
        ("thread", "busy", 5.0, 6), ("thread", "idle", 5.0, 6)]
    assert all(0 < r["p50_ms"] <= r["p90_ms"] <= r["max_ms"] for r in rows)
    assert "thread busy  switch  5.0 ms: publish -> take p50" in res.stdout
