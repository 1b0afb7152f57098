"""Push mode with concurrent legs from a peer D reads over CUDA IPC: D's scheduler
claims the params itself and loads synchronously.

The decode leg reaches D before P has prefilled. For a P every rank of D has mapped,
D's scheduler claims the staged params from P's listener and holds the request back
(nothing allocated, vLLM asks again every step) until P answers; the request then loads
in the step that schedules it, as pull mode's synchronous loads do. Real vLLM
AsyncSchedulers and push connectors over real NIXL agents; only CUDA IPC is faked
(tests/support/fake_cuda_ipc.py)."""

from __future__ import annotations

import logging

import pytest

from kvcached_pd import vllm_api
from kvcached_pd.connector.side_channel import ClaimClient
from kvcached_pd.connector.wire import ClaimReply
from tests.support import connector_pd as pd
from tests.test_connector_ipc_wire import (  # noqa: F401 (fixtures)
    ipc,
    reads_left,
    sync_loads,
    wait_unmapped,
)
from tests.test_connector_mixed import assert_same_kv, settled
from tests.test_connector_pd import saw_done, staged_env  # noqa: F401 (fixture)
from tests.test_connector_push import PUSH, engine, shut_down  # noqa: F401 (fixture)
from tests.test_connector_push_concurrent import (
    PROMPT,
    both_legs,
    concurrent_params,
    watch_per_block_writes,
)

pytestmark = pytest.mark.skipif(
    vllm_api.api_for(None) is None or vllm_api.current().push_name != PUSH,
    reason="vLLM has push mode (NixlPushConnector) from 0.24 on")


@pytest.fixture
def claims(monkeypatch):
    """(client, request id) of every claim sent, by D's scheduler or its worker."""
    sent = []
    real = ClaimClient.submit

    def submit(self, req_id, host, port, claim):
        sent.append((self, req_id))
        return real(self, req_id, host, port, claim)
    monkeypatch.setattr(ClaimClient, "submit", submit)
    return sent


def mapped_pair(shut_down, seeds):
    """P and D in push mode, P's staging mapped by D (the first request's asynchronous
    claim and handshake)."""
    p = engine(shut_down, "p", "kv_producer", seeds[0])
    d = engine(shut_down, "d", "kv_consumer", seeds[1])
    both_legs(p, d, "c0", PROMPT)
    assert d.connector._decode.ipc_ranks, "D's scheduler never learnt P's wire"
    return p, d


def p_kv(p, req_id, n):
    ids = p.outputs[req_id].kv_transfer_params["remote_block_ids"]
    return p.tokens(list(ids[0] if isinstance(ids[0], list) else ids), n)


def held_back(d, req_id) -> bool:
    from vllm.v1.request import RequestStatus

    request = d.sched.requests[req_id]
    return (request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
            and req_id in d.connector._decode.claiming
            and req_id not in d.connector._decode.pending)


def step_until_scheduled(d, req_id, timeout_steps=2000):
    """Step D until a step schedules ``req_id``; that step's scheduler output."""
    import time

    for _ in range(timeout_steps):
        out = d.step()
        if req_id in out.num_scheduled_tokens:
            return out
        time.sleep(0.002)
    raise AssertionError(f"D never scheduled {req_id}")


def test_a_decode_leg_sent_before_p_answered_loads_in_the_step_that_schedules_it(
        staged_env, ipc, sync_loads, claims, shut_down):
    """D's scheduler claims, holds the request back while P has not prefilled it, and
    once P staged it the step that schedules it loads it (synchronously, its exact KV)
    and yields its first token; D's worker claims nothing for it, P gets no per-block
    WRITE and frees the extent and blocks on D's DONE."""
    p, d = mapped_pair(shut_down, (61, 62))
    writes = watch_per_block_writes(p)
    prompt = list(range(200, 261))
    d.sched.add_request(pd.decode_request("c1", prompt, concurrent_params(p, "c1")))
    for _ in range(5):
        d.step()
    assert held_back(d, "c1"), "D allocated the request before P had staged it"
    p.sched.add_request(pd.prefill_request("c1", prompt))
    assert pd.run([p], lambda: "c1" in p.outputs)
    want = p_kv(p, "c1", len(prompt))
    step_until_scheduled(d, "c1")
    assert "c1" in d.outputs, "the step that scheduled it yielded no token"
    assert sync_loads == ["c1"]
    assert_same_kv(want, d.tokens(d.blocks_of("c1"), len(prompt)), len(prompt))
    scheduler_claims = [r for c, r in claims if c is d.connector._decode.claims]
    assert scheduler_claims == ["c1"]
    assert [r for c, r in claims if c is not d.connector._decode.claims] == ["c0"], \
        "D's worker claimed the request too"
    assert saw_done(p, d, "c1"), "D's DONE never reached P"
    assert not writes, "P started vLLM's per-block push WRITE"
    assert settled(p, d) and reads_left(d) == 0
    assert not d.connector._decode.claiming and not d.connector._decode.claimed


