"""Record the geometry of each KV cache tensor kvcached creates.

Wraps ``kvcached.integration.vllm.interfaces.alloc_kv_cache`` (kvcached's patched
model runner calls it through the module, ``kvi.alloc_kv_cache``), records every
returned tensor in :data:`kvcached_pd.registry.REGISTRY` and returns kvcached's result
untouched.

Fail-open: without these records the ``nixl_registration`` patch finds tensors it
cannot describe and refuses to register them, so KV never moves wrongly.
"""

from __future__ import annotations

import functools
from typing import Any

from kvcached_pd.patches.base import ModuleFunctionPatch
from kvcached_pd.registry import REGISTRY, KVCacheGeometry

TARGET = "kvcached.integration.vllm.interfaces"


def blocks_dim_of(kvcache_shape: tuple[int, ...], attention_type: str) -> int:
    """Which dimension of vLLM's requested shape counts blocks (kvcached's own rule)."""
    if attention_type == "MLA" or len(kvcache_shape) == 4:  # MLA, or packed K|V
        return 0
    return 1 if kvcache_shape[0] == 2 else 0  # (2, N, ...) K/V-first, else blocks-first


def record_allocation(
    tensors: list[Any],
    kvcache_shape: tuple[int, ...],
    block_size: int,
    dtype: Any,
    attention_type: str = "MHA",
    kv_layout: str = "NHD",
    group_id: int = 0,
    kernel_block_size: int | None = None,
) -> list[KVCacheGeometry]:
    """Describe the tensors one ``alloc_kv_cache`` call returned, one per layer."""
    kernel_block_size = kernel_block_size or block_size
    ratio = block_size // kernel_block_size
    dim = blocks_dim_of(tuple(kvcache_shape), attention_type)
    allocation = REGISTRY.new_allocation_id()
    out = []
    for layer_index, tensor in enumerate(tensors):
        geometry = KVCacheGeometry.of(
            tensor,
            allocation=allocation,
            group_id=group_id,
            layer_index=layer_index,
            blocks_dim=dim,
            virtual_blocks=int(tensor.shape[dim]),
            physical_blocks=int(kvcache_shape[dim]) * ratio,
            block_size=block_size,
            kernel_block_size=kernel_block_size,
            kv_layout=kv_layout,
            attention_type=attention_type,
        )
        REGISTRY.record(geometry)
        out.append(geometry)
    return out


def _bind(original):
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def alloc_kv_cache(*args, **kwargs):
        result = original(*args, **kwargs)
        tensors = result if isinstance(result, list) else result[0]
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        record_allocation(
            tensors,
            tuple(a["kvcache_shape"]),
            a["block_size"],
            a["dtype"],
            attention_type=a.get("attention_type", "MHA"),
            kv_layout=a.get("kv_layout", "NHD"),
            group_id=a.get("group_id", 0),
            kernel_block_size=a.get("kernel_block_size"),
        )
        return result

    return alloc_kv_cache


class KvcachedAllocPatch(ModuleFunctionPatch):
    name = "kvcached_alloc"
    summary = "record each kvcached KV tensor's geometry (virtual vs physical blocks)"
    target_module = TARGET
    target_attr = "alloc_kv_cache"
    vllm_range = None
    fail_closed = False

    def wrap(self, original):
        return _bind(original)


MRV2_TARGET = "kvcached.integration.vllm.model_runner_v2"


def record_mrv2_caches(caches: dict[str, Any]) -> list[KVCacheGeometry]:
    """Describe the per-layer views kvcached's model-runner-V2 path built (vLLM 0.29+).

    There vLLM's own ``create_kv_cache_views`` sizes each view's block dimension to
    the budget already; what is virtual is the storage under it (one reservation
    per pool), which vLLM 0.30's NIXL worker registers whole. That path allocates one
    pool per layer for all KV-cache groups together, so layers are recorded under one
    allocation (group 0); block and kernel sizes are not known here (recorded as 0).
    """
    allocation = REGISTRY.new_allocation_id()
    out = []
    for layer_index, tensor in enumerate(caches.values()):
        block_stride_bytes = tensor.stride(0) * tensor.element_size()
        storage_bytes = tensor.untyped_storage().nbytes()
        geometry = KVCacheGeometry.of(
            tensor,
            allocation=allocation,
            group_id=0,
            layer_index=layer_index,
            blocks_dim=0,
            virtual_blocks=storage_bytes // block_stride_bytes if block_stride_bytes else 0,
            physical_blocks=int(tensor.shape[0]),
            block_size=0,
            kernel_block_size=0,
            kv_layout="NHD",
            attention_type="MHA",
        )
        REGISTRY.record(geometry)
        out.append(geometry)
    return out


def _bind_mrv2(original):
    @functools.wraps(original)
    def allocate_kv_cache(config, *args, **kwargs):
        caches = original(config, *args, **kwargs)
        record_mrv2_caches(caches)
        return caches

    return allocate_kv_cache


class KvcachedMrv2AllocPatch(ModuleFunctionPatch):
    name = "kvcached_alloc_mrv2"
    summary = "record kvcached's model-runner-V2 KV views (vLLM 0.29+) and their virtual storage"
    target_module = MRV2_TARGET
    target_attr = "allocate_kv_cache"
    vllm_range = None
    fail_closed = False

    def wrap(self, original):
        return _bind_mrv2(original)
