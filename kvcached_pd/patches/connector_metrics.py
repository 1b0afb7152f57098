"""kvcached-pd's series as Prometheus metrics, on every vLLM release it serves.

vLLM's NIXL stats travel from each process to the API server's Prometheus registry as
a dict of lists (``NixlKVConnectorStats.data``) and become metrics in
``NixlPromMetrics``; both classes are public and identical on every release of ``vllm_api.RELEASES`` (0.20-0.33).
kvcached-pd's samples ride along under their own keys
(:data:`kvcached_pd.connector.stats.STAT_KEYS`, which kvcached-pd's connector adds) and
this patch makes ``vllm:kvcached_pd_*`` metrics of them:
occupancy of each side's staging range as gauges (the last sample is current),
fallbacks and waits as counters, pack/READ/unpack/handoff times and the bytes each
staged load moved as histograms.

Not fail-closed: without it the transport moves KV the same, only unobserved.
"""

from __future__ import annotations

import importlib
import inspect

from kvcached_pd import serving, vllm_api, vllm_nixl
from kvcached_pd.connector.stats import STAT_KEYS
from kvcached_pd.patches.base import Patch, wrap_hook
from kvcached_pd.versions import installed_version

STATS_MODULE = f"{vllm_nixl.NIXL_PACKAGE}.stats"

SERIES = (
    # key, metric name, documentation, kind: "time" / "bytes" histogram buckets, "gauge",
    # None: counter
    ("kvcached_pd_pack_duration", "vllm:kvcached_pd_pack_seconds",
     "kvcached-pd: time to pack finished prefills into staging, per step", "time"),
    ("kvcached_pd_read_duration", "vllm:kvcached_pd_read_seconds",
     "kvcached-pd: decode side, one staged READ on the wire (NIXL's transfer telemetry)", "time"),
    ("kvcached_pd_handoff_duration", "vllm:kvcached_pd_handoff_seconds",
     "kvcached-pd: decode side, staged READ posted to scatter enqueued", "time"),
    ("kvcached_pd_read_spin", "vllm:kvcached_pd_read_spin_seconds",
     "kvcached-pd: decode side, time one engine step waited for imminent staged READs "
     "(KVCACHED_PD_READ_SPIN_US)", "time"),
    ("kvcached_pd_unpack_duration", "vllm:kvcached_pd_unpack_seconds",
     "kvcached-pd: decode side, scatter of an extent into KV blocks (device time)", "time"),
    ("kvcached_pd_prefill_staging_bytes", "vllm:kvcached_pd_prefill_staging_bytes",
     "kvcached-pd: bytes of the prefill staging range held by extents", "gauge"),
    ("kvcached_pd_decode_staging_bytes", "vllm:kvcached_pd_decode_staging_bytes",
     "kvcached-pd: bytes of the decode staging range held by extents", "gauge"),
    ("kvcached_pd_direct_fallbacks", "vllm:kvcached_pd_direct_fallbacks",
     "kvcached-pd: requests that took the direct path instead of staging", None),
    ("kvcached_pd_staging_waits", "vllm:kvcached_pd_staging_waits",
     "kvcached-pd: requests that waited for staging room (P: prefill held back; D: READ "
     "held back)", None),
    ("kvcached_pd_wire_fallbacks", "vllm:kvcached_pd_wire_fallbacks",
     "kvcached-pd: same-host prefill peers the decode side could not open over CUDA IPC "
     "and READs over NIXL instead (KVCACHED_PD_WIRE=auto; the WARNING says why)", None),
    ("kvcached_pd_moved_bytes", "vllm:kvcached_pd_moved_bytes",
     "kvcached-pd: decode side, bytes of P's extent one staged load moved (READ, or "
     "unpacked from P's memory over CUDA IPC): from the first token D's prefix cache "
     "lacks, with the 32-byte tag; 0 for a full prefix hit (the DONE alone)", "bytes"),
    ("kvcached_pd_prefix_skipped_bytes", "vllm:kvcached_pd_prefix_skipped_bytes",
     "kvcached-pd: decode side, bytes of P's extents not moved because D's prefix cache "
     "held their tokens", None),
    ("kvcached_pd_graph_fallbacks", "vllm:kvcached_pd_graph_fallbacks",
     "kvcached-pd: packs and unpacks that took the ordinary kernels though the CUDA graphs "
     "are installed (all slots in flight, or a request larger than a slot holds): the "
     "same bytes, more host time", None),
)
assert {key for key, *_ in SERIES} == set(STAT_KEYS)
TIME_BUCKETS = [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                5.0]
BYTE_BUCKETS = [0.0] + [float(1 << shift) for shift in range(12, 34, 2)]  # 0, 4 KiB .. 4 GiB


def _stats_reset(original, self):
    result = original(self)
    for key in STAT_KEYS:
        self.data.setdefault(key, [])
    return result


def _stats_is_empty(original, self):
    return original(self) and not any(self.data.get(k) for k in STAT_KEYS)


def _prom_init(original, self, *args, **kwargs):
    stats_mod = importlib.import_module(STATS_MODULE)
    result = original(self, *args, **kwargs)
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    labelnames = bound.arguments["labelnames"]
    self._kvcached_pd_metrics = {}
    for key, name, doc, kind in SERIES:
        if kind is None:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
        elif kind == "gauge":
            metric = self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                     multiprocess_mode="mostrecent")
        else:
            metric = self._histogram_cls(
                name=name, documentation=doc, labelnames=labelnames,
                buckets=BYTE_BUCKETS if kind == "bytes" else TIME_BUCKETS)
        self._kvcached_pd_metrics[key] = (
            kind, stats_mod.create_metric_per_engine(metric, self.per_engine_labelvalues))
    return result


def _prom_observe(original, self, transfer_stats_data, engine_idx=0):
    result = original(self, transfer_stats_data, engine_idx)
    for key, (kind, per_engine) in getattr(self, "_kvcached_pd_metrics", {}).items():
        values = transfer_stats_data.get(key, ())
        if kind == "gauge":
            if values:  # samples are taken on every change: the last one is current
                per_engine[engine_idx].set(values[-1])
            continue
        for value in values:
            if kind is None:
                per_engine[engine_idx].inc(value)
            else:
                per_engine[engine_idx].observe(value)
    return result


class ConnectorMetricsPatch(Patch):
    name = "connector_metrics"
    summary = "vllm:kvcached_pd_* metrics (staging occupancy, fallbacks, waits, handoff times)"
    target_module = vllm_nixl.NIXL_PACKAGE
    vllm_range = vllm_api.SUPPORTED_VLLM
    fail_closed = False

    def applies(self, vllm_version: str | None = None) -> tuple[bool, str]:
        """Where kvcached-pd's connector, routed or named, stages: only it records the
        series."""
        decision = serving.decide(self.settings, vllm_version or installed_version("vllm"),
                                  vllm_api.CONNECTOR_CLASS)
        if not decision.staged:
            return False, ("only the staged transport records kvcached-pd's series "
                           f"({decision.reason})")
        return super().applies(vllm_version)

    def _apply(self) -> None:
        stats_mod = importlib.import_module(STATS_MODULE)
        for cls, attr, hook in ((stats_mod.NixlKVConnectorStats, "reset", _stats_reset),
                                (stats_mod.NixlKVConnectorStats, "is_empty", _stats_is_empty),
                                (stats_mod.NixlPromMetrics, "__init__", _prom_init),
                                (stats_mod.NixlPromMetrics, "observe", _prom_observe)):
            self._replace(cls, attr, wrap_hook(hook, vars(cls)[attr]))
