"""The staged transport's prefill-side bookkeeping inside vLLM's real Scheduler.

vLLM's v1 ``Scheduler`` with the NIXL connector (scheduler role) schedules
``do_remote_decode`` requests; the test plays the model runner's part with vLLM's own
output types. It checks that a pack is ordered exactly in the step that completes the
prompt (also when the prompt is chunked), that the extent reaches ``kv_transfer_params``,
that it is freed exactly when vLLM frees P's blocks (``finished_sending``), and that
aborted or non-remote requests return their extents: many aborts leak nothing. Each
test runs with the pull connector and with the push connector.
"""

from __future__ import annotations

import itertools
import tempfile

import pytest
import torch

from tests.conftest import vllm_release
from tests.support import vllm_nixl_worker as vw

pytestmark = pytest.mark.skipif(not (0, 24) <= vllm_release() < (0, 29),
                                reason="staged transport hooks target vLLM 0.24-0.28")

BLOCK = 16
_ids = itertools.count(1)


@pytest.fixture(params=["NixlConnector", "NixlPushConnector"])
def scheduler(kvcached_env, request):
    """vLLM's Scheduler with the pull connector, or the push connector (P's side of
    push mode keeps the same extent bookkeeping)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvcached_pd.patches import get_patch

    kvcached_env.setenv("KVCACHED_PD_TRANSPORT", "staged")
    kvcached_env.setenv("KVCACHED_PD_STAGING_MB", "1")
    patch = get_patch("staged_transport")
    patch.patch()
    model = vw.write_tiny_llama(tempfile.mkdtemp(), num_layers=2, num_kv_heads=2, head_dim=64)
    config = vw.make_vllm_config(model, block_size=BLOCK, connector=request.param)
    config.scheduler_config.max_num_batched_tokens = 64
    config.scheduler_config.async_scheduling = False
    config.cache_config.enable_prefix_caching = False
    kv_cache_config = vw.kv_cache_config(["l0", "l1"], 200, BLOCK, 2, 64)
    config.cache_config.num_gpu_blocks = 200
    sched = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                      structured_output_manager=StructuredOutputManager(config),
                      block_size=BLOCK)
    yield sched
    patch.unpatch()


def make_request(num_tokens: int, remote_decode: bool = True):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1 if remote_decode else 4, ignore_eos=True)
    req = Request(request_id=f"req-{next(_ids)}", prompt_token_ids=list(range(1, num_tokens + 1)),
                  sampling_params=params, pooling_params=None)
    req.kv_transfer_params = {"do_remote_decode": True} if remote_decode else None
    return req


def step(sched, finished_sending=()):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    # A partial prefill samples nothing; the step that completes the prompt samples one.
    sampled = [[] if sched.requests[r].num_computed_tokens < sched.requests[r].num_prompt_tokens
               else [7] for r in req_ids]
    runner_output = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(finished_sending=set(finished_sending))
        if finished_sending else None,
    )
    engine_outputs = sched.update_from_output(out, runner_output)
    return out, engine_outputs


def staging(sched):
    from kvcached_pd.patches.staged_transport import scheduler_staging

    return scheduler_staging(sched.connector.connector_scheduler)


def finished_params(engine_outputs, req_id):
    for outputs in engine_outputs.values():
        for o in outputs.outputs:
            if o.request_id == req_id and o.finish_reason is not None:
                return o.kv_transfer_params
    return None


def test_pack_ordered_in_the_completing_step_and_freed_with_p_blocks(scheduler):
    req = make_request(100)  # 7 blocks; two chunks of at most 64 tokens
    scheduler.add_request(req)
    out1, _ = step(scheduler)
    assert out1.kv_connector_metadata.kvcached_pd_pack == {}  # prompt not complete yet
    out2, engine_outputs = step(scheduler)
    pack = out2.kv_connector_metadata.kvcached_pd_pack[req.request_id]
    assert len(pack["block_ids"]) == 7 and pack["n_tok_slots"] == 7 * BLOCK
    assert pack["num_tokens"] == 100
    st = staging(scheduler)
    assert pack["nbytes"] == st.fmt.extent_bytes(7 * BLOCK) == 7 * BLOCK * 2 * 2 * 2 * 64 * 2
    params = finished_params(engine_outputs, req.request_id)
    assert params is not None and params["kvcached_pd_staged"]["offset"] == pack["offset"]
    assert st.allocator.num_live == 1
    step(scheduler, finished_sending={req.request_id})  # D's notification reached P
    assert st.allocator.num_live == 0 and st.allocator.used_bytes == 0


def test_trace_follows_the_extent_from_order_to_release(scheduler, caplog, monkeypatch):
    import logging

    from kvcached_pd.transport import trace

    monkeypatch.setenv("KVCACHED_PD_TRACE", "1")
    trace.reset()
    caplog.set_level(logging.INFO, logger="kvcached_pd")
    try:
        req = make_request(40)
        scheduler.add_request(req)
        step(scheduler)
        step(scheduler, finished_sending={req.request_id})
    finally:
        trace.reset()
    events = [e for e in (trace.parse_line(r.getMessage()) for r in caplog.records) if e]
    assert [e["ev"] for e in events] == ["pack_ordered", "p_finished", "p_released"]
    assert {e["req"] for e in events} == {req.request_id}
    assert events[0]["tokens"] == 40 and events[0]["since_arrival_ms"] >= 0
    assert events[2]["held_ms"] >= 0


def test_many_aborts_leak_nothing(scheduler):
    from vllm.v1.request import RequestStatus

    st = staging(scheduler)
    aborted = 0
    for round_ in range(30):
        reqs = [make_request(40 + 7 * i) for i in range(4)]
        for r in reqs:
            scheduler.add_request(r)
        # some complete their prompt (and finish: max_tokens=1) and get extents, some
        # are mid-prefill when the abort comes
        _, engine_outputs = step(scheduler)
        awaiting_decode = {r.request_id for r in reqs if finished_params(engine_outputs, r.request_id)}
        victims = [r.request_id for r in reqs
                   if (round_ % 2 or r is reqs[-1]) and r.request_id not in awaiting_decode]
        scheduler.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
        aborted += len(victims)
        while scheduler.get_num_unfinished_requests():
            _, engine_outputs = step(scheduler)
            awaiting_decode |= {r.request_id for r in reqs
                                if finished_params(engine_outputs, r.request_id)}
        assert not awaiting_decode & set(victims)
        if awaiting_decode:  # D's notifications, which free P's blocks in vLLM
            step(scheduler, finished_sending=awaiting_decode)
    assert aborted >= 30  # mid-prefill and still-waiting requests were aborted
    assert st.allocator.num_live == 0 and st.allocator.used_bytes == 0
    assert st.extents == {} and st.tracked == {}


def test_local_requests_get_no_staging(scheduler):
    req = make_request(50, remote_decode=False)
    scheduler.add_request(req)
    out, _ = step(scheduler)
    assert out.kv_connector_metadata.kvcached_pd_pack == {}
    assert staging(scheduler).allocator.num_live == 0


def test_full_staging_falls_back_to_direct(scheduler):
    st = staging(scheduler)
    hog = st.allocator.alloc(st.allocator.capacity_bytes - 4096, "hog")
    req = make_request(100)
    scheduler.add_request(req)
    step(scheduler)
    _, engine_outputs = step(scheduler)
    params = finished_params(engine_outputs, req.request_id)
    assert params is not None and "kvcached_pd_staged" not in params
    assert params["remote_block_ids"]  # vLLM's direct path still offered
    assert st.fallbacks == 1
    st.allocator.free(hog)
