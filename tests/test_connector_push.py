"""kvcached-pd's connector in push mode (inner ``NixlPushConnector``) on the CPU.

Both halves of each instance are what vLLM builds: its real ``AsyncScheduler`` and the
connector with vLLM's real push connector inside, over real NIXL agents (UCX, host
memory). Between two kvcached-pd instances a request moves by the staged READ, and P
frees its blocks on D's DONE, not at the end of the KV lease; with a plain vLLM push
peer, vLLM's own PUSH_REG and per-block WRITE move it.
"""

from __future__ import annotations

import logging
import time

import pytest

from kvcached_pd import vllm_api
from kvcached_pd.connector.wire import PARAMS_KEY
from tests.support import connector_pd as pd
from tests.test_connector_mixed import assert_same_kv, settled
from tests.test_connector_mixed import handoff as mixed_handoff
from tests.test_connector_pd import staged_env  # noqa: F401 (fixture)

PUSH = "NixlPushConnector"
PROMPT = list(range(1, 45))
LEASE_S = 6  # P's kv_lease_duration here: short enough to run past it

pytestmark = pytest.mark.skipif(
    vllm_api.api_for(None) is None or vllm_api.current().push_name != PUSH,
    reason="vLLM has push mode (NixlPushConnector) from 0.24 on")


@pytest.fixture(autouse=True)
def shut_down():
    """Stop each test's push writer threads: left running they slow later tests."""
    live: list = []
    yield live
    for engine in live:
        engine.worker.shutdown()


def handoff(p, d, req_id, prompt):
    """D's request carries P's id, as a push-mode proxy sends it (vLLM's push matches
    D's registration to P's finished request by id)."""
    return mixed_handoff(p, d, req_id, prompt, d_prefix="")


def engine(live, name, role, seed, staged=True, async_scheduling=True):
    e = pd.make_engine(name, role, seed=seed, staged=staged, inner=PUSH,
                       extra={"kv_lease_duration": LEASE_S}, async_scheduling=async_scheduling)
    live.append(e)
    return e


def test_staged_push_reads_the_extent_and_frees_p_blocks_on_done(staged_env, shut_down,
                                                                  caplog):
    """The KV arrives exactly; P's blocks are freed on D's DONE, well before P's lease;
    when the inner connector's lease runs out later, P neither reports the request a
    second time (vLLM's scheduler asserts on an unknown request: P's EngineCore would
    die) nor warns that it released expired blocks."""
    p = engine(shut_down, "p", "kv_producer", 21)
    d = engine(shut_down, "d", "kv_consumer", 22)
    assert type(p.worker._inner).__name__ == PUSH and p.worker._push
    params, want, got = handoff(p, d, "s1", PROMPT)
    assert PARAMS_KEY in params
    assert_same_kv(want, got, len(PROMPT))
    finished_at = time.monotonic()
    assert pd.run([p, d], lambda: not p.sched.requests, timeout_s=LEASE_S / 3), \
        "P's blocks were not freed on D's DONE"
    assert ("s1", 0) in p.done_seen
    assert not p.connector._prefill.staged
    caplog.set_level(logging.WARNING, logger=vllm_api.current().lease_expiry_logger)
    # past the inner connector's lease: its own report of the request comes and goes
    pd.run([p, d], lambda: time.monotonic() - finished_at > LEASE_S + 2, timeout_s=LEASE_S + 5)
    assert not p.worker._prefill_worker._sent_early, "the inner report never came"
    # D's inner push connector was never left holding the request (an empty receive it
    # would keep for good, had D not taken it out of vLLM's push flow)
    assert not d.worker._inner.connector_worker._recving_metadata
    assert not [r for r in caplog.records if vllm_api.LEASE_EXPIRY_MESSAGE in r.getMessage()]
    assert settled(p, d)


def test_staged_decode_never_registers_for_a_per_block_write(staged_env, shut_down):
    """D takes a staged request out of vLLM's push flow: no PUSH_REG reaches P, so P's
    inner connector never WRITEs P's blocks into D's (kvcached) memory."""
    p = engine(shut_down, "p", "kv_producer", 23)
    d = engine(shut_down, "d", "kv_consumer", 24)
    writes = []
    pd.wrap_method(p.worker._inner.connector_worker, "_do_start_push_kv",
                   lambda real, *a, **k: writes.append(a) or real(*a, **k))
    handoff(p, d, "s2", PROMPT)
    assert settled(p, d)
    assert not writes, "P started vLLM's per-block push WRITE for a staged request"


