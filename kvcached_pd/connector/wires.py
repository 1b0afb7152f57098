"""How a staged extent reaches D: one wire per P peer rank, chosen once at its handshake.

* :class:`NixlWire`: D READs P's extent into an extent of its own staging (one NIXL
  descriptor per 64 MiB) and unpacks from there; the DONE rides on the READ. Any host;
  on two GPUs of one host 243 GB/s at 1 GiB (NVLink), between two processes on one GPU
  0.45-0.54 GB/s (UCX takes no ``cuda_ipc`` path within one device).
* :class:`IpcWire`: P and D on one host. D maps P's staging once
  (:mod:`kvcached_pd.transport.cuda_ipc`) and unpacks each request straight from P's
  extent after its stream waited on P's pack event: no READ, no D staging, one copy
  at the GPU's own speed (1.5 TB/s on one H100). D sends the DONE once its unpack has
  run on the device, so P reuses the extent only after D has read it.

:func:`choose_wire` is the one place that decides, from ``KVCACHED_PD_WIRE`` and the
peer's handshake: ``nixl`` always NIXL; ``ipc`` IPC or a refused peer (its requests fail
their loads); ``auto`` IPC when D can open P's staging, NIXL otherwise, with the reason
(an IPC open that failed on the same host is a *fallback*: logged and counted in
``vllm:kvcached_pd_wire_fallbacks_total``).

The interface a wire offers :class:`~kvcached_pd.connector.decode_worker.DecodeWorker`:
``uses_staging`` (D reserves an extent of its own), ``post`` (start moving),
``state`` ("PROC", "DONE" or "ERR"), ``settle`` (after the state left "PROC"),
``before_unpack`` / ``source`` (what the unpack waits on and reads: the request's
``window`` of P's extent, from the first token D's prefix cache lacks to the tag),
``done_message``
(the DONE D still has to send once the unpack ran; None when the wire carried it).
A third wire (RDMA across nodes, say) is one more class here and one more branch in
:func:`choose_wire`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from kvcached_pd.connector.wire import Done, RankHandshake, WireError
from kvcached_pd.transport import cuda_ipc

logger = logging.getLogger("kvcached_pd")


class WireClosed(RuntimeError):
    """The peer's mapping was dropped for idleness between lookup and use: map again."""


class _Wire:
    """What both wires hold: the peer rank's NIXL agent name and handshake, and why this
    wire serves it."""

    name = ""
    uses_staging = False

    def __init__(self, region: Any, peer: str, handshake: RankHandshake, why: str) -> None:
        self.region = region
        self.peer = peer
        self.handshake = handshake
        self.why = why
        self.fell_back = False  # an IPC open failed on this host (counted once)

    def send(self, message: bytes) -> None:
        self.region.agent.send(self.peer, message)


class NixlWire(_Wire):
    name = "nixl"
    uses_staging = True

    def post(self, read: Any) -> None:
        params = read.params
        start, nbytes = read.window  # only what D's prefix cache lacks, and the tag
        notif = Done(params.request_id, self.region.tp_rank, params.token).encode()
        read.handle = self.region.agent.read(self.peer, self.handshake, params.offset + start,
                                             self.region.decode.address(read.extent.offset),
                                             nbytes, notif)

    def state(self, read: Any) -> str:
        return self.region.agent.state(read.handle)

    def settle(self, read: Any, samples: dict[str, list[float]], state: str) -> None:
        if state == "DONE":
            wire_s = self.region.agent.transfer_seconds(read.handle)
            if wire_s is not None:
                samples.setdefault("read_duration", []).append(wire_s)
        self.region.agent.release(read.handle)

    def before_unpack(self, read: Any, stream: Any) -> None:
        pass

    def source(self, read: Any) -> torch.Tensor:
        return self.region.decode.view(read.extent.offset, read.window[1])

    def done_message(self, read: Any) -> bytes | None:
        return None  # NIXL delivered it with the READ

    def finished_with(self, read: Any) -> None:
        pass

    def is_idle(self, idle_s: float, now: float) -> bool:
        return False  # a NIXL peer holds no memory of P's

    def close_if_idle(self, idle_s: float, now: float) -> bool:
        return False


