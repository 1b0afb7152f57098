"""Offline tests of the load harness (pd_load.py) and the proxy's abort propagation,
against fake_vllm.py: no GPU, no vLLM needed.

Each failure the harness exists to catch is made to happen on the fake and must fail the
mode: a differing output, a dead server, staging left behind; a metric the instance does
not export must not pass.

run: python -m pytest experiments/tests/test_load_harness.py -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXP = os.path.dirname(HERE)
sys.path.insert(0, EXP)

import gpu_memory  # noqa: E402
import load_checks  # noqa: E402
import load_client  # noqa: E402
import pd_common  # noqa: E402
import pd_load  # noqa: E402
import pd_modes  # noqa: E402
import pd_proxy  # noqa: E402
import pd_servers  # noqa: E402

FAKE = [sys.executable, os.path.join(HERE, "fake_vllm.py")]
_ports = pd_servers.PortAllocator(13000)  # below the ephemeral range: see PortAllocator

# A load the fake serves in about a second per mode: prefills of 20 ms per 1000 tokens,
# a streamed token every 3 ms, so that aborts land during either leg.
SLOW = {"FAKE_VLLM_PREFILL_MS_PER_KTOK": "20", "FAKE_VLLM_TOKEN_MS": "3"}
# ... and one of ~1.5 s (16 tokens of 30 ms, three waves), so that a kill at 0.9 s lands
# after the first wave completed and before the last, even on a loaded 2-core machine
KILLABLE = {"FAKE_VLLM_TOKEN_MS": "30"}


def _run_load(tmp_path, *args, env_extra=None, timeout=200):
    out = tmp_path / "load"
    base = _ports.take()
    cmd = [sys.executable, os.path.join(EXP, "pd_load.py"), "--out", str(out),
           "--vllm-cmd", " ".join(FAKE), "--model", "fake-model", "--health-timeout", "30",
           "--requests", "18", "--concurrency", "6", "--max-prompt-tokens", "3000",
           "--port-base", str(base + 100), "--side-channel-port-base", str(base + 300),
           "--proxy-port-base", str(base + 500), "--deadline-s", "150", "--no-environment",
           *args]
    env = dict(os.environ, FAKE_VLLM_START_DELAY="0.1", **dict(SLOW, **(env_extra or {})))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text())
    return res, summary, out


# ---- the mode table --------------------------------------------------------------------


def test_load_flavours_run_kvcached_defaults_and_pick_the_layout():
    modes = {m.name: m for m in pd_modes.load_modes(["vanilla", "kvpd-staged", "kvpd-push"])}
    assert list(modes) == ["reference", "vanilla", "kvpd-staged", "kvpd-push"]
    staged = modes["kvpd-staged"].prefill.env
    assert staged == {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1", "KVCACHED_PD": "1",
                      "KVCACHED_PD_TRANSPORT": "staged"}  # nothing else: kvcached's defaults
    assert modes["kvpd-push"].connector == "NixlPushConnector"
    assert modes["vanilla"].decode.env["ENABLE_KVCACHED"] == "false"
    split = pd_modes.load_modes(["kvpd-staged"], layout="split")[1]
    assert split.decode.env["KVCACHED_CONTIGUOUS_LAYOUT"] == "false"


def test_kvcached_single_is_one_kvcached_instance_without_pd():
    modes = {m.name: m for m in pd_modes.load_modes(["kvcached-single", "kvpd-staged"])}
    single = modes["kvcached-single"]
    assert not single.is_pd and single.prefill is None
    assert single.single.env == {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1",
                                 "KVCACHED_PD": "0"}  # kvcached's defaults, kvcached-pd off
    split = pd_modes.load_modes(["kvcached-single"], layout="split")[1]
    assert split.single.env["KVCACHED_CONTIGUOUS_LAYOUT"] == "false"


def test_p_sync_flavours_turn_off_async_scheduling_on_the_side_they_name_only():
    modes = {m.name: m for m in pd_modes.load_modes(
        ["kvpd-push", "kvpd-push-p-sync", "kvpd-push-sync", "vanilla-p-sync",
         "kvcached-single-sync"])}
    flag = ("--no-async-scheduling",)
    assert modes["kvpd-push"].prefill.serve_args == modes["kvpd-push"].decode.serve_args == ()
    p_sync = modes["kvpd-push-p-sync"]
    assert (p_sync.prefill.serve_args, p_sync.decode.serve_args) == (flag, ())
    assert p_sync.prefill.env == modes["kvpd-push"].prefill.env  # nothing else differs
    assert p_sync.connector == "NixlPushConnector"
    both = modes["kvpd-push-sync"]
    assert (both.prefill.serve_args, both.decode.serve_args) == (flag, flag)
    assert modes["vanilla-p-sync"].prefill.serve_args == flag
    assert modes["vanilla-p-sync"].prefill.env["ENABLE_KVCACHED"] == "false"
    assert modes["kvcached-single-sync"].single.serve_args == flag
    # the instance's flags come after the harness's own and before the operator's
    settings = pd_servers.ServeSettings(model="m", max_model_len=4096,
                                        gpu_memory_utilization=0.1, kv_cache_bytes=None,
                                        vllm_cmd=["vllm", "serve"],
                                        extra_args=["--async-scheduling"])
    args = pd_servers.serve_args(settings, 8000, 16, None, flag)
    assert args[-2:] == ["--no-async-scheduling", "--async-scheduling"]
    assert "--no-async-scheduling" not in pd_servers.serve_args(settings, 8000, 16, None)


def test_p_side_flavours_change_p_alone_and_mps_ones_need_a_server(tmp_path, monkeypatch,
                                                                   capsys):
    """The P-side variants (MPS priority, MPS SM share, shorter steps) give P, and only P,
    their setting over push P-sync; a flavour whose setting only an MPS server reads is
    refused before any server starts where no MPS control daemon runs."""
    names = ["kvpd-push-p-sync", "kvpd-push-p-sync-lowprio", "kvpd-push-p-sync-sm60",
             "kvpd-push-p-sync-mbt2k", "kvpd-push-p-sync-mbt16k", "vanilla-p-sync",
             "vanilla-p-sync-lowprio"]
    modes = {m.name: m for m in pd_modes.load_modes(names)}
    base = modes["kvpd-push-p-sync"]
    for name, key, value in (("kvpd-push-p-sync-lowprio", "CUDA_MPS_CLIENT_PRIORITY", "1"),
                             ("kvpd-push-p-sync-sm60", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                              "60"),
                             ("vanilla-p-sync-lowprio", "CUDA_MPS_CLIENT_PRIORITY", "1")):
        m = modes[name]
        assert m.prefill.env[key] == value and key not in m.decode.env
        twin = modes["vanilla-p-sync" if name.startswith("vanilla") else "kvpd-push-p-sync"]
        assert {k: v for k, v in m.prefill.env.items() if k != key} == twin.prefill.env
        assert m.decode == twin.decode and m.prefill.serve_args == twin.prefill.serve_args
        assert pd_modes.LOAD_FLAVOURS[name].needs_mps
    for name, budget in (("kvpd-push-p-sync-mbt2k", "2048"),
                         ("kvpd-push-p-sync-mbt16k", "16384")):
        m = modes[name]
        assert m.prefill.serve_args == ("--no-async-scheduling", "--max-num-batched-tokens",
                                        budget)
        assert m.prefill.env == base.prefill.env and m.decode == base.decode
        assert not pd_modes.LOAD_FLAVOURS[name].needs_mps
    # no control daemon in the pipe folder: refused, naming the modes and the way out
    pipes = tmp_path / "pipes"
    pipes.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipes))
    argv = ["--out", str(tmp_path), "--model", str(tmp_path), "--modes",
            "kvpd-push-p-sync,kvpd-push-p-sync-lowprio"]
    with pytest.raises(SystemExit):
        pd_load.parse_args(argv)
    err = capsys.readouterr().err
    assert "kvpd-push-p-sync-lowprio" in err and "with_mps.sh" in err
    pd_load.parse_args(argv[:-1] + ["kvpd-push-p-sync,kvpd-push-p-sync-mbt2k"])
    (pipes / "nvidia-cuda-mps-control.pid").write_text("1\n")  # a daemon runs there
    assert pd_load.parse_args(argv).modes[1] == "kvpd-push-p-sync-lowprio"


def test_prefill_graph_flavours_add_capture_sizes_to_p_or_the_one_instance_alone():
    """kvpd-push-p-sync-pgraphs: push P-sync with vLLM's CUDA graph sizes up to 8192
    tokens on P alone; kvcached-single-graphs: the one instance with the same sizes, for
    an even comparison."""
    modes = {m.name: m for m in pd_modes.load_modes([
        "kvcached-single", "kvcached-single-graphs", "kvpd-push-p-sync",
        "kvpd-push-p-sync-pgraphs", "kvpd-push-p-sync-sm60", "kvpd-push-p-sync-pgraphs-sm60"])}
    base, ab = modes["kvpd-push-p-sync"], modes["kvpd-push-p-sync-pgraphs"]
    assert ab.prefill.serve_args == base.prefill.serve_args + pd_modes.PREFILL_GRAPHS
    assert ab.prefill.env == base.prefill.env and ab.decode == base.decode
    # both P-side changes together: pgraphs' flags, sm60's MPS share, D as push P-sync's
    both, sm60 = modes["kvpd-push-p-sync-pgraphs-sm60"], modes["kvpd-push-p-sync-sm60"]
    assert both.prefill.serve_args == ab.prefill.serve_args
    assert both.prefill.env == sm60.prefill.env != base.prefill.env
    assert both.decode == base.decode
    assert pd_modes.LOAD_FLAVOURS["kvpd-push-p-sync-pgraphs-sm60"].needs_mps
    one, one_graphs = modes["kvcached-single"], modes["kvcached-single-graphs"]
    assert one_graphs.single.serve_args == one.single.serve_args + pd_modes.PREFILL_GRAPHS
    assert one_graphs.single.env == one.single.env
    sizes = json.loads(pd_modes.PREFILL_GRAPHS[1])["cudagraph_capture_sizes"]
    assert sizes == sorted(set(sizes)) and sizes[-1] == 8192 and 512 in sizes


def test_no_tail_graph_flavour_leaves_the_patch_out_on_both_sides_and_nothing_else():
    """The A/B twin of push P-sync: both instances name prompt_tail_graph in
    KVCACHED_PD_DISABLE (a name kvcached-pd knows), every other setting as push P-sync's."""
    from kvcached_pd.patches import PATCH_NAMES

    modes = {m.name: m for m in pd_modes.load_modes(["kvpd-push-p-sync",
                                                      "kvpd-push-p-sync-no-tail-graph"])}
    base, ab = modes["kvpd-push-p-sync"], modes["kvpd-push-p-sync-no-tail-graph"]
    for side in ("prefill", "decode"):
        mine, theirs = getattr(ab, side), getattr(base, side)
        assert mine.env.pop("KVCACHED_PD_DISABLE") in PATCH_NAMES
        assert "KVCACHED_PD_DISABLE" not in theirs.env
        assert mine == theirs
    assert ab.connector == base.connector


