"""The CUDA IPC wire end to end on the CPU: real vLLM schedulers, real NIXL agents (the
DONE still travels as a NIXL notification), CUDA IPC replaced by an in-process fake
(tests/support/fake_cuda_ipc.py) that hands D the very tensor P packed into."""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import time
import weakref

import pytest
import torch

from kvcached_pd import vllm_api
from kvcached_pd.connector import decode_worker as decode_mod
from kvcached_pd.connector import prefill as prefill_mod
from kvcached_pd.connector import wires as wires_mod
from kvcached_pd.connector.tokens import new_token
from kvcached_pd.connector.wire import PARAMS_KEY
from kvcached_pd.connector.region import StagingAgent
from kvcached_pd.transport import cuda_ipc
from kvcached_pd.transport import pack as pack_mod
from tests.support import connector_pd as pd
from tests.support import fake_cuda_ipc
from tests.test_connector_pd import (  # noqa: F401 - staged_env is a fixture
    handoff,
    loaded,
    saw_done,
    settle,
    staged_env,
    staging_used,
    torch_equal,
)


@pytest.fixture
def ipc(monkeypatch):
    return fake_cuda_ipc.install(monkeypatch)


@pytest.fixture
def reads(monkeypatch):
    """Every NIXL READ D's staging agent posts (the request ids of their DONEs)."""
    posted = []
    original = StagingAgent.read

    def read(self, peer, handshake, remote_offset, local_offset, nbytes, notif):
        posted.append(notif)
        return original(self, peer, handshake, remote_offset, local_offset, nbytes, notif)

    monkeypatch.setattr(StagingAgent, "read", read)
    return posted


def same_kv(p, d, p_blocks, d_blocks, n):
    want, got = p.tokens(p_blocks, n), d.tokens(d_blocks, n)
    return all(torch_equal(a, b) for a, b in zip(want, got))


def wire_of(d):
    futures = list(d.worker._decode_worker._peers.values())
    assert len(futures) == 1
    return futures[0].result()


def wait_unmapped(worker, idle_s: float = 0.3, timeout_s: float = 5.0) -> bool:
    """Let D's unmap thread drop the peers idle for ``idle_s`` (no engine step: an idle D
    does not step); True once none is mapped, within ``timeout_s``."""
    worker.idle_unmap_s = idle_s
    deadline = time.monotonic() + timeout_s
    while worker._peers and time.monotonic() < deadline:
        time.sleep(0.05)
    return not worker._peers


def test_a_same_host_peer_is_unpacked_straight_from_p_staging(staged_env, ipc, reads):
    p = pd.make_engine("p", "kv_producer", seed=1)
    d = pd.make_engine("d", "kv_consumer", seed=2)
    prompt = list(range(1, 45))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert wire_of(d).name == "ipc" and ipc.opened
    assert reads == [], "the IPC wire posted a NIXL READ"
    assert d.series("kvcached_pd_decode_staging_bytes") == [], "D reserved staging"
    # D's DONE (a NIXL notification without a READ) frees P's extent and blocks
    assert saw_done(p, d, "r1"), "D's DONE never reached P"
    assert settle(p, d)


class _BusyGraphs:
    """CUDA graphs installed whose every slot is still in flight: each pack and unpack
    takes the ordinary kernels (what ``GraphLauncher.run`` does with a busy ring)."""

    word = torch.int64  # what the graph kernel moves; staged extents are 4 KiB-aligned

    def __init__(self) -> None:
        self.fallbacks = 0

    def refused(self) -> None:
        self.fallbacks += 1

    def run(self, *args, **kwargs) -> bool:
        self.refused()
        return False


def test_calls_the_graphs_refuse_are_counted_in_each_workers_stats(staged_env, ipc, reads):
    """vllm:kvcached_pd_graph_fallbacks: P's packs and D's unpacks that took the ordinary
    kernels under installed graphs, each counted once, by the worker that made them."""
    p = pd.make_engine("p", "kv_producer", seed=11)
    d = pd.make_engine("d", "kv_consumer", seed=12)
    for engine in (p, d):
        object.__setattr__(engine.worker._region.layers, pack_mod.GRAPHS_ATTR, _BusyGraphs())
    for i, prompt in enumerate((list(range(3, 40)), list(range(5, 70)))):
        params, p_blocks, d_blocks = handoff(p, d, f"r{i}", prompt)
        assert same_kv(p, d, p_blocks, d_blocks, len(prompt))  # the same bytes
    assert sum(p.series("kvcached_pd_graph_fallbacks")) == 2
    assert sum(d.series("kvcached_pd_graph_fallbacks")) == 2
    assert wire_of(d).name == "ipc"
    assert settle(p, d)


def test_p_packs_records_its_event_and_d_waits_on_it_before_unpacking(
        staged_env, ipc, monkeypatch):
    def logged(module, name, what):
        original = getattr(module, name)

        def call(*args, **kwargs):
            ipc.log.append((what, ""))
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, call)

    logged(prefill_mod, "pack_request", "pack")
    logged(decode_mod, "unpack_request", "unpack")
    p = pd.make_engine("p", "kv_producer", seed=3)
    d = pd.make_engine("d", "kv_consumer", seed=4)
    prompt = list(range(5, 70))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    slot = params["kvcached_pd"]["pack_event"]
    assert slot >= 0
    event = f"p1.e{slot}"
    order = [entry for entry in ipc.log if entry[0] in ("pack", "unpack")
             or entry[1] == event]
    assert order == [("pack", ""), ("record", event), ("wait", event), ("unpack", "")], order


