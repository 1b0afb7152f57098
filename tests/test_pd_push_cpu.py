"""Push mode over real NIXL on the CPU: vLLM's ``NixlPushConnectorWorker`` on both sides.

The whole push control plane is vLLM's and runs for real: D's writer thread sends the
``PUSH_REG`` notification, P's writer thread matches it with P's finished blocks and
WRITEs, D learns of the WRITE from P's completion notification, P from the handle. The
KV tensors are kvcached's (``alloc_kv_cache`` with the CPU stand-ins), as in
``test_pd_transfer_cpu``. What is checked is the bytes in D's blocks, and that D
unpacks only what P actually wrote into D's staging.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvcached_pd.patches.staged_transport import worker_staging
from tests.conftest import vllm_release
from tests.support import kvcached_cpu
from tests.test_pd_transfer_cpu import (
    handshake,
    make_side,
    staged_order,
    staged_patches,
    tokens,
)

pytestmark = [
    pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched"),
    pytest.mark.skipif(not (0, 26) <= vllm_release() < (0, 29),
                       reason="push staging hooks target vLLM 0.26-0.28's push worker"),
]


@pytest.fixture
def staged_env(kvcached_env):
    yield from staged_patches(kvcached_env)


_LIVE: list = []


@pytest.fixture(autouse=True)
def shut_down_push_workers():
    """Stop each test's push writer threads and agents: left running, they slow every
    later in-process NIXL transfer on a small CI machine."""
    yield
    while _LIVE:
        _LIVE.pop().shutdown()


def push_side(block_size, seed, contiguous=False):
    worker, tensors, backend = make_side(block_size, seed=seed, push=True, contiguous=contiguous)
    _LIVE.append(worker)
    return worker, tensors, backend


def push_pair(p_bs=16, d_bs=16, seed=40, p_contiguous=False, d_contiguous=False):
    p_worker, p_tensors, backend = push_side(p_bs, seed, p_contiguous)
    d_worker, d_tensors, _ = push_side(d_bs, seed + 1, d_contiguous)
    handshake(d_worker, p_worker, backend)  # D -> P (D sends its registration to P)
    handshake(p_worker, d_worker, backend)  # P -> D (P WRITEs into D)
    return p_worker, p_tensors, d_worker, d_tensors


def push(p_worker, d_worker, p_ids, d_ids, staged_info, *, pack=True, req="req-1", wait=True):
    """P packs (staged) and finishes; D registers; both step until D has the KV and P
    knows the WRITE is done (``wait=False``: return once both are started)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    from kvcached_pd.transport.staged import pack_for_requests

    if staged_info is not None and pack:
        pack_for_requests(p_worker, worker_staging(p_worker),
                          {req: {"block_ids": p_ids, **staged_info}})
    d_meta = NixlConnectorMetadata()
    d_meta.add_new_req_to_recv(request_id=req, local_block_ids=[d_ids], kv_transfer_params={
        "remote_block_ids": (), "remote_engine_id": p_worker.engine_id,
        "remote_request_id": req, "remote_host": "127.0.0.1", "remote_port": 0})
    d_meta.push_registrations = {req: {
        "request_id": req, "decode_engine_id": d_worker.engine_id,
        "decode_host": "127.0.0.1", "decode_port": 0, "decode_tp_size": 1,
        "local_block_ids": [list(d_ids)], "remote_engine_id": p_worker.engine_id,
        "remote_host": "127.0.0.1", "remote_port": 0, "remote_tp_size": 1,
        "remote_pp_size": 1}}
    d_meta.kvcached_pd_recv = {req: staged_info} if staged_info else {}
    d_worker.start_load_kv(d_meta)
    p_meta = NixlConnectorMetadata()
    p_meta.push_finished_blocks = {req: [list(p_ids)]}
    p_worker._reqs_to_process.add(req)
    p_worker._reqs_to_send[req] = time.perf_counter() + 60
    p_worker.start_load_kv(p_meta)
    return step_until_done(p_worker, d_worker, req) if wait else None


def step_until_done(p_worker, d_worker, req, timeout_s=60):
    deadline = time.time() + timeout_s
    done_recv, done_send = set(), set()
    while time.time() < deadline and not (req in done_recv and req in done_send):
        _, recv = d_worker.get_finished()
        send, _ = p_worker.get_finished()
        done_recv |= set(recv or ())
        done_send |= set(send or ())
        time.sleep(0.01)
    assert req in done_recv, "decode never learnt that the push finished"
    assert req in done_send, "prefill never saw its WRITE complete"
    return done_recv, done_send


