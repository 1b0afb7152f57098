"""Prefill cache -> packed extent -> decode cache, across layouts, block sizes, dtypes.

Every round trip checks, bit for bit:
- the packed extent equals the token-by-token reference and the same with and without
  the single-view fast path;
- decode's raw buffers after unpacking equal the reference's, with and without the fast
  path (so nothing outside the request's token positions was written, gaps included);
- decode holds prefill's tokens [0, num_tokens) at the right blocks and offsets;
- decode blocks outside the request keep their poison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached_pd.transport.format import PackedFormat, PackedFormatMismatch
from kvcached_pd.transport.layout import KVCacheLayers
from kvcached_pd.transport.pack import (
    pack_request,
    pack_request_reference,
    unpack_reference,
    unpack_request,
)
from tests.transport.kv_cache_builders import (
    LAYOUTS,
    LAYOUTS_BY_NAME,
    CacheLayout,
    Geometry,
    bits,
    fill_random_bits,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@dataclass(frozen=True)
class Side:
    """One worker's caches: a layout, a block size and the virtual block count."""

    layout: CacheLayout
    block_size: int
    num_blocks: int

    def geometry(self, num_layers: int, heads: int, head_dim: int) -> Geometry:
        return Geometry(num_layers, self.num_blocks, self.block_size, heads, head_dim)


