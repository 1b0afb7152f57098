"""logical_kv_view addresses the right element of every layout vLLM and kvcached build."""

from __future__ import annotations

import pytest
import torch

from kvcached_pd.transport.layout import (
    AttnCacheSpec,
    CacheShapeKind,
    KVCacheLayers,
    logical_kv_view,
)
from tests.transport.kv_cache_builders import LAYOUTS, LAYOUTS_BY_NAME, CacheLayout, Geometry

# bs != H != D != num_blocks so that a swapped dim cannot go unnoticed.
GEOMETRY = Geometry(num_layers=3, num_blocks=7, block_size=4, num_kv_heads=3, head_dim=5)


def _numbered_buffers(layout: CacheLayout, g: Geometry) -> list[torch.Tensor]:
    """Buffers whose every element holds a distinct number (its buffer and offset)."""
    buffers = layout.new_buffers(g, torch.int64)
    for index, buffer in enumerate(buffers):
        buffer.copy_(torch.arange(buffer.numel()) + index * 10**9)
    return buffers


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_view_addresses_the_element_the_layout_describes(layout: CacheLayout) -> None:
    g = GEOMETRY
    buffers = _numbered_buffers(layout, g)
    kv, block, token, head, dim = torch.meshgrid(
        torch.arange(2),
        torch.arange(g.num_blocks),
        torch.arange(g.block_size),
        torch.arange(g.num_kv_heads),
        torch.arange(g.head_dim),
        indexing="ij",
    )
    for layer, view in enumerate(layout.logical_views(buffers, g)):
        assert view.shape == (2, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        buffer_index, offsets = layout.address(g, layer, kv, block, token, head, dim)
        assert torch.equal(view, buffers[buffer_index][offsets])


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_view_aliases_the_cache(layout: CacheLayout) -> None:
    g = GEOMETRY
    buffers = _numbered_buffers(layout, g)
    caches = layout.build(buffers, g)
    view = logical_kv_view(caches[1], g.spec)
    view[1, 5, 2, 1, 3] = -42
    buffer_index, offset = layout.address(g, 1, 1, 5, 2, 1, 3)
    assert buffers[buffer_index][offset] == -42
    assert (caches[1] == -42).sum() == 1
    assert view.untyped_storage().data_ptr() == caches[1].untyped_storage().data_ptr()


def test_packed_layout_splits_k_and_v_in_the_last_dim() -> None:
    g = GEOMETRY
    cache = torch.randn(g.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim)
    view = logical_kv_view(cache, g.spec)
    assert torch.equal(view[0], cache[..., : g.head_dim].permute(0, 2, 1, 3))
    assert torch.equal(view[1], cache[..., g.head_dim :].permute(0, 2, 1, 3))


@pytest.mark.parametrize(
    "shape, message",
    [
        ((2, 7, 4, 3), "matches no known"),  # 4-D but not (N, H, bs, 2D)
        ((2, 7, 4, 3, 6), "matches no known"),  # wrong head_dim
        ((2, 7, 4, 2, 5), "matches no known"),  # wrong head count
        ((2, 7, 8, 3, 5), "matches no known"),  # wrong block size
        ((7, 3, 4, 5), "matches no known"),  # packed but last dim is D, not 2D
        ((7, 4, 3, 10), "matches no known"),  # packed NHD memory order, not the logical shape
        ((7, 4, 3, 5), "matches no known"),
        ((2, 7, 2, 4, 3, 5), "matches no known"),
    ],
)
def test_unknown_shapes_are_refused_with_shape_and_strides(shape, message) -> None:
    cache = torch.zeros(shape)
    with pytest.raises(ValueError, match=message) as error:
        logical_kv_view(cache, GEOMETRY.spec)
    assert str(tuple(shape)) in str(error.value)
    assert str(cache.stride()) in str(error.value)


def test_two_block_cache_is_ambiguous_without_a_hint() -> None:
    spec = AttnCacheSpec(block_size=4, num_kv_heads=3, head_dim=5)
    cache = torch.arange(2 * 2 * 60).view(2, 2, 4, 3, 5)
    with pytest.raises(ValueError, match="ambiguous.*shape_kind"):
        logical_kv_view(cache, spec)
    kv_first = logical_kv_view(cache, AttnCacheSpec(4, 3, 5, CacheShapeKind.KV_FIRST))
    blocks_first = logical_kv_view(cache, AttnCacheSpec(4, 3, 5, CacheShapeKind.BLOCKS_FIRST))
    assert torch.equal(kv_first[0, 1], cache[0, 1])
    assert torch.equal(blocks_first[0, 1], cache[1, 0])


def test_hint_that_contradicts_the_shape_is_refused() -> None:
    cache = torch.zeros(2, 7, 4, 3, 5)
    with pytest.raises(ValueError, match="is not a kv_packed_last_dim cache"):
        logical_kv_view(cache, AttnCacheSpec(4, 3, 5, CacheShapeKind.KV_PACKED_LAST_DIM))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.zeros(1, 4, 3, 5).expand(2, 7, 4, 3, 5), id="broadcast"),
        pytest.param(
            lambda: torch.as_strided(torch.zeros(1000), (7, 2, 4, 3, 5), (60, 10, 15, 5, 1)),
            id="v_overlaps_k",
        ),
    ],
)
def test_strides_that_alias_memory_are_refused(make) -> None:
    with pytest.raises(ValueError, match="more than once"):
        logical_kv_view(make(), GEOMETRY.spec)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layers_stack_into_one_view_only_when_they_share_storage(layout: CacheLayout) -> None:
    g = GEOMETRY
    buffers = _numbered_buffers(layout, g)
    views = layout.logical_views(buffers, g)
    layers = KVCacheLayers.from_views(views)
    if not layout.cross_layer:
        assert layers.stacked is None
        return
    assert layers.stacked is not None
    for layer, view in enumerate(views):
        assert torch.equal(layers.stacked[layer], view)
    layers.stacked[2, 1, 6, 3, 2, 4] = -7
    assert views[2][1, 6, 3, 2, 4] == -7
    assert KVCacheLayers.from_views(views, stack=False).stacked is None


