"""Where one request's pack and unpack time goes: the device's work, or the host's launch.

The servers' "effective handoff" (experiments/bench_transfer.py, trace ``pack_device`` /
``unpack``) is the time between two CUDA events around ONE ``pack_request`` (P) and ONE
``unpack_request`` (D), with the start event recorded right before their first device
operation. On an idle GPU that span also holds the host's time to launch what follows
the start event (the block ids' copy, the Triton launch, the tag's copy): the device
waits for it. On 2 x H200 (2026-11-26) the span was ~0.2 ms per call at 4 MiB and at
94 MiB alike (0.40 / 0.51 / 1.60 ms pack + unpack at 4 / 94 / 1024 MiB), far above what
the bytes need at ~3 TB/s: the fixed part is not the copy.

This measures, per size and per call, on kvcached's contiguous layout with the kvbig
test model's geometry (32 layers, 16 KV heads x 128, bf16: 256 KiB of KV per token):

* ``idle``: the servers' span, the GPU idle before the call (synchronized, 2 ms pause);
* ``busy``: the same span with the call queued behind a ~5 ms sleep kernel, so the host
  has launched everything before the device reaches the start event: the device's work
  alone;
* ``host``: the host's time for the call (return minus entry), and of it the Triton
  launch (``pack_triton.copy_blocks``) and the block ids' copy to the device;
* ``tag``: D's synchronous read of one extent's 32-byte tag (``tokens.read_tag``).

Each for the one-launch Triton kernel (what the servers select) and, where the layers
share one storage at a constant stride (kvcached's contiguous layout), the torch path's
single ``index_select`` / ``index_copy_`` over all layers (``single_view``).

usage (GPU host, from the checkout; needs torch with CUDA and Triton, not vLLM):
    python3 experiments/bench_pack_latency.py --out /tmp/pl.json
smoke test anywhere:
    python3 experiments/bench_pack_latency.py --device cpu --small --out /tmp/pl.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pack import ModelShape, kvcached_contiguous  # noqa: E402

from kvcached_pd.connector import tokens  # noqa: E402
from kvcached_pd.transport import pack as pack_mod  # noqa: E402
from kvcached_pd.transport import pack_triton  # noqa: E402
from kvcached_pd.transport.layout import AttnCacheSpec, KVCacheLayers, logical_kv_view  # noqa: E402

MiB = 1 << 20
KVBIG = ModelShape("kvbig-32L-16H-128D-bf16", 32, 16, 128, torch.bfloat16)
SMALL = ModelShape("2L-2H-64D-bf16", 2, 2, 64, torch.bfloat16)


class HostClock:
    """Accumulates the host time spent inside wrapped functions (per call of the op)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._restore: list[tuple[object, str, object]] = []

    def restore(self) -> None:
        for module, name, real in reversed(self._restore):
            setattr(module, name, real)
        self._restore = []

    def wrap(self, module, name: str):
        real = getattr(module, name)
        self._restore.append((module, name, real))

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0
        setattr(module, name, timed)
        return real