def test_a_claim_p_answers_gone_fails_that_load_alone(staged_env, ipc, sync_loads, claims,
                                                      shut_down, caplog):
    """P answers D's scheduler "gone" (it released the request, or a claim named another
    request's id): that request's load fails (its blocks reported invalid), D lives,
    and the next request loads synchronously and exactly."""
    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p, d = mapped_pair(shut_down, (63, 64))
    pd.wrap_method(p.connector._prefill.board, "answer", lambda real, claim, now=None: (
        ClaimReply(claim.key, "gone", reason="released by the test") if claim.key == "c2"
        else real(claim, now)))
    errors = pd.record_load_errors(d)
    d.sched.add_request(pd.decode_request("c2", PROMPT, concurrent_params(p, "c2")))
    p.sched.add_request(pd.prefill_request("c2", PROMPT))
    assert pd.run([p, d], lambda: "c2" in d.outputs and d.outputs["c2"].finished), \
        "D never ended the request"
    assert errors, "D's load of a request P answered gone did not fail"
    assert "released by the test" in caplog.text
    assert "c2" not in sync_loads
    prompt = list(range(300, 340))
    both_legs(p, d, "c3", prompt)
    assert sync_loads == ["c3"]
    assert settled(p, d) and reads_left(d) == 0
    assert not d.connector._decode.claiming


def test_a_decode_abort_while_the_claim_waits_leaves_nothing(staged_env, ipc, sync_loads,
                                                              claims, shut_down):
    """The client aborts the decode leg while D's scheduler waits for P's answer: the
    claim is given up, D holds nothing of it, P frees the extent at its lease (no READ
    came), and the next request still loads synchronously."""
    from vllm.v1.request import RequestStatus

    p, d = mapped_pair(shut_down, (65, 66))
    d.sched.add_request(pd.decode_request("c4", PROMPT, concurrent_params(p, "c4")))
    for _ in range(5):
        d.step()
    assert held_back(d, "c4")
    d.sched.finish_requests("c4", RequestStatus.FINISHED_ABORTED)
    assert not d.connector._decode.claiming and "c4" not in d.sched.requests
    p.sched.add_request(pd.prefill_request("c4", PROMPT))
    assert pd.run([p, d], lambda: "c4" in p.outputs)
    both_legs(p, d, "c5", list(range(400, 450)))
    assert sync_loads == ["c5"]
    assert "c4" not in d.connector._decode.claimed and reads_left(d) == 0
    # P's extent of c4 goes at P's lease (push mode: nobody READs it)
    from tests.test_connector_push import LEASE_S
    assert pd.run([p, d], lambda: not p.sched.requests and not p.connector._prefill.staged,
                  timeout_s=LEASE_S + 10), "P never freed the aborted request's extent"


def test_a_claim_p_never_answers_fails_that_load_after_ds_lease(staged_env, ipc, sync_loads,
                                                                claims, shut_down, caplog):
    """The decode leg names a request P never receives (its prefill leg was lost): P's
    listener answers "pending" for good, D's scheduler holds the request back for its KV
    lease and then fails that load, never waiting longer; D lives and serves the next."""
    from tests.test_connector_push import LEASE_S

    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p, d = mapped_pair(shut_down, (67, 68))
    errors = pd.record_load_errors(d)
    d.sched.add_request(pd.decode_request("lost", PROMPT, concurrent_params(p, "lost")))
    for _ in range(5):
        d.step()
    assert held_back(d, "lost")
    assert pd.run([p, d], lambda: "lost" in d.outputs and d.outputs["lost"].finished,
                  timeout_s=LEASE_S + 10), "D held the request back past its lease"
    assert errors and "had not staged it within this instance's KV lease" in caplog.text
    both_legs(p, d, "c6", list(range(600, 640)))
    assert sync_loads == ["c6"]
    assert not d.connector._decode.claiming and reads_left(d) == 0


