"""cudagraph_modes.py sums vLLM's --cudagraph-metrics tables per instance log (the rows as
vLLM 0.30.0 logs them on one H200, 2026-11-29c).

run: python -m pytest experiments/tests/test_cudagraph_modes.py -q
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import cudagraph_modes  # noqa: E402

P = "1795934853.539382 (APIServer pid=1762) INFO 11-29 06:47:33 [cuda_graph.py:123] "
TABLE = [P + "**CUDAGraph Stats:**", P,
         P + "| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |",
         P + "|-----------------|---------------|--------------|--------------|-------|"]


def rows(*rows: tuple[int, int, str, int]) -> list[str]:
    return TABLE + [P + f"| {u} | {p} | {p - u} | {mode} | {n} |" for u, p, mode, n in rows]


def test_counts_every_table_of_a_log_by_mode():
    lines = rows((15, 16, "FULL", 24), (3, 4, "FULL", 3), (17, 24, "PIECEWISE", 5))
    lines += ["1795934853.6 INFO [loggers.py:1] | 1 | 2 | 3 | FULL | 99 |",  # not vLLM's table
              P + "- Mode: FULL_AND_PIECEWISE"]
    lines += rows((2048, 2048, "NONE", 7), (16, 16, "FULL", 1))
    assert cudagraph_modes.count_modes(lines) == {"FULL": 28, "PIECEWISE": 5, "NONE": 7}


def test_summarize_names_each_instance_with_tables(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "kvpd-push-p-sync-decode.log").write_text(
        "\n".join(rows((15, 16, "FULL", 30), (9, 16, "PIECEWISE", 10))) + "\n")
    (logs / "kvpd-push-p-sync-proxy.log").write_text("no tables here\n")
    assert cudagraph_modes.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["kvpd-push-p-sync-decode: FULL 30 (75%), PIECEWISE 10 (25%) of 40 steps"]
    (logs / "kvpd-push-p-sync-decode.log").write_text("eager, no metrics\n")
    assert cudagraph_modes.main([str(tmp_path)]) == 1
