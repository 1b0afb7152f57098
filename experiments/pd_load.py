#!/usr/bin/env python3
"""Real traffic through PD pairs side by side: concurrency, client aborts, UCX faults and a
peer killed mid-run, every completed output checked against a no-PD reference.

One run starts, at once, a no-PD reference instance and one P/D pair per mode (P on the
prefill GPU, D on the decode GPU, each pair behind its own pd_proxy.py); the modes'
environments come from pd_modes.LOAD_FLAVOURS: vanilla vLLM, and kvcached-pd with
kvcached's defaults plus ENABLE_KVCACHED=true KVCACHED_AUTOPATCH=1 (--kvcached-layout
picks kvcached's contiguous default or the split layout). Then:

1. a warm-up per pair: one short request (NIXL's handshake is paid here, not in a
   measurement), then long prompts of the TTFT batch's shape (--no-long-warm-up: not);
2. the reference serves the load once, without aborts: the ground truth per prompt;
3. optionally (--ttft-batch N) N concurrent long prompts per mode: time to first token
   (--ttft-batch-repeats R: R batches a mode, the modes in turn, one p50 over them all);
4. --repeats times, mode after mode (interleaved, so drift hits every mode alike): the load,
   N mixed-length greedy requests (pd_common.load_prompts), --concurrency at a time,
   streamed (temperature 0, ignore_eos, return_token_ids, --max-tokens), every k-th one
   dropped by the client during its prefill leg and/or its decode leg (--abort-every,
   --abort-prefill-ms, --abort-decode-ms: the client closes its socket, the proxy closes
   the upstream connection, vLLM aborts the request).

Checks after every repeat of every mode (a mode PASSes when every repeat passed):
- outputs:  every completed request's token ids equal the reference's for that prompt;
- requests: no request failed that the client did not drop (not checked under faults/kills);
- kv:       D's vllm:external_prefix_cache_hits grew by at least the completed requests'
            prompt tokens less one each, and D computed at most one prompt token per
            request it received: D loaded the KV instead of computing it;
- alive:    both servers' processes alive and /health 200 (a dead one: its log's tail);
- staging:  kvcached-pd's staging gauges (P: vllm:kvcached_pd_prefill_staging_bytes, D:
            vllm:kvcached_pd_decode_staging_bytes) read 0 once the requests are done and
            a short settle passed (vanilla: n/a);
- nixl:     vllm:nixl_num_failed_transfers did not grow (clean runs only; reported always).
Reported too: kvcached-pd's direct-path fallbacks and staging waits per side, the aborts
P, D and the proxy saw. A metric the instance does not export is "absent": never a pass
(the verdict is then UNPROVEN, not PASS).

Fault options: --ucx-fault-lib (LD_PRELOAD'ed UCX fault injector, as vLLM's own
tests/v1/kv_connector/nixl_integration/run_ucx_fault_injection_test.sh does: the UCX
operations --ucx-fault-pattern or --ucx-fault-every N marks fail on --ucx-fault-on;
"kvpd" is experiments/ucx_fault's own injector, built for the run) and --kill prefill|decode
--kill-at-s T or --kill-after N (SIGKILL of that instance's process tree during the last
repeat, T seconds in or once N requests completed; the survivor must keep serving and
its staging return to 0 within --abort-timeout-s).

Latency per mode over completed requests, p50 and p90: end to end, time to first token
(first streamed token), P leg and D leg (the proxy's X-PD-Prefill-Seconds header and its
closing timing line), with ratios against vanilla PD. With them, the host's CPUs during
each mode's repeats: how busy all of them were, and each of the mode's process trees'
CPU milliseconds per completed request (host_cpu.py: the colocated ratios moved with what
else the host ran).

The streaming client with its aborts is load_client.py; the checks, pure functions of
what a repeat measured, are load_checks.py.

Writes under --out: summary.txt, summary.json (re-written after every repeat, so a run
cut short still leaves its results), latency.csv, modes/<mode>.json (every request),
logs/, environment.json; with --trace, timeline.txt (trace_timeline.py and
critical_path.py). Exit status 0 only when every mode passed; 1 when one failed; 2 when
nothing failed but a check could not be made.

usage: pd_load.py --out OUT [--model /tmp/tiny] [--abort-every 9 --abort-prefill-ms 50
                  --abort-decode-ms 10] [--repeats 5] [--ttft-batch 8
                  [--ttft-batch-repeats 3]] ...
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

from load_checks import (ABSENT, FAIL, NA, PASS, check_alive, check_kill_in_flight,
                         check_kv_loaded, check_memory_returned, check_outputs, check_requests,
                         check_staging, check_wire, latency_stats, ms, staging_expected,
                         verdict_of)
from gpu_memory import PeakSampler, compute_apps_mib, gpu_used_on, instance_memory
from host_cpu import CpuWindow
from load_client import AbortPlan, completion_body, run_load, stream_completion
from pd_common import (M, Deadline, MetricSnapshot, Prompt, get, load_prompts, log,
                       make_prompt_text, metric_delta, post_json, scrape_metrics, write_json)
from pd_modes import (KVCACHED_LAYOUTS, LOAD_DEFAULT_MODES, LOAD_FLAVOURS, WIRES, Mode,
                      expected_wire, kv_transfer_config, load_modes, staged_pair)
from pd_proxy import PREFILL_KV_PARAMS

# kvcached_pd.connector.decode_worker.IDLE_UNMAP_S: how long D keeps an idle IPC peer's staging
# mapped (a test keeps the two equal; this harness does not import kvcached-pd)
DECODE_IDLE_UNMAP_S = 30.0
from pd_servers import (HTTP_PORT_BASE, PROXY_PORT_BASE, SIDE_CHANNEL_PORT_BASE, ManagedProcess,
                        PortAllocator, describe_environment, serve_settings_from_args,
                        indent, instance_env, kvcached_pd_evidence, neutral_env, serve_args,
                        stop_all, wait_until_ready, wire_evidence, write_vllm_logging_config)

HERE = os.path.dirname(os.path.abspath(__file__))

# Defaults per model, from the issue's measurements: the tiny model (32 KiB of KV per
# token) under 64 requests 16 at a time, the kvbig model (256 KiB per token) under 48
# requests 8 at a time.
LOAD_PRESETS = {"tiny": {"requests": 64, "concurrency": 16},
                "kvbig": {"requests": 48, "concurrency": 8}}
KVBIG_BYTES_PER_TOKEN = 128 * 1024  # at or above this, the kvbig defaults apply
UCX_FAULT_COMMANDS = "/tmp/ucx-fault-commands"  # the injector's command file (file control)
UCX_FAULT_BUILD = os.path.join(HERE, "ucx_fault", "build.sh")  # --ucx-fault-lib kvpd
# The injector's own log lines ("UCX fault injector loaded", "[FAULT] INJECTED: ..."), not
# ld.so's complaint about a library it could not preload (which names the file).
_UCX_FAULT_LOADED = re.compile(r"UCX fault injector (loaded|initialization)")
_UCX_FAULT_INJECTED = re.compile(r"\[FAULT\]|INJECTED")



# --------------------------------------------------------------------------------------
# The harness
# --------------------------------------------------------------------------------------


@dataclass
class ModeRun:
    mode: Mode
    instances: dict[str, ManagedProcess] = field(default_factory=dict)  # role -> process
    ports: dict[str, dict] = field(default_factory=dict)
    proxy: ManagedProcess | None = None
    url: str | None = None
    infra_error: str | None = None
    repeats: list[dict] = field(default_factory=list)
    ttft: dict | None = None
    killed: str | None = None  # the role killed on purpose
    killed_at: float | None = None  # when (time.time()), for check_kill_in_flight
    broken: str | None = None  # why no further repeats run
    expected_wire: str | None = None  # the wire D must name for its staged peer

    def procs(self) -> list[ManagedProcess]:
        return list(self.instances.values()) + ([self.proxy] if self.proxy else [])

    def base(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]['http']}"


class LoadHarness:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = os.path.abspath(a.out)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(os.path.join(self.out, "modes"), exist_ok=True)
        self.deadline = Deadline(a.deadline_s)
        self.run_tag = uuid.uuid4().hex[:6]
        self.http_ports = PortAllocator(a.port_base)
        self.side_ports = PortAllocator(a.side_channel_port_base)
        self.proxy_ports = PortAllocator(a.proxy_port_base)
        self.settings = serve_settings_from_args(
            a, logging_config_path=write_vllm_logging_config(
                os.path.join(self.out, "vllm_logging.json")))
        self.prompts = load_prompts(a.requests, a.min_prompt_tokens, a.max_prompt_tokens)
        self.ttft_prompts = [Prompt(f"ttft-{i}-{a.ttft_prompt_tokens}", a.ttft_prompt_tokens,
                                    make_prompt_text(a.ttft_prompt_tokens, seed=5000 + i))
                             for i in range(a.ttft_batch)]
        self.aborts = AbortPlan(a.abort_every, a.abort_prefill_ms, a.abort_decode_ms) \
            if a.abort_every else None
        self.faulty = bool(a.ucx_fault_lib) or bool(a.kill)
        if a.ucx_fault_lib == "kvpd":
            a.ucx_fault_lib = build_fault_lib(os.path.join(self.out, "ucx_fault"))
        self._fault_lines_seen: dict[tuple[str, str], int] = {}  # (mode, role) -> lines
        self.reference: dict[str, list[int]] = {}
        self.reference_ttft: dict[str, list[int]] = {}
        self.runs: dict[str, ModeRun] = {}
        self.notes: list[str] = []
        self.frozen_counts: list[int] = []  # --freeze-others: processes stopped per pass

    # ---- instances -------------------------------------------------------------------
    def _instance(self, run: ModeRun, role: str, gpu: str) -> ManagedProcess:
        a, mode = self.a, run.mode
        cfg = {"single": mode.single, "prefill": mode.prefill, "decode": mode.decode}[role]
        port, side = self.http_ports.take(), self.side_ports.take()
        ipc = f"kvpd_{self.run_tag}_{mode.name}_{role}".replace("-", "_")
        engine_id = f"load-{mode.name}-{role}-{self.run_tag}"
        kvt = None if role == "single" else kv_transfer_config(
            mode.connector, "kv_producer" if role == "prefill" else "kv_consumer", engine_id)
        env = instance_env(cfg, gpu, side, ipc, self.settings.logging_config_path)
        extra: dict[str, str] = {}
        if a.batch_invariant:
            extra["VLLM_BATCH_INVARIANT"] = "1"
        if cfg.env.get("ENABLE_KVCACHED") == "true":
            extra.update(a.kvcached_env)  # a kvcached setting other than its default
        if role != "single":
            if a.abort_timeout_s:
                extra["VLLM_NIXL_ABORT_REQUEST_TIMEOUT"] = str(int(a.abort_timeout_s))
            if a.trace and cfg.env.get("KVCACHED_PD") == "1":
                extra["KVCACHED_PD_TRACE"] = "1"
            if a.staging_mb and cfg.env.get("KVCACHED_PD") == "1":
                extra["KVCACHED_PD_STAGING_MB"] = str(a.staging_mb)
            if a.ucx_fault_lib and a.ucx_fault_on in (role, "both"):
                # NIXL_UCX_DEEPBIND=0: with RTLD_DEEPBIND NIXL's UCX plugin would bind its
                # own libucp before the preloaded injector, and nothing would be injected
                extra.update(LD_PRELOAD=a.ucx_fault_lib, NIXL_UCX_DEEPBIND="0",
                             UCX_FAULT_HOOKS=a.ucx_fault_hooks)
                if a.ucx_fault_control == "env":
                    extra.update(UCX_FAULT_ENABLED="1", UCX_FAULT_STRATEGY="pattern",
                                 UCX_FAULT_PATTERN=a.ucx_fault_pattern)
        env.update(extra)
        shown = dict(cfg.env, CUDA_VISIBLE_DEVICES=gpu, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side),
                     KVCACHED_IPC_NAME=ipc, **extra)
        cmd = self.settings.vllm_cmd + serve_args(
            self.settings, port, cfg.block_size, kvt, cfg.serve_args)
        proc = ManagedProcess(f"{mode.name}/{role}", cmd, env,
                              os.path.join(self.logs, f"{mode.name}-{role}.log"),
                              f"http://127.0.0.1:{port}/health")
        run.ports[role] = {"http": port, "side_channel": side, "gpu": gpu,
                           "engine_id": engine_id, "flavor": cfg.flavor, "env": shown,
                           "serve_args": list(cfg.serve_args),
                           "kvcached_pd_expected": cfg.env.get("KVCACHED_PD") == "1",
                           "staging_expected": staging_expected(cfg.env)}
        proc.start(shown)
        return proc

    def start(self, modes: list[Mode]) -> None:
        a = self.a
        for mode in modes:
            run = self.runs[mode.name] = ModeRun(mode, expected_wire=expected_wire(
                mode, a.expect_wire))
            roles = [("single", a.prefill_gpu)] if not mode.is_pd else \
                [("prefill", a.prefill_gpu), ("decode", a.decode_gpu)]
            for role, gpu in roles:
                run.instances[role] = self._instance(run, role, str(gpu))
        procs = [p for r in self.runs.values() for p in r.instances.values()]
        wait_until_ready(procs, min(a.health_timeout,
                                    max(10.0, self.deadline.remaining() - a.reserve_s)))
        for run in self.runs.values():
            bad = [p for p in run.instances.values() if p.state != "ready"]
            if bad:
                run.infra_error = "; ".join(f"{p.name}: {p.failure}" for p in bad)
                run.broken = "did not start"
            elif run.mode.is_pd:
                port = self.proxy_ports.take()
                cmd = [sys.executable, os.path.join(HERE, "pd_proxy.py"), "--port", str(port),
                       "--prefill", run.base("prefill"), "--decode", run.base("decode"),
                       "--timeout", str(a.request_timeout)] + (["--trace"] if a.trace else [])
                if run.mode.connector == "NixlPushConnector" and a.push_concurrent:
                    p = run.ports["prefill"]
                    cmd += ["--push-concurrent", "--prefill-engine-id", p["engine_id"],
                            "--prefill-side-channel-port", str(p["side_channel"])]
                run.proxy = ManagedProcess(f"{run.mode.name}/proxy", cmd, neutral_env(),
                                           os.path.join(self.logs, f"{run.mode.name}-proxy.log"),
                                           f"http://127.0.0.1:{port}/healthz")
                run.proxy.start()
                run.url = f"http://127.0.0.1:{port}"
            else:
                run.url = run.base("single")
        wait_until_ready([r.proxy for r in self.runs.values() if r.proxy], 30.0, poll_s=0.2)
        for run in self.runs.values():
            if run.proxy is not None and run.proxy.state != "ready":
                run.infra_error, run.broken = f"proxy: {run.proxy.failure}", "proxy did not start"
        if a.ucx_fault_lib and a.ucx_fault_control == "file":
            self._write_fault_commands()

    def _write_fault_commands(self) -> None:
        """Older injector builds take commands from a file they watch, only those stamped
        after they loaded: written once every instance is up."""
        stamp = int(time.time()) + 1
        time.sleep(1.1)
        with open(UCX_FAULT_COMMANDS, "a", encoding="utf-8") as f:
            f.write(json.dumps({"timestamp": stamp, "command": "set_pattern",
                                "pattern": self.a.ucx_fault_pattern}) + "\n")
            f.write(json.dumps({"timestamp": stamp, "command": "toggle"}) + "\n")
        log(f"UCX fault commands written to {UCX_FAULT_COMMANDS}")

    # ---- metrics ---------------------------------------------------------------------
    def scrape(self, run: ModeRun) -> dict[str, MetricSnapshot | None]:
        return {role: scrape_metrics(run.base(role)) if p.alive() else None
                for role, p in run.instances.items()}

    def settle_staging(self, run: ModeRun, window_s: float) -> dict[str, dict]:
        """Poll the staging gauges until every expected one reads 0, or the window ends."""
        gauges = {"prefill": M.KVPD_P_STAGING, "decode": M.KVPD_D_STAGING}
        t0 = time.monotonic()
        readings: dict[str, dict] = {}
        while True:
            readings = {}
            for role, name in gauges.items():
                expected = run.ports[role]["staging_expected"] and role != run.killed
                snap = scrape_metrics(run.base(role)) if expected else None
                readings[role] = {"expected": expected, "settle_s": time.monotonic() - t0,
                                  "bytes": snap.total(name) if snap is not None else None}
            pending = [r for r in readings.values() if r["expected"] and r["bytes"] != 0]
            if not pending or time.monotonic() - t0 > window_s:
                return readings
            if all(r["bytes"] is None for r in pending) and time.monotonic() - t0 > 2.0:
                return readings  # absent, not draining: no point waiting the window out
            time.sleep(0.25)

    def proxy_stats(self, run: ModeRun) -> dict:
        if run.proxy is None:
            return {}
        res = get(run.url + "/healthz", timeout=5)
        try:
            return res.json() if res.ok else {}
        except ValueError:
            return {}

    def memory(self, run: ModeRun, staging: bool = True) -> dict[str, dict]:
        """Each live instance's GPU memory (``gpu_memory``) and its staging size."""
        apps = compute_apps_mib()
        readings = {}
        for role, proc in run.instances.items():
            if not proc.alive():
                continue
            ipc = run.ports[role]["env"].get("KVCACHED_IPC_NAME")
            reading = instance_memory(proc.proc.pid if proc.proc else None, ipc, apps)
            if staging:
                reading["staging_mib"] = staging_mib(proc.log_path)
            readings[role] = reading
        return readings

    def gpu_used(self, run: ModeRun, role: str = "decode") -> float | None:
        """The memory in use on ``role``'s GPU (all processes; P and D share it in
        colocated runs). After a kill the check reads the killed instance's GPU: across
        two GPUs (2 x H100, 2026-11-26) the kill-P check read D's GPU, where P's memory
        never was, and said "fell by -84 MiB" whatever P's GPU gave back."""
        # the role's own GPU: the first of those it sees ("1,0": D on GPU 1, P's visible too)
        return gpu_used_on(run.ports[role]["gpu"].split(",")[0])

    def wait_gpu_returned(self, run: ModeRun, before: dict, gpu_before: float | None,
                          tolerance_mib: float = 512) -> float | None:
        """After P was killed: wait until the GPU's memory in use fell by what P held
        before the load (the check_memory_returned rule), at most DECODE_IDLE_UNMAP_S + 15 s;
        the seconds it took, or None when it did not (or cannot be read). A D on the
        CUDA IPC wire keeps P's staging mapped, and so allocated, until no read has used
        it for kvcached-pd's IDLE_UNMAP_S (30 s): 2 x H200, 2026-11-26, the check read the
        GPU before that and found P's 2048 MiB staging still held."""
        held = (before.get("prefill") or {}).get("device_mib")
        if held is None or gpu_before is None:
            return None
        t0 = time.monotonic()
        while True:
            used = self.gpu_used(run, "prefill")
            if used is not None and gpu_before - used >= held - tolerance_mib:
                return round(time.monotonic() - t0, 1)
            if time.monotonic() - t0 > DECODE_IDLE_UNMAP_S + 15:
                return None
            time.sleep(1.0)

    def memory_sampler(self, run: ModeRun) -> PeakSampler:
        def read():
            return {**self.memory(run, staging=False),
                    "gpu": {"device_mib": self.gpu_used(run), "kvcached": None}}
        return PeakSampler(read, self.a.memory_sample_s)

    @staticmethod
    def cpu_window(run: ModeRun) -> CpuWindow:
        """The host's CPUs and the mode's process trees (each instance, the proxy), from
        now until the repeat's requests are done."""
        roots = {role: proc.pid for role, proc in run.instances.items()}
        if run.proxy is not None:
            roots["proxy"] = run.proxy.pid
        return CpuWindow(roots).start()

    # ---- one load of one mode --------------------------------------------------------
    def one_repeat(self, run: ModeRun, index: int, kill: bool, final: bool = False) -> dict:
        """``final``: with client aborts, this mode's last repeat (the last asked for, or
        the last the deadline leaves room for): it waits out vLLM's KV lease and checks
        that staging went back to 0 (earlier repeats only report what is still held)."""
        a = self.a
        memory = {"before": self.memory(run)}
        gpu = {"before": self.gpu_used(run)}
        if kill:  # the killed instance's GPU (D's own when P and D share one)
            gpu["killed_before"] = self.gpu_used(run, a.kill)
        before = self.scrape(run)
        proxy_before = self.proxy_stats(run)
        timer = None
        completed = [0]  # --kill-after: requests completed so far (client threads)
        kill_lock = threading.Lock()

        def arm_kill():
            nonlocal timer
            if kill and a.kill_at_s is not None:
                victim = run.instances[a.kill]
                timer = threading.Timer(a.kill_at_s, self._kill, (run, victim))
                timer.daemon = True
                timer.start()

        def count_done(result: dict) -> None:
            if not (kill and a.kill_after) or not result["ok"]:
                return
            with kill_lock:
                completed[0] += 1
                if completed[0] == a.kill_after:
                    self._kill(run, run.instances[a.kill])

        sampler = self.memory_sampler(run).start() if a.memory_sample_s > 0 else None
        cpu = self.cpu_window(run)
        t0 = time.monotonic()
        try:
            requests = run_load(run.url, a.model, self.prompts, a.max_tokens, a.concurrency,
                                a.request_timeout, self.aborts, on_start=arm_kill,
                                on_done=count_done)
        finally:
            peak = sampler.stop() if sampler else {}
            cpu_use = cpu.stop()
        wall = time.monotonic() - t0
        if timer is not None:
            timer.join()
        memory["peak_load"] = {role: r for role, r in peak.items() if role != "gpu"}
        gpu["peak_load"] = (peak.get("gpu") or {}).get("device_mib")
        rep: dict = {"repeat": index, "wall_s": round(wall, 3), "kill": kill and a.kill,
                     "cpu": cpu_use}
        rep["n_sent"] = len(requests)
        rep["n_completed"] = sum(r["ok"] for r in requests)
        rep["n_aborted"] = {leg: sum(r["aborted"] == leg for r in requests)
                            for leg in ("prefill", "decode")}
        rep["n_failed"] = sum(not r["ok"] and not r["aborted"] for r in requests)
        checks: dict[str, dict] = {}
        # D's success counter covers every completed request once its stats are in
        d_before = before.get("decode")
        t_end = time.monotonic() + 5.0
        while time.monotonic() < t_end and run.instances["decode"].alive():
            done = metric_delta(d_before, scrape_metrics(run.base("decode")), M.REQUEST_SUCCESS,
                                finished_reason="length")
            if done is None or done >= rep["n_completed"]:
                break
            time.sleep(0.1)
        d_after_load = scrape_metrics(run.base("decode")) \
            if run.instances["decode"].alive() else None
        memory["after_load"] = self.memory(run)
        gpu["after_load"] = self.gpu_used(run)
        if kill:
            gpu["killed_after_load"] = self.gpu_used(run, a.kill)
            # after D's counters are read: the probes make D compute prompts itself
            checks["survivor"] = self.survivor_check(run)
        window = a.settle_s
        if kill or a.ucx_fault_lib:
            window = max(window, a.abort_timeout_s + 15)
        if a.ucx_fault_lib and "push" in run.mode.name:
            # A push D keeps a failed request's offered extent out of use until P's KV
            # lease plus 5 s after the offer (P may still WRITE there until then).
            window = max(window, a.kv_lease_s + 20)
        # With client aborts P keeps the blocks (and so the extent) of a request whose D
        # leg never reached D's engine until vLLM's KV lease expires (its
        # kv_lease_duration, 30 s in vLLM 0.26; vanilla P holds its blocks just as long).
        # Every repeat reports what is still held; the last one waits out the lease.
        if self.aborts is not None and final:
            window = max(window, a.kv_lease_s + 15)
        readings = self.settle_staging(run, window)
        if kill and a.kill == "prefill":
            rep["gpu_returned_s"] = self.wait_gpu_returned(run, memory["before"],
                                                           gpu["killed_before"])
        memory["idle"] = self.memory(run)
        gpu["idle"] = self.gpu_used(run)
        if kill:
            gpu["killed_idle"] = self.gpu_used(run, a.kill)
        after = self.scrape(run)
        checks["outputs"] = check_outputs(requests, self.reference, self.faulty)
        checks["requests"] = check_requests(requests, self.faulty)
        checks["kv"] = check_kv_loaded(requests, d_before, d_after_load) \
            if run.killed != "decode" else {"status": NA, "detail": "D was killed"}
        alive = {}
        for role, proc in run.instances.items():
            alive[role] = {"alive": proc.alive(), "killed": role == run.killed,
                           "health": get(proc.health_url, timeout=5).status if proc.alive() else 0}
            if not alive[role]["alive"] and role != run.killed:
                time.sleep(0.3)  # let the log reader drain the last lines
                alive[role]["tail"] = proc.tail(40)
                log(f"DIED   {proc.name} (exit code {proc.proc.returncode}); last lines of "
                    f"{proc.log_path}:\n" + indent(proc.tail(40)))
        checks["alive"] = check_alive(alive)
        checks["staging"] = check_staging(readings)
        if self.aborts is not None and not final and checks["staging"]["status"] == FAIL:
            checks["staging"] = {**checks["staging"], "status": NA,
                                 "detail": "held within vLLM's KV lease (checked after the last "
                                 "repeat): " + checks["staging"]["detail"]}
        counters = self.counters(before, after)
        failed_xfers = sum(v for v in (counters["nixl_failed_transfers"] or {}).values()
                           if v is not None)
        clean = self.aborts is None and not self.faulty
        checks["nixl"] = {"status": (FAIL if failed_xfers else PASS) if clean else NA,
                          "detail": f"{failed_xfers:.0f} failed NIXL transfers"
                          + ("" if clean else " (aborts/faults: reported, not checked)")}
        if a.ucx_fault_lib:
            checks["fault_injected"] = self.fault_evidence(run)
        # D picks a peer's wire at its first handoff (the warm-up): its fallbacks since start
        d_after = after.get("decode")
        rep["wire_fallbacks_total"] = fallbacks = \
            d_after.total(M.KVPD_WIRE_FALLBACKS) if d_after is not None else None
        if staged_pair(run.mode):
            checks["wire"] = check_wire(
                run.expected_wire, wire_evidence(run.instances["decode"].log_path)["wires"],
                fallbacks, counter_readable=run.killed != "decode")
        if kill:
            checks["in_flight"] = check_kill_in_flight(requests, run.killed_at)
            survivor = "decode" if a.kill == "prefill" else "prefill"
            checks["memory"] = check_memory_returned(
                a.kill, memory["before"], memory["idle"], gpu["killed_before"],
                gpu["killed_idle"],
                survivor_kvcached=run.ports[survivor]["env"].get("ENABLE_KVCACHED") == "true")
            if rep.get("gpu_returned_s") is not None:
                checks["memory"]["detail"] += (f"; returned {rep['gpu_returned_s']:g} s after "
                                               "the load settled")
        rep["checks"] = checks
        rep["counters"] = counters
        stats = self.proxy_stats(run)
        rep["proxy_client_gone"] = {leg: stats.get(f"client_gone_{leg}", 0)
                                    - proxy_before.get(f"client_gone_{leg}", 0)
                                    for leg in ("prefill", "decode")} if stats else None
        rep["memory"] = memory
        rep["gpu_used_mib"] = gpu
        rep["latency"] = latency_stats(requests)
        rep["verdict"] = verdict_of(checks)
        rep["requests"] = requests
        dead = checks["alive"]["dead"]
        if dead:
            run.broken = f"{', '.join(dead)} died in repeat {index}"
        if kill:
            run.broken = run.broken or f"{a.kill} killed in repeat {index}"
        return rep

    def counters(self, before: dict, after: dict) -> dict:
        def per_side(name: str, **labels) -> dict | None:
            vals = {role: metric_delta(before.get(role), after.get(role), name, **labels)
                    for role in ("prefill", "decode")}
            return vals if any(v is not None for v in vals.values()) else None

        return {"direct_fallbacks": per_side(M.KVPD_FALLBACKS),
                "staging_waits": per_side(M.KVPD_STAGING_WAITS),
                "nixl_failed_transfers": per_side(M.NIXL_FAILED),
                # D: staged loads, their bytes moved and those a D prefix hit skipped
                "staged_loads": per_side(M.KVPD_MOVED_COUNT),
                "moved_bytes": per_side(M.KVPD_MOVED_SUM),
                "prefix_skipped_bytes": per_side(M.KVPD_SKIPPED),
                "graph_fallbacks": per_side(M.KVPD_GRAPH_FALLBACKS),
                # kvcached-pd's device time: P's pack per step that packed, D's unpack per
                # extent (histogram sums and counts)
                "pack_s": per_side(M.KVPD_PACK_SUM), "packs": per_side(M.KVPD_PACK_COUNT),
                "unpack_s": per_side(M.KVPD_UNPACK_SUM),
                "unpacks": per_side(M.KVPD_UNPACK_COUNT),
                "aborted_requests": per_side(M.REQUEST_SUCCESS, finished_reason="abort")}

    def fault_evidence(self, run: ModeRun) -> dict:
        """Did the injector load, and how many faults did it inject during this repeat?
        From the instance logs: both injectors log a start line and one line per fault to
        stderr. Faults are the lines new since the previous repeat's count (repeat 1's
        include the warm-up's). A repeat that injected nothing proved nothing: absent."""
        roles = ["prefill", "decode"] if self.a.ucx_fault_on == "both" else [self.a.ucx_fault_on]
        loaded, injected = {}, {}
        for role in roles:
            loaded[role] = total = 0
            try:
                with open(run.instances[role].log_path, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        loaded[role] += bool(_UCX_FAULT_LOADED.search(line))
                        total += bool(_UCX_FAULT_INJECTED.search(line))
            except OSError:
                pass
            key = (run.mode.name, role)
            injected[role] = total - self._fault_lines_seen.get(key, 0)
            self._fault_lines_seen[key] = total
        ok = all(loaded.values()) and sum(injected.values()) > 0
        why = "" if ok else (" (fault injection not confirmed)" if not all(loaded.values())
                             else " (no fault injected in this repeat)")
        return {"status": PASS if ok else ABSENT, "loaded_lines": loaded,
                "faults_injected": injected,
                "detail": "injector loaded on " + ", ".join(f"{r}: {'yes' if n else 'NO'}"
                                                            for r, n in loaded.items())
                + "; faults injected: " + ", ".join(f"{r} {n}" for r, n in injected.items())
                + why}

    def _kill(self, run: ModeRun, proc: ManagedProcess) -> None:
        when = (f"at +{self.a.kill_at_s:g}s" if self.a.kill_at_s is not None
                else f"after {self.a.kill_after} requests completed")
        log(f"KILL   {proc.name}: SIGKILL to its process tree {when}")
        run.killed = self.a.kill
        run.killed_at = time.time()
        proc.signal_group(signal.SIGKILL)

    def survivor_check(self, run: ModeRun) -> dict:
        """After the peer's death the survivor keeps serving: D answers plain (non-PD)
        requests with the reference's tokens; P answers prefill legs."""
        a = self.a
        survivor = "decode" if a.kill == "prefill" else "prefill"
        t_end = time.monotonic() + 10
        while run.instances[a.kill].group_alive() and time.monotonic() < t_end:
            time.sleep(0.1)
        probes = sorted(self.prompts, key=lambda p: p.num_tokens)[:3]
        results = []
        for p in probes:
            if survivor == "decode":
                r = stream_completion(run.base("decode"),
                                      completion_body(a.model, p.text, a.max_tokens),
                                      a.request_timeout)
                ok = r["ok"] and (p.name not in self.reference
                                  or r["token_ids"] == self.reference[p.name])
                results.append({"prompt": p.name, "ok": ok, "error": r["error"],
                                "matches_reference": r["token_ids"] == self.reference.get(p.name)})
            else:
                body = {"model": a.model, "prompt": p.text, "max_tokens": 1, "temperature": 0.0,
                        "kv_transfer_params": dict(PREFILL_KV_PARAMS)}
                r = post_json(run.base("prefill") + "/v1/completions", body,
                              timeout=a.request_timeout)
                kvp = r.json().get("kv_transfer_params") if r.ok else None
                results.append({"prompt": p.name, "ok": bool(kvp),
                                "error": None if kvp else f"HTTP {r.status} {r.error or ''}"})
        ok = all(x["ok"] for x in results)
        what = "plain requests" if survivor == "decode" else "prefill legs"
        return {"status": PASS if ok else FAIL, "survivor": survivor, "probes": results,
                "detail": f"{survivor} answered {sum(x['ok'] for x in results)}/{len(results)} "
                          f"{what} after {a.kill} was killed"}

    # ---- reference, warm-up, TTFT ------------------------------------------------------
    def warm_up_prompts(self) -> list[Prompt]:
        """The long half of the warm-up: the TTFT batch's shape (as many prompts, of the
        longest length the run sends), or one prompt of the load's longest length.
        Seeds of their own (the load's start at pd_common.LOAD_SEED_BASE, the TTFT
        batch's at 5000), so no measured prompt finds them in a prefix cache. Why: on
        2026-11-27 vLLM's JIT monitor logged Triton kernels (``matmul_kernel_persistent``
        under ``VLLM_BATCH_INVARIANT=1``) compiled at inference in every instance, once
        after the 32-token warm-up and in two runs once more under load, and one TTFT
        batch had a 612 ms decode step: the first long prompts an instance sees may pay a
        compile that the steady state an operator serves never does."""
        a = self.a
        longest = max([p.num_tokens for p in self.prompts]
                      + ([a.ttft_prompt_tokens] if a.ttft_batch else []))
        return [Prompt(f"warm-{i}-{longest}", longest, make_prompt_text(longest, seed=90000 + i))
                for i in range(max(1, a.ttft_batch))]

    def warm_up(self, run: ModeRun) -> None:
        """A 32-token request (NIXL's handshake, D's peer and wire), then, unless
        ``--no-long-warm-up``, the long prompts of :meth:`warm_up_prompts` at once."""
        a = self.a
        body = completion_body(a.model, make_prompt_text(32, seed=99), 2)
        r = stream_completion(run.url, body, a.request_timeout)
        if not r["ok"]:
            log(f"{run.mode.name}: warm-up request failed: {r['error']}")
        if not a.long_warm_up:
            return
        prompts = self.warm_up_prompts()
        t0 = time.monotonic()
        done = run_load(run.url, a.model, prompts, 2, len(prompts), a.request_timeout)
        failed = [r["error"] for r in done if not r["ok"]]
        log(f"{run.mode.name}: long warm-up, {len(prompts)} x {prompts[0].num_tokens} tokens: "
            f"{len(prompts) - len(failed)} ok in {time.monotonic() - t0:.1f} s"
            + (f"; first failure: {failed[0]}" if failed else ""))

    def single_repeat(self, run: ModeRun, index: int) -> dict:
        """One pass of the load through one instance without PD (no aborts, no kills: they
        act on PD legs). The reference's pass (index 0) is the ground truth; any other
        single instance's outputs are checked against it."""
        a = self.a
        cpu = self.cpu_window(run)
        requests = run_load(run.url, a.model, self.prompts, a.max_tokens, a.concurrency,
                            a.request_timeout)
        cpu_use = cpu.stop()
        bad = [r for r in requests if not r["ok"]]
        checks = {"requests": check_requests(requests, False)}
        if run.mode.name != "reference":
            checks["outputs"] = check_outputs(requests, self.reference, False)
        alive = {"single": {"alive": run.instances["single"].alive(), "killed": False,
                            "health": get(run.instances["single"].health_url).status}}
        checks["alive"] = check_alive(alive)
        dead = checks["alive"]["dead"]
        if dead:
            run.broken = f"{', '.join(dead)} died in repeat {index}"
        log(f"{run.mode.name}: {len(requests) - len(bad)}/{len(requests)} requests ok")
        return {"repeat": index, "n_sent": len(requests),
                "n_completed": len(requests) - len(bad), "n_failed": len(bad),
                "n_aborted": {}, "checks": checks, "verdict": verdict_of(checks),
                "latency": latency_stats(requests), "requests": requests, "cpu": cpu_use}

    def run_reference(self, run: ModeRun) -> None:
        rep = self.single_repeat(run, 0)
        self.reference = {r["name"]: r["token_ids"] for r in rep["requests"] if r["ok"]}
        run.repeats.append(rep)

    def ttft_batch(self, run: ModeRun) -> dict:
        a = self.a
        requests = run_load(run.url, a.model, self.ttft_prompts, a.max_tokens,
                            len(self.ttft_prompts), a.request_timeout)
        if run.mode.name == "reference":
            if not self.reference_ttft:  # its first batch, for every mode's every batch
                self.reference_ttft = {r["name"]: r["token_ids"] for r in requests if r["ok"]}
            outputs = {"status": NA, "detail": "the reference"}
        else:
            outputs = check_outputs(requests, self.reference_ttft)
        lat = ttft_latency(requests)
        log(f"  {run.mode.name:<14} TTFT batch {len(requests)} x {a.ttft_prompt_tokens} tokens: "
            f"p50 {lat['ttft_p50_ms']} ms, max {lat['ttft_max_ms']} ms, {lat['n']} ok")
        return {"latency": lat, "outputs": outputs, "requests": requests}

    @contextmanager
    def alone(self, run: ModeRun):
        """With ``--freeze-others``: every other mode's servers and proxy stopped (SIGSTOP
        to each one's process group: vLLM's engine process and threads with it) while
        ``run`` is measured, continued afterwards, whatever happened.

        Why: the harness keeps every mode's servers up, and an idle PD instance is not
        idle to the host: each NIXL agent's progress thread spins one CPU (vLLM's in every
        PD instance), so the other modes' instances held 6-16 of a lane's CPUs (by
        count) while one mode ran (2026-11-28f: the host 56-95% busy during the loads). A
        deployment has its own P and D, not ten idle ones beside them.

        A flavour with ``cpu_spinners`` gets that many processes spinning a CPU each for
        the same time (frozen or not), stopped afterwards whatever happened."""
        spinners = self.start_spinners(run)
        try:
            with self._frozen_others(run):
                yield
        finally:
            for proc in spinners:
                proc.kill()
                proc.wait()

    def start_spinners(self, run: ModeRun) -> list[subprocess.Popen]:
        flavour = LOAD_FLAVOURS.get(run.mode.name)
        count = flavour.cpu_spinners if flavour is not None else 0
        return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 stdin=subprocess.DEVNULL, start_new_session=True)
                for _ in range(count)]

    @contextmanager
    def _frozen_others(self, run: ModeRun):
        if not self.a.freeze_others:
            yield
            return
        frozen = []
        for other in self.runs.values():
            if other is run:
                continue
            for proc in [*other.instances.values(), other.proxy]:
                live = getattr(proc, "proc", None)
                if live is None or live.poll() is not None:
                    continue
                try:
                    os.killpg(live.pid, signal.SIGSTOP)
                except (ProcessLookupError, PermissionError):
                    continue
                frozen.append(live.pid)
        self.frozen_counts.append(len(frozen))
        try:
            yield
        finally:
            for pid in frozen:
                try:
                    os.killpg(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    # ---- the whole run ---------------------------------------------------------------
    def run(self) -> None:
        a = self.a
        modes = load_modes(a.modes, a.kvcached_layout)
        self.start(modes)
        ref = self.runs["reference"]
        pd_runs = [r for r in self.runs.values() if r.mode.is_pd]
        singles = [r for r in self.runs.values() if not r.mode.is_pd and r is not ref]
        for run in self.runs.values():
            if run.broken is None:
                self.warm_up(run)
        if ref.broken:
            self.notes.append(f"the reference did not start ({ref.infra_error}): nothing to "
                              "compare with")
            return
        with self.alone(ref):
            self.run_reference(ref)
        self.write()
        if a.ttft_batch:
            batches: dict[str, list[dict]] = {}
            for _ in range(a.ttft_batch_repeats):  # the modes in turn, each time
                for run in [ref] + singles + pd_runs:
                    if run.broken is None and not self.deadline.expired(a.reserve_s + 30):
                        with self.alone(run):
                            batches.setdefault(run.mode.name, []).append(
                                self.ttft_batch(run))
                        run.ttft = combine_ttft_batches(batches[run.mode.name])
        steps: list[float] = []  # how long one repeat of one mode took, so far
        for index in range(1, a.repeats + 1):
            for run in singles + pd_runs:
                if run.broken:
                    continue
                if not run.mode.is_pd:
                    if self.deadline.remaining() < a.reserve_s + (max(steps) if steps else 30.0):
                        self.notes.append(f"{run.mode.name}: repeat {index} not run: out of "
                                          "time (--deadline-s)")
                        continue
                    t0 = time.monotonic()
                    with self.alone(run):
                        run.repeats.append(self.single_repeat(run, index))
                    steps.append(time.monotonic() - t0)
                    self.write()
                    continue
                window = a.abort_timeout_s + 15 if (a.kill and index == a.repeats) or \
                    a.ucx_fault_lib else a.settle_s
                step_s = max(steps) if steps else 30.0
                lease_window = max(window, a.kv_lease_s + 15)
                final = self.aborts is not None and last_repeat_that_fits(
                    index, a.repeats, self.deadline.remaining(), a.reserve_s, step_s, window,
                    lease_window, sum(1 for r in pd_runs if not r.broken))
                if final:
                    window = lease_window
                if self.deadline.remaining() < a.reserve_s + step_s + window:
                    self.notes.append(f"{run.mode.name}: repeat {index} not run: out of time "
                                      "(--deadline-s)")
                    continue
                t0 = time.monotonic()
                with self.alone(run):
                    rep = self.one_repeat(run, index, kill=bool(a.kill) and index == a.repeats,
                                          final=final)
                steps.append(time.monotonic() - t0)
                run.repeats.append(rep)
                lat = rep["latency"]
                log(f"{run.mode.name:<14} repeat {index}: {rep['verdict']}  "
                    f"{rep['n_completed']}/{rep['n_sent']} completed, aborted "
                    f"{rep['n_aborted']['prefill']}+{rep['n_aborted']['decode']}, "
                    f"failed {rep['n_failed']}; e2e p50 {lat['e2e_p50_ms']} ms p90 "
                    f"{lat['e2e_p90_ms']} ms; "
                    + "; ".join(f"{k} {c['status']}" for k, c in rep["checks"].items()))
                self.write()

    # ---- outputs ---------------------------------------------------------------------
    def mode_result(self, run: ModeRun) -> dict:
        reps = [r for r in run.repeats if r["repeat"] > 0] if run.mode.is_pd else run.repeats
        checks_seen: dict[str, list[str]] = {}
        for rep in reps:
            for name, c in rep["checks"].items():
                checks_seen.setdefault(name, []).append(c["status"])
        if run.ttft and run.ttft["outputs"]["status"] != NA:
            checks_seen.setdefault("ttft_outputs", []).append(run.ttft["outputs"]["status"])
        reasons = [f"repeat {rep['repeat']}: {name}: {c['detail']}" for rep in reps
                   for name, c in rep["checks"].items() if c["status"] in (FAIL, ABSENT)]
        if run.ttft and run.ttft["outputs"]["status"] in (FAIL, ABSENT):
            reasons.append(f"TTFT batch: {run.ttft['outputs']['detail']}")
        # kvcached-pd ran exactly where the mode says (from each instance's log)
        evidence = {role: kvcached_pd_evidence(p.log_path) for role, p in run.instances.items()}
        wrong = []
        for role, ev in evidence.items():
            expected = run.ports.get(role, {}).get("kvcached_pd_expected", False)
            if not expected and ev["applied"]:
                wrong.append(f"kvcached-pd patched {role} although KVCACHED_PD=0: {ev['applied']}")
            if expected and ev["failed"]:
                wrong.append(f"kvcached-pd patches failed on {role}: {ev['failed']}")
        if reps:
            checks_seen["activation"] = [FAIL if wrong else PASS]
            reasons.extend(wrong)
        if run.infra_error:
            verdict = "FAIL"
            reasons.insert(0, run.infra_error)
        elif not reps:
            verdict = "NOT RUN"
        else:
            verdict = verdict_of({k: {"status": FAIL if FAIL in v else
                                      (ABSENT if ABSENT in v else PASS)}
                                  for k, v in checks_seen.items()})
        pooled = [q for rep in reps for q in rep["requests"]]

        def total(key, side=None):
            vals = []
            for rep in reps:
                c = (rep.get("counters") or {}).get(key)
                if c is None:
                    continue
                vals.extend(v for s, v in c.items() if v is not None and side in (None, s))
            return sum(vals) if vals else None

        return {
            "mode": run.mode.name, "description": run.mode.description,
            "connector": run.mode.connector, "verdict": verdict, "reasons": reasons,
            "instances": run.ports, "repeats_run": len(reps),
            "checks": {k: sorted(set(v)) for k, v in checks_seen.items()},
            "completed": sum(r["n_completed"] for r in reps),
            "sent": sum(r["n_sent"] for r in reps),
            "aborted": sum(sum(r["n_aborted"].values()) for r in reps),
            "failed": sum(r["n_failed"] for r in reps),
            "different": sum(r["checks"].get("outputs", {}).get("n_different", 0) for r in reps),
            "deaths": sum(len(r["checks"]["alive"]["dead"]) for r in reps),
            "staging_left_bytes": max((rd["bytes"] or 0 for r in reps
                                       for rd in r["checks"].get("staging", {})
                                       .get("readings", {}).values() if rd["expected"]),
                                      default=None),
            "direct_fallbacks": {s: total("direct_fallbacks", s) for s in ("prefill", "decode")},
            "wire_fallbacks": max((r["wire_fallbacks_total"] for r in reps
                                   if r.get("wire_fallbacks_total") is not None), default=None),
            "expected_wire": run.expected_wire,
            "wires": wire_evidence(run.instances["decode"].log_path)["wires"]
            if "decode" in run.instances else [],
            "staging_waits": {s: total("staging_waits", s) for s in ("prefill", "decode")},
            # packs / unpacks the CUDA graphs refused (ring busy, request too large)
            "graph_fallbacks": {s: total("graph_fallbacks", s) for s in ("prefill", "decode")},
            "kvpd_gpu": kvpd_gpu(total),
            "nixl_failed_transfers": total("nixl_failed_transfers"),
            "ucx_faults_injected": _faults_injected(reps),
            "latency": latency_stats(pooled),
            "ttft_batch": run.ttft["latency"] if run.ttft else None,
            "ttft_batches_p50_ms": ([b["ttft_p50_ms"] for b in run.ttft.get("batches", [])]
                                    if run.ttft else None),
            "kvcached_pd": evidence,
            "memory": reps[-1].get("memory") if reps else None,
            "gpu_used_mib": reps[-1].get("gpu_used_mib") if reps else None,
            "cpu": cpu_summary(reps),
        }

    def write(self) -> dict:
        results = {name: self.mode_result(run) for name, run in self.runs.items()}
        van = results.get("vanilla")
        for res in results.values():
            res["vs_vanilla"] = _ratios(res, van) if van and res is not van else None
        pd_verdicts = [r["verdict"] for n, r in results.items() if n != "reference"]
        ref_v = results.get("reference", {}).get("verdict")
        if "FAIL" in pd_verdicts or ref_v != "PASS" or not pd_verdicts:
            overall = "FAIL"
        elif "UNPROVEN" in pd_verdicts or "NOT RUN" in pd_verdicts:
            overall = "UNPROVEN"
        else:
            overall = "PASS"
        a = self.a
        doc = {"overall": overall, "run_tag": self.run_tag,
               "elapsed_s": round(self.deadline.elapsed(), 1),
               "config": {k: v for k, v in vars(a).items()},
               "load": {"requests": len(self.prompts), "concurrency": a.concurrency,
                        "prompt_tokens": [p.num_tokens for p in self.prompts],
                        "max_tokens": a.max_tokens,
                        "aborts": self.aborts.describe() if self.aborts else None,
                        "kvcached_layout": a.kvcached_layout,
                        "frozen": {"passes": len(self.frozen_counts),
                                   "processes_max": max(self.frozen_counts, default=0)}
                        if a.freeze_others else None},
               "notes": self.notes, "modes": results}
        write_json(os.path.join(self.out, "summary.json"), doc)
        for name, run in self.runs.items():
            write_json(os.path.join(self.out, "modes", f"{name}.json"),
                       {**results[name], "repeats": run.repeats, "ttft": run.ttft})
        with open(os.path.join(self.out, "summary.txt"), "w", encoding="utf-8") as f:
            f.write(render_summary(doc))
        self._write_csv(doc)
        return doc

    def _write_csv(self, doc: dict) -> None:
        cols = ["mode", "repeat", "verdict", "sent", "completed", "aborted", "failed",
                "e2e_p50_ms", "e2e_p90_ms", "ttft_p50_ms", "ttft_p90_ms", "prefill_p50_ms",
                "prefill_p90_ms", "decode_p50_ms", "decode_p90_ms"]
        with open(os.path.join(self.out, "latency.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            for name, run in self.runs.items():
                for rep in run.repeats:
                    w.writerow({"mode": name, "repeat": rep["repeat"], "verdict": rep["verdict"],
                                "sent": rep["n_sent"], "completed": rep["n_completed"],
                                "aborted": sum(rep["n_aborted"].values()),
                                "failed": rep["n_failed"],
                                **{k: v for k, v in rep["latency"].items() if k in cols}})
                if run.ttft:
                    w.writerow({"mode": name, "repeat": "ttft-batch",
                                "completed": run.ttft["latency"]["n"],
                                **{k: v for k, v in run.ttft["latency"].items() if k in cols}})


def ttft_latency(requests: list[dict]) -> dict:
    """A TTFT batch's latency: the load's statistics and its slowest first token."""
    lat = latency_stats(requests)
    vals = [r["ttft_s"] for r in requests if r["ok"] and r["ttft_s"] is not None]
    lat["ttft_max_ms"] = ms(max(vals)) if vals else None
    return lat


def combine_ttft_batches(batches: list[dict]) -> dict:
    """A mode's TTFT batches (``--ttft-batch-repeats``) as one: the latency over every
    batch's requests, each batch's own latency in ``batches``, the outputs of the first
    batch that failed or lacked them (else the first's), and the first batch's requests
    (one batch's, as ``ttft_batch_timeline.py`` reads them)."""
    lat = ttft_latency([r for b in batches for r in b["requests"]])
    outputs = batches[0]["outputs"]
    for i, b in enumerate(batches, 1):
        if b["outputs"]["status"] in (FAIL, ABSENT):
            outputs = {**b["outputs"], "detail": f"batch {i} of {len(batches)}: "
                       f"{b['outputs']['detail']}"}
            break
    return {"latency": lat, "outputs": outputs, "requests": batches[0]["requests"],
            "batches": [b["latency"] for b in batches]}


def last_repeat_that_fits(index: int, repeats: int, remaining_s: float, reserve_s: float,
                          step_s: float, window_s: float, lease_window_s: float,
                          modes: int) -> bool:
    """Whether repeat ``index`` of a mode under client aborts is its last one: the last
    asked for, or the last the deadline leaves room for. After it, the next repeat of
    this mode would come after one repeat of each of the other ``modes - 1`` (each
    ``step_s + window_s``) and need ``step_s + lease_window_s`` itself (it waits out
    vLLM's KV lease). Before 2026-11-27 only ``index == repeats`` counted, so a run the
    deadline cut short never checked that staging went back to 0 (its last repeat said
    "staging n/a")."""
    if index >= repeats:
        return True
    after_this = remaining_s - (step_s + window_s)
    next_final = (modes - 1) * (step_s + window_s) + step_s + lease_window_s
    return after_this < reserve_s + next_final and remaining_s >= reserve_s + step_s + lease_window_s


def _faults_injected(reps: list[dict]) -> dict[str, int] | None:
    """UCX faults the injector logged per role over the repeats (None: no injector)."""
    out: dict[str, int] = {}
    for rep in reps:
        for role, n in rep["checks"].get("fault_injected", {}).get("faults_injected",
                                                                   {}).items():
            out[role] = out.get(role, 0) + n
    return out or None


def _ratios(res: dict, van: dict) -> dict:
    out = {}
    for group, key in (("latency", "e2e_p50_ms"), ("latency", "e2e_p90_ms"),
                       ("latency", "ttft_p50_ms"), ("latency", "prefill_p50_ms"),
                       ("latency", "decode_p50_ms"), ("ttft_batch", "ttft_p50_ms")):
        mine, theirs = (res.get(group) or {}).get(key), (van.get(group) or {}).get(key)
        out[f"{group}.{key}"] = round(mine / theirs, 2) if mine and theirs else None
    return out


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render_summary(doc: dict) -> str:
    load = doc["load"]
    lines = [f"kvcached-pd load ({time.strftime('%Y-%m-%d %H:%M:%S')}, {doc['elapsed_s']}s): "
             f"{doc['overall']}",
             f"load: {load['requests']} requests, {load['concurrency']} at a time, prompts "
             f"{min(load['prompt_tokens'], default=0)}-{max(load['prompt_tokens'], default=0)} "
             f"tokens, {load['max_tokens']} tokens out; aborts: {load['aborts'] or 'none'}; "
             f"kvcached layout: {load['kvcached_layout']}"
             + (f"; other modes' servers stopped while one is measured ({frozen['passes']} "
                f"passes, up to {frozen['processes_max']} process groups)"
                if (frozen := load.get("frozen")) else ""), ""]
    hdr = (f"{'mode':<14} {'verdict':<9} {'done/sent':>10} {'abort':>5} {'fail':>4} "
           f"{'diff':>4} {'dead':>4} {'staging':>8} {'fallbk P/D':>10} {'waits P/D':>9} "
           f"{'nixlF':>5} {'wire':>8} {'wireFB':>6}  checks")
    lines += [hdr, "-" * len(hdr)]

    def pair(d):
        return "/".join("-" if d.get(s) is None else f"{d[s]:.0f}" for s in ("prefill", "decode"))

    for name, r in doc["modes"].items():
        staged = any(i.get("staging_expected") for i in r["instances"].values())
        staging = "n/a" if not staged else (
            "absent" if "absent" in r["checks"].get("staging", []) else
            ("-" if r["staging_left_bytes"] is None else f"{r['staging_left_bytes']:.0f}B"))
        checks = ",".join(f"{k}:{'/'.join(v)}" for k, v in r["checks"].items())
        done = f"{r['completed']}/{r['sent']}"
        wire = "/".join(r.get("wires") or []) or "-"
        lines.append(f"{name:<14} {r['verdict']:<9} {done:>10} "
                     f"{r['aborted']:>5} {r['failed']:>4} {r['different']:>4} {r['deaths']:>4} "
                     f"{staging:>8} {pair(r['direct_fallbacks']):>10} "
                     f"{pair(r['staging_waits']):>9} {_f(r['nixl_failed_transfers'], 0):>5} "
                     f"{wire:>8} {_f(r.get('wire_fallbacks'), 0):>6}  {checks}")
    faults = {n: r["ucx_faults_injected"] for n, r in doc["modes"].items()
              if r.get("ucx_faults_injected")}
    if faults:
        lines += ["", "UCX faults injected (the injector's lines in the instance logs): "
                  + "; ".join(f"{n}: " + ", ".join(f"{role} {k}" for role, k in f.items())
                              for n, f in faults.items())]
    lines += ["", "Latency over completed requests, ms (p50 / p90), and p50 ratio to vanilla PD:"]
    hdr = (f"{'mode':<14} {'n':>5} {'end-to-end':>15} {'TTFT':>15} {'P leg':>15} {'D leg':>15} "
           f"{'e2e x':>6} {'e2e90 x':>7} {'TTFT x':>6} {'P x':>5} {'D x':>5}")
    lines += [hdr, "-" * len(hdr)]
    for name, r in doc["modes"].items():
        lat, v = r["latency"], r.get("vs_vanilla") or {}

        def pp(k):
            return f"{_f(lat.get(k + '_p50_ms'))} / {_f(lat.get(k + '_p90_ms'))}"

        lines.append(f"{name:<14} {lat['n']:>5} {pp('e2e'):>15} {pp('ttft'):>15} "
                     f"{pp('prefill'):>15} {pp('decode'):>15} "
                     f"{_f(v.get('latency.e2e_p50_ms'), 2):>6} "
                     f"{_f(v.get('latency.e2e_p90_ms'), 2):>7} "
                     f"{_f(v.get('latency.ttft_p50_ms'), 2):>6} "
                     f"{_f(v.get('latency.prefill_p50_ms'), 2):>5} "
                     f"{_f(v.get('latency.decode_p50_ms'), 2):>5}")
    mem_lines = render_memory(doc)
    if mem_lines:
        lines += [""] + mem_lines
    cpu_lines = render_cpu(doc)
    if cpu_lines:
        lines += [""] + cpu_lines
    gpu_lines = render_kvpd_gpu(doc)
    if gpu_lines:
        lines += [""] + gpu_lines
    if any(r.get("ttft_batch") for r in doc["modes"].values()):
        lines += ["", "TTFT batch (concurrent long prompts), ms:"]
        for name, r in doc["modes"].items():
            t = r.get("ttft_batch")
            if t:
                x = (r.get("vs_vanilla") or {}).get("ttft_batch.ttft_p50_ms")
                each = r.get("ttft_batches_p50_ms") or []
                lines.append(f"  {name:<14} n {t['n']:>2}  p50 {_f(t['ttft_p50_ms'])}  p90 "
                             f"{_f(t['ttft_p90_ms'])}  max {_f(t.get('ttft_max_ms'))}  "
                             f"x vanilla {_f(x, 2)}"
                             + (f"  batches' p50 {' / '.join(_f(v) for v in each)}"
                                if len(each) > 1 else ""))
    details = [(n, line) for n, r in doc["modes"].items() for line in r["reasons"]]
    if details or doc["notes"]:
        lines += ["", "Details:"]
        lines += [f"  {n}: {line}" for n, line in details]
        lines += [f"  note: {n}" for n in doc["notes"]]
    if doc.get("timeline"):
        lines += ["", doc["timeline"].rstrip("\n")]
    return "\n".join(lines) + "\n"


def kvpd_gpu(total) -> dict:
    """kvcached-pd's device time over a mode's repeats, from its metrics: P's pack per step
    that packed and D's unpack per extent, mean ms, with their counts (None: not exported,
    e.g. vanilla). Why: on vLLM 0.30.0 D's steps that run a loaded request's first forward
    took 9.1-17.8 ms p50 against 4.9-6.4 on 0.26.0 (2026-11-29b), and whether the unpack
    in them is part of that was a metric no summary showed."""
    def mean_ms(seconds: str, count: str, side: str) -> float | None:
        s, n = total(seconds, side), total(count, side)
        return round(1e3 * s / n, 3) if s is not None and n else None
    return {"pack_ms": mean_ms("pack_s", "packs", "prefill"), "packs": total("packs", "prefill"),
            "unpack_ms": mean_ms("unpack_s", "unpacks", "decode"),
            "unpacks": total("unpacks", "decode")}


def render_kvpd_gpu(doc: dict) -> list[str]:
    rows = []
    for name, r in doc["modes"].items():
        g = r.get("kvpd_gpu") or {}
        if g.get("pack_ms") is None and g.get("unpack_ms") is None:
            continue
        rows.append(f"  {name:<18} pack {_f(g['pack_ms'], 3)} ({_f(g['packs'], 0)})"
                    f" / unpack {_f(g['unpack_ms'], 3)} ({_f(g['unpacks'], 0)})")
    if not rows:
        return []
    return ["kvcached-pd's device time (its metrics, all repeats): mean ms of P's pack per "
            "step that packed / of D's unpack per extent (n):"] + rows


def cpu_summary(reps: list[dict]) -> dict | None:
    """Over a mode's repeats (host_cpu.CpuWindow's readings): the host's busy share
    (mean, min, max of the repeats) and each process tree's CPU milliseconds per
    completed request (all repeats' CPU over all their completed requests)."""
    cpus = [r["cpu"] for r in reps if r.get("cpu")]
    busy = [c["busy_pct"] for c in cpus if c.get("busy_pct") is not None]
    done = sum(r.get("n_completed", 0) for r in reps if r.get("cpu"))
    if not cpus:
        return None
    per_request = {}
    for role in sorted({k for c in cpus for k in c.get("cpu_s", {})}):
        vals = [c["cpu_s"].get(role) for c in cpus]
        per_request[role] = (round(1e3 * sum(vals) / done, 2)
                             if done and all(v is not None for v in vals) else None)
    return {"busy_pct": round(sum(busy) / len(busy), 1) if busy else None,
            "busy_range": [min(busy), max(busy)] if busy else None,
            "cpus": cpus[0].get("cpus"), "ms_per_request": per_request}


def render_cpu(doc: dict) -> list[str]:
    """One line per mode: the host's CPUs busy during its repeats, and its processes'
    CPU per completed request (experiments/host_cpu.py says why)."""
    rows, cpus = [], None
    for name, r in doc["modes"].items():
        c = r.get("cpu")
        if not c:
            continue
        cpus = cpus or c.get("cpus")
        busy = "-" if c["busy_pct"] is None else \
            f"{c['busy_pct']:.0f} ({c['busy_range'][0]:.0f}-{c['busy_range'][1]:.0f})"
        per = ", ".join(f"{role} {'-' if ms is None else f'{ms:.1f}'}"
                        for role, ms in c["ms_per_request"].items())
        rows.append(f"  {name:<18} {busy:>14}   {per}")
    if not rows:
        return []
    return [f"Host CPU during the load (all repeats): busy % of the host's {cpus} CPUs "
            "(mean, range of repeats); CPU ms per completed request by process tree:"] + rows


MEMORY_POINTS = ("before", "peak_load", "after_load", "idle")


def render_memory(doc: dict) -> list[str]:
    """Per instance of each mode, from its last repeat: device memory (MiB) before the
    load, the highest sampled during it, right after it, and once idle (after the settle
    window); kvcached's mapped KV (in use + mapped ahead, MiB) at the same points; the
    staging region. Then the GPU's memory in use (all processes) at the same points."""
    rows, gpu_rows = [], []
    for name, r in doc["modes"].items():
        gpu = r.get("gpu_used_mib") or {}
        if any(gpu.get(p) is not None for p in MEMORY_POINTS):
            gpu_rows.append(f"  {name:<14} " + " / ".join(
                "-" if gpu.get(p) is None else f"{gpu[p]:.0f}" for p in MEMORY_POINTS))
        # MEMORY_POINTS' order; no peak is sampled on the killed instance's GPU
        killed = [gpu.get("killed_before"), None, gpu.get("killed_after_load"),
                  gpu.get("killed_idle")]
        if any(x is not None for x in killed):  # a kill: the dead instance's GPU too
            gpu_rows.append(f"  {name:<14} " + " / ".join(
                "-" if x is None else f"{x:.0f}" for x in killed)
                + "  (the killed instance's GPU)")
        mem = r.get("memory")
        if not mem:
            continue
        for role in ("prefill", "decode"):
            points = [(mem.get(p) or {}).get(role) for p in MEMORY_POINTS]
            if not any(points):
                continue

            def dev(x):
                return "-" if not x or x.get("device_mib") is None else f"{x['device_mib']:.0f}"

            def kv(x):
                k = (x or {}).get("kvcached")
                return "-" if not k else f"{k['used'] / 2**20:.0f}+{k['prealloc'] / 2**20:.0f}"
            held = [p["staging_mib"] for p in points if p and p.get("staging_mib") is not None]
            staging = max(held) if held else None  # the most it held at any point
            rows.append(f"  {name:<14} {role:<8} {' / '.join(dev(p) for p in points):>29}  "
                        f"{' / '.join(kv(p) for p in points):>34}  "
                        f"{'-' if staging is None else staging:>8}")
    out = []
    if rows:
        out += ["GPU memory per instance, last repeat (before load / peak under load / after "
                "load / idle):",
                f"  {'mode':<14} {'role':<8} {'device MiB':>29}  "
                f"{'kvcached KV MiB (in use+ahead)':>34}  {'staging':>8}"] + rows
    if gpu_rows:
        out += ["GPU memory in use, all processes, MiB (same points; the run's other "
                "instances idle):"] + gpu_rows
    return out


_STAGING_LINE = re.compile(r"kvcached-pd: staged transport ready .*?: (\d+) MiB staging "
                           r"\([^;]*; prefill (\d+) MiB, decode (\d+) MiB( allocated at the first "
                           r"READ)?")
_DECODE_STAGING_ALLOCATED = "kvcached-pd: decode staging allocated and registered"


def staging_mib(log_path: str) -> int | None:
    """MiB of staging the instance holds when its log is read: its start-up line's size,
    less a decode range that is allocated only at the first READ over NIXL (never on the
    CUDA IPC wire) until the log says it was."""
    size = lazy_decode = None
    allocated = False
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = _STAGING_LINE.search(line) if size is None else None
                if m:
                    size = int(m.group(1))
                    lazy_decode = int(m.group(3)) if m.group(4) else 0
                if _DECODE_STAGING_ALLOCATED in line:
                    allocated = True
    except OSError:
        return None
    if size is None:
        return None
    return size if allocated else size - lazy_decode


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def build_fault_lib(out_dir: str) -> str:
    """experiments/ucx_fault's injector for this run: compiled into out_dir where a C
    compiler is found, else its prebuilt copy (build.sh decides and says which)."""
    res = subprocess.run(["bash", UCX_FAULT_BUILD, out_dir], capture_output=True, text=True)
    if res.returncode != 0 or not res.stdout.strip():
        raise SystemExit(f"--ucx-fault-lib kvpd: build.sh failed: {res.stderr.strip()}")
    log(f"UCX fault injector: {res.stderr.strip()}")
    return res.stdout.strip().splitlines()[-1]


def kv_bytes_per_token(model: str) -> int | None:
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * (4 if "32" in dtype else 2)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--modes", default=",".join(LOAD_DEFAULT_MODES),
                    help=f"PD modes, comma-separated; known: {', '.join(LOAD_FLAVOURS)}")
    ap.add_argument("--kvcached-layout", choices=sorted(KVCACHED_LAYOUTS), default="contiguous",
                    help="contiguous: kvcached's default (KVCACHED_CONTIGUOUS_LAYOUT unset); "
                         "split: KVCACHED_CONTIGUOUS_LAYOUT=false")
    ap.add_argument("--requests", type=int, default=None,
                    help="default 64 (tiny model) or 48 (a model with >= 128 KiB KV per token)")
    ap.add_argument("--concurrency", type=int, default=None, help="default 16 or 8, likewise")
    ap.add_argument("--min-prompt-tokens", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=3800)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--abort-every", type=int, default=0,
                    help="the client drops every k-th request (0: none)")
    ap.add_argument("--abort-prefill-ms", type=float, default=None,
                    help="... during its P leg, this long after sending")
    ap.add_argument("--abort-decode-ms", type=float, default=None,
                    help="... during its D leg, this long after D's stream started")
    ap.add_argument("--issue-aborts", action="store_true",
                    help="the issue's failing case: every 9th, P leg 50 ms, D leg 10 ms")
    ap.add_argument("--ttft-batch", type=int, default=0,
                    help="also N concurrent --ttft-prompt-tokens prompts per mode (0: off)")
    ap.add_argument("--ttft-prompt-tokens", type=int, default=3000)
    ap.add_argument("--ttft-batch-repeats", type=int, default=1,
                    help="run the TTFT batch this many times per mode, the modes in turn "
                         "each time; its p50 and p90 are over every batch's requests, "
                         "each batch's p50 listed too (one batch of 8 is one sample: a "
                         "kvcached-pd mode's ratio moved 1.35x-1.63x between runs)")
    ap.add_argument("--long-warm-up", action=argparse.BooleanOptionalAction, default=True,
                    help="warm every instance up with long prompts too (the TTFT batch's "
                         "shape, or one of the load's longest length) before measuring, so "
                         "that no kernel compiled at first use lands in a measurement")
    ap.add_argument("--ucx-fault-lib", default=None,
                    help="LD_PRELOAD this UCX fault injector (libucx_fault_injector.so), or "
                         "'kvpd': experiments/ucx_fault's own, built for the run (or its "
                         "prebuilt copy where no C compiler is found)")
    ap.add_argument("--ucx-fault-pattern", default="OOOOOOOOOOOOOOOX",
                    help="X fails that UCX operation, O lets it pass (vLLM's test: every 16th)")
    ap.add_argument("--ucx-fault-every", type=int, default=None,
                    help="N: fail every Nth operation (sets --ucx-fault-pattern)")
    ap.add_argument("--ucx-fault-hooks", default="flush",
                    help="UCX_FAULT_HOOKS, the UCX calls counted and failed: get, put, flush, "
                         "all. NIXL posts one get/put per descriptor and one flush per "
                         "transfer, so flush fails every Nth KV transfer; get would fail "
                         "nearly every one of a many-block request")
    ap.add_argument("--ucx-fault-on", choices=("decode", "prefill", "both"), default="decode")
    ap.add_argument("--ucx-fault-control", choices=("env", "file"), default="env",
                    help="env: UCX_FAULT_ENABLED/STRATEGY/PATTERN at start; file: commands "
                         f"written to {UCX_FAULT_COMMANDS} once up (older injector builds)")
    ap.add_argument("--kill", choices=("prefill", "decode"), default=None,
                    help="SIGKILL this instance's process tree during the last repeat")
    ap.add_argument("--kill-at-s", type=float, default=None, help="seconds into that load")
    ap.add_argument("--kill-after", type=int, default=None, metavar="N",
                    help="instead of --kill-at-s: once N of that load's requests completed "
                         "(mid-run whatever the host's speed: the offline tests' fake "
                         "servers on a busy 2-core CI host had completed none at 0.9 s)")
    ap.add_argument("--abort-timeout-s", type=float, default=None,
                    help="VLLM_NIXL_ABORT_REQUEST_TIMEOUT on PD instances (default: 20 with "
                         "--kill or --ucx-fault-lib, else vLLM's own, 480)")
    ap.add_argument("--kv-lease-s", type=float, default=30.0,
                    help="vLLM's KV lease (kv_lease_duration; 30 s in 0.26): with client aborts "
                    "P may hold a request's blocks and extent that long, so the last repeat "
                    "waits it out before the staging check")
    ap.add_argument("--settle-s", type=float, default=10.0,
                    help="how long staging may take to drain once the requests are done")
    ap.add_argument("--push-concurrent", action="store_true",
                    help="push modes: the proxy sends both legs at once, D's before P answered "
                         "(default: P first)")
    ap.add_argument("--freeze-others", action="store_true",
                    help="stop every other mode's servers (SIGSTOP) while one mode is "
                         "measured, continue them after: the host then runs that mode's "
                         "processes alone (idle NIXL agents spin a CPU each)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="VLLM_BATCH_INVARIANT=1 on every instance: concurrent greedy outputs "
                         "independent of batch composition (else PD and the reference may "
                         "differ by bf16 numerics alone)")
    ap.add_argument("--expect-wire", choices=WIRES, default=None,
                    help="the wire D must name for its staged peer where the mode does not "
                         "force one (KVCACHED_PD_WIRE unset: kvcached-pd's automatic choice), "
                         "e.g. ipc with P and D on one GPU; checked as 'wire' with D's "
                         "vllm:kvcached_pd_wire_fallbacks_total (default: only reported)")
    ap.add_argument("--memory-sample-s", type=float, default=0.5,
                    help="sample each instance's GPU memory this often during a load (the "
                         "'peak under load' reading); 0: off")
    ap.add_argument("--trace", action="store_true",
                    help="KVCACHED_PD_TRACE=1 on kvcached-pd instances; per-stage timeline")
    ap.add_argument("--staging-mb", type=int, default=None,
                    help="KVCACHED_PD_STAGING_MB on kvcached-pd instances (default: unset, "
                         "the engine's own size; the caller's KVCACHED_* never reach them)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV budget per instance; default from the load (concurrency x longest "
                         "prompt x KV per token x 1.5, at least 2 GiB)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--prefill-gpu", default="0", help="P's GPU; the reference runs there too")
    ap.add_argument("--decode-gpu", default="1")
    ap.add_argument("--health-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--reserve-s", type=float, default=25.0,
                    help="time kept for shutdown and writing results")
    ap.add_argument("--vllm-cmd", default=os.environ.get("KVPD_VLLM_CMD"),
                    help="command that runs `vllm serve` (default: $KVPD_VLLM_CMD, else this "
                         "python -m vllm.entrypoints.cli.main serve)")
    ap.add_argument("--extra-serve-args", default="")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="run every instance with vLLM's CUDA graphs (default: --enforce-eager)")
    ap.add_argument("--kvcached-env", action="append", default=[], metavar="KEY=VALUE",
                    help="a KVCACHED_* setting for every kvcached instance, e.g. "
                         "KVCACHED_MAX_CACHED_TOKENS=200000 (default: kvcached's defaults; "
                         "the harness strips KVCACHED_* from its own environment)")
    ap.add_argument("--environment", action=argparse.BooleanOptionalAction, default=True,
                    help="write environment.json (versions, GPUs; importing vLLM takes seconds)")
    ap.add_argument("--port-base", type=int, default=HTTP_PORT_BASE + 400)
    ap.add_argument("--side-channel-port-base", type=int, default=SIDE_CHANNEL_PORT_BASE + 400)
    ap.add_argument("--proxy-port-base", type=int, default=PROXY_PORT_BASE + 400)
    a = ap.parse_args(argv)
    validate(ap, a)
    return a


