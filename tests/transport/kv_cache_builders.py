"""KV cache tensors laid out exactly as vLLM and kvcached lay them out, for tests.

Each :class:`CacheLayout` builds the per-layer tensors a backend would hand a KV
connector (its logical shape, its physical memory order in the strides) over raw
buffers the test owns, and states, independently of those strides, where element
``[kv, block, token, head, dim]`` of layer ``l`` lives in the raw buffers: the address
oracle the layout tests check :func:`logical_kv_view` against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcached_pd.transport.format import PackedFormat
from kvcached_pd.transport.layout import AttnCacheSpec, logical_kv_view
from kvcached_pd.transport.pack import unpack_reference


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_blocks: int  # the tensors' block dim: kvcached's virtual capacity, not what is used
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_elems(self) -> int:
        """Elements of K (or V) of one block of one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def spec(self) -> AttnCacheSpec:
        return AttnCacheSpec(self.block_size, self.num_kv_heads, self.head_dim)

    def split_half_v_offset(self) -> int:
        """kvcached's V offset: K and V regions are each sized for the whole virtual
        reservation (rounded to pages), so V starts past K's last block, not right after."""
        return self.num_blocks * self.block_elems + 3 * self.block_elems + 5

    def padded_page_stride(self) -> int:
        """vLLM's ``page_size_padded``: each block's page is longer than its K and V."""
        return 2 * self.block_elems + 7


Oracle = Callable[..., tuple[int, torch.Tensor]]


@dataclass(frozen=True)
class CacheLayout:
    name: str
    cross_layer: bool  # all layers in one buffer (one storage), else one buffer per layer
    buffer_numel: Callable[[Geometry], int]
    build_layer: Callable[[list[torch.Tensor], Geometry, int], torch.Tensor]
    # (geometry, layer, kv, block, token, head, dim) -> (buffer index, element offsets)
    address: Oracle

    def __str__(self) -> str:
        return self.name

    def num_buffers(self, g: Geometry) -> int:
        return 1 if self.cross_layer else g.num_layers

    def new_buffers(
        self, g: Geometry, dtype: torch.dtype, device: str = "cpu"
    ) -> list[torch.Tensor]:
        return [
            torch.empty(self.buffer_numel(g), dtype=dtype, device=device)
            for _ in range(self.num_buffers(g))
        ]

    def build(self, buffers: list[torch.Tensor], g: Geometry) -> list[torch.Tensor]:
        """The per-layer cache tensors as the backend exposes them."""
        return [self.build_layer(buffers, g, layer) for layer in range(g.num_layers)]

    def logical_views(self, buffers: list[torch.Tensor], g: Geometry) -> list[torch.Tensor]:
        return [logical_kv_view(cache, g.spec) for cache in self.build(buffers, g)]


def _per_layer_numel(g: Geometry) -> int:
    return 2 * g.num_blocks * g.block_elems


def _contiguous(shape: Callable[[Geometry], tuple[int, ...]], permutation: tuple[int, ...] | None):
    def build(buffers: list[torch.Tensor], g: Geometry, layer: int) -> torch.Tensor:
        tensor = buffers[layer].view(shape(g))
        return tensor if permutation is None else tensor.permute(permutation)

    return build


def _split_half(kv_first: bool):
    def build(buffers: list[torch.Tensor], g: Geometry, layer: int) -> torch.Tensor:
        # kvcached, KVCACHED_CONTIGUOUS_LAYOUT=false: torch.as_strided over the layer's
        # raw tensor; block stride = one block of K (or V), K/V stride = the V offset.
        tail = (g.block_size, g.num_kv_heads, g.head_dim)
        tail_strides = (g.num_kv_heads * g.head_dim, g.head_dim, 1)
        if kv_first:
            shape = (2, g.num_blocks, *tail)
            strides = (g.split_half_v_offset(), g.block_elems, *tail_strides)
        else:
            shape = (g.num_blocks, 2, *tail)
            strides = (g.block_elems, g.split_half_v_offset(), *tail_strides)
        return torch.as_strided(buffers[layer], shape, strides)

    return build


def _kvcached_contiguous(kv_first: bool):
    def build(buffers: list[torch.Tensor], g: Geometry, layer: int) -> torch.Tensor:
        # kvcached, KVCACHED_CONTIGUOUS_LAYOUT=true: one tensor (N, L, 2, bs, H, D) over
        # all layers; layer i is [:, i], permuted to the backend's shape.
        whole = buffers[0].view(
            g.num_blocks, g.num_layers, 2, g.block_size, g.num_kv_heads, g.head_dim
        )
        per_layer = whole[:, layer]
        return per_layer.permute(1, 0, 2, 3, 4) if kv_first else per_layer

    return build


