"""Handoff timeline: one log line per transport event, when ``KVCACHED_PD_TRACE=1``.

For profiling a deployment (and the benchmark on the GPU host): every line is
``kvcached-pd trace {json}`` with a wall-clock timestamp ``t`` (seconds, ``time.time()``,
comparable across the prefill and decode processes of one host), the event name ``ev``
and the request id ``req``. ``experiments/trace_timeline.py`` turns the lines of both
instances into per-request timelines.

Events of kvcached-pd's connector, in the order a request meets them:

prefill  ``p_admit`` (scheduler: the request's extent reserved before vLLM schedules
         its prefill; ``bytes``, ``waited`` (staging was full first), ``since_arrival_ms``),
         ``pack_ordered`` (scheduler: the step completing the prompt orders the pack;
         ``bytes``, ``tokens``, ``since_arrival_ms``), ``packed`` (worker; ``device_ms`` of
         the pack kernels from the first device operation, ``host_ms`` of the pack calls
         on the host, one event per step, naming its requests comma-separated; logged
         when the worker sees the pack done, not when it ran),
         ``p_finished`` (the extent handed to D), ``p_released`` (extent freed: D's DONE,
         vLLM freeing P's blocks, or the lease; ``held_ms`` since ``p_finished``), and
         ``p_blocks_released`` (P's blocks reported sent on D's DONE; absent when
         vLLM's own notification freed them first)
decode   ``d_match`` (scheduler: the request is taken as staged, before vLLM allocates
         its blocks; ``tokens``, ``since_arrival_ms``), ``d_alloc`` (scheduler allocated
         the blocks the KV lands in; ``remote_req``, ``tokens``, ``since_arrival_ms``),
         ``read_posted`` (``bytes`` moved: from the first token D's prefix cache lacks,
         tag included; ``skipped``: the bytes before them; ``remote_req``), ``read_done``
         (``handoff_ms`` from post to the scatter enqueued; ``host_ms`` of the scatter's
         host side, ``tag_ms`` of the tag read it shared with the loads done in the same
         step), ``d_recv_reported`` (the scheduler learnt it), ``d_compute_scheduled``
         (the step that runs the request's own forward, its first token on D;
         ``tokens``); a full prefix hit instead: ``d_full_hit`` (scheduler;
         ``cached_tokens``) and ``done_sent`` (the DONE alone; ``skipped``)

both     ``step`` (scheduler; ``req`` empty): a step that computed tokens, logged when the
         scheduler comes round again: ``start``, ``until_next_ms`` (its period: forward
         and sampling, the pipelined period under asynchronous scheduling, idle time
         after the engine's last step), ``tokens``, ``reqs``. What a P prefill step or
         a D decode step costs while the other instance shares the GPU.

Off by default: a disabled trace costs one cached boolean test per event.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

logger = logging.getLogger("kvcached_pd")

PREFIX = "kvcached-pd trace "
_clock = time.time  # wall clock: comparable across the processes of one host
_enabled: bool | None = None


def enabled() -> bool:
    global _enabled
    if _enabled is None:
        from kvcached_pd import config

        _enabled = config.read_settings().trace
    return _enabled


def reset() -> None:
    """Re-read ``KVCACHED_PD_TRACE`` at the next event (tests)."""
    global _enabled
    _enabled = None


def trace(event: str, req_id: str, **fields: Any) -> None:
    if not enabled():
        return
    record = {"t": round(_clock(), 6), "ev": event, "req": req_id, **fields}
    logger.info("%s%s", PREFIX, json.dumps(record, sort_keys=True, default=str))


def ms_since(t: float | None) -> float | None:
    """Milliseconds from wall-clock time ``t`` (``time.time()``) to now; None if unknown."""
    return None if t is None else round(1e3 * (_clock() - float(t)), 3)


def parse_line(line: str) -> dict[str, Any] | None:
    """The event of one log line, or None if the line is not a trace line."""
    at = line.find(PREFIX)
    if at < 0:
        return None
    try:
        record = json.loads(line[at + len(PREFIX):])
    except ValueError:
        return None
    return record if isinstance(record, dict) and "ev" in record else None