def _state(pid: int, stopped: bool | None = None) -> str:
    """A process's state letter ("T": stopped); with ``stopped`` given, the first state
    within 2 s that is (True) or is not (False) "T": a signal takes effect asynchronously."""
    deadline = time.monotonic() + 2
    while True:
        state = gpu_memory.stat_fields(pid)[0]
        if stopped is None or (state == "T") == stopped or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        kids = [int(k) for k in open(path, encoding="utf-8").read().split()]
        if kids:
            return kids
        time.sleep(0.05)
    raise AssertionError(f"{pid} started no child")


def test_freeze_others_stops_every_other_modes_process_groups_while_one_runs(tmp_path):
    """--freeze-others: while one mode is measured, every process of the other modes'
    servers and proxies (their whole process groups: a server's engine child too) is
    stopped, and continued afterwards, also when the pass fails; without the option
    nothing is stopped."""
    def harness(*extra):
        a = pd_load.parse_args(["--out", str(tmp_path), "--model", str(tmp_path), "--modes",
                                "kvpd-staged,kvcached-single", "--no-environment", *extra])
        h = pd_load.LoadHarness(a)
        for mode in pd_modes.load_modes(a.modes):
            h.runs[mode.name] = pd_load.ModeRun(mode)
        return h

    procs = []

    def server() -> pd_servers.ManagedProcess:  # a shell with a child, in its own session
        p = pd_servers.ManagedProcess("x", ["true"], {}, str(tmp_path / "x.log"), "")
        p.proc = subprocess.Popen(["bash", "-c", "sleep 60 & wait"], start_new_session=True)
        procs.append(p.proc)
        return p

    try:
        h = harness("--freeze-others")
        runs = h.runs
        runs["kvpd-staged"].instances = {"prefill": server(), "decode": server()}
        runs["kvpd-staged"].proxy = server()
        runs["kvcached-single"].instances = {"single": server()}
        runs["reference"].instances = {"single": server()}
        pd_pids = [p.proc.pid for p in [*runs["kvpd-staged"].instances.values(),
                                         runs["kvpd-staged"].proxy]]
        others = [runs[n].instances["single"].proc.pid for n in ("kvcached-single", "reference")]
        every = {pid: _children(pid)[0] for pid in pd_pids + others}
        with h.alone(runs["kvpd-staged"]):
            for pid in others:
                assert _state(pid, True) == "T" and _state(every[pid], True) == "T"
            for pid in pd_pids:
                assert _state(pid) != "T" and _state(every[pid]) != "T"
        for pid, child in every.items():
            assert _state(pid, False) != "T" and _state(child, False) != "T"
        with pytest.raises(RuntimeError):
            with h.alone(runs["reference"]):
                assert all(_state(pid, True) == "T" for pid in pd_pids)
                raise RuntimeError("the pass failed")
        assert all(_state(pid, False) != "T" for pid in every)
        assert h.frozen_counts == [2, 4]
        plain = harness()
        plain.runs = runs
        with plain.alone(runs["kvpd-staged"]):
            assert all(_state(pid, True) != "T" for pid in others)
    finally:
        for p in procs:
            os.killpg(p.pid, 9)
            p.wait()


