"""Handoff timeline: one log line per transport event, when ``KVCACHED_PD_TRACE=1``.

For profiling a deployment (and the benchmark on the GPU host): every line is
``kvcached-pd trace {json}`` with a wall-clock timestamp ``t`` (seconds, ``time.time()``,
comparable across the prefill and decode processes of one host), the event name ``ev``
and the request id ``req``. ``experiments/trace_timeline.py`` turns the lines of both
instances into per-request timelines.

Events, in the order a request meets them:

prefill  ``pack_ordered`` (scheduler reserved an extent; ``since_arrival_ms``),
         ``packed`` (worker; ``device_ms`` of the pack kernels, ``wall_ms`` incl. the
         wait for the step's forward), ``p_finished``, ``p_released`` (extent freed:
         D's notification or the abort timeout; ``held_ms`` since ``p_finished``)
decode   ``d_alloc`` (scheduler allocated the blocks the KV lands in;
         ``since_arrival_ms``), ``read_posted``, ``read_done`` (``seen_ms`` from post
         to completion seen, ``spin_ms`` spent waiting for it in the same step),
         ``unpack_done`` (``device_ms``), ``d_recv_reported`` (scheduler learnt it)

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

        _enabled = config.read_settings(frozenset()).trace
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
