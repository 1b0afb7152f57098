"""Byte ranges of strided KV cache views, and narrowing them to the physical budget.

kvcached's tensors are views over a virtual reservation larger than the memory vLLM
may use; the block dimension counts *virtual* blocks. The budget vLLM's scheduler
hands out block ids from is ``kv_cache_config.num_blocks`` (times the kernel-block
ratio), and only those blocks can ever hold KV. These helpers compute which bytes a
view really covers, so registration can cover exactly those and nothing else.

Only tensor metadata is read (shape, stride, data_ptr); no data is touched.
"""

from __future__ import annotations

from typing import Any

Span = tuple[int, int]  # [start, end) in bytes


def byte_span(t: Any) -> Span:
    """Smallest [start, end) holding every element of ``t`` (non-negative strides)."""
    if t.numel() == 0:
        return (int(t.data_ptr()), int(t.data_ptr()))
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = int(t.data_ptr())
    return (start, start + (last + 1) * t.element_size())


def physical_spans(t: Any) -> list[Span]:
    """The separate memory runs of a view, split where a dimension jumps a gap.

    kvcached's split-half layout puts all K blocks in one run and all V blocks in
    another far away (``stride`` of the K/V dim = the V offset); this returns both
    runs instead of one span over the unused gap between them.
    """
    start, end = byte_span(t)
    for dim in sorted(range(t.dim()), key=lambda d: -t.stride(d)):
        if t.shape[dim] <= 1:
            continue
        first = t.select(dim, 0)
        first_start, first_end = byte_span(first)
        step = t.stride(dim) * t.element_size()
        if step > first_end - first_start:  # a gap between consecutive slices
            spans: list[Span] = []
            for i in range(t.shape[dim]):
                spans.extend(physical_spans(t.select(dim, i)))
            return merge_spans(spans)
    return [(start, end)]


def merge_spans(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def within(span: Span, allowed: list[Span]) -> bool:
    return any(a <= span[0] and span[1] <= b for a, b in allowed)


def clip_to(span: Span, allowed: list[Span]) -> list[Span]:
    """Pieces of ``span`` that lie inside ``allowed``."""
    out = []
    for a, b in allowed:
        s, e = max(span[0], a), min(span[1], b)
        if s < e:
            out.append((s, e))
    return out


def overlaps(span: Span, others: list[Span]) -> bool:
    return any(span[0] < b and a < span[1] for a, b in others)


def descriptor_extents(descs: Any):
    """``(starts, ends, blocks)`` of a plain NIXL transfer-descriptor list, as numpy
    uint64 arrays, one entry per row.

    Two forms exist: per-block rows ``(addr, len, dev)`` (a list of tuples or an Nx3
    array; vLLM up to 0.32 builds these and passes them through ``get_xfer_descs``), and
    vLLM 0.33's Nx5 strided rows ``(addr, len, dev, stride, count)`` handed straight to
    ``prep_xfer_dlist``: ``count`` blocks of ``len`` bytes, ``stride`` apart. A strided
    row covers ``addr .. addr + (count - 1) x stride + len`` (nothing where ``count`` is
    0) and describes ``count`` blocks, so a check that requires every row to lie inside
    the allowed bytes is exactly as strict for both forms, and counts blocks alike."""
    import numpy as np

    if hasattr(descs, "shape"):
        arr = np.asarray(descs, dtype=np.uint64)
    else:
        arr = np.asarray([tuple(r)[:3] for r in descs], dtype=np.uint64)
    if arr.size == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    arr = arr.reshape(len(arr), -1)
    starts, lengths = arr[:, 0], arr[:, 1]
    if arr.shape[1] == 5:
        stride, count = arr[:, 3], arr[:, 4]
        last = np.where(count > 0, count - 1, 0) * stride
        ends = np.where(count > 0, starts + last + lengths, starts)
        return starts, ends, count
    return starts, starts + lengths, np.ones(len(arr), dtype=np.uint64)
