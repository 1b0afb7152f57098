"""The staged, coalesced data path, plugged into vLLM's pull-mode NixlConnector.

Push mode (``NixlPushConnector``) is in :mod:`kvcached_pd.transport.staged_push`; it
shares this module's state (:class:`SchedulerStaging`, :class:`WorkerStaging`), the
pack on P, D's extent reservation, the transfer posting and D's unpack.

vLLM's control plane stays as it is: handshake, ``kv_transfer_params``, D's completion
notification to P, P's abort timeout, stats. Only the bytes take another path:

prefill (P)
  scheduler  ``update_state_after_alloc``: remember ``do_remote_decode`` requests;
             ``build_connector_meta``: follow their block ids; in the step that
             schedules a request's last prompt tokens, reserve an extent of P's staging
             region and tell the worker to pack there (``meta.kvcached_pd_pack``);
             ``request_finished``: add the extent to the ``kv_transfer_params`` D gets;
             ``update_connector_output``: free the extent exactly when vLLM frees P's
             blocks (D's notification, or P's abort timeout), or at once if the request
             did not finish for a remote decode.
  worker     ``wait_for_save`` (after that step's forward, same stream): gather every
             layer's blocks into the extent in the canonical packed format, and wait for
             it, so D can never read a half-written extent.
decode (D)
  worker     ``_read_blocks_for_req``: instead of one descriptor per block x layer, READ
             the extent into D's own staging with a few large descriptors, carrying the
             same notification vLLM would send; ``get_finished``: once NIXL reports the
             READ done, scatter the extent into D's blocks (stream-ordered before any
             forward that reads them) and release D's extent when that scatter is done.

Kvcached memory is never the remote side of a NIXL transfer: both staging regions are
ordinary device allocations, registered once. The staging address and packed format
travel in the handshake metadata (extra fields that vanilla peers ignore).

Fallbacks, never errors: no room in P's staging -> no staging params -> D reads blocks
directly; an extent larger than D's whole staging, no staged peer, or a format mismatch
-> D reads blocks directly (logged); no room in D's staging right now -> the read waits
for room. Scope: TP=1, one full-attention KV-cache group.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcached_pd.registry import peer_direct_path_safe
from kvcached_pd.transport import sizing
from kvcached_pd.transport.format import PackedFormat, format_of_kv_cache_config
from kvcached_pd.transport.layout import AttnCacheSpec, KVCacheLayers, logical_kv_view
from kvcached_pd.transport.pack import pack_request, unpack_request
from kvcached_pd.transport.staging import (
    EXPECTED_READ_BYTES_PER_S,
    Extent,
    ExtentAllocator,
    StagingBuffer,
)
from kvcached_pd.transport.trace import ms_since, trace

logger = logging.getLogger("kvcached_pd")

PARAMS_KEY = "kvcached_pd_staged"  # in kv_transfer_params, P -> D
# Lists added to vLLM's NixlKVConnectorStats.data (they reach its Prometheus metrics)
STAT_PACK = "kvcached_pd_pack_duration"  # s, device time of one step's pack kernels
STAT_HANDOFF = "kvcached_pd_handoff_duration"  # s, D: READ posted -> scatter enqueued
STAT_UNPACK = "kvcached_pd_unpack_duration"  # s, D: scatter time on the device
STAT_P_STAGING = "kvcached_pd_prefill_staging_bytes"  # gauge: P's range in use, on change
STAT_D_STAGING = "kvcached_pd_decode_staging_bytes"  # gauge: D's range in use, on change
STAT_FALLBACKS = "kvcached_pd_direct_fallbacks"  # requests that took the direct path
STAT_WAITS = "kvcached_pd_staging_waits"  # requests that waited for staging room
STAT_KEYS = (STAT_PACK, STAT_HANDOFF, STAT_UNPACK, STAT_P_STAGING, STAT_D_STAGING,
             STAT_FALLBACKS, STAT_WAITS)  # the metrics patch (patches/connector_metrics.py)


def record_stat(worker: Any, key: str, value: float) -> None:
    """Append to vLLM's per-worker KV-connector stats, if they carry kvcached-pd's keys."""
    stats = getattr(worker, "xfer_stats", None)
    series = getattr(stats, "data", {}).get(key) if stats is not None else None
    if series is not None:
        series.append(value)


HANDSHAKE_FIELD = "kvcached_pd_staged"  # in NIXL agent metadata
CHUNK_BYTES = 64 << 20  # one NIXL descriptor per 64 MiB of extent
ALIGNMENT = sizing.ALIGNMENT


def packed_format_for(kv_cache_config: Any, tp_size: int) -> PackedFormat | None:
    """This engine's canonical format, or None if the hook path cannot serve it (TP=1)."""
    fmt, _ = format_of_kv_cache_config(kv_cache_config)
    return fmt if tp_size == 1 else None


