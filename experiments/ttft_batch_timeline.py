#!/usr/bin/env python3
"""Where each request of the TTFT batch spends its time to first token, request by request.

usage: ttft_batch_timeline.py LOAD_DIR [--modes kvpd-staged,kvpd-push]

LOAD_DIR is one load harness run (``pd_load.py``'s ``load/`` folder: ``logs/`` with the
instances' ``KVCACHED_PD_TRACE=1`` lines, ``modes/MODE.json`` with the client's records).
``trace_timeline.py`` gives medians per KV size; the TTFT batch (8 concurrent 3000-token
prompts) needs the requests one by one, because its p50 and p90 are set by *which*
requests wait and for what: P's staging being full (``P admit`` long after ``P arrival``),
P's prefill steps, or D's first step. For each request of the batch, in milliseconds from
the batch's first client send:

  P arr / P adm   P: the request's arrival / its extent reserved, when P's scheduler
                  first takes it (a gap: staging was full, or P's earlier prefill
                  steps used their token budget on the batch's other prompts)
  P fin           P: the extent handed to D (P's prefill done and packed)
  D arr / D match D: arrival (the proxy's second leg) / the scheduler takes it as staged
  D read          D: the unpack enqueued (the KV is D's from here)
  D step          D: the step running the request's own first forward is scheduled
  step ms         that step's period (its ``step`` trace line: scheduled to the
                  scheduler's next round; "-" for a trace without step lines)
  1st tok         the client's first token (its ``ttft_s``)
  step>tok        1st tok - D step: D's first forward, its output and the way back

A client record joins its instances' events by the request id the load client sends
(``load-<hex>-<index>``, inside vLLM's ``cmpl-...`` ids) and the batch's time window.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_timeline import _by_request, read_events  # noqa: E402

COLUMNS = ("P arr", "P adm", "P fin", "D arr", "D match", "D read", "D step", "step ms",
           "1st tok", "step>tok")
_CORE = re.compile(r"load-[0-9a-f]+-(\d+)")


def _core(req_id: str) -> tuple[str, int] | None:
    m = _CORE.search(str(req_id))
    return (m.group(0), int(m.group(1))) if m else None


def _arrival(ev: dict) -> float:
    return ev["t"] - float(ev.get("since_arrival_ms") or 0.0) / 1e3


def _first_by_request(events: list[dict]) -> dict[str, dict[str, dict]]:
    """trace_timeline's per-request first events, keyed by the load client's id."""
    out: dict[str, dict[str, dict]] = {}
    for req, evs in _by_request(events).items():
        core = _core(req)
        if core is not None:
            out[core[0]] = evs
    return out


def batch_rows(client: list[dict], prefill: list[dict], decode: list[dict]) -> list[dict]:
    """One row per client request of the batch (ms from its first send); a stage the
    trace lacks is None."""
    if not client:
        return []
    t0 = min(r["started_at"] for r in client)
    t_end = max(r["started_at"] + (r.get("e2e_s") or 0.0) for r in client)
    p_reqs, d_reqs = _first_by_request(prefill), _first_by_request(decode)

    def in_window(evs: dict[str, dict]) -> bool:
        return any(t0 - 1.0 <= e["t"] <= t_end + 1.0 for e in evs.values())

    by_index: dict[int, tuple[dict, dict]] = {}
    for core, d in d_reqs.items():
        if not in_window(d):
            continue
        index = int(core.rsplit("-", 1)[1])
        by_index[index] = (p_reqs.get(core, {}), d)

    def ms(t: float | None) -> float | None:
        return None if t is None else round(1e3 * (t - t0), 1)

    steps = [e for e in decode if e["ev"] == "step"]

    def step_ms(t: float) -> float | None:
        """The period of the D step whose scheduling logged ``t``."""
        for e in steps:
            if e["start"] <= t <= e["start"] + e["until_next_ms"] / 1e3:
                return e["until_next_ms"]
        return None

    rows = []
    for rec in sorted(client, key=lambda r: r.get("index", 0)):
        p, d = by_index.get(rec.get("index"), ({}, {}))
        admit = p.get("p_admit")
        match = d.get("d_match")
        step = d.get("d_compute_scheduled")
        first = (rec["started_at"] + rec["ttft_s"]) if rec.get("ttft_s") is not None else None
        row = {
            "name": rec.get("name", str(rec.get("index"))),
            "P arr": ms(_arrival(admit)) if admit else None,
            "P adm": ms(admit["t"]) if admit else None,
            "P fin": ms(p["p_finished"]["t"]) if "p_finished" in p else None,
            "D arr": ms(_arrival(match)) if match else None,
            "D match": ms(match["t"]) if match else None,
            "D read": ms(d["read_done"]["t"]) if "read_done" in d else None,
            "D step": ms(step["t"]) if step else None,
            "step ms": step_ms(step["t"]) if step else None,
            "1st tok": ms(first),
        }
        row["step>tok"] = (round(row["1st tok"] - row["D step"], 1)
                           if row["1st tok"] is not None and row["D step"] is not None else None)
        rows.append(row)
    return rows


def render(mode: str, rows: list[dict]) -> str:
    head = f"{mode}: TTFT batch, ms from the first client send\n"
    head += f"{'request':<14}" + "".join(f"{c:>10}" for c in COLUMNS) + "\n"
    body = "".join(f"{r['name']:<14}" + "".join(
        f"{'-' if r[c] is None else format(r[c], '.1f'):>10}" for c in COLUMNS) + "\n"
        for r in rows)
    return head + body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("load_dir")
    ap.add_argument("--modes", default="kvpd-staged,kvpd-push")
    a = ap.parse_args(argv)
    events = read_events(os.path.join(a.load_dir, "logs"))
    out = []
    for mode in a.modes.split(","):
        path = os.path.join(a.load_dir, "modes", f"{mode}.json")
        if not os.path.exists(path):
            out.append(f"{mode}: no {path}\n")
            continue
        with open(path, encoding="utf-8") as f:
            client = ((json.load(f).get("ttft") or {}).get("requests")) or []
        roles = events.get(mode, {})
        rows = batch_rows(client, roles.get("prefill", []), roles.get("decode", []))
        out.append(render(mode, rows) if rows else f"{mode}: no TTFT batch records\n")
    print("\n".join(out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
