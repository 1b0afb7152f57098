"""The decode side: reserve, READ P's extent, unpack, release; tell P.

Scheduler half (:class:`DecodeScheduler`), one call per vLLM hook:

* ``match`` (``get_num_new_matched_tokens``): a request whose ``kv_transfer_params``
  carry compatible :class:`StagedParams` loads asynchronously through the staged path;
  anything else (a plain vLLM P, another wire version or format, an extent larger
  than D's staging) is left to the inner NixlConnector, and said so once per peer.
* ``on_alloc`` (``update_state_after_alloc``): the blocks to unpack into.
* ``on_finished_recving`` (``update_connector_output``): the READ is done; the caller
  hands the request to the inner NixlConnector with no block to read, which sends
  P vLLM's own "done" notification so that P frees its blocks. The request keeps
  ``do_remote_prefill`` until then, so an abort at any point before it makes the inner
  connector notify P the same way (vLLM's path for requests aborted before scheduling).

Push mode (the inner connector is vLLM's ``NixlPushConnector``): a staged request is
READ the same way. D clears its ``do_remote_prefill`` once it has taken it, so the inner
push connector never registers it with P (no ``PUSH_REG``, no per-block WRITE into
kvcached memory); P frees its blocks on D's DONE (:mod:`.prefill`). A request aborted
before its READ leaves P's blocks and extent to P's lease, as vLLM's push mode does
for a decode request that never registers.

Worker half (:class:`DecodeWorker`): ``start`` (``start_load_kv``) fetches P's rank
handshake once per peer (checking wire version and format once), reserves an extent
of D's staging (waiting for room when it is full, never falling back to the 0.5 GB/s
path) and posts one READ carrying the DONE notification; ``poll`` (``get_finished``)
scatters completed extents into the request's blocks on the compute stream and frees
the extent once that scatter has run. A READ that cannot start before half of P's
lease has passed fails the request's load instead: P frees the extent at its lease.

vLLM notices a finished load only at the next ``get_finished``, one engine step later;
for a READ that ends within a fraction of a millisecond that step is most of the
handoff. So ``poll`` first waits, at most ``spin_s`` (``KVCACHED_PD_READ_SPIN_US``),
for READs predicted to end inside that budget: on the host, at 94 MiB, the connector
without it saw a READ 2.43 ms (median) after posting it, the older hooks (which this
connector replaced) with it 0.53 ms.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcached_pd.connector.records import RecvOrder
from kvcached_pd.connector.region import StagingRegion
from kvcached_pd.connector.side_channel import fetch_handshake
from kvcached_pd.connector.wire import (
    COMPATIBLE_WIRE_VERSIONS,
    Done,
    RankHandshake,
    StagedParams,
    WireError,
)
from kvcached_pd.transport.pack import unpack_request
from kvcached_pd.transport.staging import EXPECTED_READ_BYTES_PER_S, Extent
from kvcached_pd.transport.trace import ms_since, trace

logger = logging.getLogger("kvcached_pd")


@dataclass
class _Pending:
    request: Any
    params: StagedParams
    first_token: int
    blocks: Any = None  # vLLM's KVCacheBlocks, kept for the inner connector's notify
    loading: bool = False  # its RecvOrder went to the worker


@dataclass
class DecodeScheduler:
    digest: str
    block_size: int
    capacity_bytes: int
    tp_size: int
    push: bool = False  # the inner connector is vLLM's push connector (module docstring)
    pending: dict[str, _Pending] = field(default_factory=dict)
    orders: dict[str, RecvOrder] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    refused_peers: dict[str, str] = field(default_factory=dict)  # engine id -> reason
    lease_freed_peers: set[str] = field(default_factory=set)  # P block size differs
    samples: dict[str, list[float]] = field(default_factory=dict)

    def staged_params(self, request: Any) -> StagedParams | None:
        """The request's staged params when this side can serve them, else None."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            staged = StagedParams.from_params(params)
        except WireError as exc:
            self._refuse(str(params.get("remote_engine_id")), str(exc))
            return None
        if staged is None:
            reason = ("it is not a kvcached-pd prefill (no staged extent in its "
                      "kv_transfer_params)")
            if self.push:
                reason += (", or the proxy sent the decode leg before P answered (push "
                           "mode with concurrent legs: vLLM's per-block WRITE into this "
                           "instance's memory, the slow path with kvcached)")
            self._refuse(str(params.get("remote_engine_id")), reason)
            return None
        reason = None
        if staged.wire_version not in COMPATIBLE_WIRE_VERSIONS:
            reason = f"it speaks wire version {staged.wire_version}"
        elif staged.format_digest != self.digest:
            reason = "its packed format (layers, heads, dtype or TP head range) differs"
        elif staged.tp_size != self.tp_size:
            reason = f"its TP size {staged.tp_size} differs from this instance's {self.tp_size}"
        elif staged.nbytes > self.capacity_bytes:
            reason = (f"request {request.request_id}'s {staged.nbytes >> 20} MiB exceed the "
                      f"{self.capacity_bytes >> 20} MiB decode staging")
        if reason is not None:
            self._refuse(staged.engine_id, reason)
            return None
        return staged

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int, bool] | None:
        staged = self.staged_params(request)
        if staged is None:
            return None
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return None  # a full prefix hit on D: the inner connector only notifies P
        self.pending[request.request_id] = _Pending(request, staged, num_computed_tokens)
        return count, True

    def on_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool:
        """True when the request is staged (the caller keeps the inner connector out)."""
        entry = self.pending.get(request.request_id)
        if entry is None:
            return False
        if num_external_tokens <= 0:
            del self.pending[request.request_id]
            return False
        entry.blocks = blocks
        if self.push:
            # the inner push connector must never register it with P (a PUSH_REG would
            # make P WRITE its blocks into kvcached memory, the 0.5 GB/s path)
            request.kv_transfer_params["do_remote_prefill"] = False
        elif entry.params.block_size != self.block_size:
            self._leave_to_lease(entry)
        trace("d_alloc", request.request_id, remote_req=entry.params.request_id,
              tokens=int(num_external_tokens),
              since_arrival_ms=ms_since(getattr(request, "arrival_time", None)))
        ids = list(blocks.get_block_ids()[0])
        first_block = entry.first_token // self.block_size
        last_block = math.ceil(entry.params.num_tokens / self.block_size)
        entry.loading = True
        self.orders[request.request_id] = RecvOrder(
            params=entry.params, block_ids=tuple(ids[first_block:last_block]),
            first_token=entry.first_token,
            deadline=time.monotonic() + entry.params.lease_s / 2)
        return True

    def take_orders(self) -> tuple[dict[str, RecvOrder], set[str]]:
        orders, self.orders = self.orders, {}
        cancelled, self.cancelled = self.cancelled, set()
        return orders, cancelled

    def on_finished_recving(self, req_ids) -> list[tuple[Any, Any]]:
        """(request, blocks) of staged loads that completed: the caller passes them to
        the inner connector so that P is told and frees its blocks."""
        handed = []
        for req_id in req_ids or ():
            trace("d_recv_reported", req_id)
            entry = self.pending.pop(req_id, None)
            if entry is None or entry.blocks is None:
                continue
            if self.push or entry.params.block_size != self.block_size:
                continue  # push: P frees them on DONE; P16/D32: by its lease
            handed.append((entry.request, entry.blocks))
        return handed

    def _leave_to_lease(self, entry: _Pending) -> None:
        """P's and D's block sizes differ: vLLM's notify-only read (no local block)
        indexes group 0 of a remote block list it leaves empty then (vLLM 0.26
        ``pull_worker._read_blocks``: IndexError, the decode EngineCore died on the
        host with P 16 / D 32). So the request never reaches that path: it no longer
        asks for a remote prefill (vLLM's own connector clears the flag the same way
        once it has taken a request), and P frees its blocks when its KV lease runs
        out; its staging extent is still freed by D's DONE."""
        entry.request.kv_transfer_params["do_remote_prefill"] = False
        if entry.params.engine_id not in self.lease_freed_peers:
            self.lease_freed_peers.add(entry.params.engine_id)
            logger.warning(
                "kvcached-pd: prefill %s uses %d-token blocks, this decode %d: vLLM cannot "
                "notify it without a read, so it frees each request's blocks when its KV "
                "lease (%.0f s) runs out instead of at once", entry.params.engine_id,
                entry.params.block_size, self.block_size, entry.params.lease_s)

    def on_request_finished(self, request: Any) -> None:
        entry = self.pending.get(request.request_id)
        if entry is None:
            return
        if not entry.loading:
            del self.pending[request.request_id]
            if not self.push and entry.params.block_size != self.block_size:
                self._leave_to_lease(entry)
        else:
            # vLLM keeps the blocks until the worker reports the load finished.
            self.cancelled.add(request.request_id)

    def take_samples(self) -> dict[str, list[float]]:
        samples, self.samples = self.samples, {}
        return samples

    def _refuse(self, engine_id: str, reason: str) -> None:
        self.samples.setdefault("direct_fallbacks", []).append(1)
        if self.refused_peers.get(engine_id) != reason:
            self.refused_peers[engine_id] = reason
            logger.warning("kvcached-pd: requests from prefill %s take vLLM's own NIXL path: "
                           "%s", engine_id, reason)


