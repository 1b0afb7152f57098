"""kvcached-pd's series in vLLM's KV-connector stats.

vLLM's NIXL stats travel from each process to the API server's Prometheus registry as
a dict of lists (``NixlKVConnectorStats.data``); kvcached-pd's samples ride along under
their own keys (:data:`STAT_KEYS`), and the metrics patch
(:mod:`kvcached_pd.patches.connector_metrics`) turns them into ``vllm:kvcached_pd_*``
metrics. Occupancy is sampled on every change, so the last sample is current.
"""

from __future__ import annotations

from typing import Any, Iterable

PREFIX = "kvcached_pd_"
STAT_KEYS = tuple(PREFIX + key for key in (
    "pack_duration", "read_duration", "handoff_duration", "unpack_duration", "prefill_staging_bytes",
    "decode_staging_bytes", "direct_fallbacks", "staging_waits", "read_spin", "wire_fallbacks",
    "moved_bytes", "prefix_skipped_bytes", "graph_fallbacks"))
_ALIASES = {"waits": "staging_waits"}


def merge_samples(stats: Any, samples: Iterable[dict[str, list[float]]], connector_cls: Any):
    """``stats`` (the inner connector's, possibly None) with ``samples`` added."""
    pending = [s for s in samples if s]
    if not pending:
        return stats
    if stats is None:
        stats = connector_cls.build_kv_connector_stats()
        if stats is None:
            return None
    for batch in pending:
        for key, values in batch.items():
            stats.data.setdefault(PREFIX + _ALIASES.get(key, key), []).extend(values)
    return stats
