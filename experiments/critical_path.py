#!/usr/bin/env python3
"""Where a PD request's time to first token goes, against one instance's: the client's
records joined to both instances' ``KVCACHED_PD_TRACE=1`` lines, request by request.

usage: critical_path.py LOAD_OUT [--against kvcached-single] [--json OUT]

LOAD_OUT is a ``pd_load.py --trace`` output folder (``modes/<mode>.json``: every request
with its client-side start, TTFT and end; ``logs/<mode>-prefill.log`` and
``-decode.log``). A client request is found in the traces by its ``X-Request-Id``
(``load-<12 hex>-<index>``), which vLLM keeps inside its own request ids on P and D. The
load's repeats only (not the TTFT batch, not the warm-up). Per request, one after the
other on its way (milliseconds; the hosts' wall clock, one host):

  to_p        client sent -> P's engine has the request (proxy, P's API server)
  p_queue     P has it -> P schedules the step that completes its prompt (waits for P's
              steps, and for staging room)
  p_step      that step scheduled -> P hands the extent over (``p_finished``: the step's
              forward and P's pack run, sampled, its output processed)
  hop         P hands over -> D allocates the request's blocks (push: the claim's answer
              and D's next scheduler pass; pull: P's response through the proxy, D's API
              server, D's scheduler); answer: its first part in push mode, P hands over ->
              D's scheduler holds the answer (P's listener thread, D's claim thread)
  d_wait      D allocated -> D's worker unpacks (the step that schedules it starts)
  d_out       D unpacks -> the client has the first token (D's forward with the
              request's last prompt token, sampling, D's output path, the proxy)
  ttft        the client's time to first token; tail: e2e - ttft (D's decode steps)
  kvpd        kvcached-pd's own host time on that path: P's pack calls (one step's, for
              all of its requests) + D's tag read + D's unpack calls; kvpd_gpu: the pack
              kernels' device time (the unpack's is a metric, not a trace field)

With the proxy's ``--trace`` lines (``logs/<mode>-proxy.log``, ``pd_proxy trace {json}``)
two of those stages are split where the proxy saw the request:

  to_p      = to_proxy (client sent -> the proxy has the request)
              + proxy_p (-> the proxy has sent P's leg; push: after connecting to D and
                starting the prefill leg's thread)
              + p_api (-> P's engine has it: P's API server)
  d_out     = d_first (D unpacks -> the proxy reads D's first bytes: D's forward, output
                path and API server)
              + relay (-> the proxy has written them to the client)
              + to_client (-> the client has the first token)
  d_sent       the proxy has the request -> it has sent D's leg (push: D's leg goes at
               once; pull: after P's answer)

The summary prints each stage's median and, for one instance without PD (``--against``),
its TTFT and tail: what PD adds is ``ttft`` minus one instance's, and ``kvpd`` is how
much of it is kvcached-pd's transport. The stages are consecutive, so their medians sum
to about the median TTFT (not exactly: medians of parts).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import sys
from collections import defaultdict
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_timeline  # noqa: E402
from pd_common import percentile  # noqa: E402

CLIENT_ID = re.compile(r"load-[0-9a-f]{12}-\d+")
STAGES = ("to_p", "p_queue", "p_step", "hop", "answer", "d_wait", "d_out", "ttft", "tail",
          "kvpd", "kvpd_gpu")
PROXY_STAGES = ("to_proxy", "proxy_p", "p_api", "d_sent", "d_first", "relay", "to_client")
PROXY_PREFIX = "pd_proxy trace "
# vLLM's start-up line naming an engine's token budget per step (its config's
# max_num_batched_tokens), e.g. "Chunked prefill is enabled with max_num_batched_tokens=8192."
BUDGET = re.compile(r"max_num_batched_tokens=(\d+)")


def read_proxy_marks(path: str) -> dict[str, dict]:
    """{client request id: the proxy's wall-clock marks} from a proxy's log (``--trace``)."""
    out: dict[str, dict] = {}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            i = line.find(PROXY_PREFIX)
            if i < 0:
                continue
            try:
                rec = json.loads(line[i + len(PROXY_PREFIX):])
            except ValueError:
                continue
            m = CLIENT_ID.search(str(rec.get("req", "")))
            if m:
                out[m.group(0)] = rec
    return out


def _by_client_id(events: list[dict]) -> dict[str, dict[str, dict]]:
    """{client id: {event name: first such event}} for events naming a client request."""
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for ev in events:
        for req in str(ev.get("req", "")).split(","):
            m = CLIENT_ID.search(req)
            if m:
                out[m.group(0)].setdefault(ev["ev"], ev)
    return out


def _client_requests(mode_doc: dict) -> list[dict]:
    return [r for rep in mode_doc.get("repeats", []) if rep.get("repeat", 0) > 0
            for r in rep.get("requests", []) if r.get("ok") and r.get("ttft_s") is not None]


def request_rows(mode_doc: dict, prefill: list[dict], decode: list[dict],
                 proxy: dict[str, dict] | None = None) -> list[dict]:
    """One row per completed load request of a PD mode, its stages where traced."""
    p_ev, d_ev = _by_client_id(prefill), _by_client_id(decode)
    proxy = proxy or {}
    rows = []
    for r in _client_requests(mode_doc):
        rid = r.get("request_id") or ""
        start = r.get("started_at")
        row: dict = {"ttft": 1e3 * r["ttft_s"], "tail": 1e3 * (r["e2e_s"] - r["ttft_s"])}
        p, d = p_ev.get(rid, {}), d_ev.get(rid, {})
        first_token = start + r["ttft_s"] if start is not None else None
        admit, order, fin = p.get("p_admit"), p.get("pack_ordered"), p.get("p_finished")
        alloc, done = d.get("d_alloc"), d.get("read_done")
        p_arrival = (admit["t"] - admit["since_arrival_ms"] / 1e3
                     if admit and admit.get("since_arrival_ms") is not None else None)
        marks = [("to_p", start, p_arrival), ("p_queue", p_arrival, order and order["t"]),
                 ("p_step", order and order["t"], fin and fin["t"]),
                 ("hop", fin and fin["t"], alloc and alloc["t"]),
                 ("d_wait", alloc and alloc["t"], done and done["t"]),
                 ("d_out", done and done["t"], first_token)]
        px = proxy.get(rid, {})
        marks += [("to_proxy", start, px.get("recv")), ("proxy_p", px.get("recv"), px.get("p_sent")),
                  ("p_api", px.get("p_sent"), p_arrival), ("d_sent", px.get("recv"), px.get("d_sent")),
                  ("d_first", done and done["t"], px.get("d_first")),
                  ("relay", px.get("d_first"), px.get("out_first")),
                  ("to_client", px.get("out_first"), first_token)]
        for name, a, b in marks:
            if a is not None and b is not None:
                row[name] = 1e3 * (b - a)
        answered = d.get("claim_answered")
        if fin and answered:
            row["answer"] = 1e3 * (answered["t"] - fin["t"])
        packed = p.get("packed")
        if packed and done:
            row["kvpd"] = (packed.get("host_ms") or 0) + (done.get("tag_ms") or 0) + \
                (done.get("host_ms") or 0)
            row["kvpd_gpu"] = packed.get("device_ms")
        if p or d or px:
            rows.append(row)
    return rows


def _medians(rows: list[dict]) -> dict:
    out = {"n": len(rows)}
    for s in STAGES + PROXY_STAGES:
        vals = [r[s] for r in rows if r.get(s) is not None]
        out[s] = round(median(vals), 3) if vals else None
    return out


def summarize(load_out: str, against: str = "kvcached-single") -> dict:
    """{"modes": {mode: medians}, "against": {name, ttft, tail, n} or None}."""
    events = trace_timeline.read_events(os.path.join(load_out, "logs"))
    modes_dir = os.path.join(load_out, "modes")
    out: dict = {"modes": {}, "against": None, "steps": step_periods(events),
                 "beside": d_steps_beside_p(events),
                 "first_forward": d_steps_first_forward(events),
                 "passes": passes_before_admit(events, {
                     mode: prefill_budget(os.path.join(load_out, "logs", f"{mode}-prefill.log"))
                     for mode in events})}
    for name in sorted(os.listdir(modes_dir)) if os.path.isdir(modes_dir) else ():
        if not name.endswith(".json"):
            continue
        mode = name[:-5]
        with open(os.path.join(modes_dir, name), encoding="utf-8") as f:
            doc = json.load(f)
        if mode == against:
            reqs = _client_requests(doc)
            if reqs:
                out["against"] = {"name": mode, **_medians(
                    [{"ttft": 1e3 * r["ttft_s"], "tail": 1e3 * (r["e2e_s"] - r["ttft_s"])}
                     for r in reqs])}
            continue
        roles = events.get(mode)
        if not roles:
            continue
        proxy = read_proxy_marks(os.path.join(load_out, "logs", f"{mode}-proxy.log"))
        rows = request_rows(doc, roles.get("prefill", []), roles.get("decode", []), proxy)
        if rows:
            out["modes"][mode] = _medians(rows)
    return out


def step_periods(events: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """{"mode role": {n, p50, p90}}: each instance's engine step period (trace ``step``:
    scheduling to the next scheduling), in ms; periods over 1 s are idle, not steps."""
    out = {}
    for mode, roles in sorted(events.items()):
        for role, evs in sorted(roles.items()):
            vals = sorted(e["until_next_ms"] for e in evs if e.get("ev") == "step"
                          and e.get("until_next_ms") is not None and e["until_next_ms"] < 1e3)
            if vals:
                out[f"{mode} {role}"] = {"n": len(vals), "p50": round(median(vals), 2),
                                         "p90": round(percentile(vals, 0.9), 2)}
    return out


def _step_spans(evs: list[dict]) -> list[tuple[float, float]]:
    return sorted((e["start"], e["start"] + e["until_next_ms"] / 1e3) for e in evs
                  if e.get("ev") == "step" and e.get("start") is not None
                  and e.get("until_next_ms") is not None and e["until_next_ms"] < 1e3)


def d_steps_beside_p(events: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """{mode: {"beside": {n, p50}, "alone": {n, p50}}}: D's step periods split by
    whether one of P's steps ran during them (P and D on one GPU take turns on it; a
    load's decode tail is D's steps). 2026-11-28e (2 x H200, P and D on one GPU, eight
    loads, push and pull): D's steps beside one of P's took 4.2-6.8 ms p50 against
    3.3-5.2 alone (1.1-1.7x), and 42-74% of D's steps were beside one."""
    out = {}
    for mode, roles in sorted(events.items()):
        p_spans = _step_spans(roles.get("prefill", []))
        d_spans = _step_spans(roles.get("decode", []))
        if not p_spans or not d_spans:
            continue
        split: dict[str, list[float]] = {"beside": [], "alone": []}
        for start, end in d_spans:
            beside = any(ps < end and pe > start for ps, pe in p_spans)
            split["beside" if beside else "alone"].append(1e3 * (end - start))
        out[mode] = {k: {"n": len(v), "p50": round(median(v), 2) if v else None}
                     for k, v in split.items()}
    return out


