"""D already holds a prompt's first blocks in its own prefix cache: only the rest may
arrive, and it must land after them.

Measured on the 2 x H200 host with ``--enable-prefix-caching`` on D: vLLM 0.26.0's own
push mode decoded wrong text (it writes P's *first* blocks into D's new ones), every
other mode byte-identical (``experiments/results/2026-11-22-h200x2/``). Here with the
CPU harness (tests/support/connector_pd.py): a first request fills D's prefix cache,
a second one shares its first two blocks; D's blocks after the second load must hold
D's own cached KV for the shared tokens and P's KV for every later token.

Issue 23: D must also *move* only what it lacks. vLLM's NIXL connector READs only the
blocks D does not hold; kvcached-pd's D READ the whole extent (round 2 of a repeated-
prompt benchmark at 0.5 GB/s: 2 322 ms TTFT p50 against vanilla PD's 103 ms). The tests
after the first check the bytes moved (each NIXL READ's range, D's staging reservation,
the window each unpack reads) for partial and full hits, pull and push (claimed too),
the IPC wire, P 16 / D 32-token blocks, hits beside misses in one batch, an abort
before the READ, and the harness's negative control; each fails when D reads the
whole extent again.
"""

from __future__ import annotations

import pytest
import torch

from kvcached_pd import vllm_api
from kvcached_pd.connector.wire import PARAMS_KEY
from kvcached_pd.patches import get_patch
from tests.support import connector_pd as pd
from tests.test_connector_mixed import handoff, settled
from tests.test_connector_pd import staged_env  # noqa: F401 (fixture)

FIRST = list(range(1, 76))  # 75 tokens: five 16-token blocks
SHARED = 32  # the second prompt repeats the first two blocks
SECOND = FIRST[:SHARED] + list(range(300, 343))
PUSH = "NixlPushConnector"


@pytest.fixture
def alignment():
    """kvcached-pd's fix of vLLM's per-block push, as activation applies it (0.26-0.28)."""
    patch = get_patch("push_prefix_alignment")
    applies = patch.applies()[0]
    if applies:
        patch.patch()
    yield applies
    patch.unpatch()


@pytest.mark.parametrize("inner,d_staged", [
    ("NixlConnector", True), (PUSH, True), (PUSH, False)],
    ids=["staged-pull", "staged-push", "vllm-per-block-push"])
def test_decode_prefix_cache_hit_receives_only_the_rest(staged_env, alignment, inner,
                                                         d_staged):
    """Staged: P's extent carries every token and D unpacks from the first token it
    lacks. vLLM's per-block push into a plain vLLM D: P's inner push connector writes
    P's last blocks there (the ``push_prefix_alignment`` patch)."""
    if inner == PUSH and vllm_api.current().push_name != PUSH:
        pytest.skip("vLLM has push mode (NixlPushConnector) from 0.24 on")
    p = pd.make_engine("p", "kv_producer", seed=41, inner=inner)
    d = pd.make_engine("d", "kv_consumer", seed=42, inner=inner, staged=d_staged,
                       prefix_caching=True)
    try:
        # D's request has P's id, as a push-mode proxy sends it
        _, _, first_on_d = handoff(p, d, "first", FIRST, d_prefix="")
        first_blocks = p_blocks_of(p, "first")
        assert settled(p, d) if d_staged else pd.run([p, d], lambda: not d.sched.requests)
        params, want, got = handoff(p, d, "second", SECOND, d_prefix="")
        assert (PARAMS_KEY in params) is True  # P offers the extent either way
        assert p_blocks_of(p, "second")[:2] != first_blocks[:2]  # P's KV of them differs
        for layer in range(pd.LAYERS):
            # K and V of the shared tokens: D's own, from its prefix cache
            assert torch.equal(got[layer][:, :SHARED], first_on_d[layer][:, :SHARED])
            assert not torch.equal(got[layer][:, :SHARED], want[layer][:, :SHARED])
            # every later token: P's
            assert torch.equal(got[layer][:, SHARED:], want[layer][:, SHARED:]), \
                f"layer {layer}: the tokens after D's cached prefix are not P's"
    finally:
        for engine in (p, d):
            engine.worker.shutdown()


def p_blocks_of(p: pd.Engine, req_id: str) -> list[int]:
    """The blocks P handed D for ``req_id`` (in its ``kv_transfer_params``)."""
    ids = p.outputs[req_id].kv_transfer_params["remote_block_ids"]
    return list(ids[0] if isinstance(ids[0], list) else ids)


# ---- issue 23: a decode-side hit moves only the tokens D lacks --------------------------
FULL = list(range(1, 66))  # 65 tokens: D's cache can hold the first 64 (4 blocks of 16)
MISS = list(range(500, 560))  # shares nothing


