"""compare_loads.py reads the summaries pd_load writes (rendered here by pd_load's own
renderer, so a change of that format fails this test) and takes each ratio within one run.

run: python -m pytest experiments/tests/test_compare_loads.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXP = os.path.dirname(HERE)
sys.path.insert(0, EXP)

import compare_loads  # noqa: E402
import pd_load  # noqa: E402


def _mode(e2e: tuple[float, float], ttft: float, batch: float | None = None) -> dict:
    return {"instances": {}, "checks": {}, "staging_left_bytes": None, "completed": 48,
            "sent": 48, "wires": [], "verdict": "PASS", "aborted": 0, "failed": 0,
            "different": 0, "deaths": 0, "direct_fallbacks": {}, "staging_waits": {},
            "nixl_failed_transfers": 0, "reasons": [], "vs_vanilla": {},
            "latency": {"n": 48, "e2e_p50_ms": e2e[0], "e2e_p90_ms": e2e[1],
                        "ttft_p50_ms": ttft, "ttft_p90_ms": ttft * 1.2,
                        "prefill_p50_ms": None, "prefill_p90_ms": None,
                        "decode_p50_ms": None, "decode_p90_ms": None},
            "ttft_batch": None if batch is None else {"n": 8, "ttft_p50_ms": batch,
                                                     "ttft_p90_ms": batch * 1.3,
                                                     "ttft_max_ms": batch * 1.4}}


def _summary(modes: dict) -> str:
    return pd_load.render_summary({
        "load": {"requests": 48, "concurrency": 8, "prompt_tokens": [12, 3000],
                 "max_tokens": 16, "aborts": None, "kvcached_layout": "contiguous"},
        "elapsed_s": 1.0, "overall": "PASS", "modes": modes, "notes": []})


def test_each_ratio_is_taken_within_its_own_run(tmp_path):
    runs = {"a": {"reference": _mode((50, 60), 10), "vanilla": _mode((200, 300), 100, 400),
                  "kvpd-staged": _mode((180, 330), 60, 200)},
            "b": {"vanilla": _mode((100, 150), 50, 200),
                  "kvpd-staged": _mode((110, 120), 40, None)}}
    paths = []
    for name, modes in runs.items():
        p = tmp_path / f"{name}.txt"
        p.write_text(_summary(modes))
        paths.append(f"{name}={p}")
    parsed = compare_loads.parse_summary((tmp_path / "a.txt").read_text())
    assert parsed["kvpd-staged"] == {"e2e p50": 180, "e2e p90": 330, "TTFT p50": 60,
                                     "TTFT batch p50": 200}
    table = compare_loads.ratios({n: compare_loads.parse_summary(
        (tmp_path / f"{n}.txt").read_text()) for n in runs}, "vanilla")
    assert set(table) == {("kvpd-staged", m) for m in compare_loads.MEASURES}  # no reference
    assert table[("kvpd-staged", "e2e p50")] == {"a": 0.9, "b": 1.1}
    assert table[("kvpd-staged", "e2e p90")] == {"a": 1.1, "b": 0.8}
    assert table[("kvpd-staged", "TTFT batch p50")] == {"a": 0.5}  # b ran no batch
    out = subprocess.run([sys.executable, os.path.join(EXP, "compare_loads.py"), *paths],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "e2e p90" in line).split()
    # mode, measure (two words), run a, run b, median, runs over 1.0, runs at or below 0.8
    assert row[3:] == ["1.10", "0.80", "0.95", "1/2", "1/2"]


def test_a_run_without_the_baseline_is_refused(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text(_summary({"kvpd-staged": _mode((1, 2), 1)}))
    out = subprocess.run([sys.executable, os.path.join(EXP, "compare_loads.py"), f"x={p}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "no 'vanilla' row" in out.stderr
