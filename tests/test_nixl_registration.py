"""The real vLLM NIXL worker registers only kvcached's physical budget.

Tensors come from kvcached's own ``alloc_kv_cache`` (its view-building code, run on
the CPU: tests/support/kvcached_cpu.py), so their block dimension is kvcached's
virtual capacity and, for vLLM <= 0.25's FlashAttention shape, K and V sit in two
separate halves. The worker is vLLM's real ``NixlConnectorWorker`` with a real NIXL
agent registering host memory; a spy records what it asked NIXL for.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from kvcached_pd import config
from kvcached_pd.errors import LayoutMismatch, UnsupportedConfiguration
from kvcached_pd.kv_spans import physical_spans
from kvcached_pd.patches import get_patch
from kvcached_pd.registry import REGISTRY
from kvcached_pd.versions import installed_version
from tests.conftest import vllm_release
from tests.support import kvcached_cpu
from tests.support import vllm_nixl_worker as vw

pytestmark = [
    pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched"),
    pytest.mark.skipif(vllm_release() >= (0, 29), reason="vLLM 0.29+: see test_nixl_registration_mrv2"),
]

BUDGET, BLOCK, HEADS, HEAD_DIM, LAYERS = 10, 16, 2, 64, 3
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
KV_BYTES_PER_BLOCK = 2 * BLOCK * HEADS * HEAD_DIM * 2  # K and V, fp16


@pytest.fixture(scope="module")
def vllm_config():
    model = vw.write_tiny_llama(tempfile.mkdtemp(), LAYERS, HEADS, HEAD_DIM)
    config = vw.make_vllm_config(model, block_size=BLOCK)
    vw.ensure_distributed(config)
    return config


@pytest.fixture
def patched(kvcached_env):
    kvcached_cpu.install_stand_ins()
    names = ("kvcached_alloc", "nixl_layout", "nixl_registration")
    for name in names:
        get_patch(name).patch()
    vw.forget_resolved_layout()
    REGISTRY.clear()
    yield
    for name in names:
        get_patch(name).unpatch()
    vw.forget_resolved_layout()
    REGISTRY.clear()


def kvcached_caches(backend, contiguous=False):
    shape = vw.vllm_kv_shape(backend, BUDGET, BLOCK, HEADS, HEAD_DIM)
    with kvcached_cpu.fake_device(contiguous=contiguous) as kvi:
        tensors = kvi.alloc_kv_cache(shape, BLOCK, torch.float16, "cpu", LAYERS)
    return dict(zip(LAYER_NAMES, tensors))


def register(vllm_config, backend, caches, worker_hook=None):
    kv_cache_config = vw.kv_cache_config(LAYER_NAMES, BUDGET, BLOCK, HEADS, HEAD_DIM)
    with vw.backend_lookup(backend):
        worker = vw.make_worker(vllm_config, kv_cache_config)
        if worker_hook:
            worker_hook(worker)
        with vw.record_nixl_calls(worker) as calls:
            worker.register_kv_caches(caches)
    return worker, calls


def blocks_first_over_split_half(backend_name: str) -> bool:
    """Which backends kvcached serves blocks-first, K and V in separate halves:
    Triton up to vLLM 0.25, and FlashAttention from 0.23 (K/V-first up to 0.22)
    until its packed shape of 0.26."""
    if vllm_release() >= (0, 26):
        return False
    return backend_name == "TRITON_ATTN" or vllm_release() >= (0, 23)


@pytest.mark.parametrize("backend_name", ["FLASH_ATTN", "TRITON_ATTN"])
def test_registers_exactly_the_physical_budget(patched, vllm_config, backend_name):
    backend = vw.attention_backend(backend_name)
    caches = kvcached_caches(backend)
    virtual_blocks = {REGISTRY.lookup(t).virtual_blocks for t in caches.values()}
    assert min(virtual_blocks) > 10 * BUDGET  # kvcached really over-reserves

    if blocks_first_over_split_half(backend_name):
        assert vw.vllm_kv_shape(backend, BUDGET, BLOCK, HEADS, HEAD_DIM)[:2] == (BUDGET, 2)
        with pytest.raises(LayoutMismatch, match="split-half") as error:
            register(vllm_config, backend, caches)
        assert f"vLLM {installed_version('vllm')}" in str(error.value)
        return

    worker, calls = register(vllm_config, backend, caches)

    # What NIXL registered: per layer, exactly the budget's bytes, at kvcached's
    # addresses (K and V halves separately where kvcached splits them).
    expected = []
    for t in caches.values():
        geometry = REGISTRY.lookup(t)
        expected += physical_spans(t.narrow(geometry.blocks_dim, 0, BUDGET))
    registered = sorted((a, a + n) for a, n, _ in calls.reg)
    assert registered == sorted(expected)
    assert sum(e - s for s, e in registered) == LAYERS * BUDGET * KV_BYTES_PER_BLOCK
    assert worker.num_blocks == BUDGET

    # What NIXL will move: one descriptor per block and region, inside the budget.
    descs = np.concatenate(calls.xfer)
    assert len(descs) == len(registered) * BUDGET
    for addr, length, _ in descs.tolist():
        assert any(s <= addr and addr + length <= e for s, e in registered)
    assert REGISTRY.registrations()[-1]["budget_blocks"] == BUDGET


@pytest.mark.parametrize("backend_name", ["FLASH_ATTN", "TRITON_ATTN"])
def test_why_blocks_first_over_split_half_is_refused(kvcached_env, vllm_config, backend_name):
    """The refusal above prevents a real corruption: handed kvcached's blocks-first
    split-half tensors (narrowed to the budget so its own check passes), vLLM's NIXL
    worker describes block i's K and V as the two halves of page i, which in
    kvcached's memory are the K of blocks 2i and 2i+1; no descriptor reaches a V block."""
    if not blocks_first_over_split_half(backend_name):
        pytest.skip(f"{backend_name} is not blocks-first over split-half memory here")
    kvcached_cpu.install_stand_ins()
    names = ("kvcached_alloc", "nixl_layout")  # not nixl_registration: vLLM alone
    for name in names:
        get_patch(name).patch()
    vw.forget_resolved_layout()
    REGISTRY.clear()
    try:
        backend = vw.attention_backend(backend_name)
        caches = kvcached_caches(backend)
        narrowed = {n: t.narrow(0, 0, BUDGET) for n, t in caches.items()}
        _, calls = register(vllm_config, backend, narrowed)
    finally:
        for name in names:
            get_patch(name).unpatch()
        vw.forget_resolved_layout()
        REGISTRY.clear()

    layer0 = narrowed[LAYER_NAMES[0]]
    elem = layer0.element_size()
    half = layer0[0, 0].numel() * elem  # one block's K (or V) bytes
    k_run = (layer0.data_ptr(), layer0.data_ptr() + layer0.stride(0) * elem * BUDGET * 2)
    v_starts = {layer0[i, 1].data_ptr() for i in range(BUDGET)}
    descs = [(a, n) for a, n, _ in np.concatenate(calls.xfer).tolist()
             if layer0.data_ptr() <= a < layer0[0, 1].data_ptr()]
    assert descs, "no descriptor of layer 0 recorded"
    assert all(k_run[0] <= a and a + n <= k_run[1] for a, n in descs)  # K bytes only
    assert not v_starts & {a for a, _ in descs}  # V is never moved
    assert (layer0[1, 0].data_ptr(), half) in descs  # block 0's "V" is block 1's K


