"""kvcached-pd's connector end to end on the CPU: two real NIXL agents per instance."""

from __future__ import annotations

import time

import pytest

from kvcached_pd.connector.wire import PARAMS_KEY
from tests.conftest import vllm_release
from tests.support import connector_pd as pd


@pytest.fixture
def staged_env(monkeypatch):
    monkeypatch.setenv("KVCACHED_PD", "1")
    monkeypatch.setenv("KVCACHED_PD_TRANSPORT", "staged")
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    with pd.cpu_vllm():
        yield


def handoff(p: pd.Engine, d: pd.Engine, req_id: str, prompt: list[int]):
    p.sched.add_request(pd.prefill_request(req_id, prompt))
    assert pd.run([p], lambda: req_id in p.outputs)
    params = p.outputs[req_id].kv_transfer_params
    p_blocks = list(params["remote_block_ids"][0]) if isinstance(
        params["remote_block_ids"][0], list) else list(params["remote_block_ids"])
    d.sched.add_request(pd.decode_request("d-" + req_id, prompt, params))
    captured = {}

    def loaded():
        req = d.sched.requests.get("d-" + req_id)
        if req is not None and req.num_computed_tokens >= len(prompt) - 1 and not captured:
            captured["blocks"] = d.blocks_of("d-" + req_id)
        return "d-" + req_id in d.outputs and d.outputs["d-" + req_id].finished
    assert pd.run([p, d], loaded)
    return params, p_blocks, captured["blocks"]


@pytest.mark.parametrize("p_async", [True, False], ids=["p-async", "p-sync"])
def test_staged_handoff_moves_every_token_exactly(staged_env, p_async):
    """With P on vLLM's asynchronous scheduler and on its plain one
    (``--no-async-scheduling``, what the README advises for a prefill instance)."""
    p = pd.make_engine("p", "kv_producer", seed=1, async_scheduling=p_async)
    assert type(p.sched).__name__ == ("AsyncScheduler" if p_async else "Scheduler")
    d = pd.make_engine("d", "kv_consumer", seed=2)
    prompt = list(range(1, 45))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert PARAMS_KEY in params
    want = p.tokens(p_blocks, len(prompt))
    got = d.tokens(d_blocks, len(prompt))
    for layer, (a, b) in enumerate(zip(want, got)):
        assert torch_equal(a, b), f"layer {layer} differs"
    # P freed its extent and its blocks once D's READ was done (its DONE, or D's inner
    # NixlConnector's notification after it), well inside P's 30 s lease
    assert pd.run([p, d], lambda: not p.connector._prefill.staged, timeout_s=5)
    assert saw_done(p, d, "r1"), "D's DONE never reached P's own NIXL agent"
    assert pd.run([p, d], lambda: not p.sched.requests, timeout_s=10), \
        "P's blocks were never freed"


def test_a_prefill_on_async_scheduling_is_told_to_turn_it_off(staged_env, caplog):
    """A kv_producer on vLLM's asynchronous scheduling (its default) is told once, at
    start-up, to take --no-async-scheduling (its prompts wait one prefill step more:
    README, "Colocated PD"); a prefill without it and a decode instance are not."""
    import logging

    caplog.set_level(logging.WARNING, logger="kvcached_pd")

    def advised() -> list[str]:
        said = [r.getMessage() for r in caplog.records
                if "--no-async-scheduling" in r.getMessage()]
        caplog.clear()
        return said

    for role, async_on, want in (("kv_producer", True, 1), ("kv_producer", False, 0),
                                 ("kv_consumer", True, 0)):
        e = pd.make_engine(role[3:], role, async_scheduling=async_on)
        try:
            assert len(advised()) == want, (role, async_on)
        finally:
            e.worker.shutdown()


def test_a_prompt_whose_last_chunk_needs_no_new_block_is_packed(staged_env):
    """Chunked prefill: 33 of a 40-token prompt's tokens in the first step take all
    three of its 16-token blocks, so the step that completes the prompt allocates none
    (vLLM hands the connector ``None`` for that step's new blocks). P must still pack
    it: before, P skipped that step, never packed the request and ended it "without
    packing its KV" (push: D's claim answered gone, the request failed; seen on the GPU,
    1 of 64 requests of a tiny load, 2026-11-26)."""
    p = pd.make_engine("p", "kv_producer", seed=3)
    d = pd.make_engine("d", "kv_consumer", seed=4)
    p.sched.max_num_scheduled_tokens = 33
    p.sched.scheduler_config.max_num_batched_tokens = 33
    prompt = list(range(5, 45))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert PARAMS_KEY in params, "P ended the request without packing it"
    want, got = p.tokens(p_blocks, len(prompt)), d.tokens(d_blocks, len(prompt))
    assert all(torch_equal(a, b) for a, b in zip(want, got))
    assert settle(p, d)


