"""critical_path joins the client's records to both instances' trace lines, request by
request, and splits the time to first token into consecutive stages."""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import critical_path  # noqa: E402
from test_trace_timeline import write_log  # noqa: E402

CID = "load-0123456789ab-7"
OTHER = "load-fedcba987654-8"


def _mode(path, requests):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"repeats": [
        {"repeat": 0, "requests": [dict(requests[0], ttft_s=9.0, e2e_s=9.5)]},  # not a load repeat
        {"repeat": 1, "requests": requests}]}))


def _load_out(tmp_path, monkeypatch, d_alloc_t=100.050):
    out = tmp_path / "load"
    (out / "logs").mkdir(parents=True)
    # client sent at 100.000; P has it at 100.004, orders its pack at 100.020, hands the
    # extent over at 100.035; D allocates at d_alloc_t, unpacks 5 ms later; first token at
    # 100.080 (ttft 80 ms), end at 100.130
    write_log(out / "logs" / "kvpd-push-prefill.log", [
        (100.010, "p_admit", f"cmpl-{CID}-0", {"bytes": 1, "since_arrival_ms": 6.0}),
        (100.020, "pack_ordered", f"cmpl-{CID}-0", {"bytes": 1, "since_arrival_ms": 16.0}),
        (100.030, "packed", f"cmpl-{OTHER}-0,cmpl-{CID}-0", {"device_ms": 0.4, "host_ms": 0.7}),
        (100.035, "p_finished", f"cmpl-{CID}-0", {"bytes": 1}),
        (100.036, "step", "", {"start": 100.019, "until_next_ms": 17.0, "tokens": 9, "reqs": 1}),
        (100.037, "step", "", {"start": 100.036, "until_next_ms": 5000.0, "tokens": 9,
                               "reqs": 1}),  # idle after the last step: not a period
    ], monkeypatch)
    write_log(out / "logs" / "kvpd-push-decode.log", [
        (100.038, "claim_answered", f"cmpl-{CID}-0-1f2e", {"by": "scheduler"}),
        (d_alloc_t, "d_alloc", f"cmpl-{CID}-0", {"remote_req": CID, "tokens": 9,
                                                  "since_arrival_ms": 49.0}),
        (d_alloc_t + 0.005, "read_done", f"cmpl-{CID}-0", {"handoff_ms": 0.1, "host_ms": 0.2,
                                                            "tag_ms": 0.3}),
    ], monkeypatch)
    _mode(out / "modes" / "kvpd-push.json", [
        {"ok": True, "request_id": CID, "started_at": 100.000, "ttft_s": 0.080, "e2e_s": 0.130},
        # failed requests and untraced ones are no rows
        {"ok": False, "request_id": OTHER, "started_at": 100.0, "ttft_s": None, "e2e_s": None}])
    _mode(out / "modes" / "kvcached-single.json", [
        {"ok": True, "request_id": "load-aaaaaaaaaaaa-1", "started_at": 1.0, "ttft_s": 0.050,
         "e2e_s": 0.100},
        {"ok": True, "request_id": "load-aaaaaaaaaaaa-2", "started_at": 1.0, "ttft_s": 0.060,
         "e2e_s": 0.120}])
    return out


def last_rendered_line(**parts) -> str:
    """The last line render() writes for one traced mode and the given summary parts."""
    summary = {"modes": {"kvpd-push": {s: 1.0 for s in critical_path.STAGES} | {"n": 1}},
               "against": None, "steps": {}, "beside": {}, **parts}
    return critical_path.render(summary).splitlines()[-1]


def test_the_stages_are_consecutive_and_sum_to_the_clients_ttft(tmp_path, monkeypatch):
    summary = critical_path.summarize(str(_load_out(tmp_path, monkeypatch)))
    m = summary["modes"]["kvpd-push"]
    assert m["n"] == 1
    want = {"to_p": 4.0, "p_queue": 16.0, "p_step": 15.0, "hop": 15.0, "d_wait": 5.0,
            "d_out": 25.0, "answer": 3.0, "ttft": 80.0, "tail": 50.0, "kvpd": 1.2, "kvpd_gpu": 0.4}
    for stage, ms in want.items():
        assert m[stage] == pytest.approx(ms, abs=1e-3), stage
    assert sum(m[s] for s in ("to_p", "p_queue", "p_step", "hop", "d_wait", "d_out")) == \
        pytest.approx(m["ttft"], abs=1e-3)
    ref = summary["against"]
    assert ref["name"] == "kvcached-single" and ref["n"] == 2
    assert ref["ttft"] == pytest.approx(55.0) and ref["tail"] == pytest.approx(55.0)
    assert summary["steps"] == {"kvpd-push prefill": {"n": 1, "p50": 17.0, "p90": 17.0}}
    # P admitted the request in the first pass after its arrival; its log names no budget
    assert summary["passes"] == {"kvpd-push": {"n": 1, "passed_over": 0, "budget": None,
                                               "full": None, "not_full": None,
                                               "admit_p50": 6.0}}
    text = critical_path.render(summary)
    assert "kvpd-push" in text and text.splitlines()[-3].endswith("25.0")  # +ttft: 80 - 55


