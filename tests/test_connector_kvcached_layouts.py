"""kvcached-pd's connector over kvcached's own KV tensors, in both of kvcached's layouts.

The caches come from kvcached's real allocator (``alloc_kv_cache``; from vLLM 0.29 its
model-runner-V2 ``allocate_kv_cache``), run on the CPU with stand-ins for its CUDA
module only (tests/support/kvcached_cpu.py), in the shape and layout this vLLM release
asks for. Each instance runs with the patches an operator's process has with kvcached
(geometry records, NIXL layout and registration), so the inner
``NixlConnector`` registers the caches as it would on a GPU, over real NIXL (UCX, host
memory):

- split-half (``KVCACHED_CONTIGUOUS_LAYOUT=false``): one reservation per layer; NIXL
  registers the physical budget and vLLM's per-block path can move it;
- contiguous (kvcached's default): compound block ``b`` holds every layer's block
  ``b``, so each layer's view has a block stride of layers x block bytes. NIXL
  registers none of it (``kvcached_pd/nixl_kv_guard.py``): only the staged path moves
  it; a per-block READ fails instead of moving other layers' bytes, and a peer without
  kvcached-pd cannot even handshake.

What is checked is bytes: each prompt token of each layer in D's blocks equals P's, and
the rest of D's cache is as it was.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from kvcached_pd import config, vllm_api
from kvcached_pd.connector.wire import PARAMS_KEY
from kvcached_pd.patches import get_patch
from kvcached_pd.registry import REGISTRY
from tests.conftest import vllm_release
from tests.support import connector_pd as pd
from tests.support import kvcached_cpu
from tests.support import vllm_nixl_worker as vw
from tests.test_connector_mixed import assert_same_kv, settled
from tests.test_connector_mixed import handoff as mixed_handoff

pytestmark = pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched")

# What an operator's process with kvcached applies before vLLM builds a connector (the
# routing aside: the instances here name kvcached-pd's connector directly).
PATCHES = ("kvcached_alloc", "kvcached_alloc_mrv2", "nixl_layout", "nixl_registration")
NUM_BLOCKS = 40
PROMPT = list(range(1, 76))  # 75 tokens: four full 16-token blocks and a partial one
MRV2 = vllm_release() >= (0, 29)  # kvcached allocates through vLLM's model runner V2
# vLLM 0.29+ refuses a peer of another KV layout in its own handshake
# (_validate_remote_agent_handshake: "Heterogeneous TP expects same kv_cache_layout"):
# kvcached's contiguous layout is BLNHC there, its split layout and vLLM's own memory
# LBNHC. The staged READ needs no such handshake; vLLM's notification to P does, so
# between such peers only D's DONE frees P's blocks, and a per-block push never starts
# (P's handshake with D fails first).
LAYOUTS_MUST_MATCH = MRV2
# vLLM 0.23-0.25's FlashAttention shape is blocks-first: over kvcached's split-half
# memory vLLM's registration would describe other blocks' K as V, so it is refused
# (tests/test_nixl_registration.py); only the contiguous layout starts there.
SPLIT_HALF_REFUSED = (0, 23) <= vllm_release() < (0, 26)


@pytest.fixture
def env(kvcached_env):
    """kvcached (CPU stand-ins) with kvcached-pd's patches and the staged transport."""
    kvcached_env.setenv("KVCACHED_PD_TRANSPORT", "staged")
    config.reset_settings_for_tests()
    kvcached_cpu.install_stand_ins()
    for name in PATCHES:
        get_patch(name).patch()
    REGISTRY.clear()
    try:
        with pd.cpu_vllm():
            yield kvcached_env
    finally:
        for name in reversed(PATCHES):
            get_patch(name).unpatch()
        vw.forget_resolved_layout()
        REGISTRY.clear()


def instance_env(env, kvcached: bool = True, transport: str = "staged") -> None:
    """This process's settings as one instance would read them: each vLLM instance is
    its own process with its own environment, and settings are parsed once per
    process. A plain side (no kvcached) is told NHD, as a mixed fleet must agree on it."""
    env.setenv("ENABLE_KVCACHED", "true" if kvcached else "false")
    env.setenv("KVCACHED_PD", "1")
    env.setenv("KVCACHED_PD_TRANSPORT", transport)
    if kvcached:
        env.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        env.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    config.reset_settings_for_tests()


