"""Shared helpers for the kvcached-pd experiments: HTTP, prompts, fingerprints, metrics.

Everything here uses only the Python standard library, on purpose: the scripts run on an
offline GPU host where only what our provisioning installed is available, and they are
also exercised on CPU-only machines against a fake server (experiments/tests/).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Iterable

# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------


@dataclass
class HttpResult:
    """Outcome of one HTTP exchange; never raises for HTTP-level errors."""

    status: int  # 0 when no HTTP response arrived at all (connection refused, timeout)
    body: bytes
    headers: dict[str, str]
    seconds: float
    error: str | None = None  # transport-level error, when status == 0

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def _split_url(url: str) -> tuple[str, int, str]:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    path = parsed.path or "/"
    if parsed.query:
        path += "?" + parsed.query
    return parsed.hostname or "127.0.0.1", parsed.port or 80, path


def http_request(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> HttpResult:
    """One request on a fresh connection.

    A fresh connection per request costs ~0.1 ms on localhost and avoids every
    stale-keep-alive retry question (a retried POST could run a prefill twice).
    """
    host, port, path = _split_url(url)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return HttpResult(resp.status, data, {k.lower(): v for k, v in resp.getheaders()},
                          time.perf_counter() - t0)
    except (OSError, http.client.HTTPException) as exc:
        return HttpResult(0, b"", {}, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def post_json(url: str, payload: Any, timeout: float = 300.0,
              headers: dict[str, str] | None = None) -> HttpResult:
    hdrs = {"Content-Type": "application/json"}
    hdrs.update(headers or {})
    return http_request("POST", url, json.dumps(payload).encode("utf-8"), hdrs, timeout)


def get(url: str, timeout: float = 10.0) -> HttpResult:
    return http_request("GET", url, None, None, timeout)


# --------------------------------------------------------------------------------------
# Deterministic prompts
# --------------------------------------------------------------------------------------

_WORDS = (
    "the of and to in is was for on that with as by at from his her an are were which "
    "this be or kernel block cache page layer token head value key decode prefill "
    "transfer staging extent gather scatter window batch stream queue lease"
).split()


def make_prompt_text(num_tokens: int, seed: int) -> str:
    """ASCII text of exactly ``num_tokens - 1`` characters.

    The test models use a byte-level tokenizer (one token per byte) that prepends BOS,
    so this text encodes to exactly ``num_tokens`` prompt tokens. Words are drawn from a
    SHA-256 stream (not ``random``), so the text is identical on every Python version.
    Each prompt starts with its seed, so no two prompts share a prefix.
    """
    if num_tokens < 2:
        raise ValueError("a prompt needs at least 2 tokens (BOS + 1 byte)")
    target = num_tokens - 1
    parts = [f"[{seed}]"]
    length = len(parts[0])
    counter = 0
    while length < target:
        digest = hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
        for byte in digest:
            word = _WORDS[byte % len(_WORDS)]
            parts.append(word)
            length += 1 + len(word)
            if length >= target:
                break
    text = " ".join(parts)[:target]
    assert len(text) == target
    return text


@dataclass(frozen=True)
class Prompt:
    name: str
    num_tokens: int  # intended; the server's usage.prompt_tokens is authoritative
    text: str


# Lengths chosen to cover: tens of tokens, exact block multiples (16/32 -> 128, 1024),
# one-past-a-block (17, 513), and long prompts up to ~3.8k (max-model-len 4096 minus
# room for the generated tokens).
SEQUENTIAL_PROMPT_TOKENS = (17, 45, 128, 300, 513, 1024, 2047, 3005, 3800)
BATCH_PROMPT_TOKENS = (64, 500, 1000, 1500, 2000, 2500, 3000, 3500)


# Two prompts that share their first SHARED_PREFIX_TOKENS tokens, sent one after the
# other: the second finds that prefix in D's own prefix cache (D keeps the blocks it
# received for the first), so D receives only the rest of it.
SHARED_PREFIX_TOKENS = 700
SHARED_TAIL_TOKENS = (300, 413)


def shared_prefix_prompts(max_prompt_tokens: int | None = None) -> list[Prompt]:
    prefix = make_prompt_text(SHARED_PREFIX_TOKENS, seed=3000)  # BOS + 699 bytes
    out = []
    for i, tail in enumerate(SHARED_TAIL_TOKENS):
        n = SHARED_PREFIX_TOKENS + tail  # the tail's text is tail - 1 bytes, plus a space
        if max_prompt_tokens is None or n <= max_prompt_tokens:
            text = prefix + " " + make_prompt_text(tail, seed=3001 + i)
            out.append(Prompt(f"seq-shared{i}-{n}", n, text))
    return out


def sequential_prompts(max_prompt_tokens: int | None = None) -> list[Prompt]:
    return [Prompt(f"seq-{n}", n, make_prompt_text(n, seed=1000 + i))
            for i, n in enumerate(SEQUENTIAL_PROMPT_TOKENS)
            if max_prompt_tokens is None or n <= max_prompt_tokens] + \
        shared_prefix_prompts(max_prompt_tokens)


def batch_prompts(max_prompt_tokens: int | None = None) -> list[Prompt]:
    return [Prompt(f"batch-{i}-{n}", n, make_prompt_text(n, seed=2000 + i))
            for i, n in enumerate(BATCH_PROMPT_TOKENS)
            if max_prompt_tokens is None or n <= max_prompt_tokens]


# Mixed-length load (pd_load.py): prompt lengths spread over [min, max] by a SHA-256
# stream, so every run and every Python sends the same requests in the same order.
LOAD_SEED_BASE = 7000


def load_prompt_tokens(n: int, min_tokens: int = 8, max_tokens: int = 3800) -> list[int]:
    if not 2 <= min_tokens <= max_tokens:
        raise ValueError(f"prompt lengths {min_tokens}..{max_tokens}: need 2 <= min <= max")
    span = max_tokens - min_tokens + 1
    out = []
    for i in range(n):
        digest = hashlib.sha256(f"load:{i}".encode()).digest()
        out.append(min_tokens + int.from_bytes(digest[:4], "little") % span)
    return out


def load_prompt(index: int, num_tokens: int) -> Prompt:
    """The load harness's prompt ``index`` of ``num_tokens`` tokens (``load-III-N``)."""
    return Prompt(f"load-{index:03d}-{num_tokens}", num_tokens,
                  make_prompt_text(num_tokens, seed=LOAD_SEED_BASE + index))