@pytest.fixture
def moved(monkeypatch):
    """What D moved per request: the NIXL READs its staging agent posted (remote offset,
    bytes; none on the IPC wire), the staging it reserved, and the window each unpack
    read (bytes, first slot), by request id."""
    from kvcached_pd.connector import decode_worker as decode_mod
    from kvcached_pd.connector.region import DecodeStaging, StagingAgent
    from kvcached_pd.connector.wire import Done

    log = {"read": {}, "alloc": {}, "unpack": []}
    read, alloc, unpack = StagingAgent.read, DecodeStaging.alloc, decode_mod.unpack_request

    def spy_read(self, peer, handshake, remote_offset, local_offset, nbytes, notif):
        log["read"][Done.decode(notif).request_id] = (remote_offset, nbytes)
        return read(self, peer, handshake, remote_offset, local_offset, nbytes, notif)

    def spy_alloc(self, nbytes, owner):
        log["alloc"][owner] = nbytes
        return alloc(self, nbytes, owner)

    def spy_unpack(layers, block_ids, in_extent, fmt, num_tokens, src_tok_slots,
                   first_token=0, extent_first=0, **kwargs):
        log["unpack"].append((in_extent.numel(), extent_first))
        return unpack(layers, block_ids, in_extent, fmt, num_tokens, src_tok_slots,
                      first_token, extent_first, **kwargs)

    monkeypatch.setattr(StagingAgent, "read", spy_read)
    monkeypatch.setattr(DecodeStaging, "alloc", spy_alloc)
    monkeypatch.setattr(decode_mod, "unpack_request", spy_unpack)
    return log


def window(d: pd.Engine, params: dict, first_token: int) -> tuple[int, int]:
    """(offset in P's staging, bytes) of P's extent from ``first_token`` on, tag included."""
    from kvcached_pd.connector.wire import StagedParams

    staged = StagedParams.from_params(params)
    start, nbytes = d.worker._region.fmt.window(staged.n_tok_slots, first_token)
    assert start + nbytes == staged.nbytes
    return staged.offset + start, nbytes


def batch(p: pd.Engine, d: pd.Engine, prompts: dict[str, list[int]]):
    """P prefills every prompt; D then receives them all in one step (hits and misses
    in one batch). Returns, per request, P's params and each layer's K and V on P and
    on D, taken once D's request is loaded."""
    from tests.test_connector_pd import loaded

    for req_id, prompt in prompts.items():
        p.sched.add_request(pd.prefill_request(req_id, prompt, p.block_hasher))
    assert pd.run([p], lambda: all(r in p.outputs for r in prompts))
    params = {r: p.outputs[r].kv_transfer_params for r in prompts}
    for req_id, prompt in prompts.items():
        d.sched.add_request(pd.decode_request(req_id, prompt, params[req_id],
                                              block_hasher=d.block_hasher))
    kv = {}

    def finished():
        for req_id, prompt in prompts.items():
            if req_id not in kv and loaded(d, req_id):
                kv[req_id] = (p.tokens(p_blocks_of(p, req_id), len(prompt)),
                              d.tokens(d.blocks_of(req_id), len(prompt)))
        return all(r in d.outputs and d.outputs[r].finished for r in prompts)
    assert pd.run([p, d], finished), "D never finished the batch"
    assert set(kv) == set(prompts)
    return params, kv


# (inner connector, D's block size (P's is 16), wire): pull and push, a block size that
# differs between P and D, the NIXL READ and the CUDA IPC wire (a fake on the CPU)
PARTIAL_MODES = {"pull": ("NixlConnector", 16, "nixl"), "push": (PUSH, 16, "nixl"),
                 "pull-D32": ("NixlConnector", 32, "nixl"), "push-D32-ipc": (PUSH, 32, "ipc")}
FULL_MODES = {"pull": ("NixlConnector", 16, "nixl"), "push-D32": (PUSH, 32, "nixl"),
              "pull-ipc": ("NixlConnector", 16, "ipc")}


def engines(monkeypatch, inner: str, d_block_size: int, wire: str, seed: int):
    if inner == PUSH and vllm_api.current().push_name != PUSH:
        pytest.skip("vLLM has push mode (NixlPushConnector) from 0.24 on")
    if wire == "ipc":
        from tests.support import fake_cuda_ipc

        fake_cuda_ipc.install(monkeypatch)
    p = pd.make_engine("p", "kv_producer", seed=seed, inner=inner)
    d = pd.make_engine("d", "kv_consumer", seed=seed + 1, inner=inner, prefix_caching=True,
                       block_size=d_block_size)
    return p, d


@pytest.mark.parametrize("inner,d_block_size,wire", PARTIAL_MODES.values(),
                         ids=PARTIAL_MODES.keys())
