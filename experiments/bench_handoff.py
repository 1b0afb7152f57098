#!/usr/bin/env python3
"""The colocated handoff as the servers run it, in one process: pack, tag check, unpack.

Why: on one H100 (vLLM 0.26.0, P and D on one GPU, the IPC wire) the servers measured
the pack and the unpack at ~0.5 ms each from 4 MiB to 94 MiB
(experiments/results/2026-11-25-h100-colocated/): fixed cost, not bandwidth. Their
start events were recorded before the host's preparation, and the kvbig model's
forward is so short that the GPU sat idle while the host prepared, so host time showed
up as device time. This benchmark repeats the servers' calls on an idle GPU and splits
the time:

- P (``PrefillWorker.pack``): one step's packs (``--batch`` requests), the tag of each
  written after its KV, the pack event recorded; ``p_host`` (wall clock of the calls),
  ``p_span`` (device time from an event recorded before the host's work, where the
  servers recorded theirs until the branch h2-colocated-speed), ``p_device`` (from the
  first device operation, where they record it now; = ``p_span`` on an older checkout);
- D (``DecodeWorker._unpack_ready`` / ``_scatter``): its streams wait on P's pack
  event, the tags are read back (one read per step where the checkout has
  ``tokens.read_tags``, one per request otherwise) and checked, and each extent is
  unpacked straight from P's staging (what the IPC wire maps; in one process the same
  memory, and the IPC copy ran at the local copy's speed on the H100: selftest.json);
  ``d_tag`` (host), ``d_host`` (the unpack calls), ``d_span`` / ``d_device`` as for P,
  summed over the step's requests as the servers' per-request samples add up;
- ``effective`` = ``p_device`` + ``d_device`` (the servers' "effective handoff"),
  ``effective_span`` the same from the early events; ``wall``: host clock from P's first
  call to the end of D's last unpack on the device (a synchronize), everything in.

Medians over ``--iters`` steps after ``--warmup``; every configuration is checked once
(D's blocks equal P's). Kernels: ``select_kernel`` as the servers choose them
(kvcached's contiguous layout: one torch gather/scatter for all layers; its split
layout: the one-launch Triton kernels).

On the GPU host (~1 min; ~2 min with ``--baseline``)::

    python3 experiments/bench_handoff.py --out $OUT/handoff \\
        [--baseline /path/to/an/older/checkout]

``--baseline DIR`` runs the same benchmark again in a fresh interpreter importing
kvcached_pd from DIR (e.g. ``git worktree add /tmp/kvpd-base 462527c``, or
``git archive 462527c kvcached_pd | tar -x -C DIR``) and prints both side by side. It
writes ``OUT/bench_handoff.json`` (and ``OUT/base/bench_handoff.json``) and prints one
table. CPU smoke test: ``--device cpu --small``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
# (layers, KV heads, head_dim): experiments/gpu_host/make_test_model.py's presets
GEOMETRIES = {"kvbig": (32, 16, 128), "tiny": (8, 8, 128)}
SMALL_GEOMETRIES = {"small": (2, 2, 64)}
SIZES_MIB = (4, 94, 1024)
SMALL_SIZES_MIB = (1 / 16, 1 / 4)
LAYOUTS = ("kvcached_contiguous", "kvcached_split_half")
KVCACHED_PAGE = 2 * MiB
METRICS = ("p_host", "p_span", "p_device", "d_tag", "d_host", "d_span", "d_device",
           "effective", "effective_span", "wall")


def load(src: str | None) -> SimpleNamespace:
    """kvcached_pd's functions from ``src`` (default: this checkout), and what its API
    offers (the ``started`` event, the batched tag read)."""
    sys.path.insert(0, str(src or HERE.parent))
    import torch

    from kvcached_pd.connector import tokens
    from kvcached_pd.transport import pack
    from kvcached_pd.transport.format import PackedFormat
    from kvcached_pd.transport.layout import AttnCacheSpec, KVCacheLayers, logical_kv_view

    return SimpleNamespace(
        torch=torch, pack=pack, tokens=tokens, PackedFormat=PackedFormat,
        AttnCacheSpec=AttnCacheSpec, KVCacheLayers=KVCacheLayers,
        logical_kv_view=logical_kv_view,
        source=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(pack.__file__)))),
        has_started="started" in inspect.signature(pack.pack_request).parameters,
        has_read_tags=hasattr(tokens, "read_tags"))


def build_caches(K, layout: str, geometry: tuple[int, int, int], num_blocks: int,
                 block_size: int, device: str):
    """kvcached's layouts (as experiments/bench_pack.py builds them), as logical views."""
    torch = K.torch
    layers, heads, head_dim = geometry
    dtype = torch.bfloat16
    if layout == "kvcached_contiguous":
        whole = torch.empty((num_blocks, layers, 2, block_size, heads, head_dim), dtype=dtype,
                            device=device)
        caches = [whole[:, layer] for layer in range(layers)]
    else:  # split half: all K blocks, then all V blocks at a 2 MiB-aligned offset
        block_elems = block_size * heads * head_dim
        v_offset = math.ceil(num_blocks * block_elems * 2 / KVCACHED_PAGE) * KVCACHED_PAGE // 2
        caches = []
        for _ in range(layers):
            raw = torch.empty(2 * v_offset, dtype=dtype, device=device)
            caches.append(torch.as_strided(raw, (num_blocks, 2, block_size, heads, head_dim),
                                           (block_elems, v_offset, heads * head_dim, head_dim, 1)))
    for cache in caches:
        cache.view(torch.int16).random_(-(2 ** 15), 2 ** 15)
    spec = K.AttnCacheSpec(block_size, heads, head_dim)
    return K.KVCacheLayers.from_views([K.logical_kv_view(c, spec) for c in caches], stack=True)


