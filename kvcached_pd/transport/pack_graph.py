"""Pack and unpack as one CUDA graph replay: the host's launch cost off a request's path.

Why: on an idle GPU a 94 MiB request's pack + unpack took 0.49 ms of which the device's
work was 0.156 ms (one H100, 2026-11-27, ``experiments/bench_launch_paths.py``). The rest
was the host launching each Python-dispatched operation while the device waited: the
block ids' copy (0.037-0.044 ms), the ``index_select`` (0.054) or ``index_copy_``
(0.036-0.041), the tag's copy (0.027), and before them a fresh pinned buffer per call;
one Triton launch alone cost 0.09-0.13 ms. No arrangement of those operations reached
0.3 ms for the pair. A CUDA graph replays a whole recorded sequence with one launch
(~0.01 ms of host), but bakes in every address and grid size; a request's extent, its
block ids and its block count all change. So:

* every per-request value goes through a small parameter record (:func:`encode`): the
  extent's address, the block count, the token slots to move, the tag's address and
  bytes, then the block ids. The host writes it into a pinned slot (one ``memmove``);
* the graph of a slot runs two kernels: the first copies the slot's record (its
  header and its blocks' ids only) from pinned host memory to the device, the second
  has a FIXED grid that loops over ``(layer, K|V, block, chunk)``
  items up to the count it reads from the record (a grid-stride loop), so one graph
  serves every request size up to ``max_blocks``;
* a ring of slots, each with its own graphs and an event recorded after each replay,
  lets several requests be in flight; a slot whose last replay has not run yet is not
  reused (the call returns False and the caller takes the ordinary path, which is as
  correct), and neither is a request of more than ``max_blocks`` blocks.

The words moved, their order and the extent's format are those of the torch path (same
canonical format, same integer words), so the bytes are identical;
:func:`kvcached_pd.transport.pack.select_kernel` checks that on the device at startup on
a miniature of the caches before any request uses it, and a failure leaves the other
kernels in charge. Measured (2 x H200, 2026-11-27): pack + unpack at 94 MiB 0.167 ms on
an idle GPU against 0.524 ms for the torch path in the same process, the device's work
the same (0.131 ms).
"""

from __future__ import annotations

import array
import ctypes
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvcached_pd.transport.format import TAG_BYTES

try:  # Triton ships with CUDA builds of torch; CPU builds and some hosts lack it
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None
    tl = None

__all__ = ["GraphLauncher", "HEADER_WORDS", "MAX_BLOCKS_CAP", "SlotRing", "encode"]

logger = logging.getLogger("kvcached_pd")

# the record: int64 words [extent address, blocks, token slots to move, tag address,
# tag (TAG_BYTES = 4 words)], then the block ids
HEADER_WORDS = 4 + TAG_BYTES // 8
ZERO_TAG = bytes(TAG_BYTES)
# A slot's room for block ids (64 KiB of pinned memory per slot at the cap); a larger
# request takes the ordinary path.
MAX_BLOCKS_CAP = 8192
SLOTS = 32  # requests in flight per worker before a call falls back
# The kernel's launch shape: items of BLOCK words (8 KiB of int64 words), PROGRAMS_PER_SM
# resident programs of NUM_WARPS warps per SM (64 warps, the SM's whole room), 8 words
# per thread: the shape every server run of these graphs used. A candidate, 2048/8/8,
# packed and unpacked 1 GiB on one GPU in 0.591 / 0.595 ms against 0.628 / 0.631 and read
# it across NVLink in 2.900 against 2.915 ms, tying at 4 and 94 MiB (2 x H200, 2026-11-27,
# experiments/bench_remote_unpack.py, kernels alone); it becomes the default once the
# servers have run it under load.
BLOCK = 1024
PROGRAMS_PER_SM = 16
NUM_WARPS = 4  # Triton's default


def encode(extent_addr: int, ids: array.array, valid_slots: int, tag_addr: int,
           tag: bytes | None) -> bytes:
    """The parameter record of one pack or unpack (see the module docstring).

    ``valid_slots``: token slots from the first block's first that are moved (a pack:
    every slot of its blocks; an unpack: those the extent holds, so a last block only
    partly covered gets only its covered tokens). ``tag``: written at ``tag_addr`` by a
    pack (zeros when None); an unpack writes none."""
    if ids.typecode != "q":
        raise TypeError(f"block ids must be an array('q'), got {ids.typecode!r}")
    tag = ZERO_TAG if tag is None else tag
    if len(tag) != TAG_BYTES:
        raise ValueError(f"an extent's tag is {TAG_BYTES} bytes, got {len(tag)}")
    head = array.array("q", (extent_addr, len(ids), valid_slots, tag_addr))
    return head.tobytes() + tag + ids.tobytes()


