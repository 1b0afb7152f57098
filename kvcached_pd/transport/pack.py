"""Gather a request's KV blocks into a packed extent, and scatter an extent into blocks.

Prefill packs a finished request's blocks of every layer into one contiguous extent of
its staging buffer (:func:`pack_request`); decode pulls that extent, or only the window
of the tokens its prefix cache lacks, with one or a few large NIXL descriptors and
scatters it into its own blocks (:func:`unpack_request`). The extent is in the canonical
format of :mod:`kvcached_pd.transport.format` (token-major), so the two sides may differ
in cache layout and block size; the kernels address it through its layer-major view
(:func:`_layer_major`), the logical shape the caches' views share.

Both directions are single torch gather/scatter kernels over the strided logical views
of :mod:`kvcached_pd.transport.layout`: ``index_select`` (dim = blocks) writes straight
into the extent, ``index_copy_`` reads straight from it; nothing is staged twice. When
all layers sit at a constant stride in one storage, one kernel covers every layer
(:attr:`KVCacheLayers.stacked`); otherwise there is one kernel per layer, unless
:func:`select_kernel` proved the one-launch Triton kernels of
:mod:`kvcached_pd.transport.pack_triton` on this device (then one launch covers every
layer of a request whatever their allocations). Data are moved
as integers, so every cache dtype (fp8 included) moves bit for bit and no kernel needs a
dtype-specific instantiation; as the widest integers (up to 8 bytes) that the strides and
addresses allow, because these kernels move one element per step: on an H100 a 1 GiB
bf16 request moved at ~1.2 TB/s as 2-byte elements and ~2.9 TB/s (95% of a plain copy)
as 8-byte ones.

Kernels are enqueued on the current stream of the cache's device; ordering against the
attention kernels and the NIXL transfer is the caller's business.

Unpacking when decode's block size is larger than prefill's: decode needs
``ceil(num_tokens / bs_D)`` blocks, whose ``nb_D * bs_D`` token positions may exceed the
``src_tok_slots`` the extent holds. Positions below ``src_tok_slots`` are copied (those
at or above ``num_tokens`` carry prefill's padding); positions at or above
``src_tok_slots`` are left as they were. Either way they lie at or beyond
``num_tokens``, which decode writes before it ever reads them.
"""

from __future__ import annotations

import array
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcached_pd.transport import pack_graph, pack_triton
from kvcached_pd.transport.format import TAG_BYTES, PackedFormat, dtype_name, packed_extent_view
from kvcached_pd.transport.layout import KVCacheLayers

__all__ = [
    "BlockIds",
    "LayerViews",
    "pack_request",
    "pack_request_reference",
    "unpack_reference",
    "unpack_request",
]