def validate(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Every inconsistency is an error now, before any server starts."""
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        if m not in LOAD_FLAVOURS:
            ap.error(f"--modes: unknown mode {m!r}; known: {', '.join(LOAD_FLAVOURS)}")
    if not a.modes:
        ap.error("--modes: name at least one PD mode")
    needs_mps = [m for m in a.modes if LOAD_FLAVOURS[m].needs_mps]
    if needs_mps and not mps_control_running():
        ap.error(f"--modes {','.join(needs_mps)}: P's settings there are MPS client settings, "
                 "which CUDA ignores without an MPS server; no MPS control daemon found in "
                 f"{mps_pipe_dir()} (run the load under gpu_host/with_mps.sh)")
    if "kvpd-direct" in a.modes and a.kvcached_layout != "split":
        ap.error("--modes kvpd-direct needs --kvcached-layout split (kvcached's NIXL path "
                 "registers the split layout)")
    if a.issue_aborts:
        a.abort_every, a.abort_prefill_ms, a.abort_decode_ms = 9, 50.0, 10.0
    if a.abort_every < 0:
        ap.error("--abort-every must be >= 0")
    if a.abort_every and a.abort_prefill_ms is None and a.abort_decode_ms is None:
        ap.error("--abort-every needs --abort-prefill-ms and/or --abort-decode-ms")
    if not a.abort_every and (a.abort_prefill_ms is not None or a.abort_decode_ms is not None):
        ap.error("--abort-prefill-ms/--abort-decode-ms need --abort-every K")
    if (a.kill is None) != (a.kill_at_s is None and a.kill_after is None):
        ap.error("--kill goes with one of --kill-at-s and --kill-after")
    if a.kill_at_s is not None and a.kill_after is not None:
        ap.error("--kill-at-s or --kill-after, not both")
    if a.ucx_fault_every is not None:
        if a.ucx_fault_every < 1:
            ap.error("--ucx-fault-every must be >= 1")
        a.ucx_fault_pattern = "O" * (a.ucx_fault_every - 1) + "X"
    if a.ucx_fault_lib == "kvpd" and a.ucx_fault_control != "env":
        ap.error("--ucx-fault-lib kvpd reads its settings from the environment only "
                 "(--ucx-fault-control env)")
    if a.ucx_fault_lib and a.ucx_fault_lib != "kvpd" and not os.path.isfile(a.ucx_fault_lib):
        ap.error(f"--ucx-fault-lib {a.ucx_fault_lib}: no such file")
    if a.ucx_fault_lib and (not set(a.ucx_fault_pattern) <= {"X", "O"}
                            or "X" not in a.ucx_fault_pattern):
        ap.error("--ucx-fault-pattern: only X (fail) and O (pass), at least one X")
    if a.abort_timeout_s is None:  # a dead peer or a failed READ: P frees at the timeout
        a.abort_timeout_s = 20.0 if a.kill or a.ucx_fault_lib else 0.0
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    a.kvcached_env = parse_kvcached_env(ap, a.kvcached_env)
    kv_per_token = kv_bytes_per_token(a.model)
    if kv_per_token is None and not a.vllm_cmd and not os.path.isdir(a.model):
        ap.error(f"--model {a.model}: no such model folder (make it with "
                 "gpu_host/make_test_model.py)")
    preset = LOAD_PRESETS["kvbig" if (kv_per_token or 0) >= KVBIG_BYTES_PER_TOKEN else "tiny"]
    a.requests = a.requests if a.requests is not None else preset["requests"]
    a.concurrency = a.concurrency if a.concurrency is not None else preset["concurrency"]
    if a.requests < 1 or a.concurrency < 1:
        ap.error("--requests and --concurrency must be >= 1")
    if a.kill_after is not None and not 0 < a.kill_after < a.requests:
        ap.error(f"--kill-after {a.kill_after}: must be between 1 and --requests - 1 "
                 f"({a.requests - 1}), or the kill never lands mid-run")
    room = a.max_model_len - a.max_tokens
    if a.max_prompt_tokens > room:
        ap.error(f"--max-prompt-tokens {a.max_prompt_tokens} + --max-tokens {a.max_tokens} "
                 f"exceed --max-model-len {a.max_model_len}")
    if a.ttft_batch_repeats < 1:
        ap.error(f"--ttft-batch-repeats {a.ttft_batch_repeats}: must be >= 1")
    if a.ttft_batch and a.ttft_prompt_tokens > room:
        ap.error(f"--ttft-prompt-tokens {a.ttft_prompt_tokens} does not fit --max-model-len")
    if a.kv_cache_gib is None:
        need = a.concurrency * a.max_prompt_tokens * (kv_per_token or 32 * 1024) * 1.5
        a.kv_cache_gib = max(2.0, float(-(-need // (1 << 30))))
    a.kv_bytes_per_token = kv_per_token


def mps_pipe_dir() -> str:
    """Where CUDA's MPS clients look for the control daemon (NVIDIA's default, or the
    folder CUDA_MPS_PIPE_DIRECTORY names)."""
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"


def mps_control_running() -> bool:
    """An MPS control daemon keeps its pid file and its control socket in its pipe folder
    while it runs."""
    return any(os.path.exists(os.path.join(mps_pipe_dir(), name))
               for name in ("nvidia-cuda-mps-control.pid", "control"))


def parse_kvcached_env(ap: argparse.ArgumentParser, items: list[str]) -> dict[str, str]:
    """``--kvcached-env KEY=VALUE`` items as a dict; only kvcached's own settings, and
    none that the flavours themselves set (which instance runs kvcached, its layout)."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("KVCACHED_"):
            ap.error(f"--kvcached-env {item!r}: KVCACHED_NAME=VALUE expected")
        if key in ("KVCACHED_AUTOPATCH", "KVCACHED_CONTIGUOUS_LAYOUT", "KVCACHED_IPC_NAME") \
                or key.startswith("KVCACHED_PD"):
            ap.error(f"--kvcached-env {key}: set by the harness itself (the modes and "
                     "--kvcached-layout choose it)")
        env[key] = value
    return env


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    a = parse_args(argv)
    h = LoadHarness(a)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    log(f"pd_load: modes {', '.join(a.modes)} + reference on {a.model}; {a.requests} requests, "
        f"{a.concurrency} at a time, {a.repeats} repeat(s); "
        f"aborts: {h.aborts.describe() if h.aborts else 'none'} -> {h.out}")
    env_thread = describe_environment(os.path.join(h.out, "environment.json")) \
        if a.environment else None
    try:
        h.run()
    except KeyboardInterrupt:
        h.notes.append("interrupted: results as far as they got")
        log("interrupted: writing what was measured")
    finally:
        stop_all([p for r in h.runs.values() for p in r.procs()])
    if env_thread is not None:
        env_thread.join(timeout=30)
    doc = h.write()
    if a.trace:
        try:
            import trace_timeline
            import critical_path
            text = trace_timeline.render(trace_timeline.summarize(h.logs))
            text += "\n" + critical_path.render(critical_path.summarize(h.out))
            with open(os.path.join(h.out, "timeline.txt"), "w", encoding="utf-8") as f:
                f.write(text)
            doc["timeline"] = text
            with open(os.path.join(h.out, "summary.txt"), "w", encoding="utf-8") as f:
                f.write(render_summary(doc))
        except Exception as exc:  # the timeline is a bonus; never lose the summary for it
            log(f"trace timeline failed: {type(exc).__name__}: {exc}")
    with open(os.path.join(h.out, "summary.txt"), encoding="utf-8") as f:
        print(f.read(), flush=True)
    return {"PASS": 0, "UNPROVEN": 2}.get(doc["overall"], 1)


if __name__ == "__main__":
    sys.exit(main())