class Clock:
    """CUDA timing events, or host clocks on the CPU (where every call has run when it
    returns, so a span and a device time are both the host's)."""

    def __init__(self, K, device: str) -> None:
        self.K, self.cuda = K, device.startswith("cuda")

    def event(self):
        if self.cuda:
            return self.K.torch.cuda.Event(enable_timing=True)
        return _HostEvent()

    def stream(self):
        return self.K.torch.cuda.current_stream() if self.cuda else None


class _HostEvent:
    def __init__(self) -> None:
        self.t = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return 1e3 * (end.t - self.t)

    def synchronize(self) -> None:
        pass


def one_step(K, clock, p_layers, d_layers, fmt, staging, requests, tag_stream, pack_event,
             check: bool = False):
    """P packs ``requests``, D checks their tags and unpacks them; the step's timings (ms).
    ``check``: verify that D's blocks now hold P's (:func:`check_moved`)."""
    torch = K.torch
    stream = clock.stream()
    t0 = time.perf_counter()
    # ---- P: PrefillWorker.pack
    p_span, p_end = clock.event(), clock.event()
    p_start = clock.event() if K.has_started else p_span
    p_span.record(stream)
    for i, r in enumerate(requests):
        extra = {"started": p_start} if K.has_started and i == 0 else {}
        K.pack.pack_request(p_layers, list(r.p_ids), staging[r.offset: r.offset + r.nbytes],
                            fmt, K.tokens.tag_bytes(r.token, r.offset, r.nbytes), **extra)
    if pack_event is not None:
        pack_event.record(stream)
    p_end.record(stream)
    t1 = time.perf_counter()
    # ---- D: DecodeWorker._unpack_ready, then _scatter per request
    sources = [staging[r.offset: r.offset + r.nbytes] for r in requests]
    if pack_event is not None:
        tag_stream.wait_event(pack_event)
    if K.has_read_tags:
        tags = K.tokens.read_tags(sources, tag_stream)
    else:
        tags = [K.tokens.read_tag(src, tag_stream) for src in sources]
    for tag, r in zip(tags, requests):
        reason = K.tokens.check_tag(tag, r.token.hex(), r.offset, r.nbytes)
        if reason is not None:
            raise AssertionError(f"tag check failed: {reason}")
    t2 = time.perf_counter()
    d_events = []
    for r, src in zip(requests, sources):
        if pack_event is not None:
            stream.wait_event(pack_event)
        span, end = clock.event(), clock.event()
        start = clock.event() if K.has_started else span
        span.record(stream)
        extra = {"started": start} if K.has_started else {}
        K.pack.unpack_request(d_layers, list(r.d_ids), src, fmt, r.num_tokens, r.n_tok_slots,
                              **extra)
        end.record(stream)
        d_events.append((span, start, end))
    t3 = time.perf_counter()
    if clock.cuda:
        torch.cuda.synchronize()
    t4 = time.perf_counter()
    if check:
        check_moved(K, p_layers, d_layers, requests)
    p_device = p_start.elapsed_time(p_end)
    d_device = sum(start.elapsed_time(end) for _, start, end in d_events)
    d_span = sum(span.elapsed_time(end) for span, _, end in d_events)
    p_span_ms = p_span.elapsed_time(p_end)
    return {"p_host": 1e3 * (t1 - t0), "p_span": p_span_ms, "p_device": p_device,
            "d_tag": 1e3 * (t2 - t1), "d_host": 1e3 * (t3 - t2), "d_span": d_span,
            "d_device": d_device, "effective": p_device + d_device,
            "effective_span": p_span_ms + d_span, "wall": 1e3 * (t4 - t0)}