# ------------------------------------------------------------------------- scheduler
@dataclass
class _Tracked:
    request: Any
    block_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerStaging:
    """P's scheduler: the prefill range of the staging buffer, request by request.

    A remote-decode request gets its extent *before* vLLM schedules its prefill
    (:meth:`admit`, from ``get_num_new_matched_tokens``); while there is no room vLLM
    skips the request and tries again next step, so a full staging means waiting for
    D's READs to free room, never the direct path (0.5 GB/s for kvcached peers). The
    extent is packed in the step that completes the prompt, travels to D in
    ``kv_transfer_params`` and is freed when vLLM frees P's blocks (D's notification or
    the abort timeout), or at once when the request ends without a remote decode.
    """

    fmt: PackedFormat
    block_size: int
    allocator: ExtentAllocator
    tracked: dict[str, _Tracked] = field(default_factory=dict)
    reserved: dict[str, Extent] = field(default_factory=dict)  # admitted, not packed yet
    extents: dict[str, tuple[Extent, dict[str, Any]]] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)  # held back for room right now
    fallbacks: int = 0
    waits: int = 0
    # stats for vLLM's KV-connector stats (the scheduler has no worker to carry them)
    samples: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def create(cls, scheduler: Any, staging_mb: int | None) -> "SchedulerStaging | None":
        tp = scheduler.vllm_config.parallel_config.tensor_parallel_size
        fmt = packed_format_for(scheduler.kv_cache_config, tp)
        if fmt is None:
            return None
        plan = sizing.plan_for(scheduler.vllm_config, scheduler.kv_cache_config, fmt,
                               staging_mb)
        return cls(fmt=fmt, block_size=int(scheduler.block_size),
                   allocator=ExtentAllocator(plan.prefill_bytes, ALIGNMENT))

    def _sample(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def _usage_changed(self) -> None:
        self._sample(STAT_P_STAGING, self.allocator.used_bytes)

    def take_samples(self) -> dict[str, list[float]]:
        samples, self.samples = self.samples, {}
        return samples

    def extent_bytes(self, request: Any) -> int:
        n_blocks = math.ceil(int(request.num_prompt_tokens) / self.block_size)
        return self.fmt.extent_bytes(n_blocks * self.block_size)

    def admit(self, request: Any) -> bool:
        """Reserve the extent of a remote-decode prefill; False: no room now, hold the
        request back (vLLM retries it next step)."""
        req_id = request.request_id
        if req_id in self.reserved or req_id in self.extents:
            return True
        nbytes = self.extent_bytes(request)
        extent = self.allocator.alloc(nbytes, req_id)
        if extent is None:
            if nbytes > self.allocator.capacity_bytes:
                return True  # can never fit (explicit sizes are checked at startup)
            if req_id not in self.waiting:
                self.waiting.add(req_id)
                self.waits += 1
                self._sample(STAT_WAITS, 1)
                logger.info("kvcached-pd: prefill staging full (%d of %d MiB in use); request "
                            "%s (%d MiB) waits for room", self.allocator.used_bytes >> 20,
                            self.allocator.capacity_bytes >> 20, req_id, nbytes >> 20)
            return False
        self.waiting.discard(req_id)
        self.reserved[req_id] = extent
        self._usage_changed()
        return True

    def track(self, request: Any) -> None:
        self.tracked.setdefault(request.request_id, _Tracked(request))

    def on_step(self, scheduler_output: Any, meta: Any, yield_req_data) -> None:
        """Follow block ids; order a pack when a prefill completes."""
        packs: dict[str, dict[str, Any]] = {}
        num_scheduled = scheduler_output.num_scheduled_tokens or {}
        for req_id, new_block_id_groups, _ in yield_req_data(scheduler_output):
            tracked = self.tracked.get(req_id)
            if tracked is None or new_block_id_groups is None:
                continue
            tracked.block_ids.extend(new_block_id_groups[0])
            req = tracked.request
            if req.num_computed_tokens + num_scheduled.get(req_id, 0) < req.num_prompt_tokens:
                continue  # a later chunk completes the prompt
            del self.tracked[req_id]
            num_tokens = int(req.num_prompt_tokens)
            n_blocks = math.ceil(num_tokens / self.block_size)
            block_ids = tracked.block_ids[:n_blocks]
            n_tok_slots = n_blocks * self.block_size
            nbytes = self.extent_bytes(req)  # what admit() reserved for it
            extent = self.reserved.pop(req_id, None)
            if extent is None or extent.nbytes != nbytes:
                if extent is not None:
                    self.allocator.free(extent)
                    self._usage_changed()
                self.fallbacks += 1
                self._sample(STAT_FALLBACKS, 1)
                logger.warning(
                    "kvcached-pd: request %s (%d MiB) has no staging extent (%d of %d MiB in "
                    "use): it will travel by the direct path", req_id, nbytes >> 20,
                    self.allocator.used_bytes >> 20, self.allocator.capacity_bytes >> 20)
                continue
            info = {"offset": extent.offset, "nbytes": nbytes, "n_tok_slots": n_tok_slots,
                    "num_tokens": num_tokens, "format": self.fmt.to_dict()}
            self.extents[req_id] = (extent, info)
            packs[req_id] = {"block_ids": list(block_ids), **info}
            trace("pack_ordered", req_id, bytes=nbytes, tokens=num_tokens,
                  since_arrival_ms=ms_since(getattr(req, "arrival_time", None)))
        meta.kvcached_pd_pack = packs

    def on_finished(self, request: Any, delay_free: bool, params: dict | None) -> None:
        req_id = request.request_id
        self.tracked.pop(req_id, None)
        self.waiting.discard(req_id)
        entry = self.extents.get(req_id)
        if entry is None:
            self.release(req_id)  # aborted before its prompt completed
            return
        if delay_free and params is not None and params.get("remote_block_ids") is not None:
            params[PARAMS_KEY] = dict(entry[1])
            entry[1]["finished_at"] = time.time()
            trace("p_finished", req_id, bytes=entry[1]["nbytes"])
        else:
            self.release(req_id)

    def release(self, req_id: str) -> None:
        extent = self.reserved.pop(req_id, None)
        if extent is not None:
            self.allocator.free(extent)
            self._usage_changed()
        entry = self.extents.pop(req_id, None)
        if entry is not None:
            self.allocator.free(entry[0])
            self._usage_changed()
            trace("p_released", req_id, held_ms=ms_since(entry[1].get("finished_at")))


# ---------------------------------------------------------------------------- worker
@dataclass
class WorkerStaging:
    """Per-worker state: the staging region, layer views, remote peers, D's pending reads."""

    fmt: PackedFormat
    buffer: StagingBuffer
    layers: KVCacheLayers | None = None
    kernel_block_size: int = 0
    ratio: int = 1
    read_spin_s: float = 0.0  # D: longest wait for an imminent READ within one step
    push: bool = False  # a push-mode worker (P WRITEs into D's staging)
    # P waits for its pack when vLLM may sample before wait_for_save runs (speculative
    # decoding defers it past the draft model, see pack_for_requests)
    sync_pack: bool = False
    hold_s: float = 35.0  # push D: a failed request's extent stays unused this long after its offer
    remote: dict[str, dict[str, Any]] = field(default_factory=dict)  # engine_id -> staged
    recv_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    waiting: dict[str, Any] = field(default_factory=dict)  # req_id -> meta, D staging full
    pending: dict[str, tuple[Extent, dict[str, Any], float]] = field(default_factory=dict)
    # (scatter start event, end event, extent); events are None on the CPU
    releasing: list[tuple[Any, Any, Extent]] = field(default_factory=list)
    # push mode (see kvcached_pd.transport.staged_push)
    packed: dict[str, dict[str, int]] = field(default_factory=dict)  # P: req -> its extent
    push_offers: dict[str, dict[str, Any]] = field(default_factory=dict)  # P: req -> D's offer
    push_arrived: set[str] = field(default_factory=set)  # D: staged WRITE landed
    push_waiting: dict[str, dict[str, Any]] = field(default_factory=dict)  # D: held regs
    quarantine: list[tuple[float, Extent]] = field(default_factory=list)  # D: (until, extent)
    # P: packs enqueued on the compute stream, not waited for: (req ids, bytes, start
    # event, end event, wall start); their device time is recorded once they are done
    packing: list[tuple[str, int, Any, Any, float]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=lambda: {
        "packs": 0, "pack_bytes": 0, "pack_s": 0.0, "reads": 0, "read_bytes": 0,
        "handoff_s": 0.0, "unpack_s": 0.0, "spin_s": 0.0, "fallbacks": 0, "writes": 0})

    def handshake_fields(self, device_id: int) -> dict[str, Any]:
        return {"base": int(self.buffer.tensor.data_ptr()),
                "nbytes": int(self.buffer.tensor.numel()),
                "device_id": int(device_id), "format": self.fmt.to_dict()}

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer.tensor[offset: offset + nbytes]

    def kernel_ids(self, logical_ids: list[int]) -> list[int]:
        r = self.ratio
        return [b * r + i for b in logical_ids for i in range(r)]

    def decode_usage_changed(self, worker: Any) -> None:
        record_stat(worker, STAT_D_STAGING, self.buffer.allocator.used_bytes)

    def reap(self, worker: Any = None) -> None:
        """Free D extents whose scatter has finished on the device; record its time."""
        still = []
        freed = False
        for start, end, extent in self.releasing:
            if end is None or end.query():
                self.buffer.free(extent)
                freed = True
                if start is not None and worker is not None:
                    record_stat(worker, STAT_UNPACK, start.elapsed_time(end) / 1e3)
                    trace("unpack_done", str(extent.owner),
                          device_ms=round(start.elapsed_time(end), 3))
            else:
                still.append((start, end, extent))
        self.releasing = still
        if self.quarantine:
            now = time.monotonic()
            for _, extent in [q for q in self.quarantine if q[0] <= now]:
                self.buffer.free(extent)
                freed = True
            self.quarantine = [q for q in self.quarantine if q[0] > now]
        if freed and worker is not None:
            self.decode_usage_changed(worker)
        if self.packing:
            self.reap_packs(worker)

    def reap_packs(self, worker: Any = None) -> None:
        """Record the device time of packs that have finished (P never waits for them:
        see :func:`pack_for_requests`)."""
        still = []
        for entry in self.packing:
            req_ids, nbytes, start, end, wall0 = entry
            if end is not None and not end.query():
                still.append(entry)
                continue
            wall = time.perf_counter() - wall0
            device = start.elapsed_time(end) / 1e3 if end is not None else wall
            self.stats["pack_s"] += device
            if worker is not None:
                record_stat(worker, STAT_PACK, device)
            trace("packed", req_ids, bytes=nbytes, device_ms=round(1e3 * device, 3),
                  wall_ms=round(1e3 * wall, 3))
            _log_transfer(self, "pack", self.stats["packs"],
                          f"{nbytes >> 20} MiB packed for {req_ids} in {1e3 * device:.2f} ms "
                          "on the device")
        self.packing = still


def build_layer_views(worker: Any, kv_caches: dict[str, torch.Tensor]) -> tuple[KVCacheLayers, int]:
    group = worker.kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    kernel_bs = int(worker.block_size)  # after vLLM's kernel block-size sync
    views = []
    seen = set()
    for name in group.layer_names:
        cache = kv_caches[name]
        if cache.data_ptr() in seen:
            continue
        seen.add(cache.data_ptr())
        views.append(logical_kv_view(cache, AttnCacheSpec(kernel_bs, spec.num_kv_heads, spec.head_size)))
    return KVCacheLayers.from_views(views), kernel_bs


def pack_for_requests(worker: Any, st: WorkerStaging, packs: dict[str, dict[str, Any]]) -> None:
    """Gather each finished prefill's blocks into its extent, on the compute stream.

    Called from ``wait_for_save``, after the step's forward and before vLLM samples, on
    the same stream: the sampled token, and with it P's response that hands D the
    extent, cannot exist before the pack has run. So P does not wait for the pack here
    (earlier releases did, which stalled the engine loop under async scheduling for the
    whole forward); a push-mode WRITE, which P's writer thread may start on D's
    registration alone, first waits for the pack's event (:func:`packed_extent`).
    With speculative decoding vLLM 0.26 calls ``wait_for_save`` only after the draft
    model, i.e. after sampling (``defer_kv_connector_finalize``): the response could
    then leave before the pack has run, so P waits for it (``st.sync_pack``).
    """
    if not packs or st.layers is None:
        return
    t0 = time.perf_counter()
    start = end = None
    if st.buffer.tensor.is_cuda:
        stream = torch.cuda.current_stream(st.buffer.tensor.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)  # stream-ordered after the step's forward
    for req_id, order in packs.items():
        kernel_ids = st.kernel_ids(order["block_ids"])
        n_tok_slots = len(kernel_ids) * st.kernel_block_size
        if n_tok_slots != order["n_tok_slots"]:
            raise RuntimeError(
                f"kvcached-pd: request {req_id}: scheduler planned {order['n_tok_slots']} token "
                f"slots, worker has {n_tok_slots}; refusing to pack a mis-sized extent"
            )
        # The scheduler reserved [offset, offset + nbytes) for this request; it frees it.
        pack_request(st.layers, kernel_ids, st.region(order["offset"], order["nbytes"]), st.fmt)
        st.stats["packs"] += 1
        st.stats["pack_bytes"] += order["nbytes"]
    if end is not None:
        end.record(stream)
        if st.sync_pack:
            end.synchronize()
    for req_id, order in packs.items():
        if st.push:  # the writer thread WRITEs it once D's registration offers staging
            st.packed[req_id] = {"offset": int(order["offset"]), "nbytes": int(order["nbytes"]),
                                 "ready": end}
    nbytes = sum(o["nbytes"] for o in packs.values())
    st.packing.append((",".join(packs), nbytes, start, end, t0))
    st.reap_packs(worker)


def packed_extent(st: WorkerStaging, req_id: str) -> dict[str, Any] | None:
    """P's packed extent of ``req_id`` once its pack has finished on the device (the
    caller, P's push writer thread, waits for that), or None if it packed none."""
    packed = st.packed.get(req_id)
    if packed is not None and packed.get("ready") is not None:
        packed["ready"].synchronize()
    return packed


def _log_transfer(st: WorkerStaging, what: str, count: float, detail: str) -> None:
    """INFO for the first transfers and every 100th, DEBUG otherwise."""
    level = logging.INFO if count <= 3 or count % 100 == 0 else logging.DEBUG
    logger.log(level, "kvcached-pd: %s #%d: %s", what, int(count), detail)


def reserve_decode_extent(worker: Any, st: WorkerStaging, req_id: str, info: dict[str, Any],
                          already_waiting: bool) -> tuple[Extent | None, str | None]:
    """D's extent for the packed extent ``info`` describes: ``(extent, None)``;
    ``(None, None)`` when it would fit but there is no room now (the caller waits);
    ``(None, reason)`` when it cannot be staged."""
    try:
        st.fmt.check_compatible(PackedFormat.from_dict(info["format"]))
    except ValueError as exc:
        return None, f"packed formats differ: {exc}"
    nbytes = int(info["nbytes"])
    extent = st.buffer.alloc(nbytes, req_id)
    if extent is not None:
        st.decode_usage_changed(worker)
        return extent, None
    if nbytes > st.buffer.allocator.capacity_bytes:
        return None, f"its {nbytes >> 20} MiB exceed the decode staging region"
    if not already_waiting:
        record_stat(worker, STAT_WAITS, 1)
        logger.info("kvcached-pd: decode staging full (%d MiB used); request %s waits for "
                    "room", st.buffer.allocator.used_bytes >> 20, req_id)
    return None, None


def has_local_blocks(meta: Any) -> bool:
    """Whether D asked for any block of this request.

    vLLM lists no block when D holds the whole prompt in its own prefix cache, and for
    a request aborted before D scheduled it (``request_finished`` queues it with an
    empty list so that the worker tells P to free its blocks). Either way vLLM's worker
    only notifies P: a READ posted for it would be reported as received for a request
    the scheduler no longer has (vLLM 0.26 then fails ``assert req_id in
    self.requests``, killing the decode engine).
    """
    groups = getattr(meta, "local_block_ids", None) or ()
    return any(len(group) > 0 for group in groups)


def start_staged_read(worker: Any, st: WorkerStaging, req_id: str, meta: Any) -> bool:
    """Post the coalesced READ for one request; False means "vLLM's own path".

    When D's staging has no room now but the extent would fit an empty region, the
    request waits (``retry_waiting_reads`` posts it once extents come back) rather than
    falling back: the direct path from kvcached memory runs at ~0.5 GB/s. A request
    without local blocks is vLLM's (it only notifies P; see :func:`has_local_blocks`).
    """
    info = st.recv_info.get(req_id)
    if info is None or meta.remote is None:
        return False
    if not has_local_blocks(meta):
        st.recv_info.pop(req_id, None)
        st.waiting.pop(req_id, None)
        return False
    engine_id = meta.remote.engine_id
    peer = st.remote.get(engine_id)
    reason = None
    if peer is None:
        reason = "the prefill side offered no staging in its handshake"
    else:
        extent, reason = reserve_decode_extent(worker, st, req_id, info, req_id in st.waiting)
        if extent is None and reason is None:
            st.waiting[req_id] = meta
            return True
    st.recv_info.pop(req_id, None)
    st.waiting.pop(req_id, None)
    if reason is not None:
        if not peer_direct_path_safe(worker, engine_id):
            # kvcached's contiguous layout on either side: NIXL has none of that KV, and
            # per-block descriptors would address other layers' bytes. Fail the request
            # through vLLM's own path rather than try a transfer that cannot be right.
            logger.error("kvcached-pd: request %s cannot be staged (%s) and the direct path "
                         "cannot move kvcached's contiguous layout: failing its KV load",
                         req_id, reason)
            worker._handle_failed_transfer(req_id, None)
            return True
        st.stats["fallbacks"] += 1
        record_stat(worker, STAT_FALLBACKS, 1)
        logger.warning("kvcached-pd: request %s travels by the direct path: %s", req_id, reason)
        return False
    nbytes = int(info["nbytes"])
    notif = f"{meta.remote.request_id}:{worker.world_size}".encode()
    try:
        handle, descs = post_extent_transfer(worker, "READ", st, extent.offset, peer,
                                             int(info["offset"]), nbytes, engine_id, notif)
    except Exception as exc:  # noqa: BLE001 - vLLM's own failure path takes over
        st.buffer.free(extent)
        st.decode_usage_changed(worker)
        logger.error("kvcached-pd: staged READ for %s failed to start: %s", req_id, exc)
        worker._handle_failed_transfer(req_id, None)
        return True
    worker._recving_transfers[req_id].append(handle)
    st.pending[req_id] = (extent, info, time.perf_counter())
    trace("read_posted", req_id, remote_req=meta.remote.request_id, bytes=nbytes, descs=descs)
    return True


def post_extent_transfer(worker: Any, op: str, st: WorkerStaging, local_offset: int,
                         peer: dict[str, Any], remote_offset: int, nbytes: int,
                         engine_id: str, notif: bytes) -> tuple[Any, int]:
    """Post one NIXL ``op`` (READ or WRITE) between ``nbytes`` of this side's staging
    and of the peer's, one descriptor per ``CHUNK_BYTES``. Returns the handle and the
    descriptor count; raises if NIXL refuses (no handle is left behind)."""
    local_base = int(st.buffer.tensor.data_ptr()) + local_offset
    remote_base = int(peer["base"]) + remote_offset
    local, remote = [], []
    for start in range(0, nbytes, CHUNK_BYTES):
        length = min(CHUNK_BYTES, nbytes - start)
        local.append((local_base + start, length, worker.device_id))
        remote.append((remote_base + start, length, int(peer["device_id"])))
    wrapper = worker.nixl_wrapper
    handle = wrapper.initialize_xfer(
        op,
        wrapper.get_xfer_descs(local, worker.nixl_memory_type),
        wrapper.get_xfer_descs(remote, worker.nixl_memory_type),
        worker._remote_agents[engine_id][(0, 0)],
        notif,
    )
    try:
        wrapper.transfer(handle)
    except BaseException:
        wrapper.release_xfer_handle(handle)
        raise
    return handle, len(local)


def await_imminent_reads(worker: Any, st: WorkerStaging, budget_s: float) -> float:
    """Wait, at most ``budget_s``, for staged READs predicted to end within it.

    vLLM notices a finished READ only at the next ``get_finished``, one engine step
    later; for a READ that will be done in a fraction of a millisecond that step is
    most of the handoff. Returns the seconds spent (0 when nothing was imminent).
    """
    if budget_s <= 0 or not st.pending:
        return 0.0
    t0 = time.perf_counter()
    handles = []
    for req_id, (_, info, posted) in st.pending.items():
        if info.get("push"):
            continue  # P drives a push; D holds no handle to wait on
        eta = posted + int(info["nbytes"]) / EXPECTED_READ_BYTES_PER_S
        if eta - t0 <= budget_s:
            handles.extend(worker._recving_transfers.get(req_id, ()))
    if not handles:
        return 0.0
    deadline = t0 + budget_s
    wrapper = worker.nixl_wrapper
    while handles and time.perf_counter() < deadline:
        # DONE stays DONE and errors stay errors: vLLM's own poll right after sees them.
        handles = [h for h in handles if wrapper.check_xfer_state(h) == "PROC"]
    spent = time.perf_counter() - t0
    st.stats["spin_s"] += spent
    return spent


def retry_waiting_reads(worker: Any, st: WorkerStaging, read_direct) -> None:
    """Post reads that waited for room; a request whose peer vanished goes direct."""
    st.reap(worker)
    for req_id, meta in list(st.waiting.items()):
        if not start_staged_read(worker, st, req_id, meta):
            read_direct(req_id, meta)
        elif req_id in st.waiting:
            break  # still no room; keep arrival order


def decode_targets(st: WorkerStaging, meta: Any, num_tokens: int) -> tuple[list[int], int, int]:
    """D's kernel block ids to unpack into, the prompt token they start at, and the
    number of prompt tokens (``num_tokens`` clipped to what D's blocks hold).

    D allocated blocks for the whole prompt; the ones it already held from its own
    prefix cache are not in ``local_block_ids`` (vLLM lists only the new ones and READs
    just P's last blocks for them). So D's new blocks start at prompt token
    ``(ceil(num_tokens / bs) - len(new)) * bs``, with ``bs`` D's logical block size.
    """
    if meta is None:
        return [], 0, 0
    logical = list((meta.local_block_ids or [[]])[0])
    physical = list((meta.local_physical_block_ids or [[]])[0])
    kbs = st.kernel_block_size
    logical_bs = kbs * st.ratio
    cached = max(math.ceil(num_tokens / logical_bs) - len(logical), 0)
    first_token = cached * logical_bs
    num_tokens = min(num_tokens, first_token + len(physical) * kbs)
    if first_token >= num_tokens:
        return [], 0, 0
    return physical[: math.ceil((num_tokens - first_token) / kbs)], first_token, num_tokens


def finish_staged_reads(worker: Any, st: WorkerStaging, done_recving: set[str],
                        recving_meta: dict[str, Any], spun_s: float = 0.0) -> None:
    """Scatter completed READs into the request's blocks; free extents once scattered."""
    for req_id in list(done_recving):
        entry = st.pending.pop(req_id, None)
        if entry is None:
            continue
        extent, info, t0 = entry
        if info.get("push") and req_id not in st.push_arrived:
            # P wrote D's blocks by vLLM's own path (it had no packed extent, or its
            # staged WRITE could not start): the offered extent was never written.
            st.buffer.free(extent)
            st.decode_usage_changed(worker)
            logger.info("kvcached-pd: request %s arrived by vLLM's push path, not staged",
                        req_id)
            continue
        st.push_arrived.discard(req_id)
        seen_ms = round(1e3 * (time.perf_counter() - t0), 3)  # READ posted -> done seen
        ids, first_token, num_tokens = decode_targets(st, recving_meta.get(req_id),
                                                      int(info["num_tokens"]))
        start = end = None
        if st.buffer.tensor.is_cuda:
            stream = torch.cuda.current_stream(st.buffer.tensor.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        if ids:
            t1 = time.perf_counter()
            unpack_request(st.layers, ids, st.region(extent.offset, int(info["nbytes"])),
                           st.fmt, num_tokens, int(info["n_tok_slots"]), first_token)
            st.stats["unpack_s"] += time.perf_counter() - t1
        if end is not None:
            end.record(stream)
        trace("read_done", req_id, bytes=int(info["nbytes"]),
              seen_ms=seen_ms, spin_ms=round(1e3 * spun_s, 3))
        st.releasing.append((start, end, extent))
        st.stats["reads"] += 1
        st.stats["read_bytes"] += int(info["nbytes"])
        st.stats["handoff_s"] += time.perf_counter() - t0
        record_stat(worker, STAT_HANDOFF, time.perf_counter() - t0)
        _log_transfer(st, "staged handoff", st.stats["reads"],
                      f"{req_id}: {int(info['nbytes']) >> 20} MiB, READ posted to unpack "
                      f"enqueued in {1e3 * (time.perf_counter() - t0):.2f} ms; totals "
                      f"{st.stats['read_bytes'] / 2**30:.2f} GiB, {int(st.stats['fallbacks'])} "
                      "direct fallbacks")
    st.reap(worker)


def drop_failed(st: WorkerStaging, req_id: str) -> None:
    st.waiting.pop(req_id, None)
    st.recv_info.pop(req_id, None)
    st.push_waiting.pop(req_id, None)
    entry = st.pending.pop(req_id, None)
    if entry is None:
        return
    if entry[1].get("push") and req_id not in st.push_arrived:
        # P may still WRITE into the offered extent (it learnt of it in the registration)
        # until its lease on the request runs out. D offers staging only for a request
        # that carries P's packed extent, so P had finished it (and started its lease)
        # before the offer: the extent is safe ``hold_s`` (the lease plus a margin)
        # after the offer. A request that fails a lease or more after its offer (a
        # client giving up on a push that never came, vLLM's registration watchdog) is
        # free again at once, not two leases after the failure (the host's UCX-fault run
        # saw 306,708,480 bytes still held 35 s after the load, under that older rule).
        left = max(0.0, entry[2] + st.hold_s - time.perf_counter())
        st.quarantine.append((time.monotonic() + left, entry[0]))
    else:
        st.releasing.append((None, None, entry[0]))
    st.push_arrived.discard(req_id)