def d_steps_first_forward(events: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """{mode: {"first": {n, p50, p90}, "other": {n, p50, p90}}}: D's step periods split by
    whether the step runs a loaded request's own first forward (a ``d_compute_scheduled``
    line from its start to the next scheduling: both are written while D's scheduler builds
    the step, the ``step`` line's start first). Such a step is on every PD request's way to
    its first token (``d_out``), so a cost that only these steps pay (the unpack, the new
    request's inputs, kvcached mapping its pages) shows here and not in the others.

    Why: 2026-11-29, one H200, P and D on it, push P-sync: vLLM 0.26.0's D ran these
    steps in 5.0-6.4 ms p50 (tiny) and 4.9 (kvbig) against 3.2-3.8 for its other steps;
    vLLM 0.30.0's (Model Runner V2) in 9.1-11.2 (tiny) and 17.8 (kvbig) against 3.5-4.3,
    and its PD loads were 1.39-1.47x one kvcached instance where 0.26.0's were 1.04-1.18x
    (``experiments/results/2026-11-29b-h200-vllm030-session/``)."""
    out = {}
    for mode, roles in sorted(events.items()):
        evs = roles.get("decode", [])
        spans = _step_spans(evs)
        firsts = sorted(e["t"] for e in evs if e.get("ev") == "d_compute_scheduled")
        if not spans or not firsts:
            continue
        split: dict[str, list[float]] = {"first": [], "other": []}
        for start, end in spans:
            i = bisect.bisect_left(firsts, start)
            first = i < len(firsts) and firsts[i] < end
            split["first" if first else "other"].append(1e3 * (end - start))
        out[mode] = {k: {"n": len(v), "p50": round(median(v), 2) if v else None,
                         "p90": round(percentile(v, 0.9), 2) if v else None}
                     for k, v in split.items()}
    return out


def prefill_budget(log_path: str) -> int | None:
    """P's token budget per step as vLLM logged it at start-up, None where not logged."""
    if not os.path.exists(log_path):
        return None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = BUDGET.search(line)
            if m:
                return int(m.group(1))
    return None


def passes_before_admit(events: dict[str, dict[str, list[dict]]],
                        budgets: dict[str, int | None]) -> dict[str, dict]:
    """{mode: {n, passed_over, full, not_full, admit_p50}}: P's scheduling passes that
    went by a client request (a ``load-...`` id: the load's and its warm-up's) between
    its arrival (vLLM's ``arrival_time``, set by P's API server) and the pass that
    admitted it (``p_admit``; a pass's ``step`` line is written when it ends, after its
    admissions). ``full``: passes whose step held P's whole token budget
    (``budgets[mode]``; None: unknown, not split), so that a request already queued had
    no room; ``not_full``: passes with room, where the request had not reached P's
    scheduler yet (the way from P's API server to its engine) or could not be scheduled
    for another reason (its KV blocks); the traces do not say which.

    Why: P's queue (arrival to the step that packs) is a PD request's largest stage on a
    tiny model (2026-11-28e: 38-53 ms of a 93-131 ms TTFT) while a P step is 13-21 ms.
    Read from 2026-11-28g's sixteen traced tiny loads: 62-79% of the requests were passed
    over by one or more passes, 29-55% of those passes full."""
    out = {}
    for mode, roles in sorted(events.items()):
        evs = roles.get("prefill", [])
        passes = sorted((e["start"], e.get("tokens") or 0) for e in evs
                        if e.get("ev") == "step" and e.get("start") is not None)
        budget = budgets.get(mode)
        n = passed = full = not_full = 0
        waits = []
        for e in evs:
            if e.get("ev") != "p_admit" or e.get("since_arrival_ms") is None \
                    or not CLIENT_ID.search(str(e.get("req", ""))):
                continue
            arrival = e["t"] - e["since_arrival_ms"] / 1e3
            went_by = [tokens for start, tokens in passes if arrival < start < e["t"]]
            n += 1
            passed += bool(went_by)
            if budget:
                full += sum(1 for t in went_by if t >= budget)
                not_full += sum(1 for t in went_by if t < budget)
            waits.append(e["since_arrival_ms"])
        if n:
            out[mode] = {"n": n, "passed_over": passed, "budget": budget,
                         "full": full if budget else None,
                         "not_full": not_full if budget else None,
                         "admit_p50": round(median(waits), 2)}
    return out


def _p50(cell: dict) -> str:
    return ("-" if cell["p50"] is None else f"{cell['p50']:.1f}") + f" ({cell['n']})"


def render(summary: dict) -> str:
    if not summary["modes"]:
        return "critical path: no traced PD requests (pd_load.py --trace?)\n"
    hdr = f"{'mode':<16} {'n':>4} " + " ".join(f"{s:>8}" for s in STAGES) + f" {'+ttft':>8}"
    lines = ["Where the time to first token goes, medians in ms (experiments/critical_path.py;"
             " +ttft: over one instance's):", hdr, "-" * len(hdr)]
    ref = summary["against"]
    if ref:
        cells = " ".join(f"{'-' if ref.get(s) is None else format(ref[s], '.1f'):>8}"
                         for s in STAGES)
        lines.append(f"{ref['name']:<16} {ref['n']:>4} {cells} {'':>8}")
    for mode, m in summary["modes"].items():
        cells = " ".join(f"{'-' if m[s] is None else format(m[s], '.1f'):>8}" for s in STAGES)
        extra = (format(m["ttft"] - ref["ttft"], ".1f")
                 if ref and m["ttft"] is not None and ref["ttft"] is not None else "-")
        lines.append(f"{mode:<16} {m['n']:>4} {cells} {extra:>8}")
    split = {mode: m for mode, m in summary["modes"].items()
             if any(m.get(s) is not None for s in PROXY_STAGES)}
    if split:
        hdr2 = f"{'mode':<16} " + " ".join(f"{s:>9}" for s in PROXY_STAGES)
        lines += ["The proxy's marks (pd_proxy.py --trace): to_p = to_proxy + proxy_p + p_api, "
                  "d_out = d_first + relay + to_client; medians in ms:", hdr2, "-" * len(hdr2)]
        for mode, m in split.items():
            lines.append(f"{mode:<16} " + " ".join(
                f"{'-' if m.get(s) is None else format(m[s], '.1f'):>9}" for s in PROXY_STAGES))
    if summary.get("steps"):
        lines.append("engine step periods, ms (p50 / p90, n): " + "; ".join(
            f"{k} {v['p50']:.1f} / {v['p90']:.1f} ({v['n']})"
            for k, v in summary["steps"].items()))
    if summary.get("beside"):
        lines.append("D's step periods beside one of P's steps / alone, ms (p50 (n)): " +
                     "; ".join(f"{mode} {_p50(v['beside'])} / {_p50(v['alone'])}"
                               for mode, v in summary["beside"].items()))
    if summary.get("first_forward"):
        lines.append("D's step periods with a loaded request's first forward / without, ms "
                     "(p50 (n)): " + "; ".join(
                         f"{mode} {_p50(v['first'])} / {_p50(v['other'])}"
                         for mode, v in summary["first_forward"].items()))
    if summary.get("passes"):
        lines.append("P's scheduling passes that went by a request before admitting it (after "
                     "its arrival at P's API server): requests passed over of n, passes with "
                     "P's token budget full / with room, arrival -> admit p50 ms: " + "; ".join(
                         f"{mode} {v['passed_over']} of {v['n']}, "
                         + (f"{v['full']} / {v['not_full']} (budget {v['budget']})"
                            if v["budget"] else "budget not logged")
                         + f", {v['admit_p50']:.1f}" for mode, v in summary["passes"].items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("load_out")
    ap.add_argument("--against", default="kvcached-single")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    summary = summarize(a.load_out, a.against)
    trace_timeline.emit(render(summary), summary, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
