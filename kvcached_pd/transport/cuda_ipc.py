"""CUDA IPC between a prefill and a decode process of one host: P's staging, mapped by D.

Why: two vLLM instances on one GPU (what kvcached exists for) move KV over NIXL/UCX at
0.45-0.54 GB/s (one H100, default UCX transports; UCX does not use ``cuda_ipc`` within
one device), while a copy from a ``cudaIpcMemHandle``-shared allocation of the other
process runs at 1497 GB/s, as fast as a local device copy. So a same-host D maps P's
staging buffer once per peer and unpacks each request straight from it.

What is shared, once per P worker (:func:`export_staging`, carried in P's handshake):

* the staging buffer: torch's own CUDA IPC export of its allocation
  (``UntypedStorage._share_cuda_``, what ``torch.multiprocessing`` sends), opened by D
  on D's own device (:func:`open_staging`): the same GPU, or another GPU of the host
  through peer access (CUDA's lazy peer mapping); a GPU D cannot reach refuses;
* a ring of interprocess CUDA events (:class:`PackEvents`): P records one after each
  step's pack, on the stream that packed; D's stream waits on it before it unpacks.
  P's response is stream-ordered after the pack already (vLLM samples after it), so
  the wait is the device-side guarantee, not a delay: it costs nothing once the pack
  has run. Any later record of the same slot comes later on P's stream, so a reused
  slot can only make D wait longer, never shorter.

``host_identity`` says whether two processes can share these handles at all: the
kernel's boot id (the same host) and the IPC namespace (containers need a shared one,
``--ipc=host``, as NCCL's peer-to-peer transport does).

Everything here is a thin layer over torch so that tests can replace it
(``tests/support/fake_cuda_ipc.py``): a CPU has no CUDA IPC.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# Events in P's ring. A slot is re-recorded every this many pack steps; a D that waits on
# it then waits for that later pack (a few hundred microseconds at most), never less.
NUM_PACK_EVENTS = 16


class IpcUnavailable(RuntimeError):
    """This process cannot share or open the peer's memory (the reason in the message).

    ``same_host``: the peer is on this host, so NIXL serving it instead is a fallback an
    operator should see (a peer on another host never had IPC to lose)."""

    def __init__(self, message: str, same_host: bool = True) -> None:
        super().__init__(message)
        self.same_host = same_host


def host_identity() -> str:
    """Same value in two processes exactly when they can open each other's CUDA IPC
    handles as far as the host is concerned: ``<kernel boot id>/ipc:<IPC namespace>``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        ipc_ns = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        ipc_ns = 0
    return f"{boot}/ipc:{ipc_ns}"


def _check_host(peer: str) -> None:
    own = host_identity()
    if peer == own:
        return
    same_boot = peer.split("/", 1)[0] == own.split("/", 1)[0]
    if same_boot:
        raise IpcUnavailable("the peer runs in another IPC namespace on this host (containers "
                             "need a shared one, e.g. --ipc=host)")
    raise IpcUnavailable("the peer is on another host", same_host=False)


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class PackEvents:
    """P's ring of interprocess events (see the module docstring)."""

    def __init__(self, device: torch.device, count: int = NUM_PACK_EVENTS) -> None:
        with torch.cuda.device(device):
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(count)]
            self.handles = [bytes(e.ipc_handle()) for e in self.events]

    def record(self, slot: int, stream: Any) -> None:
        """After a step's packs, on the stream that ran them (None: the current one)."""
        self.events[slot % len(self.events)].record(stream)


