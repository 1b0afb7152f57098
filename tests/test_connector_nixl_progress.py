"""kvcached-pd's own NIXL agent moves data and notifications for a peer that makes no
NIXL call (an idle prefill engine): its progress thread serves that side. Real NIXL
agents on host memory."""

from __future__ import annotations

import time

import pytest
import torch

from kvcached_pd.connector.region import StagingAgent

pytest.importorskip("nixl._api")


def test_a_read_and_a_notification_complete_while_the_target_makes_no_nixl_call():
    """D READs from P's staging and sends P a notification while P's thread makes no NIXL
    call at all: only P's progress thread can serve P's side (over TCP, or UCX's pipeline
    on one GPU, UCX needs it). Without a progress thread the same READ never completes."""
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