def test_a_spinner_flavour_runs_beside_cpu_spinning_processes_only_while_measured(tmp_path):
    """kvcached-single-spin4: the one instance as kvcached-single, and while it is measured
    (not the reference, nor after, nor when the pass fails) four processes that each keep
    a CPU busy."""
    from host_cpu import tree_cpu_s

    a = pd_load.parse_args(["--out", str(tmp_path), "--model", str(tmp_path), "--modes",
                            "kvcached-single,kvcached-single-spin4", "--no-environment"])
    h = pd_load.LoadHarness(a)
    modes = {m.name: m for m in pd_modes.load_modes(a.modes)}
    assert modes["kvcached-single-spin4"].single == modes["kvcached-single"].single
    for mode in modes.values():
        h.runs[mode.name] = pd_load.ModeRun(mode)
    started = []
    spawn = h.start_spinners
    h.start_spinners = lambda run: started.append(spawn(run)) or started[-1]
    with h.alone(h.runs["reference"]), h.alone(h.runs["kvcached-single"]):
        pass
    assert started == [[], []]
    with pytest.raises(RuntimeError):
        with h.alone(h.runs["kvcached-single-spin4"]):
            spinners = started[-1]
            assert len(spinners) == pd_modes.CPU_SPINNERS_OF_A_PD_PAIR == 4
            # each spins: its CPU time grows to 0.1 s (a sleeping process never gets
            # there). Waited for, not sampled over a fixed window: on CI's 2 cores beside
            # five other test processes one spinner got 0.0 s of a half second
            deadline = time.monotonic() + 20
            busy = [0.0] * len(spinners)
            while min(busy) < 0.1 and time.monotonic() < deadline:
                time.sleep(0.1)
                busy = [tree_cpu_s(p.pid) or 0.0 for p in spinners]
            assert min(busy) >= 0.1, busy
            raise RuntimeError("the pass failed")
    assert all(p.poll() is not None for p in spinners)


def test_a_p_sync_mode_starts_p_with_the_flag_and_d_without(tmp_path):
    """(With --freeze-others: the load passes with the other modes' servers stopped
    while one mode runs, and the summary says so.)"""
    res, summary, out = _run_load(tmp_path, "--modes", "kvpd-staged-p-sync", "--repeats", "1",
                                  "--freeze-others")
    assert res.returncode == 0, res.stdout[-3000:]
    mode = summary["modes"]["kvpd-staged-p-sync"]
    assert mode["verdict"] == "PASS"
    # two passes (the reference's, the mode's); the reference's stopped P, D and proxy
    assert summary["load"]["frozen"] == {"passes": 2, "processes_max": 3}
    assert "other modes' servers stopped" in (out / "summary.txt").read_text()
    assert mode["instances"]["prefill"]["serve_args"] == ["--no-async-scheduling"]
    assert mode["instances"]["decode"]["serve_args"] == []
    logs = out / "logs"
    cmd = {role: next(line for line in (logs / f"kvpd-staged-p-sync-{role}.log").read_text()
                      .splitlines() if line.startswith("# cmd: "))
           for role in ("prefill", "decode")}
    assert "--no-async-scheduling" in cmd["prefill"]
    assert "--no-async-scheduling" not in cmd["decode"]


def test_a_kvcached_single_instance_serves_every_repeat_checked_against_the_reference(
        tmp_path):
    res, summary, out = _run_load(tmp_path, "--modes", "kvcached-single,vanilla",
                                  "--repeats", "2", "--ttft-batch", "2",
                                  "--ttft-prompt-tokens", "300")
    assert res.returncode == 0, res.stdout[-3000:]
    single = summary["modes"]["kvcached-single"]
    assert single["verdict"] == "PASS" and single["repeats_run"] == 2
    assert single["completed"] == single["sent"] == 2 * 18
    assert single["checks"]["outputs"] == ["pass"]
    assert single["ttft_batch"]["n"] == 2 and single["latency"]["e2e_p50_ms"]
    assert single["instances"]["single"]["env"]["ENABLE_KVCACHED"] == "true"
    assert "kvcached-single" in (out / "summary.txt").read_text()
    # ... and a kvcached instance that answers otherwise than the reference fails
    res, summary, _ = _run_load(tmp_path, "--modes", "kvcached-single",
                                env_extra={"FAKE_VLLM_KVCACHED_SINGLE_SKEW": "1"})
    assert res.returncode == 1
    single = summary["modes"]["kvcached-single"]
    assert single["verdict"] == "FAIL" and single["checks"]["outputs"] == ["fail"]
    assert summary["modes"]["reference"]["verdict"] == "PASS"


