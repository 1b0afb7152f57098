#!/usr/bin/env python3
"""vLLM's own client, `vllm bench serve`, against one instance, vanilla PD and kvcached-pd,
side by side: a prompt set, the same prompts again, and prompts that share prefixes.

Why: real traffic repeats prefixes (system prompts, multi-turn chat, agents re-sending
their history). On one H100 with P and D on it (vLLM 0.26.0, tiny model, random 2000
tokens in / 16 out, 64 prompts 16 at a time, through vLLM's toy NIXL proxy) the second
round of the same prompts had TTFT p50 103 ms on vanilla PD and 2322 ms on kvcached-pd,
which read each request's whole extent whatever D's prefix cache held; one instance
without PD: 63 ms. kvcached-pd now moves only the tokens D lacks (packed format 3); this
benchmark measures it with a client nobody here wrote, and reports the bytes each mode
moved per request from the servers' own metrics (kvcached-pd:
``vllm:kvcached_pd_moved_bytes`` on D; vanilla: ``vllm:nixl_bytes_transferred`` on D).

Workloads, in this order, on every mode (the servers stay up between them, so each one
meets the prefix caches the earlier ones left):

- ``round1``: ``--dataset-name random`` (``--input-len`` in, ``--output-len`` out,
  ``--num-prompts``, ``--concurrency``, ``--seed``);
- ``round2``: the very same command: every prompt is now in P's and D's prefix caches;
- ``prefix``: ``--dataset-name prefix_repetition`` (``--num-prefixes`` prefixes of
  ``--prefix-len`` tokens, each followed by its own ``--suffix-len`` tokens; another seed,
  so the prefixes are new).

Servers start through the load harness (``pd_load.LoadHarness``: the same flavours,
kvcached's default settings, one proxy per PD pair) with prefix caching on
(``--enable-prefix-caching``) and an explicit KV budget large enough that round 1 stays
cached (``--kv-cache-gib``). Outputs are not compared here (random prompts, no batch
invariance: the equivalence and load harnesses check bytes); a request that failed or a
mode that did not start makes the run fail (exit 1).

On the GPU host (~5 minutes for four modes on the tiny model)::

    python3 experiments/bench_serve.py --out /tmp/serve --model /tmp/tiny \\
        --prefill-gpu 0 --decode-gpu 0

Writes ``OUT/summary.txt`` (printed too), ``OUT/summary.json``, ``OUT/client/*.json``
(each ``vllm bench serve`` result) and ``OUT/logs/`` (every instance's log).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pd_load
from load_checks import NA, PASS, check_wire
from pd_load import _f
from pd_common import M, Deadline, log, metric_delta, scrape_metrics, write_json
from pd_modes import LOAD_FLAVOURS
from pd_servers import stop_all, wire_evidence

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ("round1", "round2", "prefix")
DEFAULT_MODES = "vanilla,kvpd-staged,kvpd-push"
PERCENTILES = "50,90"
NIXL_BYTES_SUM = "vllm:nixl_bytes_transferred_sum"
NIXL_BYTES_COUNT = "vllm:nixl_bytes_transferred_count"
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # tokens served from the local prefix cache
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help="PD modes (the load harness's names); one instance without PD "
                         "always runs first")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"a subset of {', '.join(WORKLOADS)}, run in that order")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="round1 and round2")
    ap.add_argument("--prefix-len", type=int, default=1800)
    ap.add_argument("--suffix-len", type=int, default=200)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-seed", type=int, default=1)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV budget per instance (default: every prompt of the run cached, "
                         "x1.5, at least 2)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--push-concurrent", action="store_true",
                    help="push mode: the proxy sends both legs at once")
    ap.add_argument("--expect-wire", choices=("nixl", "ipc"), default=None,
                    help="the wire every staged D must name in its log")
    ap.add_argument("--prefill-gpu", default="0")
    ap.add_argument("--decode-gpu", default="1")
    ap.add_argument("--client-cmd", default=None,
                    help="command that runs `vllm bench serve` (default: this interpreter's "
                         "vLLM)")
    ap.add_argument("--client-timeout-s", type=float, default=180.0)
    ap.add_argument("--vllm-cmd", default=os.environ.get("KVPD_VLLM_CMD"))
    ap.add_argument("--extra-serve-args", default="--enable-prefix-caching")
    ap.add_argument("--kvcached-env", action="append", default=[], metavar="KEY=VALUE",
                    help="a kvcached setting for its instances, e.g. "
                         "KVCACHED_MAX_CACHED_TOKENS=200000 (kvcached keeps at most 16000 "
                         "tokens of freed prefix blocks by default)")
    ap.add_argument("--health-timeout", type=float, default=300.0)
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--port-base", type=int, default=None)
    a = ap.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        if m not in LOAD_FLAVOURS:
            ap.error(f"--modes: unknown mode {m!r}; known: {', '.join(LOAD_FLAVOURS)}")
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    for w in a.workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    if "round2" in a.workloads and "round1" not in a.workloads:
        ap.error("--workloads: round2 repeats round1; name round1 too")
    for name in ("num_prompts", "concurrency", "input_len", "output_len", "prefix_len",
                 "suffix_len", "num_prefixes"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    longest = max(a.input_len, a.prefix_len + a.suffix_len) + a.output_len
    if longest > a.max_model_len:
        ap.error(f"prompts of up to {longest} tokens with output do not fit --max-model-len "
                 f"{a.max_model_len}")
    return a


def load_harness_args(a: argparse.Namespace) -> argparse.Namespace:
    """The load harness's options for the same servers: its flavours, ports and budget."""
    argv = ["--out", a.out, "--model", a.model, "--modes", ",".join(a.modes),
            "--requests", "1", "--max-model-len", str(a.max_model_len),
            "--max-prompt-tokens", str(min(3800, a.max_model_len - 16)),
            "--no-batch-invariant", "--prefill-gpu", str(a.prefill_gpu),
            "--decode-gpu", str(a.decode_gpu), "--health-timeout", str(a.health_timeout),
            "--deadline-s", str(a.deadline_s), f"--extra-serve-args={a.extra_serve_args}",
            "--request-timeout", str(a.client_timeout_s),
            # one short request, as before: a long one would sit in the prefix cache that
            # round 2 and serve-cap measure (kvcached's default holds 16000 tokens)
            "--no-long-warm-up"]
    if a.kv_cache_gib is None:
        per_token = pd_load.kv_bytes_per_token(a.model) or 32 * 1024
        tokens = a.num_prompts * (a.input_len + a.output_len) + \
            a.num_prompts * (a.suffix_len + a.output_len) + a.num_prefixes * a.prefix_len
        a.kv_cache_gib = max(2.0, float(-(-tokens * per_token * 1.5 // (1 << 30))))
    argv += ["--kv-cache-gib", str(a.kv_cache_gib)]
    if a.push_concurrent:
        argv.append("--push-concurrent")
    for item in a.kvcached_env:
        argv += ["--kvcached-env", item]
    if a.expect_wire:
        argv += ["--expect-wire", a.expect_wire]
    if a.vllm_cmd:
        argv += ["--vllm-cmd", a.vllm_cmd]
    if a.port_base:
        argv += ["--port-base", str(a.port_base), "--side-channel-port-base",
                 str(a.port_base + 200), "--proxy-port-base", str(a.port_base + 400)]
    return pd_load.parse_args(argv)


def client_cmd(a: argparse.Namespace, url: str, workload: str, result: str) -> list[str]:
    base = shlex.split(a.client_cmd) if a.client_cmd else \
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    cmd = base + [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", a.model, "--tokenizer", a.model,
        "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency),
        "--request-rate", "inf", "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
        "--save-result", "--result-dir", os.path.dirname(result),
        "--result-filename", os.path.basename(result)]
    if workload in ("round1", "round2"):
        cmd += ["--dataset-name", "random", "--random-input-len", str(a.input_len),
                "--random-output-len", str(a.output_len), "--seed", str(a.seed)]
    else:
        cmd += ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(a.prefix_len),
                "--prefix-repetition-suffix-len", str(a.suffix_len),
                "--prefix-repetition-num-prefixes", str(a.num_prefixes),
                "--prefix-repetition-output-len", str(a.output_len),
                "--seed", str(a.prefix_seed)]
    return cmd


def client_metrics(doc: dict) -> dict:
    """What the summary reads from one `vllm bench serve` result file."""
    keys = ("completed", "failed", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p90_ttft_ms", "median_e2el_ms", "p90_e2el_ms", "median_tpot_ms", "p90_tpot_ms",
            "duration", "total_input_tokens")
    return {k: doc.get(k) for k in keys}


def server_counters(before: dict, after: dict) -> dict:
    """Deltas of the servers' own counters over one workload (D's, or the one instance's)."""
    role = "decode" if "decode" in after else "single"
    b, c = before.get(role), after.get(role)
    moved = metric_delta(b, c, M.KVPD_MOVED_SUM)
    moved_n = metric_delta(b, c, M.KVPD_MOVED_COUNT)
    nixl = metric_delta(b, c, NIXL_BYTES_SUM)
    nixl_n = metric_delta(b, c, NIXL_BYTES_COUNT)
    return {
        "role": role,
        "kvpd_moved_bytes": moved, "kvpd_loads": moved_n,
        "kvpd_prefix_skipped_bytes": metric_delta(b, c, M.KVPD_SKIPPED),
        "nixl_bytes": nixl, "nixl_transfers": nixl_n,
        "prefix_cache_hit_tokens": metric_delta(b, c, PREFIX_HITS),
        "prefix_cache_query_tokens": metric_delta(b, c, PREFIX_QUERIES),
        "p_prefix_cache_hit_tokens": metric_delta(before.get("prefill"), after.get("prefill"),
                                                  PREFIX_HITS),
        "wire_fallbacks": metric_delta(b, c, M.KVPD_WIRE_FALLBACKS),
    }


def run_workload(a, run, workload: str, out_dir: str, deadline: Deadline) -> dict:
    result = os.path.join(out_dir, "client", f"{run.mode.name}-{workload}.json")
    os.makedirs(os.path.dirname(result), exist_ok=True)
    cmd = client_cmd(a, run.url, workload, result)
    log_path = os.path.join(out_dir, "logs", f"client-{run.mode.name}-{workload}.log")
    before = {role: scrape_metrics(run.base(role)) for role in run.instances}
    t0 = time.monotonic()
    timeout = max(10.0, min(a.client_timeout_s, deadline.remaining() - 15))
    with open(log_path, "w", encoding="utf-8") as logf:
        logf.write("$ " + shlex.join(cmd) + "\n")
        logf.flush()
        try:
            rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout,
                                env=dict(os.environ, HF_HUB_OFFLINE="1")).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.monotonic() - t0
    after = {role: scrape_metrics(run.base(role)) for role in run.instances}
    entry = {"workload": workload, "rc": rc, "wall_s": round(wall, 1), "command": cmd,
             "counters": server_counters(before, after)}
    if os.path.isfile(result):
        with open(result, encoding="utf-8") as f:
            entry["client"] = client_metrics(json.load(f))
    else:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            entry["error"] = f"no result file (rc {rc}); client log tail:\n" + \
                "".join(f.readlines()[-15:])
    c = entry.get("client") or {}
    log(f"{run.mode.name:<12} {workload:<7} rc {rc}: {c.get('completed')} done, "
        f"{c.get('failed')} failed, TTFT p50 {_f(c.get('median_ttft_ms'))} ms p90 "
        f"{_f(c.get('p90_ttft_ms'))} ms, {_f(c.get('request_throughput'), 2)} req/s; "
        f"moved {_bytes_per_request(entry)}/request")
    return entry


def _bytes_per_request(entry: dict) -> str:
    c, n = entry["counters"], (entry.get("client") or {}).get("completed")
    moved = c["kvpd_moved_bytes"] if c["kvpd_moved_bytes"] is not None else c["nixl_bytes"]
    if moved is None or not n:
        return "-"
    return f"{moved / n / (1 << 20):.2f} MiB"


def verdict(doc: dict) -> tuple[str, list[str]]:
    problems = []
    for mode in doc["modes"]:
        if mode.get("error"):
            problems.append(f"{mode['name']}: {mode['error']}")
        for w in mode.get("workloads", []):
            c = w.get("client")
            if c is None:
                problems.append(f"{mode['name']}/{w['workload']}: {w.get('error', 'no result')}")
            elif (c.get("failed") or 0) > 0 or c.get("completed") != doc["num_prompts"]:
                problems.append(f"{mode['name']}/{w['workload']}: {c.get('completed')} of "
                                f"{doc['num_prompts']} completed, {c.get('failed')} failed")
        wire = mode.get("wire")
        if wire is not None and wire["status"] not in (PASS, NA):
            problems.append(f"{mode['name']}: wire {wire['status']}: {wire['detail']}")
    return ("PASS" if not problems else "FAIL"), problems


def render_summary(doc: dict) -> str:
    lines = [f"bench_serve: vllm bench serve, {doc['num_prompts']} prompts, "
             f"{doc['concurrency']} at a time, model {doc['model']}; random {doc['input_len']} "
             f"in / {doc['output_len']} out (round1, round2 = the same prompts); prefix: "
             f"{doc['num_prefixes']} prefixes x {doc['prefix_len']} + {doc['suffix_len']} "
             f"tokens; P on GPU {doc['prefill_gpu']}, D on GPU {doc['decode_gpu']}; kvcached "
             f"settings: {doc.get('kvcached_env') or 'its defaults'}", ""]
    head = (f"{'mode':<12} {'workload':<8} {'done':>5} {'TTFT p50':>9} {'p90':>8} "
            f"{'e2e p50':>8} {'p90':>8} {'req/s':>7} {'MiB moved/req':>14} "
            f"{'D hit tokens':>12} {'x vanilla p50/p90':>18}")
    lines += [head, "-" * len(head)]
    van = {w["workload"]: w.get("client") or {} for m in doc["modes"] if m["name"] == "vanilla"
           for w in m.get("workloads", [])}
    for mode in doc["modes"]:
        if mode.get("error"):
            lines.append(f"{mode['name']:<12} not run: {mode['error']}")
            continue
        for w in mode.get("workloads", []):
            c, k = w.get("client") or {}, w["counters"]
            v = van.get(w["workload"], {})
            ratio = "-"
            if mode["name"] != "vanilla" and v.get("median_ttft_ms") and c.get("median_ttft_ms"):
                ratio = (f"{c['median_ttft_ms'] / v['median_ttft_ms']:.2f}/"
                         f"{c['p90_ttft_ms'] / v['p90_ttft_ms']:.2f}")
            hits = k.get("prefix_cache_hit_tokens")
            lines.append(
                f"{mode['name']:<12} {w['workload']:<8} {c.get('completed', '-')!s:>5} "
                f"{_f(c.get('median_ttft_ms')):>9} {_f(c.get('p90_ttft_ms')):>8} "
                f"{_f(c.get('median_e2el_ms')):>8} {_f(c.get('p90_e2el_ms')):>8} "
                f"{_f(c.get('request_throughput'), 2):>7} {_bytes_per_request(w):>14} "
                f"{'-' if hits is None else int(hits):>12} {ratio:>18}")
    lines += ["", "MiB moved/req: D's vllm:kvcached_pd_moved_bytes (kvcached-pd) or "
              "vllm:nixl_bytes_transferred (vanilla) over the workload, per completed request; "
              "D hit tokens: vllm:prefix_cache_hits_total on D (or the one instance)."]
    for mode in doc["modes"]:
        if mode.get("wire") is not None:
            lines.append(f"wire {mode['name']}: {mode['wire']['status']}, "
                         f"{mode['wire']['detail']}")
    lines += ["", f"verdict: {doc['verdict']}"] + [f"  - {p}" for p in doc["problems"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    la = load_harness_args(a)
    h = pd_load.LoadHarness(la)
    signal.signal(signal.SIGTERM, pd_load._raise_interrupt)
    deadline = Deadline(a.deadline_s)
    doc = {k: getattr(a, k) for k in ("model", "num_prompts", "concurrency", "input_len",
                                      "output_len", "seed", "prefix_len", "suffix_len",
                                      "num_prefixes", "prefill_gpu", "decode_gpu",
                                      "kv_cache_gib", "expect_wire", "push_concurrent")}
    doc["kvcached_env"] = la.kvcached_env
    doc.update(started=time.strftime("%F %T"), modes=[], workloads=a.workloads,
               extra_serve_args=a.extra_serve_args)
    log(f"bench_serve: reference + {', '.join(a.modes)} on {a.model}, workloads "
        f"{', '.join(a.workloads)} -> {h.out}")
    try:
        h.start(pd_load.load_modes(la.modes, la.kvcached_layout))
        for run in h.runs.values():  # the reference first, as the load harness orders them
            entry = {"name": run.mode.name, "workloads": []}
            doc["modes"].append(entry)
            if run.broken:
                entry["error"] = f"{run.broken}: {run.infra_error}"
                continue
            h.warm_up(run)
            for workload in a.workloads:
                if deadline.remaining() < 30:
                    entry["error"] = f"out of time before {workload} (--deadline-s)"
                    break
                entry["workloads"].append(run_workload(a, run, workload, h.out, deadline))
                write_json(os.path.join(h.out, "summary.json"), doc)
    except KeyboardInterrupt:
        doc["interrupted"] = True
        log("interrupted: writing what was measured")
    finally:
        stop_all([p for r in h.runs.values() for p in r.procs()])
    for entry in doc["modes"]:
        run = h.runs.get(entry["name"])
        if run is not None and run.mode.is_pd and "decode" in run.instances:
            ev = wire_evidence(run.instances["decode"].log_path)
            seen = [w["counters"]["wire_fallbacks"] for w in entry["workloads"]
                    if w["counters"]["wire_fallbacks"] is not None]
            entry["wire"] = check_wire(run.expected_wire, ev["wires"],
                                       sum(seen) if seen else None)
    doc["verdict"], doc["problems"] = verdict(doc)
    write_json(os.path.join(h.out, "summary.json"), doc)
    text = render_summary(doc)
    with open(os.path.join(h.out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text, flush=True)
    return 0 if doc["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
