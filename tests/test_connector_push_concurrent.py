"""Push mode with concurrent legs: the decode leg reaches D before P has answered.

vLLM's push design lets a proxy send both legs at once, so that D allocates its blocks
while P still prefills; D then knows only P's vLLM side-channel address, not where P
will stage the request. kvcached-pd's D claims the staged params from P's listener
(``side_channel``): every test here runs vLLM's real AsyncSchedulers and push
connectors over real NIXL agents (UCX, host memory), and checks that such a request
still moves by the staged READ (never vLLM's per-block WRITE into D's memory, the
0.5 GB/s path with kvcached), exactly, and that aborts on either side leave nothing.
"""

from __future__ import annotations

import logging
import time

import pytest

from kvcached_pd import vllm_api
from kvcached_pd.connector.side_channel import claim_port
from tests.support import connector_pd as pd
from tests.test_connector_mixed import assert_same_kv, settled
from tests.test_connector_pd import loaded, saw_done, staged_env  # noqa: F401 (fixture)
from tests.test_connector_push import LEASE_S, PUSH, engine, shut_down  # noqa: F401

pytestmark = pytest.mark.skipif(
    vllm_api.api_for(None) is None or vllm_api.current().push_name != PUSH,
    reason="vLLM has push mode (NixlPushConnector) from 0.24 on")

PROMPT = list(range(3, 50))  # 47 tokens: two full 16-token blocks and a partial one


def concurrent_params(p: pd.Engine, req_id: str) -> dict:
    """What a push-mode proxy gives D before P answered: P's vLLM coordinates only
    (vLLM's push_scheduler reads these in update_state_after_alloc)."""
    return {"do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": engine_id(p), "remote_host": "localhost",
            "remote_port": p.port, "tp_size": 1, "pp_size": 1,
            "remote_request_id": req_id}


def engine_id(e: pd.Engine) -> str:
    return str(e.sched.vllm_config.kv_transfer_config.engine_id)


def watch_per_block_writes(p: pd.Engine) -> list:
    writes: list = []
    pd.wrap_method(p.worker._inner.connector_worker, "_do_start_push_kv",
                   lambda real, *a, **k: writes.append(a) or real(*a, **k))
    return writes


def both_legs(p: pd.Engine, d: pd.Engine, req_id: str, prompt: list[int],
              d_first: bool = True):
    """Send the decode leg (first, by default) and the prefill leg together; run both
    until D finished. Returns each layer's K and V on P and on D, taken while D held
    the loaded blocks."""
    legs = [lambda: d.sched.add_request(pd.decode_request(req_id, prompt,
                                                          concurrent_params(p, req_id))),
            lambda: p.sched.add_request(pd.prefill_request(req_id, prompt))]
    for leg in (legs if d_first else legs[::-1]):
        leg()
    kv = {}

    def finished():
        if not kv and loaded(d, req_id) and req_id in p.outputs:
            ids = p.outputs[req_id].kv_transfer_params["remote_block_ids"]
            p_blocks = list(ids[0] if isinstance(ids[0], list) else ids)
            kv["p"] = p.tokens(p_blocks, len(prompt))
            kv["d"] = d.tokens(d.blocks_of(req_id), len(prompt))
        return req_id in d.outputs and d.outputs[req_id].finished
    assert pd.run([p, d], finished), "D never finished the request"
    assert kv, "D's request was never seen loaded"
    return kv["p"], kv["d"]


def test_a_decode_leg_sent_before_p_answered_is_staged(staged_env, shut_down):
    """D allocates while P has not even scheduled the prefill, claims the params from
    P's listener, and READs the extent: the KV arrives exactly, no PUSH_REG reaches P
    (no per-block WRITE), and P frees its blocks on D's DONE, long before its lease."""
    p = engine(shut_down, "p", "kv_producer", 41)
    d = engine(shut_down, "d", "kv_consumer", 42)
    assert p.connector._listener.port == claim_port(p.port)
    writes = watch_per_block_writes(p)
    d.sched.add_request(pd.decode_request("c1", PROMPT, concurrent_params(p, "c1")))
    # D asks P's listener once whether it answers claims, then allocates at once
    assert pd.run([d], lambda: "c1" in d.connector._decode.pending
                  and d.connector._decode.pending["c1"].loading, timeout_s=5), \
        "D did not take the request while P had not seen it"
    assert d.connector._decode.pending["c1"].claim is not None
    assert "c1" in d.worker._decode_worker.queued  # its claim waits for P
    p.sched.add_request(pd.prefill_request("c1", PROMPT))
    kv = {}

    def finished():
        if not kv and loaded(d, "c1") and "c1" in p.outputs:
            ids = p.outputs["c1"].kv_transfer_params["remote_block_ids"]
            kv["p"] = p.tokens(list(ids[0] if isinstance(ids[0], list) else ids), len(PROMPT))
            kv["d"] = d.tokens(d.blocks_of("c1"), len(PROMPT))
        return "c1" in d.outputs and d.outputs["c1"].finished
    assert pd.run([p, d], finished), "D never finished the request"
    assert_same_kv(kv["p"], kv["d"], len(PROMPT))
    # D can finish decoding before its DONE reaches P
    assert saw_done(p, d, "c1", timeout_s=LEASE_S / 3), \
        "P never got D's DONE: the staged READ did not run"
    assert not writes, "P started vLLM's per-block push WRITE"
    assert pd.run([p, d], lambda: not p.sched.requests, timeout_s=LEASE_S / 3), \
        "P's blocks were not freed on D's DONE"
    assert not d.connector._decode.refused_peers
    assert settled(p, d)


