"""The staged transport on kvcached's contiguous layout, built by kvcached's own code.

kvcached's default on CUDA (``KVCACHED_CONTIGUOUS_LAYOUT`` unset or true) backs all
layers with one reservation: compound block ``b`` holds every layer's block ``b``, so
layer ``l``'s block ``b`` starts at ``(b * L + l) * P`` (``P`` = one layer's K and V of
one block) and each layer's view has a block stride of ``L * P``. Here the tensors come
from kvcached's real ``alloc_kv_cache`` in that mode (only its CUDA module is replaced,
tests/support/kvcached_cpu.py) for the three shapes vLLM asks for: K/V-first
``(2, N, bs, H, D)`` (FlashAttention up to vLLM 0.22, e.g. 0.20), blocks-first
``(N, 2, bs, H, D)`` (FlashInfer/Triton) and K|V packed in the last dim
``(N, H, bs, 2D)`` (vLLM 0.26+).

The address oracle is written from that description, not from the tensors' strides;
the round trips check bytes against a token-by-token reference, across the torch
single-launch path (all layers stacked), the per-layer path, and the pointer arithmetic
of the one-launch Triton kernel (a table of layer base addresses and shared strides),
emulated on the CPU word for word.
"""

from __future__ import annotations

import pytest
import torch

from kvcached_pd.registry import KVCacheGeometry
from kvcached_pd.transport import pack_triton
from kvcached_pd.transport.format import PackedFormat
from kvcached_pd.transport.layout import AttnCacheSpec, KVCacheLayers, logical_kv_view
from kvcached_pd.transport.pack import (
    PLAN_ATTR,
    _build_plan,
    select_kernel,
    pack_request,
    pack_request_reference,
    unpack_reference,
    unpack_request,
)
from tests.support import kvcached_cpu
from tests.transport.kv_cache_builders import bits, fill_random_bits

pytestmark = pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched")

LAYERS, BS, HEADS, HEAD_DIM = 3, 4, 2, 8
BUDGET = 6  # what vLLM asks for; kvcached reserves far more (the virtual block count)
SHAPES = {
    "kv_first": lambda n: (2, n, BS, HEADS, HEAD_DIM),
    "blocks_first": lambda n: (n, 2, BS, HEADS, HEAD_DIM),
    "packed": lambda n: (n, HEADS, BS, 2 * HEAD_DIM),
}
SPEC = AttnCacheSpec(BS, HEADS, HEAD_DIM)
FMT = PackedFormat.for_cache(LAYERS, HEADS, HEAD_DIM, torch.float16)
P = 2 * BS * HEADS * HEAD_DIM  # elements of one layer's K and V of one block


def kvcached_caches(shape_name: str, contiguous: bool = True, seed: int = 0):
    kvcached_cpu.install_stand_ins()
    with kvcached_cpu.fake_device(total_memory=16 << 20, contiguous=contiguous) as kvi:
        caches = kvi.alloc_kv_cache(SHAPES[shape_name](BUDGET), BS, torch.float16, "cpu", LAYERS)
    raws = list({c.untyped_storage().data_ptr(): torch.empty(0, dtype=torch.float16)
                 .set_(c.untyped_storage()) for c in caches}.values())
    fill_random_bits(raws, torch.Generator().manual_seed(seed))
    return caches, raws


