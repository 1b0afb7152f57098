#!/usr/bin/env python3
"""Greedy-output equivalence of every PD mode against a no-PD reference, with proof that
the KV cache really crossed the wire.

For each mode (see pd_modes.py) this starts its vLLM instances (P on the prefill GPU,
D on the decode GPU; the reference is one instance), a pd_proxy.py in front of each
PD pair, and runs pd_client's fixed prompt set through it. Several modes run at the
same time (--parallel) to save wall time; every instance has its own ports and
KVCACHED_IPC_NAME.

A mode PASSES when all its requests succeed, its output token ids equal the baseline's
byte for byte, and D's Prometheus counters prove that D loaded the prompts' KV from P
instead of computing it: vllm:external_prefix_cache_hits grew by the number of prompt
tokens (at least prompt tokens minus one per request), and D computed at most one
prompt token per request locally (vllm:prompt_tokens_by_source{source=local_compute}).
Two prompts share a 700-token prefix: the second finds it in D's own prefix cache
(source=local_cache_hit), which the proof subtracts, and D receives only the rest.
The negative control (KVCACHED_PD_TEST_CORRUPT=1) passes only when its outputs DIFFER.
With --expect-wire ipc|nixl a staged pair must also be served by that wire where the mode
does not force one: D's log names it for its peer, and D's
vllm:kvcached_pd_wire_fallbacks_total did not grow.

Writes under OUTDIR: logs/ (one time-stamped log per instance and proxy), modes/<mode>.json,
summary.json, summary.txt, environment.json. Exit status 0 only if every required mode passed.

usage: equivalence.py OUTDIR [MODES...|all] [--parallel N] [--deadline-s S]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pd_client import compare_outputs, run_suite
from pd_common import M, Deadline, MetricSnapshot, log, metric_delta, scrape_metrics, write_json
from pd_modes import WIRES, MODES, Mode, expected_wire, kv_transfer_config, resolve_modes
from pd_servers import (HTTP_PORT_BASE, PROXY_PORT_BASE, SIDE_CHANNEL_PORT_BASE, ManagedProcess,
                        PortAllocator, describe_environment, serve_settings_from_args,
                        instance_env,
                        indent, kvcached_pd_evidence, neutral_env, serve_args, stop_all,
                        wait_until_ready, wire_evidence,
                        write_vllm_logging_config)

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class ModeRun:
    """Everything about one mode in one harness run."""

    mode: Mode
    instances: dict[str, ManagedProcess] = field(default_factory=dict)  # role -> process
    ports: dict[str, dict] = field(default_factory=dict)
    proxy: ManagedProcess | None = None
    client_url: str | None = None
    metrics_before: dict[str, MetricSnapshot | None] = field(default_factory=dict)
    metrics_after: dict[str, MetricSnapshot | None] = field(default_factory=dict)
    suite: dict | None = None
    infra_error: str | None = None

    def all_procs(self) -> list[ManagedProcess]:
        return list(self.instances.values()) + ([self.proxy] if self.proxy else [])


class Harness:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = os.path.abspath(args.outdir)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(os.path.join(self.out, "modes"), exist_ok=True)
        self.run_tag = uuid.uuid4().hex[:6]
        self.http_ports = PortAllocator(args.port_base)
        self.side_ports = PortAllocator(args.side_channel_port_base)
        self.proxy_ports = PortAllocator(args.proxy_port_base)
        self.deadline = Deadline(args.deadline_s)
        self.settings = serve_settings_from_args(
            args, kv_role_style="both" if args.kv_both else "split",
            logging_config_path=None if args.no_logging_config else
            write_vllm_logging_config(os.path.join(self.out, "vllm_logging.json")))

    # ---- instances -------------------------------------------------------------------
    def _instance(self, run: ModeRun, role: str, gpu: str) -> ManagedProcess:
        mode = run.mode
        cfg = {"single": mode.single, "prefill": mode.prefill, "decode": mode.decode}[role]
        port, side = self.http_ports.take(), self.side_ports.take()
        ipc = f"kvpd_{self.run_tag}_{mode.name}_{role}".replace("-", "_")
        engine_id = f"{mode.name}-{role}-{self.run_tag}"
        kvt = None
        if role != "single":
            kv_role = "kv_both" if self.settings.kv_role_style == "both" else \
                ("kv_producer" if role == "prefill" else "kv_consumer")
            kvt = kv_transfer_config(mode.connector, kv_role, engine_id)
        cmd = self.settings.vllm_cmd + serve_args(
            self.settings, port, cfg.block_size, kvt, cfg.serve_args)
        env = instance_env(cfg, gpu, side, ipc, self.settings.logging_config_path)
        if self.args.batch_invariant:
            env["VLLM_BATCH_INVARIANT"] = "1"
        shown = dict(cfg.env, CUDA_VISIBLE_DEVICES=gpu, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side),
                     KVCACHED_IPC_NAME=ipc)
        proc = ManagedProcess(f"{mode.name}/{role}", cmd, env,
                              os.path.join(self.logs, f"{mode.name}-{role}.log"),
                              f"http://127.0.0.1:{port}/health")
        proc.env_shown = shown  # type: ignore[attr-defined]
        run.ports[role] = {"http": port, "side_channel": side, "gpu": gpu, "engine_id": engine_id,
                           "ipc_name": ipc, "flavor": cfg.flavor, "block_size": cfg.block_size,
                           "kvcached_pd_expected": cfg.env.get("KVCACHED_PD") == "1"}
        return proc

    def launch(self, run: ModeRun) -> None:
        a = self.args
        roles = [("single", a.single_gpu)] if not run.mode.is_pd else \
            [("prefill", a.prefill_gpu), ("decode", a.decode_gpu)]
        for role, gpu in roles:
            proc = self._instance(run, role, str(gpu))
            run.instances[role] = proc
            proc.start(proc.env_shown)  # type: ignore[attr-defined]

    def start_proxy(self, run: ModeRun) -> None:
        port = self.proxy_ports.take()
        p, d = run.ports["prefill"], run.ports["decode"]
        cmd = [sys.executable, os.path.join(HERE, "pd_proxy.py"), "--port", str(port),
               "--prefill", f"http://127.0.0.1:{p['http']}",
               "--decode", f"http://127.0.0.1:{d['http']}",
               "--timeout", str(self.args.request_timeout)]
        if run.mode.connector == "NixlPushConnector" and self.args.push_concurrent:
            cmd += ["--push-concurrent", "--prefill-engine-id", p["engine_id"],
                    "--prefill-side-channel-port", str(p["side_channel"])]
        run.proxy = ManagedProcess(f"{run.mode.name}/proxy", cmd, neutral_env(),
                                   os.path.join(self.logs, f"{run.mode.name}-proxy.log"),
                                   f"http://127.0.0.1:{port}/healthz")
        run.proxy.start()
        run.client_url = f"http://127.0.0.1:{port}"

    # ---- one batch of modes ----------------------------------------------------------
    def run_batch(self, modes: list[Mode]) -> list[ModeRun]:
        runs = [ModeRun(m) for m in modes]
        log(f"batch: {', '.join(m.name for m in modes)}")
        try:
            for run in runs:
                self.launch(run)
            instances = [p for r in runs for p in r.instances.values()]
            wait_until_ready(instances, min(self.args.health_timeout,
                                            max(10.0, self.deadline.remaining() - 40)))
            for run in runs:
                bad = [p for p in run.instances.values() if p.state != "ready"]
                if bad:
                    run.infra_error = "; ".join(f"{p.name}: {p.failure}" for p in bad)
                elif run.mode.is_pd:
                    self.start_proxy(run)
                else:
                    run.client_url = f"http://127.0.0.1:{run.ports['single']['http']}"
            proxies = [r.proxy for r in runs if r.proxy is not None]
            wait_until_ready(proxies, 30.0, poll_s=0.2)
            for run in runs:
                if run.proxy is not None and run.proxy.state != "ready":
                    run.infra_error = f"proxy: {run.proxy.failure}"
            ready = [r for r in runs if r.infra_error is None]
            for run in ready:
                run.metrics_before = self._scrape(run)
            # no `with`: on an interrupt the servers must be stopped (finally below)
            # without first waiting for client threads blocked on those servers
            pool = ThreadPoolExecutor(max_workers=max(1, len(ready)))
            try:
                futures = [pool.submit(self._run_client, run) for run in ready]
                for run, fut in zip(ready, futures):
                    run.suite = fut.result()
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
            for run in ready:
                self._settle_metrics(run)
                run.metrics_after = self._scrape(run)
                dead = [p for p in run.all_procs() if not p.alive()]
                for p in dead:
                    time.sleep(0.3)  # let the log reader drain the last lines
                    log(f"DIED   {p.name} during the requests (exit code {p.proc.returncode}); "
                        f"last lines of {p.log_path}:\n" + indent(p.tail(40)))
                if dead:
                    run.infra_error = "died during the requests: " + ", ".join(
                        f"{p.name} (exit code {p.proc.returncode})" for p in dead)
        finally:
            stop_all([p for r in runs for p in r.all_procs()])
        return runs

    def _run_client(self, run: ModeRun) -> dict | None:
        # leave time for the metrics, the shutdown and the summary
        deadline = time.monotonic() + self.deadline.remaining() - 30 \
            if self.deadline.seconds else None
        try:
            suite = run_suite(run.client_url, self.args.model, self.args.max_tokens,
                              self.args.max_model_len, not self.args.no_batch,
                              self.args.request_timeout, label=run.mode.name, deadline=deadline)
        except Exception as exc:  # a client bug must not lose the other modes' results
            run.infra_error = f"client crashed: {type(exc).__name__}: {exc}"
            return None
        log(f"{run.mode.name}: {suite['n_ok']}/{suite['n_requests']} requests ok in "
            f"{suite['wall_s']:.1f}s, sha256 {suite['fingerprint_sha256'][:16]}")
        return suite

    @staticmethod
    def _scrape(run: ModeRun) -> dict[str, MetricSnapshot | None]:
        out = {}
        for role, proc in run.instances.items():
            out[role] = scrape_metrics(proc.health_url.rsplit("/", 1)[0]) if proc.alive() else None
        return out

    def _settle_metrics(self, run: ModeRun, timeout_s: float = 5.0) -> None:
        """Wait until D's finished-request counter covers every successful request, so
        the counters read afterwards include the last request's statistics."""
        role = "decode" if run.mode.is_pd else "single"
        proc = run.instances[role]
        want = run.suite["n_ok"] if run.suite else 0
        base = run.metrics_before.get(role)
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end and proc.alive():
            snap = scrape_metrics(proc.health_url.rsplit("/", 1)[0])
            done = metric_delta(base, snap, M.REQUEST_SUCCESS)
            if done is None or done >= want:
                return
            time.sleep(0.1)