def kvcached_caches(block_size: int, contiguous: bool, seed: int):
    """A builder of what kvcached's patched model runner hands vLLM for the tiny model,
    filled with random values over the whole virtual tensor (a stray write shows)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    def build(vllm_config) -> list[torch.Tensor]:
        with kvcached_cpu.fake_device(contiguous=contiguous) as kvi:
            if MRV2:
                import kvcached.integration.vllm.model_runner_v2 as mrv2

                spec = FullAttentionSpec(block_size=block_size, num_kv_heads=pd.HEADS,
                                         head_size=pd.HEAD_DIM, dtype=torch.float16)
                layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
                caches = list(mrv2.allocate_kv_cache(
                    _mrv2_kv_cache_config(spec, contiguous), "cpu", layout).values())
            else:
                shape = vw.vllm_kv_shape(vw.attention_backend("FLASH_ATTN"), NUM_BLOCKS,
                                         block_size, pd.HEADS, pd.HEAD_DIM)
                caches = kvi.alloc_kv_cache(shape, block_size, torch.float16, "cpu",
                                            pd.LAYERS)
        gen = torch.Generator().manual_seed(seed)
        for cache in caches:
            cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
        return caches

    return build


def _mrv2_kv_cache_config(spec, contiguous: bool):
    """The KV-cache config vLLM's model runner V2 hands kvcached: one backing for all
    layers, each layer's blocks together (split) or every layer's block ``b`` in one
    compound page (contiguous: a block stride of layers x page)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    page = spec.page_size_bytes
    size = NUM_BLOCKS * pd.LAYERS * page
    tensor = (KVCacheTensor(size=size, layers=list(pd.LAYER_NAMES), layer_stride=page,
                            block_stride=pd.LAYERS * page) if contiguous else
              KVCacheTensor(size=size, layers=list(pd.LAYER_NAMES),
                            layer_stride=NUM_BLOCKS * page, block_stride=page))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(list(pd.LAYER_NAMES), spec)])


def kvcached_engine(name: str, role: str, contiguous: bool, seed: int, block_size: int = 16,
                    **kwargs) -> pd.Engine:
    if not contiguous and SPLIT_HALF_REFUSED:
        pytest.skip("vLLM 0.23-0.25 refuse kvcached's split-half memory behind "
                    "FlashAttention's blocks-first shape")
    # kvcached's layout patch (vLLM 0.29+) reports the layouts its memory can back
    layouts = ("BLNHC", "BLHNC") if contiguous else ("LBNHC", "LBHNC")
    make = functools.partial(pd.make_engine, name, role, block_size=block_size,
                             num_blocks=NUM_BLOCKS, seed=seed, kv_layouts=layouts,
                             caches=kvcached_caches(block_size, contiguous, seed), **kwargs)
    return make()


@contextlib.contextmanager
def without_kvcached_pd(env, restore: bool = True):
    """A plain vLLM instance: none of kvcached-pd's patches and no kvcached, while it is
    built (and, ``restore=False``, for the rest of the test: a hook left in place would
    run in this instance's calls too, all instances sharing one process here)."""
    for name in reversed(PATCHES):
        get_patch(name).unpatch()
    instance_env(env, kvcached=False)
    env.setenv("KVCACHED_PD", "0")
    config.reset_settings_for_tests()
    try:
        yield
    finally:
        if restore:
            for name in PATCHES:
                get_patch(name).patch()


def block_stride_in_blocks(cache: torch.Tensor) -> float:
    """Distance between two consecutive blocks of this layer, in this layer's blocks:
    the number of layers with the contiguous layout, else 1 (split-half: 1/2, each of
    the K and V halves holding one half of a block)."""
    geometry = REGISTRY.lookup(cache)
    return geometry.block_stride_bytes / geometry.block_bytes