def loaded(engine, req_id: str) -> bool:
    """D's request is past its load (its blocks hold the prompt's KV) and not freed."""
    from vllm.v1.request import RequestStatus

    req = engine.sched.requests.get(req_id)
    return req is not None and req.status not in (RequestStatus.WAITING_FOR_REMOTE_KVS,
                                                   RequestStatus.WAITING)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def saw_done(p, d, *req_ids, timeout_s: float = 30.0) -> bool:
    """D's DONE for each request reached P's own NIXL agent. Waited for, not asked once:
    it can arrive after P has freed everything, when vLLM's own notification (pull) or
    P's lease (push, 6 s in these tests) was faster, as it was twice on CI's 2 busy cores
    (a routed pull handoff on vLLM 0.26, a push handoff on 0.30)."""
    want = {(req_id, 0) for req_id in req_ids}
    return pd.run([p, d], lambda: want <= p.done_seen, timeout_s=timeout_s)


def settle(p, d):
    """Both sides hold nothing any more: requests, extents, staging bytes; within 10 s,
    well inside P's 30 s lease (which would free P's side without any notification)."""
    return pd.run([p, d], lambda: not p.sched.requests and not d.sched.requests
                  and staging_used(p) == 0 and staging_used(d) == 0, timeout_s=10)


def staging_used(engine) -> int:
    conn, worker = engine.connector, engine.worker
    used = 0
    if conn._prefill is not None:
        used += conn._prefill.allocator.used_bytes
    if worker._region is not None:
        used += worker._region.decode.allocator.used_bytes
    return used


