"""D already holds a prompt's first blocks in its own prefix cache: only the rest may
arrive, and it must land after them.

Measured on the 2 x H200 host with ``--enable-prefix-caching`` on D: vLLM 0.26.0's own
push mode decoded wrong text (it writes P's *first* blocks into D's new ones), every
other mode byte-identical (``experiments/results/2026-11-22-h200x2/``). Here with the
CPU harness (tests/support/connector_pd.py): a first request fills D's prefix cache,
a second one shares its first two blocks; D's blocks after the second load must hold
D's own cached KV for the shared tokens and P's KV for every later token.
"""

from __future__ import annotations

import pytest
import torch

from kvcached_pd import vllm_api
from kvcached_pd.connector.wire import PARAMS_KEY
from kvcached_pd.patches import get_patch
from tests.support import connector_pd as pd
from tests.test_connector_mixed import handoff, settled
from tests.test_connector_pd import staged_env  # noqa: F401 (fixture)

FIRST = list(range(1, 76))  # 75 tokens: five 16-token blocks
SHARED = 32  # the second prompt repeats the first two blocks
SECOND = FIRST[:SHARED] + list(range(300, 343))
PUSH = "NixlPushConnector"


@pytest.fixture
def alignment():
    """kvcached-pd's fix of vLLM's per-block push, as activation applies it (0.26-0.28)."""
    patch = get_patch("push_prefix_alignment")
    applies = patch.applies()[0]
    if applies:
        patch.patch()
    yield applies
    patch.unpatch()


@pytest.mark.parametrize("inner,d_staged", [
    ("NixlConnector", True), (PUSH, True), (PUSH, False)],
    ids=["staged-pull", "staged-push", "vllm-per-block-push"])
def test_decode_prefix_cache_hit_receives_only_the_rest(staged_env, alignment, inner,
                                                         d_staged):
    """Staged: P's extent carries every token and D unpacks from the first token it
    lacks. vLLM's per-block push into a plain vLLM D: P's inner push connector writes
    P's last blocks there (the ``push_prefix_alignment`` patch)."""
    if inner == PUSH and vllm_api.current().push_name != PUSH:
        pytest.skip("vLLM has push mode (NixlPushConnector) from 0.24 on")
    p = pd.make_engine("p", "kv_producer", seed=41, inner=inner)
    d = pd.make_engine("d", "kv_consumer", seed=42, inner=inner, staged=d_staged,
                       prefix_caching=True)
    try:
        # D's request has P's id, as a push-mode proxy sends it
        _, _, first_on_d = handoff(p, d, "first", FIRST, d_prefix="")
        first_blocks = p_blocks_of(p, "first")
        assert settled(p, d) if d_staged else pd.run([p, d], lambda: not d.sched.requests)
        params, want, got = handoff(p, d, "second", SECOND, d_prefix="")
        assert (PARAMS_KEY in params) is True  # P offers the extent either way
        assert p_blocks_of(p, "second")[:2] != first_blocks[:2]  # P's KV of them differs
        for layer in range(pd.LAYERS):
            # K and V of the shared tokens: D's own, from its prefix cache
            assert torch.equal(got[layer][:, :SHARED], first_on_d[layer][:, :SHARED])
            assert not torch.equal(got[layer][:, :SHARED], want[layer][:, :SHARED])
            # every later token: P's
            assert torch.equal(got[layer][:, SHARED:], want[layer][:, SHARED:]), \
                f"layer {layer}: the tokens after D's cached prefix are not P's"
    finally:
        for engine in (p, d):
            engine.worker.shutdown()


def p_blocks_of(p: pd.Engine, req_id: str) -> list[int]:
    """The blocks P handed D for ``req_id`` (in its ``kv_transfer_params``)."""
    ids = p.outputs[req_id].kv_transfer_params["remote_block_ids"]
    return list(ids[0] if isinstance(ids[0], list) else ids)