def test_the_ttft_batch_repeated_is_one_measure_over_every_batch_each_checked(tmp_path):
    """--ttft-batch-repeats 3: every mode's batch three times, the modes in turn; the p50
    is over all six requests, each batch's p50 listed in the summary, and every batch's
    outputs checked against the reference's."""
    res, summary, out = _run_load(tmp_path, "--modes", "kvcached-single", "--repeats", "1",
                                  "--ttft-batch", "2", "--ttft-batch-repeats", "3",
                                  "--ttft-prompt-tokens", "300")
    assert res.returncode == 0, res.stdout[-3000:]
    for name in ("reference", "kvcached-single"):
        mode = summary["modes"][name]
        assert mode["ttft_batch"]["n"] == 6 and len(mode["ttft_batches_p50_ms"]) == 3
    single = summary["modes"]["kvcached-single"]
    assert single["checks"]["ttft_outputs"] == ["pass"]
    line = next(x for x in (out / "summary.txt").read_text().splitlines()
                if x.strip().startswith("kvcached-single n"))
    assert "batches' p50" in line and line.count(" / ") == 2
    # the modes in turn: the reference's second batch after the instance's first
    log = res.stdout + res.stderr
    order = re.findall(r"^\[[\d:]+\]\s+(\S+)\s+TTFT batch 2 x 300", log, re.M)
    assert order == ["reference", "kvcached-single"] * 3, order


def test_combined_ttft_batches_fail_on_any_batch_that_differs():
    def batch(ttfts, status, detail=""):
        reqs = [{"name": f"t{i}", "ok": True, "ttft_s": t, "e2e_s": t + 0.01,
                 "token_ids": [1]} for i, t in enumerate(ttfts)]
        return {"latency": load_checks.latency_stats(reqs), "requests": reqs,
                "outputs": {"status": status, "detail": detail}}

    one = batch([0.1, 0.2], load_checks.PASS, "2 of 2 equal")
    two = batch([0.3, 0.4], load_checks.FAIL, "t1 differs")
    three = batch([0.5, 0.6], load_checks.PASS, "2 of 2 equal")
    got = pd_load.combine_ttft_batches([one, two, three])
    assert got["latency"]["n"] == 6 and got["latency"]["ttft_max_ms"] == 600.0
    assert [b["n"] for b in got["batches"]] == [2, 2, 2]
    assert got["outputs"]["status"] == load_checks.FAIL
    assert got["outputs"]["detail"] == "batch 2 of 3: t1 differs"
    assert got["requests"] == one["requests"]  # one batch's, for ttft_batch_timeline.py
    assert pd_load.combine_ttft_batches([one, three])["outputs"] == one["outputs"]


def test_bad_options_stop_before_any_server_starts(tmp_path, capsys):
    for args, words in ((["--modes", "kvpd-direct"], "--kvcached-layout split"),
                        (["--abort-every", "9"], "--abort-prefill-ms"),
                        (["--kill", "decode"], "--kill-at-s"),
                        (["--kill", "decode", "--kill-at-s", "1", "--kill-after", "3"],
                         "not both"),
                        (["--kill", "decode", "--kill-after", "18", "--requests", "18"],
                         "never lands mid-run"),
                        (["--kill-after", "3"], "--kill goes with"),
                        (["--ucx-fault-lib", str(tmp_path / "nope.so")], "no such file"),
                        (["--modes", "vanilla,nope"], "unknown mode"),
                        (["--max-prompt-tokens", "4090"], "exceed --max-model-len"),
                        (["--ttft-batch", "8", "--ttft-batch-repeats", "0"], "must be >= 1")):
        with pytest.raises(SystemExit):
            pd_load.parse_args(["--out", str(tmp_path), "--model", str(tmp_path), *args])
        assert words in capsys.readouterr().err
    a = pd_load.parse_args(["--out", str(tmp_path), "--model", str(tmp_path), "--issue-aborts"])
    assert (a.abort_every, a.abort_prefill_ms, a.abort_decode_ms) == (9, 50.0, 10.0)


def test_a_kvcached_setting_reaches_kvcached_instances_only(tmp_path, monkeypatch, capsys):
    """--kvcached-env gives every kvcached instance a setting other than kvcached's
    default (the harness strips KVCACHED_* from its own environment), and no vanilla
    one; the settings the modes themselves choose are refused."""
    a = pd_load.parse_args(["--out", str(tmp_path), "--model", str(tmp_path), "--modes",
                            "vanilla,kvpd-staged", "--no-environment",
                            "--kvcached-env", "KVCACHED_MAX_CACHED_TOKENS=200000"])
    monkeypatch.setattr(pd_load.ManagedProcess, "start", lambda self, env_diff=None: None)
    h = pd_load.LoadHarness(a)
    modes = {m.name: m for m in pd_modes.load_modes(a.modes)}
    seen = {}
    for name in ("vanilla", "kvpd-staged"):
        run = pd_load.ModeRun(modes[name])
        for role in ("prefill", "decode"):
            seen[name, role] = h._instance(run, role, "0").env.get("KVCACHED_MAX_CACHED_TOKENS")
    assert seen == {("vanilla", "prefill"): None, ("vanilla", "decode"): None,
                    ("kvpd-staged", "prefill"): "200000", ("kvpd-staged", "decode"): "200000"}
    for bad, words in (("MAX_CACHED_TOKENS=1", "KVCACHED_NAME=VALUE"),
                       ("KVCACHED_CONTIGUOUS_LAYOUT=false", "set by the harness"),
                       ("KVCACHED_PD_WIRE=nixl", "set by the harness")):
        with pytest.raises(SystemExit):
            pd_load.parse_args(["--out", str(tmp_path), "--model", str(tmp_path),
                                "--kvcached-env", bad])
        assert words in capsys.readouterr().err