def test_vllm_alone_refuses_kvcached_tensors(kvcached_env, vllm_config):
    """Without kvcached-pd, vLLM's own check rejects the virtual block dimension."""
    kvcached_cpu.install_stand_ins()
    backend = vw.attention_backend("FLASH_ATTN")
    caches = kvcached_caches(backend)
    with pytest.raises(AssertionError, match="number of"):
        register(vllm_config, backend, caches)


def test_tensor_kvcached_did_not_create_is_refused(patched, vllm_config):
    backend = vw.attention_backend("FLASH_ATTN")
    caches = kvcached_caches(backend)
    stranger = torch.zeros_like(next(iter(caches.values())))
    caches[LAYER_NAMES[0]] = stranger
    with pytest.raises(LayoutMismatch, match="not created by kvcached"):
        register(vllm_config, backend, caches)


def test_budget_disagreeing_with_kvcached_geometry_is_refused(patched, vllm_config):
    backend = vw.attention_backend("FLASH_ATTN")
    shape = vw.vllm_kv_shape(backend, BUDGET + 4, BLOCK, HEADS, HEAD_DIM)
    with kvcached_cpu.fake_device() as kvi:
        tensors = kvi.alloc_kv_cache(shape, BLOCK, torch.float16, "cpu", LAYERS)
    with pytest.raises(LayoutMismatch, match="created it for 14 blocks"):
        register(vllm_config, backend, dict(zip(LAYER_NAMES, tensors)))


