"""Staged, coalesced KV transport for vLLM's NixlConnector, pull and push modes.

Installs the hooks described in :mod:`kvcached_pd.transport.staged` (pull) and
:mod:`kvcached_pd.transport.staged_push` (push) on the classes that define them
(vLLM 0.24-0.28 code layout: ``NixlBaseConnector``, ``NixlBaseConnectorScheduler`` /
``NixlPullConnectorScheduler`` / ``NixlPushConnectorScheduler``,
``NixlBaseConnectorWorker`` / ``NixlPullConnectorWorker`` / ``NixlPushConnectorWorker``),
plus the name ``NixlAgentMetadata`` in the worker module so handshakes carry the
staging address. The patch applies only with ``KVCACHED_PD_TRANSPORT=staged``; every
hook calls vLLM's method unchanged where staging does not serve (TP>1, several KV
groups, host buffer), so direct mode is vanilla.

Fail-closed: a staged path that is half installed could leave P packing into memory
that D never reads (or the reverse), so a failure to apply stops startup.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Any

from kvcached_pd import config, vllm_nixl
from kvcached_pd.patches.base import Patch, defining_class, wrap_hook
from kvcached_pd.versions import VersionRange

logger = logging.getLogger("kvcached_pd")

STATE = "_kvcached_pd_staging"

# True when the connector routing serves pull mode (kvcached_pd.connector): these hooks
# then stage push mode only. They sit partly on classes that pull and push share, so
# each one that creates staging state checks this and leaves a pull instance (the inner
# NixlConnector of kvcached-pd's connector) to vLLM's code.
_PUSH_ONLY = False
# Push D: a failed request's offered extent stays unused for P's KV lease plus this margin
# after the offer (a WRITE P posted just before its lease ended has landed by then).
PUSH_HOLD_MARGIN_S = 5.0


def _is_push(obj: Any) -> bool:
    return "Push" in type(obj).__name__


def _settings():
    """The process's settings, parsed once (kvcached_pd.config.settings)."""
    return config.settings()


def _enabled() -> bool:
    return _settings().transport == "staged"


def _make_staged_metadata_class(base: type) -> type:
    """NixlAgentMetadata plus an optional field; vanilla decoders ignore unknown keys."""
    from kvcached_pd.transport.staged import HANDSHAKE_FIELD

    cls = dataclasses.make_dataclass(
        "NixlAgentMetadata",
        [(HANDSHAKE_FIELD, dict | None, dataclasses.field(default=None))],
        bases=(base,),
    )
    cls.__module__ = __name__
    cls.__doc__ = f"{base.__doc__ or ''}\n(kvcached-pd: + optional {HANDSHAKE_FIELD})"
    return cls


