"""One Triton kernel launch per pack or unpack, across every layer.

The torch path of :mod:`kvcached_pd.transport.pack` needs one ``index_select`` /
``index_copy_`` per layer when the layers live in separate allocations (vLLM's own
tensors and kvcached's per-layer reservations both do). On the 2xH200 host that loop
cost ~1 ms per request for 32 layers whatever the size (host-side dispatch, with the
device idle in between), which dominated the handoff below ~256 MiB.

Here every layer's logical view is described by its base address and one set of
strides shared by all layers, and a single kernel copies block ``b`` of ``(layer, K|V)``
between the cache and the packed extent, reading the block id from a device table.
Same canonical format, same words (8-byte integers where the views allow it), so the
result is bit-identical to the torch path; :func:`self_check` proves that on the
device at startup before the kernels are used, and any failure leaves the torch path
in charge (see :func:`kvcached_pd.transport.pack.select_kernel`).

Only the layers' shape/strides matter to correctness, never their contents, so the
check runs on small ordinary tensors with the same geometry: kvcached's cache pages are
mapped on demand and must not be touched outside the blocks vLLM hands out.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds and some hosts lack it
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None
    tl = None

BLOCK = 1024  # words per program

if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(
        layer_addrs,  # int64[L]: byte address of each layer's view element [0, 0, 0, 0, 0]
        block_ids,  # int64[nb]: this side's block of packed block slot b
        packed,  # the extent (token-major, packed format 3), as words
        nb,  # blocks copied per (layer, K|V)
        packed_tok_stride,  # words per token slot (all layers' K and V) in the extent
        s_kv, s_blk, s_tok, s_head,  # the views' strides, in words (last dim stride 1)
        H: tl.constexpr, DW: tl.constexpr, BS: tl.constexpr,
        WORD_BYTES: tl.constexpr, TO_PACKED: tl.constexpr, BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)  # (layer, kv, b)
        chunk = tl.program_id(1)
        b = pid % nb
        kv = (pid // nb) % 2
        layer = pid // (2 * nb)
        blk = tl.load(block_ids + b).to(tl.int64)
        base = tl.load(layer_addrs + layer)
        e = chunk * BLOCK + tl.arange(0, BLOCK)
        per_block: tl.constexpr = BS * H * DW
        mask = e < per_block
        tok = e // (H * DW)
        rem = e % (H * DW)
        head = rem // DW
        d = rem % DW
        cache_off = kv * s_kv + blk * s_blk + tok * s_tok + head * s_head + d
        if WORD_BYTES == 8:
            cache = (base + cache_off * 8).to(tl.pointer_type(tl.int64))
        elif WORD_BYTES == 4:
            cache = (base + cache_off * 4).to(tl.pointer_type(tl.int32))
        elif WORD_BYTES == 2:
            cache = (base + cache_off * 2).to(tl.pointer_type(tl.int16))
        else:
            cache = (base + cache_off).to(tl.pointer_type(tl.uint8))
        # token slot b*BS + tok, then (layer, K|V), then (head, d): the torch path's
        # pack._layer_major view, element [layer, kv, slot, head, d]
        extent = (packed + (b * BS + tok) * packed_tok_stride + (layer * 2 + kv) * (H * DW)
                  + rem)
        if TO_PACKED:
            tl.store(extent, tl.load(cache, mask=mask), mask=mask)
        else:
            tl.store(cache, tl.load(extent, mask=mask), mask=mask)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda" and torch.cuda.is_available()


def layer_addresses(views: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The device table of the layers' base addresses, or None when the layers' strides
    differ (the kernel takes one set of strides; only the torch path serves them)."""
    first = views[0]
    if any(v.stride() != first.stride() for v in views) or first.stride(-1) != 1:
        return None
    return torch.tensor([v.data_ptr() for v in views], dtype=torch.int64).to(first.device)


def copy_blocks(
    words: tuple[torch.Tensor, ...],
    addrs: torch.Tensor,
    index: torch.Tensor,
    packed_words: torch.Tensor,
    packed_tok_stride: int,
    to_packed: bool,
) -> None:
    """Copy ``index``'s blocks of every layer between ``words`` (the layers' views as
    words, shape ``(2, N, bs, H, DW)``) and ``packed_words`` (a flat token-major extent,
    or its window from the first token moved, ``packed_tok_stride`` words a slot)."""
    first = words[0]
    _, _, bs, heads, dw = first.shape
    s_kv, s_blk, s_tok, s_head = first.stride()[:4]
    nb = index.numel()
    grid = (len(words) * 2 * nb, triton.cdiv(bs * heads * dw, BLOCK))
    _copy_blocks_kernel[grid](
        addrs, index, packed_words, nb, packed_tok_stride, s_kv, s_blk, s_tok, s_head,
        H=heads, DW=dw, BS=bs, WORD_BYTES=first.element_size(), TO_PACKED=to_packed,
        BLOCK=BLOCK,
    )
