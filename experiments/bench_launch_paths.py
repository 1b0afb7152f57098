"""Which launch path gets one request's pack and unpack span down to the device's work?

experiments/bench_pack_latency.py (2026-11-26, one H200) found the servers' span of one
``pack_request`` / ``unpack_request`` at 94 MiB to be ~0.22-0.33 ms on an idle GPU
against ~0.06 ms of device work: the rest is the host launching what follows the start
event (the block ids' copy, the gather/scatter, the tag's copy), during which the idle
device waits. Issue 19 asks for pack + unpack <= 0.3 ms at 94 MiB.

This times, on kvcached's contiguous layout with the kvbig geometry (32 layers, 16 KV
heads x 128, bf16), each candidate as one span (idle GPU, and queued behind a sleep
kernel = the device's work alone), with the host's time per call and per operation:

* ``torch``: the product's ``pack_request`` / ``unpack_request`` on the stacked view (what
  the servers select on this layout; since 2026-11-27 they build every view before the
  start event, the lesson of this script's first run);
* ``triton``: the same on the one-launch Triton plan;
* ``torch_pre``: the torch path's three device operations alone (ids' copy, the
  ``index_select`` / ``index_copy_``, the tag's copy), every view built before the start;
* ``graph``: the product's ``pack_request`` / ``unpack_request`` with the CUDA graphs of
  :mod:`kvcached_pd.transport.pack_graph` installed (``KVCACHED_PD_PACK_KERNEL=graph``;
  what ``auto`` selects since 2026-11-27), built on the candidates below: one replay
  of a record copy and one Triton kernel per call;
* ``uva``: ONE Triton launch that reads the block ids (and writes the tag from) pinned
  host memory directly (unified addressing: a pinned buffer's address is valid on the
  device), so no copy precedes or follows the gather/scatter.

usage (GPU host, from the checkout; torch with CUDA and Triton, no vLLM):
    python3 experiments/bench_launch_paths.py --out /tmp/lp.json
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

from kvcached_pd.transport import pack as pack_mod  # noqa: E402
from kvcached_pd.transport.format import TAG_BYTES, packed_extent_view  # noqa: E402
from kvcached_pd.transport.layout import AttnCacheSpec, KVCacheLayers, logical_kv_view  # noqa: E402

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    triton = tl = None

MiB = 1 << 20
KVBIG = ModelShape("kvbig-32L-16H-128D-bf16", 32, 16, 128, torch.bfloat16)
SMALL = ModelShape("2L-2H-64D-bf16", 2, 2, 64, torch.bfloat16)
BLOCK = 1024

if triton is not None:
    # A candidate, not the product: pack_triton._copy_blocks_kernel's addressing (8-byte
    # words only), plus the tag written in-kernel and the block ids read from pinned host
    # memory. Its lines restate the product kernel's on purpose, so that the product's
    # kernel stays untouched by an experiment; main() checks that its pack gives the
    # product's bytes (``pack[uva]_equal``), which catches the two drifting apart.
    @triton.jit
    def _uva_kernel(layer_addrs, block_ids, packed, tag_src, tag_dst, nb, packed_tok_stride,
                    s_kv, s_blk, s_tok, s_head, H: tl.constexpr, DW: tl.constexpr,
                    BS: tl.constexpr, TO_PACKED: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        b = pid % nb
        kv = (pid // nb) % 2
        layer = pid // (2 * nb)
        blk = tl.load(block_ids + b).to(tl.int64)  # pinned host memory, read over the bus
        base = tl.load(layer_addrs + layer)
        e = chunk * BLOCK + tl.arange(0, BLOCK)
        per_block: tl.constexpr = BS * H * DW
        mask = e < per_block
        tok = e // (H * DW)
        rem = e % (H * DW)
        cache_off = kv * s_kv + blk * s_blk + tok * s_tok + (rem // DW) * s_head + rem % DW
        cache = (base + cache_off * 8).to(tl.pointer_type(tl.int64))
        extent = packed + (b * BS + tok) * packed_tok_stride + (layer * 2 + kv) * (H * DW) + rem
        if TO_PACKED:
            tl.store(extent, tl.load(cache, mask=mask), mask=mask)
            if (pid == 0) & (chunk == 0):
                t = tl.arange(0, 32)
                tl.store(tag_dst + t, tl.load(tag_src + t))
        else:
            tl.store(cache, tl.load(extent, mask=mask), mask=mask)


def one_call(fn, busy: bool, host_ops: dict) -> dict:
    torch.cuda.synchronize()
    time.sleep(0.002)
    if busy:
        torch.cuda._sleep(5_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host_ops.clear()
    t0 = time.perf_counter()
    fn(start)
    end.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    row = {"host_ms": 1e3 * host, "span_ms": start.elapsed_time(end)}
    row.update({f"host_{k}_ms": 1e3 * v for k, v in host_ops.items()})
    return row


def medians(rows):
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="4,94,1024")
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    model = SMALL if args.small else KVBIG
    fmt = model.fmt
    bs = 16
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    block_bytes = bs * fmt.bytes_per_token_all_layers
    max_blocks = max(1, math.ceil(max(sizes) * MiB / block_bytes))
    num_blocks = 3 * max_blocks
    caches = kvcached_contiguous(model, num_blocks, bs, "cuda")
    for c in caches:
        c.normal_()
    views = [logical_kv_view(c, AttnCacheSpec(bs, model.num_kv_heads, model.head_dim))
             for c in caches]
    stacked = KVCacheLayers.from_views(views)
    plain = KVCacheLayers.from_views(views, stack=False)
    pack_mod.select_kernel(stacked, fmt, "torch")  # no graphs: the torch baseline
    kernel = pack_mod.select_kernel(plain, fmt, "triton")
    plan = getattr(plain, pack_mod.PLAN_ATTR, None)
    graphed = KVCacheLayers.from_views(views)  # what the servers select since 2026-11-27
    t0 = time.perf_counter()
    try:
        graph_kernel = pack_mod.select_kernel(graphed, fmt, "graph")
    except RuntimeError as exc:  # the other paths still report
        graph_kernel, graphed = f"not installed: {exc}", None
    graph_setup_s = time.perf_counter() - t0
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": getattr(triton, "__version__", None), "kernel": kernel,
              "graph_kernel": graph_kernel, "graph_setup_s": round(graph_setup_s, 3),
              "sizes": {}}
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    ops: dict[str, float] = {}

    def timed(name, f):
        t0 = time.perf_counter()
        out = f()
        ops[name] = ops.get(name, 0.0) + time.perf_counter() - t0
        return out

    for mib in sizes:
        nb = max(1, round(mib * MiB / block_bytes))
        src, dst = order[:nb].tolist(), order[nb:2 * nb].tolist()
        n_tok = nb * bs
        extent = torch.empty(fmt.extent_bytes(n_tok), dtype=torch.uint8, device="cuda")
        ref = torch.empty_like(extent)
        tag = bytes(range(TAG_BYTES))
        pack_mod.pack_request(stacked, src, ref, fmt, tag=tag)
        entry = {"extent_bytes": extent.numel()}

        def cur(lay):
            def pack(start):
                pack_mod.pack_request(lay, src, extent, fmt, tag=tag, started=start)

            def unpack(start):
                pack_mod.unpack_request(lay, dst, extent, fmt, n_tok, n_tok, started=start)
            return pack, unpack

        # torch_pre: every view and the pinned buffer before the start event
        word = torch.int64
        packed = packed_extent_view(extent, fmt, n_tok)
        by_block = pack_mod._layer_major(packed.view(word)).unflatten(2, (nb, bs))
        st = stacked.stacked.view(word)
        flat = extent.reshape(-1)
        tag_dst = flat[flat.numel() - TAG_BYTES:]

        def pre_pack(start):
            host = torch.frombuffer(bytearray(tag + torch.tensor(src).numpy().tobytes()),
                                    dtype=torch.uint8).pin_memory()
            start.record()
            dev = timed("h2d", lambda: host.to("cuda", non_blocking=True))
            idx = dev[TAG_BYTES:].view(torch.int64)
            timed("index", lambda: torch.index_select(st, 2, idx, out=by_block))
            timed("tag", lambda: tag_dst.copy_(dev[:TAG_BYTES]))

        def pre_unpack(start):
            host = torch.tensor(dst, dtype=torch.int64).pin_memory()
            start.record()
            idx = timed("h2d", lambda: host.to("cuda", non_blocking=True))
            timed("index", lambda: st.index_copy_(2, idx, by_block))

        paths = {"torch": cur(stacked), "torch_pre": (pre_pack, pre_unpack)}
        if graphed is not None:
            paths["graph"] = cur(graphed)
        if plan is not None:
            paths["triton"] = cur(plain)
            words = packed.view(plan.word).reshape(-1)
            tok_stride = packed.view(plan.word)[0].numel()
            first = plan.words[0]
            _, _, bsz, heads, dw = first.shape
            s_kv, s_blk, s_tok, s_head = first.stride()[:4]
            grid = (len(plan.words) * 2 * nb, triton.cdiv(bsz * heads * dw, BLOCK))

            def uva(to_packed, ids):
                def go(start):
                    host = torch.frombuffer(
                        bytearray(tag + torch.tensor(ids).numpy().tobytes()),
                        dtype=torch.uint8).pin_memory()
                    start.record()
                    timed("launch", lambda: _uva_kernel[grid](
                        plan.addrs, host[TAG_BYTES:].view(torch.int64), words,
                        host[:TAG_BYTES], tag_dst, nb, tok_stride, s_kv, s_blk, s_tok, s_head,
                        H=heads, DW=dw, BS=bsz, TO_PACKED=to_packed, BLOCK=BLOCK))
                    entry.setdefault("_keep", []).append(host)  # alive until synchronized
                return go
            paths["uva"] = (uva(True, src), uva(False, dst))
        for name, (pack, unpack) in paths.items():
            for op, fn in (("pack", pack), ("unpack", unpack)):
                for _ in range(3):
                    one_call(fn, False, ops)
                for mode in ("idle", "busy"):
                    rows = [one_call(fn, mode == "busy", ops) for _ in range(args.calls)]
                    entry[f"{op}[{name}]_{mode}"] = medians(rows)
                entry.pop("_keep", None)
            # the bytes: the pack equals the product's torch pack; the unpack of it puts
            # the source blocks' bytes into the (scrambled) destination blocks
            extent.fill_(0x5A)
            pack(torch.cuda.Event())
            torch.cuda.synchronize()
            entry[f"pack[{name}]_equal"] = bool(torch.equal(extent, ref))
            extent.copy_(ref)
            bits = st.view(torch.int16)
            bits[:, :, dst] = torch.randint_like(bits[:, :, dst], -(2 ** 15), 2 ** 15)
            unpack(torch.cuda.Event())
            torch.cuda.synchronize()
            entry[f"unpack[{name}]_equal"] = bool(torch.equal(bits[:, :, dst], bits[:, :, src]))
            entry.pop("_keep", None)
        if graphed is not None:
            entry["graph_replays"] = getattr(graphed, pack_mod.GRAPHS_ATTR).replays
        result["sizes"][f"{mib:g}"] = entry
        print(f"{mib:g} MiB: " + json.dumps(entry), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
