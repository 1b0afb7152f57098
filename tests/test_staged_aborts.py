"""Client aborts on the decode side, through vLLM's real async scheduler and real NIXL.

The decode instance here is vLLM's own ``AsyncScheduler`` (vLLM 0.26 schedules
asynchronously by default) with the NIXL connector's scheduler half, and vLLM's real
pull-mode ``NixlConnectorWorker`` over kvcached tensors; the prefill side is a real
worker that packed the request into its staging. The test plays the engine loop:
``schedule`` -> the worker's ``start_load_kv`` / ``get_finished`` -> ``update_from_output``.

The case that killed the decode server on the GPU host (16 concurrent requests, every
9th client dropping its legs): a request aborted before D scheduled it is queued by
vLLM with *no* blocks, so its worker only notifies P. The staged path used to READ the
extent anyway and report the request as received after the scheduler had deleted it:
vLLM's ``assert req_id in self.requests`` then killed the engine. Also covered: an abort
while the staged READ is in flight, which must still free D's blocks, D's extent and
P's extent (P learns through D's notification).
"""

from __future__ import annotations

import tempfile
import time

import pytest

from kvcached_pd.patches.staged_transport import worker_staging
from tests.conftest import vllm_release
from tests.support import kvcached_cpu
from tests.support import vllm_nixl_worker as vw
from tests.test_pd_transfer_cpu import BUDGET, LAYERS, handshake, make_side, staged_order

pytestmark = [
    pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched"),
    pytest.mark.skipif(not (0, 24) <= vllm_release() < (0, 29),
                       reason="staged transport hooks target vLLM 0.24-0.28"),
]

BLOCK = 16


@pytest.fixture
def pair(kvcached_env):
    from tests.test_pd_transfer_cpu import staged_patches

    gen = staged_patches(kvcached_env)
    next(gen)
    p_worker, p_tensors, backend = make_side(BLOCK, seed=41)
    d_worker, d_tensors, _ = make_side(BLOCK, seed=42)
    handshake(d_worker, p_worker, backend)
    yield p_worker, d_worker
    for _ in gen:
        pass


def decode_scheduler():
    """vLLM's async scheduler of a decode instance (kv_consumer), as EngineCore builds it."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    model = vw.write_tiny_llama(tempfile.mkdtemp(), LAYERS, 2, 64)
    config = vw.make_vllm_config(model, block_size=BLOCK, kv_role="kv_consumer")
    config.scheduler_config.async_scheduling = True
    config.cache_config.enable_prefix_caching = False
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_cache_config = vw.kv_cache_config(names, BUDGET, BLOCK, 2, 64)
    config.cache_config.num_gpu_blocks = BUDGET
    return AsyncScheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK)


def decode_request(req_id, p_worker, num_tokens, p_ids, info):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id=req_id, prompt_token_ids=list(range(1, num_tokens + 1)),
                  sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                  pooling_params=None)
    req.kv_transfer_params = {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": [p_ids], "remote_engine_id": p_worker.engine_id,
        "remote_request_id": "p-" + req_id, "remote_host": "127.0.0.1", "remote_port": 0,
        "tp_size": 1, "remote_num_tokens": num_tokens, "kvcached_pd_staged": info,
    }
    return req


def pack_on_prefill(p_worker, req_id, p_ids, info):
    from kvcached_pd.transport.staged import pack_for_requests

    pack_for_requests(p_worker, worker_staging(p_worker), {req_id: {"block_ids": p_ids, **info}})
    p_worker._reqs_to_send[req_id] = time.perf_counter() + 60  # P awaits D's notification
    p_worker._reqs_to_process.add(req_id)


def engine_step(sched, d_worker, out):
    """What the decode engine does with one scheduled step: the worker's connector
    calls around the (absent) forward, then the scheduler's update."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    d_worker.start_load_kv(out.kv_connector_metadata)
    _, recving = d_worker.get_finished()
    req_ids = list(out.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids], logprobs=None, prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(finished_recving=set(recving or ())),
    )
    sched.update_from_output(out, runner_output)
    return set(recving or ())


def run_until(sched, d_worker, p_worker, p_req_id, deadline_s=30.0):
    """Run engine steps until P has D's notification and D holds nothing any more."""
    notified = False
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        engine_step(sched, d_worker, sched.schedule())
        sending, _ = p_worker.get_finished()
        notified |= p_req_id in (sending or ())
        if notified and not sched.requests and not worker_staging(d_worker).pending:
            return True
        time.sleep(0.005)
    return False


def test_abort_before_decode_schedules_notifies_prefill_and_reads_nothing(pair):
    from vllm.v1.request import RequestStatus

    p_worker, d_worker = pair
    p_ids = [7, 2, 9]
    info = staged_order(p_worker, len(p_ids), BLOCK, 40)
    pack_on_prefill(p_worker, "p-a", p_ids, info)
    sched = decode_scheduler()
    req = decode_request("a", p_worker, 40, p_ids, info)
    sched.add_request(req)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # client gone at once
    # engine steps: must neither crash (vLLM's assert in _update_from_kv_xfer_finished)
    # nor leave P's blocks/extent waiting for the abort timeout
    assert run_until(sched, d_worker, p_worker, "p-a"), \
        "P never got D's notification for the aborted request"
    st = worker_staging(d_worker)
    assert st.stats["reads"] == 0 and not st.pending and not st.recv_info
    assert st.buffer.allocator.num_live == 0


def test_abort_while_the_staged_read_is_in_flight_frees_everything(pair):
    from vllm.v1.request import RequestStatus

    p_worker, d_worker = pair
    p_ids = [1, 5, 3, 8]
    info = staged_order(p_worker, len(p_ids), BLOCK, 60)
    pack_on_prefill(p_worker, "p-b", p_ids, info)
    sched = decode_scheduler()
    sched.add_request(decode_request("b", p_worker, 60, p_ids, info))
    out = sched.schedule()  # D allocates blocks; the request waits for remote KV
    assert sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_worker.start_load_kv(out.kv_connector_metadata)  # the staged READ is posted
    assert "b" in worker_staging(d_worker).pending
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert run_until(sched, d_worker, p_worker, "p-b")
    # vLLM held D's blocks until the READ was done, then freed them
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    assert worker_staging(d_worker).buffer.allocator.num_live == 0


def test_many_decode_aborts_at_every_point_leak_nothing(pair):
    """Mixed traffic: some requests aborted before scheduling, some mid-READ, some run
    to completion; the engine survives and every staging byte comes back."""
    from vllm.v1.request import RequestStatus

    p_worker, d_worker = pair
    sched = decode_scheduler()
    p_ids = [4, 6]
    for i in range(12):
        req_id = f"m{i}"
        info = staged_order(p_worker, len(p_ids), BLOCK, 20 + i)
        pack_on_prefill(p_worker, "p-" + req_id, p_ids, info)
        sched.add_request(decode_request(req_id, p_worker, 20 + i, p_ids, info))
        if i % 3 == 0:
            sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        engine_step(sched, d_worker, out)
        if i % 3 == 1:
            sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
    deadline = time.time() + 30
    while time.time() < deadline and (sched.requests or worker_staging(d_worker).pending):
        engine_step(sched, d_worker, sched.schedule())
        p_worker.get_finished()
        time.sleep(0.005)
    assert not sched.requests
    st = worker_staging(d_worker)
    assert not st.pending and not st.waiting and st.buffer.allocator.num_live == 0