def test_a_stage_follows_its_events(tmp_path, monkeypatch):
    """D allocating 10 ms later: those 10 ms are the hop's, and d_out keeps what is left
    of the client's TTFT."""
    m = critical_path.summarize(str(_load_out(tmp_path, monkeypatch, 100.060)))["modes"][
        "kvpd-push"]
    assert m["hop"] == pytest.approx(25.0) and m["d_out"] == pytest.approx(15.0)


def test_no_traces_is_said_not_rendered_as_zeros(tmp_path):
    (tmp_path / "logs").mkdir()
    summary = critical_path.summarize(str(tmp_path))
    assert summary == {"modes": {}, "against": None, "steps": {}, "beside": {},
                       "first_forward": {}, "passes": {}}
    assert "no traced PD requests" in critical_path.render(summary)


def test_the_proxys_marks_split_the_way_to_p_and_ds_way_out(tmp_path, monkeypatch):
    """pd_proxy.py --trace: the proxy had the request at 100.001, sent P's leg at 100.0025
    and D's at 100.0015, read D's first bytes at 100.070 and relayed them at 100.071; the
    parts sum to to_p (4 ms) and d_out (25 ms)."""
    out = _load_out(tmp_path, monkeypatch)
    (out / "logs" / "kvpd-push-proxy.log").write_text(
        "pd_proxy listening on http://127.0.0.1:1 mode=push-concurrent\n"
        "pd_proxy trace {not json\n"
        + "pd_proxy trace " + json.dumps({"req": OTHER, "ok": False, "recv": 1.0}) + "\n"
        + "pd_proxy trace " + json.dumps({"req": CID, "ok": True, "recv": 100.001,
                                          "d_sent": 100.0015, "p_sent": 100.0025,
                                          "d_first": 100.070, "out_first": 100.071}) + "\n")
    summary = critical_path.summarize(str(out))
    m = summary["modes"]["kvpd-push"]
    want = {"to_proxy": 1.0, "proxy_p": 1.5, "p_api": 1.5, "d_sent": 0.5, "d_first": 15.0,
            "relay": 1.0, "to_client": 9.0}
    for stage, ms in want.items():
        assert m[stage] == pytest.approx(ms, abs=1e-3), stage
    assert m["to_proxy"] + m["proxy_p"] + m["p_api"] == pytest.approx(m["to_p"], abs=1e-3)
    assert m["d_first"] + m["relay"] + m["to_client"] == pytest.approx(m["d_out"], abs=1e-3)
    text = critical_path.render(summary)
    assert "The proxy's marks" in text and text.splitlines()[-3].split()[1:] == \
        ["1.0", "1.5", "1.5", "0.5", "15.0", "1.0", "9.0"]
    # without the proxy's lines there is no such table
    (out / "logs" / "kvpd-push-proxy.log").unlink()
    assert "The proxy's marks" not in critical_path.render(critical_path.summarize(str(out)))


def test_ds_steps_are_split_by_whether_one_of_ps_steps_ran_beside_them(tmp_path,
                                                                      monkeypatch):
    """D's step periods beside one of P's steps and alone: P steps 10.000-10.020 and
    10.050-10.060; D steps of 6 and 7 ms overlap them, 3 and 4 ms ones do not, one ends
    exactly where P's starts (not beside), one idle period (> 1 s) is no step."""
    logs = tmp_path / "logs"
    logs.mkdir()
    write_log(logs / "kvpd-push-prefill.log", [
        (10.021, "step", "", {"start": 10.000, "until_next_ms": 20.0, "tokens": 9, "reqs": 1}),
        (10.061, "step", "", {"start": 10.050, "until_next_ms": 10.0, "tokens": 9, "reqs": 1}),
    ], monkeypatch)
    write_log(logs / "kvpd-push-decode.log", [
        (10.1, "step", "", {"start": 9.995, "until_next_ms": 6.0, "tokens": 1, "reqs": 1}),
        (10.1, "step", "", {"start": 10.015, "until_next_ms": 7.0, "tokens": 1, "reqs": 1}),
        (10.1, "step", "", {"start": 10.025, "until_next_ms": 3.0, "tokens": 1, "reqs": 1}),
        (10.1, "step", "", {"start": 10.030, "until_next_ms": 4.0, "tokens": 1, "reqs": 1}),
        (10.1, "step", "", {"start": 10.045, "until_next_ms": 5.0, "tokens": 1, "reqs": 1}),
        (10.1, "step", "", {"start": 10.070, "until_next_ms": 2000.0, "tokens": 1, "reqs": 1}),
    ], monkeypatch)
    # a mode with P's steps and no D's (vanilla has no trace on either) is not listed
    write_log(logs / "kvpd-staged-prefill.log", [
        (10.1, "step", "", {"start": 10.0, "until_next_ms": 5.0, "tokens": 1, "reqs": 1})],
        monkeypatch)
    got = critical_path.d_steps_beside_p(
        critical_path.trace_timeline.read_events(str(logs)))
    assert got == {"kvpd-push": {"beside": {"n": 2, "p50": 6.5},
                                 "alone": {"n": 3, "p50": 4.0}}}
    assert last_rendered_line(beside=got).endswith(
        "kvpd-push 6.5 (2) / 4.0 (3)")


