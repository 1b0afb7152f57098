"""``KvcachedPDConnector``: the staged transport as a vLLM KV connector.

It implements vLLM's public ``KVConnectorBase_V1`` and composes an inner vLLM NIXL
connector (``NixlConnector``, or ``NixlPushConnector`` in push mode) through the same
interface, the way vLLM's ``MultiConnector`` composes connectors:

* requests whose peer is a kvcached-pd instance of the same wire and packed format
  move through the staged path (:mod:`.prefill`, :mod:`.decode_scheduler`,
  :mod:`.decode_worker`), with this connector's own NIXL agent, staging registration
  and handshake listener;
* everything else (a plain vLLM peer, another format, TP > 1 for now) is the inner
  connector's, unchanged; P's blocks are the inner connector's, so a plain vLLM decode
  instance can read them, and a staged request's are freed at the first of D's DONE,
  the inner connector's notification, or its lease (:mod:`.prefill`).

Each vLLM hook is one call on the prefill or decode side plus the inner connector's
own call; nothing here touches the inner connector's private methods or attributes.
Which vLLM release spells what lives in :mod:`kvcached_pd.vllm_api`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvcached_pd import config, nixl_kv_guard, serving, vllm_api
from kvcached_pd.connector.decode_scheduler import ClaimProbe, DecodeScheduler
from kvcached_pd.connector.decode_worker import DecodeWorker
from kvcached_pd.connector.prefill import PrefillScheduler, PrefillWorker
from kvcached_pd.connector.claim_board import ClaimBoard
from kvcached_pd.connector.records import StepMetadata, WorkerReport
from kvcached_pd.connector.region import StagingRegion
from kvcached_pd.connector.side_channel import (
    CLAIM_PORT_OFFSET,
    HandshakeListener,
    claim_port,
)
from kvcached_pd.connector.stats import merge_samples
from kvcached_pd.connector.wire import format_hash
from kvcached_pd.transport import sizing, trace
from kvcached_pd.transport.format import PackedFormat, format_of_kv_cache_config
from kvcached_pd.transport.pack import graph_fallbacks, select_kernel
from kvcached_pd.transport.staging import ExtentAllocator
from kvcached_pd.versions import installed_version

logger = logging.getLogger("kvcached_pd")


@dataclass
class StagedHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker rank's handshake: the inner connector's, and ours (encoded
    :class:`~kvcached_pd.connector.wire.RankHandshake`, None when not staged)."""

    inner: Any = None
    staged: bytes | None = None


def staged_reason(vllm_config: Any, kv_cache_config: Any,
                  decision: serving.Serving) -> tuple[PackedFormat | None, str]:
    """The packed format when the staged path serves this engine, else the reason:
    the process's decision (:func:`kvcached_pd.serving.decide`), then what only this
    engine's configs say."""
    if not decision.staged:
        return None, decision.reason
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if tp != 1:
        return None, (f"tensor parallel size {tp}: the staged path is validated at TP=1 "
                      "only (its wire and packed format carry per-rank head ranges)")
    if getattr(vllm_config.kv_transfer_config, "kv_buffer_device", "cuda") not in ("cuda", "cpu"):
        return None, "a host-buffered NIXL transfer (kv_buffer_device)"
    if kv_cache_config is None:
        return None, "vLLM gave the connector no KV-cache config"
    return format_of_kv_cache_config(kv_cache_config)