def _packed_cross_layer(buffers: list[torch.Tensor], g: Geometry, layer: int) -> torch.Tensor:
    # vLLM 0.26+ FlashAttention with the layers dimension (NHD):
    # memory (N, L, bs, H, 2D), exposed per layer as logical (N, H, bs, 2D).
    # This is also kvcached's contiguous layout for that shape (one compound page per
    # block, layer l at l x block; _build_packed_kv_views), byte for byte; built by
    # kvcached's own code in tests/transport/test_kvcached_contiguous.py.
    whole = buffers[0].view(
        g.num_blocks, g.num_layers, g.block_size, g.num_kv_heads, 2 * g.head_dim
    )
    return whole[:, layer].permute(0, 2, 1, 3)


def _padded_pages(buffers: list[torch.Tensor], g: Geometry, layer: int) -> torch.Tensor:
    # vLLM's page_size_padded: blocks-first with a block stride longer than the block.
    contiguous = torch.empty(
        (g.num_blocks, 2, g.block_size, g.num_kv_heads, g.head_dim), device="meta"
    ).stride()
    strides = (g.padded_page_stride(), *contiguous[1:])
    return torch.as_strided(
        buffers[layer], (g.num_blocks, 2, g.block_size, g.num_kv_heads, g.head_dim), strides
    )


# Address oracles, written from each layout's description (not from its strides).
def _nhd_offset(g, kv_stride, block_stride, block, token, head, dim, kv):
    return (
        kv * kv_stride + block * block_stride + (token * g.num_kv_heads + head) * g.head_dim + dim
    )


def _hnd_offset(g, kv_stride, block_stride, block, token, head, dim, kv):
    return kv * kv_stride + block * block_stride + (head * g.block_size + token) * g.head_dim + dim