def one_call(fn, cuda: bool, busy: bool, clock: HostClock) -> dict[str, float]:
    if cuda:
        torch.cuda.synchronize()
        time.sleep(0.002)
        if busy:
            torch.cuda._sleep(5_000_000)  # ~2-5 ms of device time before the call
    clock.spent = {}
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    t0 = time.perf_counter()
    fn(start)
    if cuda:
        end.record()
    host = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    row = {"host_ms": 1e3 * host, "device_ms": start.elapsed_time(end) if cuda else float("nan")}
    for name, seconds in clock.spent.items():
        row[f"host_{name}_ms"] = 1e3 * seconds
    return row


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in rows), 4) for key in rows[0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--sizes-mib", default="4,94,1024")
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    model = SMALL if args.small else KVBIG
    sizes = [1 / 4] if args.small else [float(s) for s in args.sizes_mib.split(",")]
    fmt = model.fmt
    block_bytes = args.block_size * fmt.bytes_per_token_all_layers
    max_blocks = max(1, math.ceil(max(sizes) * MiB / block_bytes))
    num_blocks = 3 * max_blocks
    caches = kvcached_contiguous(model, num_blocks, args.block_size, args.device)
    for cache in caches:
        cache.normal_()
    spec = AttnCacheSpec(args.block_size, model.num_kv_heads, model.head_dim)
    views = [logical_kv_view(c, spec) for c in caches]
    layers = KVCacheLayers.from_views(views, stack=False)
    kernel = pack_mod.select_kernel(layers, fmt)
    paths = {"triton": layers}
    stacked = KVCacheLayers.from_views(views)
    if stacked.stacked is not None:
        paths["single_view"] = stacked
    clock = HostClock()
    clock.wrap(pack_triton, "copy_blocks")
    clock.wrap(pack_mod, "_on_device")
    try:
        result = run(args, cuda, model, sizes, fmt, block_bytes, num_blocks, paths, kernel,
                     clock)
    finally:
        clock.restore()
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


def run(args, cuda, model, sizes, fmt, block_bytes, num_blocks, paths, kernel,
        clock: HostClock) -> dict:
    tag_stream = torch.cuda.Stream() if cuda else None
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "model": model.name, "kernel": kernel,
              "triton": getattr(pack_mod.pack_triton.triton, "__version__", None),
              "sizes": {}}
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    for mib in sizes:
        nb = max(1, round(mib * MiB / block_bytes))
        src, dst = order[:nb].tolist(), order[nb:2 * nb].tolist()
        n_tok = nb * args.block_size
        extent = torch.empty(fmt.extent_bytes(n_tok), dtype=torch.uint8, device=args.device)
        tag = tokens.tag_bytes(tokens.new_token(), 0, extent.numel())

        def read_tag(started, extent=extent):
            if started is not None:
                started.record()
            tokens.read_tag(extent, tag_stream)

        pinned = torch.empty(tokens.TAG_BYTES if hasattr(tokens, "TAG_BYTES") else 32,
                             dtype=torch.uint8, pin_memory=cuda)

        def read_tag_pinned(started, extent=extent, pinned=pinned):
            # the candidate: a reused pinned buffer, an asynchronous copy, one stream sync
            if started is not None:
                started.record()
            src = tokens.tag_view(extent)
            if cuda:
                with torch.cuda.stream(tag_stream):
                    pinned.copy_(src, non_blocking=True)
                tag_stream.synchronize()
            else:
                pinned.copy_(src)
            bytes(pinned.numpy().tobytes())

        ops = [("tag", read_tag), ("tag_pinned", read_tag_pinned)]
        for path, lay in paths.items():
            def pack(started, src=src, extent=extent, tag=tag, lay=lay):
                pack_mod.pack_request(lay, src, extent, fmt, tag=tag, started=started)

            def unpack(started, dst=dst, extent=extent, n_tok=n_tok, lay=lay):
                pack_mod.unpack_request(lay, dst, extent, fmt, n_tok, n_tok, started=started)
            ops += [(f"pack[{path}]", pack), (f"unpack[{path}]", unpack)]
        entry = {"extent_bytes": extent.numel()}
        for name, fn in ops:
            for _ in range(3):  # warm-up: Triton compiles, pinned pools fill
                one_call(fn, cuda, False, clock)
            for mode in ("idle", "busy"):
                if name.startswith("tag") and mode == "busy":
                    continue
                rows = [one_call(fn, cuda, mode == "busy", clock) for _ in range(args.calls)]
                entry[f"{name}_{mode}"] = medians(rows)
        result["sizes"][f"{mib:g}"] = entry
        print(f"{mib:g} MiB: " + json.dumps(entry), flush=True)
    return result


if __name__ == "__main__":
    main()