@dataclass
class _Read:
    order: RecvOrder
    extent: Extent | None = None
    handle: Any = None
    posted: float = 0.0


class DecodeWorker:
    """D's worker half (see the module docstring)."""

    def __init__(self, region: StagingRegion, handshake_timeout_s: float = 5.0,
                 spin_s: float = 0.0) -> None:
        self.region = region
        self.spin_s = spin_s
        self.handshake_timeout_s = handshake_timeout_s
        self._peers: dict[tuple[str, int], Future] = {}  # (engine, P rank) -> (name, hs)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvcached-pd-hs")
        self._lock = threading.Lock()
        self.queued: dict[str, _Read] = {}  # waiting for a handshake or for room
        self.inflight: dict[str, _Read] = {}
        self.cancelled: set[str] = set()
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.invalid_blocks: set[int] = set()
        # (start event, end event, extent): freed once the scatter has run on the device
        self.releasing: list[tuple[Any, Any, Extent]] = []
        self.samples: dict[str, list[float]] = {}

    # ------------------------------------------------------------- vLLM's hooks
    def start(self, orders: dict[str, RecvOrder], cancelled: set[str]) -> None:
        for req_id, order in orders.items():
            self.queued[req_id] = _Read(order)
            self._peer(order.params)
        for req_id in cancelled:
            if req_id in self.queued:  # not posted: nothing to wait for
                del self.queued[req_id]
                self.finished.add(req_id)
            elif req_id in self.inflight:
                self.cancelled.add(req_id)
        self._post_queued()

    def poll(self) -> tuple[set[str], set[str], set[int]]:
        """Requests whose load finished (loaded, failed or cancelled), those of them
        that failed, and the blocks that failed to load, since the last call."""
        states = self._await_imminent()
        for req_id, read in list(self.inflight.items()):
            state = states.get(req_id) or self.region.agent.state(read.handle)
            if state == "PROC":
                continue
            del self.inflight[req_id]
            if state == "DONE":
                wire_s = self.region.agent.transfer_seconds(read.handle)
                if wire_s is not None:
                    self.samples.setdefault("read_duration", []).append(wire_s)
            self.region.agent.release(read.handle)
            if state == "DONE" and req_id not in self.cancelled:
                self._unpack(req_id, read)
            else:
                if state != "DONE":
                    logger.error("kvcached-pd: staged READ of request %s failed (NIXL state "
                                 "%s)", req_id, state)
                    self.invalid_blocks.update(read.order.block_ids)
                    self.failed.add(req_id)
                self.releasing.append((None, None, read.extent))
            self.cancelled.discard(req_id)
            self.finished.add(req_id)
        self._post_queued()
        self._reap()
        finished, self.finished = self.finished, set()
        failed, self.failed = self.failed, set()
        invalid, self.invalid_blocks = self.invalid_blocks, set()
        return finished, failed, invalid

    # ----------------------------------------------------------------- helpers
    def _await_imminent(self) -> dict[str, str]:
        """Wait, at most ``spin_s``, for in-flight READs predicted to end within it;
        the states last seen (a READ that finished or failed stays so)."""
        if self.spin_s <= 0 or not self.inflight:
            return {}
        t0 = time.perf_counter()
        deadline = t0 + self.spin_s
        waiting = {req_id: read for req_id, read in self.inflight.items()
                   if req_id not in self.cancelled and read.posted
                   + read.order.params.nbytes / EXPECTED_READ_BYTES_PER_S <= deadline}
        states: dict[str, str] = {}
        while waiting:
            for req_id, read in list(waiting.items()):
                states[req_id] = self.region.agent.state(read.handle)
                if states[req_id] != "PROC":
                    del waiting[req_id]
            if time.perf_counter() >= deadline:
                break
        spent = time.perf_counter() - t0
        if spent > 0 and states:
            self.samples.setdefault("read_spin", []).append(spent)
        return {req_id: state for req_id, state in states.items() if state != "PROC"}

    def _peer(self, params: StagedParams) -> Future:
        key = (params.engine_id, self.region.tp_rank)
        with self._lock:
            future = self._peers.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._handshake, params)
                self._peers[key] = future
        return future

    def _handshake(self, params: StagedParams) -> tuple[str, RankHandshake]:
        data = fetch_handshake(params.host, params.port, self.region.tp_rank,
                               self.handshake_timeout_s)
        handshake = RankHandshake.decode(data)
        handshake.check_compatible(self.region.fmt, self.region.digest)
        name = self.region.agent.add_peer(handshake)
        logger.info("kvcached-pd: staged peer %s rank %d: %d MiB staging, wire version %d",
                    handshake.engine_id, handshake.tp_rank, handshake.staging_bytes >> 20,
                    handshake.wire_version)
        return name, handshake

    def _fail(self, req_id: str, read: _Read, reason: str) -> None:
        logger.error("kvcached-pd: request %s: staged load failed: %s", req_id, reason)
        self.invalid_blocks.update(read.order.block_ids)
        self.finished.add(req_id)
        self.failed.add(req_id)
        if read.extent is not None:
            self.releasing.append((None, None, read.extent))

    def _post_queued(self) -> None:
        """Post queued READs in arrival order while there is room."""
        now = time.monotonic()
        for req_id, read in list(self.queued.items()):
            params = read.order.params
            future = self._peer(params)
            if now > read.order.deadline:
                del self.queued[req_id]
                self._fail(req_id, read, "it waited past half of P's lease "
                           f"({params.lease_s:.0f} s) for a handshake or for staging room")
                continue
            if not future.done():
                continue
            if future.exception() is not None:
                del self.queued[req_id]
                self._fail(req_id, read, f"no handshake with prefill {params.engine_id}: "
                           f"{future.exception()}")
                continue
            peer, handshake = future.result()
            if read.extent is None:
                read.extent = self.region.buffer.alloc(params.nbytes, req_id)
                if read.extent is None:
                    if not getattr(read, "_waited", False):
                        read._waited = True  # type: ignore[attr-defined]
                        self.samples.setdefault("waits", []).append(1)
                        logger.info("kvcached-pd: decode staging full (%d MiB used); request "
                                    "%s waits for room",
                                    self.region.buffer.allocator.used_bytes >> 20, req_id)
                    break  # keep arrival order
                self._usage_changed()
            notif = Done(params.request_id, self.region.tp_rank).encode()
            try:
                read.handle = self.region.agent.read(peer, handshake, params.offset,
                                                     read.extent.offset, params.nbytes, notif)
            except Exception as exc:  # noqa: BLE001 - the request's load fails, D lives
                del self.queued[req_id]
                self._fail(req_id, read, f"the READ did not start: {exc}")
                continue
            del self.queued[req_id]
            read.posted = time.perf_counter()
            self.inflight[req_id] = read
            trace("read_posted", req_id, bytes=params.nbytes, remote_req=params.request_id)

    def _unpack(self, req_id: str, read: _Read) -> None:
        region = self.region
        order, params = read.order, read.order.params
        start = end = stream = None
        if region.buffer.tensor.is_cuda:
            stream = torch.cuda.current_stream(region.buffer.tensor.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        kernel_ids = region.kernel_ids(list(order.block_ids))
        kbs = region.kernel_block_size
        kernel_ids = kernel_ids[: math.ceil((params.num_tokens - order.first_token) / kbs)]
        if kernel_ids:
            unpack_request(region.layers, kernel_ids,
                           region.region(read.extent.offset, params.nbytes), region.fmt,
                           params.num_tokens, params.n_tok_slots, order.first_token)
        if end is not None:
            end.record(stream)
        self.releasing.append((start, end, read.extent))
        handoff = time.perf_counter() - read.posted
        self.samples.setdefault("handoff_duration", []).append(handoff)
        trace("read_done", req_id, bytes=params.nbytes, handoff_ms=round(1e3 * handoff, 3))

    def _reap(self) -> None:
        """Free extents whose scatter has run on the device."""
        still, freed = [], False
        for start, end, extent in self.releasing:
            if extent is None:
                continue
            if end is None or end.query():
                if start is not None:
                    self.samples.setdefault("unpack_duration", []).append(
                        start.elapsed_time(end) / 1e3)
                self.region.buffer.free(extent)
                freed = True
            else:
                still.append((start, end, extent))
        self.releasing = still
        if freed:
            self._usage_changed()

    def _usage_changed(self) -> None:
        self.samples.setdefault("decode_staging_bytes", []).append(
            self.region.buffer.allocator.used_bytes)

    def take_samples(self) -> dict[str, list[float]]:
        samples, self.samples = self.samples, {}
        return samples

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
