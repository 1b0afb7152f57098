"""How each instance's engine steps ran: FULL CUDA graph, PIECEWISE or eager, from vLLM's
``--cudagraph-metrics`` tables in a load run's server logs.

Why: on vLLM 0.30 (Model Runner V2) a decode instance's step that runs a KV-loaded
request's first forward left the FULL decode graph for the piecewise one, with every
decoding request beside it (kvcached-pd's ``prompt_tail_graph`` patch sends it back).
The step periods (critical_path.py's first-forward line) show the cost; these tables show
the mode. vLLM logs one table per stats interval (the API server's ``CUDAGraph Stats``,
counts of steps since the last one), so the sums cover the logged intervals, not
necessarily every step of the run.

    python3 experiments/cudagraph_modes.py LOAD_OUT     # LOAD_OUT/logs/*.log
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

# "| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |" rows
ROW = re.compile(r"\[cuda_graph\.py:\d+\]\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|"
                 r"\s*([A-Z_]+)\s*\|\s*(\d+)\s*\|")


def count_modes(lines) -> Counter:
    """Steps per runtime mode over every table in ``lines``."""
    modes: Counter = Counter()
    for line in lines:
        m = ROW.search(line)
        if m:
            modes[m.group(4)] += int(m.group(5))
    return modes


def summarize(load_out: str) -> list[str]:
    log_dir = os.path.join(load_out, "logs")
    out = []
    for name in sorted(os.listdir(log_dir)):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(log_dir, name), errors="replace") as f:
            modes = count_modes(f)
        if not modes:
            continue
        total = sum(modes.values())
        parts = ", ".join(f"{mode} {n} ({100 * n / total:.0f}%)"
                          for mode, n in sorted(modes.items()))
        out.append(f"{name[:-4]}: {parts} of {total} steps")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("load_out", help="a load run's output folder (the one holding logs/)")
    a = ap.parse_args(argv)
    lines = summarize(a.load_out)
    if not lines:
        print(f"no --cudagraph-metrics tables in {a.load_out}/logs", file=sys.stderr)
        return 1
    print("engine steps by CUDA graph runtime mode, over vLLM's logged stats intervals "
          "(--cudagraph-metrics):")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
