"""The CUDA-graph pack/unpack kernels themselves, run by Triton's interpreter on the CPU.

``tests/transport/test_pack_graph.py`` runs on CI, where there is no Triton (a 1 GB
package with CUDA's compilers, for a test environment of CPU torch), so there the
kernels of :mod:`kvcached_pd.transport.pack_graph` are emulated. This script runs the
REAL kernel source instead, under ``TRITON_INTERPRET=1`` on ordinary CPU memory with
real addresses, on every cache layout the tests know: the pack (with its tag), the
unpack on a decode side of larger blocks (its last block only partly covered, fewer
tokens than slots), and the record copy (header and ids only). Compared with the
token-by-token references of :mod:`kvcached_pd.transport.pack`. Exit status 1 on any
difference. On a GPU, ``select_kernel`` repeats a check of the compiled kernels at
startup, and ``experiments/bench_launch_paths.py`` compares them at full size.

usage (a venv with CPU torch and triton; no GPU, no vLLM):
    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.13.0 triton numpy
    /tmp/tv/bin/python experiments/pack_graph_interpreted.py
"""

import array
import math
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvcached_pd.transport import pack as pk  # noqa: E402
from kvcached_pd.transport import pack_graph as pg  # noqa: E402
from kvcached_pd.transport.format import TAG_BYTES, PackedFormat, packed_extent_view  # noqa: E402
from kvcached_pd.transport.layout import KVCacheLayers  # noqa: E402
from tests.transport.kv_cache_builders import LAYOUTS, decode_side, side  # noqa: E402


BLOCK_IDS_P = [7, 2, 5, 0, 8]
FMT = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)


def run_kernel(views, record: bytes, to_packed: bool) -> None:
    """One launch of the graph kernel as the captured graph runs it: the record in the
    (here CPU) params row, a grid-stride loop over 4 programs."""
    plan = pk._build_plan(KVCacheLayers.from_views(views, stack=False))
    first = plan.words[0]
    _, _, bs, heads, dw = first.shape
    params = torch.zeros(pg.HEADER_WORDS + 16, dtype=torch.int64)
    params.view(torch.uint8)[:len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
    addrs = torch.tensor([w.data_ptr() for w in plan.words], dtype=torch.int64)
    pg._graph_copy_kernel[(4,)](
        addrs, params, params.view(torch.uint8), *first.stride()[:4],
        FMT.bytes_per_token_all_layers // plan.word.itemsize, NUM_LAYERS=len(views), H=heads,
        DW=dw, BS=bs, WORD_BYTES=plan.word.itemsize, TO_PACKED=to_packed, BLOCK=pg.BLOCK,
        CHUNKS=math.ceil(bs * heads * dw / pg.BLOCK), NPROG=4, HEADER=pg.HEADER_WORDS,
        TAG=TAG_BYTES)


def check(layout, p_bs: int, num_p_blocks: int, short: int) -> dict:
    """Pack ``num_p_blocks`` blocks of ``p_bs`` tokens; unpack ``short`` fewer tokens than
    slots on a side of 16-token blocks."""
    _, p_views = side(layout, p_bs, seed=1)
    ids = BLOCK_IDS_P[:num_p_blocks]
    slots = len(ids) * p_bs
    extent = torch.full((FMT.extent_bytes(slots),), 0xA5, dtype=torch.uint8)
    packed = packed_extent_view(extent, FMT, slots)
    tag = bytes(range(1, 1 + TAG_BYTES))
    tag_addr = extent.data_ptr() + extent.numel() - TAG_BYTES
    run_kernel(p_views, pg.encode(packed.data_ptr(), array.array("q", ids), slots, tag_addr,
                                  tag), True)
    reference = pk.pack_request_reference(p_views, ids, FMT)
    pack_ok = (torch.equal(extent[:-TAG_BYTES], reference[:-TAG_BYTES])
               and bytes(extent[-TAG_BYTES:].tolist()) == tag)

    d_buffers, d_views, expected, d_ids, _ = decode_side(layout, 16, slots - short, 0, extent,
                                                         FMT, slots)
    run_kernel(d_views, pg.encode(packed.data_ptr(), array.array("q", d_ids), slots, 0, None),
               False)
    unpack_ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(d_buffers, expected))
    return {"pack": pack_ok, "unpack": unpack_ok}


def check_record_kernel() -> bool:
    host = torch.full((pg.HEADER_WORDS + 16,), 7, dtype=torch.int64)
    host[1] = 3  # three block ids: the header and those, nothing after
    dev = torch.zeros_like(host)
    pg._record_kernel[(1,)](host, dev, WIDTH=host.numel(), HEADER=pg.HEADER_WORDS,
                            BLOCK=pg.BLOCK)
    moved = pg.HEADER_WORDS + 3
    return bool(torch.equal(dev[:moved], host[:moved]) and dev[moved:].eq(0).all())


def main() -> int:
    differing = 0
    for layout in LAYOUTS:
        for p_bs, num_p_blocks, short in ((16, 3, 0), (8, 5, 3)):
            result = check(layout, p_bs, num_p_blocks, short)
            differing += not all(result.values())
            print(f"{layout} P blocks of {p_bs} x {num_p_blocks}, {short} short: {result}")
    record_ok = check_record_kernel()
    print(f"record kernel: {record_ok}")
    print(f"layouts x cases differing: {differing}")
    return 1 if differing or not record_ok else 0


if __name__ == "__main__":
    sys.exit(main())