def changed_blocks(engine: pd.Engine, before: list[torch.Tensor]) -> set[int]:
    """Block ids whose K or V differs from ``before`` (copies of the caches) in any layer."""
    from kvcached_pd.transport.layout import AttnCacheSpec, logical_kv_view

    spec = AttnCacheSpec(engine.block_size, pd.HEADS, pd.HEAD_DIM)
    changed: set[int] = set()
    for cache, old in zip(engine.caches, before):
        now, was = logical_kv_view(cache, spec), logical_kv_view(old, spec)
        diff = (now != was).flatten(2).any(dim=2).any(dim=0)  # per block
        changed.update(int(b) for b in diff.nonzero().flatten())
    return changed


def freed_on_done(p: pd.Engine, req_id: str) -> bool:
    """P's blocks of ``req_id`` were freed by the staged path on D's DONE (the inner
    connector's notification or lease would have reported it itself)."""
    return p.worker._prefill_worker.reported_early(req_id)


# ------------------------------------------------------------ the staged handoff
@pytest.mark.parametrize("p_contiguous,d_contiguous,d_block_size", [
    (False, False, 16), (True, True, 16), (True, False, 16), (False, True, 16),
    (True, True, 32),
])
def test_staged_handoff_over_kvcached_moves_every_prompt_token(
        env, p_contiguous, d_contiguous, d_block_size):
    """Either layout on either side, and P 16 -> D 32: P packs through its strided views,
    D unpacks through its own, every prompt token arrives and no other block of D's
    changes (a view with the wrong block or layer stride would move other layers'
    bytes, and the contiguous layout's blocks are layers x block bytes apart)."""
    p = kvcached_engine("p", "kv_producer", p_contiguous, seed=1)
    d = kvcached_engine("d", "kv_consumer", d_contiguous, seed=2, block_size=d_block_size)
    for engine, contiguous in ((p, p_contiguous), (d, d_contiguous)):
        stride = block_stride_in_blocks(engine.caches[0])
        assert stride == pd.LAYERS if contiguous else stride <= 1  # the layout under test
    before = [c.clone() for c in d.caches]
    params, want, got = mixed_handoff(p, d, "r1", PROMPT)
    assert PARAMS_KEY in params, "P did not stage the request"
    assert_same_kv(want, got, len(PROMPT))
    assert not d.connector._decode.refused_peers, "the request left the staged path"
    # the harness's forward writes nothing: only the request's blocks changed on D
    assert len(changed_blocks(d, before)) == -(-len(PROMPT) // d_block_size)
    # well inside P's 30 s lease, whether vLLM could notify P (same block size and, on
    # 0.29+, the same layout) or not
    assert settled(p, d)
    if d_block_size != 16 or (LAYOUTS_MUST_MATCH and p_contiguous != d_contiguous):
        assert freed_on_done(p, "r1")


# --------------------------------------------- kvcached's contiguous layout: the guards
def load(p: pd.Engine, d: pd.Engine, req_id: str) -> dict:
    """P prefills; D is handed P's params and steps until its request is finished (here:
    its load failed); P's params."""
    p.sched.add_request(pd.prefill_request(req_id, PROMPT))
    assert pd.run([p], lambda: req_id in p.outputs)
    params = p.outputs[req_id].kv_transfer_params
    d.sched.add_request(pd.decode_request("d-" + req_id, PROMPT, params))
    assert pd.run([p, d], lambda: "d-" + req_id in d.outputs
                  and d.outputs["d-" + req_id].finished), "D never finished the request"
    return params


@pytest.mark.parametrize("contiguous_side", ["p", "d"])
def test_per_block_read_involving_the_contiguous_layout_fails_instead_of_moving_wrong_bytes(
        env, contiguous_side):
    """The contiguous side's KV is not registered with NIXL: a request the staged path
    does not carry (here the other side runs the direct transport) takes vLLM's
    per-block READ, which NIXL refuses; vLLM's failure path reports it and not one byte
    of D's cache changes."""
    p_contiguous = contiguous_side == "p"
    if not p_contiguous:
        instance_env(env, transport="direct")
    p = kvcached_engine("p", "kv_producer", p_contiguous, seed=3)
    instance_env(env, transport="direct" if p_contiguous else "staged")
    d = kvcached_engine("d", "kv_consumer", not p_contiguous, seed=4)
    before = [c.clone() for c in d.caches]
    params = load(p, d, "r1")
    assert (PARAMS_KEY in params) is p_contiguous  # a direct-transport P stages nothing
    # on 0.29+ vLLM's handshake refuses the other KV layout before the READ (see
    # LAYOUTS_MUST_MATCH); 0.31+ counts that in its own series
    failure = vllm_api.current().failed_handshake_stat if LAYOUTS_MUST_MATCH \
        else "num_failed_transfers"
    assert d.series(failure) == [1], f"vLLM saw no failure ({failure})"
    assert not changed_blocks(d, before), "a per-block READ moved bytes"


def test_a_peer_without_kvcached_pd_cannot_handshake_with_the_contiguous_layout(env):
    """vLLM alone prepares a descriptor for every block its peer advertises; a
    contiguous-layout P advertises none, so vLLM's own handshake fails and D's request
    fails without a READ: the direct path against that KV is refused before any byte."""
    p = kvcached_engine("p", "kv_producer", True, seed=5)
    with without_kvcached_pd(env, restore=False):
        d = pd.make_engine("d", "kv_consumer", seed=6, staged=False, num_blocks=NUM_BLOCKS)
    refused = []

    def add_remote_agent(real_add, *args, **kwargs):
        try:
            return real_add(*args, **kwargs)
        except Exception as exc:
            refused.append(exc)
            raise

    pd.wrap_method(d.worker.connector_worker, "add_remote_agent", add_remote_agent)
    before = [c.clone() for c in d.caches]
    load(p, d, "r1")
    assert refused, "vLLM's handshake accepted a peer that registered no KV"
    assert not changed_blocks(d, before)


# ------------------------------------------------------------------------ mixed fleets
@pytest.mark.parametrize("kvcached_side,contiguous", [
    ("p", False), ("p", True), ("d", False), ("d", True)])
def test_staged_handoff_between_kvcached_and_ordinary_kv_memory(env, kvcached_side,
                                                                 contiguous):
    """Both instances run kvcached-pd, one of them without kvcached (vLLM's own KV
    allocation): the packed format does not depend on either side's memory, so the
    request is staged and arrives exactly."""
    engines = {}
    for side, seed in (("p", 7), ("d", 8)):
        role = "kv_producer" if side == "p" else "kv_consumer"
        if side == kvcached_side:
            instance_env(env)
            engines[side] = kvcached_engine(side, role, contiguous, seed=seed)
        else:
            instance_env(env, kvcached=False)
            engines[side] = pd.make_engine(side, role, seed=seed, num_blocks=NUM_BLOCKS)
    p, d = engines["p"], engines["d"]
    params, want, got = mixed_handoff(p, d, "r1", PROMPT)
    assert PARAMS_KEY in params and not d.connector._decode.refused_peers
    assert_same_kv(want, got, len(PROMPT))
    # well inside P's 30 s lease, also between two KV layouts (kvcached's contiguous
    # layout against vLLM's own memory on 0.29+), where vLLM cannot notify P
    assert settled(p, d)
    if LAYOUTS_MUST_MATCH and contiguous:
        assert freed_on_done(p, "r1")


@pytest.mark.parametrize("kvcached_side", ["p", "d"])
def test_a_plain_vllm_peer_moves_kvcached_kv_by_the_physical_budget(env, kvcached_side):
    """kvcached-pd on kvcached's split-half memory, vLLM alone on the other side: vLLM's
    per-block READ serves, over the physical budget NIXL registered for kvcached's
    tensors (not the virtual reservation), and moves every token exactly."""
    if kvcached_side == "p":
        p = kvcached_engine("p", "kv_producer", False, seed=9)
        with without_kvcached_pd(env):
            d = pd.make_engine("d", "kv_consumer", seed=10, staged=False, num_blocks=NUM_BLOCKS)
    else:
        with without_kvcached_pd(env):
            p = pd.make_engine("p", "kv_producer", seed=9, staged=False, num_blocks=NUM_BLOCKS)
        instance_env(env)
        d = kvcached_engine("d", "kv_consumer", False, seed=10)
    registration = REGISTRY.registrations()[-1]
    assert registration["registered_bytes"] == pd.LAYERS * NUM_BLOCKS * block_bytes()
    assert registration["virtual_blocks"] > NUM_BLOCKS
    params, want, got = mixed_handoff(p, d, "r1", PROMPT)
    assert (PARAMS_KEY in params) is (kvcached_side == "p")  # offered, not taken
    assert_same_kv(want, got, len(PROMPT))
    assert settled(p, d)


def block_bytes(block_size: int = 16) -> int:
    """One layer's K and V of one block of the tiny model, fp16."""
    return 2 * block_size * pd.HEADS * pd.HEAD_DIM * 2


# ------------------------------------------------------------------------- push mode
PUSH = "NixlPushConnector"


@pytest.fixture
def push(env):
    """Push mode (vLLM 0.24+); each test's instances are shut down (writer threads)."""
    from kvcached_pd import vllm_api

    if vllm_api.current().push_name != PUSH:
        pytest.skip("vLLM has push mode (NixlPushConnector) from 0.24 on")
    live: list[pd.Engine] = []
    yield live
    for engine in live:
        engine.worker.shutdown()


@pytest.mark.parametrize("p_contiguous,d_contiguous", [(True, True), (False, True),
                                                       (True, False)])
def test_staged_push_over_kvcached_moves_every_prompt_token(env, push, p_contiguous,
                                                            d_contiguous):
    """Push mode reads the extent as pull mode does; D takes the request out of vLLM's
    push flow, so P never WRITEs into D's kvcached memory."""
    p = kvcached_engine("p", "kv_producer", p_contiguous, seed=11, inner=PUSH)
    push.append(p)
    d = kvcached_engine("d", "kv_consumer", d_contiguous, seed=12, inner=PUSH)
    push.append(d)
    before = [c.clone() for c in d.caches]
    # D's request has P's id, as a push-mode proxy sends it
    params, want, got = mixed_handoff(p, d, "r1", PROMPT, d_prefix="")
    assert PARAMS_KEY in params and not d.connector._decode.refused_peers
    assert_same_kv(want, got, len(PROMPT))
    assert len(changed_blocks(d, before)) == -(-len(PROMPT) // 16)
    assert settled(p, d)


@pytest.mark.parametrize("contiguous_side", ["p", "d"])
def test_per_block_push_involving_the_contiguous_layout_fails_instead_of_writing_wrong_bytes(
        env, push, contiguous_side, caplog):
    """A request the staged path does not carry takes vLLM's per-block WRITE from P into
    D: with kvcached's contiguous layout on either side NIXL refuses it (P's writer
    reports a failed transfer) and D's cache keeps every byte."""
    p_contiguous = contiguous_side == "p"
    if not p_contiguous:
        instance_env(env, transport="direct")
    p = kvcached_engine("p", "kv_producer", p_contiguous, seed=13, inner=PUSH)
    push.append(p)
    instance_env(env, transport="direct" if p_contiguous else "staged")
    d = kvcached_engine("d", "kv_consumer", not p_contiguous, seed=14, inner=PUSH)
    push.append(d)
    before = [c.clone() for c in d.caches]
    p.sched.add_request(pd.prefill_request("r1", PROMPT))
    assert pd.run([p], lambda: "r1" in p.outputs)
    d.sched.add_request(pd.decode_request("r1", PROMPT, p.outputs["r1"].kv_transfer_params))
    if LAYOUTS_MUST_MATCH:  # vLLM refuses the peer before any WRITE (see the constant)
        # D's registration (D -> P) or P's writer (P -> D) meets the refusal first
        assert pd.run([p, d], lambda: any(
            f in r.getMessage() for r in caplog.records
            for f in ("push_handshake_failed", "push_reg_handshake_failed")),
            timeout_s=30), "vLLM's push handshake between two KV layouts did not fail"
    else:
        assert pd.run([p, d], lambda: p.series("num_failed_transfers"), timeout_s=30), \
            "P's writer reported no failed WRITE"
        assert p.series("num_failed_transfers") == [1]
    assert not changed_blocks(d, before), "a per-block WRITE moved bytes"