def advise_sync_prefill() -> None:
    """A prefill-only instance (kv_producer) on vLLM's asynchronous scheduling, its
    default: the engine schedules step N+1 while step N runs, so a prompt reaching a busy
    prefill waits for the step already queued behind the running one, and each prefill
    step is a whole batch of prompts (13-46 ms p50 on the load harness's models). With P
    and D on one H200, P started with ``--no-async-scheduling`` took the push loads' time
    to first token to 0.50-1.00x of vLLM's default at p50 (e.g. 146.2 -> 72.8 ms, kvbig
    48 requests 8 at a time), their p90 latencies mostly far lower (0.24-1.04x), end to
    end p50 0.72-1.12x (three runs side by side, two loads each, 2026-11-28;
    experiments/results/2026-11-28d- and 2026-11-28e-h200x2-session). Said, not changed:
    the flag is the operator's, and a decode instance (kv_consumer, kv_both) keeps vLLM's
    default, which hides the host's scheduling between its short decode steps (with the
    flag on D too, two runs: D's first token one step sooner, its decode steps longer,
    end to end p50 0.95-1.03x)."""
    logger.warning(
        "kvcached-pd: this prefill instance (kv_producer) runs vLLM's asynchronous "
        "scheduling, which holds each prompt that reaches a busy engine one prefill step "
        "longer before its KV is handed to the decode instance; start prefill instances "
        "with --no-async-scheduling (measured with P and D on one GPU under load: time to "
        "first token p50 0.50-1.00x, p90 latencies mostly far lower; README, 'Colocated "
        "PD'). Decode instances keep vLLM's default.")


class KvcachedPDConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring.

    ``SupportsHMA`` as vLLM's NixlConnector has it (every release 0.20-0.33): without it
    vLLM turns the hybrid KV-cache manager off, and ``is_hma_enabled`` is part of NIXL's
    compatibility hash, so a plain vLLM peer refused every handshake (seen on the host).
    The staged path itself serves one full-attention group; anything else is the inner
    connector's."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        inner_name = vllm_api.inner_connector_name(vllm_config.kv_transfer_config)
        self._push = vllm_api.is_push(inner_name)
        self._inner = vllm_api.inner_connector_class(inner_name)(vllm_config, role,
                                                                 kv_cache_config)
        self._kv_cache_config = kv_cache_config
        self._settings = config.settings()
        # this is kvcached-pd's connector, whichever name built it
        self._serving = serving.decide(self._settings, installed_version("vllm"),
                                       vllm_api.CONNECTOR_CLASS)
        kv_transfer = vllm_config.kv_transfer_config
        self._engine_id = str(kv_transfer.engine_id)
        self._kv_role = kv_transfer.kv_role
        self._fmt, reason = staged_reason(vllm_config, kv_cache_config, self._serving)
        self._why_not_staged = None if self._fmt is not None else reason
        self._prefill: PrefillScheduler | None = None
        self._decode: DecodeScheduler | None = None
        self._prefill_worker: PrefillWorker | None = None
        self._decode_worker: DecodeWorker | None = None
        self._region: StagingRegion | None = None
        self._graph_fallbacks_seen = 0  # graph_fallbacks already reported in stats
        self._open_step: tuple[float, int, int] | None = None  # the trace's last step
        self._listener: HandshakeListener | None = None
        self._invalid_blocks: set[int] = set()
        self._lease_log_filter: logging.Filter | None = None
        if self._fmt is None:
            level = logging.WARNING if self._settings.active else logging.INFO
            logger.log(level, "kvcached-pd: the staged transport does not serve this engine "
                       "(%s); vLLM's NixlConnector moves all KV", reason)
            return
        self._plan = sizing.plan_for(vllm_config, kv_cache_config, self._fmt,
                                     self._settings.staging_mb)
        if role == KVConnectorRole.SCHEDULER:
            self._make_scheduler_sides(vllm_config, kv_cache_config)

    # ------------------------------------------------------------------ set-up
    def _make_scheduler_sides(self, vllm_config: Any, kv_cache_config: Any) -> None:
        fmt, plan = self._fmt, self._plan
        block_size = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        digest = format_hash(fmt, 0, fmt.num_kv_heads)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        secret = self._settings.side_channel_secret
        if plan.prefill_bytes:
            if self._kv_role == "kv_producer" and vllm_api.async_scheduling(vllm_config):
                advise_sync_prefill()
            self._prefill = PrefillScheduler(
                fmt=fmt, digest=digest, block_size=block_size,
                allocator=ExtentAllocator(plan.prefill_bytes, sizing.ALIGNMENT),
                engine_id=self._engine_id, tp_size=tp,
                lease_s=vllm_api.kv_lease_seconds(vllm_config))
        if plan.decode_bytes:
            self._decode = DecodeScheduler(
                digest=digest, block_size=block_size, capacity_bytes=plan.decode_bytes,
                tp_size=tp, push=self._push, lease_s=vllm_api.kv_lease_seconds(vllm_config),
                fmt=fmt, probe=ClaimProbe(digest, tp, secret=secret) if self._push else None,
                secret=secret)

    # ========================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if self._decode is not None:
            matched = self._decode.match(request, num_computed_tokens)
            if matched is not None:
                return matched
        result = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        params = request.kv_transfer_params
        if (self._prefill is not None and params and params.get("do_remote_decode")
                and not self._prefill.admit(request)):
            return None, False
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if self._decode is not None and self._decode.on_alloc(request, blocks,
                                                              num_external_tokens):
            return
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        if trace.enabled():
            self._trace_step(scheduler_output)
        meta = StepMetadata(inner=self._inner.build_connector_meta(scheduler_output))
        if self._prefill is not None:
            meta.packs = self._prefill.on_step(scheduler_output, vllm_api.yield_req_data)
            self._prefill.expire()
            meta.wipes = self._prefill.take_wipes()
        if self._decode is not None:
            meta.recvs, meta.cancelled = self._decode.take_orders()
            self._decode.on_step(scheduler_output)
        return meta

    def _trace_step(self, scheduler_output: Any) -> None:
        """A ``step`` trace line for the last step that computed tokens, now that the
        scheduler has come round again: from its scheduling to this one's, the engine
        step's period (its forward and sampling; under vLLM's asynchronous scheduling
        the pipelined period; after an idle spell, the idle time too)."""
        now = time.time()
        if self._open_step is not None:
            start, tokens, reqs = self._open_step
            trace.trace("step", "", start=round(start, 6), until_next_ms=round(
                1e3 * (now - start), 3), tokens=tokens, reqs=reqs)
        tokens = scheduler_output.total_num_scheduled_tokens
        self._open_step = ((now, tokens, len(scheduler_output.num_scheduled_tokens))
                           if tokens else None)

    def update_connector_output(self, connector_output: Any) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, WorkerReport):
            connector_output = dataclasses.replace(connector_output,
                                                   kv_connector_worker_meta=report.inner)
        if self._prefill is not None:
            self._prefill.on_output(report.done if isinstance(report, WorkerReport) else (),
                                    connector_output.finished_sending)
        if self._decode is not None:
            staged = report if isinstance(report, WorkerReport) else WorkerReport()
            self._decode.on_wires(staged.ipc_peers)
            for request, blocks in self._decode.on_finished_recving(
                    connector_output.finished_recving, staged.unread, staged.read):
                # No block left to read: the inner connector only tells P we are done.
                self._inner.update_state_after_alloc(request, blocks, 0)
        self._inner.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any):
        return self._finished(request, self._inner.request_finished, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        return self._finished(request, self._inner.request_finished_all_groups, block_ids)

    def _finished(self, request: Any, inner_finished, block_ids: Any):
        if self._decode is not None:
            self._decode.on_request_finished(request)
        delay_free, params = inner_finished(request, block_ids)
        if self._prefill is not None:
            self._prefill.on_finished(request, delay_free, params)
        return delay_free, params

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        inner = {rank: getattr(m, "inner", m) for rank, m in metadata.items()}
        self._inner.set_xfer_handshake_metadata(inner)
        self._listen({rank: getattr(m, "staged", None) for rank, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
        inner = {key: getattr(m, "inner", m) for key, m in metadata.items()}
        if hasattr(self._inner, "set_xfer_handshake_metadata_pp_aware"):
            self._inner.set_xfer_handshake_metadata_pp_aware(inner)
        else:
            self._inner.set_xfer_handshake_metadata({tp: m for (_, tp), m in inner.items()})
        self._listen({tp: getattr(m, "staged", None) for (_, tp), m in metadata.items()})

    def _listen(self, staged: dict[int, bytes | None]) -> None:
        staged = {rank: data for rank, data in staged.items() if data}
        if self._prefill is None or not staged or self._listener is not None:
            return
        host = vllm_api.side_channel_host()
        board = None
        secret = self._settings.side_channel_secret
        port = self._settings.side_channel_port or 0
        if self._push:
            # a decode leg sent before P answered claims its params here (side_channel)
            board = ClaimBoard(self._engine_id, keep_s=self._prefill.lease_s,
                               readers=self._prefill.tp_size)
            derived = claim_port(vllm_api.side_channel_port(self._vllm_config))
            if not port:
                port = derived
            elif port != derived:
                logger.warning(
                    "kvcached-pd: %s=%d: a push-mode decode leg sent before this prefill "
                    "answered looks for the staged listener at vLLM's NIXL side-channel port "
                    "+ %d (%d), so it takes vLLM's per-block push; leave %s unset to serve it",
                    config.KVCACHED_PD_SIDE_CHANNEL_PORT, port, CLAIM_PORT_OFFSET, derived,
                    config.KVCACHED_PD_SIDE_CHANNEL_PORT)
        try:
            self._listener = HandshakeListener(host, port, staged, board, secret=secret)
        except Exception as exc:  # noqa: BLE001 - zmq.ZMQError: the port is taken
            if self._settings.side_channel_port:
                raise
            logger.warning(
                "kvcached-pd: port %d (vLLM's NIXL side-channel port + %d) is taken (%s); "
                "the staged handshake listener takes any free port, so a push-mode decode "
                "leg sent before this prefill answered cannot find it and takes vLLM's "
                "per-block push (give this instance another VLLM_NIXL_SIDE_CHANNEL_PORT)",
                port, CLAIM_PORT_OFFSET, exc)
            self._listener = HandshakeListener(host, 0, staged, board, secret=secret)
        self._prefill.host, self._prefill.port = host, self._listener.port
        self._prefill.board = board
        logger.info("kvcached-pd: staged handshake listener on %s:%d for %d rank(s)%s", host,
                    self._listener.port, len(staged),
                    " (answers claims of decode legs sent before P answered)" if board else "")

    def get_kv_connector_stats(self):
        stats = self._inner.get_kv_connector_stats()
        samples = []
        for side in (self._prefill, self._decode, self._prefill_worker, self._decode_worker):
            if side is not None:
                samples.append(side.take_samples())
        if self._region is not None:  # one count per worker, whichever side packed
            total = graph_fallbacks(self._region.layers)
            if total > self._graph_fallbacks_seen:
                samples.append({"graph_fallbacks": [total - self._graph_fallbacks_seen]})
                self._graph_fallbacks_seen = total
        return merge_samples(stats, samples, type(self._inner))

    # ============================================================= worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        # the registration patch accepts kvcached's contiguous layout only when it is
        # told, here, that the staged path moves this engine's KV
        with nixl_kv_guard.registering_for_the_connector(self._why_not_staged):
            self._inner.register_kv_caches(kv_caches)
        if self._fmt is None:
            return
        plan = self._plan
        tp_rank = vllm_api.tp_rank()
        self._region = StagingRegion.create(
            kv_caches, self._kv_cache_config, self._fmt, plan, tp_rank, 1,
            offer_ipc=bool(plan.prefill_bytes) and self._serving.wire != "nixl",
            eager_decode=self._serving.wire == "nixl")
        kernels = select_kernel(self._region.layers, self._fmt, self._settings.pack_kernel)
        if plan.prefill_bytes:
            self._prefill_worker = PrefillWorker(
                self._region, sync_pack=getattr(self._vllm_config, "speculative_config",
                                                None) is not None,
                horizon_s=2 * vllm_api.kv_lease_seconds(self._vllm_config) + 60)
            self._lease_log_filter = _LeaseExpiryFilter(self._prefill_worker)
            logging.getLogger(vllm_api.current().lease_expiry_logger).addFilter(
                self._lease_log_filter)
        if plan.decode_bytes:
            self._decode_worker = DecodeWorker(self._region,
                                               spin_s=self._settings.read_spin_us / 1e6,
                                               wire_policy=self._serving.wire,
                                               secret=self._settings.side_channel_secret)
        region = self._region
        logger.info(
            "kvcached-pd: staged transport ready (%s mode, inner %s): %d MiB staging (%s; "
            "prefill %d MiB, decode %d MiB%s, %s) registered with its own NIXL agent, packed "
            "format %s, %d layers x "
            "%d-token kernel blocks, pack/unpack kernels: %s; wire %s (%s)",
            "push" if self._push else "pull",
            type(self._inner).__name__, plan.total_bytes >> 20,
            region.agent.memory_type, plan.prefill_bytes >> 20, plan.decode_bytes >> 20,
            "" if region.decode.allocated or not plan.decode_bytes else
            " allocated at the first READ over NIXL, never on the CUDA IPC wire",
            plan.rule, self._fmt.to_dict(), region.layers.num_layers, region.kernel_block_size,
            kernels, self._serving.wire, _wire_summary(self._serving.wire, region))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._inner.bind_connector_metadata(getattr(connector_metadata, "inner",
                                                    connector_metadata))

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._inner.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._inner.handle_preemptions(getattr(kv_connector_metadata, "inner",
                                               kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._inner.start_load_kv(forward_context, **kwargs)
        if self._prefill_worker is not None and self.has_connector_metadata():
            # every step, with a forward or without (vLLM skips wait_for_save then)
            self._prefill_worker.wipe(self._get_connector_metadata().wipes)
        if self._decode_worker is not None:
            meta = self._get_connector_metadata()
            self._decode_worker.start(meta.recvs, meta.cancelled)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._inner.wait_for_save()
        if self._prefill_worker is not None and self.has_connector_metadata():
            self._prefill_worker.pack(self._get_connector_metadata().packs)

    def get_finished(self, finished_req_ids: set[str]):
        sending, recving = self._inner.get_finished(finished_req_ids)
        if self._prefill_worker is not None:
            sending = self._prefill_worker.finished_sending(sending)
        done, _ = self._poll_staged_loads()
        if done:
            recving = set(recving or ()) | done
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]):
        """vLLM 0.30+ asks for this instead of ``get_finished``: the inner connector's
        results (its failed receives included) plus the staged loads that finished."""
        results = self._inner.get_transfer_results(finished_req_ids)
        if self._prefill_worker is not None:
            results.finished_sending = self._prefill_worker.finished_sending(
                results.finished_sending)
        done, failed = self._poll_staged_loads()
        results.finished_recving |= done
        results.failed_recving |= failed
        return results

    def _poll_staged_loads(self) -> tuple[set[str], set[str]]:
        """Staged loads that finished since the last poll, and those of them that failed
        (their blocks are reported by ``get_block_ids_with_load_errors``)."""
        if self._decode_worker is None:
            return set(), set()
        done, failed, invalid = self._decode_worker.poll()
        self._invalid_blocks |= invalid
        return done, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return set(self._inner.get_block_ids_with_load_errors()) | invalid

    def build_connector_worker_meta(self):
        inner = self._inner.build_connector_worker_meta()
        done = self._prefill_worker.done() if self._prefill_worker is not None else set()
        unread, read, wires = ((*self._decode_worker.take_unread(),
                                self._decode_worker.take_ipc_news())
                               if self._decode_worker is not None else (set(), set(), {}))
        if inner is None and not done and not unread and not read and not wires:
            return None
        return WorkerReport(inner=inner, done=done, unread=unread, read=read,
                            ipc_peers=wires)

    def get_handshake_metadata(self):
        inner = self._inner.get_handshake_metadata()
        if self._region is None:
            return inner
        return StagedHandshakeMetadata(inner=inner,
                                       staged=self._region.handshake(self._engine_id).encode())

    def shutdown(self) -> None:
        try:
            self._inner.shutdown()
        finally:
            if self._lease_log_filter is not None:
                logging.getLogger(vllm_api.current().lease_expiry_logger).removeFilter(
                    self._lease_log_filter)
            if self._listener is not None:
                self._listener.close()
            if self._prefill is not None and self._prefill.board is not None:
                self._prefill.board.close()
            if self._decode is not None:
                self._decode.close()
            if self._decode_worker is not None:
                self._decode_worker.close()
            if self._region is not None:
                self._region.agent.close()


def _wire_summary(policy: str, region: StagingRegion) -> str:
    """What KVCACHED_PD_WIRE means for this worker, for its start-up line."""
    offer = ("offers its staging to same-host decode instances over CUDA IPC"
             if region.ipc_export is not None else
             f"offers no CUDA IPC: {region.ipc_reason}" if region.ipc_reason else "")
    take = {"auto": "takes CUDA IPC from each same-host prefill it can open, NIXL otherwise",
            "nixl": "takes every extent by NIXL READ", "ipc": "takes CUDA IPC only"}[policy]
    parts = [part for part in (offer if region.plan.prefill_bytes else "",
                               take if region.plan.decode_bytes else "") if part]
    return "; ".join(parts) or "no staged role"


class _LeaseExpiryFilter(logging.Filter):
    """Drops the inner connector's lease-expiry WARNING for requests whose blocks the
    staged path already released on D's DONE (``PrefillWorker``); vLLM's own requests
    keep it. It holds the worker weakly: a filter left on the (process-wide) logger
    must not keep a connector, its staging and its NIXL agent alive (an agent's UCX
    progress thread polls as long as it lives)."""

    def __init__(self, worker: PrefillWorker) -> None:
        super().__init__()
        self.worker = weakref.ref(worker)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(vllm_api.LEASE_EXPIRY_MESSAGE):
            return True
        worker = self.worker()
        args = record.args if isinstance(record.args, tuple) else ()
        return not (worker is not None and args and worker.reported_early(str(args[0])))


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"The inner NixlConnector's ``{name}``."
    return method


def _inner_class_asked(args: tuple) -> type:
    """The inner connector class a class-level question is about: the one the config it
    is asked with names (a KVTransferConfig, or a VllmConfig holding one), else
    vLLM's NixlConnector."""
    config = args[0] if args else None
    transfer = config if hasattr(config, "kv_connector") else \
        getattr(config, "kv_transfer_config", None)
    if transfer is None:
        return vllm_api.inner_connector_class()
    return vllm_api.inner_connector_class(vllm_api.inner_connector_name(transfer))


def _forward_class(name: str):
    def method(cls, *args, **kwargs):
        # class-level questions go to the inner connector's class: most have one answer
        # for vLLM's pull and push connectors (one base), not all (0.33's
        # supports_sleep_mode: pull yes, push no)
        return getattr(_inner_class_asked(args), name)(*args, **kwargs)

    method.__name__ = name
    return classmethod(method)


def _forward_property(name: str):
    return property(lambda self: getattr(self._inner, name))


def _install_forwarders() -> None:
    """Every other public method of this vLLM's ``KVConnectorBase_V1`` goes to the inner
    connector as it is, so the wrapper follows the interface of each release."""
    for name, value in vars(KVConnectorBase_V1).items():
        if name.startswith("_") or name in vars(KvcachedPDConnector) or name == "role":
            continue
        if isinstance(value, classmethod):
            setattr(KvcachedPDConnector, name, _forward_class(name))
        elif isinstance(value, property):
            setattr(KvcachedPDConnector, name, _forward_property(name))
        elif callable(value) and not isinstance(value, staticmethod):
            setattr(KvcachedPDConnector, name, _forward(name))


_install_forwarders()
