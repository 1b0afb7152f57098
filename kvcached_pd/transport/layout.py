"""One logical, zero-copy view of an attention layer's KV cache, whatever its layout.

vLLM's attention backends hand each layer's KV cache out in one of three *logical*
shapes, and behind each shape the physical memory order varies again:

- K/V-first ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (FlashAttention up
  to vLLM 0.22): NHD memory, HND memory exposed as a permuted view, or kvcached's
  "split-half" memory (all K blocks, then all V blocks far away, built with
  ``torch.as_strided``);
- blocks-first ``(num_blocks, 2, block_size, num_kv_heads, head_dim)`` (FlashInfer,
  Triton, FlashAttention in 0.23-0.25): K and V interleaved per block, split-half,
  NHD or HND, kvcached's cross-layer "contiguous" layout;
- K/V packed in the last dim ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``
  (vLLM 0.26+): ``[..., :head_dim]`` is K, ``[..., head_dim:]`` is V; NHD memory
  is exposed as a permuted view of ``(num_blocks, block_size, num_kv_heads, 2*head_dim)``.

The pack/unpack kernels should not know any of this. :func:`logical_kv_view` maps all
of them onto one logical shape, ``(2, num_blocks, block_size, num_kv_heads, head_dim)``
(index 0 = K, 1 = V), as a view that aliases the cache: physical order lives only in
the strides, so the kernels read and write the cache in place. The logical shape vLLM
exposes is trusted (it comes from the backend's ``get_kv_cache_shape``); the strides are
not interpreted at all, only checked to address every element exactly once.

:class:`KVCacheLayers` bundles the views of all layers and, when every layer is the
same strided view at a constant offset in one storage (vLLM's and kvcached's
cross-layer layouts), one 6-D view over all of them so that a request moves with a
single gather or scatter instead of one per layer.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "AttnCacheSpec",
    "CacheShapeKind",
    "KVCacheLayers",
    "logical_kv_view",
]


class CacheShapeKind(enum.Enum):
    """Which logical shape vLLM gave a layer's cache tensor."""

    KV_FIRST = "kv_first"  # (2, N, bs, H, D)
    BLOCKS_FIRST = "blocks_first"  # (N, 2, bs, H, D)
    KV_PACKED_LAST_DIM = "kv_packed_last_dim"  # (N, H, bs, 2 * D)


@dataclass(frozen=True)
class AttnCacheSpec:
    """The dims a layer's cache must have; they resolve what the shape alone cannot.

    ``shape_kind`` is needed only when the shape is ambiguous (a 5-D cache with two
    blocks, ``(2, 2, bs, H, D)``); leave it ``None`` to infer it otherwise.
    """

    block_size: int
    num_kv_heads: int
    head_dim: int
    shape_kind: CacheShapeKind | None = None


def _describe(cache: torch.Tensor) -> str:
    return f"shape={tuple(cache.shape)} strides={tuple(cache.stride())} dtype={cache.dtype}"


def _candidate_kinds(cache: torch.Tensor, spec: AttnCacheSpec) -> list[CacheShapeKind]:
    bs, h, d = spec.block_size, spec.num_kv_heads, spec.head_dim
    shape = tuple(cache.shape)
    kinds = []
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, h, d):
        kinds.append(CacheShapeKind.KV_FIRST)
    if len(shape) == 5 and shape[1] == 2 and shape[2:] == (bs, h, d):
        kinds.append(CacheShapeKind.BLOCKS_FIRST)
    if len(shape) == 4 and shape[1:] == (h, bs, 2 * d):
        kinds.append(CacheShapeKind.KV_PACKED_LAST_DIM)
    return kinds


def _resolve_kind(cache: torch.Tensor, spec: AttnCacheSpec) -> CacheShapeKind:
    kinds = _candidate_kinds(cache, spec)
    if spec.shape_kind is not None:
        if spec.shape_kind not in kinds:
            raise ValueError(
                f"KV cache {_describe(cache)} is not a {spec.shape_kind.value} cache with "
                f"block_size={spec.block_size}, num_kv_heads={spec.num_kv_heads}, "
                f"head_dim={spec.head_dim}"
            )
        return spec.shape_kind
    if not kinds:
        raise ValueError(
            f"KV cache {_describe(cache)} matches no known attention layout for "
            f"block_size={spec.block_size}, num_kv_heads={spec.num_kv_heads}, "
            f"head_dim={spec.head_dim}; expected (2, N, bs, H, D), (N, 2, bs, H, D) "
            "or (N, H, bs, 2*D)"
        )
    if len(kinds) > 1:
        raise ValueError(
            f"KV cache {_describe(cache)} is ambiguous between "
            f"{', '.join(k.value for k in kinds)}; set AttnCacheSpec.shape_kind"
        )
    return kinds[0]


