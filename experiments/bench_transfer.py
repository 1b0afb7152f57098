#!/usr/bin/env python3
"""Decode-side KV handoff time and effective GB/s against KV bytes per request, per mode.

For every mode (default: vanilla, kvcached-pd-staged, kvcached-pd-direct, kvcached-own)
a P/D pair serves a model with a large KV per token (gpu_host/make_test_model.py
--preset kvbig: 256 KiB/token, so 1 MiB .. 1 GiB = 4 .. 4096 tokens). All pairs start
at once (P on GPU0, D on GPU1); the measurements then run one mode at a time, so the
modes do not compete for the GPUs or NVLink while measured.

Per request (prefill leg on P with max_tokens=1, then the decode leg on D with P's
kv_transfer_params and max_tokens=1), three views of the handoff:
- server:  D's vllm:request_queue_time_seconds for that request. A request waiting for
           remote KV is first scheduled only once its KV has arrived, so this is the
           decode side's wait for the transfer (plus at most a scheduler step);
- nixl:    vLLM's NIXL telemetry on D (vllm:nixl_xfer_time_seconds,
           vllm:nixl_bytes_transferred, vllm:nixl_num_descriptors): what NIXL itself
           timed and moved. Absent when a transport bypasses vLLM's transfer stats;
- client:  the decode leg's HTTP latency minus the median latency of a no-transfer
           request to the same D (an 8-token prompt, max_tokens=1).
Staged modes also get the effective handoff, device times from kvcached-pd's metrics: P's
pack + the NIXL READ + D's unpack, or on the CUDA IPC wire (no READ: D's unpack reads P's
packed extent in place) pack + unpack. The wire of each request is read from the metrics
(a staged request D unpacked with no READ counted went over IPC) and the wire D's log
names for its peer is reported beside it.
GB/s = KV bytes of the prompt (prompt tokens x KV bytes per token) / time, except the
nixl view, which divides NIXL's own byte count by NIXL's own time.

Also: the time to first token of a concurrent batch of long prompts through pd_proxy.py,
each instance's startup time, NIXL registration time (from the time-stamped logs)
and host RSS of its process tree (API server + EngineCore) once ready.

Writes under --out: bench.json, bench.csv, instances.csv, ttft.csv, summary.txt,
bench_gbps.png, logs/. No pass/fail thresholds: a mode whose servers fail is skipped
with the reason recorded; the exit status is non-zero only if no mode was measured.

usage: bench_transfer.py --out OUT [--modes vanilla,kvcached-pd-staged] [--sizes 1,16,256,1024]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import sys
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pd_common import (M, Deadline, MetricSnapshot, log, make_prompt_text, median, metric_delta,
                       percentile, post_json, scrape_metrics, write_json)
from pd_modes import BENCH_MODES, MODES, Mode, kv_transfer_config
from pd_proxy import PREFILL_KV_PARAMS
from pd_servers import (HTTP_PORT_BASE, PROXY_PORT_BASE, SIDE_CHANNEL_PORT_BASE, ManagedProcess,
                        PortAllocator, ServeSettings, default_vllm_cmd, describe_environment,
                        indent, instance_env, kvcached_pd_evidence, neutral_env,
                        registration_timings, rss_report,
                        serve_args, stop_all, wait_until_ready, wire_evidence,
                        write_vllm_logging_config)
import trace_timeline

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_COPY_CEILING_GBPS = 393.0  # GPU0 -> GPU1 torch peer copy on the 2xH200 host
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2}


def kv_bytes_per_token(model_dir: str) -> int:
    """Layers x (K,V) x KV heads x head_dim x dtype bytes, from the model's config.json."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


def effective_handoff(staged: bool, read_s: float | None, pack_s: float | None,
                      unpack_s: float | None) -> tuple[str | None, float | None]:
    """(wire, effective seconds) of one handoff.

    Vanilla: the NIXL READ alone. Staged: pack + READ + unpack on the NIXL wire; on the
    CUDA IPC wire D's unpack copies straight from P's mapped extent and no READ is
    counted, so a staged request that D unpacked without a READ went over IPC and its
    handoff is pack + unpack. None where a part is missing."""
    if not staged:
        return ("nixl" if read_s is not None else None), read_s
    if unpack_s is None:
        return None, None
    wire = "nixl" if read_s is not None else "ipc"
    parts = [pack_s, unpack_s] + ([read_s] if read_s is not None else [])
    return wire, None if None in parts else sum(parts)


