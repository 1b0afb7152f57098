"""Choosing the pack/unpack kernels: the one-launch Triton path and its safety net.

Triton needs a CUDA device, so on the CPU its kernel is replaced by an emulation with
the kernel's contract (copy block ``index[b]`` of every (layer, K|V), located through
the address table, to/from token slots ``b * bs ...`` of the flat token-major extent, at
the kernel's own address formula). What is tested for real is
everything around it: the plan (word views, address table), the self-check on small
layers of the same stride pattern, the extent arithmetic of pack/unpack, the partial
last block, and that a kernel that gets it wrong is never used.
"""

from __future__ import annotations

import pytest
import torch

from kvcached_pd import config
from kvcached_pd.transport import pack_triton
from kvcached_pd.transport.format import PackedFormat
from kvcached_pd.transport.layout import KVCacheLayers
from kvcached_pd.transport.pack import (
    PLAN_ATTR,
    pack_request,
    pack_request_reference,
    select_kernel,
    unpack_request,
)
from tests.transport.kv_cache_builders import LAYOUTS, decode_side, side


def emulated_copy_blocks(words, addrs, index, packed_words, packed_tok_stride, to_packed,
                         misplace=False):
    by_addr = {w.data_ptr(): w for w in words}
    assert addrs.dtype == torch.int64 and addrs.numel() == len(words)
    _, _, bs, heads, dw = words[0].shape
    ids = index.tolist()
    if misplace:  # a kernel bug: blocks land one slot off
        ids = ids[1:] + ids[:1]
    for layer, addr in enumerate(addrs.tolist()):
        view = by_addr[addr]  # the table must point at each layer's own view
        for kv in range(2):
            for b, block in enumerate(ids):
                for tok in range(bs):  # pack_triton's formula for element (tok, 0, 0)
                    start = (b * bs + tok) * packed_tok_stride + (layer * 2 + kv) * heads * dw
                    flat = packed_words[start: start + heads * dw]
                    if to_packed:
                        flat.copy_(view[kv, block, tok].reshape(-1))
                    else:
                        view[kv, block, tok].copy_(flat.view(heads, dw))


@pytest.fixture
def emulated_triton(monkeypatch):
    monkeypatch.setattr(pack_triton, "available", lambda device: True)
    monkeypatch.setattr(pack_triton, "copy_blocks", emulated_copy_blocks)
    return monkeypatch


def test_the_self_check_runs_the_kernel_both_ways(emulated_triton):
    calls = []

    def counting(*args, to_packed, **kwargs):
        calls.append(to_packed)
        emulated_copy_blocks(*args, to_packed=to_packed, **kwargs)

    emulated_triton.setattr(pack_triton, "copy_blocks", counting)
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    layers = KVCacheLayers.from_views(side(LAYOUTS[0], 16)[1], stack=False)
    assert select_kernel(layers, fmt).startswith("Triton")
    # one pack and three unpacks (the whole extent, a window from block 1, an extent
    # ending inside the last block) through the kernel
    assert calls == [True, False, False, False]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("p_bs,d_bs,num_tokens,cached", [
    (16, 16, 40, 0), (16, 32, 40, 0), (8, 32, 35, 0),
    (16, 16, 40, 1), (8, 16, 35, 2),  # D holds its first blocks from its prefix cache
])
def test_one_launch_path_moves_the_same_bytes(emulated_triton, layout, p_bs, d_bs, num_tokens,
                                               cached):
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    _, p_views = side(layout, p_bs, seed=1)
    p_layers = KVCacheLayers.from_views(p_views, stack=False)
    assert select_kernel(p_layers, fmt).startswith("Triton, one launch for all 3 layers")
    p_ids = [7, 2, 5, 0, 8][: -(-num_tokens // p_bs)]
    slots = len(p_ids) * p_bs
    extent = torch.full((fmt.extent_bytes(slots),), 0xA5, dtype=torch.uint8)
    pack_request(p_layers, p_ids, extent, fmt)
    assert torch.equal(extent, pack_request_reference(p_views, p_ids, fmt))

    d_buffers, d_views, expected, d_ids, first = decode_side(layout, d_bs, num_tokens, cached,
                                                             extent, fmt, slots)
    d_layers = KVCacheLayers.from_views(d_views, stack=False)
    select_kernel(d_layers, fmt)
    assert getattr(d_layers, PLAN_ATTR) is not None
    unpack_request(d_layers, d_ids, extent, fmt, num_tokens, slots, first)
    for got, want in zip(d_buffers, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_a_wrong_kernel_is_caught_by_the_self_check(emulated_triton):
    def broken(*args, **kwargs):
        emulated_copy_blocks(*args, **kwargs, misplace=True)

    emulated_triton.setattr(pack_triton, "copy_blocks", broken)
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    layers = KVCacheLayers.from_views(side(LAYOUTS[0], 16)[1], stack=False)
    described = select_kernel(layers, fmt)
    assert described.startswith("torch") and "packed extents differ" in described
    assert getattr(layers, PLAN_ATTR, None) is None  # pack/unpack keep the torch path
    with pytest.raises(RuntimeError, match="KVCACHED_PD_PACK_KERNEL=triton but packed"):
        select_kernel(layers, fmt, "triton")


def test_without_triton_or_cuda_torch_serves_and_triton_cannot_be_forced():
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    layers = KVCacheLayers.from_views(side(LAYOUTS[0], 16)[1], stack=False)
    assert "Triton or a CUDA device is not available" in select_kernel(layers, fmt)
    assert select_kernel(layers, fmt, "torch") == "torch index ops (KVCACHED_PD_PACK_KERNEL=torch)"
    with pytest.raises(RuntimeError, match="KVCACHED_PD_PACK_KERNEL=triton"):
        select_kernel(layers, fmt, "triton")


def test_layers_with_different_strides_stay_on_torch(emulated_triton):
    fmt = PackedFormat.for_cache(2, 2, 4, torch.bfloat16)
    a = torch.zeros(2, 9, 16, 2, 4, dtype=torch.bfloat16)
    b = torch.zeros(9, 2, 16, 2, 4, dtype=torch.bfloat16).transpose(0, 1)
    described = select_kernel(KVCacheLayers.from_views([a, b], stack=False), fmt)
    assert "do not share strides" in described


def test_pack_kernel_setting():
    assert config.read_settings({}).pack_kernel == "auto"
    assert config.read_settings({"KVCACHED_PD_PACK_KERNEL": " Torch "}).pack_kernel == "torch"
    bad = config.read_settings({"KVCACHED_PD_PACK_KERNEL": "cuda"})
    assert bad.pack_kernel == "auto" and "KVCACHED_PD_PACK_KERNEL='cuda'" in bad.problems[0]