class IpcWire(_Wire):
    name = "ipc"

    def __init__(self, region: Any, peer: str, handshake: RankHandshake,
                 mapped: cuda_ipc.MappedStaging, why: str) -> None:
        super().__init__(region, peer, handshake, why)
        self.mapped = mapped
        # posted reads not finished yet, and when the last one finished (close_if_idle);
        # D's engine thread and its unmap thread both touch them
        self._lock = threading.Lock()
        self.users = 0
        self.last_used = time.monotonic()

    def post(self, read: Any) -> None:
        params = read.params
        with self._lock:
            if self.mapped is None:
                raise WireClosed(f"prefill {self.handshake.engine_id}'s staging was unmapped")
            self.mapped.extent(params.offset, params.nbytes)  # raises outside P's staging
            self.users += 1
            self.last_used = time.monotonic()

    def finished_with(self, read: Any) -> None:
        """A posted read is done with P's staging (its DONE sent, or its load failed)."""
        with self._lock:
            self.users -= 1
            self.last_used = time.monotonic()

    @property
    def device(self) -> Any:
        """The GPU holding P's staging, as this process numbers it (None once dropped):
        P's across two GPUs, where the mapping itself sits in D's own GPU's context."""
        mapped = self.mapped
        return mapped.home if mapped is not None else None

    def is_idle(self, idle_s: float, now: float) -> bool:
        """Whether :meth:`close_if_idle` would drop the mapping now."""
        with self._lock:
            return self._idle(idle_s, now)

    def _idle(self, idle_s: float, now: float) -> bool:
        return self.mapped is not None and not self.users and now - self.last_used >= idle_s

    def close_if_idle(self, idle_s: float, now: float) -> bool:
        """Drop the mapping when no read uses it and none came for ``idle_s``: torch
        closes the IPC handle with the last reference, and only then can the GPU free P's
        staging once P is gone. True when it was dropped."""
        with self._lock:
            if not self._idle(idle_s, now):
                return False
            self.mapped = None
            return True

    def state(self, read: Any) -> str:
        return "DONE"  # nothing in flight: the unpack reads P's memory

    def settle(self, read: Any, samples: dict[str, list[float]], state: str) -> None:
        pass

    def before_unpack(self, read: Any, stream: Any) -> None:
        if read.params.pack_event >= 0:
            self.mapped.wait_packed(read.params.pack_event, stream)

    def source(self, read: Any) -> torch.Tensor:
        start, nbytes = read.window  # the unpack reads only what D's prefix cache lacks
        return self.mapped.extent(read.params.offset + start, nbytes)

    def done_message(self, read: Any) -> bytes | None:
        return Done(read.params.request_id, self.region.tp_rank, read.params.token).encode()



def choose_wire(policy: str, region: Any, peer: str, handshake: RankHandshake):
    """The wire that serves this peer rank (module docstring). Raises :class:`WireError`
    when ``policy`` is ``ipc`` and IPC cannot serve it."""
    if policy == "nixl":
        return NixlWire(region, peer, handshake, "KVCACHED_PD_WIRE=nixl")
    try:
        if handshake.ipc is None:
            raise cuda_ipc.IpcUnavailable(
                "the prefill offers no CUDA IPC (its staging is host memory or could not be "
                "exported, it runs with KVCACHED_PD_WIRE=nixl, or its kvcached-pd predates "
                "the IPC wire)", same_host=False)
        export = cuda_ipc.StagingExport.from_dict(handshake.ipc)
        if export.nbytes < handshake.staging_bytes:
            raise cuda_ipc.IpcUnavailable("the exported staging is smaller than advertised")
        mapped, how = cuda_ipc.open_staging(export, region.buffer.tensor.device)
    except cuda_ipc.IpcUnavailable as exc:
        if policy == "ipc":
            raise WireError(f"KVCACHED_PD_WIRE=ipc, but CUDA IPC cannot serve prefill "
                            f"{handshake.engine_id}: {exc}") from exc
        wire = NixlWire(region, peer, handshake, f"no CUDA IPC: {exc}")
        wire.fell_back = exc.same_host
        return wire
    return IpcWire(region, peer, handshake, mapped, f"CUDA IPC, {how}")
