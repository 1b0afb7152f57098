"""Time pack (gather into a staging extent) and unpack (scatter back) on kvcached-like caches.

The design budgets the gather/scatter at about 2 x bytes / device bandwidth; this
measures it. For each model shape, cache layout and request size it times
``pack_request`` and ``unpack_request`` through the per-layer loop, where the layers
share one storage the single-view path, and the one-launch Triton kernels (when
:func:`~kvcached_pd.transport.pack.select_kernel` enables them on the device), next to a plain device-to-device copy of the
same bytes (the ceiling). Bytes moved = bytes read + bytes written = 2 x extent size.
Before timing, each configuration is checked on the device: all paths produce the
same extent, and unpacking it into other blocks reproduces the packed tokens.

Caches are built as kvcached builds them: a block dimension sized for the whole virtual
reservation (far more blocks than any request uses), split-half per-layer tensors
(``KVCACHED_CONTIGUOUS_LAYOUT=false``, V region at a 2 MiB-aligned offset) or one
cross-layer tensor (``KVCACHED_CONTIGUOUS_LAYOUT=true``); and, for comparison, vLLM
0.26's own per-layer FlashAttention layout (K/V packed in the last dim, NHD).

On the GPU host::

    python experiments/bench_pack.py --out experiments/results/bench_pack.csv

Smoke test anywhere::

    python experiments/bench_pack.py --device cpu --small --out /tmp/bench_pack.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcached_pd.transport.format import PackedFormat
from kvcached_pd.transport.layout import AttnCacheSpec, KVCacheLayers, logical_kv_view
from kvcached_pd.transport.pack import (
    PLAN_ATTR,
    pack_request,
    select_kernel,
    unpack_request,
)

MiB = 1 << 20
KVCACHED_PAGE = 2 * MiB


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def fmt(self) -> PackedFormat:
        return PackedFormat.for_cache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


FULL_MODELS = (
    ModelShape("8L-8H-128D-bf16", 8, 8, 128, torch.bfloat16),
    ModelShape("32L-16H-128D-bf16", 32, 16, 128, torch.bfloat16),
)
SMALL_MODELS = (ModelShape("2L-2H-64D-bf16", 2, 2, 64, torch.bfloat16),)
FULL_REQUEST_MIB = (1, 4, 16, 64, 256, 1024)
SMALL_REQUEST_MIB = (1 / 16, 1 / 4, 1)


def kvcached_split_half(
    model: ModelShape, num_blocks: int, block_size: int, device: str
) -> list[torch.Tensor]:
    """Per-layer tensors, blocks-first (FlashInfer shape), K region then V region."""
    h, d = model.num_kv_heads, model.head_dim
    block_elems = block_size * h * d
    itemsize = model.dtype.itemsize
    v_offset = math.ceil(num_blocks * block_elems * itemsize / KVCACHED_PAGE) * KVCACHED_PAGE
    v_offset //= itemsize
    caches = []
    for _ in range(model.num_layers):
        raw = torch.empty(2 * v_offset, dtype=model.dtype, device=device)
        caches.append(
            torch.as_strided(
                raw, (num_blocks, 2, block_size, h, d), (block_elems, v_offset, h * d, d, 1)
            )
        )
    return caches


def kvcached_contiguous(
    model: ModelShape, num_blocks: int, block_size: int, device: str
) -> list[torch.Tensor]:
    """One (N, L, 2, bs, H, D) tensor over all layers; layer i is [:, i]."""
    whole = torch.empty(
        (num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim),
        dtype=model.dtype,
        device=device,
    )
    return [whole[:, layer] for layer in range(model.num_layers)]


def vllm_packed_nhd(
    model: ModelShape, num_blocks: int, block_size: int, device: str
) -> list[torch.Tensor]:
    """vLLM 0.26 FlashAttention: memory (N, bs, H, 2D) per layer, logical (N, H, bs, 2D)."""
    shape = (num_blocks, block_size, model.num_kv_heads, 2 * model.head_dim)
    return [
        torch.empty(shape, dtype=model.dtype, device=device).permute(0, 2, 1, 3)
        for _ in range(model.num_layers)
    ]


LAYOUTS: dict[str, Callable[[ModelShape, int, int, str], list[torch.Tensor]]] = {
    "kvcached_split_half": kvcached_split_half,
    "kvcached_contiguous": kvcached_contiguous,
    "vllm026_packed_nhd": vllm_packed_nhd,
}


def fill_random(caches: list[torch.Tensor]) -> None:
    for cache in caches:
        cache.normal_()


def median_ms(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        pairs = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in pairs]
    else:
        for _ in range(iters):
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def host_ms_per_call(fn: Callable[[], object], device: str, calls: int) -> float:
    """Host time per call when calls are issued back to back (the worker thread's cost;
    on a GPU it overlaps device work unless the device is idle waiting for it)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return elapsed / calls * 1e3