def test_a_claimed_request_vllm_cannot_allocate_yet_keeps_its_claim(
        staged_env, ipc, sync_loads, claims, shut_down):
    """D's KV cache has no room for a request whose params D's scheduler already
    claimed: vLLM leaves it waiting and asks again next step. The claim P answered
    stands (P answers each claim once: a second claim would be refused "claimed
    already" and fail the load); the request loads synchronously once there is room."""
    p, d = mapped_pair(shut_down, (69, 70))
    manager = d.sched.kv_cache_manager
    refused = []

    def allocate_slots(real, request, *args, **kwargs):
        if request.request_id == "c7" and len(refused) < 3:
            refused.append(request.request_id)
            return None  # no room this step, as with a full KV cache
        return real(request, *args, **kwargs)
    pd.wrap_method(manager, "allocate_slots", allocate_slots)
    both_legs(p, d, "c7", list(range(700, 750)))
    assert len(refused) == 3, "vLLM never met the full cache"
    assert sync_loads == ["c7"], "the request did not load synchronously once there was room"
    assert [r for c, r in claims if c is d.connector._decode.claims] == ["c7"], \
        "D claimed the request again"
    assert settled(p, d) and reads_left(d) == 0
    assert not d.connector._decode.claiming and not d.connector._decode.claimed


def test_a_claimed_request_held_back_past_its_read_deadline_is_not_read(
        staged_env, ipc, sync_loads, claims, shut_down, caplog):
    """D's scheduler claimed the params, then vLLM had no KV room for the request until
    the READ's deadline (half of P's lease, less the claim's age) had passed: P may have
    freed the extent at its lease and packed another request into it, and the tag check
    runs before the scatter does on the device. So that load fails, unread; D lives and
    the next request loads synchronously and exactly. (Until 2026-11-26's eighth session
    the synchronous path never looked at the deadline: D unpacked it.)"""
    import time

    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p, d = mapped_pair(shut_down, (73, 74))
    dec = d.connector._decode
    posted = []
    pd.wrap_method(d.worker._decode_worker, "_unpack_ready",
                   lambda real, ready: (posted.extend(r for r, _ in ready), real(ready))[1])
    aged = []

    def allocate_slots(real, request, *args, **kwargs):
        if request.request_id == "c8" and not aged:
            params, _deadline, failure = dec.claimed["c8"]
            # the time vLLM holds it back: half of P's lease goes by
            dec.claimed["c8"] = (params, time.monotonic() - 1.0, failure)
            aged.append(request.request_id)
            return None  # no room this step, as with a full KV cache
        return real(request, *args, **kwargs)
    pd.wrap_method(d.sched.kv_cache_manager, "allocate_slots", allocate_slots)
    errors = pd.record_load_errors(d)
    prompt = list(range(800, 850))
    d.sched.add_request(pd.decode_request("c8", prompt, concurrent_params(p, "c8")))
    p.sched.add_request(pd.prefill_request("c8", prompt))
    assert pd.run([p, d], lambda: "c8" in d.outputs and d.outputs["c8"].finished), \
        "D never ended the request"
    assert aged == ["c8"], "vLLM never held the claimed request back"
    assert errors, "D's load of a request past its READ deadline did not fail"
    assert "past its READ deadline" in caplog.text
    assert "c8" not in posted, "D read P's extent after its READ deadline"
    both_legs(p, d, "c9", list(range(900, 940)))
    assert sync_loads[-1] == "c9" and "c9" in posted
    assert not dec.claiming and not dec.claimed


def test_the_first_request_after_an_idle_unmap_loads_claimed_once(
        staged_env, ipc, sync_loads, claims, shut_down):
    """D's worker drops an idle peer's mapping on its own thread; D's scheduler hears of
    it only at D's next step. The decode leg that wakes an idle D therefore meets a
    scheduler that still takes P for mapped: it claims, and P answers one claim per
    request. That request must load (its exact KV), claimed once (the next test is the
    order of events that failed on a GPU)."""
    p, d = mapped_pair(shut_down, (65, 66))
    worker = d.worker._decode_worker
    assert wait_unmapped(worker), "the idle peer stayed mapped"
    worker.idle_unmap_s = 60.0
    assert d.connector._decode.ipc_ranks, "the scheduler heard of the unmap before a step"
    errors = pd.record_load_errors(d)
    prompt = list(range(400, 447))
    sent_before = len(claims)
    d.sched.add_request(pd.decode_request("c5", prompt, concurrent_params(p, "c5")))
    d.step()  # the step that wakes D: its scheduler claims (P still mapped, it thinks)
    p.sched.add_request(pd.prefill_request("c5", prompt))
    assert pd.run([p], lambda: "c5" in p.outputs)
    want = p_kv(p, "c5", len(prompt))
    step_until_scheduled(d, "c5")
    assert not errors, f"the load failed: {errors}"
    assert [r for _, r in claims[sent_before:]] == ["c5"], "claimed more than once"
    assert_same_kv(want, d.tokens(d.blocks_of("c5"), len(prompt)), len(prompt))
    assert pd.run([p, d], lambda: d.outputs["c5"].finished)
    assert settled(p, d) and reads_left(d) == 0


