"""Staging memory: one registered device buffer, carved into per-request extents.

NIXL only ever sees a worker's staging buffer, an ordinary device allocation made and
registered once (kvcached's remappable pages cannot be the remote side of a transfer).
Each in-flight request holds one extent of it from pack until decode's notification or
the abort timeout, so the buffer is a small heap of variable-size, short-lived extents.

:class:`ExtentAllocator` manages the byte range: first fit over an offset-sorted free
list whose neighbours coalesce on free, every extent aligned. A full buffer is an
ordinary outcome (``alloc`` returns ``None``; the caller waits or takes the direct
path), never an exception; freeing an extent twice, or one it never handed out, is a
bug and raises. :class:`StagingBuffer` owns the device tensor and hands out typed views
of extents.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvcached_pd.config import KVCACHED_PD_STAGING_MB

# What D assumes a staged READ runs at when predicting whether it ends within the spin
# budget: below the 243 GB/s measured at 1 GiB on NVLink, so predictions err late.
EXPECTED_READ_BYTES_PER_S = 150e9

__all__ = [
    "Extent",
    "ExtentAllocator",
    "StagingBuffer",
    "StagingError",
]

logger = logging.getLogger(__name__)


class StagingError(RuntimeError):
    """Misuse of staging memory, or a staging buffer that could not be allocated."""


@dataclass(frozen=True)
class Extent:
    """``nbytes`` bytes at ``offset`` of a staging buffer, held by ``owner``.

    ``ticket`` is unique per allocation, so a stale handle to a freed extent is never
    mistaken for a later extent at the same offset.
    """

    offset: int
    nbytes: int
    owner: Hashable
    ticket: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class ExtentAllocator:
    """Thread-safe first-fit allocator over ``[start, start + capacity_bytes)``.

    Every extent starts on a multiple of ``alignment`` and reserves its size rounded up
    to one, so ``used_bytes + free_bytes == capacity_bytes`` always holds. Offsets are
    absolute (``start`` included): a buffer shared by a prefill and a decode role gives
    each role its own allocator over a disjoint range. A capacity of 0 is a role this
    instance does not play: every ``alloc`` returns ``None``.
    """

    def __init__(self, capacity_bytes: int, alignment: int = 256, start: int = 0) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity_bytes < 0 or capacity_bytes % alignment:
            raise ValueError(
                f"capacity_bytes must be a non-negative multiple of {alignment}, "
                f"got {capacity_bytes}"
            )
        if start < 0 or start % alignment:
            raise ValueError(f"start must be a non-negative multiple of {alignment}, got {start}")
        self._capacity = capacity_bytes
        self._start = start
        self._alignment = alignment
        self._lock = threading.Lock()
        # Free ranges as parallel offset-sorted lists; neighbours are always coalesced.
        self._free_starts: list[int] = [start] if capacity_bytes else []
        self._free_ends: list[int] = [start + capacity_bytes] if capacity_bytes else []
        self._live: dict[int, Extent] = {}
        self._used = 0
        self._tickets = itertools.count()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def start(self) -> int:
        return self._start

    def _reserved(self, nbytes: int) -> int:
        return -(-nbytes // self._alignment) * self._alignment

    def alloc(self, nbytes: int, owner: Hashable) -> Extent | None:
        """Reserve ``nbytes``; ``None`` when no free range is large enough."""
        if nbytes <= 0:
            raise ValueError(f"extent size must be positive, got {nbytes}")
        reserved = self._reserved(nbytes)
        with self._lock:
            for index, (start, end) in enumerate(zip(self._free_starts, self._free_ends)):
                if end - start >= reserved:
                    break
            else:
                return None
            if end - start == reserved:
                del self._free_starts[index], self._free_ends[index]
            else:
                self._free_starts[index] = start + reserved
            extent = Extent(offset=start, nbytes=nbytes, owner=owner, ticket=next(self._tickets))
            self._live[extent.ticket] = extent
            self._used += reserved
            return extent

    def free(self, extent: Extent) -> None:
        """Return ``extent``; raises :class:`StagingError` if it is not live."""
        with self._lock:
            if self._live.get(extent.ticket) != extent:
                raise StagingError(
                    f"free of an extent that is not live (double free, or not from this "
                    f"allocator): {extent}"
                )
            del self._live[extent.ticket]
            self._release(extent)

    def release_owner(self, owner: Hashable) -> int:
        """Free every extent ``owner`` holds (an aborted request); return how many."""
        with self._lock:
            held = [extent for extent in self._live.values() if extent.owner == owner]
            for extent in held:
                del self._live[extent.ticket]
                self._release(extent)
        if held:
            logger.debug("released %d staging extent(s) of %r", len(held), owner)
        return len(held)

    def _release(self, extent: Extent) -> None:
        start, end = extent.offset, extent.offset + self._reserved(extent.nbytes)
        self._used -= end - start
        index = bisect.bisect_left(self._free_starts, start)
        merges_left = index > 0 and self._free_ends[index - 1] == start
        merges_right = index < len(self._free_starts) and self._free_starts[index] == end
        if merges_left and merges_right:
            self._free_ends[index - 1] = self._free_ends[index]
            del self._free_starts[index], self._free_ends[index]
        elif merges_left:
            self._free_ends[index - 1] = end
        elif merges_right:
            self._free_starts[index] = start
        else:
            self._free_starts.insert(index, start)
            self._free_ends.insert(index, end)

    def is_live(self, extent: Extent) -> bool:
        with self._lock:
            return self._live.get(extent.ticket) == extent

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max(
                (end - start for start, end in zip(self._free_starts, self._free_ends)),
                default=0,
            )

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    def owners(self) -> dict[Hashable, int]:
        """Reserved bytes per owner of a live extent (what is holding staging)."""
        with self._lock:
            held: dict[Hashable, int] = {}
            for extent in self._live.values():
                held[extent.owner] = held.get(extent.owner, 0) + self._reserved(extent.nbytes)
            return held

    def free_ranges(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each free range, in address order."""
        with self._lock:
            return list(zip(self._free_starts, self._free_ends))

    def live_extents(self) -> list[Extent]:
        with self._lock:
            return sorted(self._live.values(), key=lambda extent: extent.offset)


