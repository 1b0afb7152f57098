"""Does another launch shape of the graph kernel read P's extent across NVLink faster?

Why: across two GPUs of a host (2 x H200, 2026-11-27e and f) the IPC wire's effective
handoff at 1 GiB is 3.72-3.75 ms, 287-289 GB/s, and issue 22 asks for 300: P's pack
(0.64 ms, local) then D's unpack, which reads the 1 GiB extent from P's GPU at ~349 GB/s
(3.07 ms). The unpack is one replay of :mod:`kvcached_pd.transport.pack_graph`'s kernel:
a fixed grid of ``PROGRAMS_PER_SM`` programs per SM, each moving ``BLOCK`` words at a
time with ``NUM_WARPS`` warps (1024 / 16 / 4). Reads across the link are bound by the
requests in flight and their size, which those three set.

For each shape this builds the product's graphs (``GraphLauncher``, the module constants
set first) over kvcached's contiguous layout with the kvbig geometry (32 layers, 16 KV
heads x 128, bf16: 256 KiB per token) on D's GPU, packs a request on P's GPU with the
product's path, and times on D's stream (CUDA events, idle GPUs):

* ``remote_unpack``: D's unpack reading the extent in P's GPU memory (peer access, what
  the IPC wire's mapping gives D across two GPUs), checked block for block against P's;
* ``local_unpack`` / ``local_pack``: the same kernel with extent and cache on one GPU
  (what colocated P and D run), so that a shape that helps across the link is seen not
  to slow the one-GPU case.

usage (a host with two GPUs; torch with CUDA and Triton, no vLLM, ~1 min):
    python3 experiments/bench_remote_unpack.py --out /tmp/ru.json
With one GPU it times the local rows only.
"""

from __future__ import annotations

import argparse
import array
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_launch_paths import KVBIG  # noqa: E402
from bench_pack import kvcached_contiguous  # noqa: E402

from kvcached_pd.transport import pack as pack_mod  # noqa: E402
from kvcached_pd.transport import pack_graph  # noqa: E402
from kvcached_pd.transport.layout import AttnCacheSpec, KVCacheLayers, logical_kv_view  # noqa: E402

