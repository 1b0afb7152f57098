"""ttft_batch_timeline joins each TTFT-batch client record to its instances' trace lines."""

from __future__ import annotations

import json
import os
import sys

EXP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, EXP)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ttft_batch_timeline  # noqa: E402
from test_trace_timeline import write_log  # noqa: E402


def _load_dir(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "modes").mkdir()
    p = "cmpl-load-aaaa11112222-{}-0-p"
    d = "cmpl-load-aaaa11112222-{}-0-d"
    old = "cmpl-load-bbbb33334444-1-0-d"  # index 1 of the load run after the batch
    write_log(str(logs / "kvpd-staged-prefill.log"), [
        (100.010, "p_admit", p.format(0), {"since_arrival_ms": 5.0}),
        (100.150, "p_admit", p.format(1), {"since_arrival_ms": 140.0}),  # staging was full
        (100.090, "p_finished", p.format(0), {}),
        (100.200, "p_finished", p.format(1), {}),
    ], monkeypatch)
    write_log(str(logs / "kvpd-staged-decode.log"), [
        (100.100, "d_match", d.format(0), {"since_arrival_ms": 4.0}),
        (100.105, "read_done", d.format(0), {"handoff_ms": 1.0}),
        (100.104, "d_compute_scheduled", d.format(0), {"tokens": 1}),
        (100.140, "step", "", {"start": 100.1035, "until_next_ms": 36.5, "tokens": 1,
                               "reqs": 1}),  # the step that scheduled request 0's forward
        (100.220, "d_match", d.format(1), {"since_arrival_ms": 8.0}),
        (100.226, "read_done", d.format(1), {"handoff_ms": 1.0}),
        (100.224, "d_compute_scheduled", d.format(1), {"tokens": 1}),
        (500.0, "d_match", old, {"since_arrival_ms": 1.0}),  # the harness's loads follow
        (500.1, "d_compute_scheduled", old, {"tokens": 1}),  # its TTFT batch
    ], monkeypatch)
    client = [{"index": i, "name": f"ttft-{i}-3000", "started_at": 100.0 + i / 1000,
               "ttft_s": ttft, "e2e_s": 0.6} for i, ttft in ((0, 0.160), (1, 0.281))]
    (tmp_path / "modes" / "kvpd-staged.json").write_text(json.dumps(
        {"ttft": {"requests": client}}))
    return tmp_path


def test_each_batch_request_gets_its_own_stages(tmp_path, monkeypatch, capsys):
    load = _load_dir(tmp_path, monkeypatch)
    with open(load / "modes" / "kvpd-staged.json") as f:
        client = json.load(f)["ttft"]["requests"]
    events = ttft_batch_timeline.read_events(str(load / "logs"))["kvpd-staged"]
    first, second = ttft_batch_timeline.batch_rows(client, events["prefill"], events["decode"])
    assert first == {"name": "ttft-0-3000", "P arr": 5.0, "P adm": 10.0, "P fin": 90.0,
                     "D arr": 96.0, "D match": 100.0, "D read": 105.0, "D step": 104.0,
                     "step ms": 36.5, "1st tok": 160.0, "step>tok": 56.0}
    # the second waited 140 ms for room in P's staging; the later run's index 1 is not it
    assert (second["P arr"], second["P adm"]) == (10.0, 150.0)
    assert (second["D step"], second["1st tok"], second["step>tok"]) == (224.0, 282.0, 58.0)
    assert second["step ms"] is None  # no step line covers its scheduling
    assert ttft_batch_timeline.main([str(load), "--modes", "kvpd-staged,kvpd-push"]) == 0
    out = capsys.readouterr().out
    assert "ttft-1-3000" in out and "kvpd-push: no " in out


def test_a_mode_without_trace_lines_prints_dashes(tmp_path, monkeypatch):
    load = _load_dir(tmp_path, monkeypatch)
    with open(load / "modes" / "kvpd-staged.json") as f:
        client = json.load(f)["ttft"]["requests"]
    rows = ttft_batch_timeline.batch_rows(client, [], [])
    assert [r["1st tok"] for r in rows] == [160.0, 282.0]
    assert all(r["D step"] is None and r["step>tok"] is None for r in rows)
    assert "-" in ttft_batch_timeline.render("x", rows)
