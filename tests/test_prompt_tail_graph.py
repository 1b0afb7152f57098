"""prompt_tail_graph: Model Runner V2's own ``gather_batch_req_state`` (vLLM 0.30), run on
a CPU stand-in of the runner's state, with and without the patch.

What is checked is the step's uniform token count, the value vLLM dispatches its CUDA
graph on (1: the FULL decode graph; None: the piecewise one), and that the batch state
vLLM built (what prepares the inputs and samples) is the same object either way.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvcached_pd.patches import get_patch
from kvcached_pd.versions import installed_version
from tests.conftest import vllm_release

PATCH = get_patch("prompt_tail_graph")
APPLIES = PATCH.applies()[0]

requires_mrv2 = pytest.mark.skipif(not APPLIES, reason="the patch is for vLLM 0.30's MRV2")


def test_applies_to_vllm_030_only():
    """0.30 is the release read and measured; every other release of the matrix keeps
    vLLM's dispatch (0.31-0.33 serve kvcached-pd without kvcached, unmeasured here)."""
    assert APPLIES == (vllm_release()[:2] == (0, 30)), installed_version("vllm")


def _spec(kind: str):
    import torch
    from vllm.v1 import kv_cache_interface as kvi

    if kind == "full":
        return kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                     dtype=torch.float16)
    return kvi.MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float16,))


class Req:
    def __init__(self, prefill_len: int, computed: int, scheduled: int):
        self.prefill_len, self.computed, self.scheduled = prefill_len, computed, scheduled


def runner_and_output(reqs: dict[str, Req], kind: str = "full", **runner):
    """A stand-in for GPUModelRunner's state that ``gather_batch_req_state`` reads, and a
    scheduler output of ``reqs`` (name -> prompt length, tokens computed, scheduled)."""
    states = SimpleNamespace(
        req_id_to_index={r: i for i, r in enumerate(reqs)},
        prefill_len=SimpleNamespace(np=np.array([q.prefill_len for q in reqs.values()],
                                                dtype=np.int32)),
        num_computed_prefill_tokens=np.array(
            [min(q.computed, q.prefill_len) for q in reqs.values()], dtype=np.int32))
    fields = dict(req_states=states, decode_query_len=1, adaptive_verification=None,
                  pcp_manager=None, is_encoder_decoder=False,
                  kv_cache_config=SimpleNamespace(kv_cache_groups=[
                      SimpleNamespace(kv_cache_spec=_spec(kind))]))
    fields.update(runner)
    out = SimpleNamespace(num_scheduled_tokens={r: q.scheduled for r, q in reqs.items()},
                          total_num_scheduled_tokens=sum(q.scheduled for q in reqs.values()),
                          scheduled_spec_decode_tokens={})
    return SimpleNamespace(**fields), out


def gather(runner, out, dummy_run=False):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return GPUModelRunner.gather_batch_req_state(runner, out, dummy_run)


@pytest.fixture
def patched():
    PATCH.patch()
    yield
    PATCH.unpatch()


DECODES = {"d1": Req(30, 34, 1), "d2": Req(500, 512, 1)}
TAIL = {"loaded": Req(3000, 2999, 1)}  # D after a load: all but the last prompt token


@requires_mrv2
def test_vllm_leaves_the_decode_graph_for_a_prompt_tail():
    """The behaviour the patch changes, as vLLM 0.30 has it."""
    assert gather(*runner_and_output({**DECODES, **TAIL}))[1] is None
    assert gather(*runner_and_output(DECODES))[1] == 1


@requires_mrv2
def test_a_prompt_tail_beside_decodes_dispatches_as_a_decode(patched):
    runner, out = runner_and_output({**DECODES, **TAIL})
    state, uniform = gather(runner, out)
    assert uniform == 1
    assert state.has_prefill and state.is_prefilling_np.tolist() == [False, False, True]
    alone = gather(*runner_and_output(TAIL))[1]
    assert alone == 1


@pytest.mark.parametrize("reqs, runner", [
    ({**DECODES, "chunk": Req(3000, 2990, 1)}, {}),  # a one-token chunk, not the last
    ({**DECODES, "chunk": Req(3000, 2998, 2)}, {}),  # two tokens
    ({"chunk": Req(3000, 2998, 2)}, {}),  # two tokens alone: uniform, but not decodes
    ({**DECODES, "new": Req(40, 0, 40)}, {}),  # a whole prompt
    ({**DECODES, **TAIL}, {"kind": "mamba"}),  # state that tells extends apart
    ({**DECODES, **TAIL}, {"decode_query_len": 2}),  # speculative decoding
    ({**DECODES, **TAIL}, {"adaptive_verification": object()}),
    ({**DECODES, **TAIL}, {"pcp_manager": object()}),
    ({**DECODES, **TAIL}, {"is_encoder_decoder": True}),
], ids=["chunk-not-last", "two-tokens", "two-tokens-alone", "whole-prompt", "mamba", "spec-decode",
        "adaptive-verification", "prefill-context-parallel", "encoder-decoder"])
@requires_mrv2
def test_any_other_batch_keeps_vllms_dispatch(patched, reqs, runner):
    assert gather(*runner_and_output(reqs, **runner))[1] is None


@requires_mrv2
def test_draft_tokens_keep_vllms_dispatch(patched):
    runner, out = runner_and_output({**DECODES, **TAIL})
    out.scheduled_spec_decode_tokens = {"d1": [7]}
    assert gather(runner, out)[1] is None


@requires_mrv2
def test_batch_state_is_vllms_own(patched):
    """The hook returns vLLM's state untouched: the loaded row still takes its input from
    the prompt and samples as the prompt's end."""
    runner, out = runner_and_output({**DECODES, **TAIL})
    state, _ = gather(runner, out)
    PATCH.unpatch()
    plain, _ = gather(runner, out)
    PATCH.patch()
    for name in ("req_ids", "num_tokens", "has_prefill"):
        assert getattr(state, name) == getattr(plain, name)
    for name in ("num_scheduled_tokens", "idx_mapping_np", "prefill_len_np",
                 "num_computed_prefill_tokens_np", "is_prefilling_np"):
        assert getattr(state, name).tolist() == getattr(plain, name).tolist()


@requires_mrv2
def test_eligibility_waits_for_the_kv_cache_config(patched):
    """kv_cache_config arrives after the runner's __init__: no answer is kept before."""
    runner, out = runner_and_output({**DECODES, **TAIL})
    runner.kv_cache_config = None
    assert gather(runner, out)[1] is None
    runner.kv_cache_config = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=_spec("full"))])
    assert gather(runner, out)[1] == 1
