"""vLLM 0.29+: kvcached's model-runner-V2 path and vLLM 0.30's storage-wide registration.

From 0.29 kvcached allocates one virtual pool per layer and lets vLLM's own
``create_kv_cache_views`` build budget-sized views over it; vLLM 0.30's NIXL worker
then registers each view's whole *storage*, i.e. kvcached's whole virtual pool. The
registration patch clips that to the budget. Tensors come from kvcached's real
``model_runner_v2.allocate_kv_cache`` (CPU stand-ins for its CUDA module only).
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from kvcached_pd.kv_spans import physical_spans
from kvcached_pd.patches import get_patch
from kvcached_pd.registry import REGISTRY
from tests.conftest import vllm_release
from tests.support import kvcached_cpu
from tests.support import vllm_nixl_worker as vw

pytestmark = [
    pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched"),
    pytest.mark.skipif(vllm_release() < (0, 29), reason="MRV2 allocation is vLLM 0.29+"),
]

BUDGET, BLOCK, HEADS, HEAD_DIM, LAYERS = 10, 16, 2, 64, 3
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PAGE = 2 * BLOCK * HEADS * HEAD_DIM * 2


@pytest.fixture
def vllm_config():
    model = vw.write_tiny_llama(tempfile.mkdtemp(), LAYERS, HEADS, HEAD_DIM)
    config = vw.make_vllm_config(model, block_size=BLOCK)
    vw.ensure_distributed(config)
    return config


def resolve_layout(vllm_config):
    """What the EngineCore does once before allocating (vLLM 0.29+)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    return resolve_kv_cache_layout(vllm_config, [["LBNHC", "LBHNC"]])


def kv_cache_config_layer_outermost():
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
    )

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                             dtype=torch.float16)
    assert spec.page_size_bytes == PAGE
    tensor = KVCacheTensor(size=BUDGET * LAYERS * PAGE, layers=list(LAYER_NAMES),
                           layer_stride=BUDGET * PAGE, block_stride=PAGE)
    return KVCacheConfig(num_blocks=BUDGET, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)])


def test_registers_the_budget_not_the_virtual_pool(kvcached_env, vllm_config):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kvcached_cpu.install_stand_ins()
    names = ("kvcached_alloc_mrv2", "nixl_layout", "nixl_registration")
    for name in names:
        get_patch(name).patch()
    REGISTRY.clear()
    try:
        import kvcached.integration.vllm.model_runner_v2 as mrv2

        config = kv_cache_config_layer_outermost()
        layout = resolve_layout(vllm_config)
        assert layout is KVCacheLayout.LBNHC  # NIXL asked for LBHNC; kvcached-pd said NHD
        with kvcached_cpu.fake_device():
            caches = mrv2.allocate_kv_cache(config, "cpu", layout)
        pool_bytes = {t.untyped_storage().nbytes() for t in caches.values()}
        assert min(pool_bytes) > 10 * BUDGET * PAGE  # the virtual pool under each view

        backend = vw.attention_backend("FLASH_ATTN")
        with vw.backend_lookup(backend):
            worker = vw.make_worker(vllm_config, config)
            with vw.record_nixl_calls(worker) as calls:
                worker.register_kv_caches(caches)

        expected = sorted(s for t in caches.values() for s in physical_spans(t))
        registered = sorted((a, a + n) for a, n, _ in calls.reg)
        assert registered == expected
        assert sum(e - s for s, e in registered) == LAYERS * BUDGET * PAGE
        descs = np.concatenate(calls.xfer)
        assert len(descs) >= LAYERS * BUDGET
        for addr, length, _ in descs.tolist():
            assert any(s <= addr and addr + length <= e for s, e in registered)
    finally:
        for name in names:
            get_patch(name).unpatch()
        REGISTRY.clear()


def test_vllm_alone_registers_the_whole_virtual_pool(kvcached_env, vllm_config):
    """The problem the patch fixes, seen on vLLM 0.30's own code path."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kvcached_cpu.install_stand_ins()
    import kvcached.integration.vllm.model_runner_v2 as mrv2

    config = kv_cache_config_layer_outermost()
    layout = resolve_layout(vllm_config)
    assert layout is KVCacheLayout.LBHNC  # NIXL's own preference, unpatched
    with kvcached_cpu.fake_device():
        caches = mrv2.allocate_kv_cache(config, "cpu", layout)
    backend = vw.attention_backend("FLASH_ATTN")
    with vw.backend_lookup(backend):
        worker = vw.make_worker(vllm_config, config)
        with vw.record_nixl_calls(worker) as calls:
            worker.register_kv_caches(caches)
    registered = sum(n for _, n, _ in calls.reg)
    assert registered == sum(t.untyped_storage().nbytes() for t in caches.values())
    assert registered > 10 * LAYERS * BUDGET * PAGE
