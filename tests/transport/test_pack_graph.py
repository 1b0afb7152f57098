"""Pack and unpack through CUDA graph replays (kvcached_pd.transport.pack_graph).

A CPU has no CUDA graphs and no Triton, so the launcher's three device methods are
emulated: ``_capture`` does nothing, ``_new_event`` is an event the test completes by
hand, and ``_replay`` does what the captured kernels do, reading ONLY the slot's record
in the launcher's host buffer (the bytes the record kernel would carry to the device)
and moving words by the kernel's own address formula on raw addresses. Everything
else runs for real: the records, the ring, pack/unpack's extent and tag arithmetic,
the self-check that keeps a wrong kernel out, and the fallbacks.
"""

from __future__ import annotations

import array
import ctypes
import logging

import pytest
import torch

from kvcached_pd import config
from kvcached_pd.transport import pack_graph
from kvcached_pd.transport.format import TAG_BYTES, PackedFormat
from kvcached_pd.transport.layout import KVCacheLayers
from kvcached_pd.transport.pack import (
    GRAPHS_ATTR,
    graph_fallbacks,
    pack_request,
    pack_request_reference,
    select_kernel,
    unpack_request,
)
from kvcached_pd.transport.pack_graph import HEADER_WORDS, SlotRing, encode
from tests.transport.kv_cache_builders import LAYOUTS, LAYOUTS_BY_NAME, decode_side, side

KVCACHED = LAYOUTS_BY_NAME["kv_first_kvcached_contiguous"]


class FakeEvent:
    def __init__(self) -> None:
        self.done = True
        self.records = 0

    def query(self) -> bool:
        return self.done

    def record(self, stream=None) -> None:
        self.records += 1
        self.done = not EmulatedGraphs.hold  # a held device: the replay has not run yet


