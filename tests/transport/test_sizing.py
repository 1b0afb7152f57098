"""Staging size and placement: the rule of kvcached_pd.transport.sizing."""

from __future__ import annotations

import pytest

from kvcached_pd.transport.sizing import ALIGNMENT, FLOOR_BYTES, StagingSizeError, plan_staging
from kvcached_pd.transport.staging import ExtentAllocator

KIB = 1 << 10
MIB = 1 << 20


def plan(**overrides):
    args = dict(kv_role="kv_both", bytes_per_token=32 * KIB, block_size=16,
                kv_budget_tokens=1_000_000, max_model_len=4096, max_num_batched_tokens=8192,
                staging_mb=None)
    args.update(overrides)
    return plan_staging(**args)


def test_default_takes_the_largest_need_under_the_budget():
    # tiny test model (32 KiB/token): 2 x 8192 tokens = 512 MiB, 2 x 4096 = 256 MiB: floor
    assert plan().prefill_bytes == FLOOR_BYTES
    # kvbig (256 KiB/token): two steps of 8192 tokens = 4 GiB
    assert plan(bytes_per_token=256 * KIB).prefill_bytes == 4 << 30
    # a max_model_len of 32k at 256 KiB/token: two requests = 16 GiB (and two tags)
    big = plan(bytes_per_token=256 * KIB, max_model_len=32768)
    assert big.prefill_bytes == (16 << 30) + ALIGNMENT


def test_default_never_exceeds_the_kv_budget_but_holds_one_request():
    small = plan(kv_budget_tokens=10_000)  # 10k tokens of KV: 312.5 MiB
    assert small.prefill_bytes == 10_000 * 32 * KIB
    tiny_budget = plan(kv_budget_tokens=1_000)  # below one max_model_len request
    # one request's extent: its KV and its tag, aligned
    assert tiny_budget.prefill_bytes == 4096 * 32 * KIB + ALIGNMENT


def test_each_role_gets_its_range():
    # (a kv_both worker's two ranges are two buffers: test_connector_ipc_wire's
    # test_a_kv_both_worker_offers_its_prefill_range_alone)
    both = plan()
    assert both.prefill_bytes == both.decode_bytes == FLOOR_BYTES
    assert both.total_bytes == 2 * FLOOR_BYTES
    producer, consumer = plan(kv_role="kv_producer"), plan(kv_role="kv_consumer")
    assert (producer.prefill_bytes, producer.decode_bytes) == (FLOOR_BYTES, 0)
    assert (consumer.prefill_bytes, consumer.decode_bytes) == (0, FLOOR_BYTES)


def test_explicit_size_is_used_and_checked_against_one_request():
    assert plan(staging_mb=300).prefill_bytes == 300 * MIB
    with pytest.raises(StagingSizeError, match="at least 129"):
        plan(staging_mb=100)  # 4096 tokens x 32 KiB = 128 MiB, and the extent's tag
    with pytest.raises(StagingSizeError, match="at least 129"):
        plan(staging_mb=128)


def test_a_role_with_no_range_never_allocates():
    none = ExtentAllocator(0, 4096, start=8192)
    assert none.alloc(1, "x") is None and none.capacity_bytes == 0
