"""Geometry of every KV cache tensor kvcached creates in this process.

An earlier version of this integration passed the block budget through a module
global of kvcached's, which holds one value per process; its review objected that
several engines or KV-cache groups overwrite each other. This registry keeps one
record per tensor instead, keyed by (allocation, KV-cache group, layer) and looked up
by the tensor's address, so a registration can check each tensor it is handed
against what was actually created for it.

Filled by the ``kvcached_alloc`` patch (wrapping kvcached's ``alloc_kv_cache``), read
by the ``nixl_registration`` patch and by ``kvcached-pd doctor``. Imports torch only
when a tensor is described.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
import tempfile
import threading
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from kvcached_pd import config

logger = logging.getLogger("kvcached_pd")


@dataclass(frozen=True)
class KVCacheGeometry:
    """One layer's KV cache tensor as created by kvcached, in kernel blocks."""

    allocation: str  # "<pid>:<n>": one alloc_kv_cache call = one engine's KV-cache group
    group_id: int
    layer_index: int
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    element_size: int
    blocks_dim: int  # which dim of ``shape`` counts blocks
    virtual_blocks: int  # size of that dim: kvcached's virtual reservation
    physical_blocks: int  # what vLLM asked for (its kv_cache_config budget), kernel blocks
    block_size: int  # tokens per logical block
    kernel_block_size: int  # tokens per kernel block (== block_size unless vLLM splits)
    kv_layout: str  # "NHD" or "HND" as requested from kvcached
    attention_type: str

    @classmethod
    def of(cls, tensor: Any, **fields: Any) -> "KVCacheGeometry":
        """The record of ``tensor``: address, shape, strides and dtype read from it."""
        return cls(
            data_ptr=int(tensor.data_ptr()),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            dtype=str(tensor.dtype).replace("torch.", ""),
            element_size=tensor.element_size(),
            **fields,
        )

    @property
    def block_stride_bytes(self) -> int:
        return self.stride[self.blocks_dim] * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this layer (K and V): every dim but the blocks dim."""
        n = self.element_size
        for dim, size in enumerate(self.shape):
            if dim != self.blocks_dim:
                n *= size
        return n

    @property
    def interleaves_layers(self) -> bool:
        """kvcached's contiguous layout: consecutive blocks of this layer are further
        apart than one block, because every other layer's block sits in between
        (block stride = layers x block bytes). vLLM's NIXL worker describes block
        ``b`` of a layer as ``base + b * block_len``, which there addresses another
        layer's bytes. Split-half memory (block stride = half a block) and plain
        per-layer tensors (= one block) do not interleave."""
        return self.block_stride_bytes > self.block_bytes

    def key(self) -> tuple[str, int, int]:
        return (self.allocation, self.group_id, self.layer_index)


class GeometryRegistry:
    """Thread-safe map from tensor address to the geometry kvcached created there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ptr: dict[int, KVCacheGeometry] = {}
        self._registrations: list[dict[str, Any]] = []
        self._counter = itertools.count()

    def new_allocation_id(self) -> str:
        return f"{os.getpid()}:{next(self._counter)}"

    def record(self, geometry: KVCacheGeometry) -> None:
        with self._lock:
            # A new allocation at an address replaces whatever was recorded there
            # before (a re-initialised engine reuses its reservation).
            self._by_ptr[geometry.data_ptr] = geometry

    def forget_allocation(self, allocation: str) -> None:
        with self._lock:
            for ptr in [p for p, g in self._by_ptr.items() if g.allocation == allocation]:
                del self._by_ptr[ptr]

    def lookup(self, tensor: Any) -> KVCacheGeometry | None:
        """The record for a tensor with this address and shape, if kvcached made it."""
        with self._lock:
            geometry = self._by_ptr.get(int(tensor.data_ptr()))
        if geometry is None:
            return None
        if tuple(tensor.shape) != geometry.shape or tuple(tensor.stride()) != geometry.stride:
            return None  # another view at the same address: not the tensor kvcached made
        return geometry

    def geometries(self) -> list[KVCacheGeometry]:
        with self._lock:
            return sorted(self._by_ptr.values(), key=KVCacheGeometry.key)

    def note_registration(self, record: dict[str, Any]) -> None:
        """Remember (and publish for the doctor) what a NIXL registration covered."""
        with self._lock:
            self._registrations.append(record)
        _publish(self.snapshot())

    def registrations(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._registrations)

    def snapshot(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "geometries": [asdict(g) for g in self.geometries()],
            "registrations": self.registrations(),
        }

    def clear(self) -> None:
        with self._lock:
            self._by_ptr.clear()
            self._registrations.clear()


REGISTRY = GeometryRegistry()

def state_dir() -> str:
    # Read at each call, not from the once-parsed settings: tests point it elsewhere.
    return config.state_dir()


def own_state_dir(create: bool) -> str | None:
    """The state dir when it is this user's own: a real directory (not a link), owned by
    this user, writable by no one else. Created 0700 when missing and ``create``. None
    otherwise, with a warning when it exists and is not: its default name under the
    shared temp dir is predictable, so another local user may have made it first, to
    read or plant snapshots."""
    directory = state_dir()
    if create:
        os.makedirs(os.path.dirname(directory) or ".", exist_ok=True)
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        global _warned
        if not _warned:
            _warned = True
            logger.warning(
                "kvcached-pd: state dir %s is not this user's own (a link, another owner, or "
                "writable by others); registrations are not published there. Remove it or "
                "set %s to a directory of your own", directory, config.KVCACHED_PD_STATE_DIR)
        return None
    return directory


_warned = False


def _publish(snapshot: dict[str, Any]) -> None:
    """Write this process's snapshot where ``kvcached-pd doctor`` looks; best effort.
    Written to a fresh temporary name (``mkstemp``: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600)
    and renamed over the snapshot, so a link planted at either name is never followed."""
    try:
        directory = own_state_dir(create=True)
        if directory is None:
            return
        path = os.path.join(directory, f"{snapshot['pid']}.json")
        fd, tmp = tempfile.mkstemp(prefix=f".{snapshot['pid']}.", suffix=".tmp",
                                   dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(snapshot, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def live_snapshots() -> Iterable[dict[str, Any]]:
    """Snapshots published by processes that are still running."""
    directory = own_state_dir(create=False)
    if directory is None:
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        try:
            pid = int(name[: -len(".json")])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError, PermissionError):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue
    return out