@pytest.mark.parametrize("flag,value,error", [
    ("_has_mamba", True, "hybrid/mamba"),
    ("kv_cache_layout", "HND", "NHD only"),
])
def test_configurations_nixl_cannot_describe_are_refused(patched, vllm_config, flag, value, error):
    backend = vw.attention_backend("FLASH_ATTN")
    caches = kvcached_caches(backend)
    with pytest.raises(UnsupportedConfiguration, match=error):
        register(vllm_config, backend, caches, lambda w: setattr(w, flag, value))


def test_num_blocks_changed_by_another_patch_is_refused(patched, vllm_config):
    """kvcached 0.1.6's own patch raises num_blocks to the virtual count."""
    backend = vw.attention_backend("FLASH_ATTN")
    caches = kvcached_caches(backend)
    virtual = REGISTRY.lookup(next(iter(caches.values()))).virtual_blocks
    with pytest.raises(UnsupportedConfiguration, match="another patch changed it"):
        register(vllm_config, backend, caches, lambda w: setattr(w, "num_blocks", virtual))


def test_gate_closed_leaves_vllm_alone(patched, vllm_config, monkeypatch):
    monkeypatch.setenv("ENABLE_KVCACHED", "false")
    config.reset_settings_for_tests()  # settings are parsed once per process
    backend = vw.attention_backend("FLASH_ATTN")
    caches = kvcached_caches(backend)
    with pytest.raises(AssertionError, match="number of"):
        register(vllm_config, backend, caches)


@pytest.mark.parametrize("transport,reason", [
    ("staged", "vLLM's own NIXL connector registers it, not kvcached-pd's connector"),
    ("direct", "KVCACHED_PD_TRANSPORT=direct"),
])
def test_contiguous_layout_without_the_staged_transport_is_refused(
        patched, vllm_config, monkeypatch, transport, reason):
    """kvcached's contiguous layout: per-block descriptors would read other layers'
    bytes, so registration stops unless kvcached-pd's connector registers the caches of
    an engine it stages (here vLLM's own NixlConnector worker registers them: the
    connector_routing patch disabled, say). tests/test_connector_kvcached_layouts.py
    has the connector's side."""
    monkeypatch.setenv("KVCACHED_PD_TRANSPORT", transport)
    backend = vw.attention_backend("FLASH_ATTN")
    caches = kvcached_caches(backend, contiguous=True)
    assert all(REGISTRY.lookup(t).interleaves_layers for t in caches.values())
    with pytest.raises(UnsupportedConfiguration, match="only the staged transport") as error:
        register(vllm_config, backend, caches)
    assert reason in str(error.value) and "KVCACHED_CONTIGUOUS_LAYOUT=false" in str(error.value)


@pytest.mark.parametrize("blocks_dim", [0, 1])
def test_stand_ins_vllm_registers_cannot_be_packed_from(blocks_dim):
    """What vLLM is handed under the contiguous layout covers one block's memory (block
    axis second: stride 0 there) or one element per block (block axis first: stride 1
    there, 0 elsewhere, since vLLM 0.30 divides by a blocks-first view's stride(0)):
    should anything build the staged transport's views over it instead of the real
    caches, that fails loudly rather than packing a block's bytes for every block."""
    from kvcached_pd.nixl_kv_guard import make_guard
    from kvcached_pd.transport.layout import AttnCacheSpec, logical_kv_view

    shape = (BUDGET, HEADS, BLOCK, 2 * HEAD_DIM) if blocks_dim == 0 else \
        (2, BUDGET, BLOCK, HEADS, HEAD_DIM)
    real = {"l0": torch.zeros(shape)}
    stand_in = make_guard(real, {"l0": blocks_dim}).stand_ins["l0"]
    assert stand_in.shape == real["l0"].shape
    assert stand_in.stride(blocks_dim) == (1 if blocks_dim == 0 else 0)
    assert stand_in.stride(0) > 0  # vLLM 0.30 divides by it
    if blocks_dim == 0:  # one element per block, nowhere near the KV's size
        assert stand_in.untyped_storage().nbytes() == BUDGET * stand_in.element_size()
    with pytest.raises(ValueError, match="more than once"):
        logical_kv_view(stand_in, AttnCacheSpec(BLOCK, HEADS, HEAD_DIM))