def oracle(shape_name: str, num_blocks: int, layer, kv, block, token, head, dim):
    """Element offset in the one reservation, from kvcached's compound-page layout."""
    start = (block * LAYERS + layer) * P
    if shape_name == "packed":  # NHD memory: [token][head][K|V x dim]
        return start + (token * HEADS + head) * 2 * HEAD_DIM + kv * HEAD_DIM + dim
    return start + kv * (P // 2) + (token * HEADS + head) * HEAD_DIM + dim  # [K|V][t][h][d]


@pytest.mark.parametrize("shape_name", SHAPES)
def test_views_address_kvcached_compound_pages(shape_name):
    caches, raws = kvcached_caches(shape_name)
    assert len(raws) == 1  # the stand-in built kvcached's single contiguous reservation
    raw = raws[0]
    views = [logical_kv_view(c, SPEC) for c in caches]
    num_blocks = views[0].shape[1]
    assert num_blocks > 10 * BUDGET  # the virtual block count
    some_blocks = torch.tensor([0, 1, 2, 3, BUDGET, num_blocks // 2, num_blocks - 1])
    kv, block, token, head, dim = torch.meshgrid(
        torch.arange(2), some_blocks, torch.arange(BS), torch.arange(HEADS),
        torch.arange(HEAD_DIM), indexing="ij")
    for layer, view in enumerate(views):
        offsets = oracle(shape_name, num_blocks, layer, kv, block, token, head, dim)
        assert torch.equal(bits(view[:, some_blocks]), bits(raw)[offsets])
    # the reservation holds exactly the compound blocks (nothing past the last one)
    assert raw.numel() >= num_blocks * LAYERS * P
    layers = KVCacheLayers.from_views(views)
    assert layers.stacked is not None  # every layer at a constant offset: one launch
    assert layers.stacked.stride(0) == P and views[0].stride(1) == LAYERS * P
    # and the registry sees a block stride spanning every layer's block
    geometry = KVCacheGeometry.of(caches[0], allocation="t", group_id=0, layer_index=0,
                                  blocks_dim=1 if shape_name == "kv_first" else 0,
                                  virtual_blocks=num_blocks, physical_blocks=BUDGET,
                                  block_size=BS, kernel_block_size=BS, kv_layout="NHD",
                                  attention_type="MHA")
    assert geometry.interleaves_layers


def test_non_contiguous_geometry_does_not_interleave_layers():
    for shape_name in SHAPES:
        caches, raws = kvcached_caches(shape_name, contiguous=False)
        assert len(raws) == LAYERS
        geometry = KVCacheGeometry.of(caches[0], allocation="t", group_id=0, layer_index=0,
                                      blocks_dim=1 if shape_name == "kv_first" else 0,
                                      virtual_blocks=0, physical_blocks=BUDGET, block_size=BS,
                                      kernel_block_size=BS, kv_layout="NHD",
                                      attention_type="MHA")
        assert not geometry.interleaves_layers, shape_name


def pointer_math_copy_blocks(words, addrs, index, packed_words, packed_tok_stride, to_packed,
                             block_stride_from_shape=False):
    """pack_triton's kernel, element for element: ``base[layer] + offset * word_bytes``,
    with one set of strides for every layer, into the raw reservations (not views).
    ``block_stride_from_shape``: a kernel bug that is right for per-layer tensors only."""
    first = words[0]
    word_bytes = first.element_size()
    _, _, bs, heads, dw = first.shape
    s_kv, s_blk, s_tok, s_head = first.stride()[:4]
    if block_stride_from_shape:
        s_blk = 2 * bs * heads * dw
    per_block = bs * heads * dw
    e = torch.arange(per_block)
    tok, head, d = e // (heads * dw), (e % (heads * dw)) // dw, e % dw
    rem = e % (heads * dw)
    for layer, base in enumerate(addrs.tolist()):
        storage = words[layer].untyped_storage()  # the memory that address lies in
        assert storage.data_ptr() <= base < storage.data_ptr() + storage.nbytes()
        flat = torch.empty(0, dtype=first.dtype).set_(storage)
        for kv in range(2):
            for b, blk in enumerate(index.tolist()):
                off = kv * s_kv + blk * s_blk + tok * s_tok + head * s_head + d
                cache = (base - storage.data_ptr()) // word_bytes + off
                extent = (b * bs + tok) * packed_tok_stride + (layer * 2 + kv) * heads * dw + rem
                if to_packed:
                    packed_words[extent] = flat[cache]
                else:
                    flat[cache] = packed_words[extent]


@pytest.mark.parametrize("kernel", ["stacked", "per_layer", "triton_pointer_math"])
@pytest.mark.parametrize("prefill_shape", SHAPES)
@pytest.mark.parametrize("decode", ["packed", "kv_first", "packed_non_contiguous"])
def test_pack_unpack_round_trip_is_byte_exact(prefill_shape, decode, kernel, monkeypatch):
    p_caches, _ = kvcached_caches(prefill_shape, seed=1)
    d_contiguous = decode != "packed_non_contiguous"
    d_caches, d_raws = kvcached_caches(decode.split("_non")[0], contiguous=d_contiguous, seed=2)
    p_views = [logical_kv_view(c, SPEC) for c in p_caches]
    d_views = [logical_kv_view(c, SPEC) for c in d_caches]

    def layers(views):
        out = KVCacheLayers.from_views(views, stack=kernel == "stacked")
        if kernel == "triton_pointer_math":
            plan = _build_plan(out)
            assert plan is not None and len(set(plan.addrs.tolist())) == LAYERS
            object.__setattr__(out, PLAN_ATTR, plan)
        return out

    if kernel == "triton_pointer_math":
        monkeypatch.setattr(pack_triton, "copy_blocks", pointer_math_copy_blocks)
    p_ids, d_ids, num_tokens = [5, 1, 3], [2, 4, 0], 3 * BS - 1
    slots = len(p_ids) * BS
    extent = torch.empty(FMT.extent_bytes(slots), dtype=torch.uint8)
    pack_request(layers(p_views), p_ids, extent, FMT)
    assert torch.equal(extent, pack_request_reference(p_views, p_ids, FMT))

    expected_raws = [raw.clone() for raw in d_raws]
    expected = [logical_kv_view(c, SPEC) for c in _rebase(d_caches, d_raws, expected_raws)]
    unpack_reference(expected, d_ids, extent, FMT, num_tokens, slots)
    unpack_request(layers(d_views), d_ids, extent, FMT, num_tokens, slots)
    for raw, expected_raw in zip(d_raws, expected_raws):  # nothing else written, anywhere
        assert torch.equal(bits(raw), bits(expected_raw))
    for p_view, d_view in zip(p_views, d_views):
        got = d_view[:, d_ids].flatten(1, 2)[:, :num_tokens]
        assert torch.equal(bits(got), bits(p_view[:, p_ids].flatten(1, 2)[:, :num_tokens]))


def _rebase(caches, old_raws, new_raws):
    """The same views over copies of their reservations."""
    by_ptr = {old.untyped_storage().data_ptr(): new for old, new in zip(old_raws, new_raws)}
    return [torch.as_strided(by_ptr[c.untyped_storage().data_ptr()], c.shape, c.stride(),
                             c.storage_offset()) for c in caches]


@pytest.mark.parametrize("shape_name", SHAPES)
def test_triton_self_check_runs_on_the_real_compound_strides(shape_name, monkeypatch):
    """select_kernel proves the Triton kernel on small layers before using it; for
    layers in one storage those now carry the real block and layer strides, so a
    kernel that gets the compound-page stride wrong is caught, not used."""
    caches, _ = kvcached_caches(shape_name)
    layers = KVCacheLayers.from_views([logical_kv_view(c, SPEC) for c in caches])
    real_strides = _build_plan(layers).words[0].stride()
    seen = []

    def kernel(words, *args, block_stride_from_shape=False, **kwargs):
        seen.append(words[0].stride())
        pointer_math_copy_blocks(words, *args, **kwargs,
                                 block_stride_from_shape=block_stride_from_shape)

    monkeypatch.setattr(pack_triton, "available", lambda device: True)
    monkeypatch.setattr(pack_triton, "copy_blocks", kernel)
    assert "self-check passed" in select_kernel(layers, FMT, "triton")
    assert seen and all(stride == real_strides for stride in seen)

    buggy = KVCacheLayers.from_views([logical_kv_view(c, SPEC) for c in caches])
    monkeypatch.setattr(pack_triton, "copy_blocks",
                        lambda *a, **k: kernel(*a, **k, block_stride_from_shape=True))
    with pytest.raises(RuntimeError, match="differ"):
        select_kernel(buggy, FMT, "triton")
    assert getattr(buggy, PLAN_ATTR, None) is None