def test_d_tells_p_only_once_its_unpack_has_run(staged_env, ipc):
    ipc.unpacks_complete = False
    p = pd.make_engine("p", "kv_producer", seed=5)
    d = pd.make_engine("d", "kv_consumer", seed=6)
    prompt = list(range(3, 40))
    handoff(p, d, "r1", prompt)
    # D decoded (its forward is stream-ordered after the unpack), but the unpack has not
    # run on the device: P must not reuse its extent yet
    assert not pd.run([p, d], lambda: ("r1", 0) in p.done_seen, timeout_s=2)
    assert p.connector._prefill.staged, "P freed its extent before D's unpack ran"
    ipc.unpacks_complete = True
    assert saw_done(p, d, "r1")
    assert settle(p, d)


def _read_p_staging(d) -> str:
    """Post a NIXL READ of P's first 4 KiB from D's staged agent: "read", or why NIXL
    refused it."""
    wire = wire_of(d)
    agent = d.worker._region.agent
    try:
        handle = agent.read(wire.peer, wire.handshake, 0, d.worker._region.decode.address(0),
                            4096, b"probe")
    except Exception as exc:  # noqa: BLE001 - NIXL's refusal is the answer
        return f"refused: {type(exc).__name__}: {exc}"
    deadline = time.monotonic() + 10
    while agent.state(handle) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.01)
    state = agent.state(handle)
    agent.release(handle)
    return "read" if state == "DONE" else f"refused: {state}"


def test_an_ipc_peer_is_loaded_without_its_memory(staged_env, ipc):
    """D on the IPC wire loads P's NIXL agent for its DONEs alone, none of P's memory:
    UCX opens the first remote key of each peer GPU through CUDA IPC and keeps that
    mapping for good, which held a killed P's 2 GiB staging on one H100 (2026-11-26).
    D's agent then cannot READ P's staging (it has no key for it); the DONE still reaches
    P."""
    p = pd.make_engine("p", "kv_producer", seed=51)
    d = pd.make_engine("d", "kv_consumer", seed=52)
    prompt = list(range(3, 40))
    handoff(p, d, "r1", prompt)
    assert wire_of(d).name == "ipc"
    assert wire_of(d).handshake.notify_metadata, "P's handshake offers no notify metadata"
    assert _read_p_staging(d).startswith("refused"), "D loaded P's staging into NIXL"
    assert saw_done(p, d, "r1") and settle(p, d)


def test_a_nixl_wire_peer_is_loaded_with_its_staging(staged_env, ipc, monkeypatch):
    """The other half of the test above: D READs over NIXL, so it loads P's staging."""
    monkeypatch.setenv("KVCACHED_PD_WIRE", "nixl")
    p = pd.make_engine("p", "kv_producer", seed=53)
    d = pd.make_engine("d", "kv_consumer", seed=54)
    handoff(p, d, "r1", list(range(3, 40)))
    assert wire_of(d).name == "nixl"
    assert _read_p_staging(d) == "read"


def test_a_peer_first_loaded_without_its_memory_is_read_over_nixl_once_ipc_fails(
        staged_env, ipc, reads):
    """D loaded P's agent without its memory for the IPC wire; after the idle unmap its
    next handshake cannot map P (here: the open fails) and falls back to NIXL, which
    loads P's whole agent over the first, so READs find P's staging. The request that
    the scheduler had already made synchronous (it learns of the unmap a step later)
    fails its load alone, as the README says of a re-map in its step; the next one is
    read over NIXL."""
    p = pd.make_engine("p", "kv_producer", seed=57)
    d = pd.make_engine("d", "kv_consumer", seed=58)
    prompt = list(range(9, 52))
    handoff(p, d, "r1", prompt)
    assert wire_of(d).name == "ipc" and reads == []
    assert wait_unmapped(d.worker._decode_worker), "the idle peer stayed mapped"
    ipc.fail_open = "the peer runs in another IPC namespace on this host"
    invalid = pd.record_load_errors(d)
    d.sched.add_request(pd.decode_request("d-r2", prompt, pd.prefilled(p, "r2", prompt)))
    assert pd.run([p, d], lambda: "d-r2" in d.outputs and d.outputs["d-r2"].finished,
                  timeout_s=30), "d-r2 never finished"
    assert invalid, "the synchronous load after the fallback did not fail"
    params, p_blocks, d_blocks = handoff(p, d, "r3", list(range(60, 110)))
    assert same_kv(p, d, p_blocks, d_blocks, 50)
    assert wire_of(d).name == "nixl" and len(reads) == 1
    assert saw_done(p, d, "r3")
    # D holds nothing; P holds only the failed request's extent, for its lease (no DONE
    # frees an extent whose load failed)
    assert pd.run([p, d], lambda: not d.sched.requests and staging_used(d) == 0
                  and set(p.connector._prefill.staged) == {"r2"}, timeout_s=10), \
        sorted(p.connector._prefill.staged)