class StagingBuffer:
    """One device ``uint8`` buffer of ``capacity_bytes`` plus the extent allocator of its
    first ``alloc_bytes`` this process hands out itself (default: all of it; 0 where
    another object hands them out: P's scheduler, D's :class:`DecodeStaging`).

    ``tensor`` is what the transport registers with NIXL, once.
    """

    def __init__(
        self, capacity_bytes: int, device: torch.device | str, alignment: int = 256,
        alloc_bytes: int | None = None,
    ) -> None:
        alloc_bytes = capacity_bytes if alloc_bytes is None else alloc_bytes
        if alloc_bytes > capacity_bytes:
            raise ValueError(f"allocator range of {alloc_bytes} bytes exceeds the "
                             f"{capacity_bytes}-byte buffer")
        self.allocator = ExtentAllocator(alloc_bytes, alignment)
        try:
            self.tensor = torch.empty(capacity_bytes, dtype=torch.uint8, device=device)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            raise StagingError(
                f"could not allocate a {capacity_bytes / 2**20:.0f} MiB KV staging buffer on "
                f"{device}: {error}. Lower {KVCACHED_PD_STAGING_MB} (MiB of staging per worker) "
                "or leave more device memory free (e.g. a lower --gpu-memory-utilization)"
            ) from error
        if capacity_bytes:  # a decode-only worker's prefill range is empty
            logger.info("KV staging buffer: %d MiB on %s", capacity_bytes >> 20, device)

    def alloc(self, nbytes: int, owner: Hashable) -> Extent | None:
        return self.allocator.alloc(nbytes, owner)

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def view(
        self, extent: Extent, dtype: torch.dtype = torch.uint8, shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The live ``extent`` as a contiguous tensor of ``dtype`` and ``shape``
        (default: 1-D); the shape must cover the extent's bytes exactly."""
        if not self.allocator.is_live(extent):
            raise StagingError(f"view of an extent that is not live: {extent}")
        if extent.nbytes % dtype.itemsize:
            raise ValueError(f"{extent.nbytes} bytes do not hold whole {dtype} elements")
        numel = extent.nbytes // dtype.itemsize
        shape = (numel,) if shape is None else tuple(shape)
        if math.prod(shape) != numel:
            raise ValueError(f"shape {shape} of {dtype} does not cover {extent.nbytes} bytes")
        return self.tensor[extent.offset : extent.end].view(dtype).view(shape)