def plan_requests(K, fmt, num_blocks: int, block_size: int, mib: float, batch: int, seed: int):
    """``batch`` requests of ``mib`` each: random P blocks, other random D blocks, and
    their extents one after another in P's staging (4 KiB-aligned, as staging is)."""
    torch = K.torch
    per_block = block_size * fmt.bytes_per_token_all_layers
    nb = max(1, round(mib * MiB / per_block))
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    requests, offset = [], 0
    for i in range(batch):
        slots = nb * block_size
        nbytes = fmt.extent_bytes(slots)
        requests.append(SimpleNamespace(
            p_ids=order[2 * i * nb: (2 * i + 1) * nb], d_ids=order[(2 * i + 1) * nb: (2 * i + 2) * nb],
            offset=offset, nbytes=nbytes, n_tok_slots=slots, num_tokens=slots,
            token=K.tokens.new_token()))
        offset += math.ceil(nbytes / 4096) * 4096
    return requests, offset, nb


def check_moved(K, p_layers, d_layers, requests) -> None:
    torch = K.torch
    for r in requests:
        p_ids = torch.tensor(r.p_ids, device=p_layers.device)
        d_ids = torch.tensor(r.d_ids, device=d_layers.device)
        for p_view, d_view in zip(p_layers.layers, d_layers.layers):
            # as integers: random bits hold NaNs, which never compare equal
            if not torch.equal(p_view.view(torch.int16)[:, p_ids],
                               d_view.view(torch.int16)[:, d_ids]):
                raise AssertionError("D's blocks differ from P's after the handoff")


def bench(args, K) -> dict:
    torch = K.torch
    device = args.device
    geometries = SMALL_GEOMETRIES if args.small else {g: GEOMETRIES[g] for g in args.geometries}
    sizes = SMALL_SIZES_MIB if args.small else args.sizes
    clock = Clock(K, device)
    rows = []
    for name, geometry in geometries.items():
        fmt = K.PackedFormat.for_cache(*geometry, torch.bfloat16)
        per_block = args.block_size * fmt.bytes_per_token_all_layers
        max_blocks = max(max(1, round(mib * MiB / per_block)) * batch
                         for mib in sizes for batch in args.batches)
        num_blocks = 2 * max_blocks + 8  # P's and D's blocks drawn from one permutation
        for layout in args.layouts:
            p_layers = build_caches(K, layout, geometry, num_blocks, args.block_size, device)
            d_layers = build_caches(K, layout, geometry, num_blocks, args.block_size, device)
            kernel = K.pack.select_kernel(p_layers, fmt)
            K.pack.select_kernel(d_layers, fmt)
            for mib in sizes:
                for batch in args.batches:
                    requests, staging_bytes, nb = plan_requests(
                        K, fmt, num_blocks, args.block_size, mib, batch, args.seed)
                    staging = torch.zeros(staging_bytes, dtype=torch.uint8, device=device)
                    tag_stream = torch.cuda.Stream() if clock.cuda else None
                    pack_event = torch.cuda.Event(interprocess=True) if clock.cuda else None
                    samples = []
                    for i in range(args.warmup + args.iters):
                        step = one_step(K, clock, p_layers, d_layers, fmt, staging, requests,
                                        tag_stream, pack_event, check=i == 0)
                        if i >= args.warmup:
                            samples.append(step)
                    row = {"geometry": name, "layout": layout, "kernel": kernel,
                           "mib": round(requests[0].nbytes / MiB, 3), "blocks": nb,
                           "batch": batch, "iters": len(samples)}
                    for metric in METRICS:
                        row[metric] = round(statistics.median(s[metric] for s in samples), 4)
                    rows.append(row)
                    print(f"{name} {layout} {row['mib']:.1f} MiB x{batch}: effective "
                          f"{row['effective']:.3f} ms (span {row['effective_span']:.3f}), "
                          f"wall {row['wall']:.3f} ms", flush=True)
                    del staging
            del p_layers, d_layers
            if clock.cuda:
                torch.cuda.empty_cache()
    return {"label": args.label, "source": K.source, "device": device,
            "device_name": torch.cuda.get_device_name() if clock.cuda else "cpu",
            "torch": torch.__version__,
            "api": {"started": K.has_started, "read_tags": K.has_read_tags},
            "rows": rows}


