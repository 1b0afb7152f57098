"""kvcached-pd's own NIXL agent waits for UCX's events instead of spinning a CPU, and
still moves data and notifications for a peer that makes no NIXL call (an idle prefill
engine). Real NIXL agents on host memory."""

from __future__ import annotations

import time

import pytest
import torch

from kvcached_pd.connector import region
from kvcached_pd.connector.region import PROGRESS_WAIT_US, StagingAgent

nixl_api = pytest.importorskip("nixl._api")


@pytest.fixture
def recorded(monkeypatch):
    """The progress-thread delay of every agent built, as NIXL's bindings receive it."""
    bindings = nixl_api.nixlBind
    real = bindings.nixlAgent
    delays: list[int] = []

    def recorder(name, config):
        delays.append(config.pthrDelay)
        return real(name, config)

    monkeypatch.setattr(bindings, "nixlAgent", recorder)
    return delays


def test_kvcached_pds_agent_waits_for_events_and_vllms_is_left_alone(recorded):
    """Our staging agent's progress thread gets a delay (it sleeps in poll() on UCX's
    events instead of holding a CPU); the bindings are as before afterwards, so an agent
    built the way vLLM builds its own still gets NIXL's own setting."""
    agent = StagingAgent(torch.zeros(4096, dtype=torch.uint8))
    try:
        assert recorded == [PROGRESS_WAIT_US] and PROGRESS_WAIT_US > 0
        assert nixl_api.nixlBind.nixlAgent.__name__ == "recorder"
        plain = nixl_api.nixl_agent("vllm-like", nixl_api.nixl_agent_config(backends=["UCX"]))
        assert recorded[-1] == 0 and plain is not None
    finally:
        agent.close()


def test_an_api_without_the_bindings_constructor_builds_the_agent_as_nixl_does(monkeypatch):
    monkeypatch.delattr(nixl_api, "nixlBind")
    built = []
    monkeypatch.setattr(nixl_api, "nixl_agent", lambda name, config: built.append(name) or name)
    assert region.build_nixl_agent("a", object()) == "a" and built == ["a"]


def test_a_config_without_the_delay_field_still_builds_the_agent(monkeypatch):
    """A NIXL whose agent config has no ``pthrDelay`` builds the agent as it would."""
    class Strict:  # no such field, and none can be added (as on a pybind11 object)
        __slots__ = ()

    seen = []
    monkeypatch.setattr(nixl_api.nixlBind, "nixlAgent",
                        lambda name, config: seen.append((name, type(config))) or name)
    monkeypatch.setattr(nixl_api, "nixl_agent",
                        lambda name, config: nixl_api.nixlBind.nixlAgent(name, Strict()))
    assert region.build_nixl_agent("old", object()) == "old" and seen == [("old", Strict)]


def test_a_read_and_a_notification_complete_while_the_target_makes_no_nixl_call():
    """D READs from P's staging and sends P a notification while P's thread makes no NIXL
    call at all: only P's progress thread can serve P's side (over TCP UCX needs it).
    Without a progress thread the same READ never completes."""
    source = torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8)
    p = StagingAgent(source)
    d = StagingAgent(torch.zeros(8 << 20, dtype=torch.uint8))
    try:
        peer = d.agent.add_remote_agent(p.metadata())
        peer = peer.decode() if isinstance(peer, bytes) else peer
        p.agent.add_remote_agent(d.metadata())
        landing = torch.zeros(8 << 20, dtype=torch.uint8)
        d.register(landing)
        handle = d.agent.initialize_xfer(
            "READ", d.agent.get_xfer_descs([(landing.data_ptr(), landing.numel(), 0)], "DRAM"),
            d.agent.get_xfer_descs([(p.base, p.nbytes, 0)], "DRAM"), peer, b"read")
        state, deadline = d.agent.transfer(handle), time.monotonic() + 30
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            state = d.state(handle)
        d.release(handle)
        assert state == "DONE"
        assert torch.equal(landing, source)
        d.send(peer, b"done-1")
        got, deadline = [], time.monotonic() + 30
        while b"done-1" not in got and time.monotonic() < deadline:
            time.sleep(0.01)
            got += p.notifications()
        assert b"read" in got and b"done-1" in got
    finally:
        d.close()
        p.close()