class StagedTransportPatch(Patch):
    name = "staged_transport"
    summary = ("KVCACHED_PD_TRANSPORT=staged: P packs into ordinary staging; D pulls it, or P "
               "pushes it into D's staging, with a few descriptors")
    target_module = vllm_nixl.NIXL_PACKAGE
    vllm_range = VersionRange("0.24", "0.29")
    fail_closed = True

    def applies(self, vllm_version: str | None = None) -> tuple[bool, str]:
        from kvcached_pd.patches.connector_routing import routing_applies

        if not _enabled():
            return False, f"{config.KVCACHED_PD_TRANSPORT} is not 'staged'"
        if routing_applies(self.settings)[0]:
            return False, "kvcached-pd's connector serves pull and push (connector_routing)"
        return super().applies(vllm_version)

    def _apply(self) -> None:
        global _PUSH_ONLY
        from kvcached_pd.patches.connector_routing import routing_applies

        _PUSH_ONLY = routing_applies(self.settings)[0]
        package = vllm_nixl.nixl_package()
        base_worker_mod = importlib.import_module(f"{vllm_nixl.NIXL_PACKAGE}.base_worker")
        base_sched_mod = importlib.import_module(f"{vllm_nixl.NIXL_PACKAGE}.base_scheduler")
        pull_worker_cls = package.NixlPullConnectorWorker
        pull_sched_cls = package.NixlPullConnectorScheduler
        push_worker_cls = getattr(package, "NixlPushConnectorWorker", None)
        push_sched_cls = getattr(package, "NixlPushConnectorScheduler", None)
        connector_cls = package.NixlBaseConnector

        original_meta_cls = base_worker_mod.NixlAgentMetadata
        staged_meta_cls = _make_staged_metadata_class(original_meta_cls)
        self._replace(base_worker_mod, "NixlAgentMetadata", staged_meta_cls)

        hooks = {
            (pull_sched_cls, "get_num_new_matched_tokens"): _sched_get_num_new_matched_tokens,
            (pull_sched_cls, "update_state_after_alloc"): _sched_update_state_after_alloc,
            (pull_sched_cls, "build_connector_meta"): functools.partial(
                _sched_build_connector_meta, base_sched_mod.yield_req_data),
            (pull_sched_cls, "request_finished"): _sched_request_finished,
            (pull_sched_cls, "update_connector_output"): _sched_update_connector_output,
            (pull_worker_cls, "register_kv_caches"): functools.partial(
                _worker_register_kv_caches, staged_meta_cls, original_meta_cls),
            (pull_worker_cls, "add_remote_agent"): _worker_add_remote_agent,
            (pull_worker_cls, "start_load_kv"): _worker_start_load_kv,
            (pull_worker_cls, "_read_blocks_for_req"): _worker_read_blocks_for_req,
            (pull_worker_cls, "get_finished"): _worker_get_finished,
            (pull_worker_cls, "_handle_failed_transfer"): _worker_handle_failed_transfer,
            (connector_cls, "wait_for_save"): _connector_wait_for_save,
            (connector_cls, "get_kv_connector_stats"): _connector_get_kv_connector_stats,
        }
        if push_worker_cls is not None and push_sched_cls is not None:
            hooks.update({
                (push_sched_cls, "get_num_new_matched_tokens"): _sched_get_num_new_matched_tokens,
                (push_sched_cls, "update_state_after_alloc"): _sched_update_state_after_alloc,
                (push_sched_cls, "request_finished"): _sched_request_finished,
                (push_worker_cls, "start_load_kv"): _push_worker_start_load_kv,
                (push_worker_cls, "get_finished"): _push_worker_get_finished,
                (push_worker_cls, "_do_start_push_kv"): _push_worker_do_start_push_kv,
                (push_worker_cls, "_xfer_blocks_for_req"): _push_worker_xfer_blocks_for_req,
            })
        for (cls, attr), hook in hooks.items():
            owner = defining_class(cls, attr)
            original = vars(owner)[attr]
            self._replace(owner, attr, wrap_hook(hook, original))

    def _undo(self) -> None:
        global _PUSH_ONLY
        super()._undo()
        _PUSH_ONLY = False


# ------------------------------------------------------------------------- scheduler
def _sched_state(sched: Any):
    """The scheduler's staging state; None for unsupported models."""
    from kvcached_pd.transport.staged import SchedulerStaging

    state = vars(sched).get(STATE, False)
    if state is False and _PUSH_ONLY and not _is_push(sched):
        state = None  # pull mode is kvcached-pd's connector's
        setattr(sched, STATE, state)
    if state is False:
        state = SchedulerStaging.create(sched, _settings().staging_mb)  # may raise: too small
        if state is None:
            logger.warning("kvcached-pd: staged transport does not serve this model "
                           "(needs TP=1 and one full-attention KV group); direct path")
        setattr(sched, STATE, state)
    return state


def scheduler_staging(sched: Any):
    """The staging bookkeeping of a NIXL connector scheduler (None if not staged)."""
    return _sched_state(sched)


def worker_staging(worker: Any):
    """The staging state of a NIXL connector worker (None if not staged)."""
    return _worker_state(worker)


def _sched_get_num_new_matched_tokens(original, self, request, num_computed_tokens):
    """P: a remote-decode prefill is scheduled only once its staging extent is reserved;
    ``None`` tells vLLM's scheduler to skip it this step and try again (backpressure)."""
    result = original(self, request, num_computed_tokens)
    params = request.kv_transfer_params or {}
    if not params.get("do_remote_decode") or params.get("remote_block_ids"):
        return result  # not a prefill for a remote decode (or a turn-2 readback)
    state = _sched_state(self)
    if state is not None and not state.admit(request):
        return None, False
    return result