def render(results: list[dict]) -> str:
    """One table: a line per configuration and checkout (ms, medians)."""
    short = {"p_host": "P host", "p_span": "P span", "p_device": "P dev", "d_tag": "D tag",
             "d_host": "D host", "d_span": "D span", "d_device": "D dev",
             "effective": "eff", "effective_span": "eff span", "wall": "wall"}
    head = (f"{'checkout':<8} {'geometry':<6} {'layout':<20} {'MiB':>8} {'x':>2} "
            + " ".join(f"{short[m]:>8}" for m in METRICS))
    lines = [f"handoff in one process, idle GPU, medians in ms ({results[0]['device_name']}, "
             f"torch {results[0]['torch']})", head, "-" * len(head)]
    keyed = [{(r["geometry"], r["layout"], r["mib"], r["batch"]): r for r in res["rows"]}
             for res in results]
    for key in keyed[0]:
        for res, rows in zip(results, keyed):
            r = rows.get(key)
            if r is None:
                continue
            cells = " ".join(f"{r[m]:>8.3f}" for m in METRICS)
            lines.append(f"{res['label']:<8} {r['geometry']:<6} {r['layout']:<20} "
                         f"{r['mib']:>8.2f} {r['batch']:>2} {cells}")
    for res in results:
        lines.append(f"{res['label']}: {res['source']} (started event: {res['api']['started']}, "
                     f"batched tag read: {res['api']['read_tags']})")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for bench_handoff.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny geometry and sizes (CPU smoke)")
    ap.add_argument("--geometries", type=lambda s: s.split(","), default=list(GEOMETRIES))
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS))
    ap.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")],
                    default=list(SIZES_MIB), help="MiB per request")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="requests per step (one pack step, one poll on D)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--src", help="import kvcached_pd from this checkout (default: this one)")
    ap.add_argument("--label", default="this")
    ap.add_argument("--baseline", help="an older checkout to run the same benchmark with")
    args = ap.parse_args(argv)
    if args.small:
        args.batches = [b for b in args.batches if b <= 2] or [1]
    return args


def baseline_command(argv: list[str], baseline: str, out: Path) -> list[str]:
    """This benchmark's command line for the baseline run: the same options, without
    ``--baseline``, importing kvcached_pd from ``baseline`` and writing to ``out``."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--baseline", "--out", "--src", "--label"):
            skip = True
        elif not arg.startswith(("--baseline=", "--out=", "--src=", "--label=")):
            rest.append(arg)
    return [sys.executable, str(Path(__file__).resolve()), *rest, "--src", baseline,
            "--label", "base", "--out", str(out)]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    if args.baseline:
        # first, in a fresh interpreter: one process imports one kvcached_pd
        base_out = args.out / "base"
        subprocess.run(baseline_command(argv, args.baseline, base_out), check=True)
        results.append(json.loads((base_out / "bench_handoff.json").read_text()))
    K = load(args.src)
    result = bench(args, K)
    (args.out / "bench_handoff.json").write_text(json.dumps(result, indent=1))
    results.append(result)
    text = render(results)
    (args.out / "summary.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
