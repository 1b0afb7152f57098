"""kvcached-pd's connector end to end on the CPU: two real NIXL agents per instance."""

from __future__ import annotations

import pytest

from kvcached_pd.connector.wire import PARAMS_KEY
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


def test_staged_handoff_moves_every_token_exactly(staged_env):
    p = pd.make_engine("p", "kv_producer", seed=1)
    d = pd.make_engine("d", "kv_consumer", seed=2)
    prompt = list(range(1, 45))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert PARAMS_KEY in params
    want = p.tokens(p_blocks, len(prompt))
    got = d.tokens(d_blocks, len(prompt))
    for layer, (a, b) in enumerate(zip(want, got)):
        assert torch_equal(a, b), f"layer {layer} differs"
    # P freed its extent once D's READ was done, and its blocks once D's inner
    # NixlConnector sent vLLM's notification
    assert pd.run([p, d], lambda: not p.connector._prefill.staged)
    assert pd.run([p, d], lambda: not p.sched.requests), "P's blocks were never freed"


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))