def test_a_partial_hit_moves_only_the_tokens_d_lacks(staged_env, monkeypatch, moved, inner,
                                                     d_block_size, wire):
    """P (16-token blocks) packs every token; D, holding the first 32 tokens, READs (or,
    over IPC, unpacks from P's memory) P's extent from token 32 to its tag into staging
    of that size, beside a miss in the same batch that moves its whole extent. D's KV:
    its own for the shared tokens, P's for the rest; P frees both extents on DONE."""
    p, d = engines(monkeypatch, inner, d_block_size, wire, seed=51)
    try:
        handoff(p, d, "first", FIRST, d_prefix="")
        assert settled(p, d)
        fmt = d.worker._region.fmt
        # the miss and the hit of one batch
        params, kv = batch(p, d, {"second": SECOND, "miss": MISS})
        hit, whole = window(d, params["second"], SHARED), window(d, params["miss"], 0)
        # 75 tokens in 80 slots of P's 16-token blocks; D holds 32 of them
        assert hit[1] == fmt.extent_bytes(80) - SHARED * fmt.bytes_per_token_all_layers
        if wire == "nixl":
            assert moved["read"]["second"] == hit, "the hit READ more than D lacks"
            assert moved["alloc"]["second"] == hit[1], "D reserved staging for all of it"
            assert moved["read"]["miss"] == whole
        else:
            assert not moved["read"] and "second" not in moved["alloc"]
        assert sorted(moved["unpack"][-2:]) == sorted([(hit[1], SHARED), (whole[1], 0)])
        assert sorted(d.series("kvcached_pd_moved_bytes")[-2:]) == sorted([hit[1], whole[1]])
        assert SHARED * fmt.bytes_per_token_all_layers in \
            d.series("kvcached_pd_prefix_skipped_bytes")
        want, got = kv["second"]
        for layer in range(pd.LAYERS):
            assert not torch.equal(got[layer][:, :SHARED], want[layer][:, :SHARED])
            assert torch.equal(got[layer][:, SHARED:], want[layer][:, SHARED:])
        want, got = kv["miss"]
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert settled(p, d), "P kept an extent or blocks after D's partial READ"
    finally:
        for engine in (p, d):
            engine.worker.shutdown()


@pytest.mark.parametrize("inner,d_block_size,wire", FULL_MODES.values(),
                         ids=FULL_MODES.keys())
def test_a_full_hit_moves_nothing_but_the_done(staged_env, monkeypatch, moved, inner,
                                              d_block_size, wire):
    """D's cache holds every prompt token vLLM does not compute again (all but the last):
    no READ, no staging, no unpack; the DONE alone reaches P, which frees the extent and
    its blocks at once (well inside its lease)."""
    p, d = engines(monkeypatch, inner, d_block_size, wire, seed=61)
    try:
        _, _, first_on_d = handoff(p, d, "full1", FULL, d_prefix="")
        assert settled(p, d)
        unpacks = len(moved["unpack"])
        _, _, got = handoff(p, d, "full2", FULL, d_prefix="")
        assert "full2" not in moved["read"] and "full2" not in moved["alloc"], \
            "a full hit READ P's extent"
        assert len(moved["unpack"]) == unpacks, "a full hit unpacked"
        cached = 64
        for layer in range(pd.LAYERS):
            assert torch.equal(got[layer][:, :cached], first_on_d[layer][:, :cached])
        assert ("full2", 0) in p.done_seen or pd.run([p, d], lambda: ("full2", 0) in p.done_seen)
        assert settled(p, d), "P kept the extent or blocks of a full hit"
        assert d.series("kvcached_pd_moved_bytes")[-1] == 0
    finally:
        for engine in (p, d):
            engine.worker.shutdown()


def test_an_abort_between_match_and_read_moves_nothing_for_it(staged_env, monkeypatch, moved):
    """Two hits wait for D's staging room (their READs not posted); one is aborted. It
    is never READ; the other READs only its window once room frees; both sides settle."""
    from vllm.v1.request import RequestStatus

    from kvcached_pd.connector.region import DecodeStaging

    p, d = engines(monkeypatch, "NixlConnector", 16, "nixl", seed=71)
    try:
        handoff(p, d, "first", FIRST, d_prefix="")
        assert settled(p, d)
        full = {"on": True}
        alloc = DecodeStaging.alloc  # the spy
        monkeypatch.setattr(DecodeStaging, "alloc",
                            lambda self, n, owner: None if full["on"] else alloc(self, n, owner))
        prompts = {"keep": SECOND, "gone": FIRST[:SHARED] + list(range(700, 740))}
        for req_id, prompt in prompts.items():
            p.sched.add_request(pd.prefill_request(req_id, prompt))
        assert pd.run([p], lambda: all(r in p.outputs for r in prompts))
        for req_id, prompt in prompts.items():
            d.sched.add_request(pd.decode_request(
                req_id, prompt, p.outputs[req_id].kv_transfer_params,
                block_hasher=d.block_hasher))
        worker = d.worker._decode_worker
        assert pd.run([p, d], lambda: set(worker.queued) == set(prompts))
        d.sched.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
        full["on"] = False
        assert pd.run([p, d], lambda: "keep" in d.outputs and d.outputs["keep"].finished)
        assert "gone" not in moved["read"], "an aborted request was READ"
        assert moved["read"]["keep"] == window(d, p.outputs["keep"].kv_transfer_params, SHARED)
        assert settled(p, d), "an abort between match and READ left something behind"
    finally:
        for engine in (p, d):
            engine.worker.shutdown()