def _sched_update_state_after_alloc(original, self, request, blocks, num_external_tokens):
    from kvcached_pd.transport.trace import ms_since, trace

    params = request.kv_transfer_params or {}
    if params.get("do_remote_prefill") and num_external_tokens:
        trace("d_alloc", request.request_id, remote_req=params.get("remote_request_id"),
              tokens=int(num_external_tokens),
              since_arrival_ms=ms_since(getattr(request, "arrival_time", None)))
    result = original(self, request, blocks, num_external_tokens)
    state = _sched_state(self)
    if state is not None and params.get("do_remote_decode"):
        state.track(request)
    return result


def _sched_build_connector_meta(yield_req_data, original, self, scheduler_output):
    from kvcached_pd.transport.staged import PARAMS_KEY

    # Only requests D holds blocks for: one queued with none (aborted before D scheduled
    # it, or a full prefix hit) is vLLM's to finish, by notifying P (has_local_blocks).
    recv = {rid: (req.kv_transfer_params or {}).get(PARAMS_KEY)
            for rid, (req, block_ids) in getattr(self, "_reqs_need_recv", {}).items()
            if any(len(group) > 0 for group in (block_ids or ()))}
    meta = original(self, scheduler_output)
    state = _sched_state(self)
    meta.kvcached_pd_recv = {rid: info for rid, info in recv.items() if info}
    if state is not None:
        state.on_step(scheduler_output, meta, yield_req_data)
    else:
        meta.kvcached_pd_pack = {}
    return meta


def _sched_request_finished(original, self, request, block_ids):
    delay_free, params = original(self, request, block_ids)
    state = _sched_state(self)
    if state is not None:
        state.on_finished(request, delay_free, params)
    return delay_free, params


def _sched_update_connector_output(original, self, connector_output):
    from kvcached_pd.transport.trace import trace

    result = original(self, connector_output)
    for req_id in getattr(connector_output, "finished_recving", None) or ():
        trace("d_recv_reported", req_id)
    state = _sched_state(self)
    if state is not None:
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            state.release(req_id)
    return result


# ---------------------------------------------------------------------------- worker
def _worker_state(worker: Any):
    return vars(worker).get(STATE)


