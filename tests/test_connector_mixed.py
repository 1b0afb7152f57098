"""A mixed fleet on the CPU: kvcached-pd's connector on one side, vLLM's plain
``NixlConnector`` (no kvcached-pd) on the other, both over real NIXL agents.

The staged path needs kvcached-pd on both sides; with a plain peer every request must
take vLLM's own per-block path through the inner NixlConnector's registration, move
exact bytes, and leave nothing behind on either side: P's blocks and (when P is
kvcached-pd) the staging extent it reserved before it knew who would read it.
"""

from __future__ import annotations

import torch

from kvcached_pd.connector.wire import PARAMS_KEY
from tests.support import connector_pd as pd
from tests.test_connector_pd import loaded, staged_env  # noqa: F401 (fixture)


PROMPT = list(range(1, 45))  # 44 tokens: two full 16-token blocks and a partial one


def handoff(p: pd.Engine, d: pd.Engine, req_id: str, prompt: list[int], d_prefix: str = "d-"):
    """P prefills ``prompt``; D loads it and decodes. Returns P's params and, taken
    while D still held the request's blocks (after its load), each layer's K and V of
    every prompt token on P and on D. ``d_prefix=""``: D's request has P's id, as a
    push-mode proxy sends it (vLLM's push matches D's registration to P's request by id)."""
    p.sched.add_request(pd.prefill_request(req_id, prompt, p.block_hasher))
    assert pd.run([p], lambda: req_id in p.outputs)
    params = p.outputs[req_id].kv_transfer_params
    ids = params["remote_block_ids"]
    p_blocks = list(ids[0] if isinstance(ids[0], list) else ids)
    d_id = d_prefix + req_id
    d.sched.add_request(pd.decode_request(d_id, prompt, params, block_hasher=d.block_hasher))
    kv = {}

    def finished():
        if not kv and loaded(d, d_id):
            kv["p"] = p.tokens(p_blocks, len(prompt))
            kv["d"] = d.tokens(d.blocks_of(d_id), len(prompt))
        return d_id in d.outputs and d.outputs[d_id].finished
    assert pd.run([p, d], finished), "D never finished the request"
    assert kv, "D's request was never seen loaded"
    return params, kv["p"], kv["d"]


def assert_plain(engine) -> None:
    """vLLM's own NixlConnector (pull mode) on both halves, kvcached-pd nowhere."""
    from kvcached_pd.connector import KvcachedPDConnector
    from kvcached_pd.vllm_api import inner_connector_class

    for half in (engine.connector, engine.worker):
        assert isinstance(half, inner_connector_class())
        assert not isinstance(half, KvcachedPDConnector)


def assert_same_kv(want, got, num_tokens):
    assert len(want) == len(got) == pd.LAYERS
    for layer, (a, b) in enumerate(zip(want, got)):
        assert a.shape[1] == num_tokens  # (K|V, token, head, dim)
        assert torch.equal(a, b), f"layer {layer} differs"


def test_kvcached_pd_prefill_to_a_plain_vllm_decode(staged_env):
    """P (kvcached-pd) staged the request before it knew its reader; D (plain vLLM)
    ignores the staged params and READs P's blocks through the inner NixlConnector's
    registration. P frees the extent when vLLM's notification frees its blocks."""
    p = pd.make_engine("p", "kv_producer", seed=11)
    d = pd.make_engine("d", "kv_consumer", seed=12, staged=False)
    assert_plain(d)
    params, want, got = handoff(p, d, "m1", PROMPT)
    assert PARAMS_KEY in params  # P offered the staged path; D took vLLM's own
    assert_same_kv(want, got, len(PROMPT))
    # freed by the inner connector's finished_sending, well inside the 30 s lease
    assert pd.run([p, d], lambda: not p.connector._prefill.staged
                  and p.connector._prefill.allocator.used_bytes == 0, timeout_s=5), \
        "P kept its staging extent after a plain D read its blocks"
    assert pd.run([p, d], lambda: not p.sched.requests, timeout_s=5), \
        "P's blocks were never freed"
    assert not p.done_seen, "a staged DONE reached P from a plain D"
    assert settled(p, d)


def test_plain_vllm_prefill_to_a_kvcached_pd_decode(staged_env):
    """P (plain vLLM) sends no staged params; D's connector leaves the request to its
    inner NixlConnector, which READs P's blocks; P frees them on vLLM's notification."""
    p = pd.make_engine("p", "kv_producer", seed=13, staged=False)
    d = pd.make_engine("d", "kv_consumer", seed=14)
    assert_plain(p)
    reads = []
    region = d.worker._region
    real_read = region.agent.read
    region.agent.read = lambda *a, **k: reads.append(a) or real_read(*a, **k)
    params, want, got = handoff(p, d, "m2", PROMPT)
    assert PARAMS_KEY not in params
    assert_same_kv(want, got, len(PROMPT))
    assert not reads, "D posted a staged READ to a plain P"
    assert not d.worker._decode_worker._peers, "D asked a plain P for a staged handshake"
    assert params["remote_engine_id"] in d.connector._decode.refused_peers
    assert pd.run([p, d], lambda: not p.sched.requests, timeout_s=5), \
        "P's blocks were never freed"
    assert settled(p, d)
    assert not d.connector._decode.pending and not d.worker._decode_worker.inflight


def settled(p, d) -> bool:
    """Both sides hold nothing any more: requests, extents, staging bytes."""
    return pd.run([p, d], lambda: not p.sched.requests and not d.sched.requests
                  and staging_used(p) == 0 and staging_used(d) == 0, timeout_s=10)


def staging_used(engine) -> int:
    conn, worker = engine.connector, engine.worker
    used = 0
    if getattr(conn, "_prefill", None) is not None:
        used += conn._prefill.allocator.used_bytes + len(conn._prefill.staged)
    if getattr(worker, "_region", None) is not None:
        used += worker._region.decode.allocator.used_bytes
    return used