LAYOUTS: tuple[CacheLayout, ...] = (
    CacheLayout(
        "kv_first_nhd",
        False,
        _per_layer_numel,
        _contiguous(lambda g: (2, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim), None),
        lambda g, layer, kv, b, t, h, d: (
            layer,
            _nhd_offset(g, g.num_blocks * g.block_elems, g.block_elems, b, t, h, d, kv),
        ),
    ),
    CacheLayout(
        "kv_first_hnd",
        False,
        _per_layer_numel,
        _contiguous(
            lambda g: (2, g.num_blocks, g.num_kv_heads, g.block_size, g.head_dim), (0, 1, 3, 2, 4)
        ),
        lambda g, layer, kv, b, t, h, d: (
            layer,
            _hnd_offset(g, g.num_blocks * g.block_elems, g.block_elems, b, t, h, d, kv),
        ),
    ),
    CacheLayout(
        "kv_first_split_half",
        False,
        lambda g: 2 * g.split_half_v_offset(),
        _split_half(kv_first=True),
        lambda g, layer, kv, b, t, h, d: (
            layer,
            _nhd_offset(g, g.split_half_v_offset(), g.block_elems, b, t, h, d, kv),
        ),
    ),
    CacheLayout(
        "kv_first_kvcached_contiguous",
        True,
        lambda g: g.num_layers * _per_layer_numel(g),
        _kvcached_contiguous(kv_first=True),
        lambda g, layer, kv, b, t, h, d: (
            0,
            _nhd_offset(g, g.block_elems, 2 * g.num_layers * g.block_elems, b, t, h, d, kv)
            + layer * 2 * g.block_elems,
        ),
    ),
    CacheLayout(
        "blocks_first_nhd",
        False,
        _per_layer_numel,
        _contiguous(lambda g: (g.num_blocks, 2, g.block_size, g.num_kv_heads, g.head_dim), None),
        lambda g, layer, kv, b, t, h, d: (
            layer,
            _nhd_offset(g, g.block_elems, 2 * g.block_elems, b, t, h, d, kv),
        ),
    ),
    CacheLayout(
        "blocks_first_hnd",
        False,
        _per_layer_numel,
        _contiguous(
            lambda g: (g.num_blocks, 2, g.num_kv_heads, g.block_size, g.head_dim), (0, 1, 3, 2, 4)
        ),
        lambda g, layer, kv, b, t, h, d: (
            layer,
            _hnd_offset(g, g.block_elems, 2 * g.block_elems, b, t, h, d, kv),
        ),
    ),
    CacheLayout(
        "blocks_first_split_half",
        False,
        lambda g: 2 * g.split_half_v_offset(),
        _split_half(kv_first=False),
        lambda g, layer, kv, b, t, h, d: (
            layer,
            _nhd_offset(g, g.split_half_v_offset(), g.block_elems, b, t, h, d, kv),
        ),
    ),
    CacheLayout(
        "blocks_first_kvcached_contiguous",
        True,
        lambda g: g.num_layers * _per_layer_numel(g),
        _kvcached_contiguous(kv_first=False),
        lambda g, layer, kv, b, t, h, d: (
            0,
            _nhd_offset(g, g.block_elems, 2 * g.num_layers * g.block_elems, b, t, h, d, kv)
            + layer * 2 * g.block_elems,
        ),
    ),
    CacheLayout(
        "blocks_first_padded_pages",
        False,
        lambda g: g.num_blocks * g.padded_page_stride(),
        _padded_pages,
        lambda g, layer, kv, b, t, h, d: (
            layer,
            _nhd_offset(g, g.block_elems, g.padded_page_stride(), b, t, h, d, kv),
        ),
    ),
    CacheLayout(
        "packed_nhd",
        False,
        _per_layer_numel,
        _contiguous(
            lambda g: (g.num_blocks, g.block_size, g.num_kv_heads, 2 * g.head_dim), (0, 2, 1, 3)
        ),
        lambda g, layer, kv, b, t, h, d: (
            layer,
            ((b * g.block_size + t) * g.num_kv_heads + h) * 2 * g.head_dim + kv * g.head_dim + d,
        ),
    ),
    CacheLayout(
        "packed_hnd",
        False,
        _per_layer_numel,
        _contiguous(lambda g: (g.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim), None),
        lambda g, layer, kv, b, t, h, d: (
            layer,
            ((b * g.num_kv_heads + h) * g.block_size + t) * 2 * g.head_dim + kv * g.head_dim + d,
        ),
    ),
    CacheLayout(
        "packed_cross_layer_nhd",
        True,
        lambda g: g.num_layers * _per_layer_numel(g),
        _packed_cross_layer,
        lambda g, layer, kv, b, t, h, d: (
            0,
            (((b * g.num_layers + layer) * g.block_size + t) * g.num_kv_heads + h) * 2 * g.head_dim
            + kv * g.head_dim
            + d,
        ),
    ),
)

LAYOUTS_BY_NAME = {layout.name: layout for layout in LAYOUTS}


def fill_random_bits(buffers: list[torch.Tensor], generator: torch.Generator) -> None:
    """Random bytes (NaN patterns included for float dtypes): nothing can pass by luck."""
    for buffer in buffers:
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Same-width integer view, for bitwise equality of float data that may hold NaNs."""
    return tensor.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    )


def side(layout: CacheLayout, block_size: int, num_blocks: int = 9, layers: int = 3,
         heads: int = 2, head_dim: int = 4, dtype: torch.dtype = torch.bfloat16,
         seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One side's caches of random bits: ``(buffers, logical views)``."""
    g = Geometry(layers, num_blocks, block_size, heads, head_dim)
    buffers = layout.new_buffers(g, dtype)
    fill_random_bits(buffers, torch.Generator().manual_seed(seed))
    return buffers, layout.logical_views(buffers, g)


def decode_side(layout: CacheLayout, block_size: int, num_tokens: int, cached: int,
                extent: torch.Tensor, fmt: PackedFormat, src_tok_slots: int):
    """A decode side (3 layers of 9 blocks, seed 2) that holds its first ``cached`` blocks
    from its prefix cache, and what unpacking tokens ``[cached * block_size, num_tokens)``
    of ``extent`` must leave in it, by the token-by-token reference.

    Returns ``(buffers, views, expected buffers, block ids, first token)``."""
    buffers, views = side(layout, block_size, seed=2)
    expected = [b.clone() for b in buffers]
    ids = [4, 1, 6][: -(-num_tokens // block_size)][cached:]
    first = cached * block_size
    unpack_reference(layout.logical_views(expected, Geometry(3, 9, block_size, 2, 4)), ids,
                     extent, fmt, num_tokens, src_tok_slots, first)
    return buffers, views, expected, ids, first