def _worker_register_kv_caches(staged_meta_cls, original_meta_cls, original, self, kv_caches):
    from kvcached_pd.transport.pack import select_kernel
    from kvcached_pd.transport.sizing import plan_for
    from kvcached_pd.transport.staged import (
        ALIGNMENT,
        HANDSHAKE_FIELD,
        WorkerStaging,
        build_layer_views,
        packed_format_for,
    )
    from kvcached_pd.transport.staging import StagingBuffer

    push = _is_push(self)  # the hook sits on the shared base class
    if _PUSH_ONLY and not push:
        return original(self, kv_caches)  # pull mode is kvcached-pd's connector's
    if push and not all(hasattr(self, a) for a in _PUSH_WORKER_ATTRS):
        logger.warning("kvcached-pd: this vLLM's push worker lacks %s; push mode keeps "
                       "vLLM's data path", ", ".join(_PUSH_WORKER_ATTRS))
        return original(self, kv_caches)
    fmt = packed_format_for(self.kv_cache_config, self.world_size)
    if fmt is None or self.use_host_buffer:
        logger.warning("kvcached-pd: staged transport does not serve this worker "
                       "(TP=%d, host buffer=%s); direct path", self.world_size, self.use_host_buffer)
        return original(self, kv_caches)
    first = next(iter(kv_caches.values()))
    settings = _settings()
    plan = plan_for(self.vllm_config, self.kv_cache_config, fmt, settings.staging_mb)
    buffer = StagingBuffer(plan.total_bytes, first.device, alignment=ALIGNMENT,
                           alloc_start=plan.decode_start, alloc_bytes=plan.decode_bytes)
    device_id = max(first.get_device(), 0)
    descs = self.nixl_wrapper.get_reg_descs(
        [(int(buffer.tensor.data_ptr()), int(buffer.tensor.numel()), device_id, "")],
        self.nixl_memory_type,
    )
    self.nixl_wrapper.register_memory(descs, backends=self.nixl_backends)
    self._registered_descs.append(descs)
    result = original(self, kv_caches)
    state = WorkerStaging(fmt=fmt, buffer=buffer, read_spin_s=settings.read_spin_us / 1e6,
                          push=push, hold_s=_kv_lease_seconds(self) + PUSH_HOLD_MARGIN_S,
                          sync_pack=getattr(self.vllm_config, "speculative_config", None)
                          is not None)
    state.layers, state.kernel_block_size = build_layer_views(self, self.device_kv_caches)
    kernels = select_kernel(state.layers, fmt, settings.pack_kernel)
    state.ratio = int(getattr(self, "_physical_blocks_per_logical_kv_block", 1) or 1)
    if push:
        from kvcached_pd.transport.staged_push import install_notif_queue

        install_notif_queue(self, state)  # before vLLM's push writer thread starts
    setattr(self, STATE, state)
    _republish_handshake(self, state, staged_meta_cls, HANDSHAKE_FIELD, device_id)
    if push:
        mode = "push: P WRITEs the packed extent into D's staging"
    else:
        mode = (f"pull: D READs the packed extent, and waits up to {settings.read_spin_us} us "
                f"for a READ about to end ({config.KVCACHED_PD_READ_SPIN_US})")
    logger.info(
        "kvcached-pd: staged transport ready (%s): %d MiB staging registered with NIXL "
        "(%s; prefill %d MiB, decode %d MiB, %s), packed format %s, %d layers x %d-token "
        "kernel blocks, pack/unpack kernels: %s",
        mode, buffer.tensor.numel() >> 20, self.nixl_memory_type, plan.prefill_bytes >> 20,
        plan.decode_bytes >> 20, plan.rule, fmt.to_dict(), state.layers.num_layers,
        state.kernel_block_size, kernels,
    )
    return result


# What the push hooks use of vLLM's push worker (instance attributes, vLLM 0.26-0.28).
_PUSH_WORKER_ATTRS = ("_pending_completion_notifs", "_reg_send_inbox", "_push_writer_wake",
                      "_sending_transfers", "_sending_transfers_lock")


def _kv_lease_seconds(worker) -> float:
    """vLLM's KV lease (``kv_lease_duration`` in the connector's extra config)."""
    try:
        cfg = worker.vllm_config.kv_transfer_config
        return float(cfg.get_from_extra_config("kv_lease_duration", 30))
    except (AttributeError, TypeError, ValueError):
        return 30.0


def _republish_handshake(worker, state, staged_meta_cls, field_name, device_id) -> None:
    import msgspec

    payload = worker.xfer_handshake_metadata
    meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=staged_meta_cls)
    setattr(meta, field_name, state.handshake_fields(device_id))
    worker.xfer_handshake_metadata = type(payload)(
        compatibility_hash=payload.compatibility_hash,
        agent_metadata_bytes=msgspec.msgpack.Encoder().encode(meta),
    )


def _worker_add_remote_agent(original, self, nixl_agent_meta, *args, **kwargs):
    from kvcached_pd.transport.staged import HANDSHAKE_FIELD

    result = original(self, nixl_agent_meta, *args, **kwargs)
    state = _worker_state(self)
    staged = getattr(nixl_agent_meta, HANDSHAKE_FIELD, None)
    if state is not None and staged:
        state.remote[nixl_agent_meta.engine_id] = dict(staged)
    return result


def _worker_start_load_kv(original, self, metadata):
    state = _worker_state(self)
    if state is not None:
        state.recv_info.update(getattr(metadata, "kvcached_pd_recv", {}) or {})
    return original(self, metadata)


def _worker_read_blocks_for_req(original, self, req_id, meta):
    from kvcached_pd.transport.staged import start_staged_read

    state = _worker_state(self)
    if state is not None and start_staged_read(self, state, req_id, meta):
        return None
    return original(self, req_id, meta)