def test_ds_steps_are_split_by_whether_they_run_a_loaded_requests_first_forward(
        tmp_path, monkeypatch):
    """D's steps 10.000 (+8 ms: two requests' first forwards, one step), 10.008 (+3 ms),
    10.011 (+9 ms: a first forward scheduled at its very start), 10.020 (+4 ms), then
    idle (> 1 s: no step). A ``d_compute_scheduled`` line belongs to the step whose start
    precedes it and whose period has not ended: the one at 10.011 to the third step, not
    to the second, which ends there."""
    logs = tmp_path / "logs"
    logs.mkdir()
    write_log(logs / "kvpd-push-decode.log", [
        (10.0001, "d_compute_scheduled", f"cmpl-{CID}-0", {"tokens": 1}),
        (10.0002, "d_compute_scheduled", f"cmpl-{OTHER}-0", {"tokens": 1}),
        (10.008, "step", "", {"start": 10.000, "until_next_ms": 8.0, "tokens": 3, "reqs": 3}),
        (10.011, "step", "", {"start": 10.008, "until_next_ms": 3.0, "tokens": 3, "reqs": 3}),
        (10.011, "d_compute_scheduled", "cmpl-load-aaaaaaaaaaaa-3-0", {"tokens": 1}),
        (10.020, "step", "", {"start": 10.011, "until_next_ms": 9.0, "tokens": 4, "reqs": 4}),
        (10.024, "step", "", {"start": 10.020, "until_next_ms": 4.0, "tokens": 4, "reqs": 4}),
        (12.0, "step", "", {"start": 10.024, "until_next_ms": 1976.0, "tokens": 4,
                            "reqs": 4}),
    ], monkeypatch)
    # a decode without first-forward lines (an older trace) is not listed
    write_log(logs / "kvpd-staged-decode.log", [
        (10.1, "step", "", {"start": 10.0, "until_next_ms": 5.0, "tokens": 1, "reqs": 1})],
        monkeypatch)
    got = critical_path.d_steps_first_forward(
        critical_path.trace_timeline.read_events(str(logs)))
    assert got == {"kvpd-push": {"first": {"n": 2, "p50": 8.5, "p90": 8.9},
                                 "other": {"n": 2, "p50": 3.5, "p90": 3.9}}}
    assert last_rendered_line(first_forward=got).endswith(
        "kvpd-push 8.5 (2) / 3.5 (2)")


def test_ps_passes_that_went_by_a_request_are_counted_full_or_with_room(tmp_path,
                                                                        monkeypatch):
    """A request that arrived (P's API server) at 20.000 and was admitted at 20.040: P's
    passes ending at 20.010 (budget full) and 20.025 (room) went by it, the one ending
    before its arrival and the admitting one (its step line comes after the admission)
    did not. A second request admitted by the first pass after its arrival was passed over
    by none. The budget is read from vLLM's start-up line in P's log."""
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "kvpd-push-prefill.log"
    write_log(log, [
        (19.995, "step", "", {"start": 19.990, "until_next_ms": 5.0, "tokens": 100, "reqs": 1}),
        (20.011, "step", "", {"start": 20.010, "until_next_ms": 15.0, "tokens": 4096,
                              "reqs": 2}),
        (20.026, "step", "", {"start": 20.025, "until_next_ms": 16.0, "tokens": 300, "reqs": 1}),
        (20.040, "p_admit", f"cmpl-{CID}-0", {"bytes": 1, "since_arrival_ms": 40.0}),
        (20.040, "p_admit", f"cmpl-{OTHER}-0", {"bytes": 1, "since_arrival_ms": 10.0}),
        (20.041, "step", "", {"start": 20.041, "until_next_ms": 9.0, "tokens": 900, "reqs": 2}),
    ], monkeypatch)
    with open(log, "a") as f:
        f.write("(EngineCore pid=1) INFO 11-21 10:00:00 [arg_utils.py:1] Chunked prefill is "
                "enabled with max_num_batched_tokens=4096.\n")
    assert critical_path.prefill_budget(str(log)) == 4096
    assert critical_path.prefill_budget(str(logs / "none-prefill.log")) is None
    events = critical_path.trace_timeline.read_events(str(logs))
    got = critical_path.passes_before_admit(events, {"kvpd-push": 4096})
    assert got == {"kvpd-push": {"n": 2, "passed_over": 1, "budget": 4096, "full": 1,
                                 "not_full": 1, "admit_p50": 25.0}}
    # no budget known: the passes are counted, not split
    unknown = critical_path.passes_before_admit(events, {})["kvpd-push"]
    assert (unknown["passed_over"], unknown["full"], unknown["not_full"]) == (1, None, None)
    assert last_rendered_line(passes=got).endswith(
        "kvpd-push 1 of 2, 1 / 1 (budget 4096), 25.0")
    # summarize reads the budget from each mode's P log
    assert critical_path.summarize(str(tmp_path))["passes"] == got