# ---- evaluation ----------------------------------------------------------------------


def kv_proof(run: ModeRun) -> dict:
    """Did D load every prompt's KV from P? Read from D's (and P's) Prometheus counters."""
    suite = run.suite or {}
    reqs = suite.get("requests", [])
    if not reqs or not all(r["ok"] for r in reqs):
        return {"checked": False, "ok": False, "reason": "not checked: some requests failed"}
    d_before, d_after = run.metrics_before.get("decode"), run.metrics_after.get("decode")
    p_before, p_after = run.metrics_before.get("prefill"), run.metrics_after.get("prefill")
    n = len(reqs)
    prompt_total = sum(r["prompt_tokens"] or 0 for r in reqs)
    hits = metric_delta(d_before, d_after, M.EXT_HITS)
    queries = metric_delta(d_before, d_after, M.EXT_QUERIES)
    local = metric_delta(d_before, d_after, M.PROMPT_BY_SOURCE, source="local_compute")
    # tokens D found in its own prefix cache (the shared-prefix prompts): D loads the rest
    cached = metric_delta(d_before, d_after, M.PROMPT_BY_SOURCE, source="local_cache_hit") or 0
    external = metric_delta(d_before, d_after, M.PROMPT_BY_SOURCE, source="external_kv_transfer")

    def both(name: str) -> float | None:
        vals = [metric_delta(b, a, name) for b, a in ((d_before, d_after), (p_before, p_after))]
        vals = [v for v in vals if v is not None]
        return sum(vals) if vals else None

    nixl_bytes, nixl_count = both(M.NIXL_BYTES_SUM), both(M.NIXL_XFER_COUNT)
    nixl_time, nixl_failed = both(M.NIXL_XFER_SUM), both(M.NIXL_FAILED)
    problems = []
    if d_after is None:
        problems.append("could not read D's /metrics")
    elif hits is None:
        problems.append(f"D's /metrics has no {M.EXT_HITS}")
    elif not (prompt_total - cached - n <= hits <= prompt_total - cached):
        problems.append(f"D's external prefix cache hits grew by {hits:.0f}, expected "
                        f"{prompt_total - cached - n:.0f}..{prompt_total - cached:.0f} (sum of "
                        f"prompt tokens less {cached:.0f} from D's own prefix cache): "
                        "D did not load the KV from P")
    if local is not None and local > n:
        problems.append(f"D computed {local:.0f} prompt tokens locally (at most {n} expected): "
                        "D recomputed prompts")
    if nixl_failed:
        problems.append(f"{nixl_failed:.0f} failed NIXL transfers")
    return {
        "checked": True, "ok": not problems, "problems": problems,
        "requests": n, "prompt_tokens_total": prompt_total,
        "d_external_prefix_cache_hits": hits, "d_external_prefix_cache_queries": queries,
        "d_prompt_tokens_local_compute": local, "d_prompt_tokens_external_kv_transfer": external,
        "d_prompt_tokens_local_cache_hit": cached,
        "nixl_bytes": nixl_bytes, "nixl_transfers": nixl_count, "nixl_xfer_seconds": nixl_time,
        "nixl_failed_transfers": nixl_failed,
    }