def test_kvcached_pd_prefill_to_a_plain_vllm_push_decode(staged_env, shut_down):
    """A plain vLLM D registers its blocks (PUSH_REG) and P's inner connector WRITEs
    them; P frees its blocks and its extent when vLLM frees them: the WRITE done on
    0.26-0.28, P's lease on 0.30 (vLLM's own push P does the same there)."""
    p = engine(shut_down, "p", "kv_producer", 25)
    d = engine(shut_down, "d", "kv_consumer", 26, staged=False)
    params, want, got = handoff(p, d, "m1", PROMPT)
    assert PARAMS_KEY in params  # offered; the plain D ignores it
    assert_same_kv(want, got, len(PROMPT))
    assert pd.run([p, d], lambda: not p.sched.requests, timeout_s=LEASE_S + 5), \
        "P's blocks were never freed"
    assert not p.done_seen
    assert settled(p, d)


def test_plain_vllm_push_prefill_to_a_kvcached_pd_decode(staged_env, shut_down):
    """A plain vLLM P sends no staged extent: D leaves the request to its inner push
    connector, whose registration makes P WRITE the blocks."""
    p = engine(shut_down, "p", "kv_producer", 27, staged=False)
    d = engine(shut_down, "d", "kv_consumer", 28)
    params, want, got = handoff(p, d, "m2", PROMPT)
    assert PARAMS_KEY not in params
    assert_same_kv(want, got, len(PROMPT))
    assert params["remote_engine_id"] in d.connector._decode.refused_peers
    assert settled(p, d)


def test_push_decode_aborts_leave_nothing_after_the_lease(staged_env, shut_down):
    """D aborts one request before scheduling it and one with its READ posted, and
    finishes a third: D lives, the third arrives exactly, and P's blocks and extents of
    the aborted ones are back by the end of P's lease (vLLM's push mode frees a request
    its D never registered the same way)."""
    from vllm.v1.request import RequestStatus

    p = engine(shut_down, "p", "kv_producer", 29)
    d = engine(shut_down, "d", "kv_consumer", 30)
    prompt = list(range(5, 50))
    for req_id in ("early", "mid", "late"):
        p.sched.add_request(pd.prefill_request(req_id, prompt))
    assert pd.run([p], lambda: all(r in p.outputs for r in ("early", "mid", "late")))
    for req_id in ("early", "mid", "late"):
        d.sched.add_request(pd.decode_request(req_id, prompt,
                                              p.outputs[req_id].kv_transfer_params))
    d.sched.finish_requests(["early"], RequestStatus.FINISHED_ABORTED)
    d.step()
    d.sched.finish_requests(["mid"], RequestStatus.FINISHED_ABORTED)
    assert pd.run([p, d], lambda: "late" in d.outputs and d.outputs["late"].finished)
    assert pd.run([p, d], lambda: not p.sched.requests and not d.sched.requests
                  and not p.connector._prefill.staged
                  and d.worker._region.decode.allocator.used_bytes == 0,
                  timeout_s=LEASE_S + 10), "an abort left blocks or staging behind"


def test_shutdown_of_both_halves_raises_nothing_and_stops_kvcached_pds_threads(staged_env):
    """What vLLM's EngineCore does at exit (the scheduler's and the worker's connector
    ``shutdown``), after a staged push handoff: nothing raises, and kvcached-pd's side
    channel (P's claim listener, D's claim client and probe) stops. D's scheduler half
    once raised AttributeError here (its probe closed a client it never had)."""
    import threading

    names = ("kvcached-pd-handshake", "kvcached-pd-claims")
    earlier = set(threading.enumerate())  # other tests' instances are not shut down

    def ours() -> list[str]:
        return [t.name for t in set(threading.enumerate()) - earlier
                if t.name.startswith(names)]

    p = pd.make_engine("p", "kv_producer", seed=23, inner=PUSH)
    d = pd.make_engine("d", "kv_consumer", seed=24, inner=PUSH)
    params, want, got = handoff(p, d, "s9", PROMPT)
    assert PARAMS_KEY in params
    assert_same_kv(want, got, len(PROMPT))
    assert "kvcached-pd-handshake" in ours()  # P's claim listener
    for engine in (d, p):
        engine.sched.shutdown()
        engine.worker.shutdown()
    deadline = time.monotonic() + 5
    while ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ours(), f"still running after shutdown: {ours()}"
