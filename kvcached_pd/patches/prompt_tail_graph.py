"""Model Runner V2: a KV-loaded request's first forward replays the decode CUDA graph.

D receives a prompt's KV and recomputes only its last prompt token (vLLM's connectors
all do: the scheduler leaves ``num_computed_tokens`` one short of the prompt). That
forward is one token of one request, like a decode; vLLM's V1 model runner (0.26.0)
counts it as one (``_is_uniform_decode`` reads query lengths only), so the step replays
the FULL decode CUDA graph. Model Runner V2, the runner kvcached 0.1.6 requires on vLLM
0.29-0.30, counts it as prefilling (``gather_batch_req_state``:
``num_computed_prefill_tokens < prefill_len``) and gives a batch holding one no uniform
token count, so the whole step, every decoding request in it, leaves the FULL graph for
the PIECEWISE one (attention eager). Measured on one H200 with P and D on it (tiny
load, 64 requests 16 at a time, ``experiments/results/2026-11-29b-h200-vllm030-session/``):
D's steps that ran such a forward took 9.1-11.2 ms p50 on 0.30.0 against 4.9-6.4 on 0.26.0
(3.5-4.3 against 3.2-3.8 for D's other steps), a quarter of D's steps under load.

The hook leaves vLLM's batch state as it is (the input tokens still come from the
prompt, sampling still treats the row as the prompt's end) and changes only the uniform
token count the step dispatches on, to the count vLLM's own
``get_uniform_decode_token_count`` gives the same batch without a prefill, and only where
a one-token prompt tail is a decode for every kernel of the step:

- every scheduled request runs exactly one token and a prefilling one runs its *last*
  prompt token (so it samples);
- no speculative decoding (``decode_query_len`` 1, no draft tokens, no adaptive
  verification), no prefill context parallelism, not an encoder-decoder model;
- every KV cache group is plain ``FullAttentionSpec`` (the staged transport's own
  requirement). vLLM's attention metadata tells prefilling rows apart only for Mamba-style
  state (``split_decodes_and_prefills(treat_short_extends_as_decodes=False)``): softmax
  attention over paged KV computes a one-token extend and a decode alike, which is
  why V1 replayed the graph for it.

Any other batch dispatches as vLLM decides. Not fail-closed: without it KV moves the same
and outputs are the same, D's first-forward steps are only slower. ``KVCACHED_PD_DISABLE=
prompt_tail_graph`` leaves it out. Read against vLLM 0.30.0's source; other releases run
vLLM's own dispatch.
"""

from __future__ import annotations

import functools
import inspect
import logging

from kvcached_pd.patches.base import Patch, defining_class
from kvcached_pd.versions import VersionRange

logger = logging.getLogger("kvcached_pd")

MODULE = "vllm.v1.worker.gpu.model_runner"  # Model Runner V2
CLASS = "GPUModelRunner"
ATTR = "gather_batch_req_state"
PARAMS = ("self", "scheduler_output", "dummy_run")
UNIFORM_COUNT = "get_uniform_decode_token_count"  # vLLM's rule, in MODULE's namespace
FULL_ATTENTION = "FullAttentionSpec"
_ELIGIBLE = "_kvcached_pd_prompt_tail_graph"  # per runner: the model's answer, kept


def runner_eligible(runner) -> bool:
    """Whether this runner's model and settings make a one-token prompt tail a decode for
    every kernel (module docstring); decided once per runner."""
    cached = runner.__dict__.get(_ELIGIBLE)
    if cached is not None:
        return cached
    groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None)
    eligible = bool(
        groups
        and all(type(g.kv_cache_spec).__name__ == FULL_ATTENTION for g in groups)
        and getattr(runner, "decode_query_len", None) == 1
        and getattr(runner, "adaptive_verification", None) is None
        and getattr(runner, "pcp_manager", None) is None
        and not getattr(runner, "is_encoder_decoder", False)
    )
    if groups:  # kv_cache_config arrives after __init__; decide only once it has
        runner.__dict__[_ELIGIBLE] = eligible
    return eligible


def prompt_tails_only(state, scheduler_output) -> bool:
    """True for a batch that vLLM counts as prefilling only because of one-token prompt
    tails: one token a request, and every prefilling request at its last prompt token."""
    if not getattr(state, "has_prefill", False) or scheduler_output.scheduled_spec_decode_tokens:
        return False
    if not (state.num_scheduled_tokens == 1).all():
        return False
    tails = state.is_prefilling_np
    return bool((state.num_computed_prefill_tokens_np[tails] + state.num_scheduled_tokens[tails]
                 == state.prefill_len_np[tails]).all())


def _make_hook(original, uniform_count):
    announced = []

    @functools.wraps(original)
    def gather_batch_req_state(self, scheduler_output, dummy_run):
        state, uniform = original(self, scheduler_output, dummy_run)
        if (uniform is None and state is not None and runner_eligible(self)
                and prompt_tails_only(state, scheduler_output)):
            uniform = uniform_count(len(state.req_ids), int(state.num_tokens),
                                    int(state.num_scheduled_tokens.max()), has_prefill=False)
            if uniform is not None and not announced:
                announced.append(True)
                logger.info("kvcached-pd: a loaded request's first forward (its last prompt "
                            "token) runs in the decode CUDA graph with the decoding requests "
                            "beside it (prompt_tail_graph)")
        return state, uniform

    return gather_batch_req_state


class PromptTailGraphPatch(Patch):
    name = "prompt_tail_graph"
    summary = ("Model Runner V2 replays the decode CUDA graph for a step whose only "
               "prefill is a loaded request's last prompt token")
    target_module = MODULE
    vllm_range = VersionRange("0.30", "0.31")  # the Model Runner V2 this was read against
    fail_closed = False

    def _apply(self) -> None:
        import importlib

        module = importlib.import_module(MODULE)
        runner_cls = getattr(module, CLASS, None)
        uniform_count = getattr(module, UNIFORM_COUNT, None)
        if runner_cls is None or not hasattr(runner_cls, ATTR) or uniform_count is None:
            raise AttributeError(f"no {CLASS}.{ATTR} or {UNIFORM_COUNT} in {MODULE}")
        params = tuple(inspect.signature(getattr(runner_cls, ATTR)).parameters)
        if params != PARAMS:
            raise TypeError(f"{CLASS}.{ATTR}{params}: expected {PARAMS}")
        owner = defining_class(runner_cls, ATTR)
        self._replace(owner, ATTR, _make_hook(vars(owner)[ATTR], uniform_count))