def test_an_older_prefill_without_notify_metadata_is_loaded_whole(staged_env, ipc,
                                                                  monkeypatch):
    """A P of an older build sends no ``notify_metadata``: D loads its whole agent, as
    before, and the IPC wire serves it."""
    from kvcached_pd.connector import region as region_mod

    monkeypatch.setattr(region_mod.StagingAgent, "notify_metadata", lambda self: None)
    p = pd.make_engine("p", "kv_producer", seed=55)
    d = pd.make_engine("d", "kv_consumer", seed=56)
    prompt = list(range(5, 44))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert wire_of(d).name == "ipc" and wire_of(d).handshake.notify_metadata is None
    assert _read_p_staging(d) == "read"
    assert saw_done(p, d, "r1") and settle(p, d)


def test_an_ipc_open_that_fails_falls_back_to_nixl_logged_once_and_counted(
        staged_env, ipc, reads, caplog):
    ipc.fail_open = "the peer runs in another IPC namespace on this host"
    p = pd.make_engine("p", "kv_producer", seed=7)
    d = pd.make_engine("d", "kv_consumer", seed=8)
    with caplog.at_level(logging.INFO, logger="kvcached_pd"):
        for i, prompt in enumerate((list(range(1, 30)), list(range(9, 60)))):
            params, p_blocks, d_blocks = handoff(p, d, f"r{i}", prompt)
            assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert wire_of(d).name == "nixl" and len(reads) == 2
    warned = [r for r in caplog.records if "wire nixl" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "another IPC namespace" in warned[0].getMessage()
    assert d.series("kvcached_pd_wire_fallbacks") == [1]
    assert settle(p, d)


def test_a_peer_on_another_host_takes_nixl_without_counting_a_fallback(
        staged_env, ipc, reads):
    ipc.fail_open, ipc.fail_same_host = "the peer is on another host", False
    p = pd.make_engine("p", "kv_producer", seed=9)
    d = pd.make_engine("d", "kv_consumer", seed=10)
    prompt = list(range(2, 50))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert wire_of(d).name == "nixl" and len(reads) == 1
    assert d.series("kvcached_pd_wire_fallbacks") == []


def test_wire_nixl_never_maps_the_peer(staged_env, ipc, reads, monkeypatch):
    monkeypatch.setenv("KVCACHED_PD_WIRE", "nixl")
    p = pd.make_engine("p", "kv_producer", seed=11)
    d = pd.make_engine("d", "kv_consumer", seed=12)
    prompt = list(range(4, 40))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert ipc.opened == [] and ipc.exported == {} and len(reads) == 1
    assert wire_of(d).name == "nixl"


def test_wire_ipc_fails_the_loads_of_a_peer_it_cannot_open(staged_env, ipc, reads,
                                                           monkeypatch):
    monkeypatch.setenv("KVCACHED_PD_WIRE", "ipc")
    ipc.fail_open = "this GPU cannot access the peer's GPU directly"
    p = pd.make_engine("p", "kv_producer", seed=13)
    d = pd.make_engine("d", "kv_consumer", seed=14)
    prompt = list(range(6, 50))
    params = pd.prefilled(p, "r1", prompt)
    invalid = pd.record_load_errors(d)  # vLLM 0.30+ reads them; earlier releases ask
    failed = []  # for the connector's own failed loads (what its poll returns)

    def recorded_poll(poll):
        done, bad = poll()
        failed.extend(bad)
        return done, bad
    pd.wrap_method(d.worker, "_poll_staged_loads", recorded_poll)
    d.sched.add_request(pd.decode_request("d-r1", prompt, params))
    assert pd.run([p, d], lambda: bool(invalid) or bool(failed), timeout_s=20), \
        "D's load did not fail"
    assert reads == [], "KVCACHED_PD_WIRE=ipc took NIXL"


@pytest.mark.skipif(vllm_api.api_for(None) is None or vllm_api.current().push_name is None,
                    reason="vLLM has push mode (NixlPushConnector) from 0.24 on")
def test_push_mode_takes_the_ipc_wire_too(staged_env, ipc, reads, monkeypatch):
    monkeypatch.setenv("KVCACHED_PD_STAGING_MB", "8")
    p = pd.make_engine("p", "kv_producer", seed=15, inner="NixlPushConnector")
    d = pd.make_engine("d", "kv_consumer", seed=16, inner="NixlPushConnector")
    prompt = list(range(7, 70))
    params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert wire_of(d).name == "ipc" and reads == []
    assert saw_done(p, d, "r1")
    assert settle(p, d)


def test_a_decode_abort_before_the_unpack_still_frees_p(staged_env, ipc):
    p = pd.make_engine("p", "kv_producer", seed=17)
    d = pd.make_engine("d", "kv_consumer", seed=18)
    prompt = list(range(8, 60))
    params = pd.prefilled(p, "r1", prompt)
    d.sched.add_request(pd.decode_request("d-r1", prompt, params))
    d.sched.finish_requests(["d-r1"], _aborted())
    assert settle(p, d)
    assert staging_used(p) == 0


def _aborted():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def test_an_idle_peer_is_unmapped_and_mapped_again_at_its_next_request(staged_env, ipc):
    """A mapping keeps P's staging allocated on the GPU, even once P died (seen on one
    H100: a killed P's 2 GiB stayed allocated while D held it)."""
    p = pd.make_engine("p", "kv_producer", seed=19)
    d = pd.make_engine("d", "kv_consumer", seed=20)
    prompt = list(range(11, 50))
    handoff(p, d, "r1", prompt)
    worker = d.worker._decode_worker
    wire = wire_of(d)
    # no engine step: an idle D does not step, and must let go of the mapping all the same
    assert wait_unmapped(worker), "the idle peer stayed mapped"
    assert wire.mapped is None
    params, p_blocks, d_blocks = handoff(p, d, "r2", prompt)
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert wire_of(d).name == "ipc" and len(ipc.opened) == 2


def test_loads_done_in_one_step_share_one_tag_read_and_a_bad_one_fails_alone(
        staged_env, ipc, monkeypatch, caplog):
    """Three loads that complete in one poll of D: their tags come back in one
    device-to-host read (``read_tags``; one synchronous read each cost tens of us of
    host time on the H100). One carries another token (its tag check fails), one meets
    a repeated block id (``unpack_request`` refuses it before any device work): each
    fails alone, and the third receives its exact KV."""
    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    batches = []
    real_read_tags = decode_mod.read_tags

    def read_tags(extents, stream=None):
        batches.append(len(extents))
        return real_read_tags(extents, stream)
    monkeypatch.setattr(decode_mod, "read_tags", read_tags)
    real_scatter = decode_mod.DecodeWorker._scatter

    def scatter(self, req_id, read, src):
        if req_id == "d-ids":
            ids = read.order.block_ids
            read.order = dataclasses.replace(read.order, block_ids=(ids[0],) * len(ids))
        return real_scatter(self, req_id, read, src)
    monkeypatch.setattr(decode_mod.DecodeWorker, "_scatter", scatter)

    p = pd.make_engine("p", "kv_producer", seed=21)
    d = pd.make_engine("d", "kv_consumer", seed=22)
    prompts = {"good": list(range(1, 41)), "token": list(range(101, 141)),
               "ids": list(range(201, 241))}
    params = {name: pd.prefilled(p, name, prompt) for name, prompt in prompts.items()}
    params["token"] = copy.deepcopy(params["token"])
    params["token"][PARAMS_KEY]["token"] = new_token().hex()
    p_blocks = list(params["good"]["remote_block_ids"][0])
    invalid = pd.record_load_errors(d)
    for name, prompt in prompts.items():
        d.sched.add_request(pd.decode_request("d-" + name, prompt, params[name]))
    good = {}

    def finished():
        if not good and loaded(d, "d-good"):
            good["blocks"] = d.blocks_of("d-good")
        return all(f"d-{name}" in d.outputs and d.outputs[f"d-{name}"].finished
                   for name in prompts)
    assert pd.run([p, d], finished)
    assert batches and batches[0] == 3, f"the three tags were not read at once: {batches}"
    assert "another request's token" in caplog.text
    assert "block ids repeat" in caplog.text
    assert invalid and not set(invalid) & set(good["blocks"])
    assert same_kv(p, d, p_blocks, good["blocks"], len(prompts["good"]))
    assert len(d.series("kvcached_pd_handoff_duration")) == 1, "a bad load was scattered"


@pytest.fixture
def sync_loads(monkeypatch):
    """The requests D's worker loaded synchronously (in the step that scheduled them)."""
    seen = []
    real = decode_mod.DecodeWorker._post_now

    def post_now(self, req_id, read):
        seen.append(req_id)
        return real(self, req_id, read)
    monkeypatch.setattr(decode_mod.DecodeWorker, "_post_now", post_now)
    return seen


def test_an_ipc_peers_request_is_loaded_and_computed_in_the_step_that_schedules_it(
        staged_env, ipc, sync_loads):
    """Once D's worker has told its scheduler that P's staging is mapped, P's requests
    load synchronously: unpacked in start_load_kv before the forward of the step that
    scheduled them, which computes the last prompt token at once. An asynchronous load
    takes that step, the one reporting it finished, and (vLLM's asynchronous scheduling)
    one more before the request's first forward."""
    p = pd.make_engine("p", "kv_producer", seed=23)
    d = pd.make_engine("d", "kv_consumer", seed=24)
    handoff(p, d, "r1", list(range(1, 45)))  # the first request maps P's staging
    assert sync_loads == [], "D loaded synchronously before it knew P's wire"
    assert d.connector._decode.ipc_ranks, "D's scheduler never learnt P's wire"
    prompt = list(range(60, 100))
    params = pd.prefilled(p, "r2", prompt)
    p_blocks = list(params["remote_block_ids"][0])
    d.sched.add_request(pd.decode_request("d-r2", prompt, params))
    d.step()
    assert "d-r2" in d.outputs, "the scheduling step did not yield the first token"
    assert sync_loads == ["d-r2"]
    assert same_kv(p, d, p_blocks, d.blocks_of("d-r2"), len(prompt))
    assert saw_done(p, d, "r2"), "D's DONE never reached P"
    assert settle(p, d)
    assert reads_left(d) == 0


def reads_left(d) -> int:
    """What D's worker and scheduler still hold of any load."""
    worker, sched = d.worker._decode_worker, d.connector._decode
    return (len(worker.queued) + len(worker.inflight) + len(worker.releasing)
            + len(sched.pending) + len(sched.parked))


def test_a_synchronous_load_of_another_requests_extent_fails_alone_in_its_step(
        staged_env, ipc, sync_loads, caplog):
    """Forged params on the synchronous path: the tag of the extent read is another
    request's, so the load fails in its own step (its blocks reported invalid, vLLM
    fails the request), nothing of the victim's is freed, D lives, and the victim's
    own request then loads its exact KV, synchronously too."""
    from tests.test_connector_untrusted import decode, forged, prefill
    from tests.test_connector_untrusted import same_kv as same

    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p = pd.make_engine("p", "kv_producer", seed=25)
    d = pd.make_engine("d", "kv_consumer", seed=26)
    handoff(p, d, "r1", list(range(1, 45)))
    victim, victim_blocks = prefill(p, "victim", list(range(1, 41)))
    mine, _ = prefill(p, "attacker", list(range(101, 141)))
    theft = forged(mine, offset=victim[PARAMS_KEY]["offset"],
                   request_id=victim[PARAMS_KEY]["request_id"])
    blocks, failed = decode(p, d, "d-attacker", list(range(101, 141)), theft)
    assert "d-attacker" in sync_loads
    assert failed and blocks is None, "D unpacked another request's extent"
    assert "another request's token" in caplog.text
    pd.run([p, d], lambda: False, timeout_s=1)
    assert "victim" in p.connector._prefill.staged, "P freed the victim's extent"
    assert "victim" in p.sched.requests, "P freed the victim's blocks"
    blocks, failed = decode(p, d, "d-victim", list(range(1, 41)), victim)
    assert "d-victim" in sync_loads
    assert not failed and same(p, victim_blocks, d, blocks)
    # D holds nothing; P keeps the attacker's own extent until its lease: no DONE carried
    # its token (its load failed before any unpack)
    assert pd.run([p, d], lambda: reads_left(d) == 0 and "victim" not in p.sched.requests,
                  timeout_s=10)
    assert list(p.connector._prefill.staged) == ["attacker"]


def test_an_unmapped_peer_is_mapped_again_and_its_loads_stay_correct(
        staged_env, ipc, sync_loads):
    """The idle unmap (a thread: an idle D does not step) tells the scheduler at D's
    next step. A request scheduled in that very step still loads synchronously: its
    step maps P's staging again (a handshake inside the step, the one stall of this
    path, bounded by the handshake timeout) and loads its exact KV. Once the scheduler
    has heard, the next request takes the asynchronous path (its handshake off the
    engine step), and the one after it is synchronous again."""
    p = pd.make_engine("p", "kv_producer", seed=27)
    d = pd.make_engine("d", "kv_consumer", seed=28)
    prompt = list(range(11, 50))
    handoff(p, d, "r1", prompt)
    worker = d.worker._decode_worker
    worker.idle_unmap_s = 0.3

    def unmapped():
        deadline = time.monotonic() + 5
        while worker._peers and time.monotonic() < deadline:
            time.sleep(0.05)
        return not worker._peers
    assert unmapped(), "the idle peer stayed mapped"
    params, p_blocks, d_blocks = handoff(p, d, "r2", prompt)
    assert sync_loads == ["d-r2"] and len(ipc.opened) == 2
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert unmapped(), "the idle peer stayed mapped"
    worker.idle_unmap_s = 60.0  # no further drop while the next requests run, however slow
    d.step()  # an idle step carries the worker's news
    assert not d.connector._decode.ipc_ranks, "the scheduler never heard of the unmap"
    params, p_blocks, d_blocks = handoff(p, d, "r3", prompt)
    assert sync_loads == ["d-r2"], "D loaded synchronously from a peer it knew unmapped"
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    params, p_blocks, d_blocks = handoff(p, d, "r4", prompt)
    assert sync_loads == ["d-r2", "d-r4"] and len(ipc.opened) == 3
    assert same_kv(p, d, p_blocks, d_blocks, len(prompt))


def test_the_unmap_says_how_much_of_the_gpus_memory_came_back(
        staged_env, ipc, monkeypatch, caplog):
    """The unmap's log line carries the GPU's free memory before and after the drop
    (read only when a mapping is about to go), so a run that kills P tells a dropped
    mapping whose memory stayed held apart from one never dropped."""
    caplog.set_level(logging.INFO, logger="kvcached_pd")
    reads = []
    used = iter([12 << 30, 10 << 30])

    def used_bytes(device):
        reads.append(device)
        return next(used)
    monkeypatch.setattr(decode_mod, "_used_bytes", used_bytes)
    p = pd.make_engine("p", "kv_producer", seed=29)
    d = pd.make_engine("d", "kv_consumer", seed=30)
    handoff(p, d, "r1", list(range(11, 50)))
    worker = d.worker._decode_worker
    # across two GPUs, as cuda_ipc.open_staging maps it: the tensor on D's own GPU (the
    # handle is opened in D's context, through peer access), the memory on P's; the
    # figure must come from P's GPU (2 x H100, 2026-11-26: the line read the tensor's
    # device, D's, and said 0 MiB for a killed P)
    wire = wire_of(d)
    device = torch.device("meta")  # P's GPU, as D numbers it
    wire.mapped = cuda_ipc.MappedStaging(wire.mapped.tensor, wire.mapped.events, device)
    assert wire.mapped.tensor.device != device
    worker._unmap_idle_peers()
    assert reads == [], "the GPU's memory was read with nothing to unmap"
    assert wait_unmapped(worker), "the idle peer stayed mapped"
    # the GPU holding P's staging (across two GPUs not D's own), read around the drop
    assert reads == [device] * 2
    assert "staging after 0 s without requests (its next request maps it again); the " \
           "GPU's free memory rose by 2048 MiB" in caplog.text


def test_a_failed_synchronous_load_never_lends_its_blocks_to_the_next_steps_requests(
        staged_env, ipc, sync_loads, caplog):
    """vLLM puts a synchronous load's blocks into D's prefix cache when it schedules the
    request, and its asynchronous scheduling plans step N+1 before step N's failure is
    seen. A forged request (another token) for a prompt whose blocks D has never cached
    fails in step N; the real request for the same prompt, scheduled in step N+1, hits
    the forged request's (never written) blocks. It must fail with it (vLLM's default
    ``kv_load_failure_policy=fail`` fails every running request holding invalid blocks)
    or end with P's exact KV: never run on the unwritten blocks."""
    from vllm.v1.engine import FinishReason

    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p = pd.make_engine("p", "kv_producer", seed=31)
    d = pd.make_engine("d", "kv_consumer", seed=32, prefix_caching=True)
    first = list(range(200, 244))  # its handshake maps P's staging
    d.sched.add_request(pd.decode_request("d-r1", first, pd.prefilled(p, "r1", first),
                                          block_hasher=d.block_hasher))
    assert pd.run([p, d], lambda: "d-r1" in d.outputs and d.outputs["d-r1"].finished)
    prompt = list(range(1, 41))  # two full blocks and 8 tokens
    real = pd.prefilled(p, "v", prompt)
    p_blocks = list(real["remote_block_ids"][0])
    forged = copy.deepcopy(real)
    forged[PARAMS_KEY]["token"] = new_token().hex()
    d.sched.add_request(pd.decode_request("d-forged", prompt, forged,
                                          block_hasher=d.block_hasher))
    out_n = d.schedule()
    runner_n = d.execute(out_n)  # the forged load fails here: its blocks stay unwritten
    assert sync_loads == ["d-forged"] and runner_n.kv_connector_output.invalid_block_ids
    d.sched.add_request(pd.decode_request("d-real", prompt, real,
                                          block_hasher=d.block_hasher))
    out_n1 = d.schedule()  # planned before step N's failure is seen, as vLLM does
    assert d.sched.requests["d-real"].num_computed_tokens >= 32, \
        "the real request did not hit the forged one's cached blocks (the case under test)"
    d_blocks = d.blocks_of("d-real")
    d.finish(out_n, runner_n)
    d.finish(out_n1, d.execute(out_n1))
    assert pd.run([p, d], lambda: all(r in d.outputs and d.outputs[r].finished
                                      for r in ("d-forged", "d-real")))
    assert d.outputs["d-forged"].finish_reason == FinishReason.ERROR
    if d.outputs["d-real"].finish_reason != FinishReason.ERROR:
        assert same_kv(p, d, p_blocks, d_blocks, len(prompt)), \
            "the real request ran on blocks the forged load never wrote"


def test_an_unmapped_peer_leaves_nothing_in_d_holding_p_staging(staged_env, ipc, monkeypatch,
                                                                caplog):
    """Only the last reference to the mapped tensor closes the IPC handle, and only then
    can the GPU free a dead P's staging. On 2 x H200 (2026-11-26, P killed mid-load)
    push mode's D gave P's 2 GiB back at the idle unmap and pull mode's did not (the
    holder turned out to be UCX's own mapping, not a Python reference:
    ``test_an_ipc_peer_is_loaded_without_its_memory``). Here,
    in pull mode, with what that run went through (loads on both paths, one refused by
    its tag, DONEs that no longer reach P): once the peer is unmapped, nothing in D's
    Python objects still refers to P's staging. The fake maps a tensor object of D's
    own over P's storage (as torch's IPC open does), whose lifetime the test watches."""
    caplog.set_level(logging.WARNING, logger="kvcached_pd")
    mapped_refs = []
    fake_open = ipc.open_staging

    def open_staging(export, device):
        mapped, how = fake_open(export, device)
        src = mapped.tensor
        own = torch.empty(0, dtype=src.dtype).set_(src.untyped_storage(), 0, src.shape,
                                                    src.stride())
        mapped_refs.append(weakref.ref(own))
        return cuda_ipc.MappedStaging(own, mapped.events, mapped.home), how
    monkeypatch.setattr(cuda_ipc, "open_staging", open_staging)
    p = pd.make_engine("p", "kv_producer", seed=41)
    d = pd.make_engine("d", "kv_consumer", seed=42)
    prompt = list(range(11, 50))
    handoff(p, d, "r1", prompt)
    handoff(p, d, "r2", list(range(3, 90)))
    bad = copy.deepcopy(pd.prefilled(p, "r3", prompt))
    bad[PARAMS_KEY]["token"] = new_token().hex()
    d.sched.add_request(pd.decode_request("d-r3", prompt, bad))
    assert pd.run([p, d], lambda: "d-r3" in d.outputs and d.outputs["d-r3"].finished)

    def p_is_gone(self, message):
        raise RuntimeError("prefill's NIXL agent is gone")
    monkeypatch.setattr(wires_mod.IpcWire, "send", p_is_gone)
    handoff(p, d, "r4", prompt)
    worker = d.worker._decode_worker
    assert wait_unmapped(worker), "the idle peer stayed mapped"
    assert "another request's token" in caplog.text and "could not send DONE" in caplog.text
    assert len(mapped_refs) == 1
    gc.collect()
    held = mapped_refs[0]()
    assert held is None, ("P's mapped staging is still referred to by " + ", ".join(
        type(r).__name__ for r in gc.get_referrers(held)))


def test_the_unmaps_figure_is_read_without_opening_a_context_on_ps_gpu(monkeypatch):
    """Across two GPUs the GPU read is P's; ``cudaMemGetInfo`` there would first create a
    CUDA context of D's own on P's GPU (hundreds of MiB, for D's life) only for a log
    line. The figure comes from NVML (torch.cuda.device_memory_used), or not at all."""
    def no_context(*a, **k):
        raise AssertionError("cudaMemGetInfo would open a context on P's GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda device: 5 << 30)
    assert decode_mod._used_bytes(torch.device("cuda", 1)) == 5 << 30

    def no_nvml(device):
        raise RuntimeError("NVML not available")
    monkeypatch.setattr(torch.cuda, "device_memory_used", no_nvml)
    assert decode_mod._used_bytes(torch.device("cuda", 1)) is None
    assert decode_mod._used_bytes(torch.device("cpu")) is None


def _late_pull(p, d, name: str, prompt: list[int], waited_beyond_half_s: float):
    """P prefills ``name``; its decode leg reaches D as if it had waited on D (for KV
    room) ``waited_beyond_half_s`` beyond half of P's lease already (negative: less)."""
    params = pd.prefilled(p, name, prompt)
    req = pd.decode_request("d-" + name, prompt, params)
    req.arrival_time = time.time() - params[PARAMS_KEY]["lease_s"] / 2 - waited_beyond_half_s
    d.sched.add_request(req)
    return params


@pytest.mark.parametrize("wire", ["ipc", "nixl"])
def test_a_pulled_request_that_waited_on_d_past_half_the_lease_is_not_read(
        staged_env, ipc, reads, sync_loads, monkeypatch, caplog, wire):
    """Pulled params carry no age, but P staged them before the decode leg reached D: the
    time the request then waited on D counts against half of P's lease. (Until
    2026-11-27 the half lease started at D's allocation: a request vLLM held back for KV
    room more than half a lease was read, though P may have freed the extent at its lease
    and packed another request into it.) That load fails unread, on the IPC wire's
    synchronous path and on the NIXL wire's asynchronous one; D lives, and a request that
    waited less loads exactly."""
    monkeypatch.setenv("KVCACHED_PD_WIRE", wire)
    caplog.set_level(logging.ERROR, logger="kvcached_pd")
    p = pd.make_engine("p", "kv_producer", seed=41)
    d = pd.make_engine("d", "kv_consumer", seed=42)
    handoff(p, d, "r1", list(range(1, 45)))  # the handshake (and, on ipc, the mapping)
    posted = []
    pd.wrap_method(d.worker._decode_worker, "_unpack_ready",
                   lambda real, ready: (posted.extend(r for r, _ in ready), real(ready))[1])
    errors = pd.record_load_errors(d)
    reads.clear()
    _late_pull(p, d, "late", list(range(300, 340)), 1.0)
    assert pd.run([p, d], lambda: "d-late" in d.outputs and d.outputs["d-late"].finished), \
        "D never ended the request"
    assert errors, "D's load of a request past its READ deadline did not fail"
    assert "d-late" not in posted and reads == [], "D read P's extent past its READ deadline"
    assert ("past its READ deadline" if wire == "ipc" else "past half of P's lease") \
        in caplog.text
    assert sync_loads == (["d-late"] if wire == "ipc" else [])
    failed = len(errors)
    prompt = list(range(400, 440))
    params = _late_pull(p, d, "ok", prompt, -5.0)
    p_blocks = list(params["remote_block_ids"][0])
    assert pd.run([p, d], lambda: "d-ok" in d.outputs), "the next request never loaded"
    assert same_kv(p, d, p_blocks, d.blocks_of("d-ok"), len(prompt))
    assert len(errors) == failed, "a request within its READ deadline failed its load"
    assert "d-ok" in posted if wire == "ipc" else len(reads) == 1


def test_vllm_requests_carry_the_arrival_time_a_pulled_read_deadline_counts_from(caplog):
    """The pulled-params READ deadline counts from vLLM's ``Request.arrival_time``; a
    release that stopped setting it would weaken the rule (D warns once, then counts from
    its allocation). This fails on such a release instead of passing silently."""
    from kvcached_pd.connector.decode_scheduler import DecodeScheduler, _Pending
    from kvcached_pd.connector.wire import StagedParams

    before = time.time()
    req = pd.decode_request("arrival", [1, 2, 3], {})  # vLLM's own Request class
    assert isinstance(req.arrival_time, float) and before <= req.arrival_time <= time.time()
    sched = DecodeScheduler(digest="d", block_size=16, capacity_bytes=1 << 20, tp_size=1)
    params = StagedParams(wire_version=3, engine_id="p", request_id="arrival", host="h",
                          port=1, tp_size=1, offset=0, nbytes=64, n_tok_slots=16,
                          num_tokens=3, block_size=16, lease_s=30.0, format_digest="d",
                          token="0" * 32)
    entry = _Pending(request=req, params=params, first_token=0)
    req.arrival_time = time.time() - 10.0  # ten seconds on D already
    assert sched._read_deadline(req, entry) <= time.monotonic() + 5.0
    del req.arrival_time
    caplog.set_level(logging.WARNING, logger="kvcached_pd")
    assert sched._read_deadline(req, entry) >= time.monotonic() + 14.0
    sched._read_deadline(req, entry)
    assert caplog.text.count("carries no arrival time") == 1


# ---- D's staging range: allocated only for a READ over NIXL -------------------------
def test_d_on_the_ipc_wire_never_allocates_its_decode_staging(staged_env, ipc, reads):
    """D's staging range is where a NIXL READ lands (2 x max_num_batched_tokens of KV by
    default: 4 096 of an idle kvbig D's 6 690 MiB, 2 x H200, 2026-11-27); the IPC wire
    unpacks from P's memory, so a D whose peers all take it never allocates the range."""
    p = pd.make_engine("p", "kv_producer", seed=61)
    d = pd.make_engine("d", "kv_consumer", seed=62)
    decode = d.worker._region.decode
    assert decode.allocator.capacity_bytes > 0 and not decode.allocated
    for i, prompt in enumerate((list(range(3, 40)), list(range(5, 90)))):
        params, p_blocks, d_blocks = handoff(p, d, f"r{i}", prompt)
        assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
    assert wire_of(d).name == "ipc" and reads == []
    assert not decode.allocated, "D allocated the staging range the IPC wire never uses"
    assert settle(p, d)


def test_d_allocates_its_decode_staging_at_its_first_read_over_nixl(staged_env, ipc, reads,
                                                                     caplog):
    ipc.fail_open = "the peer runs in another IPC namespace on this host"
    p = pd.make_engine("p", "kv_producer", seed=63)
    d = pd.make_engine("d", "kv_consumer", seed=64)
    decode = d.worker._region.decode
    assert not decode.allocated
    tensors = []
    with caplog.at_level(logging.INFO, logger="kvcached_pd"):
        for i, prompt in enumerate((list(range(1, 30)), list(range(9, 60)))):
            params, p_blocks, d_blocks = handoff(p, d, f"r{i}", prompt)
            assert same_kv(p, d, p_blocks, d_blocks, len(prompt))
            tensors.append(decode.tensor)
    assert wire_of(d).name == "nixl" and len(reads) == 2
    assert tensors[0] is not None and tensors[1] is tensors[0], "allocated more than once"
    assert decode.tensor.numel() == decode.allocator.capacity_bytes
    said = [r for r in caplog.records if "decode staging allocated" in r.getMessage()]
    assert len(said) == 1
    assert settle(p, d)


def test_wire_nixl_allocates_the_decode_staging_at_start_up(staged_env, ipc, monkeypatch):
    """Every peer of KVCACHED_PD_WIRE=nixl READs: the range is allocated with the engine,
    so that a device without room for it stops startup as before."""
    monkeypatch.setenv("KVCACHED_PD_WIRE", "nixl")
    d = pd.make_engine("d", "kv_consumer", seed=65)
    assert d.worker._region.decode.allocated


@pytest.mark.parametrize("what", ["allocation", "registration"])
def test_no_room_for_the_decode_staging_fails_that_load_and_a_later_one_reads(
        staged_env, ipc, reads, monkeypatch, what):
    """The device filled up since start-up (kvcached lends it to other models), or NIXL
    refused to register the range: the request that would READ fails its load through
    vLLM's own path, D lives, and the next request that needs the range allocates it."""
    from kvcached_pd.connector.region import DecodeStaging
    from kvcached_pd.transport.staging import StagingError

    ipc.fail_open = "the peer runs in another IPC namespace on this host"
    p = pd.make_engine("p", "kv_producer", seed=66)
    d = pd.make_engine("d", "kv_consumer", seed=67)
    room = {"free": False}
    if what == "allocation":
        real_ensure = DecodeStaging.ensure

        def ensure(self):
            if self.tensor is None and not room["free"]:
                raise StagingError("could not allocate the decode staging (injected)")
            return real_ensure(self)

        monkeypatch.setattr(DecodeStaging, "ensure", ensure)
    else:
        real_register = StagingAgent.register

        def register(self, tensor):
            if not room["free"]:
                raise RuntimeError("NIXL_ERR_BACKEND (injected)")
            return real_register(self, tensor)

        monkeypatch.setattr(StagingAgent, "register", register)
    invalid = pd.record_load_errors(d)
    prompt = list(range(3, 40))
    p.sched.add_request(pd.prefill_request("x1", prompt))
    assert pd.run([p], lambda: "x1" in p.outputs)
    d.sched.add_request(pd.decode_request("d-x1", prompt, p.outputs["x1"].kv_transfer_params))
    assert pd.run([p, d], lambda: bool(invalid), timeout_s=10), "no failed load reported"
    assert len(invalid) == -(-len(prompt) // 16) and reads == []
    assert not d.worker._region.decode.allocated
    assert pd.run([p, d], lambda: not d.sched.requests, timeout_s=10)
    room["free"] = True
    params, p_blocks, d_blocks = handoff(p, d, "x2", list(range(7, 50)))
    assert same_kv(p, d, p_blocks, d_blocks, 43) and len(reads) == 1
    assert d.worker._region.decode.allocated


def test_a_kv_both_worker_offers_its_prefill_range_alone(staged_env, ipc):
    """P's handshake offers what P packs into: a kv_both worker's decode range (where
    its own READs land) is not part of it, so no peer's READ or mapping reaches it."""
    b = pd.make_engine("b", "kv_both", seed=68)
    region = b.worker._region
    offered = region.handshake("b")
    assert region.plan.prefill_bytes and region.plan.decode_bytes
    assert offered.staging_bytes == region.plan.prefill_bytes
    assert not region.decode.allocated
    tensor = region.decode.ensure()
    base = offered.staging_base
    assert not base <= tensor.data_ptr() < base + offered.staging_bytes