def activation_evidence(run: ModeRun) -> dict:
    """Did kvcached-pd run exactly where the mode says? From each instance's log.

    A kvcached-pd line in an instance run with KVCACHED_PD=0, or a failed patch, is a
    problem; no line at all where it should run is only noted (log wording may change)."""
    per_role, problems, notes = {}, [], []
    for role, proc in run.instances.items():
        ev = kvcached_pd_evidence(proc.log_path)
        expected = run.ports.get(role, {}).get("kvcached_pd_expected", False)
        ev["expected"] = expected
        per_role[role] = ev
        if not expected and ev["applied"]:
            problems.append(f"kvcached-pd patched {role} although KVCACHED_PD=0: {ev['applied']}")
        if expected and ev["failed"]:
            problems.append(f"kvcached-pd patches failed on {role}: {ev['failed']}")
        if expected and not ev["seen"] and proc.state != "failed":
            notes.append(f"{role}: no kvcached-pd log line (activation not confirmed)")
    return {"instances": per_role, "problems": problems, "notes": notes}


def wire_proof(run: ModeRun, default: str | None) -> dict:
    """Which wire served D's staged peer, against the one expected (pd_modes.expected_wire
    with ``default`` for modes that leave the choice to kvcached-pd)."""
    expected = expected_wire(run.mode, default)
    proc = run.instances.get("decode")
    wires = wire_evidence(proc.log_path)["wires"] if proc else []
    d_after = run.metrics_after.get("decode")  # D's fallbacks since it started
    fallbacks = d_after.total(M.KVPD_WIRE_FALLBACKS) if d_after is not None else None
    problems, notes = [], []
    if expected is not None and run.suite is not None:
        if not wires:
            problems.append(f"D's log names no wire for its staged peer (expected {expected})")
        elif wires != [expected]:
            problems.append(f"D's log names wire {'/'.join(wires)} for its peer, expected "
                            f"{expected}")
        if fallbacks:
            problems.append(f"{fallbacks:.0f} peers fell back from IPC to NIXL on D")
        elif fallbacks is None and expected == "ipc":
            notes.append(f"D exports no {M.KVPD_WIRE_FALLBACKS}")
    return {"expected": expected, "wires": wires, "wire_fallbacks": fallbacks,
            "problems": problems, "notes": notes}