def test_full_staging_on_both_sides_waits_instead_of_taking_the_direct_path(
        staged_env, monkeypatch):
    # 4 MiB of staging per role holds one 1500-token request (1536 B/token), not two
    monkeypatch.setenv("KVCACHED_PD_STAGING_MB", "4")
    p = pd.make_engine("p", "kv_producer", seed=5, num_blocks=300)
    d = pd.make_engine("d", "kv_consumer", seed=6, num_blocks=300)
    prompts = {f"f{i}": [i + 1] * 1500 for i in range(3)}
    for req_id, prompt in prompts.items():
        p.sched.add_request(pd.prefill_request(req_id, prompt))
    p_blocks, d_blocks, kv = {}, {}, {}
    waits_p = []

    def forward():
        for req_id in prompts:
            o = p.outputs.get(req_id)
            if o is not None and "d-" + req_id not in d.sched.requests and req_id not in p_blocks:
                params = o.kv_transfer_params
                assert PARAMS_KEY in params, "P sent a request without staging"
                ids = params["remote_block_ids"]
                p_blocks[req_id] = list(ids[0] if isinstance(ids[0], list) else ids)
                d.sched.add_request(pd.decode_request("d-" + req_id, prompts[req_id], params))
            if req_id not in d_blocks and loaded(d, "d-" + req_id):
                # compared now: once D frees them, a later request's load may reuse them
                d_blocks[req_id] = d.blocks_of("d-" + req_id)
                kv[req_id] = (p.tokens(p_blocks[req_id], 1500), d.tokens(d_blocks[req_id], 1500))
        waits_p.extend(p.connector._prefill.samples.get("waits", []))
        return len(d_blocks) == len(prompts) and all(
            "d-" + r in d.outputs and d.outputs["d-" + r].finished for r in prompts)

    assert pd.run([p, d], forward, timeout_s=60)
    for req_id, (want, got) in kv.items():
        for layer, (a, b) in enumerate(zip(want, got)):
            assert torch_equal(a, b), f"{req_id}: layer {layer} differs"
    assert not d.connector._decode.refused_peers
    assert settle(p, d)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_explicit_staging_too_small_for_one_request_stops_the_connector(staged_env,
                                                                       monkeypatch, role):
    """KVCACHED_PD_STAGING_MB below one max_model_len request (here 2048 tokens x
    1.5 KiB = 3 MiB) would make such a request wait for room forever: vLLM's factory
    cannot build the connector, in the scheduler or in a worker, so startup stops."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcached_pd import config
    from kvcached_pd.transport.sizing import StagingSizeError
    from tests.support import vllm_nixl_worker as vw

    monkeypatch.setenv("KVCACHED_PD_STAGING_MB", "1")
    config.reset_settings_for_tests()
    vllm_config = pd.connector_config("kv_both", 16, 40, engine_id="small")
    vw.ensure_distributed(vllm_config)
    pd.resolve_layout(vllm_config)
    kv_cache_config = vw.kv_cache_config(pd.LAYER_NAMES, 40, 16, pd.HEADS, pd.HEAD_DIM)
    with set_current_vllm_config(vllm_config), pytest.raises(
            StagingSizeError, match="=1 cannot hold the KV of one max_model_len=2048 request"):
        KVConnectorFactory.create_connector(vllm_config, KVConnectorRole[role], kv_cache_config)


def test_decode_aborts_before_scheduling_and_mid_read_free_both_sides(staged_env):
    from vllm.v1.request import RequestStatus

    p = pd.make_engine("p", "kv_producer", seed=7)
    d = pd.make_engine("d", "kv_consumer", seed=8)
    params = {}
    for req_id in ("early", "mid", "late"):
        p.sched.add_request(pd.prefill_request(req_id, list(range(5, 50))))
    assert pd.run([p], lambda: all(r in p.outputs for r in ("early", "mid", "late")))
    for req_id in ("early", "mid", "late"):
        params[req_id] = p.outputs[req_id].kv_transfer_params
        d.sched.add_request(pd.decode_request("d-" + req_id, list(range(5, 50)),
                                              params[req_id]))
    d.sched.finish_requests(["d-early"], RequestStatus.FINISHED_ABORTED)  # never scheduled
    d.step()  # schedules mid and late: their READs are posted
    assert d.worker._decode_worker.inflight or d.worker._decode_worker.queued or \
        d.sched.requests["d-mid"].status != RequestStatus.WAITING_FOR_REMOTE_KVS
    d.sched.finish_requests(["d-mid"], RequestStatus.FINISHED_ABORTED)
    assert pd.run([p, d], lambda: "d-late" in d.outputs and d.outputs["d-late"].finished)
    assert settle(p, d), "an abort left blocks or staging behind"


def test_prefill_abort_before_its_prompt_completes_frees_the_extent(staged_env):
    from vllm.v1.request import RequestStatus

    p = pd.make_engine("p", "kv_producer", seed=9)
    p.sched.add_request(pd.prefill_request("gone", list(range(7, 90))))
    p.sched.add_request(pd.prefill_request("kept", list(range(7, 40))))
    p.sched.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    assert pd.run([p], lambda: "kept" in p.outputs)
    assert "gone" not in p.connector._prefill.staged


LEASE_S = 10  # P's KV lease in the tests that run past it


def short_lease(monkeypatch, seconds: float) -> dict:
    """The extra config that gives P a KV lease of ``seconds``: vLLM 0.23+ reads
    ``kv_lease_duration`` there, 0.20-0.22 VLLM_NIXL_ABORT_REQUEST_TIMEOUT."""
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", str(int(seconds)))
    return {"kv_lease_duration": seconds}


def test_prefill_16_decode_32_block_sizes_hand_off_and_finish_cleanly(staged_env, monkeypatch,
                                                                      caplog):
    """P with 16-token blocks, D with 32 (vLLM's handshake allows it for pull). vLLM's
    notify-only read with no local block indexes an empty remote block list when the
    sizes differ (IndexError: the decode EngineCore died on the 2 x H200 host), so D
    must never leave such a request to it: the KV arrives exactly, D lives on and
    settles, and P frees the extent and the blocks on D's DONE. When the inner
    connector's lease runs out later, P neither reports a request a second time
    (vLLM's scheduler asserts on an unknown request: P's EngineCore would die) nor
    warns that it released expired blocks."""
    import logging

    from kvcached_pd import vllm_api

    caplog.set_level(logging.WARNING)
    extra = short_lease(monkeypatch, LEASE_S)
    p = pd.make_engine("p", "kv_producer", block_size=16, seed=11, extra=extra)
    d = pd.make_engine("d", "kv_consumer", block_size=32, seed=12, extra=extra)
    for i, n in enumerate((17, 45)):
        req = f"bs{i}"
        prompt = list(range(3, 3 + n))
        p.sched.add_request(pd.prefill_request(req, prompt))
        assert pd.run([p], lambda: req in p.outputs)
        params = p.outputs[req].kv_transfer_params
        assert PARAMS_KEY in params
        ids = params["remote_block_ids"]
        p_blocks = list(ids[0] if isinstance(ids[0], list) else ids)
        d.sched.add_request(pd.decode_request("d-" + req, prompt, params))
        got = {}

        def done():
            if not got and loaded(d, "d-" + req):
                got["kv"] = d.tokens(d.blocks_of("d-" + req), n)
            return "d-" + req in d.outputs and d.outputs["d-" + req].finished
        assert pd.run([p, d], done)
        for layer, (a, b) in enumerate(zip(p.tokens(p_blocks, n), got["kv"])):
            assert torch_equal(a, b), f"{req}: layer {layer} differs"
        assert pd.run([p, d], lambda: req not in p.sched.requests, timeout_s=LEASE_S)
        # freed by the staged path on D's DONE, not by the inner connector's lease
        assert p.worker._prefill_worker.reported_early(req), "P's blocks waited for the lease"
    finished_at = time.monotonic()
    # D keeps stepping without dying; nothing is left on either side
    assert settle(p, d)
    # past the inner connector's lease: its own report of each request comes and goes
    pd.run([p, d], lambda: time.monotonic() - finished_at > LEASE_S + 2,
           timeout_s=LEASE_S + 5)
    assert not p.worker._prefill_worker._sent_early, "the inner lease's report never came"
    assert settle(p, d)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if vllm_api.LEASE_EXPIRY_MESSAGE in m], warned
    assert not [m for m in warned if "lease" in m and "kvcached-pd" in m], warned


@pytest.mark.parametrize("d_block_size", [16, 32])
def test_a_prefill_that_predates_freeing_on_done_is_still_freed(staged_env, caplog,
                                                                d_block_size):
    """A kvcached-pd P of an earlier build frees only its extent on D's DONE and sends
    no ``frees_on_done``: D still asks vLLM's connector to notify it once the load is
    done, so its blocks are freed while D decodes (not only when D's request ends);
    with P 16 / D 32, where vLLM cannot notify, D says once that that P holds its
    blocks to the lease."""
    import logging

    from vllm.v1.request import RequestStatus

    caplog.set_level(logging.WARNING, logger="kvcached_pd")
    p = pd.make_engine("p", "kv_producer", seed=13)
    d = pd.make_engine("d", "kv_consumer", seed=14, block_size=d_block_size)
    p.worker._prefill_worker.finished_sending = lambda inner: inner  # the earlier P
    prompt = list(range(5, 50))
    p.sched.add_request(pd.prefill_request("o1", prompt))
    assert pd.run([p], lambda: "o1" in p.outputs)
    params = p.outputs["o1"].kv_transfer_params
    assert params[PARAMS_KEY].pop("frees_on_done") is True
    # D decodes for as long as the test needs (its request ending would notify P too)
    d.sched.add_request(pd.decode_request("d-o1", prompt, params, max_tokens=1 << 20))
    assert pd.run([p, d], lambda: loaded(d, "d-o1") and not p.connector._prefill.staged,
                  timeout_s=10)
    warned = [r.getMessage() for r in caplog.records if "predates" in r.getMessage()]
    if d_block_size == 16:
        assert pd.run([p, d], lambda: "o1" not in p.sched.requests, timeout_s=10), \
            "D no longer asks vLLM to notify an earlier P when its load is done"
        assert not warned
    else:
        pd.run([p, d], lambda: False, timeout_s=1)
        assert "o1" in p.sched.requests  # held to the lease, as that P did
        assert len(warned) == 1 and "KV lease" in warned[0]
    assert not d.outputs.get("d-o1") or not d.outputs["d-o1"].finished
    d.sched.finish_requests(["d-o1"], RequestStatus.FINISHED_ABORTED)
    assert pd.run([p, d], lambda: not d.sched.requests and staging_used(d) == 0)


@pytest.fixture
def metrics_patch(staged_env):
    from kvcached_pd import config
    from kvcached_pd.patches import get_patch

    config.reset_settings_for_tests()
    patch = get_patch("connector_metrics")
    patch.patch()
    yield
    patch.unpatch()


def test_staged_series_reach_the_schedulers_stats_for_prometheus(metrics_patch):
    """What the API server's Prometheus logger receives is SchedulerStats'
    ``kv_connector_stats``, built by vLLM's scheduler from the worker's and its own
    connector stats: P's pack time and staging occupancy, D's READ and handoff times
    and occupancy must all be in it (the unpack time is device time: a GPU's only).
    Without the connector_metrics patch vLLM's ``is_empty`` drops what carries no
    transfer of vLLM's own, so the scheduler's half would be lost."""
    p = pd.make_engine("p", "kv_producer", seed=1)
    d = pd.make_engine("d", "kv_consumer", seed=2)
    handoff(p, d, "r1", list(range(1, 45)))
    assert pd.run([p, d], lambda: not p.connector._prefill.staged, timeout_s=5)
    assert p.series("kvcached_pd_pack_duration"), p.stats
    # vLLM 0.20-0.23's scheduler forwards its connector's own stats only along with the
    # worker's: an idle P's release sample waits for the next step that carries any
    # (a stale occupancy gauge there, noted in the issue); later releases send it alone
    if vllm_release() >= (0, 24):
        assert pd.run([p, d], lambda: p.series("kvcached_pd_prefill_staging_bytes")[-1:]
                      == [0], timeout_s=5), p.series("kvcached_pd_prefill_staging_bytes")
    else:
        assert p.series("kvcached_pd_prefill_staging_bytes")
    for key in ("kvcached_pd_read_duration", "kvcached_pd_handoff_duration"):
        assert d.series(key), (key, d.stats)
    assert d.series("kvcached_pd_decode_staging_bytes")[-1] == 0


@pytest.mark.parametrize("spin_s", [10.0, 0.0])
def test_decode_waits_within_the_step_for_a_read_about_to_end(staged_env, spin_s):
    """vLLM sees a finished load only at the next ``get_finished``: with a spin budget D
    waits inside the step for a READ predicted to end within it, so the first poll after
    the READ was posted reports it (on the host: READ seen 2.43 ms after posting without
    the spin, 0.53 ms with it). Without a budget (0) the in-process UCX READ is still
    running at that poll; the budget here is generous because how fast UCX is on a
    loaded CI machine is not the test's business."""
    p = pd.make_engine("p", "kv_producer", seed=1)
    d = pd.make_engine("d", "kv_consumer", seed=2)
    worker = d.worker._decode_worker
    assert worker.spin_s == 0.001  # KVCACHED_PD_READ_SPIN_US's default reached D
    worker.spin_s = spin_s
    first_polls = []
    inflight = worker.inflight  # the worker's own dict, read before each poll

    def poll(real_poll):
        posted = set(inflight)
        finished, failed, invalid = real_poll()
        first_polls.extend((req_id, req_id in finished) for req_id in posted
                           if req_id not in {r for r, _ in first_polls})
        return finished, failed, invalid

    pd.wrap_method(worker, "poll", poll)
    handoff(p, d, "r1", list(range(1, 45)))
    assert first_polls == [("d-r1", spin_s > 0)]


@pytest.mark.parametrize("inner,p_async", [("NixlConnector", True), ("NixlPushConnector", True),
                                           ("NixlConnector", False),
                                           ("NixlPushConnector", False)],
                         ids=["pull", "push", "pull-p-sync", "push-p-sync"])
def test_many_aborts_on_both_sides_leak_nothing(staged_env, monkeypatch, inner, p_async):
    """Rounds of mixed-length requests through P and D, P's staging small enough that
    prefills wait for room and long prompts chunked, aborts on P (waiting for room, mid
    prefill) and on D (before scheduling, with the READ in flight, while decoding):
    every request that completes has P's KV exactly, D stays alive, and at the end
    neither side holds a request, a block, or a byte of staging. Pull mode must settle
    by notifications, well inside P's 30 s KV lease; push mode frees what a D-side
    abort left on P at that lease (10 s here), as vLLM's push does. P on vLLM's
    asynchronous scheduler and on its plain one (``--no-async-scheduling``)."""
    from vllm.v1.request import RequestStatus

    from kvcached_pd import vllm_api

    if inner != "NixlConnector" and vllm_api.current().push_name != inner:
        pytest.skip("vLLM has push mode (NixlPushConnector) from 0.24 on")
    monkeypatch.setenv("KVCACHED_PD_STAGING_MB", "4")  # ~2 x 1300-token extents
    lease = 30 if inner == "NixlConnector" else 10
    p = pd.make_engine("p", "kv_producer", seed=31, num_blocks=600, inner=inner,
                       extra={"kv_lease_duration": lease}, async_scheduling=p_async)
    assert type(p.sched).__name__ == ("AsyncScheduler" if p_async else "Scheduler")
    d = pd.make_engine("d", "kv_consumer", seed=32, num_blocks=600, inner=inner,
                       extra={"kv_lease_duration": lease})
    settle_s = 15 if inner == "NixlConnector" else lease + 15
    p.sched.max_num_scheduled_tokens = 512  # long prompts are prefilled in chunks
    p.sched.scheduler_config.max_num_batched_tokens = 512
    prompts, p_blocks, checked, aborted, waited = {}, {}, set(), set(), set()
    mid_prefill_aborts: list[str] = []
    try:
        for round_ in range(6):
            ids = [f"r{round_}-{i}" for i in range(4)]
            for i, req_id in enumerate(ids):
                prompts[req_id] = [(round_ * 7 + i + t) % 500 + 1
                                   for t in range(100 + 400 * i + 13 * round_)]
                p.sched.add_request(pd.prefill_request(req_id, prompts[req_id]))
            p.step()
            if round_ % 2:  # on P: one mid-prefill (its extent reserved), one waiting for room
                prefill = p.connector._prefill
                mid = [r for r in ids if r in prefill.staged and prefill.staged[r].order is None]
                victims = mid[:1] + [r for r in ids if r in prefill.waiting][:1]
                assert victims, "nothing on P to abort mid-prefill or waiting"
                p.sched.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
                aborted.update(victims)
                mid_prefill_aborts.extend(mid[:1])
            sent = set()

            def forward():
                waited.update(p.connector._prefill.waiting)
                for req_id in ids:
                    out = p.outputs.get(req_id)
                    if out is not None and req_id not in sent:
                        sent.add(req_id)
                        params = out.kv_transfer_params
                        assert PARAMS_KEY in params, "P sent a request without staging"
                        got = params["remote_block_ids"]
                        p_blocks[req_id] = list(got[0] if isinstance(got[0], list) else got)
                        d.sched.add_request(pd.decode_request(req_id, prompts[req_id], params))
                        if (round_ + ids.index(req_id)) % 3 == 0:  # on D, before scheduling
                            d.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
                            aborted.add(req_id)
                    elif req_id in sent and req_id not in checked | aborted and loaded(d, req_id):
                        n = len(prompts[req_id])
                        want = p.tokens(p_blocks[req_id], n)
                        got_kv = d.tokens(d.blocks_of(req_id), n)
                        for layer, (a, b) in enumerate(zip(want, got_kv)):
                            assert torch_equal(a, b), f"{req_id}: layer {layer} differs"
                        checked.add(req_id)
                        if round_ % 3 == 1:  # on D, while decoding
                            d.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
                            aborted.add(req_id)
                    elif req_id in sent and req_id not in aborted and round_ % 3 == 2 and \
                            d.sched.requests.get(req_id) is not None and \
                            d.worker._decode_worker.inflight.get(req_id) is not None:
                        d.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
                        aborted.add(req_id)  # on D, with its READ in flight
                return all(r in aborted or (r in d.outputs and d.outputs[r].finished)
                           for r in ids if r in sent) and \
                    all(r in sent or r in aborted for r in ids)

            assert pd.run([p, d], forward, timeout_s=60), (
                f"round {round_} never finished: sent {sorted(sent)}, aborted "
                f"{sorted(aborted & set(ids))}, P has {sorted(p.sched.requests)}, D has "
                f"{ {r: str(q.status) for r, q in d.sched.requests.items()} }, P waits "
                f"{sorted(p.connector._prefill.waiting)}")
        assert pd.run([p, d], lambda: not p.sched.requests and not d.sched.requests
                      and staging_used(p) == 0 and staging_used(d) == 0
                      and not p.connector._prefill.staged, timeout_s=settle_s), (
            f"left behind: P {sorted(p.sched.requests)}, D {sorted(d.sched.requests)}, "
            f"P extents {sorted(p.connector._prefill.staged)}, staging P "
            f"{staging_used(p)} D {staging_used(d)}")
        assert waited, "no prefill ever waited for room"
        assert not d.connector._decode.refused_peers  # no request left the staged path
        assert len(aborted) >= 8 and len(checked) >= 6, (len(aborted), len(checked))
        assert mid_prefill_aborts, "no prefill was aborted with its extent reserved"
    finally:
        for engine in (p, d):
            engine.worker.shutdown()


def test_a_staged_read_nixl_refuses_fails_the_load_and_frees_the_extent(staged_env):
    """NIXL refuses to start D's READ: D lives, the request's load fails through vLLM's
    own path (its blocks reported invalid) and D's extent for it is freed."""
    p = pd.make_engine("p", "kv_producer", seed=13)
    d = pd.make_engine("d", "kv_consumer", seed=14)
    agent = d.worker._region.agent
    real_transfer = agent.agent.transfer
    refused = []

    def transfer(handle, *args, **kwargs):
        refused.append(handle)
        raise RuntimeError("NIXL_ERR_BACKEND (injected)")

    agent.agent.transfer = transfer
    invalid = pd.record_load_errors(d)
    prompt = list(range(3, 40))
    p.sched.add_request(pd.prefill_request("x1", prompt))
    assert pd.run([p], lambda: "x1" in p.outputs)
    params = p.outputs["x1"].kv_transfer_params
    assert PARAMS_KEY in params
    d.sched.add_request(pd.decode_request("d-x1", prompt, params))
    assert pd.run([p, d], lambda: bool(invalid), timeout_s=10), "no failed load reported"
    agent.agent.transfer = real_transfer
    assert len(refused) == 1 and not d.worker._decode_worker.inflight
    assert len(invalid) == -(-len(prompt) // 16)  # the request's blocks
    assert pd.run([p, d], lambda: not d.sched.requests and staging_used(d) == 0,
                  timeout_s=10), "D kept the request or its extent"


_DROP = object()  # the field is absent


@pytest.mark.parametrize("change,reason", [
    ({"format_digest": "0" * 16}, "its packed format"),
    ({"wire_version": 99}, "wire version 99"),
    ({"tp_size": 2}, "its TP size 2 differs"),
    ({"nbytes": 1 << 40}, "exceed the"),
    ({"offset": "far"}, "malformed kvcached_pd"),
    ({"frees_on_done": "yes"}, "malformed kvcached_pd"),
    # what a client may write into kv_transfer_params (vLLM's JSON reads Infinity/NaN)
    ({"offset": float("inf")}, "offset=inf is not an integer"),
    ({"offset": -1}, "offset not negative"),
    ({"offset": 1 << 64}, "outside"),
    ({"nbytes": 0}, "must be positive"),
    ({"nbytes": 24576}, "differ from what its n_tok_slots pack into"),
    ({"num_tokens": 40}, "fill 48 slots, not 16"),
    ({"num_tokens": 11}, "differ from its prompt's length"),
    ({"num_tokens": 9}, "differ from its prompt's length"),
    ({"block_size": 0}, "block_size 0"),
    ({"lease_s": float("nan")}, "is not finite"),
    ({"lease_s": 0}, "lease_s must be in"),
    ({"lease_s": 1e300}, "lease_s must be in"),
    ({"port": 70000}, "is not a TCP port"),
    ({"request_id": "\ud800"}, "request_id is not valid UTF-8"),
    ({"token": "AB" * 16}, "token is not 32 lowercase hex digits"),
    ({"wire_version": 2, "token": _DROP}, "lacks ['token']"),
], ids=["format", "wire-version", "tp-size", "larger-than-staging", "malformed",
        "malformed-flag", "offset-inf", "offset-negative", "offset-huge", "nbytes-zero",
        "nbytes-not-packed-size", "slots-mismatch", "num-tokens-beyond-prompt",
        "num-tokens-short-of-prompt", "block-size-zero", "lease-nan", "lease-zero",
        "lease-absurd", "port", "request-id-surrogate", "token-case", "older-wire"])
def test_decode_leaves_a_request_it_cannot_stage_to_the_inner_connector(change, reason):
    """What D's scheduler checks before it takes a request onto the staged path (P's
    params, no handshake yet): a P of another wire version, packed format or TP size,
    an extent larger than D's whole staging, or malformed params go to vLLM's own
    path, counted as a fallback, with the reason logged once per P. Every field is the
    client's to forge: each malformed or inconsistent one is refused here, for that
    request only (vLLM's own path reads P's blocks as vLLM does), never raised."""
    import torch

    from kvcached_pd.connector.decode_scheduler import DecodeScheduler
    from kvcached_pd.connector.wire import WIRE_VERSION, StagedParams, format_hash
    from kvcached_pd.transport.format import PackedFormat

    fmt = PackedFormat.for_cache(pd.LAYERS, pd.HEADS, pd.HEAD_DIM, torch.float16)
    decode = DecodeScheduler(digest=format_hash(fmt, 0, pd.HEADS), block_size=16,
                             capacity_bytes=4 << 20, tp_size=1, fmt=fmt)
    p_params = StagedParams(
        wire_version=WIRE_VERSION, engine_id="p-1", request_id="x", host="127.0.0.1",
        port=1, tp_size=1, offset=0, nbytes=fmt.extent_bytes(16), n_tok_slots=16,
        num_tokens=10, block_size=16, lease_s=30.0, format_digest=decode.digest,
        token="ab" * 16).to_params()
    good = pd.decode_request("good", list(range(10)), {
        "do_remote_prefill": True, "remote_engine_id": "p-1", PARAMS_KEY: p_params})
    assert decode.staged_params(good) is not None  # the unchanged params are staged
    # what a P older than frees_on_done sends: still staged, the flag read as False
    older = pd.decode_request("older", list(range(10)), {
        "do_remote_prefill": True, "remote_engine_id": "p-1",
        PARAMS_KEY: {k: v for k, v in p_params.items() if k != "frees_on_done"}})
    assert decode.staged_params(older).frees_on_done is False
    forged = {k: v for k, v in {**p_params, **change}.items() if v is not _DROP}
    bad = pd.decode_request("bad", list(range(10)), {
        "do_remote_prefill": True, "remote_engine_id": "p-1", PARAMS_KEY: forged})
    assert decode.staged_params(bad) is None
    assert reason in decode.refused_peers["p-1"]
    assert decode.take_samples() == {"direct_fallbacks": [1]}


def test_trace_follows_one_handoff_on_both_sides(staged_env, monkeypatch, caplog):
    """``KVCACHED_PD_TRACE=1``: one line per event, in the order the request meets them
    on each side, with the fields experiments/trace_timeline.py joins and times them by
    (D's ``remote_req`` is P's request id)."""
    import logging

    from kvcached_pd.transport import trace

    monkeypatch.setenv("KVCACHED_PD_TRACE", "1")
    trace.reset()
    caplog.set_level(logging.INFO, logger="kvcached_pd")
    try:
        p = pd.make_engine("p", "kv_producer", seed=17)
        d = pd.make_engine("d", "kv_consumer", seed=18)
        handoff(p, d, "t1", list(range(2, 42)))
        assert pd.run([p, d], lambda: not p.connector._prefill.staged, timeout_s=5)
    finally:
        trace.reset()
    events = [e for e in (trace.parse_line(r.getMessage()) for r in caplog.records) if e]
    on_p = [e for e in events if e["req"] == "t1"]
    on_d = [e for e in events if e["req"] == "d-t1"]
    # P's blocks released on D's DONE: when the DONE came before vLLM's notification
    blocks = [e for e in on_p if e["ev"] == "p_blocks_released"]
    assert len(blocks) <= 1
    on_p = [e for e in on_p if e["ev"] != "p_blocks_released"]
    assert [e["ev"] for e in on_p] == ["p_admit", "pack_ordered", "packed", "p_finished",
                                       "p_released"]
    assert [e["ev"] for e in on_d] == ["d_match", "d_alloc", "read_posted", "read_done",
                                       "d_recv_reported", "d_compute_scheduled"]
    assert all(e["t"] > on_p[3]["t"] for e in blocks)
    admit, pack_ordered, packed, _, released = on_p
    d_match, d_alloc, posted, done, _, compute = on_d
    assert pack_ordered["tokens"] == d_alloc["tokens"] == d_match["tokens"] == 40
    assert admit["bytes"] == packed["bytes"] and admit["waited"] is False
    assert posted["remote_req"] == d_alloc["remote_req"] == "t1"
    assert posted["bytes"] == done["bytes"] == packed["bytes"] > 0
    assert done["handoff_ms"] >= 0 and packed["device_ms"] >= 0
    assert packed["host_ms"] >= 0 and done["host_ms"] >= 0 and done["tag_ms"] >= 0
    # held_ms was once a monotonic time taken from a wall-clock one (~1.8e12 ms)
    assert 0 <= released["held_ms"] < 30_000
    assert compute["tokens"] >= 1
    assert [e["t"] for e in on_p] == sorted(e["t"] for e in on_p)
    assert [e["t"] for e in on_d] == sorted(e["t"] for e in on_d)


def test_trace_times_each_step_that_computed_tokens(staged_env, monkeypatch, caplog):
    """``step`` lines: one per scheduler step that computed tokens, with its period (the
    scheduler's next round), on both sides; none for steps that computed nothing, none
    with the trace off."""
    import logging

    from kvcached_pd.transport import trace

    caplog.set_level(logging.INFO, logger="kvcached_pd")
    for on in (True, False):
        monkeypatch.setenv("KVCACHED_PD_TRACE", "1" if on else "0")
        trace.reset()
        caplog.clear()
        try:
            p = pd.make_engine("p", "kv_producer", seed=19)
            d = pd.make_engine("d", "kv_consumer", seed=20)
            handoff(p, d, f"s{on}", list(range(2, 42)))
            for engine in (p, d):  # one more round each: the last step's line
                engine.step()
        finally:
            trace.reset()
        steps = [e for e in (trace.parse_line(r.getMessage()) for r in caplog.records)
                 if e and e["ev"] == "step"]
        if not on:
            assert steps == []
            continue
        assert steps and all(e["tokens"] > 0 and e["reqs"] >= 1 for e in steps)
        assert all(0 <= e["until_next_ms"] < 30_000 and e["start"] <= e["t"] for e in steps)
        # P's prefill of the 40-token prompt, and D's own forward of its last token
        assert 40 in [e["tokens"] for e in steps]
        assert any(e["tokens"] < 40 for e in steps)


def test_a_connector_left_without_shutdown_can_be_collected(staged_env):
    """Nothing process-wide (the lease-expiry log filter on vLLM's logger) keeps a
    connector alive: each one holds a NIXL agent whose UCX progress thread polls while
    it lives, and a filter that held its worker kept every engine of the CPU suite
    alive (vLLM 0.30's NIXL tests took 504 s instead of 139 s on 2 cores)."""
    import gc
    import weakref

    # the first engine of a process stays: a traceback kept by one of the modules it
    # imports holds make_engine's frame
    pd.make_engine("w", "kv_producer", seed=21)
    p = pd.make_engine("p", "kv_producer", seed=19)
    d = pd.make_engine("d", "kv_consumer", seed=20)
    handoff(p, d, "g1", list(range(4, 30)))
    refs = [weakref.ref(p.worker._prefill_worker), weakref.ref(d.worker._decode_worker)]
    del p, d
    gc.collect()
    assert [r() for r in refs] == [None, None]
