"""kvcached-pd's connector series (connector_metrics patch, every vLLM release) travel in
vLLM's own NIXL stats and reach its Prometheus metrics (the real ``NixlKVConnectorStats`` /
``NixlPromMetrics``)."""

from __future__ import annotations

import functools

import pytest


@pytest.fixture
def staged(kvcached_env):
    from kvcached_pd.patches import get_patch

    kvcached_env.setenv("KVCACHED_PD_TRANSPORT", "staged")
    patch = get_patch("connector_metrics")
    patch.patch()
    yield
    patch.unpatch()


def test_series_survive_aggregation_and_reach_prometheus(staged):
    import prometheus_client as prom
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
        NixlKVConnectorStats, NixlPromMetrics,
    )

    from kvcached_pd.connector.stats import PREFIX

    pack, handoff, fallbacks, d_staging, p_staging, waits = (
        PREFIX + key for key in ("pack_duration", "handoff_duration", "direct_fallbacks",
                                 "decode_staging_bytes", "prefill_staging_bytes",
                                 "staging_waits"))

    worker_a, worker_b = NixlKVConnectorStats(), NixlKVConnectorStats()
    assert worker_a.is_empty()
    worker_a.data[pack].append(0.002)  # a prefill worker that only packed
    assert not worker_a.is_empty()  # ... is still reported
    worker_b.data[handoff].extend([0.004, 0.006])
    worker_b.data["kvcached_pd_read_duration"].append(0.0005)
    worker_b.data[fallbacks].append(1)
    worker_b.data[d_staging].extend([4096, 12288, 0])  # sampled on every change
    # bytes moved per staged load: a miss, a partial prefix hit, a full hit (the DONE alone)
    worker_b.data[PREFIX + "moved_bytes"].extend([98336, 73760, 0])
    worker_b.data[PREFIX + "prefix_skipped_bytes"].extend([0, 49152, 98304])
    scheduler = NixlKVConnectorStats()  # P's scheduler samples its own range
    scheduler.data[p_staging].extend([8192, 4096])
    scheduler.data[waits].extend([1, 1])
    total = NixlKVConnectorStats().aggregate(worker_a).aggregate(worker_b).aggregate(scheduler)
    assert total.data[pack] == [0.002] and total.data[handoff] == [0.004, 0.006]
    total.reduce()  # vLLM's CLI summary ignores the extra series without failing

    registry = prom.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry)
             for cls in (prom.Counter, prom.Histogram, prom.Gauge)}
    import tempfile

    from tests.support import vllm_nixl_worker as vw

    config = vw.make_vllm_config(vw.write_tiny_llama(tempfile.mkdtemp()))
    metrics = NixlPromMetrics(config, types, ["engine"], {0: ["0"]})
    metrics.observe(total.data, engine_idx=0)
    value = registry.get_sample_value
    assert value("vllm:kvcached_pd_pack_seconds_count", {"engine": "0"}) == 1
    assert value("vllm:kvcached_pd_handoff_seconds_sum", {"engine": "0"}) == pytest.approx(0.010)
    assert value("vllm:kvcached_pd_read_seconds_count", {"engine": "0"}) == 1
    assert value("vllm:kvcached_pd_direct_fallbacks_total", {"engine": "0"}) == 1
    assert value("vllm:kvcached_pd_staging_waits_total", {"engine": "0"}) == 2
    assert value("vllm:kvcached_pd_moved_bytes_count", {"engine": "0"}) == 3
    assert value("vllm:kvcached_pd_moved_bytes_sum", {"engine": "0"}) == 98336 + 73760
    assert value("vllm:kvcached_pd_moved_bytes_bucket", {"engine": "0", "le": "0.0"}) == 1
    assert value("vllm:kvcached_pd_prefix_skipped_bytes_total", {"engine": "0"}) == 147456
    # occupancy is a gauge holding the latest sample, not a histogram of samples
    assert value("vllm:kvcached_pd_decode_staging_bytes", {"engine": "0"}) == 0
    assert value("vllm:kvcached_pd_prefill_staging_bytes", {"engine": "0"}) == 4096
    metrics.observe({**NixlKVConnectorStats().data, d_staging: [65536]}, engine_idx=0)
    assert value("vllm:kvcached_pd_decode_staging_bytes", {"engine": "0"}) == 65536
    assert value("vllm:nixl_xfer_time_seconds_count", {"engine": "0"}) == 0  # vLLM's own intact


def test_without_the_patch_vllm_stats_are_unchanged():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    assert not any(k.startswith("kvcached_pd") for k in NixlKVConnectorStats().data)
