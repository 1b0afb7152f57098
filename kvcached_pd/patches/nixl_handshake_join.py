"""Pull mode: a read queued by a NIXL handshake waits until that handshake's agents are stored.

vLLM's pull worker (0.20-0.30) runs the NIXL handshake with a new prefill engine on a
background thread. The handshake future's first callback stores the peer's agents in
``_remote_agents`` (under ``_handshake_lock``); each request waiting on that peer adds
a callback of its own that puts it in ``_ready_requests``, and ``start_load_kv`` reads
whatever is queued. A request that adds its callback after the handshake has finished,
but before the first callback has stored the agents (that callback waits for the lock
the engine thread holds while it adds the request's, or has not run yet), is queued at
once and read in the same step: ``_remote_agents[peer][(0, rank)]`` raises KeyError
(``_remote_agents`` is a defaultdict, so the lookup also leaves an empty entry behind)
and the decode instance's EngineCore dies. Seen once (vLLM 0.30.0, the project's CPU
tests on a 2-core CI machine, 2026-11-28): the first request from a new prefill
engine, handed to vLLM's connector after kvcached-pd's CUDA IPC load. That hand-over
is where it matters: on 0.30 the notify-only read (no block to read) is the only pull
read that looks the agents up (block READs use the descriptors the handshake prepared),
and vLLM's own requests reach it only when D's prefix cache holds the whole prompt,
which it never reports for a dense model (at most all tokens but the last). vLLM 0.31 checks
``_remote_agents`` for each queued read and joins the handshake again (the queue spins
in that step until the callback has run); 0.32 checks in ``_read_blocks_for_req`` too.

The hook does the same without the spin: a read whose peer's agents are not stored
while its handshake is still registered is put back at the next ``start_load_kv``.
Everything else reaches vLLM's method unchanged.

Fail-open: without it the decode instance can die on a first request from a new
prefill engine (rarely: the handshake must finish inside that window), but no KV moves
wrongly.
"""

from __future__ import annotations

import logging

from kvcached_pd import vllm_nixl
from kvcached_pd.patches.base import Patch, wrap_hook
from kvcached_pd.versions import VersionRange

logger = logging.getLogger("kvcached_pd")

READ = "_read_blocks_for_req"
START = "start_load_kv"
# the worker's reads put back for its next start_load_kv (an instance attribute of ours)
DEFERRED = "_kvcached_pd_reads_awaiting_agents"


def _read_when_agents_stored(original, self, req_id, meta):
    engine_id = meta.remote.engine_id
    with self._handshake_lock:
        stored = engine_id in self._remote_agents  # ``in`` adds no entry
        pending = engine_id in self._handshake_futures
    if not stored and pending:
        self.__dict__.setdefault(DEFERRED, []).append((req_id, meta))
        logger.debug("kvcached-pd: %s waits a step for the agents of %s (its NIXL "
                     "handshake finished, its callback has not stored them yet)",
                     req_id, engine_id)
        return None
    return original(self, req_id, meta)


def _requeue_deferred(original, self, *args, **kwargs):
    for entry in self.__dict__.pop(DEFERRED, ()):
        self._ready_requests.put(entry)
    return original(self, *args, **kwargs)


class NixlHandshakeJoinPatch(Patch):
    name = "nixl_handshake_join"
    summary = ("a pull read queued as its peer's NIXL handshake finishes waits until the "
               "peer's agents are stored (the decode EngineCore died on a KeyError)")
    target_module = vllm_nixl.NIXL_PACKAGE
    vllm_range = VersionRange("0.20", "0.31")  # 0.31 checks the agents itself
    fail_closed = False

    def _apply(self) -> None:
        owners = vllm_nixl.nixl_owners(vllm_nixl.worker_classes(), READ)
        if not owners:
            raise AttributeError(f"no NIXL worker defines {READ} in {vllm_nixl.NIXL_PACKAGE}")
        for owner in owners:
            if START not in vars(owner):
                raise AttributeError(f"{owner.__qualname__} defines {READ} but not {START}")
            self._replace(owner, READ, wrap_hook(_read_when_agents_stored, vars(owner)[READ]))
            self._replace(owner, START, wrap_hook(_requeue_deferred, vars(owner)[START]))
