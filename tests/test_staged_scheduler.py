"""The staged transport's prefill-side bookkeeping inside vLLM's real Scheduler.

vLLM's v1 ``Scheduler`` with the NIXL connector (scheduler role) schedules
``do_remote_decode`` requests; the test plays the model runner's part with vLLM's own
output types. It checks that a pack is ordered exactly in the step that completes the
prompt (also when the prompt is chunked), that the extent reaches ``kv_transfer_params``,
that it is freed exactly when vLLM frees P's blocks (``finished_sending``), and that
aborted or non-remote requests return their extents: many aborts leak nothing. A full
staging holds a prefill back (vLLM's scheduler skips it) until room frees, instead of
sending it by the direct path. Each test runs with the pull connector and with the push
connector, on vLLM's ``AsyncScheduler`` (vLLM 0.26's default) driven as EngineCore's
batch queue drives it: step N+1 is scheduled before step N's output is processed.
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
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvcached_pd.patches import get_patch

    kvcached_env.setenv("KVCACHED_PD_TRANSPORT", "staged")
    kvcached_env.setenv("KVCACHED_PD_STAGING_MB", "2")  # holds one 2048-token request
    kvcached_env.setenv("KVCACHED_PD_DISABLE", "connector_routing")  # the hook path's tests
    patch = get_patch("staged_transport")
    patch.patch()
    metrics = get_patch("connector_metrics")  # the kvcached_pd_* series in vLLM's stats
    metrics.patch()
    model = vw.write_tiny_llama(tempfile.mkdtemp(), num_layers=2, num_kv_heads=2, head_dim=64)
    config = vw.make_vllm_config(model, block_size=BLOCK, connector=request.param)
    config.scheduler_config.max_num_batched_tokens = 64
    config.scheduler_config.async_scheduling = True
    config.cache_config.enable_prefix_caching = False
    kv_cache_config = vw.kv_cache_config(["l0", "l1"], 200, BLOCK, 2, 64)
    config.cache_config.num_gpu_blocks = 200
    sched = AsyncScheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                      structured_output_manager=StructuredOutputManager(config),
                      block_size=BLOCK)
    yield sched
    patch.unpatch()
    metrics.unpatch()


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


class BatchQueue:
    """EngineCore's batch queue with async scheduling: step N+1 is scheduled before
    step N's output is processed, so aborts and finishes land between the two."""

    def __init__(self, sched):
        self.sched = sched
        self.inflight = None  # (scheduler output, sampled token ids per request)

    def _runner_output(self, out, sampled, finished_sending):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids], logprobs=None,
            prompt_logprobs_dict={}, pooler_output=None,
            kv_connector_output=KVConnectorOutput(finished_sending=set(finished_sending))
            if finished_sending else None)

    def step(self, finished_sending=()):
        out = self.sched.schedule()
        # decided at schedule time: does this step complete the request's prompt?
        sampled = {r: [7] if self.sched.requests[r].num_computed_tokens
                   >= self.sched.requests[r].num_prompt_tokens else []
                   for r in out.num_scheduled_tokens}
        engine_outputs = {}
        if self.inflight is not None:
            engine_outputs = self.sched.update_from_output(
                self.inflight[0], self._runner_output(*self.inflight, finished_sending))
        elif finished_sending:
            engine_outputs = self.sched.update_from_output(
                out, self._runner_output(out, sampled, finished_sending))
            out, sampled = self.sched.schedule(), {}
        self.inflight = (out, sampled)
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
    """Requests aborted before, during and after their prefill, some held back for room,
    with one step always in flight: every extent comes back, and only through the
    paths that free it (removing the release on D's notification makes this fail)."""
    from vllm.v1.request import RequestStatus

    st = staging(scheduler)
    # several prefills per step, long ones chunked (0.28 also reads the config's budget)
    scheduler.max_num_scheduled_tokens = 512
    scheduler.scheduler_config.max_num_batched_tokens = 512
    queue = BatchQueue(scheduler)
    aborted = 0
    awaiting_decode: set[str] = set()  # finished on P, extent handed to D

    def step():
        # D reads and notifies one step after P finished: deliver what is awaited
        notified = set(awaiting_decode)
        awaiting_decode.clear()
        _, engine_outputs = queue.step(finished_sending=notified)
        done = {rid for rid in ids if finished_params(engine_outputs, rid)}
        awaiting_decode.update(done)
        return done

    finished_remote: set[str] = set()
    for round_ in range(30):
        # 2 MiB of staging, 100-1300-token prompts (~0.1-1.3 MiB each): some wait for room
        reqs = [make_request(100 + 300 * i + 7 * round_) for i in range(4)]
        ids = [r.request_id for r in reqs]
        for r in reqs:
            scheduler.add_request(r)
        for _ in range(1 + round_ % 3):
            finished_remote |= step()
        victims = [r for r in ids if (round_ % 2 or r == ids[-1]) and r not in finished_remote]
        scheduler.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
        aborted += len(victims)
        for _ in range(500):  # bounded: a leak would hold the last requests back forever
            if not (scheduler.get_num_unfinished_requests() or awaiting_decode
                    or queue.inflight[0].num_scheduled_tokens):
                break
            finished_remote |= step()
        else:
            pytest.fail(f"round {round_}: requests still held back after 500 steps; staging "
                        f"holds {sorted(e.owner for e in st.allocator.live_extents())}")
        assert not finished_remote & set(victims)
    assert aborted >= 30  # mid-prefill and still-waiting requests were aborted
    assert st.waits > 0  # some prefills were held back for room
    assert st.fallbacks == 0
    assert st.allocator.num_live == 0 and st.allocator.used_bytes == 0
    assert st.extents == {} and st.tracked == {} and st.reserved == {} and not st.waiting
    assert not scheduler.requests


