"""trace_timeline joins the prefill and decode instances' trace lines per request."""

from __future__ import annotations

import logging
import os
import sys

import pytest

EXP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, EXP)

import trace_timeline

from kvcached_pd.transport import trace


def write_log(path, events, monkeypatch):
    """Emit events through kvcached-pd's own trace() into a vLLM-like log file."""
    monkeypatch.setenv("KVCACHED_PD_TRACE", "1")
    trace.reset()
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("(EngineCore pid=1) INFO 11-21 10:00:00 [x.py:1] %(message)s"))
    logger = logging.getLogger("kvcached_pd")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    clock = iter(t for t, *_ in events)
    monkeypatch.setattr(trace, "_clock", lambda: next(clock))
    try:
        for _, ev, req, fields in events:
            trace.trace(ev, req, **fields)
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(old)
        monkeypatch.undo()
        trace.reset()


def test_stages_are_joined_across_instances(tmp_path, monkeypatch):
    mib = 64 << 20
    write_log(tmp_path / "staged-prefill.log", [
        (99.990, "p_admit", "P1", {"bytes": mib, "waited": True, "since_arrival_ms": 20.0}),
        (100.000, "pack_ordered", "P1", {"bytes": mib, "since_arrival_ms": 30.0}),
        (100.010, "packed", "P1,P0", {"bytes": 2 * mib, "device_ms": 0.2, "host_ms": 0.1}),
        (100.011, "p_finished", "P1", {"bytes": mib}),
        (100.030, "p_released", "P1", {"held_ms": 19.0}),
    ], monkeypatch)
    write_log(tmp_path / "staged-decode.log", [
        (100.013, "d_match", "D1", {"tokens": 256, "since_arrival_ms": 1.0}),
        (100.015, "d_alloc", "D1", {"remote_req": "P1", "tokens": 256, "since_arrival_ms": 3.0}),
        (100.017, "read_posted", "D1", {"remote_req": "P1", "bytes": mib}),
        (100.018, "read_done", "D1", {"bytes": mib, "handoff_ms": 0.5, "host_ms": 0.3,
                                      "tag_ms": 0.04}),
        (100.021, "d_recv_reported", "D1", {}),
        (100.046, "d_compute_scheduled", "D1", {"tokens": 1}),
        # a request that took the direct path has no READ of its own: not a staged row
        (100.100, "d_alloc", "D2", {"remote_req": "P2", "tokens": 16, "since_arrival_ms": 1.0}),
    ], monkeypatch)
    (tmp_path / "unrelated.txt").write_text("kvcached-pd trace {\"ev\": \"x\", \"req\": 1}\n")
    summary = trace_timeline.summarize(str(tmp_path))
    assert list(summary) == ["staged"]
    (row,) = summary["staged"]
    assert row["mib"] == 64 and row["n"] == 1
    assert row["d_arrival_to_alloc"] == 3.0 and row["d_alloc_to_post"] == pytest.approx(2.0)
    assert row["d_arrival_to_match"] == 1.0
    assert row["d_match_to_alloc"] == pytest.approx(2.0)
    assert row["d_read_seen"] == 0.5 and row["d_unpack_host"] == 0.3 and row["d_tag"] == 0.04
    assert row["d_seen_to_reported"] == pytest.approx(3.0)
    assert row["d_reported_to_compute"] == pytest.approx(25.0)
    assert row["p_pack_device"] == 0.2  # one pack event of the step, both its requests
    assert row["p_pack_host"] == 0.1 and row["p_arrival_to_admit"] == 20.0
    assert row["p_arrival_to_order"] == 30.0 and row["p_held"] == 19.0
    assert row["p_finish_to_d_alloc"] == pytest.approx(4.0)
    text = trace_timeline.render(summary)
    assert "staged" in text and "64.0" in text


def test_no_trace_lines_say_so(tmp_path):
    (tmp_path / "vanilla-decode.log").write_text("INFO nothing traced here\n")
    assert trace_timeline.summarize(str(tmp_path)) == {}
    assert "KVCACHED_PD_TRACE" in trace_timeline.render({})