def model_max_positions(model_dir: str) -> int | None:
    """The model's max_position_embeddings (vLLM refuses a longer --max-model-len)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if value else None


@dataclass
class PairRun:
    mode: Mode
    prefill: ManagedProcess
    decode: ManagedProcess
    ports: dict
    proxy: ManagedProcess | None = None
    proxy_url: str | None = None
    status: str = "starting"  # starting | ready | measured | skipped
    reason: str | None = None
    broken: str | None = None  # set when a request got no answer: measure no further
    result: dict = field(default_factory=dict)

    @property
    def p_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['prefill']['http']}"

    @property
    def d_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['decode']['http']}"

    def procs(self) -> list[ManagedProcess]:
        return [self.prefill, self.decode] + ([self.proxy] if self.proxy else [])


def _request(prompt: str, model: str, kv_params: dict | None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "ignore_eos": True, "stream": False}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    return body


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = os.path.abspath(a.out)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.deadline = Deadline(a.deadline_s)
        self.run_tag = uuid.uuid4().hex[:6]
        self.kv_per_token = a.kv_bytes_per_token or kv_bytes_per_token(a.model)
        limit = model_max_positions(a.model)
        if limit and a.max_model_len > limit:
            log(f"--max-model-len {a.max_model_len} exceeds the model's {limit} positions "
                f"(vLLM would refuse to start): using {limit}")
            a.max_model_len = limit
        kv_bytes = int(a.kv_cache_gib * (1 << 30)) if a.kv_cache_gib > 0 else None
        gmu = a.gpu_memory_utilization if a.gpu_memory_utilization is not None else \
            (0.04 if kv_bytes else 0.2)
        self.settings = ServeSettings(
            model=a.model, max_model_len=a.max_model_len, gpu_memory_utilization=gmu,
            kv_cache_bytes=kv_bytes,
            vllm_cmd=shlex.split(a.vllm_cmd) if a.vllm_cmd else default_vllm_cmd(),
            extra_args=shlex.split(a.extra_serve_args or ""),
            logging_config_path=write_vllm_logging_config(
                os.path.join(self.out, "vllm_logging.json")),
            kv_role_style="both" if a.kv_both else "split", cuda_graphs=a.cuda_graphs)
        self.http_ports = PortAllocator(a.port_base)
        self.side_ports = PortAllocator(a.side_channel_port_base)
        self.proxy_ports = PortAllocator(a.proxy_port_base)
        # KV MiB per request -> prompt tokens (at least 2: BOS + one byte)
        self.sizes = []
        for mib in a.sizes:
            tokens = max(2, round(mib * (1 << 20) / self.kv_per_token))
            fits = tokens + 1 <= a.max_model_len
            self.sizes.append({"kv_mib_requested": mib, "prompt_tokens": tokens, "fits": fits})

    # ---- startup ---------------------------------------------------------------------
    def launch(self, mode: Mode) -> PairRun:
        ports, procs = {}, {}
        for role, cfg, gpu in (("prefill", mode.prefill, self.a.prefill_gpu),
                               ("decode", mode.decode, self.a.decode_gpu)):
            port, side = self.http_ports.take(), self.side_ports.take()
            ipc = f"kvpd_{self.run_tag}_{mode.name}_{role}".replace("-", "_")
            engine_id = f"bench-{mode.name}-{role}-{self.run_tag}"
            kv_role = "kv_both" if self.settings.kv_role_style == "both" else \
                ("kv_producer" if role == "prefill" else "kv_consumer")
            kvt = kv_transfer_config(mode.connector, kv_role, engine_id)
            env = instance_env(cfg, str(gpu), side, ipc, self.settings.logging_config_path)
            shown = dict(cfg.env, CUDA_VISIBLE_DEVICES=str(gpu),
                         VLLM_NIXL_SIDE_CHANNEL_PORT=str(side), KVCACHED_IPC_NAME=ipc)
            if self.a.staging_mb and cfg.env.get("KVCACHED_PD") == "1":
                env["KVCACHED_PD_STAGING_MB"] = shown["KVCACHED_PD_STAGING_MB"] = \
                    str(self.a.staging_mb)
            if self.a.trace and cfg.env.get("KVCACHED_PD") == "1":
                env["KVCACHED_PD_TRACE"] = shown["KVCACHED_PD_TRACE"] = "1"
            cmd = self.settings.vllm_cmd + serve_args(
                self.settings, port, cfg.block_size, kvt, cfg.serve_args)
            proc = ManagedProcess(f"{mode.name}/{role}", cmd, env,
                                  os.path.join(self.logs, f"{mode.name}-{role}.log"),
                                  f"http://127.0.0.1:{port}/health")
            proc.start(shown)
            procs[role] = proc
            ports[role] = {"http": port, "side_channel": side, "gpu": str(gpu),
                           "engine_id": engine_id, "ipc_name": ipc, "flavor": cfg.flavor,
                           "env": shown}
        return PairRun(mode, procs["prefill"], procs["decode"], ports)

    def start_proxy(self, run: PairRun) -> None:
        port = self.proxy_ports.take()
        cmd = [sys.executable, os.path.join(HERE, "pd_proxy.py"), "--port", str(port),
               "--prefill", run.p_url, "--decode", run.d_url,
               "--timeout", str(self.a.request_timeout)]
        run.proxy = ManagedProcess(f"{run.mode.name}/proxy", cmd, neutral_env(),
                                   os.path.join(self.logs, f"{run.mode.name}-proxy.log"),
                                   f"http://127.0.0.1:{port}/healthz")
        run.proxy.start()
        run.proxy_url = f"http://127.0.0.1:{port}"

    def instance_report(self, proc: ManagedProcess) -> dict:
        return {
            "state": proc.state, "failure": proc.failure, "log": proc.log_path,
            "startup_s": round(proc.ready_at - proc.started_at, 2) if proc.ready_at else None,
            "registration": registration_timings(proc.log_path),
            "rss": rss_report(proc.pid) if proc.state == "ready" else {},
            "kvcached_pd": kvcached_pd_evidence(proc.log_path),
        }

    # ---- measurements ----------------------------------------------------------------
    def _wait_finished(self, url: str, before: MetricSnapshot | None,
                       counts: tuple[str, ...] = (M.QUEUE_TIME_COUNT,), n: int = 1,
                       timeout_s: float = 3.0) -> MetricSnapshot | None:
        """Scrape until each histogram of ``counts`` that the instance has counts ``n``
        more: a request's statistics reach /metrics shortly after its HTTP response."""
        t_end = time.monotonic() + timeout_s
        snap = None
        while True:
            snap = scrape_metrics(url)
            got = [metric_delta(before, snap, name) for name in counts]
            if all(g is None or g >= n for g in got) or time.monotonic() > t_end:
                return snap
            time.sleep(0.01)

    def baseline(self, run: PairRun) -> dict:
        """Latency of a no-transfer request to D: HTTP, scheduling, one forward pass."""
        times = []
        for i in range(self.a.warmup + self.a.repeats + 2):
            res = post_json(run.d_url + "/v1/completions",
                            _request(make_prompt_text(8, seed=900 + i), self.a.model, None),
                            timeout=self.a.request_timeout)
            if not res.ok:
                return {"error": f"HTTP {res.status}: {res.error or res.body[:300]!r}"}
            if i >= self.a.warmup:
                times.append(res.seconds)
        return {"median_s": median(times), "samples_s": times}

    def handoff(self, run: PairRun, tokens: int, seed: int) -> dict:
        """One prefill leg, then one decode leg; returns timings and metric deltas."""
        prompt = make_prompt_text(tokens, seed)
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        p_before = scrape_metrics(run.p_url)
        p = post_json(run.p_url + "/v1/completions",
                      _request(prompt, self.a.model, dict(PREFILL_KV_PARAMS)),
                      timeout=self.a.request_timeout, headers=headers)
        if not p.ok:
            return {"error": f"prefill HTTP {p.status}: {p.error or p.body[:300]!r}",
                    "no_answer": p.status == 0}
        kvp = p.json().get("kv_transfer_params")
        if not kvp:
            return {"error": "prefill returned no kv_transfer_params"}
        staged = "kvcached_pd" in kvp  # kvcached_pd.connector.wire.PARAMS_KEY
        p_after = self._wait_finished(run.p_url, p_before, (M.KVPD_PACK_COUNT,)) \
            if staged else None
        before = scrape_metrics(run.d_url)
        d = post_json(run.d_url + "/v1/completions", _request(prompt, self.a.model, kvp),
                      timeout=self.a.request_timeout, headers=headers)
        if not d.ok:
            return {"error": f"decode HTTP {d.status}: {d.error or d.body[:300]!r}",
                    "no_answer": d.status == 0}
        counts = (M.QUEUE_TIME_COUNT, M.KVPD_UNPACK_COUNT) if staged else (M.QUEUE_TIME_COUNT,)
        after = self._wait_finished(run.d_url, before, counts)
        usage = d.json().get("usage") or {}
        out = {"prompt_tokens": usage.get("prompt_tokens"), "prefill_s": p.seconds,
               "decode_s": d.seconds, "staged": staged,
               "pack_s": metric_delta(p_before, p_after, M.KVPD_PACK_SUM) if staged else None}
        # vLLM's NIXL agent records a transfer on the side that posts it: D's READ in
        # pull mode, P's WRITE (posted once D's registration reached P) in vLLM's push
        # mode. A staged request is READ by D in both modes, with the connector's agent.
        nixl_before, nixl_after = before, after
        if run.mode.connector == "NixlPushConnector" and not staged:
            nixl_before = p_before
            nixl_after = self._wait_finished(run.p_url, p_before, (M.NIXL_XFER_COUNT,))
        for key, name, labels in (
                ("nixl_xfer_s", M.NIXL_XFER_SUM, {}),
                ("nixl_post_s", M.NIXL_POST_SUM, {}),
                ("nixl_bytes", M.NIXL_BYTES_SUM, {}),
                ("nixl_descriptors", M.NIXL_DESCS_SUM, {}),
                ("nixl_transfers", M.NIXL_XFER_COUNT, {})):
            out[key] = metric_delta(nixl_before, nixl_after, name, **labels)
        for key, name, labels in (
                ("server_wait_s", M.QUEUE_TIME_SUM, {}),
                ("unpack_s", M.KVPD_UNPACK_SUM, {}),
                ("staged_handoff_s", M.KVPD_HANDOFF_SUM, {}),
                ("ext_hits", M.EXT_HITS, {}),
                ("local_compute_tokens", M.PROMPT_BY_SOURCE, {"source": "local_compute"})):
            out[key] = metric_delta(before, after, name, **labels)
        if staged and not out["nixl_transfers"]:
            # kvcached-pd's connector READs with its own NIXL agent, whose telemetry is its
            # own metric
            read_s = metric_delta(before, after, M.KVPD_READ_SUM)
            reads = metric_delta(before, after, M.KVPD_READ_COUNT)
            if reads:
                out["nixl_xfer_s"], out["nixl_transfers"] = read_s, reads
        if not out["nixl_transfers"]:  # no NIXL telemetry for this request
            for key in ("nixl_xfer_s", "nixl_post_s", "nixl_bytes", "nixl_descriptors"):
                out[key] = None
        if not staged:
            out["unpack_s"] = out["staged_handoff_s"] = None
        out["wire"], out["effective_s"] = effective_handoff(
            staged, out["nixl_xfer_s"], out["pack_s"], out["unpack_s"])
        return out

    def sweep(self, run: PairRun, baseline_s: float | None) -> list[dict]:
        rows = []
        for size in self.sizes:
            row = {"kv_mib_requested": size["kv_mib_requested"],
                   "prompt_tokens": size["prompt_tokens"], "samples": []}
            rows.append(row)
            if not size["fits"]:
                row["skipped"] = f"{size['prompt_tokens']} tokens exceed --max-model-len"
                continue
            if self.deadline.expired(reserve=self.a.reserve_s):
                row["skipped"] = "out of time (--deadline-s)"
                continue
            if run.broken:
                row["skipped"] = run.broken
                continue
            for i in range(self.a.warmup + self.a.repeats):
                seed = zlib.crc32(f"{run.mode.name}/{size['prompt_tokens']}/{i}".encode())
                sample = self.handoff(run, size["prompt_tokens"], seed)
                sample["warmup"] = i < self.a.warmup
                row["samples"].append(sample)
                if sample.get("no_answer"):  # a hung server: one timeout is enough
                    run.broken = f"an earlier request got no answer: {sample['error']}"
                if "error" in sample:
                    break
            self.summarize_size(row, baseline_s)
            log(f"  {run.mode.name:<28} {row['kv_mib']:>8.1f} MiB: "
                + (f"server {fmt(row.get('server_wait_ms'))} ms "
                   f"({fmt(row.get('gbps_server'))} GB/s), "
                   f"nixl {fmt(row.get('nixl_xfer_ms'))} ms ({fmt(row.get('gbps_nixl'))} GB/s), "
                   f"client {fmt(row.get('handoff_client_ms'))} ms"
                   if not row.get("error") else f"ERROR {row['error']}"))
        return rows

    def summarize_size(self, row: dict, baseline_s: float | None) -> None:
        good = [s for s in row["samples"] if not s.get("warmup") and "error" not in s]
        errors = [s["error"] for s in row["samples"] if "error" in s]
        if errors:
            row["error"] = errors[0]
        if not good:
            return
        tokens = median(s["prompt_tokens"] for s in good) or row["prompt_tokens"]
        kv_bytes = tokens * self.kv_per_token
        row["kv_bytes"] = kv_bytes
        row["kv_mib"] = kv_bytes / 2**20
        row["repeats_ok"] = len(good)

        def med(key):
            return median(s.get(key) for s in good)

        wires = sorted({s.get("wire") for s in good if s.get("wire")})
        row["wire"] = "/".join(wires) or None

        decode_s, server_s, nixl_s = med("decode_s"), med("server_wait_s"), med("nixl_xfer_s")
        handoff_s = decode_s - baseline_s if decode_s is not None and baseline_s is not None \
            else None
        nixl_bytes = med("nixl_bytes")
        row.update({
            "prefill_ms": ms(med("prefill_s")), "decode_leg_ms": ms(decode_s),
            "baseline_ms": ms(baseline_s), "handoff_client_ms": ms(handoff_s),
            "server_wait_ms": ms(server_s), "nixl_xfer_ms": ms(nixl_s),
            "nixl_post_ms": ms(med("nixl_post_s")), "nixl_bytes": nixl_bytes,
            "nixl_descriptors": med("nixl_descriptors"), "nixl_transfers": med("nixl_transfers"),
            "ext_hits": med("ext_hits"), "local_compute_tokens": med("local_compute_tokens"),
            "gbps_server": gbps(kv_bytes, server_s),
            "gbps_client": gbps(kv_bytes, handoff_s),
            "gbps_nixl": gbps(nixl_bytes, nixl_s),
            "pack_ms": ms(med("pack_s")), "unpack_ms": ms(med("unpack_s")),
            "staged_handoff_ms": ms(med("staged_handoff_s")),
            "effective_ms": ms(med("effective_s")),
            "gbps_effective": gbps(kv_bytes, med("effective_s")),
        })

    def ttft_batch(self, run: PairRun) -> dict:
        n, tokens = self.a.ttft_batch, self.a.ttft_prompt_tokens
        if n <= 0:
            return {"skipped": "disabled"}
        if tokens + 1 > self.a.max_model_len:
            return {"skipped": f"{tokens} tokens exceed --max-model-len"}
        if self.deadline.expired(reserve=self.a.reserve_s + 10):
            return {"skipped": "out of time (--deadline-s)"}
        if run.broken:
            return {"skipped": run.broken}
        if run.proxy is None or run.proxy.state != "ready":
            return {"skipped": f"proxy not ready: {run.proxy.failure if run.proxy else None}"}
        url = run.proxy_url
        prompts = [make_prompt_text(tokens, seed=5000 + i) for i in range(n)]

        def one(prompt):
            return post_json(url + "/v1/completions", _request(prompt, self.a.model, None),
                             timeout=self.a.request_timeout)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
        ok = [r for r in results if r.ok]
        legs = [r.json().get("pd_proxy", {}) for r in ok]
        out = {
            "batch": n, "prompt_tokens": tokens, "ok": len(ok), "wall_s": wall,
            "kv_mib_per_request": tokens * self.kv_per_token / 2**20,
            "ttft_ms": [ms(r.seconds) for r in ok],
            "ttft_median_ms": ms(median(r.seconds for r in ok)),
            "ttft_p90_ms": ms(percentile([r.seconds for r in ok], 0.9)),
            "ttft_max_ms": ms(max((r.seconds for r in ok), default=None)),
            "prefill_leg_median_ms": ms(median(x.get("prefill_s") for x in legs)),
            "decode_leg_median_ms": ms(median(x.get("decode_s") for x in legs)),
            "errors": [f"HTTP {r.status}: {r.error or r.body[:200]!r}"
                       for r in results if not r.ok],
        }
        log(f"  {run.mode.name:<28} TTFT batch {n} x {tokens} tokens: median "
            f"{fmt(out['ttft_median_ms'])} ms, max {fmt(out['ttft_max_ms'])} ms, {len(ok)}/{n} ok")
        return out

    def measure(self, run: PairRun) -> None:
        log(f"measuring {run.mode.name}")
        base = self.baseline(run)
        run.result["baseline"] = base
        run.result["sizes"] = self.sweep(run, base.get("median_s"))
        run.result["ttft"] = self.ttft_batch(run)
        run.status = "measured"

    # ---- the run -------------------------------------------------------------------
    def run(self, modes: list[Mode]) -> dict[str, PairRun]:
        runs: dict[str, PairRun] = {}
        try:
            for mode in modes:
                runs[mode.name] = self.launch(mode)
            pairs = list(runs.values())
            wait_until_ready([p for r in pairs for p in (r.prefill, r.decode)],
                             min(self.a.health_timeout,
                                 max(10.0, self.deadline.remaining() - self.a.reserve_s)))
            for r in pairs:
                bad = [p for p in (r.prefill, r.decode) if p.state != "ready"]
                if bad:
                    r.status, r.reason = "skipped", "; ".join(f"{p.name}: {p.failure}" for p in bad)
                else:
                    r.status = "ready"
                    self.start_proxy(r)
                r.result["instances"] = {"prefill": self.instance_report(r.prefill),
                                         "decode": self.instance_report(r.decode)}
            wait_until_ready([r.proxy for r in pairs if r.proxy], 30.0, poll_s=0.2)
            for r in pairs:
                if r.status != "ready":
                    continue
                if self.deadline.expired(reserve=self.a.reserve_s):
                    r.status, r.reason = "skipped", "out of time (--deadline-s)"
                    continue
                try:
                    self.measure(r)
                except Exception as exc:  # keep the other modes' results
                    r.status = "skipped"
                    r.reason = f"measurement crashed: {type(exc).__name__}: {exc}"
                    log(f"{r.mode.name}: {r.reason}")
                r.result["wire_logged"] = wire_evidence(r.decode.log_path)["wires"]
                for p in (r.prefill, r.decode):
                    if not p.alive():
                        time.sleep(0.3)  # let the log reader drain the last lines
                        r.result.setdefault("died", {})[p.name] = {
                            "exit_code": p.proc.returncode, "log_tail": p.tail(40)}
                        log(f"DIED   {p.name} while measured (exit code {p.proc.returncode}); "
                            f"last lines:\n" + indent(p.tail(40)))
        except KeyboardInterrupt:
            log("interrupted: writing what was measured")
        finally:
            stop_all([p for r in runs.values() for p in r.procs()])
        return runs

    # ---- outputs ---------------------------------------------------------------------
    def write(self, runs: dict[str, PairRun], env_thread) -> dict:
        doc = {
            "config": {k: v for k, v in vars(self.a).items()},
            "kv_bytes_per_token": self.kv_per_token, "run_tag": self.run_tag,
            "elapsed_s": round(self.deadline.elapsed(), 1),
            "peer_copy_ceiling_gbps": self.a.ceiling_gbps,
            "definitions": {
                "kv_bytes": "prompt tokens x KV bytes per token",
                "server_wait_ms": "D's vllm:request_queue_time_seconds: wait for the remote KV",
                "nixl_xfer_ms": "vLLM NIXL telemetry on D (vllm:nixl_xfer_time_seconds)",
                "handoff_client_ms": "decode-leg HTTP latency minus a no-transfer request's",
                "gbps_*": "kv_bytes / time / 1e9 (gbps_nixl: NIXL bytes / NIXL time)",
                "pack_ms": "P's vllm:kvcached_pd_pack_seconds: device time of the pack kernels",
                "unpack_ms": "D's vllm:kvcached_pd_unpack_seconds: device time of the scatter",
                "staged_handoff_ms": "D's vllm:kvcached_pd_handoff_seconds: READ posted -> "
                                     "READ seen done + scatter enqueued (engine steps included)",
                "effective_ms": "pack + nixl_xfer + unpack (vanilla: nixl_xfer alone; CUDA IPC "
                                "wire: pack + unpack, the unpack reading P's extent in place)",
                "wire": "per request: ipc when a staged request was unpacked with no NIXL "
                        "READ counted, else nixl; wire_logged: what D's log names",
                "instances": "started concurrently, so startup/registration times include "
                             "CPU contention between instances"},
            "modes": {},
        }
        for name, r in runs.items():
            doc["modes"][name] = {"status": r.status, "reason": r.reason,
                                  "description": r.mode.description, "ports": r.ports, **r.result}
        env_thread.join(timeout=30)
        doc["trace_timeline"] = trace_timeline.summarize(self.logs)
        write_json(os.path.join(self.out, "bench.json"), doc)
        self.write_csvs(doc)
        doc["plot"] = plot(doc, os.path.join(self.out, "bench_gbps.png"))
        text = render_summary(doc)
        with open(os.path.join(self.out, "summary.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        print(text, flush=True)
        return doc

    def write_csvs(self, doc: dict) -> None:
        cols = ["mode", "kv_mib", "prompt_tokens", "repeats_ok", "prefill_ms", "decode_leg_ms",
                "baseline_ms", "handoff_client_ms", "server_wait_ms", "nixl_xfer_ms",
                "nixl_post_ms", "nixl_bytes", "nixl_descriptors", "nixl_transfers", "ext_hits",
                "gbps_server", "gbps_client", "gbps_nixl", "pack_ms", "unpack_ms",
                "staged_handoff_ms", "effective_ms", "gbps_effective", "wire", "error",
                "skipped"]
        with open(os.path.join(self.out, "bench.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, cols, extrasaction="ignore")
            w.writeheader()
            for name, m in doc["modes"].items():
                for row in m.get("sizes", []):
                    w.writerow({"mode": name, **{k: rnd(v) for k, v in row.items()}})
        with open(os.path.join(self.out, "instances.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["mode", "role", "state", "startup_s", "nixl_register_kv_caches_s",
                        "nixl_register_memory_s", "total_rss_mib", "processes",
                        "kvcached_pd_applied"])
            for name, m in doc["modes"].items():
                for role, inst in (m.get("instances") or {}).items():
                    reg, rss = inst.get("registration") or {}, inst.get("rss") or {}
                    w.writerow([name, role, inst["state"], inst.get("startup_s"),
                                reg.get("nixl_register_kv_caches_s"),
                                reg.get("nixl_register_memory_s"), rss.get("total_rss_mib"),
                                len(rss.get("processes", [])),
                                " ".join(inst["kvcached_pd"]["applied"])])
        with open(os.path.join(self.out, "ttft.csv"), "w", newline="") as f:
            cols = ["mode", "batch", "prompt_tokens", "kv_mib_per_request", "ok", "ttft_median_ms",
                    "ttft_p90_ms", "ttft_max_ms", "prefill_leg_median_ms", "decode_leg_median_ms",
                    "wall_s", "skipped"]
            w = csv.DictWriter(f, cols, extrasaction="ignore")
            w.writeheader()
            for name, m in doc["modes"].items():
                if m.get("ttft"):
                    w.writerow({"mode": name, **{k: rnd(v) for k, v in m["ttft"].items()}})


# ---- formatting helpers ----------------------------------------------------------------


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def gbps(nbytes: float | None, seconds: float | None) -> float | None:
    if nbytes is None or seconds is None or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if abs(x) < 1000 else f"{x:.0f}"


def rnd(v):
    return round(v, 4) if isinstance(v, float) else v


def render_summary(doc: dict) -> str:
    lines = [f"kvcached-pd transfer benchmark ({time.strftime('%Y-%m-%d %H:%M:%S')}, "
             f"{doc['elapsed_s']}s, {doc['kv_bytes_per_token'] // 1024} KiB of KV per token)", ""]
    hdr = (f"{'mode':<28} {'KV MiB':>8} {'decode ms':>10} {'server ms':>10} {'GB/s':>7} "
           f"{'nixl ms':>9} {'GB/s':>7} {'client ms':>10} {'GB/s':>7} {'descs':>7}")
    lines += ["Decode-side KV handoff (medians; server = D's wait for the KV, nixl = vLLM's "
              "NIXL telemetry, client = decode leg minus a no-transfer request):", hdr,
              "-" * len(hdr)]
    for name, m in doc["modes"].items():
        if m["status"] != "measured":
            lines.append(f"{name:<28} {m['status']}: {m.get('reason')}")
            continue
        for r in m.get("sizes", []):
            if "kv_mib" not in r:
                lines.append(f"{name:<28} {r['kv_mib_requested']:>8} "
                             f"{r.get('skipped') or r.get('error') or 'no result'}")
                continue
            lines.append(
                f"{name:<28} {r['kv_mib']:>8.1f} {fmt(r['decode_leg_ms']):>10} "
                f"{fmt(r['server_wait_ms']):>10} {fmt(r['gbps_server']):>7} "
                f"{fmt(r['nixl_xfer_ms']):>9} {fmt(r['gbps_nixl']):>7} "
                f"{fmt(r['handoff_client_ms']):>10} {fmt(r['gbps_client']):>7} "
                f"{fmt(r['nixl_descriptors'], 0):>7}"
                + (f"  ERROR {r['error']}" if r.get("error") else ""))
    hdr = (f"{'mode':<28} {'KV MiB':>8} {'wire':>5} {'pack ms':>8} {'nixl ms':>8} "
           f"{'unpack ms':>9} {'effective ms':>12} {'GB/s':>7} {'staged handoff ms':>17}")
    lines += ["", ("Handoff parts (medians; effective = pack + NIXL READ + unpack, device "
                   "times for pack/unpack; vanilla: the READ alone; wire ipc: pack + unpack, "
                   "D's unpack reading P's extent through CUDA IPC):"), hdr, "-" * len(hdr)]
    for name, m in doc["modes"].items():
        for r in m.get("sizes", []) if m["status"] == "measured" else ():
            if r.get("effective_ms") is not None:
                lines.append(f"{name:<28} {r['kv_mib']:>8.1f} {r.get('wire') or '-':>5} "
                             f"{fmt(r.get('pack_ms'), 3):>8} "
                             f"{fmt(r['nixl_xfer_ms'], 3):>8} {fmt(r.get('unpack_ms'), 3):>9} "
                             f"{fmt(r['effective_ms'], 3):>12} {fmt(r['gbps_effective']):>7} "
                             f"{fmt(r.get('staged_handoff_ms'), 3):>17}")
    logged = {n: m.get("wire_logged") for n, m in doc["modes"].items() if m.get("wire_logged")}
    if logged:
        lines.append("wire D's log names for its peer: "
                     + "; ".join(f"{n} {'/'.join(w)}" for n, w in logged.items()))
    lines += ["", "TTFT through pd_proxy (concurrent batch, max_tokens=1):",
              f"{'mode':<28} {'batch':>5} {'tokens':>6} {'ok':>4} {'median ms':>10} {'p90 ms':>9} "
              f"{'max ms':>9} {'P leg ms':>9} {'D leg ms':>9}"]
    for name, m in doc["modes"].items():
        t = m.get("ttft") or {}
        if "batch" in t:
            lines.append(f"{name:<28} {t['batch']:>5} {t['prompt_tokens']:>6} {t['ok']:>4} "
                         f"{fmt(t['ttft_median_ms']):>10} {fmt(t['ttft_p90_ms']):>9} "
                         f"{fmt(t['ttft_max_ms']):>9} {fmt(t['prefill_leg_median_ms']):>9} "
                         f"{fmt(t['decode_leg_median_ms']):>9}")
        elif t:
            lines.append(f"{name:<28} {t.get('skipped')}")
    lines += ["", "Instances (started concurrently):",
              f"{'mode':<28} {'role':<8} {'startup s':>9} {'NIXL reg s':>10} {'reg mem s':>9} "
              f"{'RSS MiB':>9} {'procs':>5}  kvcached-pd"]
    for name, m in doc["modes"].items():
        for role, inst in (m.get("instances") or {}).items():
            reg, rss = inst.get("registration") or {}, inst.get("rss") or {}
            lines.append(f"{name:<28} {role:<8} {fmt(inst.get('startup_s'), 1):>9} "
                         f"{fmt(reg.get('nixl_register_kv_caches_s'), 3):>10} "
                         f"{fmt(reg.get('nixl_register_memory_s'), 3):>9} "
                         f"{fmt(rss.get('total_rss_mib'), 0):>9} "
                         f"{len(rss.get('processes', [])):>5}  "
                         f"{' '.join(inst['kvcached_pd']['applied']) or '-'}")
    lines += ["", trace_timeline.render(doc.get("trace_timeline") or {}).rstrip("\n")]
    lines += ["", f"plot: {doc.get('plot')}"]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - the numbers are in the CSV anyway
        return f"skipped: matplotlib unavailable ({exc})"
    views = (("gbps_server", "server: D's wait for the KV"),
             ("gbps_nixl", "NIXL telemetry (bytes/xfer time)"),
             ("gbps_client", "client: decode leg - no-transfer leg"))
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(views), figsize=(6 * len(views), 4.8), sharey=True)
    # one colour per mode in every panel, even where a mode has no points
    colours = {name: f"C{i}" for i, name in enumerate(doc["modes"])}
    drawn = 0
    for ax, (key, title) in zip(axes, views):
        for name, m in doc["modes"].items():
            pts = [(r["kv_mib"], r[key]) for r in m.get("sizes", [])
                   if r.get("kv_mib") and r.get(key) and r[key] > 0]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=name, color=colours[name])
                drawn += 1
        ax.axhline(doc["peer_copy_ceiling_gbps"], color="black", linestyle="--", linewidth=1,
                   label=f"peer-copy ceiling {doc['peer_copy_ceiling_gbps']:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.set_yscale("log")
        ax.set_xlabel("KV MiB per request")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("effective GB/s (1e9 B/s)")
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    axes[0].legend(handles.values(), handles.keys(), fontsize=8, loc="lower right")
    fig.suptitle(f"Decode-side KV handoff, {doc['kv_bytes_per_token'] // 1024} KiB KV/token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path if drawn else f"{path} (no data points)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="/tmp/kvbig")
    ap.add_argument("--kv-bytes-per-token", type=int, default=0,
                    help="override; default: computed from the model's config.json")
    ap.add_argument("--modes", default=",".join(BENCH_MODES),
                    help=f"comma-separated, measured in this order; known: {', '.join(MODES)}")
    ap.add_argument("--sizes", default="1,4,16,64,256,1024",
                    help="KV MiB per request (prompt tokens = MiB / KV per token)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests per size")
    ap.add_argument("--ttft-batch", type=int, default=8, help="0 disables the TTFT batch")
    ap.add_argument("--ttft-prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-model-len", type=int, default=4352)
    ap.add_argument("--kv-cache-gib", type=float, default=12.0,
                    help="KV budget per instance (--kv-cache-memory-bytes); 0 = from "
                         "--gpu-memory-utilization")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--staging-mb", type=int, default=2048,
                    help="KVCACHED_PD_STAGING_MB for kvcached-pd instances (a 1 GiB request "
                         "must fit); 0 = kvcached-pd's default")
    ap.add_argument("--no-trace", dest="trace", action="store_false",
                    help="do not set KVCACHED_PD_TRACE=1 on kvcached-pd instances")
    ap.add_argument("--prefill-gpu", default="0")
    ap.add_argument("--decode-gpu", default="1")
    ap.add_argument("--health-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--deadline-s", type=float, default=540.0,
                    help="whole-run budget: what does not fit is reported as skipped")
    ap.add_argument("--reserve-s", type=float, default=25.0,
                    help="time kept for shutdown and writing results")
    ap.add_argument("--ceiling-gbps", type=float, default=PEER_COPY_CEILING_GBPS)
    ap.add_argument("--kv-both", action="store_true", help="kv_role kv_both on P and D")
    ap.add_argument("--vllm-cmd", default=os.environ.get("KVPD_VLLM_CMD"),
                    help="command that runs `vllm serve` (default: $KVPD_VLLM_CMD, else this "
                         "python -m vllm.entrypoints.cli.main serve)")
    ap.add_argument("--extra-serve-args", default="")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="run every instance with vLLM's CUDA graphs (default: --enforce-eager)")
    ap.add_argument("--port-base", type=int, default=HTTP_PORT_BASE + 200)
    ap.add_argument("--side-channel-port-base", type=int, default=SIDE_CHANNEL_PORT_BASE + 200)
    ap.add_argument("--proxy-port-base", type=int, default=PROXY_PORT_BASE + 200)
    a = ap.parse_args(argv)
    a.sizes = [float(s) for s in a.sizes.split(",") if s.strip()]
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        if m not in MODES or not MODES[m].is_pd:
            pd_modes = ", ".join(n for n in MODES if MODES[n].is_pd)
            ap.error(f"--modes: {m!r} is not a PD mode ({pd_modes})")
    return a


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    a = parse_args(argv)
    bench = Bench(a)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    log(f"bench: modes {', '.join(a.modes)}; {bench.kv_per_token // 1024} KiB KV/token; sizes "
        + ", ".join(f"{s['kv_mib_requested']:g} MiB={s['prompt_tokens']} tok" for s in bench.sizes)
        + f" -> {bench.out}")
    env_thread = describe_environment(os.path.join(bench.out, "environment.json"))
    runs = bench.run([MODES[m] for m in a.modes])
    doc = bench.write(runs, env_thread)
    return 0 if any(m["status"] == "measured" for m in doc["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