def describe_differences(cmp: dict) -> str:
    """Which prompts differ and where: sequential vs concurrent-batch prompts, and the
    first differing token (late, isolated flips in the batch point at batch-dependent
    numerics; early ones on every prompt at corrupted KV)."""
    diffs = cmp["different"]
    seq = [d for d in diffs if d["name"].startswith("seq-")]
    parts = [f"{len(seq)} sequential, {len(diffs) - len(seq)} batch"]
    firsts = ", ".join(f"{d['name']}:{d['first_diff_index']}" for d in diffs[:6])
    parts.append("first differing token at " + firsts + (" ..." if len(diffs) > 6 else ""))
    return "; ".join(parts)


def evaluate(runs: dict[str, ModeRun], baseline_name: str,
             expect_wire: str | None = None) -> dict[str, dict]:
    base_run = runs.get(baseline_name)
    baseline = base_run.suite if base_run and base_run.suite and \
        base_run.suite["n_failed"] == 0 else None
    vanilla_run = runs.get("vanilla")
    vanilla = vanilla_run.suite if vanilla_run and vanilla_run.suite else None
    results = {}
    for name, run in runs.items():
        m = run.mode
        res = {"mode": name, "description": m.description, "connector": m.connector,
               "optional": m.optional, "expect_different": m.expect_different,
               "instances": run.ports, "infra_error": run.infra_error,
               "logs": {r: p.log_path for r, p in run.instances.items()}}
        reasons: list[str] = []
        wrong_output = False
        suite = run.suite
        if run.infra_error:
            reasons.append(run.infra_error)
        if suite is None:
            if not run.infra_error:
                reasons.append("no client results")
        else:
            res.update(fingerprint_sha256=suite["fingerprint_sha256"], n_ok=suite["n_ok"],
                       n_requests=suite["n_requests"], compare_on=suite["compare_on"])
            if suite["n_failed"]:
                errs = [f"{r['name']}: HTTP {r['status']}: {(r['error'] or '')[:200]}"
                        for r in suite["requests"] if not r["ok"]]
                reasons.append(f"{suite['n_failed']} requests failed: " + " | ".join(errs[:3]))
            if m.is_pd:
                res["kv_proof"] = proof = kv_proof(run)
                if proof["checked"] and not proof["ok"]:
                    reasons.extend(proof["problems"])
                res["wire"] = wire = wire_proof(run, expect_wire)
                reasons.extend(wire["problems"])
            if name != baseline_name:
                if baseline is None:
                    reasons.append(f"baseline {baseline_name!r} has no complete results")
                else:
                    res["vs_baseline"] = cmp = compare_outputs(suite, baseline)
                    all_ok = suite["n_failed"] == 0
                    if m.expect_different:
                        twin = runs.get(m.clean_twin) if m.clean_twin else None
                        if twin and twin.suite and twin.suite["n_failed"] == 0:
                            res["vs_clean_twin"] = cmp = compare_outputs(suite, twin.suite)
                            against = f"its clean twin {m.clean_twin}"
                        else:
                            against = baseline_name
                        if cmp["n_different"] == 0 and all_ok:
                            reasons.append(f"negative control MATCHED {against}: the corruption "
                                           "was not detected")
                            wrong_output = True
                        elif all_ok:
                            res["note"] = (f"negative control differs from {against} in "
                                           f"{cmp['n_different']} outputs (as it must)")
                    elif cmp["n_different"]:
                        reasons.append(f"{cmp['n_different']} outputs differ from {baseline_name}: "
                                       + describe_differences(cmp))
                        wrong_output = all_ok
                if vanilla is not None and name not in ("vanilla", baseline_name):
                    res["vs_vanilla"] = compare_outputs(suite, vanilla)
        res["kvcached_pd"] = activation = activation_evidence(run)
        reasons.extend(activation["problems"])
        res["reasons"] = reasons
        res["wrong_output"] = wrong_output
        if not reasons:
            res["verdict"] = "PASS"
        else:
            res["verdict"] = "FAIL-OPTIONAL" if m.optional and not wrong_output else "FAIL"
        results[name] = res
    return results