def test_the_warm_up_sends_the_ttft_batchs_shape_before_any_measurement(tmp_path,
                                                                        monkeypatch):
    """Every instance is warmed up with long prompts too (kernels compiled at first use
    must not land in the TTFT batch or the load): as many at once as the TTFT batch, of
    the run's longest length, on seeds no measured prompt has; one of the load's longest
    without a TTFT batch; only the short request with --no-long-warm-up."""
    sent = []
    monkeypatch.setattr(pd_load, "stream_completion",
                        lambda url, body, timeout, *x, **k: sent.append(("one", body)) or
                        {"ok": True})
    monkeypatch.setattr(pd_load, "run_load",
                        lambda url, model, prompts, max_tokens, conc, timeout, *x, **k:
                        sent.append(("load", prompts, conc)) or
                        [{"ok": True} for _ in prompts])
    run = pd_load.ModeRun(pd_modes.load_modes(["vanilla"])[0])

    def warm(*extra):
        sent.clear()
        a = pd_load.parse_args(["--out", str(tmp_path), "--model", str(tmp_path),
                                "--no-environment", "--requests", "12", *extra])
        h = pd_load.LoadHarness(a)
        h.warm_up(run)
        return h, list(sent)

    h, calls = warm("--ttft-batch", "8", "--ttft-prompt-tokens", "3000")
    assert [c[0] for c in calls] == ["one", "load"]
    _, prompts, conc = calls[1]
    longest = max([p.num_tokens for p in h.prompts] + [3000])
    assert conc == len(prompts) == 8 and {p.num_tokens for p in prompts} == {longest}
    measured = {p.text for p in h.prompts} | {p.text for p in h.ttft_prompts}
    assert not any(p.text[:12] == m[:12] for p in prompts for m in measured)
    _, calls = warm()
    assert [c[0] for c in calls] == ["one", "load"] and len(calls[1][1]) == 1
    assert calls[1][1][0].num_tokens == max(p.num_tokens for p in h.prompts)
    _, calls = warm("--ttft-batch", "8", "--no-long-warm-up")
    assert [c[0] for c in calls] == ["one"]


def test_load_prompts_are_mixed_and_deterministic():
    prompts = pd_common.load_prompts(64)
    assert [p.num_tokens for p in prompts] == [p.num_tokens for p in pd_common.load_prompts(64)]
    lengths = [p.num_tokens for p in prompts]
    assert min(lengths) < 100 and max(lengths) > 3000 and len(set(lengths)) > 60
    assert all(len(p.text) == p.num_tokens - 1 for p in prompts)


# ---- the checks: a missing metric is never a pass ---------------------------------------


def test_absent_metrics_are_unproven_not_passed():
    staging = load_checks.check_staging(
        {"prefill": {"expected": True, "bytes": None, "settle_s": 2},
         "decode": {"expected": True, "bytes": 0.0, "settle_s": 0}})
    assert staging["status"] == load_checks.ABSENT
    req = [{"ok": True, "aborted": None, "prompt_tokens": 10, "intended_prompt_tokens": 10,
            "name": "x", "token_ids": [1]}]
    kv = load_checks.check_kv_loaded(req, None, pd_common.MetricSnapshot())
    assert kv["status"] == load_checks.ABSENT
    assert load_checks.verdict_of({"staging": staging, "outputs": {"status": "pass"}}) == "UNPROVEN"
    vanilla = load_checks.check_staging(
        {"prefill": {"expected": False, "bytes": None, "settle_s": 0}})
    assert vanilla["status"] == load_checks.NA


# ---- the proxy propagates client aborts ------------------------------------------------


@pytest.fixture
def pd_pair(tmp_path):
    procs = []

    def make(env=None):
        out = []
        for role in ("kv_producer", "kv_consumer"):
            port, side = _ports.take(), _ports.take()
            args = ["fake-model", "--port", str(port), "--kv-transfer-config",
                    json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                "engine_id": role})]
            penv = dict(os.environ, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side),
                        FAKE_VLLM_START_DELAY="0.1", **(env or {}))
            proc = pd_servers.ManagedProcess(role, FAKE + args, penv,
                                             str(tmp_path / f"{role}.log"),
                                             f"http://127.0.0.1:{port}/health")
            proc.start()
            proc.side_port = side
            out.append(proc)
        procs.extend(out)
        pd_servers.wait_until_ready(out, 20, poll_s=0.1)
        assert all(p.state == "ready" for p in out)
        return out

    yield make
    pd_servers.stop_all(procs, grace_s=3)


def _aborts(proc) -> float:
    snap = pd_common.scrape_metrics(proc.health_url[:-len("/health")])
    return snap.total(pd_common.M.REQUEST_SUCCESS, finished_reason="abort")


def _wait_for(fn, want, timeout=3.0):
    t_end = time.monotonic() + timeout
    while fn() < want and time.monotonic() < t_end:
        time.sleep(0.05)
    return fn()


@pytest.mark.parametrize("push_mode", [False, True], ids=["sequential", "push-concurrent"])
def test_proxy_cuts_the_upstream_leg_when_the_client_goes_away(pd_pair, push_mode):
    """Push-concurrent too: its watcher starts only once P's leg is sent (from the
    handler's own thread), and still cuts P's leg when the client leaves during it."""
    p, d = pd_pair({"FAKE_VLLM_PREFILL_MS_PER_KTOK": "1500", "FAKE_VLLM_TOKEN_MS": "50"})
    port = _ports.take()
    push = {"engine_id": "kv_producer", "host": "127.0.0.1", "port": p.side_port,
            "tp_size": 1, "pp_size": 1} if push_mode else None
    proxy = pd_proxy.PDProxy(p.health_url[:-len("/health")], d.health_url[:-len("/health")],
                             push_concurrent=push)
    server = pd_proxy.make_server("127.0.0.1", port, proxy)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        body = load_client.completion_body("fake-model", pd_common.make_prompt_text(2000, 1), 8)
        # P's prefill takes ~3 s: the client leaves after 1 s, during the P leg (long enough
        # after sending that P surely has the request even on a busy machine; a client gone
        # before the proxy sent it would leave P nothing to abort)
        res = load_client.stream_completion(url, body, 30, abort_p_ms=1000)
        assert res["aborted"] == "prefill" and not res["ok"]
        assert _wait_for(lambda: _aborts(p), 1) == 1  # P aborted the prefill
        # a short prompt: P answers quickly; D streams a token per 50 ms; leave after 75 ms
        body = load_client.completion_body("fake-model", "hello there", 8)
        res = load_client.stream_completion(url, body, 30, abort_d_ms=75)
        assert res["aborted"] == "decode" and len(res["token_ids"]) < 8
        assert _wait_for(lambda: _aborts(d), 1) == 1  # D aborted the decode
        if push_mode:  # both legs are upstream at once: the leg attached last is named
            assert proxy.stats["client_gone_prefill"] + proxy.stats["client_gone_decode"] == 2
        else:
            assert proxy.stats["client_gone_prefill"] == 1
            assert proxy.stats["client_gone_decode"] == 1
        # and a request nobody drops completes, with the reference's tokens
        res = load_client.stream_completion(url, body, 30)
        ref = load_client.stream_completion(p.health_url[:-len("/health")], body, 30)
        assert res["ok"] and res["token_ids"] == ref["token_ids"] and len(res["token_ids"]) == 8
        assert res["ttft_s"] <= res["e2e_s"] and res["prefill_s"] > 0 and res["decode_s"] > 0
    finally:
        server.shutdown()