def poison_staging(worker):
    """Fill a side's staging with a pattern: an unpack of bytes never written shows."""
    worker_staging(worker).buffer.tensor.fill_(0x5A)


@pytest.mark.parametrize("p_bs,d_bs,num_tokens", [(16, 16, 75), (16, 16, 64), (32, 32, 33)])
def test_push_writes_the_packed_extent_into_decode_staging(staged_env, p_bs, d_bs, num_tokens):
    p_worker, p_tensors, d_worker, d_tensors = push_pair(p_bs, d_bs, seed=40)
    p_st, d_st = worker_staging(p_worker), worker_staging(d_worker)
    assert p_st.push and d_st.push
    p_ids = [7, 2, 9, 4, 0][: -(-num_tokens // p_bs)]
    d_ids = [3, 10, 5, 1, 8][: -(-num_tokens // d_bs)]
    untouched = [t[[b for b in range(t.shape[0]) if b not in d_ids]].clone() for t in d_tensors]
    poison_staging(d_worker)
    push(p_worker, d_worker, p_ids, d_ids, staged_order(p_worker, len(p_ids), p_bs, num_tokens))
    assert torch.equal(tokens(d_tensors, d_ids, d_bs, num_tokens),
                       tokens(p_tensors, p_ids, p_bs, num_tokens))
    for t, before in zip(d_tensors, untouched):
        assert torch.equal(t[[b for b in range(t.shape[0]) if b not in d_ids]], before)
    assert p_st.stats["writes"] == 1 and d_st.stats["reads"] == 1
    assert d_st.stats["fallbacks"] == 0 and not d_st.push_arrived
    assert d_st.buffer.allocator.num_live == 0  # D's extent returned after the unpack
    assert not p_st.packed and not p_st.push_offers  # P forgot the finished request
    # one WRITE of one descriptor, in vLLM's own telemetry on P
    assert p_worker.xfer_stats.data["num_descriptors"] == [1]


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "vllm-per-block"])
def test_decode_prefix_cache_hit_gets_the_prompts_last_blocks(staged_env, staged):
    """D holds the prompt's first two blocks from its own prefix cache and registers
    only the rest. Staged: D unpacks the extent from the first token it lacks. vLLM's
    per-block push would write P's *first* blocks there (vLLM 0.26-0.28);
    push_prefix_alignment makes it write P's last ones, as pull mode reads them."""
    p_worker, p_tensors, d_worker, d_tensors = push_pair(seed=52)
    num_tokens, cached = 75, 2
    p_ids, d_all = [7, 2, 9, 4, 0], [3, 10, 5, 1, 8]
    held = [t[d_all[:cached]].clone() for t in d_tensors]
    poison_staging(d_worker)
    info = staged_order(p_worker, len(p_ids), 16, num_tokens) if staged else None
    push(p_worker, d_worker, p_ids, d_all[cached:], info)
    first = cached * 16
    assert torch.equal(tokens(d_tensors, d_all, 16, num_tokens)[:, first:],
                       tokens(p_tensors, p_ids, 16, num_tokens)[:, first:])
    for t, before in zip(d_tensors, held):
        assert torch.equal(t[d_all[:cached]], before)
    assert worker_staging(p_worker).stats["writes"] == (1 if staged else 0)


def test_push_between_different_block_sizes_is_refused_by_vllm_handshake(staged_env):
    """In push mode P handshakes with D; vLLM refuses a D block size that is not a
    divisor of P's before any data path is chosen (the pull-mode mirror image)."""
    p_worker, _, backend = push_side(16, 50)
    d_worker, _, _ = push_side(32, 51)
    with pytest.raises(AssertionError, match="block size"):
        handshake(p_worker, d_worker, backend)


def test_push_without_a_packed_extent_is_vllms_push(staged_env):
    """P packed nothing (its staging was full, or it runs without kvcached-pd): D offers
    no staging and vLLM's per-block WRITE moves the KV."""
    p_worker, p_tensors, d_worker, d_tensors = push_pair(seed=42)
    p_ids, d_ids = [5, 11, 0], [6, 1, 2]
    push(p_worker, d_worker, p_ids, d_ids, None)
    assert torch.equal(tokens(d_tensors, d_ids, 16, 40), tokens(p_tensors, p_ids, 16, 40))
    assert worker_staging(p_worker).stats["writes"] == 0
    assert worker_staging(d_worker).stats["reads"] == 0
    assert p_worker.xfer_stats.data["num_descriptors"] == [3 * 3]  # block x layer


def test_decode_never_unpacks_what_prefill_did_not_write(staged_env):
    """D offered staging but P WRITEs blocks by vLLM's path (here: P lost its packed
    extent, as a P without kvcached-pd would never have one). P's notification is then
    unmarked and D leaves its blocks as P wrote them; its poisoned staging is unused."""
    p_worker, p_tensors, d_worker, d_tensors = push_pair(seed=44)
    p_ids, d_ids = [5, 11, 0], [6, 1, 2]
    poison_staging(d_worker)
    push(p_worker, d_worker, p_ids, d_ids, staged_order(p_worker, 3, 16, 40), pack=False)
    assert torch.equal(tokens(d_tensors, d_ids, 16, 40), tokens(p_tensors, p_ids, 16, 40))
    d_st = worker_staging(d_worker)
    assert d_st.stats["reads"] == 0 and worker_staging(p_worker).stats["writes"] == 0
    assert d_st.buffer.allocator.num_live == 0  # the unused offer came back


def test_decode_staging_full_holds_the_registration_until_room(staged_env):
    p_worker, p_tensors, d_worker, d_tensors = push_pair(seed=46)
    d_st = worker_staging(d_worker)
    hog = d_st.buffer.alloc(d_st.buffer.allocator.capacity_bytes - 4096, "hog")
    p_ids, d_ids = [3, 4, 5], [0, 1, 2]
    info = staged_order(p_worker, 3, 16, 40)

    def free_hog_later():
        time.sleep(0.3)
        d_st.buffer.free(hog)

    import threading

    threading.Thread(target=free_hog_later, daemon=True).start()
    push(p_worker, d_worker, p_ids, d_ids, info)
    assert torch.equal(tokens(d_tensors, d_ids, 16, 40), tokens(p_tensors, p_ids, 16, 40))
    assert d_st.stats["reads"] == 1 and d_st.stats["fallbacks"] == 0 and not d_st.push_waiting


def test_a_failed_request_keeps_its_offered_extent_out_of_use(staged_env):
    """After D's request fails with its offer out, P may still WRITE there until its
    lease ends. P's lease began before the offer (D offers only for a request carrying
    P's extent), so the extent is held until hold_s after the offer, then returned."""
    from kvcached_pd.transport.staged import drop_failed
    from kvcached_pd.transport.staged_push import offer_staging

    _, _, d_worker, _ = push_pair(seed=48)
    d_st = worker_staging(d_worker)
    assert d_st.hold_s == 35.0  # vLLM's default 30 s KV lease plus a 5 s margin
    info = staged_order(d_worker, 3, 16, 40)
    d_st.recv_info["req-9"] = info
    reg = {"request_id": "req-9"}
    assert offer_staging(d_worker, d_st, "req-9", reg) == "offered"
    assert reg["kvcached_pd_staged"]["nbytes"] == info["nbytes"]
    drop_failed(d_st, "req-9")
    d_st.reap(d_worker)
    assert d_st.buffer.allocator.num_live == 1  # still held: the lease may not have ended
    until = d_st.quarantine[0][0]
    assert 30.0 < until - time.monotonic() <= 35.0
    d_st.quarantine = [(0.0, extent) for _, extent in d_st.quarantine]  # hold elapsed
    d_st.reap(d_worker)
    assert d_st.buffer.allocator.num_live == 0


def test_a_request_failed_a_lease_after_its_offer_frees_its_extent_soon(staged_env):
    """A push D never received fails a lease or more after the offer (the host's UCX
    faults on P's WRITE: the client gave up; or vLLM's registration watchdog): P's lease
    is over by then, so the extent comes back within the margin, not a whole hold
    after the failure."""
    from kvcached_pd.transport.staged import drop_failed
    from kvcached_pd.transport.staged_push import offer_staging

    _, _, d_worker, _ = push_pair(seed=49)
    d_st = worker_staging(d_worker)
    info = staged_order(d_worker, 3, 16, 40)
    d_st.recv_info["req-8"] = info
    assert offer_staging(d_worker, d_st, "req-8", {"request_id": "req-8"}) == "offered"
    extent, info_, offered = d_st.pending["req-8"]
    d_st.pending["req-8"] = (extent, info_, offered - 31.0)  # offered 31 s ago
    drop_failed(d_st, "req-8")
    assert d_st.quarantine[0][0] - time.monotonic() <= 4.0


def test_a_staged_write_nixl_refuses_goes_by_vllms_push(staged_env, monkeypatch):
    """NIXL refuses to start the staged WRITE (here: its first transfer() raises): P
    releases that handle and writes the blocks by vLLM's path; D, seeing no staged mark,
    leaves them as written."""
    p_worker, p_tensors, d_worker, d_tensors = push_pair(seed=54)
    wrapper = p_worker.nixl_wrapper
    real_transfer, refused = wrapper.transfer, []

    def transfer_once_refused(handle, *args, **kwargs):
        if not refused:
            refused.append(handle)
            raise RuntimeError("NIXL_ERR_BACKEND (injected)")
        return real_transfer(handle, *args, **kwargs)

    monkeypatch.setattr(wrapper, "transfer", transfer_once_refused)
    p_ids, d_ids = [5, 11, 0], [6, 1, 2]
    poison_staging(d_worker)
    push(p_worker, d_worker, p_ids, d_ids, staged_order(p_worker, 3, 16, 40))
    assert refused, "the staged WRITE was never attempted"
    assert torch.equal(tokens(d_tensors, d_ids, 16, 40), tokens(p_tensors, p_ids, 16, 40))
    d_st = worker_staging(d_worker)
    assert worker_staging(p_worker).stats["writes"] == 0 and d_st.stats["reads"] == 0
    assert d_st.buffer.allocator.num_live == 0


# ----------------------------------------------- kvcached's contiguous layout (its default)
@pytest.mark.parametrize("p_contiguous,d_contiguous", [(True, True), (True, False), (False, True)])
def test_staged_push_on_kvcached_contiguous_layout(staged_env, p_contiguous, d_contiguous):
    p_worker, p_tensors, d_worker, d_tensors = push_pair(
        seed=70, p_contiguous=p_contiguous, d_contiguous=d_contiguous)
    p_ids, d_ids, num_tokens = [7, 2, 9, 4, 0], [3, 10, 5, 1, 8], 75
    whole = [t.clone() for t in d_tensors]
    poison_staging(d_worker)
    push(p_worker, d_worker, p_ids, d_ids, staged_order(p_worker, 5, 16, num_tokens))
    assert torch.equal(tokens(d_tensors, d_ids, 16, num_tokens),
                       tokens(p_tensors, p_ids, 16, num_tokens))
    others = [b for b in range(d_tensors[0].shape[0]) if b not in d_ids]
    for t, before in zip(d_tensors, whole):
        assert torch.equal(t[others], before[others])
    assert worker_staging(p_worker).stats["writes"] == 1
    assert worker_staging(d_worker).stats["reads"] == 1


@pytest.mark.parametrize("p_contiguous,d_contiguous", [(True, False), (False, True)])
def test_vllm_per_block_push_with_a_contiguous_layout_fails_instead_of_writing_wrong_bytes(
        staged_env, p_contiguous, d_contiguous):
    """No packed extent, so vLLM's per-block WRITE is tried: NIXL holds none of the
    contiguous side's KV and refuses the request; D's cache keeps every byte."""
    p_worker, _, d_worker, d_tensors = push_pair(
        seed=72, p_contiguous=p_contiguous, d_contiguous=d_contiguous)
    before = [t.clone() for t in d_tensors]
    push(p_worker, d_worker, [5, 11, 0], [6, 1, 2], None, wait=False)
    deadline, received = time.time() + 30, set()
    while time.time() < deadline and not p_worker.xfer_stats.data["num_failed_transfers"]:
        received |= set(d_worker.get_finished()[1] or ())
        p_worker.get_finished()
        time.sleep(0.01)
    # vLLM's push writer reports the WRITE as failed (its setup was refused by NIXL)
    assert p_worker.xfer_stats.data["num_failed_transfers"] == [1]
    assert not p_worker.xfer_stats.data["bytes_transferred"] and "req-1" not in received
    assert worker_staging(p_worker).stats["writes"] == 0
    for t, b in zip(d_tensors, before):
        assert torch.equal(t, b)