def test_two_requests_claimed_across_an_idle_unmap_each_load_claimed_once(
        staged_env, ipc, sync_loads, claims, shut_down):
    """Two decode legs wake an idle D: its scheduler, not yet told of the unmap, claims
    both. The step's output brings the unmap's news; the next step takes both replies
    while matching the first request. The second request's reply is then waiting for
    it, and its match must use it although its P is no longer taken for mapped (it did
    not: the worker claimed again, P refused "claimed already" and the load failed, one
    request of a push load on 2 x H100, 2026-11-26)."""
    import time

    p, d = mapped_pair(shut_down, (69, 70))
    worker = d.worker._decode_worker
    assert wait_unmapped(worker), "the idle peer stayed mapped"
    worker.idle_unmap_s = 60.0
    errors = pd.record_load_errors(d)
    prompts = {"c7": list(range(600, 647)), "c8": list(range(700, 739))}
    sent_before = len(claims)
    for req_id, prompt in prompts.items():
        d.sched.add_request(pd.decode_request(req_id, prompt, concurrent_params(p, req_id)))
    d.step()  # both claimed by D's scheduler; this step's output says P is unmapped
    assert set(d.connector._decode.claiming) == {"c7", "c8"}
    assert not d.connector._decode.ipc_ranks, "the scheduler never heard of the unmap"
    for req_id, prompt in prompts.items():
        p.sched.add_request(pd.prefill_request(req_id, prompt))
    assert pd.run([p], lambda: all(r in p.outputs for r in prompts))
    want = {r: p_kv(p, r, len(prompt)) for r, prompt in prompts.items()}
    time.sleep(0.5)  # both replies reach D's claim client before its next step
    for req_id in prompts:
        step_until_scheduled(d, req_id)
    assert not errors, f"a load failed: {errors}"
    assert sorted(r for _, r in claims[sent_before:]) == ["c7", "c8"], \
        "a request was claimed twice"
    for req_id, prompt in prompts.items():
        assert_same_kv(want[req_id], d.tokens(d.blocks_of(req_id), len(prompt)), len(prompt))
    assert pd.run([p, d], lambda: all(d.outputs[r].finished for r in prompts))
    assert settled(p, d) and reads_left(d) == 0
    assert not d.connector._decode.claiming and not d.connector._decode.claimed


def test_a_decode_that_dies_after_its_claim_leaves_p_serving_the_next(
        staged_env, ipc, sync_loads, claims, shut_down):
    """Kill D mid-handoff, push mode over CUDA IPC: D's scheduler claimed the request, P
    prefilled and staged it for D, then D is gone (it never steps again and its claim
    sockets close; a killed process sends nothing more). No READ and no DONE come: P
    frees the request's extent and blocks by the end of its KV lease (vLLM's push
    connector reports the request sent when its lease runs out; kvcached-pd's own expiry
    is the backstop: with both removed this fails), stays up, and serves the next D,
    whose KV arrives exactly. (The GPU runs' kill D under push was not reached in three
    sessions, for the harness's time; this is its CPU half.)"""
    from tests.test_connector_push import LEASE_S

    p, d = mapped_pair(shut_down, (73, 74))
    prompt = list(range(700, 761))
    d.sched.add_request(pd.decode_request("k1", prompt, concurrent_params(p, "k1")))
    for _ in range(5):
        d.step()
    assert held_back(d, "k1")
    p.sched.add_request(pd.prefill_request("k1", prompt))
    assert pd.run([p], lambda: "k1" in p.outputs)
    assert "k1" in p.connector._prefill.staged, "P did not hold the extent for D"
    d.sched.shutdown()  # D dies holding its claim
    assert pd.run([p], lambda: not p.sched.requests and not p.connector._prefill.staged
                  and p.connector._prefill.allocator.used_bytes == 0,
                  timeout_s=LEASE_S + 10), "P held the dead D's extent past its lease"
    assert ("k1", 0) not in p.done_seen
    d2 = engine(shut_down, "d2", "kv_consumer", 75)
    want, got = both_legs(p, d2, "k2", PROMPT)
    assert_same_kv(want, got, len(PROMPT))
    assert settled(p, d2)