# ---- the whole harness -----------------------------------------------------------------


def test_load_with_aborts_passes_and_reports_everything(tmp_path):
    res, summary, out = _run_load(tmp_path, "--abort-every", "3", "--abort-prefill-ms", "15",
                                  "--abort-decode-ms", "10", "--repeats", "2",
                                  "--ttft-batch", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary["overall"] == "PASS"
    modes = summary["modes"]
    assert list(modes) == ["reference", "vanilla", "kvpd-staged", "kvpd-push"]
    for name in ("vanilla", "kvpd-staged", "kvpd-push"):
        m = modes[name]
        assert m["verdict"] == "PASS" and m["repeats_run"] == 2, m["reasons"]
        assert m["sent"] == 36 and m["aborted"] >= 6 and m["completed"] == m["sent"] - m["aborted"]
        assert m["checks"]["outputs"] == ["pass"] and m["checks"]["kv"] == ["pass"]
        assert m["checks"]["activation"] == ["pass"]
        assert m["latency"]["e2e_p50_ms"] > 0 and m["latency"]["prefill_p90_ms"] > 0
        assert m["ttft_batch"]["n"] == 2
    assert modes["vanilla"]["checks"]["staging"] == ["n/a"]
    assert modes["kvpd-staged"]["checks"]["staging"] == ["pass"]
    assert modes["kvpd-staged"]["direct_fallbacks"] == {"prefill": 0, "decode": 0}
    assert modes["kvpd-staged"]["staging_waits"] == {"prefill": None, "decode": None}
    assert modes["kvpd-staged"]["graph_fallbacks"] == {"prefill": 0, "decode": 0}
    assert modes["vanilla"]["graph_fallbacks"] == {"prefill": None, "decode": None}
    # kvcached-pd's device time from its metrics: the fake counts 0.25 ms a pack on P and
    # 0.5 ms an unpack on D; vanilla exports neither
    gpu = modes["kvpd-staged"]["kvpd_gpu"]
    assert gpu["pack_ms"] == pytest.approx(0.25) and gpu["unpack_ms"] == pytest.approx(0.5)
    assert gpu["packs"] >= modes["kvpd-staged"]["completed"] and gpu["unpacks"] > 0
    assert modes["vanilla"]["kvpd_gpu"] == {"pack_ms": None, "packs": None,
                                            "unpack_ms": None, "unpacks": None}
    assert modes["kvpd-push"]["vs_vanilla"]["latency.e2e_p50_ms"] > 0
    # the host's CPUs during each mode's repeats, and each process tree's CPU per request
    # (the fake servers parse, tokenize and stream in Python: never 0 over 30 requests)
    for name in ("reference", "vanilla", "kvpd-staged", "kvpd-push"):
        cpu = modes[name]["cpu"]
        assert 0 < cpu["busy_pct"] <= 100 and cpu["cpus"] == os.cpu_count(), cpu
        roles = {"single"} if name == "reference" else {"prefill", "decode", "proxy"}
        assert set(cpu["ms_per_request"]) == roles, cpu
        assert all(ms > 0 for ms in cpu["ms_per_request"].values()), cpu
    detail = json.loads((out / "modes" / "kvpd-staged.json").read_text())
    reps = detail["repeats"]
    assert sum(sum(r["proxy_client_gone"].values()) for r in reps) >= 6  # aborts propagated
    assert sum(r["counters"]["aborted_requests"]["prefill"] for r in reps) >= 1
    text = (out / "summary.txt").read_text()
    assert "requests 3, 6, 9, ...: drop P leg after 15 ms / D leg after 10 ms" in text
    assert "x vanilla" in text
    assert "Host CPU during the load" in text and "proxy" in text.split("Host CPU")[1]
    gpu_lines = text.split("kvcached-pd's device time")[1].splitlines()
    assert gpu_lines[1].split() == ["kvpd-staged", "pack", "0.250", f"({gpu['packs']:.0f})",
                                    "/", "unpack", "0.500", f"({gpu['unpacks']:.0f})"]
    assert not any(line.split()[0] == "vanilla" for line in gpu_lines[1:3] if line.strip())
    assert (out / "latency.csv").read_text().count("\n") >= 1 + 3 * 2 + 1


def test_a_differing_output_fails_the_mode(tmp_path):
    res, summary, _ = _run_load(tmp_path, "--modes", "vanilla",
                                env_extra={"FAKE_VLLM_CORRUPT_DECODE": "1"})
    assert res.returncode == 1
    van = summary["modes"]["vanilla"]
    assert van["verdict"] == "FAIL" and van["checks"]["outputs"] == ["fail"]
    assert van["different"] > 0 and any("differ from the reference" in r for r in van["reasons"])


def test_a_dead_server_fails_the_mode_with_its_log(tmp_path):
    res, summary, _ = _run_load(tmp_path, "--modes", "vanilla",
                                env_extra={"FAKE_VLLM_DIE_AFTER": "8"})
    assert res.returncode == 1
    van = summary["modes"]["vanilla"]
    assert van["verdict"] == "FAIL" and "fail" in van["checks"]["alive"]
    assert van["deaths"] == 1 and any("decode is dead" in r for r in van["reasons"])
    assert "simulated crash while serving" in res.stdout  # the log's tail is shown


def test_staging_left_behind_fails_the_staged_modes_only(tmp_path):
    res, summary, _ = _run_load(tmp_path, "--modes", "vanilla,kvpd-staged", "--settle-s", "1",
                                env_extra={"FAKE_VLLM_STAGING_LEAK": "1"})
    assert res.returncode == 1
    staged = summary["modes"]["kvpd-staged"]
    assert staged["verdict"] == "FAIL" and staged["checks"]["staging"] == ["fail"]
    assert staged["staging_left_bytes"] > 0
    assert any("still staged" in r for r in staged["reasons"])
    assert summary["modes"]["vanilla"]["verdict"] == "PASS"


def test_staging_mb_reaches_the_kvcached_pd_instances_only(tmp_path):
    # KVCACHED_PD_STAGING_MB in the caller's environment would not: the harness strips
    # every KVCACHED_* variable of its own before it starts an instance
    res, summary, _ = _run_load(tmp_path, "--modes", "vanilla,kvpd-staged", "--staging-mb",
                                "6144", "--requests", "6",
                                env_extra={"KVCACHED_PD_STAGING_MB": "99"})
    assert res.returncode == 0, res.stdout + res.stderr
    staged = summary["modes"]["kvpd-staged"]["instances"]
    assert {r: staged[r]["env"].get("KVCACHED_PD_STAGING_MB") for r in staged} == \
        {"prefill": "6144", "decode": "6144"}
    for mode in ("vanilla", "reference"):
        for inst in summary["modes"][mode]["instances"].values():
            assert "KVCACHED_PD_STAGING_MB" not in inst["env"]


def test_killed_prefill_leaves_a_decode_that_keeps_serving(tmp_path):
    res, summary, out = _run_load(tmp_path, "--modes", "kvpd-staged", "--kill", "prefill",
                                  "--kill-after", "3", "--abort-timeout-s", "2",
                                  env_extra=KILLABLE)
    assert res.returncode == 0, res.stdout + res.stderr
    staged = summary["modes"]["kvpd-staged"]
    assert staged["verdict"] == "PASS", staged["reasons"]
    assert staged["checks"]["survivor"] == ["pass"] and staged["checks"]["requests"] == ["n/a"]
    rep = json.loads((out / "modes" / "kvpd-staged.json").read_text())["repeats"][0]
    assert 0 < rep["n_completed"] < rep["n_sent"]  # the kill landed mid-run
    assert rep["checks"]["in_flight"]["status"] == "pass", rep["checks"]["in_flight"]
    assert rep["checks"]["survivor"]["survivor"] == "decode"
    assert all(p["matches_reference"] for p in rep["checks"]["survivor"]["probes"])


def test_killed_decode_leaves_a_prefill_that_frees_its_staging(tmp_path):
    res, summary, out = _run_load(tmp_path, "--modes", "kvpd-staged", "--kill", "decode",
                                  "--kill-after", "3", "--abort-timeout-s", "2",
                                  env_extra=KILLABLE)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads((out / "modes" / "kvpd-staged.json").read_text())["repeats"][0]
    # the kill landed mid-run, once 3 had completed (--kill-after: a fixed 0.9 s found
    # none completed on a busy 2-core CI host, 2026-11-28)
    assert 3 <= rep["n_completed"] < rep["n_sent"]
    assert "after 3 requests completed" in res.stdout
    assert rep["checks"]["in_flight"]["status"] == "pass", rep["checks"]["in_flight"]
    assert rep["checks"]["survivor"]["status"] == "pass"
    assert summary["modes"]["kvpd-staged"]["verdict"] == "PASS"
    staging = rep["checks"]["staging"]["readings"]["prefill"]
    # P held the dead D's extents and the probes' until vLLM's abort timeout (2 s here)
    assert staging["bytes"] == 0 and staging["settle_s"] > 1.0


def test_ucx_fault_injection_keeps_decode_alive_and_outputs_identical(tmp_path):
    lib = tmp_path / "fake_ucx_fault.so"
    lib.write_bytes(b"")  # ld.so ignores it; the fake emulates the injector
    res, summary, out = _run_load(tmp_path, "--modes", "kvpd-staged", "--ucx-fault-lib",
                                  str(lib), "--ucx-fault-every", "4",
                                  "--abort-timeout-s", "1", "--repeats", "2",
                                  # the injector counts fetches from the start: a long
                                  # warm-up's fetch would move which repeat gets the 5th
                                  "--no-long-warm-up")
    assert res.returncode == 0, res.stdout + res.stderr
    staged = summary["modes"]["kvpd-staged"]
    assert staged["verdict"] == "PASS", staged["reasons"]
    # 36 fetches, every 4th failed: 4 in the first 18, 5 in the next
    assert staged["failed"] == 9 and staged["nixl_failed_transfers"] == 9
    assert staged["checks"]["fault_injected"] == ["pass"]
    assert staged["ucx_faults_injected"] == {"decode": 9}
    reps = json.loads((out / "modes" / "kvpd-staged.json").read_text())["repeats"]
    assert [r["checks"]["fault_injected"]["faults_injected"] for r in reps] == \
        [{"decode": 4}, {"decode": 5}]  # per repeat, not the log's running total
    assert "UCX faults injected (the injector's lines in the instance logs): " \
        "kvpd-staged: decode 9" in (out / "summary.txt").read_text()
    log = (out / "logs" / "kvpd-staged-decode.log").read_text()
    assert "# env: UCX_FAULT_PATTERN=OOOX" in log  # --ucx-fault-every 4
    assert "# env: UCX_FAULT_HOOKS=flush" in log and "# env: NIXL_UCX_DEEPBIND=0" in log
    assert "LD_PRELOAD" not in (out / "logs" / "kvpd-staged-prefill.log").read_text()


def test_our_injector_is_built_and_preloaded_with_the_harness_settings(tmp_path):
    """--ucx-fault-lib kvpd: experiments/ucx_fault's injector, built (or its prebuilt
    copy), preloaded into D only, armed by the environment the harness sets. The fake
    makes no UCX call, so nothing is injected: loaded but unproven."""
    res, summary, out = _run_load(tmp_path, "--modes", "kvpd-staged", "--ucx-fault-lib",
                                  "kvpd", "--ucx-fault-every", "5", "--abort-timeout-s", "1")
    assert res.returncode == 2, res.stdout + res.stderr
    staged = summary["modes"]["kvpd-staged"]
    assert staged["checks"]["fault_injected"] == ["absent"]
    assert any("no fault injected in this repeat" in r for r in staged["reasons"])
    lib = summary["config"]["ucx_fault_lib"]
    assert lib == str(out / "ucx_fault" / "libkvpd_ucx_fault.so") and os.path.isfile(lib)
    decode_log = (out / "logs" / "kvpd-staged-decode.log").read_text()
    assert "UCX fault injector loaded: 1 of every 5 calls fail (pattern OOOOX); hooks: " \
        "flush; error -3" in decode_log
    assert "ucx_fault_injector" not in (out / "logs" / "kvpd-staged-prefill.log").read_text()


def test_fault_injection_that_never_loaded_is_unproven(tmp_path):
    lib = tmp_path / "libsomething.so"  # not the (fake) injector: nothing is injected
    lib.write_bytes(b"")
    res, summary, _ = _run_load(tmp_path, "--modes", "kvpd-staged", "--ucx-fault-lib", str(lib),
                                "--abort-timeout-s", "1")
    assert res.returncode == 2
    assert summary["overall"] == "UNPROVEN"
    assert summary["modes"]["kvpd-staged"]["checks"]["fault_injected"] == ["absent"]


def test_kvcached_pd_where_the_mode_has_none_fails_it(tmp_path):
    res, summary, _ = _run_load(tmp_path, "--modes", "vanilla",
                                env_extra={"FAKE_VLLM_PD_ALWAYS": "1"})
    assert res.returncode == 1
    van = summary["modes"]["vanilla"]
    assert van["checks"]["activation"] == ["fail"]
    assert any("although KVCACHED_PD=0" in r for r in van["reasons"])


def test_after_a_prefill_kill_the_harness_waits_for_ds_idle_unmap_before_reading_memory(
        monkeypatch):
    # 2 x H200, 2026-11-26: the kill-P memory check read the GPU before D dropped its IPC
    # mapping of P's staging (kvcached-pd unmaps an idle peer after IDLE_UNMAP_S) and
    # reported 2048 MiB "not all returned". The harness now polls until the drop shows.
    import re

    import pd_load

    src = open(os.path.join(os.path.dirname(EXP), "kvcached_pd", "connector", "decode_worker.py")).read()
    product = float(re.search(r"^IDLE_UNMAP_S = ([0-9.]+)", src, re.M).group(1))
    assert pd_load.DECODE_IDLE_UNMAP_S == product

    class Stub:  # P's GPU in use: P's 3838 MiB go back three readings after the load
        def __init__(self, readings):
            self.readings = list(readings)

        def gpu_used(self, run, role="decode"):
            assert role == "prefill"  # the killed P's GPU, not D's (they differ across GPUs)
            return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    monkeypatch.setattr(pd_load.time, "sleep", lambda s: None)
    before = {"prefill": {"device_mib": 3838.0}}
    wait = pd_load.LoadHarness.wait_gpu_returned
    returned = Stub([20142.0, 20142.0, 20142.0, 16300.0])
    assert wait(returned, None, before, 20142.0) is not None
    assert returned.readings == [16300.0]  # it polled until the drop, not once
    monkeypatch.setattr(pd_load, "DECODE_IDLE_UNMAP_S", -15.0)  # no time to wait
    held = Stub([18430.0])  # 1712 MiB fell: P's staging still mapped by D
    assert wait(held, None, before, 20142.0) is None
    assert wait(held, None, {}, 20142.0) is None  # nothing to compare with


def test_the_kill_checks_read_the_killed_instances_gpu_across_two_gpus(monkeypatch):
    # 2 x H100, 2026-11-26: P on GPU 0, D on GPU 1 seeing "1,0"; the kill-P check read
    # D's GPU 1 (the first D sees) and said "fell by -84 MiB": P's memory was never there.
    import gpu_memory
    import pd_load

    readings = {"0": 3900.0, "1": 7700.0}  # what nvidia-smi says per GPU
    monkeypatch.setattr(gpu_memory, "gpu_used_mib", lambda: dict(readings))

    class Run:
        ports = {"prefill": {"gpu": "0"}, "decode": {"gpu": "1,0"}}

    harness = pd_load.LoadHarness.__new__(pd_load.LoadHarness)
    assert harness.gpu_used(Run()) == 7700.0  # D's own GPU: the summary's column
    assert harness.gpu_used(Run(), "decode") == 7700.0
    assert harness.gpu_used(Run(), "prefill") == 3900.0  # where a killed P's memory was

    monkeypatch.setattr(pd_load.time, "sleep", lambda s: None)
    before = {"prefill": {"device_mib": 3838.0}}
    readings["0"] = 62.0  # P's GPU got P's memory back; D's GPU did not move
    assert harness.wait_gpu_returned(Run(), before, 3900.0) is not None


def test_the_last_repeat_the_deadline_leaves_room_for_checks_staging():
    """2026-11-27: two aborts runs cut by their deadline after 1-2 of 3 repeats reported
    "staging n/a" for every repeat they ran: only repeat == --repeats waited out vLLM's KV
    lease and checked that staging went back to 0, and that repeat never ran."""
    fits = pd_load.last_repeat_that_fits
    # (index, repeats, remaining, reserve, step, window, lease window, modes)
    assert fits(3, 3, 1000, 20, 15, 5, 45, 2)  # the last asked for
    assert not fits(1, 3, 1000, 20, 15, 5, 45, 2)  # room for the rest
    # room for this repeat and the other mode's, not for this mode's next one with its lease
    assert fits(1, 3, 90, 20, 15, 5, 45, 2)
    assert not fits(1, 3, 130, 20, 15, 5, 45, 2)  # 130 - 20 = 110 >= 20 + 20 + 60
    # no room to wait out the lease at all: an unchecked repeat beats none
    assert not fits(1, 3, 60, 20, 15, 5, 45, 2)
