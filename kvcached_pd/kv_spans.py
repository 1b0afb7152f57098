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