def _check_addresses_each_element_once(view: torch.Tensor, what: str) -> None:
    """Raise unless no two elements of ``view`` share a memory address.

    Sufficient test: ordered by stride, each dim's stride must exceed the span of all
    smaller-stride dims. Every layout vLLM and kvcached build passes it; a broadcast
    (stride 0) or otherwise aliasing view fails it and would make a scatter racy.
    """
    dims = sorted((s, n) for s, n in zip(view.stride(), view.shape) if n > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            raise ValueError(
                f"{what} {_describe(view)} addresses some memory more than once "
                "(or its strides interleave in a way kvcached-pd does not accept)"
            )
        span += stride * (size - 1)


def logical_kv_view(cache: torch.Tensor, spec: AttnCacheSpec) -> torch.Tensor:
    """Return ``cache`` as a ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` view.

    Index 0 of the first dim is K, 1 is V. No data is copied: the result aliases
    ``cache`` (writes through it land in the cache). Raises ``ValueError`` naming the
    shape and strides for any tensor that is not one of the known layouts with the
    dims of ``spec``, or whose strides alias memory.
    """
    kind = _resolve_kind(cache, spec)
    if kind is CacheShapeKind.KV_FIRST:
        view = cache
    elif kind is CacheShapeKind.BLOCKS_FIRST:
        view = cache.transpose(0, 1)
    else:
        # (N, H, bs, 2D) -> (N, H, bs, 2, D): splitting one dim is always a view.
        view = cache.unflatten(3, (2, spec.head_dim)).permute(3, 0, 2, 1, 4)
    _check_addresses_each_element_once(view, "KV cache")
    return view


@dataclass(frozen=True)
class KVCacheLayers:
    """The logical views of all attention layers of one worker, in layer order.

    ``stacked`` is a ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``
    view over every layer at once, present only when the layers share storage, strides
    and a constant positive offset between consecutive layers (and the result still
    addresses each element once); otherwise ``None`` and kernels loop over layers.
    """

    layers: tuple[torch.Tensor, ...]
    stacked: torch.Tensor | None

    @classmethod
    def from_views(cls, views: Sequence[torch.Tensor], stack: bool = True) -> KVCacheLayers:
        """Bundle logical views (from :func:`logical_kv_view`); ``stack=False`` skips the
        single-view fast path (for comparisons)."""
        if not views:
            raise ValueError("KVCacheLayers needs at least one layer")
        first = views[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise ValueError(f"layer 0 is not a logical KV view: {_describe(first)}")
        for index, view in enumerate(views[1:], start=1):
            if (view.shape, view.dtype, view.device) != (first.shape, first.dtype, first.device):
                raise ValueError(
                    f"layer {index} ({_describe(view)}, {view.device}) differs from layer 0 "
                    f"({_describe(first)}, {first.device}); all layers must share shape, "
                    "dtype and device"
                )
        stacked = _stack_if_evenly_spaced(views) if stack else None
        return cls(layers=tuple(views), stacked=stacked)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_size(self) -> int:
        return self.layers[0].shape[2]

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device


def _stack_if_evenly_spaced(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    if len(views) < 2:
        return None
    first = views[0]
    storage_ptr = first.untyped_storage().data_ptr()
    for view in views[1:]:
        if view.untyped_storage().data_ptr() != storage_ptr or view.stride() != first.stride():
            return None
    layer_stride = views[1].storage_offset() - first.storage_offset()
    if layer_stride <= 0:
        return None
    for index, view in enumerate(views):
        if view.storage_offset() != first.storage_offset() + index * layer_stride:
            return None
    stacked = torch.as_strided(
        first,
        size=(len(views), *first.shape),
        stride=(layer_stride, *first.stride()),
        storage_offset=first.storage_offset(),
    )
    try:
        _check_addresses_each_element_once(stacked, "stacked layers")
    except ValueError:
        return None
    return stacked
