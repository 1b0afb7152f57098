"""A prefill worker and a decode worker move a request's KV over real NIXL, on the CPU.

Both are vLLM's real pull-mode ``NixlConnectorWorker`` with real NIXL agents (UCX,
host memory) in one process, over KV tensors from kvcached's real ``alloc_kv_cache``
(virtual block dimension, vLLM 0.26's packed K|V layout). The handshake is vLLM's
``add_remote_agent`` fed with P's own published metadata; the transfer is driven by
vLLM's ``start_load_kv`` / ``get_finished``. What is checked is the bytes: after the
handoff, every token of the prompt in D's blocks equals P's, whichever data path.

- direct: vLLM's per-block descriptors over the physical budget (the registration
  patch's product), remote side = P's kvcached tensors;
- staged: P packs into its staging, D READs the extent and unpacks (the staged
  transport), including P and D with different block sizes;
- fallback: D has no staging peer and silently takes the direct path;
- kvcached's contiguous layout (its default; every layer's block ``b`` in one compound
  page) on either side: staged handoffs stay byte-exact, while NIXL holds none of that
  KV, so a direct READ against it fails instead of moving another layer's bytes.
"""

from __future__ import annotations

import tempfile
import time

import pytest
import torch

from kvcached_pd import config as kvcached_pd_config
from kvcached_pd.patches import get_patch
from kvcached_pd.patches.staged_transport import worker_staging
from kvcached_pd.registry import REGISTRY, direct_path_safe, peer_direct_path_safe
from tests.conftest import vllm_release
from tests.support import kvcached_cpu
from tests.support import vllm_nixl_worker as vw

pytestmark = [
    pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched"),
    pytest.mark.skipif(not (0, 24) <= vllm_release() < (0, 29),
                       reason="staged transport hooks target vLLM 0.24-0.28"),
]

HEADS, HEAD_DIM, LAYERS, BUDGET = 2, 64, 3, 12
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PATCHES = ("kvcached_alloc", "nixl_layout", "nixl_registration", "push_prefix_alignment",
           "staged_transport", "connector_metrics")


@pytest.fixture
def staged_env(kvcached_env):
    yield from staged_patches(kvcached_env)


def staged_patches(env):
    """kvcached (CPU stand-ins) with every patch the staged transport runs with.

    These tests drive vLLM's NixlConnector workers directly through the staged hooks;
    routing pull mode to kvcached-pd's connector is off (``KVCACHED_PD_DISABLE``), as an
    operator who keeps the hook path on vLLM 0.24-0.28 would run. The connector has
    its own tests (tests/test_connector_pd.py)."""
    env.setenv("KVCACHED_PD_TRANSPORT", "staged")
    env.setenv("KVCACHED_PD_DISABLE", "connector_routing")
    env.setenv("KVCACHED_PD_STAGING_MB", "4")
    kvcached_cpu.install_stand_ins()
    for name in PATCHES:
        get_patch(name).patch()
    vw.forget_resolved_layout()
    REGISTRY.clear()
    yield env
    for name in reversed(PATCHES):
        get_patch(name).unpatch()
    vw.forget_resolved_layout()
    REGISTRY.clear()


def plain_vllm_caches(block_size: int) -> list[torch.Tensor]:
    """What vLLM 0.26 allocates without kvcached: (N, H, bs, 2D) over NHD memory."""
    return [torch.empty(BUDGET, block_size, HEADS, 2 * HEAD_DIM, dtype=torch.float16)
            .permute(0, 2, 1, 3) for _ in range(LAYERS)]


