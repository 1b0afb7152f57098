#!/usr/bin/env python3
"""Per-request timelines of the staged handoff, from ``KVCACHED_PD_TRACE=1`` logs.

usage: trace_timeline.py LOG_DIR [--json OUT]

Reads every ``<mode>-prefill.log`` / ``<mode>-decode.log`` in LOG_DIR (the benchmark's
and the equivalence harness's ``logs/``), joins each decode request to its prefill
request (D's ``remote_req`` is P's request id) and prints, per mode and KV size, the
median of each stage (milliseconds):

  d_arrival_to_alloc   D: request arrival -> its blocks allocated (kvcached maps pages here)
  d_arrival_to_match   D: request arrival -> the scheduler first takes it as staged (the
                       API server's hand-off and the wait for an engine step)
  d_match_to_alloc     D: taken as staged -> blocks allocated (vLLM's allocation, with
                       kvcached mapping the pages beyond its reserve)
  d_alloc_to_post      D: blocks allocated -> staged READ posted (next start_load_kv)
  d_read_seen          D: READ posted -> scatter enqueued (the wire plus polling, the
                       in-step spin included: KVCACHED_PD_READ_SPIN_US)
  d_seen_to_reported   D: scatter enqueued -> the scheduler learns the load (next step)
  d_reported_to_compute D: the scheduler learnt the load -> the step running the request's
                       own forward (its first token on D) is scheduled
  d_unpack_host        D: host time of the scatter call (``read_done`` host_ms)
  d_tag                D: host time of the tag read shared by the step's loads
  p_arrival_to_order   P: request arrival -> pack ordered (the prefill's scheduling + chunks)
  p_arrival_to_admit   P: request arrival -> its extent reserved (waits while staging is full)
  p_pack_device        P: device time of the pack kernels
  p_pack_host          P: host time of the step's pack calls
  p_finish_to_d_alloc  P finished -> D allocated (response, proxy/client, D's scheduling)
  p_held               P: finished -> extent released (D's DONE, or P's blocks freed)

The events are kvcached-pd's connector's (kvcached_pd/transport/trace.py); the spin and
the unpack's device time are metrics (vllm:kvcached_pd_read_spin_seconds,
vllm:kvcached_pd_unpack_seconds), not trace fields.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from statistics import median

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvcached_pd.transport.trace import parse_line

STAGES = ("d_arrival_to_alloc", "d_arrival_to_match", "d_match_to_alloc", "d_alloc_to_post",
          "d_read_seen", "d_tag", "d_unpack_host", "d_seen_to_reported",
          "d_reported_to_compute", "p_arrival_to_admit", "p_arrival_to_order",
          "p_pack_device", "p_pack_host", "p_finish_to_d_alloc", "p_held")
_LOG = re.compile(r"^(?P<mode>.+)-(?P<role>prefill|decode)\.log$")


def read_events(log_dir: str) -> dict[str, dict[str, list[dict]]]:
    """{mode: {role: [event, ...]}} from the instance logs in ``log_dir``."""
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for name in sorted(os.listdir(log_dir)):
        m = _LOG.match(name)
        if not m:
            continue
        with open(os.path.join(log_dir, name), encoding="utf-8", errors="replace") as f:
            for line in f:
                ev = parse_line(line)
                if ev is not None:
                    out[m["mode"]][m["role"]].append(ev)
    return out


def _by_request(events: list[dict]) -> dict[str, dict[str, dict]]:
    reqs: dict[str, dict[str, dict]] = defaultdict(dict)
    for ev in events:
        for req in str(ev["req"]).split(","):  # one "packed" event may name several
            reqs[req].setdefault(ev["ev"], ev)
    return reqs


def timelines(prefill: list[dict], decode: list[dict]) -> list[dict]:
    """One row per decode request that was read through staging."""
    p_reqs, d_reqs = _by_request(prefill), _by_request(decode)
    rows = []
    for d in d_reqs.values():
        alloc, posted, done = d.get("d_alloc"), d.get("read_posted"), d.get("read_done")
        if not (posted and done):
            continue
        p = p_reqs.get(str(posted.get("remote_req")), {})
        row = {"bytes": posted.get("bytes"), "d_read_seen": done.get("handoff_ms"),
               "d_tag": done.get("tag_ms"), "d_unpack_host": done.get("host_ms")}
        match = d.get("d_match")
        if alloc:
            row["d_arrival_to_alloc"] = alloc.get("since_arrival_ms")
            row["d_alloc_to_post"] = 1e3 * (posted["t"] - alloc["t"])
        if match:
            row["d_arrival_to_match"] = match.get("since_arrival_ms")
            if alloc:
                row["d_match_to_alloc"] = 1e3 * (alloc["t"] - match["t"])
        if "d_recv_reported" in d:
            row["d_seen_to_reported"] = 1e3 * (d["d_recv_reported"]["t"] - done["t"])
            if "d_compute_scheduled" in d:
                row["d_reported_to_compute"] = 1e3 * (d["d_compute_scheduled"]["t"]
                                                      - d["d_recv_reported"]["t"])
        if "p_admit" in p:
            row["p_arrival_to_admit"] = p["p_admit"].get("since_arrival_ms")
        if "pack_ordered" in p:
            row["p_arrival_to_order"] = p["pack_ordered"].get("since_arrival_ms")
        if "packed" in p:
            row["p_pack_device"] = p["packed"].get("device_ms")
            row["p_pack_host"] = p["packed"].get("host_ms")
        if "p_finished" in p and alloc:
            row["p_finish_to_d_alloc"] = 1e3 * (alloc["t"] - p["p_finished"]["t"])
        if "p_released" in p:
            row["p_held"] = p["p_released"].get("held_ms")
        rows.append(row)
    return rows


def summarize(log_dir: str) -> dict[str, list[dict]]:
    """{mode: [{"mib": .., "n": .., stage: median ms, ...}, ...]} sorted by size."""
    out = {}
    for mode, roles in read_events(log_dir).items():
        rows = timelines(roles.get("prefill", []), roles.get("decode", []))
        by_size = defaultdict(list)
        for r in rows:
            by_size[r["bytes"]].append(r)
        table = []
        for nbytes in sorted(by_size):
            group = by_size[nbytes]
            entry = {"mib": nbytes / 2**20, "n": len(group)}
            for stage in STAGES:
                vals = [r[stage] for r in group if r.get(stage) is not None]
                entry[stage] = round(median(vals), 3) if vals else None
            table.append(entry)
        if table:
            out[mode] = table
    return out


def render(summary: dict[str, list[dict]]) -> str:
    if not summary:
        return "no kvcached-pd trace events (KVCACHED_PD_TRACE=1 not set?)\n"
    short = [("P " + s[2:] if s.startswith("p_") else s[2:]).replace("_to_", ">")
             for s in STAGES]  # prefixes only ("d_read_seen" once read "reaseen")
    hdr = f"{'mode':<28} {'MiB':>7} {'n':>3} " + " ".join(f"{h:>10}" for h in short)
    lines = ["Staged handoff timeline, medians in ms (experiments/trace_timeline.py):", hdr,
             "-" * len(hdr)]
    for mode, table in summary.items():
        for e in table:
            cells = " ".join(f"{'-' if e[s] is None else format(e[s], '.3f'):>10}" for s in STAGES)
            lines.append(f"{mode:<28} {e['mib']:>7.1f} {e['n']:>3} {cells}")
    return "\n".join(lines) + "\n"


def emit(text: str, summary: object, json_path: str | None) -> None:
    """A summarizing script's output: its table printed, its summary as JSON if asked."""
    print(text, end="")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("log_dir")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    summary = summarize(a.log_dir)
    emit(render(summary), summary, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