MiB = 1 << 20
BS = 16
# (BLOCK words per item, programs per SM, warps per program); the first is the product's
SHAPES = ((1024, 16, 4), (2048, 8, 8), (1024, 8, 4), (2048, 8, 4), (4096, 4, 8),
          (4096, 8, 8), (4096, 4, 16), (8192, 2, 16))


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"1024/16/4,2048/8/8"`` -> ((1024, 16, 4), (2048, 8, 8))."""
    shapes = []
    for item in text.split(","):
        block, per_sm, warps = (int(x) for x in item.split("/"))
        if block <= 0 or block & (block - 1) or per_sm <= 0 or warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"bad shape {item!r}: BLOCK a power of two, programs >= 1, "
                             "warps a power of two <= 32")
        shapes.append((block, per_sm, warps))
    return tuple(shapes)


def layers_on(device: str, num_blocks: int, seed: int):
    caches = kvcached_contiguous(KVBIG, num_blocks, BS, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for c in caches:
        c.normal_(generator=gen)
    views = [logical_kv_view(c, AttnCacheSpec(BS, KVBIG.num_kv_heads, KVBIG.head_dim))
             for c in caches]
    return caches, views


def launcher(views, shape, max_blocks: int) -> pack_graph.GraphLauncher:
    pack_graph.BLOCK, pack_graph.PROGRAMS_PER_SM, pack_graph.NUM_WARPS = shape
    plan = pack_mod._build_plan(KVCacheLayers.from_views(views))
    fmt = KVBIG.fmt
    return pack_graph.GraphLauncher(plan.words, plan.addrs,
                                    fmt.bytes_per_token_all_layers // plan.word.itemsize,
                                    max_blocks, slots=4)


def timed(device: str, fn, iters: int, warmup: int = 3, gap_s: float = 0.0) -> float:
    """Median ms of ``fn`` on ``device``'s current stream; ``gap_s``: the GPUs left idle
    that long before each call, as between the servers' single requests."""
    with torch.cuda.device(device):
        for _ in range(warmup):
            fn()
            torch.cuda.synchronize()  # a slot is reused only once its replay has run
        times = []
        for _ in range(iters):
            if gap_s:
                time.sleep(gap_s)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def enable_peer(d_dev: int, p_dev: int) -> bool:
    if not torch.cuda.can_device_access_peer(d_dev, p_dev):
        return False
    try:  # CuPy is on the GPU hosts; torch enables peer access only inside its own copies
        import cupy
        with cupy.cuda.Device(d_dev):
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(p_dev)
            except cupy.cuda.runtime.CUDARuntimeError as exc:  # already enabled
                if "PeerAccessAlreadyEnabled" not in str(exc):
                    raise
        return True
    except ImportError:
        a = torch.ones(1, device=f"cuda:{p_dev}")
        a.to(f"cuda:{d_dev}")  # torch enables peer access for its device-to-device copy
        return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes-mib", default="94,1024")
    ap.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                    help="BLOCK/programs-per-SM/warps,... (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--idle-gap-s", type=float, default=0.0,
                    help="also time each remote unpack and local pack after the GPUs sat "
                         "idle this long (the servers' single requests come seconds apart)")
    args = ap.parse_args(argv)
    two = torch.cuda.device_count() >= 2
    p_dev, d_dev = (0, 1) if two else (0, 0)
    fmt = KVBIG.fmt
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    block_bytes = BS * fmt.bytes_per_token_all_layers
    max_blocks = max(1, math.ceil(max(sizes) * MiB / block_bytes))
    num_blocks = 2 * max_blocks + 1
    p_caches, p_views = layers_on(f"cuda:{p_dev}", num_blocks, 1)
    d_caches, d_views = layers_on(f"cuda:{d_dev}", num_blocks, 2)
    peer = enable_peer(d_dev, p_dev) if two else False
    result = {"devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
              "torch": torch.__version__, "peer_access": peer, "p_dev": p_dev, "d_dev": d_dev,
              "sms": torch.cuda.get_device_properties(d_dev).multi_processor_count,
              "rows": []}
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    for shape in args.shapes:
        with torch.cuda.device(p_dev):
            p_launch = launcher(p_views, shape, max_blocks)
        with torch.cuda.device(d_dev):
            d_launch = launcher(d_views, shape, max_blocks)
        for mib in sizes:
            nb = max(1, round(mib * MiB / block_bytes))
            n_tok = nb * BS
            src = array.array("q", order[:nb].tolist())
            dst = array.array("q", order[nb:2 * nb].tolist())
            nbytes = fmt.extent_bytes(n_tok)
            p_extent = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{p_dev}")
            d_extent = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d_dev}")
            row = {"block": shape[0], "programs_per_sm": shape[1], "warps": shape[2],
                   "mib": mib, "extent_bytes": nbytes}

            def run(launch, to_packed, extent, ids):
                if not launch.run(to_packed, extent.data_ptr(), ids, n_tok):
                    raise RuntimeError("the graph ring refused a call")
            row["local_pack_ms"] = timed(f"cuda:{p_dev}",
                                         lambda: run(p_launch, True, p_extent, src), args.iters)
            d_extent.copy_(p_extent)
            row["local_unpack_ms"] = timed(f"cuda:{d_dev}",
                                           lambda: run(d_launch, False, d_extent, dst), args.iters)
            if two and peer:
                for c in d_caches:
                    c.zero_()
                row["remote_unpack_ms"] = timed(
                    f"cuda:{d_dev}", lambda: run(d_launch, False, p_extent, dst), args.iters)
                if args.idle_gap_s:
                    iters = max(3, args.iters // 4)
                    row["remote_unpack_after_idle_ms"] = timed(
                        f"cuda:{d_dev}", lambda: run(d_launch, False, p_extent, dst), iters,
                        gap_s=args.idle_gap_s)
                    row["local_pack_after_idle_ms"] = timed(
                        f"cuda:{p_dev}", lambda: run(p_launch, True, p_extent, src), iters,
                        gap_s=args.idle_gap_s)
                torch.cuda.synchronize(d_dev)
                # D's blocks dst[i] now hold P's blocks src[i], every layer
                moved = torch.stack([c[order[nb:2 * nb].to(c.device)] for c in d_caches])
                want = torch.stack([c[order[:nb].to(c.device)] for c in p_caches])
                row["remote_equal"] = bool(torch.equal(moved.to(want.device), want))
                row["remote_gbps"] = round(nbytes / row["remote_unpack_ms"] / 1e6, 1)
                row["effective_ms"] = round(row["local_pack_ms"] + row["remote_unpack_ms"], 4)
                row["effective_gbps"] = round(nbytes / row["effective_ms"] / 1e6, 1)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        p_launch = d_launch = None  # their graphs go before the next shape captures
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(render(result))
    return 0 if all(r.get("remote_equal", True) for r in result["rows"]) else 1


def render(result: dict) -> str:
    lines = [f"{' / '.join(result['devices'])}; peer access {result['peer_access']}",
             f"{'BLOCK/prog/warps':>17} {'MiB':>6} {'pack ms':>8} {'unpack ms':>9} "
             f"{'remote ms':>9} {'GB/s':>6} {'effective':>9} {'GB/s':>6} equal"]
    for r in result["rows"]:
        shape = f"{r['block']}/{r['programs_per_sm']}/{r['warps']}"
        lines.append(f"{shape:>17} {r['mib']:>6g} {r['local_pack_ms']:>8.4f} "
                     f"{r['local_unpack_ms']:>9.4f} {r.get('remote_unpack_ms', float('nan')):>9.4f} "
                     f"{r.get('remote_gbps', float('nan')):>6} "
                     f"{r.get('effective_ms', float('nan')):>9} "
                     f"{r.get('effective_gbps', float('nan')):>6} {r.get('remote_equal', '-')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