def _worker_get_finished(original, self, *args, **kwargs):
    from kvcached_pd.transport.staged import (
        await_imminent_reads,
        finish_staged_reads,
        retry_waiting_reads,
    )

    state = _worker_state(self)
    if state is None:
        return original(self, *args, **kwargs)
    if state.push_waiting:
        from kvcached_pd.transport.staged_push import send_waiting_registrations

        send_waiting_registrations(self, state)
    if state.waiting:
        retry_waiting_reads(self, state, lambda req_id, meta: _direct_read(self, req_id, meta))
    spun = await_imminent_reads(self, state, state.read_spin_s)
    recving_meta = dict(self._recving_metadata)
    done_sending, done_recving = original(self, *args, **kwargs)
    finish_staged_reads(self, state, set(done_recving or ()), recving_meta, spun)
    return done_sending, done_recving


def _push_worker_start_load_kv(original, self, metadata):
    from kvcached_pd.transport.staged_push import offer_for_registrations

    state = _worker_state(self)
    if state is not None:
        for req_id in getattr(metadata, "reqs_not_processed", None) or ():
            state.packed.pop(req_id, None)  # aborted on P: its extent is freed, never WRITE it
            state.push_offers.pop(req_id, None)
        for req_id, info in (getattr(metadata, "kvcached_pd_recv", {}) or {}).items():
            recv = metadata.reqs_to_recv.get(req_id)
            remote = getattr(recv, "remote", None)
            state.recv_info[req_id] = {**info, "remote_req": getattr(remote, "request_id", None)}
        registrations = getattr(metadata, "push_registrations", None)
        if registrations:
            offer_for_registrations(self, state, registrations)
    return original(self, metadata)


def _push_worker_get_finished(original, self, *args, **kwargs):
    from kvcached_pd.transport.staged_push import forget_finished

    done_sending, done_recving = original(self, *args, **kwargs)
    state = _worker_state(self)
    if state is not None:
        forget_finished(state, done_sending)
    return done_sending, done_recving


def _push_worker_do_start_push_kv(original, self, request_id, local_block_ids,
                                  registration_data, *args, **kwargs):
    from kvcached_pd.transport.staged_push import OFFER_FIELD

    state = _worker_state(self)
    offer = registration_data.get(OFFER_FIELD) if isinstance(registration_data, dict) else None
    if state is not None and offer:
        state.push_offers[request_id] = dict(offer)
    return original(self, request_id, local_block_ids, registration_data, *args, **kwargs)


def _push_worker_xfer_blocks_for_req(original, self, req_id, meta):
    from kvcached_pd.transport.staged_push import start_staged_write

    state = _worker_state(self)
    if state is not None and start_staged_write(self, state, req_id, meta):
        return None
    return original(self, req_id, meta)


def _direct_read(worker, req_id, meta):
    """vLLM's own per-block read, bypassing the staged hook."""
    owner = defining_class(type(worker), "_read_blocks_for_req")
    return vars(owner)["_read_blocks_for_req"].__wrapped__(worker, req_id, meta)


def _worker_handle_failed_transfer(original, self, req_id, handle):
    from kvcached_pd.transport.staged import drop_failed

    state = _worker_state(self)
    if state is not None:
        drop_failed(state, req_id)
    return original(self, req_id, handle)


def _connector_wait_for_save(original, self):
    from kvcached_pd.transport.staged import pack_for_requests

    result = original(self)
    worker = getattr(self, "connector_worker", None)
    state = _worker_state(worker) if worker is not None else None
    if state is not None:
        packs = getattr(self._connector_metadata, "kvcached_pd_pack", None) or {}
        pack_for_requests(worker, state, packs)
    return result


def _connector_get_kv_connector_stats(original, self):
    """The scheduler's own samples (P's staging gauge, its fallbacks and waits) ride in
    vLLM's KV-connector stats like the workers' (vLLM's scheduler merges them)."""
    result = original(self)
    sched = getattr(self, "connector_scheduler", None)
    state = vars(sched).get(STATE) if sched is not None else None
    if not state:
        return result
    samples = state.take_samples()
    if not samples:
        return result
    stats = result if result is not None else self.build_kv_connector_stats()
    for key, values in samples.items():
        stats.data.setdefault(key, []).extend(values)
    return stats
