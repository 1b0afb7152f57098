"""One worker's staging region: the device buffer, its NIXL agent, the cache views.

Built once in ``register_kv_caches`` and shared by the prefill and decode sides of a
worker (a ``kv_both`` instance has both). The buffer is ordinary device memory, not
kvcached's virtual memory: NIXL/UCX moves kvcached-mapped memory at ~0.5 GB/s but
ordinary device memory at the link's speed (243 GB/s measured at 1 GiB on NVLink), so
kvcached memory is never the remote side of a transfer.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kvcached_pd.connector.wire import RankHandshake, WIRE_VERSION, WireError, format_hash
from kvcached_pd.transport import cuda_ipc
from kvcached_pd.transport.format import PackedFormat
from kvcached_pd.transport.layout import AttnCacheSpec, KVCacheLayers, logical_kv_view
from kvcached_pd.transport.sizing import ALIGNMENT, StagingPlan
from kvcached_pd.transport.staging import Extent, ExtentAllocator, StagingBuffer, StagingError

logger = logging.getLogger("kvcached_pd")

CHUNK_BYTES = 64 << 20  # one NIXL descriptor per 64 MiB of extent


class StagingAgent:
    """This worker's own NIXL agent (not vLLM's): it registers only staging memory (the
    prefill range at once, D's range when it is allocated: :class:`DecodeStaging`),
    loads P peers from their handshakes, posts READs and reads notifications."""

    def __init__(self, tensor: torch.Tensor, backends: tuple[str, ...] = ("UCX",)) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"kvcached-pd-{uuid.uuid4()}"
        # Telemetry as vLLM's own agent has it: each READ's time on the wire is a metric.
        # NIXL's progress thread as NIXL's Python API builds it: polling without pause, one
        # CPU at 100% for the process's life. A thread that sleeps up to 1 ms on UCX's
        # events instead (NIXL's pthrDelay) idles at 0.01 CPUs, but a READ of P's staging on
        # one GPU whose P makes no NIXL call took 1.27x as long (256 MiB: 566 against 448 ms,
        # medians; one H200, two processes, experiments/bench_nixl_progress.py, 2026-11-28):
        # P's side of UCX's pipeline then moves only when the thread wakes. Kept as NIXL
        # builds it until a lease measures what the waiting thread does to the loads.
        self.backends = list(backends)
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=self.backends,
                                                             capture_telemetry=True))
        self.memory_type = "VRAM" if tensor.is_cuda else "DRAM"
        self.device_id = (tensor.device.index or 0) if tensor.is_cuda else 0
        # what a peer READs from: the staging this agent offers (a decode-only worker's
        # is empty and registers nothing)
        self.base = int(tensor.data_ptr())
        self.nbytes = int(tensor.numel() * tensor.element_size())
        self._regs: list[Any] = []
        self.register(tensor)

    def register(self, tensor: torch.Tensor) -> None:
        """Register ``tensor`` (staging of this worker's device) with the agent; a tensor
        of no bytes is not registered."""
        nbytes = int(tensor.numel() * tensor.element_size())
        if nbytes:
            reg = self.agent.get_reg_descs(
                [(int(tensor.data_ptr()), nbytes, self.device_id, "")], self.memory_type)
            self.agent.register_memory(reg)
            self._regs.append(reg)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def notify_metadata(self) -> bytes:
        """This agent's connection alone, none of its memory: what a peer that only
        sends notifications (the IPC wire's D) loads (:meth:`add_peer`)."""
        from nixl._api import nixlBind

        empty = nixlBind.nixlRegDList(self.agent.nixl_mems[self.memory_type])
        return self.agent.get_partial_agent_metadata(empty, True, self.backends)

    def add_peer(self, handshake: RankHandshake, notify_only: bool = False) -> str:
        """Load the peer's agent: all of it (its staging too: this agent READs from it),
        or, with ``notify_only`` and a peer that offers it, only its connection.

        Why the difference: loading a peer's memory hands its keys to UCX, and UCX's
        ``cuda_ipc`` transport probes the first key of each peer GPU by opening that
        memory's CUDA IPC handle and keeping the mapping in its cache for the life of the
        process (``uct_cuda_ipc_is_peer_accessible``). A D on the IPC wire never READs
        over NIXL, yet loading P's staging made its process map P's 2 GiB a second time;
        once P was killed that mapping kept P's staging allocated on the GPU after D had
        dropped its own (one H100, 2026-11-26: D's process 2 132 MiB above its start,
        the idle unmap freeing nothing). Raises :class:`WireError` when the agent loaded
        is not the one the handshake names."""
        metadata = handshake.agent_metadata
        if notify_only and handshake.notify_metadata is not None:
            metadata = handshake.notify_metadata
        name = self.agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        if name != handshake.agent_name:
            raise WireError(f"the handshake names NIXL agent {handshake.agent_name!r}, its "
                            f"metadata loads {name!r}")
        return name

    def read(self, peer: str, handshake: RankHandshake, remote_offset: int,
             local_address: int, nbytes: int, notif: bytes) -> Any:
        """Post a READ of ``nbytes`` from the peer's staging into ours at
        ``local_address`` (registered memory: :class:`DecodeStaging`), one descriptor per
        ``CHUNK_BYTES``; NIXL delivers ``notif`` to the peer when it has completed.
        Raises if NIXL refuses (no handle is left behind)."""
        local, remote = [], []
        for start in range(0, nbytes, CHUNK_BYTES):
            length = min(CHUNK_BYTES, nbytes - start)
            local.append((local_address + start, length, self.device_id))
            remote.append((handshake.staging_base + remote_offset + start, length,
                           handshake.device_id))
        handle = self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(local, self.memory_type),
            self.agent.get_xfer_descs(remote, handshake.memory_type), peer, notif)
        try:
            state = self.agent.transfer(handle)
        except BaseException:
            self.agent.release_xfer_handle(handle)
            raise
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused to start the READ")
        return handle

    def state(self, handle: Any) -> str:
        """"DONE", "PROC" or "ERR" (an exception from NIXL counts as "ERR")."""
        try:
            return self.agent.check_xfer_state(handle)
        except Exception:  # noqa: BLE001 - a broken transfer is a failed one
            return "ERR"

    def transfer_seconds(self, handle: Any) -> float | None:
        """A completed transfer's duration by NIXL's telemetry, None where it has none."""
        try:
            return float(self.agent.get_xfer_telemetry(handle).xferDuration) / 1e6
        except Exception:  # noqa: BLE001 - telemetry is best effort
            return None

    def release(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001
            logger.warning("kvcached-pd: could not release a NIXL transfer handle: %s", exc)

    def send(self, peer: str, message: bytes) -> None:
        """A notification to a loaded peer without a transfer (the IPC wire's DONE)."""
        self.agent.send_notif(peer, message)

    def notifications(self) -> list[bytes]:
        messages: list[bytes] = []
        for batch in self.agent.get_new_notifs().values():
            messages.extend(batch)
        return messages

    def close(self) -> None:
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001 - shutdown path
                pass
        self._regs = []


class DecodeStaging:
    """D's staging: where a NIXL READ lands before the unpack, allocated and registered
    at the first request that needs it, not at start-up.

    Why: on the CUDA IPC wire (P and D on one host: the colocated deployment) D unpacks
    straight from P's mapped extent and never uses this range, which is 2 x
    ``max_num_batched_tokens`` of KV by default: 4 096 MiB of an idle D's 6 690 MiB on the
    kvbig test model, 2 048 of 3 984 on the tiny one (2 x H200, 2026-11-27). A D whose
    peers all take the IPC wire now never allocates it. ``eager`` (``KVCACHED_PD_WIRE=nixl``:
    every peer READs) allocates it at start-up, as before, so that a device without the
    room stops startup. Otherwise a failed allocation (the device filled since start-up)
    fails that request's load, as a failed READ does (vLLM's ``kv_load_failure_policy``),
    and the next request that needs the range tries again.

    Extent offsets are relative to this range. Used from the worker's own thread only
    (the hooks that post READs and free extents), like the agent's READs.
    """

    def __init__(self, nbytes: int, device: torch.device, agent: StagingAgent,
                 eager: bool = False) -> None:
        self.allocator = ExtentAllocator(nbytes, ALIGNMENT)
        self.device = device
        self.agent = agent
        self.tensor: torch.Tensor | None = None
        if eager and nbytes:
            self.ensure()

    @property
    def allocated(self) -> bool:
        return self.tensor is not None

    def ensure(self) -> torch.Tensor:
        """The range's tensor, allocated and registered with the agent the first time.
        Raises :class:`~kvcached_pd.transport.staging.StagingError` when the device has
        no room for it."""
        if self.tensor is None:
            nbytes = self.allocator.capacity_bytes
            # raises StagingError when the device has no room (this allocator hands out)
            tensor = StagingBuffer(nbytes, self.device, alignment=ALIGNMENT,
                                   alloc_bytes=0).tensor
            try:
                self.agent.register(tensor)
            except Exception as error:  # noqa: BLE001 - NIXL's refusal fails the load only
                raise StagingError(f"could not register the {nbytes >> 20} MiB decode staging "
                                   f"with NIXL: {error}") from error
            self.tensor = tensor
            logger.info("kvcached-pd: decode staging allocated and registered: %d MiB on %s "
                        "(the first request READ over NIXL)", nbytes >> 20, self.device)
        return self.tensor

    def alloc(self, nbytes: int, owner: Any) -> Extent | None:
        """An extent of ``nbytes``, or None while the range is full (the request waits).
        Raises :class:`StagingError` when the range cannot be allocated at all."""
        self.ensure()
        return self.allocator.alloc(nbytes, owner)

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def address(self, offset: int) -> int:
        """The device address of ``offset`` (a READ's local descriptor)."""
        return int(self.ensure().data_ptr()) + offset

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.ensure()[offset: offset + nbytes]


def cache_layers(kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> tuple[KVCacheLayers, int, int]:
    """The logical views of this worker's attention caches, the kernel block size and
    how many kernel blocks make one of the scheduler's blocks.

    vLLM may split a scheduler block into several kernel blocks (the attention kernel's
    block size); the caches then hold ``ratio x num_blocks`` blocks of
    ``block_size / ratio`` tokens. The ratio is read off the tensors, not from vLLM's
    private worker attributes.
    """
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    block_size = int(spec.block_size)
    caches, seen = [], set()
    for name in group.layer_names:
        cache = kv_caches[name]
        if cache.data_ptr() not in seen:
            seen.add(cache.data_ptr())
            caches.append(cache)
    errors = []
    ratio = 1
    while ratio <= block_size:
        if block_size % ratio == 0:
            kernel_bs = block_size // ratio
            try:
                views = [logical_kv_view(c, AttnCacheSpec(kernel_bs, spec.num_kv_heads,
                                                          spec.head_size)) for c in caches]
                layers = KVCacheLayers.from_views(views)
            except ValueError as exc:
                errors.append(str(exc))
            else:
                if layers.num_blocks >= int(kv_cache_config.num_blocks) * ratio:
                    return layers, kernel_bs, ratio
                errors.append(f"{layers.num_blocks} blocks of {kernel_bs} tokens do not hold "
                              f"{kv_cache_config.num_blocks} blocks of {block_size}")
        ratio *= 2
    raise ValueError("kvcached-pd cannot read this KV cache's layout: " + "; ".join(errors[-2:]))


@dataclass
class StagingRegion:
    """A worker's staging buffer, agent and cache views (see the module docstring)."""

    fmt: PackedFormat
    plan: StagingPlan
    buffer: StagingBuffer  # the prefill range: what P packs into and offers its peers
    agent: StagingAgent
    decode: DecodeStaging  # D's range, allocated when a READ first needs it
    layers: KVCacheLayers
    kernel_block_size: int
    ratio: int
    tp_rank: int
    tp_size: int
    head_start: int
    head_count: int
    # P: the staging exported for a same-host D's CUDA IPC wire, and its pack events
    ipc_export: cuda_ipc.StagingExport | None = None
    pack_events: cuda_ipc.PackEvents | None = None
    ipc_reason: str = ""  # why there is no export

    @classmethod
    def create(cls, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any, fmt: PackedFormat,
               plan: StagingPlan, tp_rank: int, tp_size: int,
               offer_ipc: bool = False, eager_decode: bool = False) -> "StagingRegion":
        """``offer_ipc``: a prefill role that lets same-host decode instances map its
        staging (:mod:`kvcached_pd.transport.cuda_ipc`); a buffer that cannot be
        exported is served over NIXL alone, said once here. ``eager_decode``: allocate
        D's range now (:class:`DecodeStaging` says when it is not)."""
        layers, kernel_bs, ratio = cache_layers(kv_caches, kv_cache_config)
        # the prefill range alone (P's scheduler hands out its extents)
        buffer = StagingBuffer(plan.prefill_bytes, layers.device, alignment=ALIGNMENT,
                               alloc_bytes=0)
        agent = StagingAgent(buffer.tensor)
        decode = DecodeStaging(plan.decode_bytes, layers.device, agent, eager=eager_decode)
        heads = fmt.num_kv_heads
        region = cls(fmt=fmt, plan=plan, buffer=buffer, agent=agent, decode=decode,
                     layers=layers, kernel_block_size=kernel_bs, ratio=ratio, tp_rank=tp_rank,
                     tp_size=tp_size, head_start=tp_rank * heads, head_count=heads)
        if offer_ipc:
            try:
                region.ipc_export, region.pack_events = cuda_ipc.export_staging(buffer.tensor)
            except cuda_ipc.IpcUnavailable as exc:
                region.ipc_reason = str(exc)
                level = logging.WARNING if buffer.tensor.is_cuda else logging.INFO
                logger.log(level, "kvcached-pd: this prefill offers no CUDA IPC wire (%s); "
                           "decode instances READ its extents over NIXL", exc)
        return region

    @property
    def digest(self) -> str:
        return format_hash(self.fmt, self.head_start, self.head_count)

    def handshake(self, engine_id: str) -> RankHandshake:
        return RankHandshake(
            wire_version=WIRE_VERSION, engine_id=engine_id, tp_rank=self.tp_rank,
            tp_size=self.tp_size, agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(), notify_metadata=self.agent.notify_metadata(),
            staging_base=self.agent.base,
            staging_bytes=self.agent.nbytes, device_id=self.agent.device_id,
            memory_type=self.agent.memory_type, packed_format=self.fmt.to_dict(),
            head_start=self.head_start, head_count=self.head_count, format_digest=self.digest,
            ipc=self.ipc_export.to_dict() if self.ipc_export is not None else None)

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer.tensor[offset: offset + nbytes]

    def kernel_ids(self, block_ids: list[int]) -> list[int]:
        r = self.ratio
        return [b * r + i for b in block_ids for i in range(r)]