def test_a_claim_after_p_finished_is_answered_at_once(staged_env, shut_down):
    """The prefill leg first: P has finished and published the params when D's claim
    arrives (a proxy whose legs race either way)."""
    p = engine(shut_down, "p", "kv_producer", 43)
    d = engine(shut_down, "d", "kv_consumer", 44)
    # D's handshakes with P first: with the prefill leg first, D's first handshake would
    # start only after P finished, and D starts no READ past half of P's lease (3 s here):
    # on 2 cores loaded by other work that handshake once took longer (2026-11-27, vLLM
    # 0.26.0), and the load failed for it, which is not what this test is about
    both_legs(p, d, "c2-warm", PROMPT)
    writes = watch_per_block_writes(p)
    p.sched.add_request(pd.prefill_request("c2", PROMPT))
    assert pd.run([p], lambda: "c2" in p.outputs)
    d.sched.add_request(pd.decode_request("c2", PROMPT, concurrent_params(p, "c2")))
    kv = {}
    ids = p.outputs["c2"].kv_transfer_params["remote_block_ids"]
    p_blocks = list(ids[0] if isinstance(ids[0], list) else ids)

    def finished():
        if not kv and loaded(d, "c2"):
            kv["p"] = p.tokens(p_blocks, len(PROMPT))
            kv["d"] = d.tokens(d.blocks_of("c2"), len(PROMPT))
        return "c2" in d.outputs and d.outputs["c2"].finished
    assert pd.run([p, d], finished)
    assert_same_kv(kv["p"], kv["d"], len(PROMPT))
    assert saw_done(p, d, "c2"), "P never got D's DONE: the staged READ did not run"
    assert settled(p, d) and not writes


@pytest.mark.parametrize("p_async", [True, False], ids=["p-async", "p-sync"])
def test_many_concurrent_legs_of_mixed_length(staged_env, shut_down, p_async):
    """Several requests of different lengths, legs sent together in both orders: each
    is staged and exact, and both sides end with nothing held; with P on vLLM's
    asynchronous scheduler and on its plain one (``--no-async-scheduling``, what the
    README advises for a prefill instance)."""
    p = engine(shut_down, "p", "kv_producer", 45, async_scheduling=p_async)
    assert type(p.sched).__name__ == ("AsyncScheduler" if p_async else "Scheduler")
    d = engine(shut_down, "d", "kv_consumer", 46)
    writes = watch_per_block_writes(p)
    lengths = {"m0": 5, "m1": 17, "m2": 33, "m3": 64, "m4": 90}
    prompts = {r: list(range(7 + i, 7 + i + n)) for i, (r, n) in enumerate(lengths.items())}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        legs = [lambda r=req_id, pr=prompt: d.sched.add_request(
                    pd.decode_request(r, pr, concurrent_params(p, r))),
                lambda r=req_id, pr=prompt: p.sched.add_request(pd.prefill_request(r, pr))]
        for leg in (legs if i % 2 else legs[::-1]):
            leg()
    kv = {}

    def finished():
        for req_id, prompt in prompts.items():
            if req_id not in kv and loaded(d, req_id) and req_id in p.outputs:
                ids = p.outputs[req_id].kv_transfer_params["remote_block_ids"]
                p_blocks = list(ids[0] if isinstance(ids[0], list) else ids)
                kv[req_id] = (p.tokens(p_blocks, len(prompt)),
                              d.tokens(d.blocks_of(req_id), len(prompt)))
        return all(r in d.outputs and d.outputs[r].finished for r in prompts)
    assert pd.run([p, d], finished, timeout_s=60)
    for req_id, (want, got) in kv.items():
        assert_same_kv(want, got, lengths[req_id])
    assert set(kv) == set(prompts)
    assert saw_done(p, d, *prompts), "P never got every DONE: a staged READ did not run"
    assert settled(p, d) and not writes


