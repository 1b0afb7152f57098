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

from kvcached_pd import nixl_kv_guard
from kvcached_pd.errors import UnsupportedConfiguration
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


def kv_cache_config_block_outermost(budget: int = BUDGET):
    """kvcached's contiguous layout on vLLM 0.29+: one backing whose blocks hold every
    layer's page side by side (block stride = layers x page), as vLLM places a BL*
    layout."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
    )

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                             dtype=torch.float16)
    tensor = KVCacheTensor(size=budget * LAYERS * PAGE, layers=list(LAYER_NAMES),
                           layer_stride=PAGE, block_stride=LAYERS * PAGE)
    return KVCacheConfig(num_blocks=budget, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)])


def contiguous_worker(vllm_config, engine_id, budget: int = BUDGET):
    """A NIXL worker over kvcached's real MRV2 allocation in its contiguous layout
    (blocks-first BLNHC views), registered through kvcached-pd's patches."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_layout import KVCacheLayout

    import kvcached.integration.vllm.model_runner_v2 as mrv2

    config = kv_cache_config_block_outermost(budget)
    # what kvcached's contiguous layout accepts; NIXL would pick the head-major one
    layout = resolve_kv_cache_layout(vllm_config, [["BLNHC", "BLHNC"]])
    assert layout is KVCacheLayout.BLNHC
    with kvcached_cpu.fake_device(total_memory=max(64 << 20, 4 * budget * LAYERS * PAGE),
                                  contiguous=True):
        caches = mrv2.allocate_kv_cache(config, "cpu", layout)
    first = next(iter(caches.values()))
    assert first.stride(0) * first.element_size() == LAYERS * PAGE  # blocks first
    worker = vw.make_worker(vllm_config, config, engine_id=engine_id)
    # what kvcached-pd's connector does around its inner connector's registration when
    # its staged path moves this engine's KV (only then is this layout registered)
    with vw.record_nixl_calls(worker) as calls, \
            nixl_kv_guard.registering_for_the_connector(None):
        worker.register_kv_caches(caches)
    return worker, caches, calls


@pytest.fixture
def contiguous_env(kvcached_env):
    kvcached_env.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "true")
    kvcached_env.setenv("KVCACHED_PD_TRANSPORT", "staged")
    with kvcached_cpu.patches_applied("kvcached_alloc_mrv2", "nixl_layout", "nixl_registration",
                                      "connector_routing"):
        yield


def test_contiguous_layout_registers_no_kv_on_block_outermost_views(contiguous_env,
                                                                    vllm_config):
    """kvcached's default (contiguous) layout under Model Runner V2: its views are
    blocks-first (block stride: every layer's page), and NIXL must register none of the
    KV (only the staged transport can move it). vLLM 0.30's registration divides by the
    stand-ins' block stride: with a zero stride there the decode and prefill EngineCores
    died at start-up on the GPU host (ZeroDivisionError in base_worker)."""
    backend = vw.attention_backend("FLASH_ATTN")
    with vw.backend_lookup(backend):
        worker, caches, calls = contiguous_worker(vllm_config, "p-contiguous")
    kv_bytes = [(a, n) for a, n, _ in calls.reg
                if any(s <= a < e for t in caches.values() for s, e in physical_spans(t))]
    assert not kv_bytes, "NIXL registered kvcached's interleaved KV"
    # what follows (the staged transport's views) sees the real caches, not stand-ins
    for name in LAYER_NAMES:
        real = worker.device_kv_caches[name]
        assert real.data_ptr() == caches[name].data_ptr()
        assert real.stride() == caches[name].stride()


def test_two_contiguous_layout_workers_handshake(contiguous_env, vllm_config):
    """D's vLLM worker loads P's advertised metadata (vLLM's own handshake: D needs it
    to tell P it is done with a request). P registered none of its KV, so D must
    prepare a remote list over P's guard alone. On vLLM 0.30 the list came from each
    region's block count, which the advertisement had left at the budget: every
    handshake failed with NIXL_ERR_NOT_FOUND on the GPU host, and P kept each request's
    blocks until its KV lease ran out. The budget here is the host's order (4096
    blocks): one descriptor per block then reaches past P's 4 KiB guard."""
    import importlib

    import msgspec

    backend = vw.attention_backend("FLASH_ATTN")
    with vw.backend_lookup(backend):
        p_worker, _, _ = contiguous_worker(vllm_config, "p-contiguous", budget=4096)
        d_worker, _, _ = contiguous_worker(vllm_config, "d-contiguous", budget=4096)
        base_worker = importlib.import_module(f"{vw.NIXL}.base_worker")
        meta = msgspec.msgpack.decode(p_worker.xfer_handshake_metadata.agent_metadata_bytes,
                                      type=base_worker.NixlAgentMetadata)
        assert meta.num_blocks == 0
        assert not any(getattr(meta, "region_num_blocks", None) or ())
        agent = d_worker.add_remote_agent(meta, 0, 1)
    assert agent