def round_trip(
    prefill: Side,
    decode: Side,
    *,
    num_tokens: int,
    num_layers: int = 2,
    heads: int = 2,
    head_dim: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cpu",
    cached_decode_blocks: int = 0,
) -> None:
    """P packs, D unpacks. D already holds its first ``cached_decode_blocks`` blocks
    (its own prefix cache): those, like every block outside the request, stay as they
    were, and only tokens from ``first_token`` on are written. D then unpacks the same
    from the extent's window alone (:meth:`PackedFormat.window`: what it READs), as a
    tensor of its own: the tokens it lacks lie in that one byte range."""
    generator = torch.Generator().manual_seed(seed)
    fmt = PackedFormat.for_cache(num_layers, heads, head_dim, dtype)

    g_p = prefill.geometry(num_layers, heads, head_dim)
    p_buffers = prefill.layout.new_buffers(g_p, dtype, device)
    fill_random_bits(p_buffers, generator)
    p_views = prefill.layout.logical_views(p_buffers, g_p)
    p_blocks = math.ceil(num_tokens / prefill.block_size)
    p_ids = torch.randperm(prefill.num_blocks, generator=generator)[:p_blocks].tolist()

    src_tok_slots = p_blocks * prefill.block_size
    extents = {}
    for stack in (True, False):
        extent = torch.empty(fmt.extent_bytes(src_tok_slots), dtype=torch.uint8, device=device)
        fill_random_bits([extent], generator)  # pack must overwrite every byte
        layers = KVCacheLayers.from_views(p_views, stack=stack)
        assert (layers.stacked is not None) == (
            stack and prefill.layout.cross_layer and num_layers > 1
        )
        assert pack_request(layers, p_ids, extent, fmt) == src_tok_slots
        extents[stack] = extent
    reference_extent = pack_request_reference(p_views, p_ids, fmt)
    assert torch.equal(extents[True], reference_extent)
    assert torch.equal(extents[False], reference_extent)

    g_d = decode.geometry(num_layers, heads, head_dim)
    poisoned = decode.layout.new_buffers(g_d, dtype, device)
    fill_random_bits(poisoned, generator)
    d_blocks = math.ceil(num_tokens / decode.block_size)
    d_ids = torch.randperm(decode.num_blocks, generator=generator)[:d_blocks].tolist()
    assert 0 <= cached_decode_blocks < d_blocks
    first_token = cached_decode_blocks * decode.block_size
    d_received = d_ids[cached_decode_blocks:]

    expected = [buffer.clone() for buffer in poisoned]
    unpack_reference(
        decode.layout.logical_views(expected, g_d),
        d_received,
        reference_extent,
        fmt,
        num_tokens,
        src_tok_slots,
        first_token,
    )
    start, _ = fmt.window(src_tok_slots, first_token)
    for stack in (True, False):
        sources = [(extents[stack], 0)]
        if first_token:
            sources.append((extents[stack][start:].clone(), first_token))
        for source, extent_first in sources:
            actual = [buffer.clone() for buffer in poisoned]
            layers = KVCacheLayers.from_views(decode.layout.logical_views(actual, g_d),
                                              stack=stack)
            unpack_request(layers, d_received, source, fmt, num_tokens, src_tok_slots,
                           first_token, extent_first)
            for got, want in zip(actual, expected):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

    # Semantics, independent of the reference implementations.
    d_views = decode.layout.logical_views(expected, g_d)
    before = decode.layout.logical_views(poisoned, g_d)
    tokens = torch.arange(first_token, num_tokens)
    p_block = torch.tensor(p_ids)[tokens // prefill.block_size]
    d_block = torch.tensor(d_ids)[tokens // decode.block_size]
    untouched = torch.ones(decode.num_blocks, dtype=torch.bool)
    untouched[d_received] = False
    for p_view, d_view, old in zip(p_views, d_views, before):
        sent = p_view[:, p_block.to(device), (tokens % prefill.block_size).to(device)]
        received = d_view[:, d_block.to(device), (tokens % decode.block_size).to(device)]
        assert torch.equal(bits(received), bits(sent))
        assert torch.equal(
            bits(d_view[:, untouched.to(device)]), bits(old[:, untouched.to(device)])
        )


LAYOUT_NAMES = [layout.name for layout in LAYOUTS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode_layout", LAYOUT_NAMES)
@pytest.mark.parametrize("prefill_layout", LAYOUT_NAMES)
def test_every_layout_pair(prefill_layout: str, decode_layout: str, device: str) -> None:
    round_trip(
        Side(LAYOUTS_BY_NAME[prefill_layout], block_size=16, num_blocks=9),
        Side(LAYOUTS_BY_NAME[decode_layout], block_size=32, num_blocks=6),
        num_tokens=45,
        device=device,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "prefill_bs, decode_bs, num_tokens",
    [
        (16, 32, 100),  # decode's last block only partly covered by the extent
        (16, 32, 96),  # ... exactly covered
        (32, 16, 77),
        (16, 16, 50),
        (16, 16, 48),  # a multiple of the block size: no ragged block
        (64, 16, 130),
        (16, 64, 17),  # one decode block, mostly beyond the extent
        (16, 64, 1),
    ],
)
@pytest.mark.parametrize(
    "prefill_layout, decode_layout",
    [
        ("kv_first_split_half", "packed_nhd"),
        ("packed_hnd", "blocks_first_kvcached_contiguous"),
        ("packed_cross_layer_nhd", "kv_first_kvcached_contiguous"),
    ],
)
def test_block_size_pairs(prefill_layout, decode_layout, prefill_bs, decode_bs, num_tokens, device):
    round_trip(
        Side(
            LAYOUTS_BY_NAME[prefill_layout],
            prefill_bs,
            num_blocks=3 * math.ceil(num_tokens / prefill_bs),
        ),
        Side(
            LAYOUTS_BY_NAME[decode_layout],
            decode_bs,
            num_blocks=2 * math.ceil(num_tokens / decode_bs) + 1,
        ),
        num_tokens=num_tokens,
        num_layers=3,
        device=device,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "prefill_layout, decode_layout",
    [("blocks_first_split_half", "packed_hnd"), ("packed_cross_layer_nhd", "kv_first_hnd")],
)
def test_dtypes(prefill_layout, decode_layout, dtype, device) -> None:
    round_trip(
        Side(LAYOUTS_BY_NAME[prefill_layout], 16, num_blocks=12),
        Side(LAYOUTS_BY_NAME[decode_layout], 32, num_blocks=5),
        num_tokens=70,
        dtype=dtype,
        device=device,
    )


@settings(max_examples=200, deadline=None)
@given(
    prefill_layout=st.sampled_from(LAYOUTS),
    decode_layout=st.sampled_from(LAYOUTS),
    prefill_bs=st.sampled_from([16, 32, 64]),
    decode_bs=st.sampled_from([16, 32, 64]),
    num_tokens=st.integers(1, 200),
    spare_prefill_blocks=st.integers(0, 5),
    spare_decode_blocks=st.integers(0, 5),
    num_layers=st.integers(1, 3),
    heads=st.integers(1, 2),
    head_dim=st.sampled_from([1, 2, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
    cached_decode_blocks=st.integers(0, 3),
)
def test_round_trip_property(
    prefill_layout,
    decode_layout,
    prefill_bs,
    decode_bs,
    num_tokens,
    spare_prefill_blocks,
    spare_decode_blocks,
    num_layers,
    heads,
    head_dim,
    dtype,
    seed,
    cached_decode_blocks,
) -> None:
    # At least 3 blocks: a (2, 2, ...) cache is ambiguous without a hint (tested apart).
    round_trip(
        Side(
            prefill_layout,
            prefill_bs,
            max(3, math.ceil(num_tokens / prefill_bs) + spare_prefill_blocks),
        ),
        Side(
            decode_layout,
            decode_bs,
            max(3, math.ceil(num_tokens / decode_bs) + spare_decode_blocks),
        ),
        num_tokens=num_tokens,
        num_layers=num_layers,
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
        cached_decode_blocks=min(cached_decode_blocks, math.ceil(num_tokens / decode_bs) - 1),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "prefill_bs, decode_bs, num_tokens, cached",
    [(16, 16, 75, 2), (16, 32, 75, 1), (32, 16, 77, 3), (16, 16, 48, 2)],
)
def test_decode_prefix_cache_hit_keeps_its_blocks(prefill_bs, decode_bs, num_tokens, cached, device):
    """D holds the prompt's first blocks from its own prefix cache: the extent's tokens
    from there on go to the blocks D allocated for the rest, as vLLM's direct path
    (which READs only P's last blocks) would leave them."""
    round_trip(
        Side(LAYOUTS_BY_NAME["packed_nhd"], prefill_bs, num_blocks=12),
        Side(LAYOUTS_BY_NAME["kv_first_kvcached_contiguous"], decode_bs, num_blocks=12),
        num_tokens=num_tokens,
        num_layers=3,
        device=device,
        cached_decode_blocks=cached,
    )


def test_a_token_suffix_is_the_extents_tail() -> None:
    """Token-major (format 3): the window from any token slot is the extent's tail, tag
    included; every byte before it belongs to earlier tokens only. A layer-major extent
    (format 2) kept tokens of every layer apart, so no tail held a suffix."""
    g = Geometry(num_layers=3, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=4)
    layout = LAYOUTS_BY_NAME["kv_first_split_half"]
    fmt = PackedFormat.for_cache(3, 2, 4, torch.float16)
    buffers = layout.new_buffers(g, torch.float16)
    views = layout.logical_views(buffers, g)
    for view in views:  # every element holds its token's index
        view.copy_(torch.arange(4 * 4, dtype=torch.float16).view(1, 4, 4, 1, 1).expand_as(view))
    extent = pack_request_reference(views, [0, 1, 2, 3], fmt)
    for first in (0, 1, 5, 15):
        start, nbytes = fmt.window(16, first)
        assert start + nbytes == extent.numel()
        kv = extent[:extent.numel() - 32].view(torch.float16)
        split = start // 2
        assert kv[split:].unique().tolist() == list(range(first, 16))
        assert kv[:split].unique().tolist() == list(range(first))


def test_unpack_refuses_a_window_that_starts_after_its_first_token() -> None:
    views = _views()
    start, _ = FMT.window(48, 32)
    with pytest.raises(ValueError, match="window from slot 32 does not hold tokens from 16"):
        unpack_request(views, [1, 2], _extent(48)[start:], FMT, 40, 48, 16, 32)
    with pytest.raises(ValueError, match=r"token slots \[16, 48\)"):
        unpack_request(views, [1, 2], _extent(48)[start:], FMT, 40, 48, 16, 16)
    assert all(bool((view == 1.0).all()) for view in views)


def test_unpack_refuses_a_first_token_off_the_block_grid() -> None:
    views = _views()
    with pytest.raises(ValueError, match="first_token=8 must be a multiple of the block size 16"):
        unpack_request(views, [1, 2], _extent(48), FMT, 40, 48, first_token=8)
    with pytest.raises(ValueError, match=r"tokens \[16, 40\) fill 2 blocks of 16 tokens, got 3"):
        unpack_request(views, [1, 2, 3], _extent(48), FMT, 40, 48, first_token=16)
    assert all(bool((view == 1.0).all()) for view in views)


# Refusals: each names what is wrong and leaves the cache alone.

G = Geometry(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=4)
LAYOUT = LAYOUTS_BY_NAME["kv_first_split_half"]
FMT = PackedFormat.for_cache(2, 2, 4, torch.float16)


def _views() -> list[torch.Tensor]:
    buffers = LAYOUT.new_buffers(G, torch.float16)
    for buffer in buffers:
        buffer.fill_(1.0)
    return LAYOUT.logical_views(buffers, G)


def _extent(slots: int) -> torch.Tensor:
    return torch.zeros(FMT.extent_bytes(slots), dtype=torch.uint8)


@pytest.mark.parametrize(
    "block_ids, message",
    [
        ([0, 8], r"span \[0, 8\] but the cache has 8 blocks"),
        ([-1, 2], r"span \[-1, 2\]"),
        ([3, 3], "repeat"),
        ([], "non-empty"),
        ([1.5, 2], "integers"),  # torch.as_tensor used to truncate it to block 1
        ([[1, 2]], "integers"),
        (torch.tensor([[1, 2]]), "1-D"),
        (torch.tensor([2, 2]), "repeat"),
    ],
)
def test_bad_block_ids_are_refused(block_ids, message) -> None:
    with pytest.raises(ValueError, match=message):
        pack_request(_views(), block_ids, _extent(max(len(block_ids), 1) * 16), FMT)
    with pytest.raises(ValueError, match=message):
        unpack_request(_views(), block_ids, _extent(32), FMT, 20, 32)


def test_block_ids_may_come_as_a_tensor_or_numpy_integers() -> None:
    np = pytest.importorskip("numpy")
    views = _views()
    for view in views:
        view[:, 5].fill_(2.0)
    extents = [_extent(16) for _ in range(3)]
    pack_request(views, [5], extents[0], FMT)
    pack_request(views, torch.tensor([5]), extents[1], FMT)
    pack_request(views, [np.int64(5)], extents[2], FMT)
    assert torch.equal(extents[0], extents[1]) and torch.equal(extents[0], extents[2])
    assert not torch.equal(extents[0], _extent(16))


class _StartEvent:
    """Stands in for the caller's CUDA timing event: what the extent and caches held
    when it was recorded."""

    def __init__(self, *watched: torch.Tensor) -> None:
        self.watched = watched
        self.seen: list[list[torch.Tensor]] = []

    def record(self, stream=None) -> None:
        self.seen.append([t.clone() for t in self.watched])


def test_the_start_event_is_recorded_after_the_checks_and_before_any_byte_moves() -> None:
    """The servers time pack and unpack from ``started``: recorded once the checks
    passed (a refused call queues nothing, so records nothing), before the first
    device operation (so it is before any byte of the extent or the caches moved)."""
    views = _views()
    for view in views:
        view[:, 2].fill_(3.0)
    extent = torch.full((FMT.extent_bytes(16),), 0xA5, dtype=torch.uint8)
    started = _StartEvent(extent)
    with pytest.raises(ValueError, match="repeat"):
        pack_request(views, [2, 2], _extent(32), FMT, started=started)
    assert started.seen == []
    pack_request(views, [2], extent, FMT, bytes(range(32)), started=started)
    assert len(started.seen) == 1
    assert bool((started.seen[0][0] == 0xA5).all()), "bytes moved before the start event"
    assert not bool((extent == 0xA5).all())

    started = _StartEvent(*views)
    with pytest.raises(ValueError, match="span"):
        unpack_request(views, [1, 9], _extent(32), FMT, 20, 32, started=started)
    assert started.seen == []
    unpack_request(views, [1], extent, FMT, 16, 16, started=started)
    assert len(started.seen) == 1
    assert all(bool((view[:, 1] == 1.0).all()) for view in started.seen[0])
    assert all(bool((view[:, 1] == 3.0).all()) for view in views)


def test_format_mismatch_is_refused() -> None:
    other = PackedFormat.for_cache(2, 1, 4, torch.float16)
    with pytest.raises(PackedFormatMismatch, match="2 here, 1 at the peer.*TP head slicing"):
        pack_request(_views(), [1, 2], _extent(32), other)
    with pytest.raises(PackedFormatMismatch, match="dtype differs"):
        pack_request(_views(), [1, 2], _extent(32), PackedFormat.for_cache(2, 2, 4, torch.bfloat16))


def test_unpack_refuses_a_block_count_that_does_not_match_the_tokens() -> None:
    views = _views()
    with pytest.raises(ValueError, match=r"tokens \[0, 20\) fill 2 blocks of 16 tokens, got 3"):
        unpack_request(views, [1, 2, 3], _extent(48), FMT, 20, 48)
    with pytest.raises(ValueError, match=r"num_tokens=40 must be in \[1, src_tok_slots=32\]"):
        unpack_request(views, [1, 2, 3], _extent(32), FMT, 40, 32)
    assert all(bool((view == 1.0).all()) for view in views)


def test_extent_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="token slots"):
        pack_request(_views(), [1, 2], _extent(16), FMT)
    with pytest.raises(ValueError, match="token slots"):
        unpack_request(_views(), [1, 2], _extent(48), FMT, 20, 32)