def make_side(block_size: int, seed: int, kvcached: bool = True, env=None, push: bool = False,
              contiguous: bool = False, backend_name: str = "FLASH_ATTN"):
    """One instance's worker. ``env`` (a monkeypatch) switches this process's gates to
    what that instance would run with: each vLLM instance is its own process.
    ``contiguous``: kvcached's contiguous layout (its default) instead of split-half."""
    if env is not None:
        if kvcached:
            env.setenv("ENABLE_KVCACHED", "true")
            env.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
        else:  # plain vLLM with kvcached-pd; a mixed fleet agrees on NHD
            env.setenv("ENABLE_KVCACHED", "false")
            env.setenv("KVCACHED_PD", "1")
            env.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
        vw.forget_resolved_layout()
        kvcached_pd_config.reset_settings_for_tests()  # settings are parsed once per process
    model = vw.write_tiny_llama(tempfile.mkdtemp(), LAYERS, HEADS, HEAD_DIM)
    config = vw.make_vllm_config(model, block_size=block_size,
                                 connector="NixlPushConnector" if push else "NixlConnector")
    vw.ensure_distributed(config)
    backend = vw.attention_backend(backend_name)
    shape = vw.vllm_kv_shape(backend, BUDGET, block_size, HEADS, HEAD_DIM)
    if kvcached:
        with kvcached_cpu.fake_device(contiguous=contiguous) as kvi:
            tensors = kvi.alloc_kv_cache(shape, block_size, torch.float16, "cpu", LAYERS)
    else:
        tensors = plain_vllm_caches(block_size)
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:  # fill the whole virtual tensor: stray reads would show up
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
    kv_cache_config = vw.kv_cache_config(LAYER_NAMES, BUDGET, block_size, HEADS, HEAD_DIM)
    with vw.backend_lookup(backend):
        worker = vw.make_worker(config, kv_cache_config, push=push, engine_id=f"engine-{seed}")
        worker.register_kv_caches(dict(zip(LAYER_NAMES, tensors)))
    return worker, tensors, backend


def handshake(d_worker, p_worker, backend):
    """What vLLM's _nixl_handshake does with P's payload, minus the socket."""
    import importlib

    import msgspec

    base_worker = importlib.import_module(f"{vw.NIXL}.base_worker")
    meta = msgspec.msgpack.decode(p_worker.xfer_handshake_metadata.agent_metadata_bytes,
                                  type=base_worker.NixlAgentMetadata)
    with vw.backend_lookup(backend):
        agent = d_worker.add_remote_agent(meta, 0, 1)
    d_worker._remote_agents[meta.engine_id] = {(0, 0): agent}
    return meta


def tokens(tensors, block_ids, block_size, num_tokens):
    """(layer, K|V, token, head, dim) content of the first num_tokens tokens of a
    request, whatever the backend's cache shape."""
    from kvcached_pd.transport.layout import AttnCacheSpec, logical_kv_view

    spec = AttnCacheSpec(block_size, HEADS, HEAD_DIM)
    return torch.stack([logical_kv_view(t, spec)[:, block_ids].flatten(1, 2)[:, :num_tokens]
                        for t in tensors])