# ------------------------------------------- every armed check proves it inspected KV
# vLLM 0.33 stopped calling get_xfer_descs: the descriptor bounds check, hooked there
# alone, inspected 0 descriptors and said nothing, and the peer guard never pointed a
# contiguous-layout peer's list at its guard byte (NIXL_ERR_NOT_FOUND). Each check now
# counts what it inspected and refuses when armed and 0; here vLLM's calls go past the
# hooks, as on the next release that moves them.

@pytest.fixture
def split_env(kvcached_env):
    with kvcached_cpu.patches_applied("kvcached_alloc_mrv2", "nixl_layout", "nixl_registration"):
        yield


def register_split(vllm_config, *not_called: str):
    """kvcached's split layout (MRV2 allocation) registered by a worker whose vLLM code
    calls NIXL's ``not_called`` past kvcached-pd's hooks."""
    import kvcached.integration.vllm.model_runner_v2 as mrv2

    config = kv_cache_config_layer_outermost()
    layout = resolve_layout(vllm_config)
    with kvcached_cpu.fake_device():
        caches = mrv2.allocate_kv_cache(config, "cpu", layout)
    with vw.backend_lookup(vw.attention_backend("FLASH_ATTN")):
        worker = vw.make_worker(vllm_config, config)
        with vw.vllm_not_calling(worker, *not_called):
            worker.register_kv_caches(caches)
    return worker


def test_descriptor_check_that_saw_no_descriptor_stops_registration(split_env, vllm_config):
    """Local lists reach NIXL past both hooked methods: 0 descriptors checked, refused
    (before: logged as "0 local descriptors checked" and served)."""
    with pytest.raises(UnsupportedConfiguration, match="descriptor bounds check saw no"):
        register_split(vllm_config, "get_xfer_descs", "prep_xfer_dlist")


def test_descriptor_check_without_get_xfer_descs(split_env, vllm_config):
    """vLLM 0.33's lists never pass get_xfer_descs: they are checked in prep_xfer_dlist,
    every one of the budget's blocks counted once. Up to 0.32 vLLM builds them there
    and hands prep_xfer_dlist NIXL's list object, which nothing can read: going past
    get_xfer_descs on those releases is the case above, refused."""
    if vllm_release() < (0, 33):
        with pytest.raises(UnsupportedConfiguration, match="descriptor bounds check saw no"):
            register_split(vllm_config, "get_xfer_descs")
        return
    register_split(vllm_config, "get_xfer_descs")
    assert REGISTRY.registrations()[-1]["num_descs_checked"] == LAYERS * BUDGET


def test_registration_clip_that_saw_no_registration_stops_registration(split_env,
                                                                      vllm_config):
    """Registration reaches NIXL past get_reg_descs: nothing was clipped to the budget
    (NIXL registered kvcached's whole virtual pools), refused."""
    with pytest.raises(UnsupportedConfiguration, match="registration clip saw no"):
        register_split(vllm_config, "get_reg_descs")


def test_contiguous_guard_that_replaced_no_local_list_stops_registration(contiguous_env,
                                                                        vllm_config):
    """kvcached's contiguous layout: vLLM's local lists over the stand-ins reach NIXL
    unguarded; refused with the reason, NIXL's own error as its cause."""
    import kvcached.integration.vllm.model_runner_v2 as mrv2

    config = kv_cache_config_block_outermost()
    with kvcached_cpu.fake_device(total_memory=64 << 20, contiguous=True):
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

        caches = mrv2.allocate_kv_cache(
            config, "cpu", resolve_kv_cache_layout(vllm_config, [["BLNHC", "BLHNC"]]))
    with vw.backend_lookup(vw.attention_backend("FLASH_ATTN")):
        worker = vw.make_worker(vllm_config, config)
        with pytest.raises(UnsupportedConfiguration, match="guard that keeps its per-block"), \
                vw.vllm_not_calling(worker, "prep_xfer_dlist"), \
                nixl_kv_guard.registering_for_the_connector(None):
            worker.register_kv_caches(caches)


def test_peer_guard_that_replaced_no_remote_list_refuses_the_handshake(contiguous_env,
                                                                      vllm_config):
    """D's remote list for a contiguous-layout P (0 blocks) reaches NIXL unguarded:
    the handshake is refused saying that the peer guard did not run (before: NIXL's
    bare NIXL_ERR_NOT_FOUND, the symptom on vLLM 0.33)."""
    import importlib

    import msgspec

    with vw.backend_lookup(vw.attention_backend("FLASH_ATTN")):
        p_worker, _, _ = contiguous_worker(vllm_config, "p-contiguous")
        d_worker, _, _ = contiguous_worker(vllm_config, "d-contiguous")
        base_worker = importlib.import_module(f"{vw.NIXL}.base_worker")
        meta = msgspec.msgpack.decode(p_worker.xfer_handshake_metadata.agent_metadata_bytes,
                                      type=base_worker.NixlAgentMetadata)
        with pytest.raises(UnsupportedConfiguration, match="never pointed at the peer's"), \
                vw.vllm_not_calling(d_worker, "get_xfer_descs", "prep_xfer_dlist"):
            d_worker.add_remote_agent(meta, 0, 1)