def render_table(results: dict[str, dict], baseline_name: str) -> str:
    hdr = f"{'mode':<20} {'verdict':<13} {'ok/req':>7} {'vs ' + baseline_name:>14} " \
          f"{'vs vanilla':>10} {'ext hits/prompt':>17} {'NIXL MiB':>9} {'kvpd':>5} " \
          f"{'wire':>5}  sha256[:16]"
    lines = [hdr, "-" * len(hdr)]
    for name, r in results.items():
        cmp = r.get("vs_baseline")
        cmpt = "(baseline)" if name == baseline_name else \
            (f"{cmp['n_different']} diff" if cmp else "-")
        if cmp and cmp["n_missing"]:
            cmpt += f" {cmp['n_missing']} miss"
        van = r.get("vs_vanilla")
        vant = f"{van['n_different']} diff" if van else "-"
        proof = r.get("kv_proof") or {}
        hits = proof.get("d_external_prefix_cache_hits")
        hits_txt = f"{hits:.0f}/{proof.get('prompt_tokens_total')}" if hits is not None else "-"
        mib = proof.get("nixl_bytes")
        # kvcached-pd seen in each instance's log: y = applied, x = failed, - = no line
        kvpd = "/".join("x" if ev["failed"] else ("y" if ev["seen"] else "-")
                        for ev in r["kvcached_pd"]["instances"].values()) or "-"
        wire = "/".join((r.get("wire") or {}).get("wires") or []) or "-"
        lines.append(f"{name:<20} {r['verdict']:<13} "
                     f"{str(r.get('n_ok', 0)) + '/' + str(r.get('n_requests', 0)):>7} "
                     f"{cmpt:>14} {vant:>10} {hits_txt:>17} "
                     f"{(f'{mib / 2**20:.1f}' if mib else '-'):>9} {kvpd:>5} {wire:>5}  "
                     f"{(r.get('fingerprint_sha256') or '-')[:16]}")
    return "\n".join(lines)