def peak_extra_bytes(fn: Callable[[], object], device: str) -> int | None:
    """Device memory allocated beyond what was live before ``fn``: temporaries."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def check_on_device(
    paths: dict[str, KVCacheLayers],
    model: ModelShape,
    src_ids: list[int],
    dst_ids: list[int],
    n_tok_slots: int,
    device: str,
) -> None:
    """Both paths pack the same bytes; unpacking into other blocks reproduces them."""
    fmt = model.fmt
    extents = {}
    for name, layers in paths.items():
        extents[name] = torch.empty(fmt.extent_bytes(n_tok_slots), dtype=torch.uint8, device=device)
        pack_request(layers, src_ids, extents[name], fmt)
    reference = next(iter(extents.values()))
    for name, extent in extents.items():
        if not torch.equal(extent, reference):
            raise AssertionError(f"{name} packed different bytes")
    for name, layers in paths.items():
        unpack_request(layers, dst_ids, reference, fmt, n_tok_slots, n_tok_slots)
        src, dst = torch.tensor(src_ids, device=device), torch.tensor(dst_ids, device=device)
        for view in layers.layers:
            if not torch.equal(view[:, dst], view[:, src]):
                raise AssertionError(f"{name}: unpacked blocks differ from packed blocks")


def bench(args: argparse.Namespace) -> list[dict[str, object]]:
    device = args.device
    models = SMALL_MODELS if args.small else FULL_MODELS
    sizes_mib = SMALL_REQUEST_MIB if args.small else FULL_REQUEST_MIB
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    generator = torch.Generator().manual_seed(args.seed)
    rows: list[dict[str, object]] = []
    for model in models:
        fmt = model.fmt
        tokens_per_block_bytes = args.block_size * fmt.bytes_per_token_all_layers
        max_blocks = math.ceil(max(sizes_mib) * MiB / tokens_per_block_bytes)
        num_blocks = args.oversize * max_blocks  # the virtual block dim, as kvcached sizes it
        spec = AttnCacheSpec(args.block_size, model.num_kv_heads, model.head_dim)
        for layout_name, build in LAYOUTS.items():
            caches = build(model, num_blocks, args.block_size, device)
            fill_random(caches)
            views = [logical_kv_view(cache, spec) for cache in caches]
            paths = {"per_layer": KVCacheLayers.from_views(views, stack=False)}
            stacked = KVCacheLayers.from_views(views)
            if stacked.stacked is not None:
                paths["single_view"] = stacked
            one_launch = KVCacheLayers.from_views(views, stack=False)
            chosen = select_kernel(one_launch, fmt)
            print(f"{model.name} {layout_name}: {chosen}", flush=True)
            if getattr(one_launch, PLAN_ATTR, None) is not None:
                paths["triton"] = one_launch
            block_counts = sorted(
                {max(1, round(mib * MiB / tokens_per_block_bytes)) for mib in sizes_mib}
            )
            for nb in block_counts:
                n_tok_slots = nb * args.block_size
                extent_bytes = fmt.extent_bytes(n_tok_slots)
                order = torch.randperm(num_blocks, generator=generator)
                src_ids, dst_ids = order[:nb].tolist(), order[nb : 2 * nb].tolist()
                extent = torch.empty(extent_bytes, dtype=torch.uint8, device=device)
                if nb in (block_counts[0], block_counts[-1]):
                    check_on_device(paths, model, src_ids, dst_ids, n_tok_slots, device)
                ops: dict[str, Callable[[], object]] = {}
                for path, layers in paths.items():
                    ops[f"pack/{path}"] = lambda layers=layers: pack_request(
                        layers, src_ids, extent, fmt
                    )
                    ops[f"unpack/{path}"] = lambda layers=layers: unpack_request(
                        layers, dst_ids, extent, fmt, n_tok_slots, n_tok_slots
                    )
                copy_target = torch.empty_like(extent)
                ops["d2d_copy/ceiling"] = lambda: copy_target.copy_(extent)
                for key, fn in ops.items():
                    op, path = key.split("/")
                    ms = median_ms(fn, device, args.warmup, args.iters)
                    rows.append(
                        {
                            "device": device_name,
                            "torch": torch.__version__,
                            "model": model.name,
                            "layout": layout_name,
                            "op": op,
                            "path": path,
                            "block_size": args.block_size,
                            "num_blocks_virtual": num_blocks,
                            "num_tokens": n_tok_slots,
                            "request_bytes": extent_bytes,
                            "bytes_moved": 2 * extent_bytes,
                            "median_ms": round(ms, 4),
                            "gb_per_s": round(2 * extent_bytes / ms / 1e6, 1),
                            "host_ms": round(host_ms_per_call(fn, device, args.iters), 4),
                            "peak_extra_bytes": peak_extra_bytes(fn, device),
                        }
                    )
            del caches, views, paths, stacked, one_launch
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes and sizes (smoke test)")
    parser.add_argument("--out", type=Path, required=True, help="CSV to write")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--oversize", type=int, default=3, help="virtual blocks / blocks used")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rows = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{rows[0]['device']}, torch {torch.__version__}; CSV: {args.out}")
    print(
        f"{'model':18} {'layout':20} {'op':8} {'path':11} {'MiB':>8} {'ms':>9} {'GB/s':>8}"
        f" {'host ms':>8}"
    )
    for row in rows:
        print(
            f"{row['model']:18} {row['layout']:20} {row['op']:8} {row['path']:11} "
            f"{row['request_bytes'] / MiB:8.2f} {row['median_ms']:9.4f} {row['gb_per_s']:8.1f}"
            f" {row['host_ms']:8.4f}"
        )


if __name__ == "__main__":
    main()