def start_transfer(p_worker, d_worker, p_block_ids, d_block_ids, staged_info, p_block_size):
    """P packs (staged), D gets the request in its metadata and posts the READ."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    from kvcached_pd.transport.staged import pack_for_requests

    if staged_info is not None:
        pack_for_requests(p_worker, worker_staging(p_worker),
                          {"req-1": {"block_ids": p_block_ids, **staged_info}})
    params = {
        "remote_block_ids": [p_block_ids], "remote_engine_id": p_worker.engine_id,
        "remote_request_id": "req-1", "remote_host": "127.0.0.1", "remote_port": 0,
        "remote_block_size": p_block_size,
    }
    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv(request_id="req-1", local_block_ids=[d_block_ids],
                             kv_transfer_params=params)
    meta.kvcached_pd_recv = {"req-1": staged_info} if staged_info else {}
    d_worker.start_load_kv(meta)


def run_transfer(p_worker, d_worker, p_block_ids, d_block_ids, num_tokens, staged_info,
                 p_block_size):
    start_transfer(p_worker, d_worker, p_block_ids, d_block_ids, staged_info, p_block_size)
    deadline = time.time() + 60
    done_recv, done_send = set(), set()
    while time.time() < deadline and not ("req-1" in done_recv and "req-1" in done_send):
        p_worker._reqs_to_send["req-1"] = time.perf_counter() + 60
        p_worker._reqs_to_process.add("req-1")
        _, recv = d_worker.get_finished()
        send, _ = p_worker.get_finished()
        done_recv |= set(recv or ())
        done_send |= set(send or ())
        time.sleep(0.01)
    assert "req-1" in done_recv, "decode never finished receiving"
    assert "req-1" in done_send, "prefill never got decode's completion notification"


def staged_order(p_worker, n_blocks, block_size, num_tokens):
    st = worker_staging(p_worker)
    n_tok_slots = n_blocks * block_size
    nbytes = st.fmt.extent_bytes(n_tok_slots)
    return {"offset": 8192, "nbytes": nbytes, "n_tok_slots": n_tok_slots,
            "num_tokens": num_tokens, "format": st.fmt.to_dict()}


@pytest.mark.parametrize("p_bs,d_bs,num_tokens", [(16, 16, 75), (16, 32, 75), (16, 32, 64)])
def test_staged_handoff_moves_every_prompt_token(staged_env, p_bs, d_bs, num_tokens):
    if p_bs != d_bs and vllm_release() >= (0, 28):
        pytest.skip("vLLM 0.28's own post-processing of smaller remote blocks copies block "
                    "ids through pinned host memory, which needs a CUDA device")
    p_worker, p_tensors, backend = make_side(p_bs, seed=1)
    d_worker, d_tensors, _ = make_side(d_bs, seed=2)
    meta = handshake(d_worker, p_worker, backend)
    # staging offered in the handshake: kv_both holds a prefill and a decode range
    assert meta.kvcached_pd_staged["nbytes"] == 2 * (4 << 20)
    p_ids = [7, 2, 9, 4, 0][: -(-num_tokens // p_bs)]
    d_ids = [3, 10, 5, 1, 8][: -(-num_tokens // d_bs)]
    untouched = [t[[b for b in range(BUDGET) if b not in d_ids]].clone() for t in d_tensors]
    info = staged_order(p_worker, len(p_ids), p_bs, num_tokens)
    run_transfer(p_worker, d_worker, p_ids, d_ids, num_tokens, info, p_bs)
    assert torch.equal(tokens(d_tensors, d_ids, d_bs, num_tokens),
                       tokens(p_tensors, p_ids, p_bs, num_tokens))
    for t, before in zip(d_tensors, untouched):
        assert torch.equal(t[[b for b in range(BUDGET) if b not in d_ids]], before)
    st = worker_staging(d_worker)
    assert st.stats["reads"] == 1 and st.stats["fallbacks"] == 0
    assert st.buffer.allocator.num_live == 0  # D's extent returned after the unpack
    # the staged READ went through vLLM's own NIXL telemetry: one transfer, 1 descriptor
    assert d_worker.xfer_stats.data["num_descriptors"] == [1]
    assert len(d_worker.xfer_stats.data["kvcached_pd_handoff_duration"]) == 1
    assert len(p_worker.xfer_stats.data["kvcached_pd_pack_duration"]) == 1
    # D's staging gauge: sampled on every change, so it rose and came back to zero
    gauge = d_worker.xfer_stats.data["kvcached_pd_decode_staging_bytes"]
    assert max(gauge) >= info["nbytes"] and gauge[-1] == 0


@pytest.mark.parametrize("path,p_bs,d_bs,cached", [
    ("staged", 16, 16, 2), ("direct", 16, 16, 2), ("staged", 16, 32, 1),
])
def test_decode_prefix_cache_hit_receives_only_the_rest(staged_env, path, p_bs, d_bs, cached):
    """D already holds the prompt's first blocks (its own prefix cache) and lists only
    the new ones: the staged path puts the extent's later tokens there, as vLLM's
    direct path (READ of P's last blocks) does, and leaves D's cached blocks alone."""
    if p_bs != d_bs and vllm_release() >= (0, 28):
        pytest.skip("vLLM 0.28's post-processing of smaller remote blocks needs CUDA")
    num_tokens = 75
    p_worker, p_tensors, backend = make_side(p_bs, seed=31)
    d_worker, d_tensors, _ = make_side(d_bs, seed=32)
    handshake(d_worker, p_worker, backend)
    p_ids = [7, 2, 9, 4, 0][: -(-num_tokens // p_bs)]
    d_all = [3, 10, 5, 1, 8][: -(-num_tokens // d_bs)]
    d_new = d_all[cached:]
    first = cached * d_bs
    held = [t[d_all[:cached]].clone() for t in d_tensors]
    info = staged_order(p_worker, len(p_ids), p_bs, num_tokens) if path == "staged" else None
    run_transfer(p_worker, d_worker, p_ids, d_new, num_tokens, info, p_bs)
    assert torch.equal(tokens(d_tensors, d_all, d_bs, num_tokens)[:, first:],
                       tokens(p_tensors, p_ids, p_bs, num_tokens)[:, first:])
    for t, before in zip(d_tensors, held):
        assert torch.equal(t[d_all[:cached]], before)
    st = worker_staging(d_worker)
    assert st.stats["reads"] == (1 if path == "staged" else 0) and st.stats["fallbacks"] == 0
    assert st.buffer.allocator.num_live == 0


def test_decode_sees_an_imminent_read_done_in_the_same_step(staged_env, caplog):
    """With a spin budget, the first get_finished after posting a small READ reports it
    (no extra engine step); the trace shows every event of the handoff, in order."""
    import logging

    from kvcached_pd.transport import trace

    staged_env.setenv("KVCACHED_PD_READ_SPIN_US", "20000")
    kvcached_pd_config.reset_settings_for_tests()  # settings are parsed once
    staged_env.setenv("KVCACHED_PD_TRACE", "1")
    trace.reset()
    caplog.set_level(logging.INFO, logger="kvcached_pd")
    try:
        p_worker, p_tensors, backend = make_side(16, seed=21)
        d_worker, d_tensors, _ = make_side(16, seed=22)
        handshake(d_worker, p_worker, backend)
        assert worker_staging(d_worker).read_spin_s == 0.02  # the setting reached D
        # A loaded CI machine's in-process UCX READ can take longer than the 20 ms the
        # setting allows; what is tested is that D waits within the step, not how fast
        # UCX is, so the budget here is generous.
        worker_staging(d_worker).read_spin_s = 10.0
        p_ids, d_ids = [4, 8, 1], [9, 0, 6]
        info = staged_order(p_worker, len(p_ids), 16, 40)
        start_transfer(p_worker, d_worker, p_ids, d_ids, info, 16)
        _, recv = d_worker.get_finished()
    finally:
        trace.reset()
    assert set(recv or ()) == {"req-1"}
    assert torch.equal(tokens(d_tensors, d_ids, 16, 40), tokens(p_tensors, p_ids, 16, 40))
    assert worker_staging(d_worker).stats["spin_s"] > 0
    events = [e for e in (trace.parse_line(r.getMessage()) for r in caplog.records) if e]
    names = [e["ev"] for e in events]
    assert names[:3] == ["packed", "read_posted", "read_done"], names
    done = events[2]
    assert done["req"] == "req-1" and done["bytes"] == info["nbytes"]
    # the wait happened inside the READ's post-to-seen interval (no wall-clock bounds:
    # how long UCX takes is not the test's business)
    assert done["spin_ms"] > 0 and done["seen_ms"] >= done["spin_ms"]
    assert events[0]["device_ms"] >= 0 and events[1]["descs"] == 1


def test_no_spin_budget_leaves_polling_to_vllm(staged_env):
    staged_env.setenv("KVCACHED_PD_READ_SPIN_US", "0")
    kvcached_pd_config.reset_settings_for_tests()  # settings are parsed once
    p_worker, p_tensors, backend = make_side(16, seed=23)
    d_worker, d_tensors, _ = make_side(16, seed=24)
    handshake(d_worker, p_worker, backend)
    run_transfer(p_worker, d_worker, [3, 5], [1, 2], 30, staged_order(p_worker, 2, 16, 30), 16)
    assert torch.equal(tokens(d_tensors, [1, 2], 16, 30), tokens(p_tensors, [3, 5], 16, 30))
    assert worker_staging(d_worker).stats["spin_s"] == 0


def test_a_staged_read_nixl_refuses_fails_the_request_and_frees_its_extent(staged_env,
                                                                          monkeypatch):
    """NIXL refuses to start the staged READ: vLLM's own failure path reports the request
    (its blocks invalid, so vLLM recomputes them) and D's extent comes back."""
    p_worker, _, backend = make_side(16, seed=35)
    d_worker, _, _ = make_side(16, seed=36)
    handshake(d_worker, p_worker, backend)

    def refuse(handle, *args, **kwargs):
        raise RuntimeError("NIXL_ERR_BACKEND (injected)")

    monkeypatch.setattr(d_worker.nixl_wrapper, "transfer", refuse)
    start_transfer(p_worker, d_worker, [1, 2], [3, 4], staged_order(p_worker, 2, 16, 30), 16)
    _, recv = d_worker.get_finished()
    st = worker_staging(d_worker)
    assert "req-1" in (recv or ()) and not st.pending
    assert st.buffer.allocator.num_live == 0
    assert d_worker.xfer_stats.data["num_failed_transfers"] == [1.0]


def test_direct_path_over_the_physical_budget(staged_env):
    p_worker, p_tensors, backend = make_side(16, seed=3)
    d_worker, d_tensors, _ = make_side(16, seed=4)
    handshake(d_worker, p_worker, backend)
    p_ids, d_ids = [5, 11, 0], [6, 1, 2]
    run_transfer(p_worker, d_worker, p_ids, d_ids, 40, None, 16)
    assert torch.equal(tokens(d_tensors, d_ids, 16, 40), tokens(p_tensors, p_ids, 16, 40))


def test_decode_without_staged_peer_falls_back_to_direct(staged_env):
    p_worker, p_tensors, backend = make_side(16, seed=5)
    d_worker, d_tensors, _ = make_side(16, seed=6)
    handshake(d_worker, p_worker, backend)
    worker_staging(d_worker).remote.clear()  # as if P ran without staging
    p_ids, d_ids = [1, 2], [9, 4]
    info = staged_order(p_worker, 2, 16, 30)
    run_transfer(p_worker, d_worker, p_ids, d_ids, 30, info, 16)
    assert torch.equal(tokens(d_tensors, d_ids, 16, 30), tokens(p_tensors, p_ids, 16, 30))
    assert worker_staging(d_worker).stats["fallbacks"] == 1


def test_prefill_blocks_larger_than_decode_blocks_are_refused_by_vllm_handshake(staged_env):
    """vLLM's own handshake check rejects P blocks larger than D's before any data path
    is chosen; the staged format would not need it, but the direct fallback does."""
    p_worker, _, backend = make_side(32, seed=7)
    d_worker, _, _ = make_side(16, seed=8)
    with pytest.raises(AssertionError, match="block size"):
        handshake(d_worker, p_worker, backend)


def test_decode_staging_full_waits_then_reads_staged(staged_env):
    """No room on D: the read waits for an extent instead of taking the slow path."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    from kvcached_pd.transport.staged import pack_for_requests

    p_worker, p_tensors, backend = make_side(16, seed=9)
    d_worker, d_tensors, _ = make_side(16, seed=10)
    handshake(d_worker, p_worker, backend)
    st = worker_staging(d_worker)
    hog = st.buffer.alloc(st.buffer.allocator.capacity_bytes - 4096, "hog")
    p_ids, d_ids = [3, 4, 5], [0, 1, 2]
    info = staged_order(p_worker, 3, 16, 40)
    pack_for_requests(p_worker, worker_staging(p_worker), {"req-1": {"block_ids": p_ids, **info}})
    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv(request_id="req-1", local_block_ids=[d_ids], kv_transfer_params={
        "remote_block_ids": [p_ids], "remote_engine_id": p_worker.engine_id,
        "remote_request_id": "req-1", "remote_host": "127.0.0.1", "remote_port": 0})
    meta.kvcached_pd_recv = {"req-1": info}
    d_worker.start_load_kv(meta)
    for _ in range(5):
        _, recv = d_worker.get_finished()
        assert "req-1" not in (recv or ())
    assert "req-1" in st.waiting and st.stats["fallbacks"] == 0
    st.buffer.free(hog)
    deadline = time.time() + 60
    done = False
    while time.time() < deadline and not done:
        p_worker._reqs_to_send["req-1"] = time.perf_counter() + 60
        p_worker._reqs_to_process.add("req-1")
        _, recv = d_worker.get_finished()
        p_worker.get_finished()
        done = "req-1" in (recv or ())
        time.sleep(0.01)
    assert done and not st.waiting and st.stats["reads"] == 1 and st.stats["fallbacks"] == 0
    assert torch.equal(tokens(d_tensors, d_ids, 16, 40), tokens(p_tensors, p_ids, 16, 40))


@pytest.mark.parametrize("p_kvcached,d_kvcached", [(False, False), (True, False), (False, True)])
def test_staged_handoff_with_and_without_kvcached(staged_env, p_kvcached, d_kvcached):
    """The staged path serves plain vLLM too, and mixed pairs; kvcached's patches only
    touch kvcached's tensors (a plain side is registered by vLLM unchanged)."""
    p_worker, p_tensors, backend = make_side(16, seed=11, kvcached=p_kvcached, env=staged_env)
    d_worker, d_tensors, _ = make_side(16, seed=12, kvcached=d_kvcached, env=staged_env)
    handshake(d_worker, p_worker, backend)
    p_ids, d_ids = [2, 8, 5], [7, 0, 3]
    info = staged_order(p_worker, 3, 16, 33)
    run_transfer(p_worker, d_worker, p_ids, d_ids, 33, info, 16)
    assert torch.equal(tokens(d_tensors, d_ids, 16, 33), tokens(p_tensors, p_ids, 16, 33))
    assert worker_staging(d_worker).stats["reads"] == 1


def test_decode_extent_reservation_outcomes(staged_env):
    """The one decision both data paths make on D: an extent, wait, or not staged."""
    from kvcached_pd.transport.format import PackedFormat
    from kvcached_pd.transport.staged import reserve_decode_extent

    d_worker, _, _ = make_side(16, seed=37)
    st = worker_staging(d_worker)
    info = staged_order(d_worker, 3, 16, 40)
    extent, reason = reserve_decode_extent(d_worker, st, "a", info, False)
    assert extent is not None and reason is None and extent.nbytes >= info["nbytes"]
    other = PackedFormat.for_cache(LAYERS, HEADS + 1, HEAD_DIM, torch.float16).to_dict()
    extent_b, reason = reserve_decode_extent(d_worker, st, "b", {**info, "format": other}, False)
    assert extent_b is None and reason.startswith("packed formats differ")
    huge = {**info, "nbytes": st.buffer.allocator.capacity_bytes + 1}
    extent_c, reason = reserve_decode_extent(d_worker, st, "c", huge, False)
    assert extent_c is None and "exceed the decode staging region" in reason
    hog = st.buffer.alloc(st.buffer.allocator.free_bytes, "hog")
    assert hog is not None
    assert reserve_decode_extent(d_worker, st, "d", info, False) == (None, None)  # wait for room
    st.buffer.free(hog)
    st.buffer.free(extent)
    assert st.buffer.allocator.num_live == 0


# ----------------------------------------------- kvcached's contiguous layout (its default)
@pytest.mark.parametrize("p_contiguous,d_contiguous,p_bs,d_bs,backend_name", [
    (True, True, 16, 16, "FLASH_ATTN"), (True, True, 16, 32, "FLASH_ATTN"),
    (True, False, 16, 16, "FLASH_ATTN"), (False, True, 16, 16, "FLASH_ATTN"),
])
def test_staged_handoff_on_kvcached_contiguous_layout(staged_env, p_contiguous, d_contiguous,
                                                      p_bs, d_bs, backend_name):
    """Each layer's blocks are layers x block bytes apart there; the staged READ moves
    every prompt token byte for byte, and touches no other block of D's cache."""
    if p_bs != d_bs and vllm_release() >= (0, 28):
        pytest.skip("vLLM 0.28's post-processing of smaller remote blocks needs CUDA")
    p_worker, p_tensors, backend = make_side(p_bs, seed=61, contiguous=p_contiguous,
                                             backend_name=backend_name)
    d_worker, d_tensors, _ = make_side(d_bs, seed=62, contiguous=d_contiguous,
                                       backend_name=backend_name)
    handshake(d_worker, p_worker, backend)
    for worker, contiguous in ((p_worker, p_contiguous), (d_worker, d_contiguous)):
        assert direct_path_safe(worker) is not contiguous
        assert worker_staging(worker).layers.stacked is not None or not contiguous
    assert peer_direct_path_safe(d_worker, p_worker.engine_id) is not (p_contiguous or
                                                                        d_contiguous)
    num_tokens = 75
    p_ids = [7, 2, 9, 4, 0][: -(-num_tokens // p_bs)]
    d_ids = [3, 10, 5, 1, 8][: -(-num_tokens // d_bs)]
    whole = [t.clone() for t in d_tensors]
    run_transfer(p_worker, d_worker, p_ids, d_ids, num_tokens,
                 staged_order(p_worker, len(p_ids), p_bs, num_tokens), p_bs)
    assert torch.equal(tokens(d_tensors, d_ids, d_bs, num_tokens),
                       tokens(p_tensors, p_ids, p_bs, num_tokens))
    others = [b for b in range(d_tensors[0].shape[0]) if b not in d_ids]
    for t, before in zip(d_tensors, whole):
        assert torch.equal(t[others], before[others])
    st = worker_staging(d_worker)
    assert st.stats["reads"] == 1 and st.stats["fallbacks"] == 0
    assert st.buffer.allocator.num_live == 0


@pytest.mark.parametrize("p_contiguous,d_contiguous", [(True, False), (False, True), (True, True)])
def test_direct_read_involving_a_contiguous_layout_fails_instead_of_moving_wrong_bytes(
        staged_env, p_contiguous, d_contiguous):
    """vLLM's per-block READ (no staged info: the direct path) with kvcached's
    contiguous layout on either side: NIXL holds none of that KV, so vLLM's own failure
    path reports the request (its blocks to be recomputed) and D's cache is unchanged."""
    p_worker, _, backend = make_side(16, seed=63, contiguous=p_contiguous)
    d_worker, d_tensors, _ = make_side(16, seed=64, contiguous=d_contiguous)
    handshake(d_worker, p_worker, backend)
    for worker, contiguous in ((p_worker, p_contiguous), (d_worker, d_contiguous)):
        record = [r for r in REGISTRY.registrations() if r["engine_id"] == worker.engine_id][-1]
        assert (record["registered_bytes"] == 0) is contiguous
    # what the staged path asks before any direct fallback
    assert peer_direct_path_safe(d_worker, p_worker.engine_id) is False
    before = [t.clone() for t in d_tensors]
    start_transfer(p_worker, d_worker, [5, 11, 3], [6, 1, 2], None, 16)
    deadline, recv = time.time() + 30, set()
    while time.time() < deadline and "req-1" not in recv:
        _, done = d_worker.get_finished()
        recv |= set(done or ())
        time.sleep(0.01)
    assert "req-1" in recv  # reported, as vLLM reports a failed READ
    assert d_worker.xfer_stats.data["num_failed_transfers"] == [1.0]
    for t, b in zip(d_tensors, before):
        assert torch.equal(t, b)  # not one byte moved


def test_a_contiguous_layout_that_cannot_be_staged_fails_without_a_direct_attempt(
        staged_env, monkeypatch):
    """P packed the request, but D cannot stage it (here: P's handshake offered no
    staging). With kvcached's contiguous layout the direct path is not an option: the
    request fails through vLLM's failure path, and no per-block transfer is even tried."""
    p_worker, _, backend = make_side(16, seed=66, contiguous=True)
    d_worker, d_tensors, _ = make_side(16, seed=67, contiguous=True)
    handshake(d_worker, p_worker, backend)
    worker_staging(d_worker).remote.clear()  # as if P offered no staging
    tried = []
    monkeypatch.setattr(d_worker, "_read_blocks",
                        lambda *a, **k: tried.append(a) or pytest.fail("direct READ tried"))
    before = [t.clone() for t in d_tensors]
    start_transfer(p_worker, d_worker, [5, 11], [6, 1], staged_order(p_worker, 2, 16, 30), 16)
    _, recv = d_worker.get_finished()
    assert "req-1" in (recv or ()) and not tried
    st = worker_staging(d_worker)
    assert st.stats["fallbacks"] == 0 and st.buffer.allocator.num_live == 0
    for t, b in zip(d_tensors, before):
        assert torch.equal(t, b)


def test_a_peer_without_kvcached_pd_cannot_even_handshake_with_a_contiguous_layout(staged_env):
    """vLLM alone (no kvcached-pd hooks) prepares every advertised block of its peer; a
    contiguous-layout P advertises none, so vLLM's handshake fails: the direct path
    against that KV is refused before any request."""
    p_worker, _, backend = make_side(16, seed=65, contiguous=True)
    for name in reversed(PATCHES):
        get_patch(name).unpatch()
    try:
        staged_env.setenv("ENABLE_KVCACHED", "false")
        vw.forget_resolved_layout()
        d_worker, _, _ = make_side(16, seed=66, kvcached=False)
        with pytest.raises(Exception):
            handshake(d_worker, p_worker, backend)
        assert not d_worker.dst_xfer_side_handles.get(p_worker.engine_id)
    finally:
        staged_env.setenv("ENABLE_KVCACHED", "true")
        for name in PATCHES:
            get_patch(name).patch()


def test_explicit_staging_too_small_for_one_request_stops_registration(staged_env):
    """KVCACHED_PD_STAGING_MB below one max_model_len request (this model: 2048 tokens x
    1.5 KiB = 3 MiB) would make such a request wait for room forever: vLLM's real worker
    refuses to register its KV caches, i.e. startup stops."""
    from kvcached_pd import config
    from kvcached_pd.transport.sizing import StagingSizeError

    staged_env.setenv("KVCACHED_PD_STAGING_MB", "1")
    config.reset_settings_for_tests()
    try:
        with pytest.raises(StagingSizeError, match="cannot hold the KV of one max_model_len"):
            make_side(16, seed=71)
    finally:
        staged_env.setenv("KVCACHED_PD_STAGING_MB", "4")
        config.reset_settings_for_tests()