def test_a_prefill_abort_fails_the_claimed_load_at_once(staged_env, shut_down, caplog):
    """P aborts the prefill while D's claim waits: P's listener answers "gone", D's
    load fails within a few steps (not at the end of its 30 s wait), D lives, and
    nothing is left on either side."""
    from vllm.v1.request import RequestStatus

    p = engine(shut_down, "p", "kv_producer", 47)
    d = engine(shut_down, "d", "kv_consumer", 48)
    p.sched.max_num_scheduled_tokens = 64  # the prompt is prefilled in 7 chunks
    p.sched.scheduler_config.max_num_batched_tokens = 64
    long_prompt = list(range(1, 400))
    p.sched.add_request(pd.prefill_request("a1", long_prompt))
    d.sched.add_request(pd.decode_request("a1", long_prompt, concurrent_params(p, "a1")))
    assert pd.run([d], lambda: "a1" in d.worker._decode_worker.queued, timeout_s=5)
    p.step()  # P admitted it (its extent reserved) and started the prefill
    assert "a1" in p.connector._prefill.staged
    assert p.sched.requests["a1"].num_computed_tokens < len(long_prompt)
    p.sched.finish_requests(["a1"], RequestStatus.FINISHED_ABORTED)
    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    t0 = time.monotonic()
    assert pd.run([p, d], lambda: "a1" in d.outputs and d.outputs["a1"].finished,
                  timeout_s=10), "D's request never ended"
    assert time.monotonic() - t0 < 5
    assert any("has no staged extent" in r.getMessage() for r in caplog.records)
    # D still serves: the next request goes through
    want, got = both_legs(p, d, "a2", PROMPT)
    assert_same_kv(want, got, len(PROMPT))
    assert settled(p, d)


def test_a_decode_abort_while_claiming_leaves_nothing_after_the_lease(staged_env, shut_down):
    """D aborts while its claim waits, and one after the claim was answered and the READ
    posted; P's extents and blocks of those are back by the end of P's lease (push mode
    leaves a request its D gave up to the lease, as vLLM's own push does)."""
    from vllm.v1.request import RequestStatus

    p = engine(shut_down, "p", "kv_producer", 49)
    d = engine(shut_down, "d", "kv_consumer", 50)
    d.sched.add_request(pd.decode_request("x1", PROMPT, concurrent_params(p, "x1")))
    assert pd.run([d], lambda: "x1" in d.worker._decode_worker.queued, timeout_s=5)
    d.sched.finish_requests(["x1"], RequestStatus.FINISHED_ABORTED)
    p.sched.add_request(pd.prefill_request("x1", PROMPT))
    d.sched.add_request(pd.decode_request("x2", PROMPT, concurrent_params(p, "x2")))
    p.sched.add_request(pd.prefill_request("x2", PROMPT))
    assert pd.run([p, d], lambda: "x2" in d.worker._decode_worker.inflight
                  or ("x2" in d.outputs), timeout_s=10)
    d.sched.finish_requests(["x2"], RequestStatus.FINISHED_ABORTED)
    want, got = both_legs(p, d, "x3", PROMPT)
    assert_same_kv(want, got, len(PROMPT))
    assert pd.run([p, d], lambda: not p.sched.requests and not d.sched.requests
                  and not p.connector._prefill.staged
                  and d.worker._region.decode.allocator.used_bytes == 0
                  and not d.worker._decode_worker.queued,
                  timeout_s=LEASE_S + 10), "an abort left blocks or staging behind"


def test_a_plain_vllm_prefill_keeps_vllms_push_for_concurrent_legs(staged_env, shut_down):
    """Nothing answers claims at a plain vLLM P: D asks once (vLLM holds the request
    back meanwhile), then leaves it to its inner push connector, whose registration
    makes P WRITE its blocks; the KV arrives exactly."""
    p = engine(shut_down, "p", "kv_producer", 51, staged=False)
    d = engine(shut_down, "d", "kv_consumer", 52)
    want, got = both_legs(p, d, "v1", PROMPT)
    assert_same_kv(want, got, len(PROMPT))
    refused = d.connector._decode.refused_peers
    assert engine_id(p) in refused
    assert "no kvcached-pd claim listener" in refused[engine_id(p)]
    assert not d.worker._decode_worker._peers, "D fetched a staged handshake from plain P"
    assert settled(p, d)


def test_with_a_shared_secret_only_a_decode_that_proves_it_is_served(staged_env, shut_down,
                                                                      monkeypatch, tmp_path):
    """KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE on P and D: the concurrent leg is probed,
    claimed and READ as without it. A D without the secret is refused by P's listener
    and keeps vLLM's push (exact KV, per-block WRITE), saying why."""
    from kvcached_pd import config

    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    monkeypatch.setenv(config.KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE, str(secret))
    config.reset_settings_for_tests()
    p = engine(shut_down, "p", "kv_producer", 53)
    d = engine(shut_down, "d", "kv_consumer", 54)
    assert p.connector._listener._secret == b"ab" * 32
    writes = watch_per_block_writes(p)
    want, got = both_legs(p, d, "s1", PROMPT)
    assert_same_kv(want, got, len(PROMPT))
    assert saw_done(p, d, "s1"), "P never got D's DONE: the staged READ did not run"
    assert not writes and not d.connector._decode.refused_peers
    monkeypatch.delenv(config.KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE)
    config.reset_settings_for_tests()
    d2 = engine(shut_down, "d2", "kv_consumer", 55)
    want, got = both_legs(p, d2, "s2", PROMPT)
    assert_same_kv(want, got, len(PROMPT))
    assert "requires the shared secret" in d2.connector._decode.refused_peers[engine_id(p)]
    assert writes, "the refused decode leg did not take vLLM's push"
    assert settled(p, d) and settled(p, d2)
