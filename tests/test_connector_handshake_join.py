"""A pull read queued as its peer's NIXL handshake finishes, before the handshake's
callback stored the peer's agents (``kvcached_pd/patches/nixl_handshake_join.py``).

Real vLLM schedulers and kvcached-pd's connector over real NIXL agents on both sides.
After each staged load D hands the request to vLLM's connector inside its own with no
block to read, and vLLM's read then only notifies P, by the name of P's agent: the one
read of vLLM 0.30 that needs the agents stored (its block READs use the descriptors the
handshake prepared), so the one this race broke (CI, vLLM 0.30.0). The race is set up as
it happens: D's first request from P handshakes as vLLM runs it; for the next, vLLM's
worker in D is put back in the state the race leaves it in (P's handshake future
registered and finished, P's agents not stored yet), and another thread stores them a
little later, as the handshake's own callback does once it gets the lock. Only the
timing is forced.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from kvcached_pd.patches import get_patch
from tests.support import connector_pd as pd
from tests.test_connector_pd import handoff, staged_env  # noqa: F401 (fixture)
from tests.test_connector_untrusted import same_kv

PROMPT = list(range(1, 41))
OTHER = list(range(101, 141))
PATCH = get_patch("nixl_handshake_join")


def agents_stored_late(worker, engine_id: str, delay_s: float) -> threading.Thread:
    """Put ``worker`` where the race leaves it: P's handshake future finished and still
    registered, P's agents not stored; a thread stores them after ``delay_s`` the way
    vLLM's handshake callback does (under the handshake lock: future out, agents in)."""
    with worker._handshake_lock:
        agents = worker._remote_agents.pop(engine_id)
        future = Future()
        future.set_result(None)  # the requests' callbacks only ask whether it failed
        worker._handshake_futures[engine_id] = future

    def store():
        with worker._handshake_lock:
            del worker._handshake_futures[engine_id]
            worker._remote_agents[engine_id] = agents
    timer = threading.Timer(delay_s, store)
    timer.start()
    return timer


@pytest.fixture
def unpatched(monkeypatch):
    """vLLM's worker as it ships (the harness arms the patch in every engine it makes)."""
    monkeypatch.setattr(pd, "arm_vllm_fixes", lambda: None)
    was = PATCH.is_patched()
    PATCH.unpatch()
    yield
    if was:
        PATCH.patch()


def engines():
    """kvcached-pd's P and D; D's first request from P, with vLLM's handshake as vLLM
    runs it. (P, D, vLLM's worker in D, P's engine id.)"""
    p = pd.make_engine("p", "kv_producer", seed=71)
    d = pd.make_engine("d", "kv_consumer", seed=72)
    params, p_blocks, d_blocks = handoff(p, d, "j1", PROMPT)
    assert same_kv(p, p_blocks, d, d_blocks, len(PROMPT))
    engine_id = params["remote_engine_id"]
    worker = d.worker._inner.connector_worker
    assert pd.run([p, d], lambda: engine_id in worker._remote_agents, timeout_s=10)
    return p, d, worker, engine_id


def test_a_read_that_joins_a_finished_handshake_waits_for_its_agents(staged_env):
    """With the patch, as activation arms it, vLLM's notify-only read waits for the
    agents, and D serves this request and the next, their KV exact; vLLM 0.31+ (outside
    the patch's range) gets there through its own check."""
    p, d, worker, engine_id = engines()
    assert PATCH.is_patched() or not PATCH.applies()[0]
    agents_stored_late(worker, engine_id, 0.3)
    _, p_blocks, d_blocks = handoff(p, d, "j2", OTHER)
    assert same_kv(p, p_blocks, d, d_blocks, len(OTHER))
    sending = p.worker._inner.connector_worker._reqs_to_send
    assert pd.run([p, d], lambda: "j2" not in sending and not vars(worker).get(
        "_kvcached_pd_reads_awaiting_agents"), timeout_s=10), \
        "vLLM's notification never reached P (P's connector holds j2 until its lease)"
    _, p_blocks, d_blocks = handoff(p, d, "j3", PROMPT)
    assert same_kv(p, p_blocks, d, d_blocks, len(PROMPT))


def test_without_the_patch_the_same_read_kills_the_decode_step(staged_env, unpatched):
    """The negative control: vLLM 0.20-0.30 as shipped raises KeyError out of D's
    ``start_load_kv`` (the EngineCore's step) in the same state."""
    if not PATCH.applies()[0]:
        pytest.skip(f"vLLM checks the agents itself ({PATCH.applies()[1]})")
    p, d, worker, engine_id = engines()
    timer = agents_stored_late(worker, engine_id, 0.3)
    with pytest.raises(KeyError):
        handoff(p, d, "k2", OTHER)
    timer.join()