def test_layers_at_uneven_offsets_in_one_storage_are_not_stacked() -> None:
    g = GEOMETRY
    buffer = torch.zeros(4 * 2 * g.num_blocks * g.block_elems)
    per_layer = 2 * g.num_blocks * g.block_elems
    starts = [0, per_layer, 3 * per_layer]  # a gap before layer 2
    views = [
        logical_kv_view(buffer[s : s + per_layer].view(2, g.num_blocks, 4, 3, 5), g.spec)
        for s in starts
    ]
    assert KVCacheLayers.from_views(views).stacked is None
    evenly = [
        logical_kv_view(buffer[s : s + per_layer].view(2, g.num_blocks, 4, 3, 5), g.spec)
        for s in (0, per_layer, 2 * per_layer)
    ]
    assert KVCacheLayers.from_views(evenly).stacked is not None
    assert KVCacheLayers.from_views(list(reversed(evenly))).stacked is None


def test_layers_of_different_shapes_are_refused() -> None:
    a = torch.zeros(2, 7, 4, 3, 5)
    b = torch.zeros(2, 7, 8, 3, 5)
    with pytest.raises(ValueError, match="layer 1"):
        KVCacheLayers.from_views([a, b])


def test_kvcached_oversized_block_dim_is_accepted() -> None:
    """kvcached's tensors span the virtual reservation, far more blocks than vLLM uses."""
    layout = LAYOUTS_BY_NAME["kv_first_split_half"]
    g = Geometry(num_layers=1, num_blocks=3000, block_size=16, num_kv_heads=1, head_dim=2)
    view = layout.logical_views(layout.new_buffers(g, torch.float16), g)[0]
    assert view.shape[1] == 3000