def _memory(addr: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


class EmulatedGraphs(pack_graph.GraphLauncher):
    hold = False  # True: every event stays incomplete (a device far behind the host)
    misplace = False  # True: a kernel bug, blocks land one slot off
    ignore_mask = False  # True: a kernel bug, every token of the last block is copied
    built: list = []

    def _new_event(self):
        return FakeEvent()

    def _capture(self, bs, heads, dw, strides):
        self.geometry = (bs, heads, dw, tuple(strides))
        EmulatedGraphs.built.append(self)

    def _replay(self, slot, to_packed):
        record = self._host[slot]  # what the record kernel copies to the device
        extent_addr, nb, valid, tag_addr = (int(v) for v in record[:4])
        ids = record[HEADER_WORDS: HEADER_WORDS + nb].tolist()
        if self.misplace:
            ids = ids[1:] + ids[:1]
        bs, heads, dw, (s_kv, s_blk, s_tok, s_head) = self.geometry
        wb, stride = self.word_bytes, self.tok_stride_words
        by_addr = {w.data_ptr(): w for w in self.words}
        for layer, base in enumerate(self._addrs.tolist()):
            view = by_addr[base]  # the table must point at each layer's own view
            for kv in range(2):
                for b, block in enumerate(ids):
                    for tok in range(bs):
                        if b * bs + tok >= valid and not self.ignore_mask:  # the mask
                            continue
                        at = extent_addr + wb * ((b * bs + tok) * stride
                                                 + (layer * 2 + kv) * heads * dw)
                        slot_words = _memory(at, heads * dw * wb).view(self.word)
                        if to_packed:
                            slot_words.copy_(view[kv, block, tok].reshape(-1))
                        else:
                            view[kv, block, tok].copy_(slot_words.view(heads, dw))
        if to_packed and tag_addr:
            _memory(tag_addr, TAG_BYTES).copy_(record[4:HEADER_WORDS].view(torch.uint8))


@pytest.fixture
def emulated_graphs(monkeypatch):
    monkeypatch.setattr(pack_graph, "available", lambda device: True)
    monkeypatch.setattr(pack_graph, "GraphLauncher", EmulatedGraphs)
    monkeypatch.setattr(EmulatedGraphs, "hold", False)
    monkeypatch.setattr(EmulatedGraphs, "misplace", False)
    monkeypatch.setattr(EmulatedGraphs, "ignore_mask", False)
    monkeypatch.setattr(EmulatedGraphs, "built", [])
    return monkeypatch


# ---- the record and the ring ------------------------------------------------------------
def test_the_record_carries_every_per_request_value_at_its_word():
    tag = bytes(range(TAG_BYTES))
    raw = encode(0x7F00_0000_1000, array.array("q", [5, 0, 9]), 40, 0x7F00_0000_2000, tag)
    words = array.array("q", raw)
    assert list(words[:4]) == [0x7F00_0000_1000, 3, 40, 0x7F00_0000_2000]
    assert raw[32:32 + TAG_BYTES] == tag and HEADER_WORDS == 4 + TAG_BYTES // 8
    assert list(words[HEADER_WORDS:]) == [5, 0, 9]
    assert encode(1, array.array("q", [1]), 1, 0, None)[32:64] == bytes(32)  # no tag: zeros
    with pytest.raises(ValueError, match="tag is 32 bytes"):
        encode(1, array.array("q", [1]), 1, 0, b"short")
    with pytest.raises(TypeError, match="array\\('q'\\)"):
        encode(1, array.array("i", [1]), 1, 0, None)


def test_the_ring_never_hands_out_a_slot_whose_last_use_has_not_run():
    done = {0: True, 1: True}
    ring = SlotRing(2, lambda i: done[i])
    assert [ring.acquire(), ring.acquire()] == [0, 1]
    done[0] = False  # slot 0's replay is still queued
    assert ring.acquire() is None and ring.busy == 1
    done[0] = True
    assert ring.acquire() == 0
    done[1] = False
    assert ring.acquire() is None and ring.busy == 2


# ---- through pack_request / unpack_request ----------------------------------------------
def test_auto_installs_the_graphs_after_their_self_check(emulated_graphs):
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    layers = KVCacheLayers.from_views(side(KVCACHED, 16)[1])
    assert layers.stacked is not None  # kvcached's layout, where torch needs one launch
    described = select_kernel(layers, fmt)
    assert described.startswith("CUDA graphs of one Triton kernel for all 3 layers")
    check, installed = EmulatedGraphs.built
    assert check.replays == 4  # the self-check: one pack, three unpacks, all as graphs
    assert getattr(layers, GRAPHS_ATTR) is installed and installed.replays == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("p_bs,d_bs,num_tokens,cached", [
    (16, 16, 40, 0), (16, 32, 40, 0), (8, 32, 35, 0),
    (16, 16, 40, 1), (8, 16, 35, 2),  # D holds its first blocks from its prefix cache
])
def test_graphs_move_the_same_bytes(emulated_graphs, layout, p_bs, d_bs, num_tokens, cached):
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    _, p_views = side(layout, p_bs, seed=1)
    p_layers = KVCacheLayers.from_views(p_views)
    assert select_kernel(p_layers, fmt).startswith("CUDA graphs")
    p_ids = [7, 2, 5, 0, 8][: -(-num_tokens // p_bs)]
    slots = len(p_ids) * p_bs
    extent = torch.full((fmt.extent_bytes(slots),), 0xA5, dtype=torch.uint8)
    tag = bytes(range(100, 100 + TAG_BYTES))
    pack_request(p_layers, p_ids, extent, fmt, tag=tag)
    want = pack_request_reference(p_views, p_ids, fmt)
    assert torch.equal(extent[:-TAG_BYTES], want[:-TAG_BYTES])
    assert bytes(extent[-TAG_BYTES:].tolist()) == tag
    assert getattr(p_layers, GRAPHS_ATTR).replays == 1

    d_buffers, d_views, expected, d_ids, first = decode_side(layout, d_bs, num_tokens, cached,
                                                             extent, fmt, slots)
    d_layers = KVCacheLayers.from_views(d_views)
    select_kernel(d_layers, fmt)
    start, _ = fmt.window(slots, first)  # the window a D with a prefix hit reads
    unpack_request(d_layers, d_ids, extent[start:], fmt, num_tokens, slots, first, first)
    assert getattr(d_layers, GRAPHS_ATTR).replays == 1
    for got, want_d in zip(d_buffers, expected):
        assert torch.equal(got.view(torch.uint8), want_d.view(torch.uint8))


def test_a_wrong_kernel_is_caught_by_the_self_check(emulated_graphs):
    emulated_graphs.setattr(EmulatedGraphs, "misplace", True)
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    layers = KVCacheLayers.from_views(side(KVCACHED, 16)[1])
    described = select_kernel(layers, fmt)
    assert described.startswith("torch") and "packed extents differ" in described
    assert getattr(layers, GRAPHS_ATTR, None) is None
    with pytest.raises(RuntimeError, match="KVCACHED_PD_PACK_KERNEL=graph but packed"):
        select_kernel(layers, fmt, "graph")


def test_the_self_check_catches_a_kernel_that_fills_a_partly_covered_block(emulated_graphs):
    """The unpack's token mask matters only where this side's last block is covered in
    part (a peer of smaller blocks); the device self-check has such a case."""
    emulated_graphs.setattr(EmulatedGraphs, "ignore_mask", True)
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    layers = KVCacheLayers.from_views(side(KVCACHED, 16)[1])
    described = select_kernel(layers, fmt)
    assert "unpacked blocks differ (a last block partly covered)" in described
    assert getattr(layers, GRAPHS_ATTR, None) is None


def test_a_self_check_that_ran_on_torch_does_not_pass(emulated_graphs):
    """Every slot in flight sends the self-check's calls down the torch path, which
    would compare torch with itself: that must not count as proof."""
    emulated_graphs.setattr(SlotRing, "acquire", lambda self: None)
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    layers = KVCacheLayers.from_views(side(KVCACHED, 16)[1])
    described = select_kernel(layers, fmt)
    assert "0 of 4 calls ran as graphs" in described and getattr(layers, GRAPHS_ATTR, None) is None


def test_a_busy_ring_or_a_large_request_takes_the_ordinary_path(emulated_graphs, caplog):
    caplog.set_level(logging.INFO, logger="kvcached_pd")
    emulated_graphs.setattr(logging.getLogger("kvcached_pd"), "propagate", True)
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    _, views = side(KVCACHED, 16, seed=3)
    layers = KVCacheLayers.from_views(views)
    select_kernel(layers, fmt, "graph", max_blocks=2)
    graphs = getattr(layers, GRAPHS_ATTR)
    assert graphs.max_blocks == 2
    emulated_graphs.setattr(EmulatedGraphs, "hold", True)
    results = []
    for ids in ([3, 1], [4, 6], [7, 2, 5]) + ([0, 8],) * (graphs.slots - 1):
        extent = torch.zeros(fmt.extent_bytes(16 * len(ids)), dtype=torch.uint8)
        pack_request(layers, ids, extent, fmt)
        results.append(torch.equal(extent, pack_request_reference(views, ids, fmt)))
    # 3 blocks > max_blocks, and once every slot is in flight: torch, same bytes
    assert all(results) and graphs.replays == graphs.slots and graphs.ring.busy == 1
    assert "all 32 pack/unpack CUDA graph slots in flight" in caplog.text
    # the large one and the busy one, for vllm:kvcached_pd_graph_fallbacks
    assert graphs.fallbacks == 2 and graph_fallbacks(layers) == 2
    assert graph_fallbacks(KVCacheLayers.from_views(side(KVCACHED, 16)[1])) == 0  # no graphs


def test_an_extent_off_the_graphs_word_takes_the_ordinary_path_and_is_counted(
        emulated_graphs):
    """Staged extents are 4 KiB-aligned; one that is not (2 bytes in) cannot be moved as
    the graph kernel's words: the ordinary kernels move it, and the call is counted."""
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    _, views = side(KVCACHED, 16, seed=5)
    layers = KVCacheLayers.from_views(views)
    select_kernel(layers, fmt, "graph")
    graphs = getattr(layers, GRAPHS_ATTR)
    ids = [3, 1]
    nbytes = fmt.extent_bytes(16 * len(ids))
    extent = torch.zeros(nbytes + 2, dtype=torch.uint8)[2:]
    replays = graphs.replays
    pack_request(layers, ids, extent, fmt)
    assert torch.equal(extent, pack_request_reference(views, ids, fmt))
    assert graphs.replays == replays and graph_fallbacks(layers) == 1


def test_without_triton_or_cuda_the_graphs_cannot_be_forced():
    fmt = PackedFormat.for_cache(3, 2, 4, torch.bfloat16)
    layers = KVCacheLayers.from_views(side(KVCACHED, 16)[1])
    described = select_kernel(layers, fmt)
    assert described.startswith("torch index ops, one launch for all layers")
    assert "CUDA graphs not used: Triton, CUDA graphs or a CUDA device" in described
    with pytest.raises(RuntimeError, match="KVCACHED_PD_PACK_KERNEL=graph but Triton"):
        select_kernel(layers, fmt, "graph")


def test_pack_kernel_setting_takes_graph():
    assert config.read_settings({"KVCACHED_PD_PACK_KERNEL": "Graph"}).pack_kernel == "graph"


def test_no_kernel_parameter_shadows_tritons_launch_binder():
    """Triton builds each kernel's argument binder as generated Python whose locals are
    ``params``, ``specialization`` and ``options``: a kernel parameter of one of those
    names is silently rebound to the binder's own dict, and every launch then fails
    with "failed to specialize argument of type: dict" (so it did on one H100 with
    Triton 3.6.0, 2026-11-27: the graphs were not installed and ``auto`` fell back).
    Read from the source, since CI has no Triton to decorate the kernels."""
    import ast
    import inspect

    from kvcached_pd.transport import pack_triton

    reserved = {"params", "specialization", "options"}
    kernels = {}
    for module in (pack_graph, pack_triton):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                kernels[node.name] = {a.arg for a in node.args.args}
    assert {"_graph_copy_kernel", "_record_kernel", "_copy_blocks_kernel"} <= set(kernels)
    assert {name: args & reserved for name, args in kernels.items() if args & reserved} == {}