@dataclass(frozen=True)
class StagingExport:
    """What D needs to map P's staging: sent in P's handshake as :meth:`to_dict`."""

    host: str
    device_uuid: str
    nbytes: int
    memory: tuple  # torch's _share_cuda_() tuple, less its device index
    events: tuple[bytes, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "device_uuid": self.device_uuid, "nbytes": self.nbytes,
                "memory": list(self.memory), "events": list(self.events)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "StagingExport":
        try:
            memory = tuple(raw["memory"])
            events = tuple(bytes(e) for e in raw["events"])
            export = cls(str(raw["host"]), str(raw["device_uuid"]), int(raw["nbytes"]),
                         memory, events)
        except (KeyError, TypeError, ValueError) as exc:
            raise IpcUnavailable(f"malformed IPC export in the peer's handshake: {exc}") from exc
        if len(memory) != 7 or not events or export.nbytes <= 0:
            raise IpcUnavailable("malformed IPC export in the peer's handshake")
        return export


def export_staging(tensor: torch.Tensor) -> tuple[StagingExport, PackEvents]:
    """P: share ``tensor`` (the whole staging buffer) and a new event ring.

    Raises :class:`IpcUnavailable` when the buffer cannot be shared (host memory, or an
    allocator that does not export, e.g. expandable segments on an older torch)."""
    if not tensor.is_cuda:
        raise IpcUnavailable("the staging buffer is host memory")
    try:
        shared = tensor.untyped_storage()._share_cuda_()
        events = PackEvents(tensor.device)
    except Exception as exc:  # noqa: BLE001 - any failure means: no IPC, NIXL serves
        raise IpcUnavailable(f"torch could not export the staging buffer: {exc}") from exc
    _device, *memory = shared
    nbytes = int(tensor.numel() * tensor.element_size())
    return (StagingExport(host_identity(), device_uuid(tensor.device), nbytes, tuple(memory),
                          tuple(events.handles)), events)


@dataclass
class MappedStaging:
    """D: P's staging mapped into this process, and P's pack events opened here.

    ``home``: the GPU holding P's staging, as this process numbers it. Across two GPUs
    it is not ``tensor.device``: D opens the handle in its own GPU's context (peer
    access), so the tensor names D's GPU while the memory, and what a dead P's staging
    gives back when D drops it, is on P's (2 x H100, 2026-11-26: D's unmap line read
    ``tensor.device`` and said "rose by 0 MiB" for a killed P). On one GPU, D's own.
    """

    tensor: torch.Tensor
    events: list[Any]
    home: torch.device

    def wait_packed(self, slot: int, stream: Any) -> None:
        """Make ``stream`` wait for P's pack of step ``slot`` (module docstring)."""
        if stream is None:
            stream = torch.cuda.current_stream(self.tensor.device)
        stream.wait_event(self.events[slot % len(self.events)])

    def extent(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.tensor.numel():
            raise ValueError(f"extent [{offset}, {offset + nbytes}) lies outside the peer's "
                             f"{self.tensor.numel()}-byte staging")
        return self.tensor[offset: offset + nbytes]


def local_device_of(export: StagingExport, device: torch.device) -> tuple[int, int, str]:
    """Where D maps P's staging (its own GPU's index: across GPUs through peer access),
    the index of the GPU holding it, both as this process numbers them, and how D
    reaches it ("same GPU" or "peer access from GPU n to GPU m");
    :class:`IpcUnavailable` when it cannot."""
    own = device.index if device.index is not None else torch.cuda.current_device()
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == export.device_uuid:
            if index == own:
                return own, own, "same GPU"
            if not torch.cuda.can_device_access_peer(own, index):
                raise IpcUnavailable(f"this GPU ({own}) cannot access the peer's GPU ({index}) "
                                     "directly (no NVLink/PCIe peer access)")
            return own, index, f"peer access from GPU {own} to GPU {index}"
    raise IpcUnavailable(f"the peer's GPU {export.device_uuid} is not visible to this process "
                         "(CUDA_VISIBLE_DEVICES)")


def open_staging(export: StagingExport, device: torch.device) -> tuple[MappedStaging, str]:
    """D: map P's staging on this process's ``device``; the mapping and how it reaches
    P's GPU. Raises :class:`IpcUnavailable` with the reason when it cannot."""
    _check_host(export.host)
    if device.type != "cuda":
        raise IpcUnavailable("this decode instance's staging is host memory")
    index, home, how = local_device_of(export, device)
    handle, size, offset, ref_handle, ref_offset, event_handle, sync = export.memory
    try:
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(
                index, handle, size, offset, ref_handle, ref_offset, event_handle, sync)
            tensor = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
            tensor.set_(storage, 0, (export.nbytes,), (1,))
            events = [torch.cuda.Event.from_ipc_handle(index, h) for h in export.events]
    except Exception as exc:  # noqa: BLE001 - cudaIpcOpenMemHandle refused: NIXL serves
        raise IpcUnavailable(f"CUDA IPC open failed: {exc}") from exc
    return MappedStaging(tensor, events, torch.device("cuda", home)), how