def load_prompts(n: int, min_tokens: int = 8, max_tokens: int = 3800) -> list[Prompt]:
    return [load_prompt(i, t)
            for i, t in enumerate(load_prompt_tokens(n, min_tokens, max_tokens))]


# --------------------------------------------------------------------------------------
# Output fingerprints
# --------------------------------------------------------------------------------------


def fingerprint(outputs: Iterable[tuple[str, Any]]) -> str:
    """SHA-256 over the canonical JSON of ``[(prompt name, token ids or text), ...]``.

    Sorted by prompt name, so the concurrent batch's completion order does not matter.
    """
    canon = json.dumps(sorted(([name, value] for name, value in outputs), key=lambda x: x[0]),
                       separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("ascii")).hexdigest()


# --------------------------------------------------------------------------------------
# Prometheus text format
# --------------------------------------------------------------------------------------

_SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class MetricSnapshot:
    """Parsed samples of one /metrics scrape: name -> list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    taken_at: float = 0.0

    def has(self, name: str) -> bool:
        return name in self.samples

    def total(self, name: str, **label_filter: str) -> float | None:
        """Sum of all samples of ``name`` whose labels match; None if the name is absent."""
        if name not in self.samples:
            return None
        return sum(v for labels, v in self.samples[name]
                   if all(labels.get(k) == want for k, want in label_filter.items()))


def parse_prometheus(text: str) -> MetricSnapshot:
    snap = MetricSnapshot(taken_at=time.time())
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line.strip())
        if not m:
            continue
        name, _, label_text, value = m.group(1), m.group(2), m.group(3), m.group(4)
        try:
            val = float(value)
        except ValueError:
            continue
        labels = dict(_LABEL_RE.findall(label_text or ""))
        snap.samples.setdefault(name, []).append((labels, val))
    return snap


def scrape_metrics(base_url: str, timeout: float = 10.0) -> MetricSnapshot | None:
    res = get(base_url.rstrip("/") + "/metrics", timeout=timeout)
    if not res.ok:
        return None
    return parse_prometheus(res.body.decode("utf-8", "replace"))


# The vLLM 0.26 metric names this harness reads (vllm/v1/metrics/loggers.py and
# vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py). prometheus_client adds
# "_total" to counters and "_sum"/"_count"/"_bucket" to histograms.
class M:
    EXT_HITS = "vllm:external_prefix_cache_hits_total"
    EXT_QUERIES = "vllm:external_prefix_cache_queries_total"
    PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"  # label source=...
    PROMPT_TOKENS = "vllm:prompt_tokens_total"
    REQUEST_SUCCESS = "vllm:request_success_total"  # label finished_reason=...
    QUEUE_TIME_SUM = "vllm:request_queue_time_seconds_sum"
    QUEUE_TIME_COUNT = "vllm:request_queue_time_seconds_count"
    PREFILL_TIME_SUM = "vllm:request_prefill_time_seconds_sum"
    NIXL_XFER_SUM = "vllm:nixl_xfer_time_seconds_sum"
    NIXL_XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
    NIXL_POST_SUM = "vllm:nixl_post_time_seconds_sum"
    NIXL_BYTES_SUM = "vllm:nixl_bytes_transferred_sum"
    NIXL_DESCS_SUM = "vllm:nixl_num_descriptors_sum"
    NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
    NIXL_FAILED_NOTIF = "vllm:nixl_num_failed_notifications_total"
    NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
    # kvcached-pd's series (kvcached_pd/patches/connector_metrics.py)
    KVPD_PACK_SUM = "vllm:kvcached_pd_pack_seconds_sum"  # P: device time of the pack
    KVPD_PACK_COUNT = "vllm:kvcached_pd_pack_seconds_count"
    KVPD_UNPACK_SUM = "vllm:kvcached_pd_unpack_seconds_sum"  # D: device time of the scatter
    KVPD_READ_SUM = "vllm:kvcached_pd_read_seconds_sum"  # D: the connector's READ, NIXL telemetry
    KVPD_READ_COUNT = "vllm:kvcached_pd_read_seconds_count"
    KVPD_UNPACK_COUNT = "vllm:kvcached_pd_unpack_seconds_count"
    KVPD_HANDOFF_SUM = "vllm:kvcached_pd_handoff_seconds_sum"  # D: READ posted -> scatter
    # staging occupancy gauges (bytes held now) and pressure counters, issue 10
    KVPD_P_STAGING = "vllm:kvcached_pd_prefill_staging_bytes"  # P: packed extents held
    KVPD_D_STAGING = "vllm:kvcached_pd_decode_staging_bytes"  # D: extents reserved
    KVPD_FALLBACKS = "vllm:kvcached_pd_direct_fallbacks_total"  # staged -> direct path
    KVPD_STAGING_WAITS = "vllm:kvcached_pd_staging_waits_total"  # waits for staging room
    # D: peers that fell back from the CUDA IPC wire to the NIXL READ (issue 19)
    KVPD_WIRE_FALLBACKS = "vllm:kvcached_pd_wire_fallbacks_total"
    # D: bytes each staged load moved (its window of P's extent; 0 for a full prefix hit)
    # and bytes D's prefix cache made unnecessary (issue 23)
    KVPD_MOVED_SUM = "vllm:kvcached_pd_moved_bytes_sum"
    KVPD_MOVED_COUNT = "vllm:kvcached_pd_moved_bytes_count"
    KVPD_SKIPPED = "vllm:kvcached_pd_prefix_skipped_bytes_total"
    # packs and unpacks that took the ordinary kernels under installed CUDA graphs
    KVPD_GRAPH_FALLBACKS = "vllm:kvcached_pd_graph_fallbacks_total"


def metric_delta(before: MetricSnapshot | None, after: MetricSnapshot | None, name: str,
                 **label_filter: str) -> float | None:
    """after - before for one metric; None when the metric is absent from ``after``.

    A metric absent before but present after counts from zero: vLLM registers some
    series lazily (e.g. per-connector histograms appear with the first transfer).
    """
    if after is None:
        return None
    a = after.total(name, **label_filter)
    if a is None:
        return None
    b = before.total(name, **label_filter) if before is not None else None
    return a - (b or 0.0)


# --------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------


def write_json(path: str, obj: Any) -> None:
    """Write atomically, so a harness killed mid-write never leaves half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def median(values: Iterable[float | None]) -> float | None:
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def percentile(values: Iterable[float | None], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


class Deadline:
    """Wall-clock budget for a whole script, so it reports partial results in time
    instead of being killed by the host's per-command limit."""

    def __init__(self, seconds: float | None):
        self.start = time.monotonic()
        self.seconds = seconds if seconds and seconds > 0 else None

    def remaining(self) -> float:
        if self.seconds is None:
            return float("inf")
        return self.seconds - (time.monotonic() - self.start)

    def expired(self, reserve: float = 0.0) -> bool:
        return self.remaining() <= reserve

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def log(msg: str) -> None:
    """Progress line with a wall-clock stamp; flushed so `tee` shows it immediately."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