def test_the_corruption_control_inverts_a_windows_kv_not_its_tag(staged_env, monkeypatch,
                                                                 moved):
    """The equivalence harness's negative control with D's prefix cache on: the window
    D READ (from token 32) has all its KV inverted and its tag left alone, so the load
    succeeds with wrong KV (the text the harness must see differ), not a refused load
    (which vLLM may recompute into the right text)."""
    from kvcached_pd.testing.corrupt_received_kv import CorruptReceivedKVPatch

    p, d = engines(monkeypatch, "NixlConnector", 16, "nixl", seed=81)
    try:
        handoff(p, d, "first", FIRST, d_prefix="")
        assert settled(p, d)
        patch = CorruptReceivedKVPatch()
        assert patch.patch()
        try:
            failed = pd.record_load_errors(d)
            params, want, got = handoff(p, d, "second", SECOND, d_prefix="")
        finally:
            patch.unpatch()
        assert not failed, "the control made the load fail instead of the KV wrong"
        assert moved["read"]["second"] == window(d, params, SHARED)
        for layer in range(pd.LAYERS):
            assert torch.equal(got[layer][:, SHARED:].view(torch.int16),
                               ~want[layer][:, SHARED:].view(torch.int16))
    finally:
        for engine in (p, d):
            engine.worker.shutdown()


@pytest.mark.parametrize("wire", ["nixl", "ipc"])
def test_claimed_requests_move_only_what_d_lacks(staged_env, monkeypatch, moved, wire):
    """Push mode with concurrent legs: D allocates before P answered and claims the
    params from P's listener; a partial hit then READs only the window, and a full hit
    (after P answered the claim) sends the DONE alone. On the IPC wire, once the first
    request has mapped P, D's scheduler claims and the partial hit loads synchronously,
    unpacking only the window out of P's memory."""
    from kvcached_pd.connector import decode_worker as decode_mod
    from tests.test_connector_pd import loaded
    from tests.test_connector_push_concurrent import concurrent_params

    p, d = engines(monkeypatch, PUSH, 16, wire, seed=91)
    sync_loads = []
    post_now = decode_mod.DecodeWorker._post_now
    monkeypatch.setattr(decode_mod.DecodeWorker, "_post_now", lambda self, req_id, read: (
        sync_loads.append(req_id) or post_now(self, req_id, read)))

    def legs(req_id, prompt):
        d.sched.add_request(pd.decode_request(req_id, prompt, concurrent_params(p, req_id),
                                              block_hasher=d.block_hasher))
        p.sched.add_request(pd.prefill_request(req_id, prompt))
        kv = {}

        def finished():
            if not kv and loaded(d, req_id) and req_id in p.outputs:
                kv["p"] = p.tokens(p_blocks_of(p, req_id), len(prompt))
                kv["d"] = d.tokens(d.blocks_of(req_id), len(prompt))
            return req_id in d.outputs and d.outputs[req_id].finished
        assert pd.run([p, d], finished), "D never finished the request"
        assert d.connector._decode.refused_peers == {}, "D took vLLM's per-block push"
        return p.outputs[req_id].kv_transfer_params, kv["p"], kv["d"]

    try:
        legs("first", FIRST)
        assert settled(p, d)
        params, want, got = legs("second", SECOND)
        hit = window(d, params, SHARED)
        if wire == "nixl":
            assert moved["read"]["second"] == hit
        else:
            assert not moved["read"] and sync_loads == ["second"]
        assert moved["unpack"][-1] == (hit[1], SHARED), "D unpacked more than it lacks"
        for layer in range(pd.LAYERS):
            assert torch.equal(got[layer][:, SHARED:], want[layer][:, SHARED:])
        assert settled(p, d)
        legs("full1", FULL)
        assert settled(p, d)
        legs("full2", FULL)
        assert "full2" not in moved["read"], "a claimed full hit READ P's extent"
        assert pd.run([p, d], lambda: ("full2", 0) in p.done_seen, timeout_s=5)
        assert settled(p, d), "P kept the extent or blocks of a claimed full hit"
    finally:
        for engine in (p, d):
            engine.worker.shutdown()