LayerViews = KVCacheLayers | Sequence[torch.Tensor]
BlockIds = Sequence[int] | torch.Tensor

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDE_WORDS = (torch.int64, torch.int32, torch.int16)  # widest first


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as integers of the same width (strides unchanged)."""
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()])


def _fits_words(tensor: torch.Tensor, word: torch.dtype) -> bool:
    """Whether ``tensor.view(word)`` (a wider dtype) is valid: torch's rules, plus an
    aligned address (a misaligned wide access faults on CUDA)."""
    ratio = word.itemsize // tensor.element_size()
    return (
        tensor.stride(-1) == 1
        and tensor.shape[-1] % ratio == 0
        and all(stride % ratio == 0 for stride in tensor.stride()[:-1])
        and tensor.storage_offset() % ratio == 0
        and tensor.data_ptr() % word.itemsize == 0
    )


def _widest_word(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest integer type every tensor can be reinterpreted as (last dim narrowed)."""
    itemsize = tensors[0].element_size()
    for word in _WIDE_WORDS:
        if word.itemsize > itemsize and all(_fits_words(t, word) for t in tensors):
            return word
    return _SAME_WIDTH_INT[itemsize]


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A :func:`_host_buffer` on the cache's device, without draining the stream (it is
    pinned on CUDA)."""
    return host.to(device, non_blocking=device.type == "cuda")


def _host_buffer(ids: array.array, device: torch.device,
                 tag: bytes | None = None) -> tuple[torch.Tensor, int]:
    """``tag`` then the block ids (int64) in ONE host buffer, and where the ids start.

    Pinned for a CUDA device, so that its copy does not drain the stream (a copy from
    pageable memory would block the host until all queued work, vLLM's forward too, is
    done). One buffer, so one pinned allocation per call: before, the ids went through
    ``torch.as_tensor`` then ``pin_memory()`` and the tag through a second
    ``pin_memory()``, three host tensors per pack. The tag is ``TAG_BYTES`` (32) long,
    so the ids that follow stay 8-byte aligned for the int64 view."""
    head = tag or b""
    host = torch.frombuffer(bytearray(head + ids.tobytes()), dtype=torch.uint8)
    return (host.pin_memory() if device.type == "cuda" else host), len(head)


def _ids_view(buffer: torch.Tensor, at: int, count: int) -> torch.Tensor:
    return buffer[at: at + 8 * count].view(torch.int64)


def _record_start(started: Any, device: torch.device) -> None:
    """Record the caller's timing start event on the caches' stream: after the host
    checks, right before the first device operation (see :func:`pack_request`)."""
    if started is not None:
        started.record(torch.cuda.current_stream(device) if device.type == "cuda" else None)


def _as_layers(layer_views: LayerViews) -> KVCacheLayers:
    if isinstance(layer_views, KVCacheLayers):
        return layer_views
    return KVCacheLayers.from_views(layer_views)


def _layer_major(packed: torch.Tensor) -> torch.Tensor:
    """The token-major packed view ``(slots, L, 2, H, D)`` as ``(L, 2, slots, H, D)``
    (a permuted view, no copy): slot ``t`` of ``(layer, kv)`` at element
    ``t * L*2*H*D + (layer * 2 + kv) * H*D``, the formula :mod:`.pack_triton` uses."""
    return packed.permute(1, 2, 0, 3, 4)


def _check_layers_match_format(layers: KVCacheLayers, fmt: PackedFormat) -> None:
    """The caches are "here", ``fmt`` (usually the peer's) "at the peer" in errors."""
    _, _, _, heads, head_dim = layers.layers[0].shape
    mine = PackedFormat(
        num_layers=layers.num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype_name(layers.dtype),
        version=fmt.version,
    )
    mine.check_compatible(fmt)


def _host_block_ids(block_ids: BlockIds, num_blocks: int) -> array.array:
    """Validate block ids on the host: an out-of-range id would be a device-side
    assert on CUDA (fatal to the process), a repeated one a racy scatter.

    Plain Python over an ``array('q')`` (int64, what the kernels index with): the torch
    version (``as_tensor``, ``min``, ``max``, ``unique`` on a small CPU tensor) cost
    ~27 us per call at 1 block and ~47 us at 188 (one 3000-token request of 16-token
    blocks) on a shared CPU, the Python checks 2-26 us, and they feed the one host
    buffer the ids travel in (:func:`_host_buffer`). ``array('q')`` takes integers
    only (numpy's too): a float or a nested sequence is refused, not truncated."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1:
            raise ValueError(f"block ids must be a non-empty 1-D sequence, got shape "
                             f"{tuple(block_ids.shape)}")
        block_ids = block_ids.tolist()
    try:
        ids = array.array("q", block_ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"block ids must be a non-empty 1-D sequence of integers in "
                         f"[0, {num_blocks}): {exc}") from None
    if not ids:
        raise ValueError("block ids must be a non-empty 1-D sequence, got shape (0,)")
    low, high = min(ids), max(ids)
    if low < 0 or high >= num_blocks:
        raise ValueError(f"block ids span [{low}, {high}] but the cache has {num_blocks} blocks")
    if len(set(ids)) != len(ids):
        raise ValueError(f"block ids repeat: {ids.tolist()}")
    return ids


def pack_request(
    layer_views: LayerViews,
    block_ids: BlockIds,
    out_extent: torch.Tensor,
    fmt: PackedFormat,
    tag: bytes | None = None,
    started: Any = None,
) -> int:
    """Gather ``block_ids`` of every layer into ``out_extent``; return ``n_tok_slots``.

    ``layer_views`` are logical views (:func:`~kvcached_pd.transport.layout.logical_kv_view`)
    or a :class:`KVCacheLayers`; ``out_extent`` is a contiguous tensor on the caches'
    device of exactly ``fmt.extent_bytes(len(block_ids) * block_size)`` bytes. The
    extent holds ``n_tok_slots = len(block_ids) * block_size`` token slots per layer,
    then ``tag`` (``TAG_BYTES``; zeros when None), written after the KV on the same
    stream.

    ``started``: a CUDA event (the caller's timing start) recorded on the caches' current
    stream once every check passed, right before the first device operation, so that
    a device-time measurement leaves out the host's checks (on an idle GPU, such as
    the kvbig test model's, it counted them: ~0.5 ms of a 4 MiB pack). Nothing is
    recorded when a check fails: no device work was queued.
    """
    layers = _as_layers(layer_views)
    _check_layers_match_format(layers, fmt)
    ids = _host_block_ids(block_ids, layers.num_blocks)
    if tag is not None and len(tag) != TAG_BYTES:
        raise ValueError(f"an extent's tag is {TAG_BYTES} bytes, got {len(tag)}")
    num_blocks, block_size = len(ids), layers.block_size
    n_tok_slots = num_blocks * block_size
    packed = packed_extent_view(out_extent, fmt, n_tok_slots)
    _check_same_device(packed, layers)
    graphs = _graphs(layers, packed)
    if graphs is not None:
        flat = out_extent.reshape(-1)
        tag_addr = flat.data_ptr() + flat.numel() * flat.element_size() - TAG_BYTES
        if graphs.run(True, packed.data_ptr(), ids, n_tok_slots, tag_addr, tag, started):
            return n_tok_slots
    host, at = _host_buffer(ids, layers.device, tag)
    _record_start(started, layers.device)
    device_buffer = _on_device(host, layers.device)
    _pack_kv(layers, _ids_view(device_buffer, at, num_blocks), packed)
    _write_tag(out_extent, None if tag is None else device_buffer[:TAG_BYTES])
    return n_tok_slots


def _write_tag(extent: torch.Tensor, tag: torch.Tensor | None) -> None:
    """The extent's last ``TAG_BYTES``: ``tag`` (uint8, already on the extent's device:
    it came with the block ids, :func:`_host_buffer`), or zeros."""
    flat = extent.reshape(-1).view(torch.uint8)
    dst = flat[flat.numel() - TAG_BYTES:]
    if tag is None:
        dst.zero_()
    else:
        dst.copy_(tag)


def _pack_kv(layers: KVCacheLayers, index: torch.Tensor, packed: torch.Tensor) -> None:
    """``index``: the validated block ids, int64 on the caches' device."""
    num_blocks, block_size = index.numel(), layers.block_size
    plan = _triton_plan(layers, packed)
    if plan is not None:
        words = packed.view(plan.word)
        pack_triton.copy_blocks(plan.words, plan.addrs, index, words.reshape(-1),
                                words[0].numel(), to_packed=True)
        return
    sources = (layers.stacked,) if layers.stacked is not None else layers.layers
    word = _widest_word((packed, *sources))
    by_block = _layer_major(packed.view(word)).unflatten(2, (num_blocks, block_size))
    if layers.stacked is not None:
        torch.index_select(layers.stacked.view(word), 2, index, out=by_block)
    else:
        for layer, view in enumerate(layers.layers):
            torch.index_select(view.view(word), 1, index, out=by_block[layer])


def unpack_request(
    layer_views: LayerViews,
    block_ids: BlockIds,
    in_extent: torch.Tensor,
    fmt: PackedFormat,
    num_tokens: int,
    src_tok_slots: int,
    first_token: int = 0,
    extent_first: int = 0,
    started: Any = None,
) -> None:
    """Scatter a packed extent of ``src_tok_slots`` token slots into ``block_ids``.

    ``block_ids`` must be exactly the ``ceil((num_tokens - first_token) / block_size)``
    blocks that hold tokens ``[first_token, num_tokens)`` on this side, in token order;
    the caches' block size need not match the packing side's. ``first_token`` (a
    multiple of this side's block size) skips the prompt's first tokens: the blocks
    this side already holds from its own prefix cache, which are left untouched.
    ``in_extent`` holds token slots ``[extent_first, src_tok_slots)`` and the tag
    (:meth:`~kvcached_pd.transport.format.PackedFormat.window`): 0, the whole extent,
    or ``first_token``, the window a decode side with a prefix hit reads. See the
    module docstring for positions past ``num_tokens``. ``started``: as in
    :func:`pack_request`.
    """
    layers = _as_layers(layer_views)
    _check_layers_match_format(layers, fmt)
    if not 0 < num_tokens <= src_tok_slots:
        raise ValueError(f"num_tokens={num_tokens} must be in [1, src_tok_slots={src_tok_slots}]")
    block_size = layers.block_size
    if not 0 <= first_token < num_tokens or first_token % block_size:
        raise ValueError(f"first_token={first_token} must be a multiple of the block size "
                         f"{block_size} below num_tokens={num_tokens}")
    if not 0 <= extent_first <= first_token:
        raise ValueError(f"an extent window from slot {extent_first} does not hold "
                         f"tokens from {first_token}")
    ids = _host_block_ids(block_ids, layers.num_blocks)
    needed = math.ceil((num_tokens - first_token) / block_size)
    if len(ids) != needed:
        raise ValueError(
            f"tokens [{first_token}, {num_tokens}) fill {needed} blocks of {block_size} "
            f"tokens, got {len(ids)} block ids"
        )
    packed = packed_extent_view(in_extent, fmt, src_tok_slots, extent_first)
    _check_same_device(packed, layers)
    # Tokens from first_token on: token-major, a contiguous tail of the window (a view)
    packed = packed[first_token - extent_first:]
    src_tok_slots -= first_token
    num_tokens -= first_token
    graphs = _graphs(layers, packed)
    if graphs is not None and graphs.run(False, packed.data_ptr(), ids, src_tok_slots,
                                         started=started):
        return
    host, at = _host_buffer(ids, layers.device)
    _record_start(started, layers.device)
    plan = _triton_plan(layers, packed)
    targets = (layers.stacked,) if layers.stacked is not None else layers.layers
    word = plan.word if plan is not None else _widest_word((packed, *targets))
    flat = packed.view(word)
    packed = _layer_major(flat)

    # Blocks wholly covered by the extent go in one scatter; when this side's blocks are
    # larger than the packing side's, the last block may be covered only in part.
    full_blocks = min(needed, src_tok_slots // block_size)
    covered = full_blocks * block_size
    by_block = packed[:, :, :covered].unflatten(2, (full_blocks, block_size))
    partial_tokens = src_tok_slots - covered if full_blocks < needed else 0
    partial_block = ids[-1]
    index = _ids_view(_on_device(host, layers.device), at, full_blocks)

    if plan is not None:
        if full_blocks:
            pack_triton.copy_blocks(plan.words, plan.addrs, index, flat.reshape(-1),
                                    flat[0].numel(), to_packed=False)
        if partial_tokens:
            for layer, target in enumerate(plan.words):
                target[:, partial_block, :partial_tokens].copy_(packed[layer, :, covered:])
        return
    if layers.stacked is not None:
        stacked = layers.stacked.view(word)
        if full_blocks:
            stacked.index_copy_(2, index, by_block)
        if partial_tokens:
            stacked[:, :, partial_block, :partial_tokens].copy_(packed[:, :, covered:])
        return
    for layer, view in enumerate(layers.layers):
        target = view.view(word)
        if full_blocks:
            target.index_copy_(1, index, by_block[layer])
        if partial_tokens:
            target[:, partial_block, :partial_tokens].copy_(packed[layer, :, covered:])


# ---- the one-launch Triton kernels (pack_triton), once proven on this device ----------
PLAN_ATTR = "_kvcached_pd_triton_plan"
GRAPHS_ATTR = "_kvcached_pd_graphs"


def _graphs(layers: KVCacheLayers, packed: torch.Tensor) -> pack_graph.GraphLauncher | None:
    """The layers' CUDA graphs, if :func:`select_kernel` installed them and this extent
    can be moved as their words (extents are 4 KiB-aligned in staging, so it can)."""
    graphs = getattr(layers, GRAPHS_ATTR, None)
    if graphs is None:
        return None
    if not _fits_words(packed, graphs.word):
        graphs.refused()
        return None
    return graphs


def graph_fallbacks(layers: KVCacheLayers) -> int:
    """Pack and unpack calls that took the ordinary kernels though the layers' CUDA
    graphs are installed (0 without graphs): a busy ring under load is not an error,
    the same bytes move, but each such call costs the host 0.2-0.4 ms more."""
    graphs = getattr(layers, GRAPHS_ATTR, None)
    return 0 if graphs is None else graphs.fallbacks


@dataclass(frozen=True)
class TritonPlan:
    word: torch.dtype
    words: tuple[torch.Tensor, ...]  # the layers' views as ``word``
    addrs: torch.Tensor  # int64 base address per layer, on the device


def _triton_plan(layers: KVCacheLayers, packed: torch.Tensor) -> TritonPlan | None:
    """The layers' Triton plan, if :func:`select_kernel` enabled one and this extent can
    be moved as the same words (extents are 4 KiB-aligned in staging, so it can)."""
    plan = getattr(layers, PLAN_ATTR, None)
    if plan is None or not _fits_words(packed, plan.word):
        return None
    return plan


def _build_plan(layers: KVCacheLayers) -> TritonPlan | None:
    word = _widest_word(layers.layers)
    words = tuple(view.view(word) for view in layers.layers)
    addrs = pack_triton.layer_addresses(words)
    return None if addrs is None else TritonPlan(word=word, words=words, addrs=addrs)


def _like(view: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A small ordinary tensor with ``view``'s shape but ``num_blocks`` blocks, laid out
    in the same physical dimension order (so its strides follow the same pattern)."""
    shape = list(view.shape)
    shape[1] = num_blocks
    order = sorted(range(view.dim()), key=lambda d: view.stride(d), reverse=True)
    buf = torch.empty([shape[d] for d in order], dtype=view.dtype, device=view.device)
    return buf.permute([order.index(d) for d in range(view.dim())])


SELF_CHECK_MAX_BYTES = 256 << 20


def _miniature(layers: KVCacheLayers, num_blocks: int) -> list[torch.Tensor] | None:
    """Layers in one small buffer with the real layers' strides and layer stride, when
    they share one storage (kvcached's contiguous layout, vLLM's cross-layer one): there
    a block's stride spans every layer's block, which ``_like`` would not reproduce.
    None when they do not share storage or the miniature would be too large."""
    if layers.stacked is None:
        return None
    first = layers.layers[0]
    layer_stride = layers.stacked.stride(0)
    shape = list(first.shape)
    shape[1] = num_blocks
    span = 1 + sum((n - 1) * st for n, st in zip(shape, first.stride()))
    numel = (layers.num_layers - 1) * layer_stride + span
    if numel * first.element_size() > SELF_CHECK_MAX_BYTES:
        return None
    buf = torch.empty(numel, dtype=first.dtype, device=first.device)
    return [torch.as_strided(buf, shape, first.stride(), layer * layer_stride)
            for layer in range(layers.num_layers)]


def _graph_launcher(plan: TritonPlan, fmt: PackedFormat, max_blocks: int,
                    slots: int = pack_graph.SLOTS) -> pack_graph.GraphLauncher | None:
    """The graphs of ``plan``'s layers; None when a token slot is not whole words."""
    if fmt.bytes_per_token_all_layers % plan.word.itemsize:
        return None
    return pack_graph.GraphLauncher(plan.words, plan.addrs,
                                    fmt.bytes_per_token_all_layers // plan.word.itemsize,
                                    max_blocks, slots)


def self_check(layers: KVCacheLayers, fmt: PackedFormat, num_blocks: int = 6,
               graphs: bool = False) -> str | None:
    """Pack and unpack synthetic layers of this geometry with torch and with the
    candidate (the one-launch Triton kernels, or with ``graphs`` their CUDA graphs) and
    compare bytes. Returns None when they agree, else what differed. Layers sharing one
    storage are checked on a miniature with their very strides."""
    views = _miniature(layers, num_blocks) or [_like(view, num_blocks) for view in layers.layers]
    for view in views:
        _as_bits(view).copy_(torch.randint(-(2**15), 2**15, view.shape, device=view.device,
                                           dtype=torch.int32).to(_as_bits(view).dtype))
    reference = KVCacheLayers.from_views(views, stack=False)
    candidate = KVCacheLayers.from_views(views, stack=False)
    plan = _build_plan(candidate)
    if plan is None:
        return "the layers do not share strides"
    launcher = None
    if graphs:
        launcher = _graph_launcher(plan, fmt, num_blocks, slots=4)
        if launcher is None:
            return "a token slot of the extent is not whole words"
        object.__setattr__(candidate, GRAPHS_ATTR, launcher)
    else:
        object.__setattr__(candidate, PLAN_ATTR, plan)
    ids = [num_blocks - 2, 0, num_blocks - 1, 2]
    slots = len(ids) * layers.block_size
    extents = [torch.empty(fmt.extent_bytes(slots), dtype=torch.uint8, device=layers.device)
               for _ in range(2)]
    probe = packed_extent_view(extents[1], fmt, slots)
    if (_graphs(candidate, probe) if graphs else _triton_plan(candidate, probe)) is None:
        return "the extent cannot be moved as the layers' words"  # never pass vacuously
    pack_request(reference, ids, extents[0], fmt, tag=bytes(range(TAG_BYTES)))
    pack_request(candidate, ids, extents[1], fmt, tag=bytes(range(TAG_BYTES)))
    if not torch.equal(extents[0], extents[1]):
        return "packed extents differ"
    # the whole extent; the window of a decode side holding the first block; and an
    # extent whose slots end inside this side's last block, as from a peer of smaller
    # blocks (its bytes need not come from a pack: both paths scatter the same ones)
    bs = layers.block_size
    start, _ = fmt.window(slots, bs)
    cases = [(0, extents[0], slots, slots - 3, "tokens from 0")]
    if slots - 3 > bs:
        cases.append((bs, extents[0][start:], slots, slots - 3, f"tokens from {bs}"))
    if bs > 1:
        short = slots - bs // 2
        noise = torch.randint(0, 256, (fmt.extent_bytes(short),), dtype=torch.uint8,
                              device=layers.device)
        cases.append((0, noise, short, short - 1, "a last block partly covered"))
    for first, src, src_slots, num_tokens, what in cases:
        ids = [1, 3, 4, 5][first // bs: math.ceil(num_tokens / bs)]
        targets = []
        for layer_set in (reference, candidate):
            for view in layer_set.layers:
                _as_bits(view).zero_()
            unpack_request(layer_set, ids, src, fmt, num_tokens, src_slots, first, first)
            targets.append(torch.cat([_as_bits(v).flatten() for v in layer_set.layers]))
        if not torch.equal(targets[0], targets[1]):
            return f"unpacked blocks differ ({what})"
    if launcher is not None and launcher.replays != 1 + len(cases):
        # a busy slot would have sent a call down the torch path: compared with itself
        return f"{launcher.replays} of {1 + len(cases)} calls ran as graphs"
    return None


def select_kernel(layers: KVCacheLayers, fmt: PackedFormat, preference: str = "auto",
                  max_blocks: int = pack_graph.MAX_BLOCKS_CAP) -> str:
    """Choose the pack/unpack kernels of ``layers`` for the life of the worker.

    ``torch``: torch index ops (one launch per layer unless the layers stack);
    ``triton``: one launch for all layers, required (an error if it cannot be used);
    ``graph``: that kernel in CUDA graphs (:mod:`.pack_graph`), required; a call it
    cannot take (more than ``max_blocks`` blocks, every slot in flight) runs as
    ``auto`` would without graphs;
    ``auto``: the graphs when Triton is available and their device self-check passes;
    else Triton when the layers do not stack and its self-check passes; else torch.
    Returns a description for the startup log.
    """
    if preference == "torch":
        return "torch index ops (KVCACHED_PD_PACK_KERNEL=torch)"
    graph_reason = None
    if preference in ("auto", "graph"):
        t0 = time.perf_counter()
        graph_reason = _install_graphs(layers, fmt, max_blocks)
        if graph_reason is None:
            rest = ("torch index ops, one launch for all layers" if layers.stacked is not None
                    else "torch index ops")
            return (f"CUDA graphs of one Triton kernel for all {layers.num_layers} layers "
                    f"(self-check passed, set up in {time.perf_counter() - t0:.2f} s; "
                    f"{pack_graph.SLOTS} in flight, up to "
                    f"{getattr(layers, GRAPHS_ATTR).max_blocks} blocks a call; beyond: "
                    f"{rest})")
        if preference == "graph":
            raise RuntimeError(f"kvcached-pd: KVCACHED_PD_PACK_KERNEL=graph but {graph_reason}")
    if layers.stacked is not None and preference == "auto":
        return (f"torch index ops, one launch for all layers (they share one storage; "
                f"CUDA graphs not used: {graph_reason})")
    if not pack_triton.available(layers.device):
        reason = "Triton or a CUDA device is not available"
    else:
        plan = _build_plan(layers)
        reason = "the layers do not share strides" if plan is None else self_check(layers, fmt)
        if reason is None:
            object.__setattr__(layers, PLAN_ATTR, plan)
            return f"Triton, one launch for all {layers.num_layers} layers (self-check passed)"
    if preference == "triton":
        raise RuntimeError(f"kvcached-pd: KVCACHED_PD_PACK_KERNEL=triton but {reason}")
    return (f"torch index ops, one launch per layer (CUDA graphs not used: {graph_reason}; "
            f"Triton not used: {reason})")


def _install_graphs(layers: KVCacheLayers, fmt: PackedFormat, max_blocks: int) -> str | None:
    """Prove the graphs on a miniature of ``layers``, then capture ``layers``' own:
    None when installed, else why not (the caller falls back or stops)."""
    if not pack_graph.available(layers.device):
        return "Triton, CUDA graphs or a CUDA device is not available"
    plan = _build_plan(layers)
    if plan is None:
        return "the layers do not share strides"
    try:
        reason = self_check(layers, fmt, graphs=True)
        if reason is None:
            launcher = _graph_launcher(plan, fmt, max(1, min(max_blocks,
                                                             pack_graph.MAX_BLOCKS_CAP)))
            if launcher is None:
                return "a token slot of the extent is not whole words"
            object.__setattr__(layers, GRAPHS_ATTR, launcher)
    except Exception as exc:  # noqa: BLE001 - a capture this device refuses: not used
        reason = f"capturing them raised {type(exc).__name__}: {exc}"
    return reason


def _check_same_device(packed: torch.Tensor, layers: KVCacheLayers) -> None:
    if packed.device != layers.device:
        raise ValueError(f"extent is on {packed.device} but the KV cache on {layers.device}")


def pack_request_reference(
    layer_views: LayerViews, block_ids: Sequence[int], fmt: PackedFormat
) -> torch.Tensor:
    """Token-by-token Python loop of :func:`pack_request` (zero tag); returns a new
    ``uint8`` extent. For tests only."""
    layers = _as_layers(layer_views)
    ids = [int(block_id) for block_id in block_ids]
    block_size = layers.block_size
    n_tok_slots = len(ids) * block_size
    extent = torch.empty(fmt.extent_bytes(n_tok_slots), dtype=torch.uint8, device=layers.device)
    _write_tag(extent, None)
    packed = _as_bits(packed_extent_view(extent, fmt, n_tok_slots))
    for layer, view in enumerate(layers.layers):
        bits = _as_bits(view)
        for kv in range(2):
            for slot in range(n_tok_slots):
                packed[slot, layer, kv] = bits[kv, ids[slot // block_size], slot % block_size]
    return extent


def unpack_reference(
    layer_views: LayerViews,
    block_ids: Sequence[int],
    in_extent: torch.Tensor,
    fmt: PackedFormat,
    num_tokens: int,
    src_tok_slots: int,
    first_token: int = 0,
    extent_first: int = 0,
) -> None:
    """Token-by-token Python loop of :func:`unpack_request` (same positions written).
    For tests only."""
    layers = _as_layers(layer_views)
    ids = [int(block_id) for block_id in block_ids]
    block_size = layers.block_size
    if len(ids) != math.ceil((num_tokens - first_token) / block_size):
        raise ValueError(f"{len(ids)} block ids do not hold tokens [{first_token}, {num_tokens})")
    packed = _as_bits(packed_extent_view(in_extent, fmt, src_tok_slots, extent_first))
    written = min(len(ids) * block_size, src_tok_slots - first_token)
    for layer, view in enumerate(layers.layers):
        bits = _as_bits(view)
        for kv in range(2):
            for token in range(written):
                bits[kv, ids[token // block_size], token % block_size] = (
                    packed[first_token - extent_first + token, layer, kv])