def test_local_requests_get_no_staging(scheduler):
    req = make_request(50, remote_decode=False)
    scheduler.add_request(req)
    out, _ = step(scheduler)
    assert out.kv_connector_metadata.kvcached_pd_pack == {}
    assert staging(scheduler).allocator.num_live == 0


def test_full_staging_holds_the_prefill_back_until_room_frees(scheduler):
    """No room in P's staging: vLLM's scheduler skips the request (it is not prefilled
    and never takes the direct path); once room frees it is prefilled and staged."""
    st = staging(scheduler)
    hog = st.allocator.alloc(st.allocator.capacity_bytes - 4096, "hog")
    other = make_request(30, remote_decode=False)  # a local request is not held back
    req = make_request(100)
    scheduler.add_request(req)
    scheduler.add_request(other)
    for _ in range(3):
        out, _ = step(scheduler)
        assert req.request_id not in out.num_scheduled_tokens
    assert other.request_id in scheduler.requests and scheduler.requests[other.request_id].num_computed_tokens > 0
    assert st.waits == 1 and st.fallbacks == 0 and req.request_id in st.waiting
    st.allocator.free(hog)
    step(scheduler)
    _, engine_outputs = step(scheduler)
    params = finished_params(engine_outputs, req.request_id)
    assert params is not None and params["kvcached_pd_staged"]["nbytes"] > 0
    assert st.fallbacks == 0 and not st.waiting


def test_abort_of_a_held_back_prefill_forgets_it(scheduler):
    from vllm.v1.request import RequestStatus

    st = staging(scheduler)
    hog = st.allocator.alloc(st.allocator.capacity_bytes - 4096, "hog")
    req = make_request(100)
    scheduler.add_request(req)
    step(scheduler)
    assert req.request_id in st.waiting
    scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    assert not st.waiting and not st.reserved
    st.allocator.free(hog)
    assert st.allocator.num_live == 0


def test_scheduler_samples_reach_vllms_connector_stats(scheduler):
    """P's staging gauge travels in vLLM's KV-connector stats: the scheduler merges the
    connector's own stats into the SchedulerStats the API server's Prometheus metrics
    observe."""
    req = make_request(100)
    scheduler.add_request(req)
    _, engine_outputs = step(scheduler)  # prefill done: the extent is held for D
    stats = [eco.scheduler_stats.kv_connector_stats for eco in engine_outputs.values()
             if eco.scheduler_stats is not None]
    gauge = [v for s in stats if s for v in s.get("kvcached_pd_prefill_staging_bytes", [])]
    assert gauge and gauge[-1] == staging(scheduler).allocator.used_bytes > 0
    _, engine_outputs = step(scheduler, finished_sending={req.request_id})
    stats = [eco.scheduler_stats.kv_connector_stats for eco in engine_outputs.values()
             if eco.scheduler_stats is not None]
    gauge = [v for s in stats if s for v in s.get("kvcached_pd_prefill_staging_bytes", [])]
    assert gauge and gauge[-1] == 0  # back to zero once D's notification freed it
