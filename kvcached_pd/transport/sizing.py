"""How much staging each role of an instance gets, and where it lies in the buffer.

One registered buffer per worker holds two disjoint ranges: the prefill role's
``[0, prefill_bytes)``, handed out by P's scheduler (it reserves a request's extent
before vLLM schedules the prefill), and the decode role's
``[prefill_bytes, prefill_bytes + decode_bytes)``, handed out by D's worker. A
``kv_producer`` has no decode range and a ``kv_consumer`` no prefill range; ``kv_both``
has both, so an instance acting as P for one request and D for another never writes
one request's KV over another's.

The default size of a role's range (``KVCACHED_PD_STAGING_MB`` unset) follows what the
instance can have in flight:

    min(KV budget, max(2 x one max_model_len request, 2 x max_num_batched_tokens, 2 GiB))

- never more than the KV budget: P keeps a request's blocks until D has its KV, so P
  can never have more KV in flight than its blocks hold;
- two maximum-length requests: one is read by D while the next is packed;
- two engine steps of prefill: a step prefills at most ``max_num_batched_tokens``
  tokens, and D reads a step's worth (2 GiB at ~150 GB/s: ~14 ms) while the next runs;
- 2 GiB floor: on the 2 x H200 host, with 16 concurrent mixed-length requests of the
  32 KiB per token test model, the 1 GiB default of earlier releases left 9 of 64
  requests without room; with this rule (2 GiB there) none waited.

A full range is never a reason to take the direct path: P holds the request back
(vLLM's scheduler skips it until room frees) and D waits to READ. An explicit size that
cannot hold one ``max_model_len`` request would make those waits endless, so it stops
startup instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcached_pd.config import KVCACHED_PD_STAGING_MB, STAGING_ALIGNMENT
from kvcached_pd.transport.format import TAG_BYTES

ALIGNMENT = STAGING_ALIGNMENT
FLOOR_BYTES = 2 << 30


class StagingSizeError(ValueError):
    """An explicit staging size that cannot hold one request of max_model_len."""


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _roles(kv_role: str | None) -> tuple[bool, bool]:
    """(prefill role, decode role) of an instance with this ``kv_role``."""
    if kv_role == "kv_producer":
        return True, False
    if kv_role == "kv_consumer":
        return False, True
    return True, True


@dataclass(frozen=True)
class StagingPlan:
    prefill_bytes: int
    decode_bytes: int
    rule: str  # how the size was chosen, for the start-up log

    @property
    def total_bytes(self) -> int:
        return self.prefill_bytes + self.decode_bytes


def role_bytes(*, bytes_per_token: int, block_size: int, kv_budget_tokens: int,
               max_model_len: int, max_num_batched_tokens: int,
               staging_mb: int | None) -> tuple[int, str]:
    """Bytes of one role's range, and the rule that chose them."""
    def tokens_bytes(tokens: int) -> int:
        return math.ceil(tokens / block_size) * block_size * bytes_per_token

    one_request = tokens_bytes(max_model_len) + TAG_BYTES  # an extent ends with its tag
    if staging_mb is not None:
        nbytes = _align(staging_mb << 20)
        if nbytes < one_request:
            need_mb = -(-one_request // (1 << 20))
            raise StagingSizeError(
                f"{KVCACHED_PD_STAGING_MB}={staging_mb} cannot hold the KV of one "
                f"max_model_len={max_model_len} request ({need_mb} MiB): such a request would "
                f"wait for room forever. Set {KVCACHED_PD_STAGING_MB} to at least {need_mb}, "
                "lower --max-model-len, or unset it for the default size"
            )
        return nbytes, f"{KVCACHED_PD_STAGING_MB}={staging_mb}"
    want = max(2 * one_request, tokens_bytes(2 * max_num_batched_tokens), FLOOR_BYTES)
    budget = tokens_bytes(kv_budget_tokens)
    nbytes = _align(max(min(want, budget), one_request))
    return nbytes, (f"default: min(KV budget {budget >> 20} MiB, max(2 x max_model_len "
                    f"{max_model_len}, 2 x max_num_batched_tokens {max_num_batched_tokens}, "
                    f"{FLOOR_BYTES >> 20} MiB))")


def plan_staging(*, kv_role: str | None, bytes_per_token: int, block_size: int,
                 kv_budget_tokens: int, max_model_len: int, max_num_batched_tokens: int,
                 staging_mb: int | None) -> StagingPlan:
    prefill, decode = _roles(kv_role)
    nbytes, rule = role_bytes(
        bytes_per_token=bytes_per_token, block_size=block_size,
        kv_budget_tokens=kv_budget_tokens, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, staging_mb=staging_mb)
    return StagingPlan(prefill_bytes=nbytes if prefill else 0,
                       decode_bytes=nbytes if decode else 0, rule=rule)


def plan_for(vllm_config, kv_cache_config, fmt, staging_mb: int | None) -> StagingPlan:
    """The plan of an engine, from vLLM's own config objects (the scheduler and the
    worker compute the same plan from the same inputs)."""
    block_size = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    kv_transfer = vllm_config.kv_transfer_config
    scheduler = vllm_config.scheduler_config
    return plan_staging(
        kv_role=getattr(kv_transfer, "kv_role", None),
        bytes_per_token=fmt.bytes_per_token_all_layers,
        block_size=block_size,
        kv_budget_tokens=int(kv_cache_config.num_blocks) * block_size,
        max_model_len=int(vllm_config.model_config.max_model_len),
        max_num_batched_tokens=int(scheduler.max_num_batched_tokens or 0),
        staging_mb=staging_mb,
    )
