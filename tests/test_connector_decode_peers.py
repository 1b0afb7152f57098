"""D's view of its peers when requests name them (issue 21): the handshake cache and
the claim probe are keyed by (engine id, host, port), probes to dead or forged targets
cannot hold back a real P's verdict, and what requests can grow is bounded. Real NIXL
agents on host memory, real listeners on loopback."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from kvcached_pd.connector import decode_scheduler
from kvcached_pd.connector.decode_scheduler import ClaimProbe, DecodeScheduler
from kvcached_pd.connector.decode_worker import DecodeWorker
from kvcached_pd.connector.region import DecodeStaging, StagingAgent, StagingRegion
from kvcached_pd.connector.side_channel import HandshakeListener
from kvcached_pd.connector.wire import WIRE_VERSION, StagedParams, WireError, format_hash
from kvcached_pd.transport.format import PackedFormat
from kvcached_pd.transport.staging import StagingBuffer
from tests.support.dead_ports import dead_ports

FMT = PackedFormat(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
DIGEST = format_hash(FMT, 0, FMT.num_kv_heads)


def region() -> StagingRegion:
    """A rank-0 staging region on host memory with its own NIXL agent (what the
    handshake and the probe use of it; no KV cache behind it)."""
    buffer = StagingBuffer(1 << 20, "cpu")
    agent = StagingAgent(buffer.tensor)
    return StagingRegion(fmt=FMT, plan=None, buffer=buffer, agent=agent,
                         decode=DecodeStaging(1 << 20, torch.device("cpu"), agent), layers=None,
                         kernel_block_size=16, ratio=1, tp_rank=0, tp_size=1, head_start=0,
                         head_count=FMT.num_kv_heads)


def params(engine_id: str, port: int) -> StagedParams:
    return StagedParams(wire_version=WIRE_VERSION, engine_id=engine_id,
                        request_id="r-0a0b0c0d", host="127.0.0.1", port=port, tp_size=1,
                        offset=0, nbytes=4096, n_tok_slots=16, num_tokens=16, block_size=16,
                        lease_s=30.0, format_digest=DIGEST, token="0" * 32)


@pytest.fixture
def peers():
    """Two prefill regions serving handshakes that both say engine "E", and a third
    saying "F"; closed after the test."""
    regions, listeners = [], []

    def serve(engine_id: str) -> tuple[StagingRegion, int]:
        r = region()
        listener = HandshakeListener("127.0.0.1", 0, {0: r.handshake(engine_id).encode()})
        regions.append(r)
        listeners.append(listener)
        return r, listener.port
    yield serve
    for listener in listeners:
        listener.close()
    for r in regions:
        r.agent.close()


def test_the_handshake_cache_is_keyed_by_engine_host_and_port(peers):
    """Keyed by engine id alone, the first request naming engine E pinned whatever
    agent its host served for every later request naming E."""
    forged, forged_port = peers("E")
    real, real_port = peers("E")
    other, other_port = peers("F")
    d = DecodeWorker(region())
    try:
        first = d._peer(params("E", forged_port)).result(timeout=10).handshake
        assert first.agent_name == forged.agent.name
        second = d._peer(params("E", real_port)).result(timeout=10).handshake
        assert second.agent_name == real.agent.name
        # a listener of another engine is no handshake for E
        with pytest.raises(WireError, match="is prefill F, not E"):
            d._peer(params("E", other_port)).result(timeout=10)
    finally:
        d.close()
        d.region.agent.close()


def test_a_no_for_a_forged_host_does_not_stick_to_the_real_engine(peers):
    """One forged host for a real engine id cached "no" for that id for 300 s."""
    _, port = peers("E")
    probe = ClaimProbe(DIGEST, 1, timeout_s=0.3)
    try:
        with dead_ports() as (dead,):
            assert until_decided(probe, "E", dead)[0] == "no"
        assert until_decided(probe, "E", port) == ("yes", "")
    finally:
        probe.close()


def until_decided(probe: ClaimProbe, engine_id: str, port: int) -> tuple[str, str]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        verdict = probe.verdict(engine_id, "127.0.0.1", port)
        if verdict[0] != "wait":
            return verdict
        time.sleep(0.005)
    raise AssertionError("no verdict")


def test_probes_of_dead_targets_do_not_hold_back_a_real_ps_verdict(peers):
    """One probe worker, 2 s per dead target: 5 forged requests delayed the real P's
    verdict by 10 s. Now the real P is answered while they are still being asked."""
    _, port = peers("E")
    probe = ClaimProbe(DIGEST, 1, timeout_s=3.0)
    try:
        with dead_ports(5) as dead:
            for i, p in enumerate(dead):
                assert probe.verdict(f"forged-{i}", "127.0.0.1", p)[0] == "wait"
            assert until_decided(probe, "E", port) == ("yes", "")
            assert "wait" in [probe.verdict(f"forged-{i}", "127.0.0.1", p)[0]
                              for i, p in enumerate(dead)]
    finally:
        probe.close()


def test_with_every_probe_worker_busy_a_new_target_is_not_held_back_nor_cached(peers):
    _, port = peers("E")
    probe = ClaimProbe(DIGEST, 1, timeout_s=1.0, workers=2)
    try:
        with dead_ports(2) as dead:
            for i, p in enumerate(dead):
                assert probe.verdict(f"forged-{i}", "127.0.0.1", p)[0] == "wait"
            verdict, reason = probe.verdict("E", "127.0.0.1", port)
            assert verdict == "no" and "being asked already" in reason
            for i, p in enumerate(dead):
                assert until_decided(probe, f"forged-{i}", p)[0] == "no"
        # a worker is free: the real P is asked, not answered from a cached "no"
        assert until_decided(probe, "E", port) == ("yes", "")
    finally:
        probe.close()


def test_what_requests_name_is_bounded(monkeypatch):
    """refused_peers (and the probe and handshake caches) grew with every engine id a
    request named."""
    monkeypatch.setattr(decode_scheduler, "MAX_PEERS", 64)
    scheduler = DecodeScheduler(digest=DIGEST, block_size=16, capacity_bytes=1 << 20,
                                tp_size=1)
    for i in range(130):
        request = SimpleNamespace(request_id=f"r{i}", prompt_token_ids=[1] * 16,
                                  kv_transfer_params={"do_remote_prefill": True,
                                                      "remote_engine_id": f"e{i}"})
        assert scheduler.match(request, 0) is None  # no staged params: vLLM's own path
    assert len(scheduler.refused_peers) == 64
    assert "e129" in scheduler.refused_peers and "e0" not in scheduler.refused_peers


def test_a_peer_loads_synchronously_only_once_every_rank_has_mapped_it():
    """TP 2: each rank's worker reports its own wire (``WorkerReport.ipc_peers``, merged
    over the ranks before D's scheduler sees it). One rank's mapping is not enough: the
    other rank would have to map P inside the engine step. Once both ranks report,
    the peer's requests load synchronously (vLLM told: tokens to load, not async, the
    last prompt token computed in the step); one rank's unmap turns them back."""
    from kvcached_pd.connector.records import WorkerReport
    from kvcached_pd.connector.wire import PARAMS_KEY

    scheduler = DecodeScheduler(digest=DIGEST, block_size=16, capacity_bytes=1 << 20,
                                tp_size=2)
    staged = StagedParams(wire_version=WIRE_VERSION, engine_id="p1",
                          request_id="r-0a0b0c0d", host="127.0.0.1", port=5600, tp_size=2,
                          offset=0, nbytes=FMT.extent_bytes(48), n_tok_slots=48,
                          num_tokens=40, block_size=16, lease_s=30.0, format_digest=DIGEST,
                          token="0" * 32)

    def match(n: int):
        request = SimpleNamespace(request_id=f"r{n}", prompt_token_ids=[1] * 40,
                                  kv_transfer_params={"do_remote_prefill": True,
                                                      PARAMS_KEY: staged.to_params()})
        return scheduler.match(request, 0)

    peer = ("p1", "127.0.0.1", 5600)
    rank0 = WorkerReport(ipc_peers={(*peer, 0): True})
    scheduler.on_wires(rank0.aggregate(WorkerReport()).ipc_peers)
    assert match(1) == (40, True), "one rank of two mapped: still asynchronous"
    scheduler.on_wires(WorkerReport().aggregate(
        WorkerReport(ipc_peers={(*peer, 1): True})).ipc_peers)
    assert match(2) == (39, False)
    scheduler.on_wires(WorkerReport(ipc_peers={(*peer, 1): False}).ipc_peers)
    assert match(3) == (40, True)
    other = StagedParams(**{**staged.__dict__, "port": 5700})
    staged = other
    assert match(4) == (40, True), "another host:port for the same engine id is not that peer"


def test_a_request_preempted_before_its_unpack_was_reported_computes_its_prompt_again():
    """vLLM preempts a request (its blocks freed, its computed tokens reset) between its
    load and the worker's word that the unpack ran: asked again, D loads nothing (P's
    extent may be freed by then: a second load would fail its tag, and the request with
    it) and vLLM computes the prompt itself."""
    from kvcached_pd.connector.decode_scheduler import _Pending

    scheduler = DecodeScheduler(digest=DIGEST, block_size=16, capacity_bytes=1 << 20,
                                tp_size=1)
    request = SimpleNamespace(request_id="r1", prompt_token_ids=[1] * 16,
                              kv_transfer_params={"do_remote_prefill": True,
                                                  "remote_engine_id": "p1"})
    scheduler.parked["r1"] = _Pending(request, params("p1", 5600), 0)
    assert scheduler.match(request, 0) == (0, False)
    assert scheduler.on_alloc(request, None, 0), "the inner connector would notify P now"