def _raise_interrupt(signum, frame):
    """SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C: servers stopped, summary written."""
    raise KeyboardInterrupt


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("modes", nargs="*", default=["all"],
                    help=f"modes to run ('all' = {' '.join(MODES)})")
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--parallel", type=int, default=5,
                    help="modes run at the same time (0 = all requested modes at once); "
                         "5 ran 'all' on the 2 x H200 host, where 8 kvcached instances "
                         "starting at once ran out of device memory")
    ap.add_argument("--baseline", default="reference",
                    help="mode whose outputs the others must equal (added if not requested)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0,
                    help="explicit KV budget per instance (--kv-cache-memory-bytes), which makes "
                         "concurrent startups on one GPU independent of each other; 0 = size "
                         "the KV cache from --gpu-memory-utilization instead")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="default 0.04 with --kv-cache-gib (only vLLM's startup free-memory "
                         "check uses it then), else 0.12")
    ap.add_argument("--prefill-gpu", default="0")
    ap.add_argument("--decode-gpu", default="1")
    ap.add_argument("--single-gpu", default="0", help="GPU of the no-PD reference instance")
    ap.add_argument("--health-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=60.0,
                    help="per request; after one unanswered request a mode sends no more")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="whole-run budget; modes that no longer fit are reported as not run")
    ap.add_argument("--no-batch", action="store_true", help="skip the concurrent batch")
    ap.add_argument("--push-concurrent", action="store_true",
                    help="push modes: send prefill and decode legs at once (default: P first)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="VLLM_BATCH_INVARIANT=1 on every instance (default): vLLM's "
                         "batch-invariant kernels make the concurrent batch's greedy outputs "
                         "independent of batch composition. On the 2xH200 host (2026-11-21) "
                         "without them 1-3 of 8 concurrent outputs differed from the "
                         "reference in every PD mode, vanilla included, run to run; with "
                         "them every mode was byte-identical")
    ap.add_argument("--expect-wire", choices=WIRES, default=None,
                    help="the wire D must name for its staged peer where the mode leaves the "
                         "choice to kvcached-pd (KVCACHED_PD_WIRE unset), e.g. ipc with P and "
                         "D on one GPU (default: only reported)")
    ap.add_argument("--kv-both", action="store_true",
                    help="kv_role kv_both on P and D (default kv_producer / kv_consumer)")
    ap.add_argument("--vllm-cmd", default=os.environ.get("KVPD_VLLM_CMD"),
                    help="command that runs `vllm serve` (default: $KVPD_VLLM_CMD, else this "
                         "python -m vllm.entrypoints.cli.main serve)")
    ap.add_argument("--extra-serve-args", default="", help="appended to every vllm serve")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="run every instance with vLLM's CUDA graphs (default: --enforce-eager; "
                         "on vLLM 0.30 a decode instance's dispatch of a loaded request's "
                         "first forward, which kvcached-pd's prompt_tail_graph changes, is "
                         "a graph decision)")
    ap.add_argument("--no-logging-config", action="store_true",
                    help="do not give vLLM our logging config (NIXL worker DEBUG lines and "
                         "kvcached_pd INFO lines in the instance logs)")
    ap.add_argument("--port-base", type=int, default=HTTP_PORT_BASE)
    ap.add_argument("--side-channel-port-base", type=int, default=SIDE_CHANNEL_PORT_BASE)
    ap.add_argument("--proxy-port-base", type=int, default=PROXY_PORT_BASE)
    # intermixed: modes may come after options (equivalence.sh OUT --parallel 4 vanilla)
    return ap.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    modes = resolve_modes(args.modes)
    if args.baseline not in MODES:
        raise SystemExit(f"unknown baseline {args.baseline!r}")
    if MODES[args.baseline] not in modes:
        modes.insert(0, MODES[args.baseline])
    else:  # the baseline goes in the first batch
        modes.remove(MODES[args.baseline])
        modes.insert(0, MODES[args.baseline])
    h = Harness(args)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    log(f"equivalence: {len(modes)} modes -> {h.out} (run tag {h.run_tag})")
    env_thread = describe_environment(os.path.join(h.out, "environment.json"))
    size = args.parallel if args.parallel > 0 else len(modes)
    batches = [modes[i:i + size] for i in range(0, len(modes), size)]
    runs: dict[str, ModeRun] = {}
    per_batch_s: list[float] = []
    try:
        for batch in batches:
            # a batch needs a startup, the requests and a shutdown; skip it if that no
            # longer fits, so the summary is written before the host's time limit
            need = max(per_batch_s) if per_batch_s else 60.0
            if h.deadline.remaining() < need:
                for m in batch:
                    run = ModeRun(m, infra_error="not run: out of time (--deadline-s)")
                    runs[m.name] = run
                log(f"skipping {', '.join(m.name for m in batch)}: out of time")
                continue
            t0 = time.monotonic()
            for run in h.run_batch(batch):
                runs[run.mode.name] = run
            per_batch_s.append(time.monotonic() - t0)
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
    for m in modes:
        runs.setdefault(m.name, ModeRun(m, infra_error="not run (interrupted)"))
    env_thread.join(timeout=30)
    results = evaluate(runs, args.baseline, args.expect_wire)
    for name, res in results.items():
        run = runs[name]
        write_json(os.path.join(h.out, "modes", f"{name}.json"),
                   {**res, "client": run.suite})
    required_failed = [n for n, r in results.items() if r["verdict"] == "FAIL"]
    numerics_note = None
    van = results.get("vanilla", {}).get("vs_baseline")
    if args.baseline != "vanilla" and van and van["n_different"]:
        numerics_note = (
            "vanilla PD itself differs from the reference. In PD, D recomputes the last prompt "
            "token as a one-token step and batches differently from the single instance, so "
            "bf16 numerics can flip a greedy token without any transfer bug. Judge the other "
            "modes by the 'vs vanilla' column (or rerun with --baseline vanilla; "
            "--batch-invariant makes vLLM's kernels batch-invariant).")
    ok = not required_failed and args.baseline in results and \
        results[args.baseline]["verdict"] == "PASS"
    summary = {
        "ok": ok, "baseline": args.baseline, "run_tag": h.run_tag,
        "elapsed_s": round(h.deadline.elapsed(), 1), "failed_modes": required_failed,
        "optional_failed_modes": [n for n, r in results.items() if r["verdict"] == "FAIL-OPTIONAL"],
        "numerics_note": numerics_note,
        "modes": {n: {k: r.get(k) for k in ("verdict", "reasons", "fingerprint_sha256", "n_ok",
                                             "n_requests", "vs_baseline", "vs_vanilla", "kv_proof",
                                             "vs_clean_twin", "kvcached_pd", "wire", "note",
                                             "description")}
                  for n, r in results.items()},
    }
    write_json(os.path.join(h.out, "summary.json"), summary)
    lines = [f"kvcached-pd equivalence ({time.strftime('%Y-%m-%d %H:%M:%S')}, "
             f"{summary['elapsed_s']}s, baseline {args.baseline}): {'PASS' if ok else 'FAIL'}",
             "", render_table(results, args.baseline), "", "SHA-256 of each mode's outputs:"]
    lines += [f"  {n:<20} {r.get('fingerprint_sha256') or '-'}" for n, r in results.items()]
    details = [(n, line) for n, r in results.items()
               for line in (r["reasons"] + ([r["note"]] if r.get("note") else [])
                            + r["kvcached_pd"]["notes"] + (r.get("wire") or {}).get("notes", []))]
    if details:
        lines += ["", "Details:"]
        lines += [f"  {n}: {line}" for n, line in details]
    if numerics_note:
        lines += ["", "NOTE: " + numerics_note]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(h.out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