class SlotRing:
    """Which slot a call may use: the next in turn whose last use has run on the device.

    ``done(i)`` is that check (a CUDA event's ``query``), injected so that the ring's
    rules are tested without a GPU. Never blocks: a busy slot means "take the ordinary
    path", since waiting for the device would stall the engine's host thread."""

    def __init__(self, slots: int, done: Any) -> None:
        self.slots = slots
        self._done = done
        self._next = 0
        self._used = [False] * slots
        self._lock = threading.Lock()  # P's pack and D's unpack may run on two threads
        self.busy = 0  # calls refused because the slot in turn was still in flight

    def acquire(self) -> int | None:
        with self._lock:
            index = self._next
            if self._used[index] and not self._done(index):
                self.busy += 1
                return None
            self._next = (index + 1) % self.slots
            self._used[index] = True
            return index


if triton is not None:

    @triton.jit
    def _record_kernel(host, dev, WIDTH: tl.constexpr, HEADER: tl.constexpr,
                       BLOCK: tl.constexpr):
        """A slot's record from pinned host memory (read over the bus: unified
        addressing) to the device, its header and its ``nb`` ids only."""
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = (at < HEADER + tl.load(host + 1)) & (at < WIDTH)
        tl.store(dev + at, tl.load(host + at, mask=mask), mask=mask)

    @triton.jit
    def _graph_copy_kernel(
        layer_addrs,  # int64[L]: byte address of each layer's view element [0, 0, 0, 0, 0]
        record,  # int64[HEADER + max_blocks]: the record (:func:`encode`), on the device
        record_bytes,  # the same record as bytes (the tag)
        s_kv, s_blk, s_tok, s_head,  # the views' strides, in words (last dim stride 1)
        packed_tok_stride,  # words per token slot (all layers' K and V) in the extent
        NUM_LAYERS: tl.constexpr, H: tl.constexpr, DW: tl.constexpr, BS: tl.constexpr,
        WORD_BYTES: tl.constexpr, TO_PACKED: tl.constexpr, BLOCK: tl.constexpr,
        CHUNKS: tl.constexpr, NPROG: tl.constexpr, HEADER: tl.constexpr,
        TAG: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        extent_addr = tl.load(record)
        nb = tl.load(record + 1)
        valid = tl.load(record + 2)
        total = nb * (2 * NUM_LAYERS * CHUNKS)
        per_block: tl.constexpr = BS * H * DW
        lanes = tl.arange(0, BLOCK)
        for item in range(pid, total, NPROG):
            chunk = item % CHUNKS
            row = item // CHUNKS  # (layer, kv, b) as pack_triton's program id
            b = row % nb
            kv = (row // nb) % 2
            layer = row // (2 * nb)
            blk = tl.load(record + HEADER + b)
            base = tl.load(layer_addrs + layer)
            e = chunk * BLOCK + lanes
            tok = e // (H * DW)
            rem = e % (H * DW)
            head = rem // DW
            d = rem % DW
            mask = (e < per_block) & (b * BS + tok < valid)
            cache_off = kv * s_kv + blk * s_blk + tok * s_tok + head * s_head + d
            # token slot b*BS + tok, then (layer, K|V), then (head, d): pack._layer_major
            slot_off = (b * BS + tok) * packed_tok_stride + (layer * 2 + kv) * (H * DW) + rem
            if WORD_BYTES == 8:
                cache = (base + cache_off * 8).to(tl.pointer_type(tl.int64))
                extent = (extent_addr + slot_off * 8).to(tl.pointer_type(tl.int64))
            elif WORD_BYTES == 4:
                cache = (base + cache_off * 4).to(tl.pointer_type(tl.int32))
                extent = (extent_addr + slot_off * 4).to(tl.pointer_type(tl.int32))
            elif WORD_BYTES == 2:
                cache = (base + cache_off * 2).to(tl.pointer_type(tl.int16))
                extent = (extent_addr + slot_off * 2).to(tl.pointer_type(tl.int16))
            else:
                cache = (base + cache_off).to(tl.pointer_type(tl.uint8))
                extent = (extent_addr + slot_off).to(tl.pointer_type(tl.uint8))
            if TO_PACKED:
                tl.store(extent, tl.load(cache, mask=mask), mask=mask)
            else:
                tl.store(cache, tl.load(extent, mask=mask), mask=mask)
        if TO_PACKED:
            if pid == 0:  # the tag: the extent's last TAG bytes, from the record
                tag_addr = tl.load(record + 3)
                if tag_addr != 0:  # 0: the warm-up's empty record
                    at = tl.arange(0, TAG)
                    tl.store((tag_addr + at).to(tl.pointer_type(tl.uint8)),
                             tl.load(record_bytes + 8 * 4 + at))


def available(device: torch.device) -> bool:
    return (triton is not None and device.type == "cuda" and torch.cuda.is_available()
            and hasattr(torch.cuda, "CUDAGraph"))


class GraphLauncher:
    """The graphs of one worker's KV cache layers (one kernel geometry), in a ring.

    ``words``: the layers' views as integer words (``pack.TritonPlan.words``), all with
    the same strides; ``addrs``: their base addresses on the device; ``max_blocks``:
    the most blocks one call moves (the record's room). Built and captured once, at
    startup, on a side stream; each call is then a ``memmove`` into a pinned slot, one
    replay and one event record on the caller's current stream.

    The device is touched in three methods only (:meth:`_capture`, :meth:`_replay`,
    :meth:`_new_event`), so that everything else (the ring, the records, the choice to
    fall back) runs the same on a CPU under test with those three emulated."""

    def __init__(self, words: Sequence[torch.Tensor], addrs: torch.Tensor,
                 tok_stride_words: int, max_blocks: int, slots: int = SLOTS) -> None:
        first = words[0]
        self.device = first.device
        _, _, bs, heads, dw = first.shape
        self.words = tuple(words)
        self.word = first.dtype
        self.word_bytes = first.element_size()
        self.tok_stride_words = tok_stride_words
        self.max_blocks = max_blocks
        self.slots = slots
        self._addrs = addrs
        self.width = HEADER_WORDS + max_blocks
        host = torch.zeros((slots, self.width), dtype=torch.int64)
        self._host = host.pin_memory() if self.device.type == "cuda" else host
        self._host_ptr = self._host.data_ptr()
        self._events = [self._new_event() for _ in range(slots)]
        self.ring = SlotRing(slots, lambda i: self._events[i].query())
        self.replays = 0
        # calls that took the ordinary kernels instead (busy ring, more blocks than a
        # slot holds, an extent not on a word boundary): vllm:kvcached_pd_graph_fallbacks;
        # P's pack and D's unpack may count from two threads (refused)
        self.fallbacks = 0
        self._count_lock = threading.Lock()
        self._capture(bs, heads, dw, first.stride()[:4])

    def _new_event(self) -> Any:
        return torch.cuda.Event()

    def _capture(self, bs: int, heads: int, dw: int, strides: Sequence[int]) -> None:
        device = self.device
        self._dev = torch.zeros((self.slots, self.width), dtype=torch.int64, device=device)
        props = torch.cuda.get_device_properties(device)
        args = dict(NUM_LAYERS=len(self.words), H=heads, DW=dw, BS=bs,
                    WORD_BYTES=self.word_bytes, BLOCK=BLOCK,
                    CHUNKS=math.ceil(bs * heads * dw / BLOCK),
                    NPROG=props.multi_processor_count * PROGRAMS_PER_SM, HEADER=HEADER_WORDS,
                    TAG=TAG_BYTES)
        self._graphs: dict[bool, list[Any]] = {True: [], False: []}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))

        def launch(slot: int, to_packed: bool) -> None:
            _record_kernel[(math.ceil(self.width / BLOCK),)](
                self._host[slot], self._dev[slot], WIDTH=self.width, HEADER=HEADER_WORDS,
                BLOCK=BLOCK)
            _graph_copy_kernel[(args["NPROG"],)](
                self._addrs, self._dev[slot], self._dev[slot].view(torch.uint8), *strides,
                self.tok_stride_words, TO_PACKED=to_packed, num_warps=NUM_WARPS, **args)

        with torch.cuda.stream(side):
            for to_packed in (True, False):
                launch(0, to_packed)  # compiles (a record of zeros: 0 blocks, no work)
            side.synchronize()
            for slot in range(self.slots):
                for to_packed in (True, False):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        launch(slot, to_packed)
                    finally:
                        graph.capture_end()
                    self._graphs[to_packed].append(graph)
        side.synchronize()

    def _replay(self, slot: int, to_packed: bool) -> None:
        self._graphs[to_packed][slot].replay()

    def refused(self) -> None:
        """Count one call that takes the ordinary kernels instead of a graph."""
        with self._count_lock:
            self.fallbacks += 1

    def run(self, to_packed: bool, extent_addr: int, ids: array.array, valid_slots: int,
            tag_addr: int = 0, tag: bytes | None = None, started: Any = None) -> bool:
        """Queue one pack (``to_packed``) or unpack on the current stream; False, with
        nothing queued, when the ring is busy or the call is too large for a slot."""
        if len(ids) > self.max_blocks or extent_addr % self.word_bytes:
            self.refused()
            return False
        slot = self.ring.acquire()
        if slot is None:
            self.refused()
            if self.ring.busy == 1:  # once: more in flight than slots is worth knowing
                logger.info("kvcached-pd: all %d pack/unpack CUDA graph slots in flight; "
                            "calls beyond them take the ordinary kernels (same bytes, "
                            "more host time)", self.slots)
            return False
        record = encode(extent_addr, ids, valid_slots, tag_addr, tag)
        ctypes.memmove(self._host_ptr + slot * self.width * 8, record, len(record))
        stream = (torch.cuda.current_stream(self.device) if self.device.type == "cuda"
                  else None)
        if started is not None:
            started.record(stream)
        self._replay(slot, to_packed)
        self._events[slot].record(stream)
        self.replays += 1
        return True
