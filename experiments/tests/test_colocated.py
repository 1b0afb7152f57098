"""Offline tests of the colocated-PD experiments: the wire each staged pair must be served
by (mode table, D's log, the fallback counter, the checks of every harness), the memory
readings a colocated run adds (peak under load, the GPU's total, memory returned after a
kill), the effective handoff on the IPC wire, run_colocated_on_host.sh's commands (parsed
by the harnesses' own parsers) and the CUDA IPC probe's pure parts.

run: python -m pytest experiments/tests/test_colocated.py -q
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXP = os.path.dirname(HERE)
sys.path.insert(0, EXP)

import bench_transfer  # noqa: E402
import equivalence  # noqa: E402
import gpu_memory  # noqa: E402
import load_checks  # noqa: E402
import pd_load  # noqa: E402
import pd_modes  # noqa: E402
import pd_servers  # noqa: E402
import probe_cuda_ipc  # noqa: E402
from pd_modes import MODES, WIRE_ENV, expected_wire  # noqa: E402

FAKE = [sys.executable, os.path.join(HERE, "fake_vllm.py")]
_ports = pd_servers.PortAllocator(15000)  # below the ephemeral range: see PortAllocator
MiB = 1 << 20


# ---- the mode table ---------------------------------------------------------------------


def test_wire_modes_force_nixl_and_leave_the_default_to_kvcached_pd():
    nixl = MODES["staged-nixl"]
    assert nixl.prefill.env[WIRE_ENV] == nixl.decode.env[WIRE_ENV] == "nixl"
    assert "KVCACHED_CONTIGUOUS_LAYOUT" not in nixl.decode.env  # kvcached's default layout
    assert MODES["push-nixl"].connector == "NixlPushConnector"
    for name in ("staged-contiguous", "push-contiguous", "kvcached-pd-staged", "negative"):
        assert WIRE_ENV not in MODES[name].decode.env  # kvcached-pd's own choice (auto)
    assert expected_wire(MODES["staged-contiguous"], "ipc") == "ipc"
    assert expected_wire(MODES["staged-contiguous"], None) is None
    assert expected_wire(MODES["staged-nixl"], "ipc") == "nixl"
    assert expected_wire(MODES["staged-nixl"], None) == "nixl"
    for name in ("blocksize", "negative", "push"):
        assert expected_wire(MODES[name], "ipc") == "ipc"
    # no staging on one side: no wire to choose
    for name in ("reference", "vanilla", "mixed-p", "mixed-d", "kvcached-own",
                 "kvcached-pd-direct"):
        assert expected_wire(MODES[name], "ipc") is None
    with pytest.raises(ValueError):
        expected_wire(MODES["staged-contiguous"], "rdma")


def test_load_flavours_with_the_nixl_wire_forced():
    modes = {m.name: m for m in pd_modes.load_modes(["kvpd-staged", "kvpd-staged-nixl",
                                                     "kvpd-push-nixl", "vanilla"])}
    assert modes["kvpd-staged-nixl"].decode.env == dict(modes["kvpd-staged"].decode.env,
                                                        KVCACHED_PD_WIRE="nixl")
    assert modes["kvpd-push-nixl"].connector == "NixlPushConnector"
    assert expected_wire(modes["kvpd-staged"], "ipc") == "ipc"
    assert expected_wire(modes["kvpd-staged-nixl"], "ipc") == "nixl"
    assert expected_wire(modes["vanilla"], "ipc") is None


# ---- D's log and the checks -------------------------------------------------------------


def test_wire_evidence_reads_the_wire_not_the_wire_version(tmp_path):
    log = tmp_path / "d.log"
    log.write_text(
        "INFO kvcached-pd: staged peer p-1 rank 0: 2048 MiB staging, wire version 2\n"
        "INFO something else mentions wire ipc\n")
    assert pd_servers.wire_evidence(str(log)) == {"wires": [], "peer_lines": 0}
    with open(log, "a") as f:
        f.write("[1.0] INFO kvcached-pd: staged peer p-1 rank 0: 2048 MiB staging, wire "
                "version 2, wire ipc\n"
                "[2.0] INFO kvcached-pd: staged peer p-2 rank 0: ... wire nixl (IPC open "
                "failed: ...)\n")
    assert pd_servers.wire_evidence(str(log)) == {"wires": ["ipc", "nixl"], "peer_lines": 2}
    assert pd_servers.wire_evidence(str(tmp_path / "none.log"))["wires"] == []


def test_check_wire_rules():
    chk = load_checks.check_wire
    assert chk("ipc", ["ipc"], 0.0)["status"] == "pass"
    assert chk("nixl", ["nixl"], None)["status"] == "pass"  # no fallback to count
    assert chk("ipc", ["nixl"], 1.0)["status"] == "fail"
    assert chk("ipc", ["ipc", "nixl"], 0.0)["status"] == "fail"  # one peer not on IPC
    assert chk("ipc", ["ipc"], 1.0)["status"] == "fail"  # a fallback counted
    assert chk("ipc", [], 0.0)["status"] == "absent"  # nothing proves the wire
    assert chk("ipc", ["ipc"], None)["status"] == "absent"  # counter not exported
    killed = chk("ipc", ["ipc"], None, counter_readable=False)  # D killed: the log decides
    assert killed["status"] == "pass"
    assert chk(None, ["nixl"], 3.0)["status"] == "n/a"


def _reading(device=None, used=None, prealloc=0):
    kv = None if used is None else {"total": 1, "used": used * MiB, "prealloc": prealloc * MiB}
    return {"device_mib": device, "kvcached": kv}


def test_a_kill_counts_only_when_requests_were_in_flight():
    """2026-11-29d (one H200, CUDA graphs): the 128-request load ended about a second in,
    just before "kill P at +1 s"; every other check passed. Such a kill fails now."""
    def req(start, e2e):
        return {"started_at": start, "e2e_s": e2e}
    done = [req(100.0 + i * 0.05, 0.12) for i in range(8)]  # the last ends at 100.47
    late = load_checks.check_kill_in_flight(done, killed_at=101.0)
    assert late["status"] == "fail" and "530 ms after the last request ended" in late["detail"]
    mid = load_checks.check_kill_in_flight(done, killed_at=100.2)
    assert mid["status"] == "pass" and mid["detail"].startswith("3 request(s) in flight")
    # a request cut by the kill (no end recorded) and one sent after it
    cut = load_checks.check_kill_in_flight([req(100.0, 0.1), req(100.2, None)], 100.3)
    assert cut["status"] == "pass" and cut["detail"].startswith("1 request(s) in flight")
    after = load_checks.check_kill_in_flight([req(100.0, 0.1), req(100.5, 0.1)], 100.3)
    assert after["status"] == "pass" and "1 sent after it" in after["detail"]
    assert load_checks.check_kill_in_flight(done, None)["status"] == "fail"


def test_memory_returned_after_a_kill():
    before = {"prefill": _reading(6000, 0), "decode": _reading(5000, 0)}
    idle = {"decode": _reading(5100, 32)}
    ok = load_checks.check_memory_returned("prefill", before, idle, 70000, 64100)
    assert ok["status"] == "pass" and ok["survivor"] == "decode", ok["detail"]
    # the survivor still maps the dead P's 2 GiB staging: the GPU got 4 GiB back, not 6
    held = load_checks.check_memory_returned("prefill", before, idle, 70000, 66000)
    assert held["status"] == "fail" and "not all returned" in held["detail"]
    # the survivor's KV pages of the dead peer's requests were never freed
    leak = load_checks.check_memory_returned("prefill", before, {"decode": _reading(5100, 512)},
                                             70000, 64100)
    assert leak["status"] == "fail" and "not returned" in leak["detail"]
    # no per-process figure (a container that hides them): unproven, not passed
    blind = load_checks.check_memory_returned("decode", {"prefill": _reading(None, 0)},
                                              {"prefill": _reading(None, 0)}, None, None)
    assert blind["status"] == "absent" and blind["survivor"] == "prefill"
    # a vanilla survivor has no kvcached pages to return: the GPU's total decides
    vanilla = load_checks.check_memory_returned(
        "prefill", {"prefill": _reading(6000)}, {"decode": _reading(5000)}, 70000, 64100,
        survivor_kvcached=False)
    assert vanilla["status"] == "pass" and "without kvcached" in vanilla["detail"]
    # a machine with no reading at all (no nvidia-smi, no kvcached segment)
    nothing = load_checks.check_memory_returned("decode", {}, {}, None, None)
    assert nothing["status"] == "n/a"


# ---- memory readings --------------------------------------------------------------------


def test_peak_keeps_the_highest_reading_of_each_instance():
    peak = gpu_memory.merge_peak({}, {"prefill": _reading(100, 10, 5), "gpu": _reading(900)})
    peak = gpu_memory.merge_peak(peak, {"prefill": _reading(300, 2, 1), "decode": None})
    peak = gpu_memory.merge_peak(peak, {"prefill": _reading(None, 40, 0), "gpu": _reading(700)})
    assert peak["prefill"]["device_mib"] == 300 and peak["prefill"]["samples"] == 3
    assert peak["prefill"]["kvcached"]["used"] == 40 * MiB  # 40 + 0 mapped beats 10 + 5
    assert peak["gpu"]["device_mib"] == 900 and "decode" not in peak


def test_sampler_reads_until_stopped():
    values = iter(range(1, 10_000))
    seen = threading.Event()

    def read():
        v = next(values)
        if v >= 3:
            seen.set()
        if v == 2:
            raise RuntimeError("nvidia-smi hiccup")  # counted, sampling goes on
        return {"decode": {"device_mib": float(v), "kvcached": None}}

    sampler = gpu_memory.PeakSampler(read, interval_s=0.01).start()
    assert seen.wait(10)
    peak = sampler.stop()
    assert peak["decode"]["device_mib"] >= 3 and sampler.errors == 1
    n = peak["decode"]["samples"]
    time.sleep(0.05)
    assert sampler.peak["decode"]["samples"] == n  # stopped


def test_gpu_used_per_index():
    assert gpu_memory.parse_gpu_used("0, 61234\n1, 12\nnot a gpu\n") == {"0": 61234.0, "1": 12.0}


def test_memory_table_has_the_peak_and_the_gpu_total():
    point = {"device_mib": 4000.0, "kvcached": {"total": 1, "used": 16 * MiB,
                                                "prealloc": 160 * MiB}, "staging_mib": 2048}
    doc = {"modes": {"kvpd-staged": {
        "memory": {"before": {"decode": point}, "peak_load": {"decode": dict(point,
                                                                              device_mib=6000.0)},
                   "after_load": {"decode": point}, "idle": {"decode": point}},
        "gpu_used_mib": {"before": 30000.0, "peak_load": 34000.0, "after_load": 30500.0,
                         "idle": None}}}}
    text = "\n".join(pd_load.render_memory(doc))
    assert "4000 / 6000 / 4000 / 4000" in text and "16+160 / 16+160" in text
    assert "kvpd-staged    30000 / 34000 / 30500 / -" in text


# ---- the effective handoff on the IPC wire ------------------------------------------------


def test_effective_handoff_per_wire():
    eff = bench_transfer.effective_handoff
    assert eff(False, 0.25, None, None) == ("nixl", 0.25)  # vanilla: the READ
    assert eff(True, 0.2, 0.001, 0.002) == ("nixl", pytest.approx(0.203))
    assert eff(True, None, 0.001, 0.002) == ("ipc", pytest.approx(0.003))  # no READ
    assert eff(True, None, None, 0.002) == ("ipc", None)  # pack not measured
    assert eff(True, None, 0.001, None) == (None, None)  # nothing proves the handoff


# ---- the harnesses end to end, on the fake -------------------------------------------------


def _env(**extra):
    return dict(os.environ, FAKE_VLLM_START_DELAY="0.1", **extra)


def _bases():
    base = _ports.take()
    return ["--port-base", str(base + 100), "--side-channel-port-base", str(base + 300),
            "--proxy-port-base", str(base + 500)]


def test_load_checks_the_wire_and_counts_fallbacks(tmp_path):
    """P and D cannot open each other's memory (FAKE_VLLM_IPC_FAILS): the pair left to
    kvcached-pd falls back to NIXL and fails the wire check; the pair forced to NIXL passes."""
    out = tmp_path / "load"
    cmd = [sys.executable, os.path.join(EXP, "pd_load.py"), "--out", str(out),
           "--vllm-cmd", " ".join(FAKE), "--model", "fake-model", "--health-timeout", "30",
           "--requests", "8", "--concurrency", "4", "--max-prompt-tokens", "2000",
           "--modes", "kvpd-staged,kvpd-staged-nixl", "--expect-wire", "ipc",
           "--deadline-s", "120", "--no-environment", "--memory-sample-s", "0.05", *_bases()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200,
                         env=_env(FAKE_VLLM_AUTO_WIRE="ipc", FAKE_VLLM_IPC_FAILS="1"))
    assert res.returncode == 1, res.stdout + res.stderr
    modes = json.loads((out / "summary.json").read_text())["modes"]
    auto, nixl = modes["kvpd-staged"], modes["kvpd-staged-nixl"]
    assert auto["verdict"] == "FAIL" and auto["checks"]["wire"] == ["fail"]
    assert auto["wires"] == ["nixl"] and auto["wire_fallbacks"] == 1
    assert any("expected ipc only" in r for r in auto["reasons"])
    assert nixl["verdict"] == "PASS" and nixl["checks"]["wire"] == ["pass"], nixl["reasons"]
    assert nixl["expected_wire"] == "nixl" and nixl["wire_fallbacks"] == 0
    assert modes["reference"]["verdict"] == "PASS"
    assert {"before", "peak_load", "after_load", "idle"} <= set(nixl["gpu_used_mib"])
    text = (out / "summary.txt").read_text()
    assert "wireFB" in text


def test_equivalence_fails_a_pair_not_served_by_the_expected_wire(tmp_path):
    out = tmp_path / "eq"
    cmd = [sys.executable, os.path.join(EXP, "equivalence.py"), str(out), "staged-contiguous",
           "staged-nixl", "mixed-d", "--vllm-cmd", " ".join(FAKE), "--model", "fake-model",
           "--health-timeout", "30", "--expect-wire", "ipc", "--parallel", "0", *_bases()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=_env())
    assert res.returncode == 1, res.stdout + res.stderr  # auto chose nixl (another host)
    modes = json.loads((out / "summary.json").read_text())["modes"]
    auto = modes["staged-contiguous"]
    assert auto["verdict"] == "FAIL" and auto["wire"]["wires"] == ["nixl"]
    assert any("names wire nixl for its peer, expected ipc" in r for r in auto["reasons"])
    assert modes["staged-nixl"]["verdict"] == "PASS", modes["staged-nixl"]["reasons"]
    assert modes["mixed-d"]["verdict"] == "PASS" and modes["mixed-d"]["wire"]["expected"] is None
    assert " nixl " in (out / "summary.txt").read_text()  # the wire column


def test_bench_reports_the_ipc_wire_and_its_effective_handoff(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "num_key_value_heads": 16, "num_attention_heads": 16,
        "hidden_size": 256, "head_dim": 128, "dtype": "bfloat16"}))
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(EXP, "bench_transfer.py"), "--out", str(out),
           "--model", str(model), "--vllm-cmd", " ".join(FAKE), "--sizes", "16",
           "--repeats", "1", "--ttft-batch", "0", "--modes", "staged-contiguous,staged-nixl",
           "--deadline-s", "120", *_bases()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200,
                         env=_env(FAKE_VLLM_AUTO_WIRE="ipc"))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((out / "bench.json").read_text())
    ipc = doc["modes"]["staged-contiguous"]
    row = ipc["sizes"][0]
    # the fake packs in 0.25 ms and unpacks in 0.5 ms; no READ on the IPC wire
    assert row["wire"] == "ipc" and row["nixl_xfer_ms"] is None
    assert row["effective_ms"] == pytest.approx(0.75) and ipc["wire_logged"] == ["ipc"]
    nixl = doc["modes"]["staged-nixl"]
    row = nixl["sizes"][0]
    assert row["wire"] == "nixl" and nixl["wire_logged"] == ["nixl"]
    assert row["effective_ms"] == pytest.approx(0.75 + row["nixl_xfer_ms"])
    summary = (out / "summary.txt").read_text()
    assert "staged-contiguous ipc" in summary and "staged-nixl nixl" in summary
    assert "wire" in (out / "bench.csv").read_text().splitlines()[0].split(",")


# ---- run_colocated_on_host.sh -----------------------------------------------------------


def _dry_run(tmp_path, part, **env):
    res = subprocess.run(["bash", os.path.join(EXP, "run_colocated_on_host.sh"),
                          str(tmp_path / "out"), part], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, COLO_DRY_RUN="1", **env))
    assert res.returncode == 0, res.stderr
    return [shlex.split(line[len("DRY:"):]) for line in res.stdout.splitlines()
            if line.startswith("DRY:")]


def _after(argv, marker):
    return argv[[i for i, x in enumerate(argv) if x.endswith(marker)][0] + 1:]


@pytest.fixture
def models(tmp_path):
    paths = {}
    for name, kv_heads, layers in (("tiny", 8, 8), ("kvbig", 16, 32)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({
            "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
            "num_attention_heads": 16, "hidden_size": 1024, "head_dim": 128,
            "dtype": "bfloat16", "max_position_embeddings": 8192}))
        paths[name] = str(d)
    return {"TINY_MODEL": paths["tiny"], "KVBIG_MODEL": paths["kvbig"]}


def test_every_part_parses_with_the_harnesses_own_parsers(tmp_path, models):
    """Each command of each part, as the host would run it, parsed by its harness: a typo
    here would cost a host session."""
    seen = {}
    for part in "abcdef":
        cmds = _dry_run(tmp_path, part, **models)
        assert cmds, part
        outputs = 0
        for argv in cmds:
            if any(x.endswith("traffic.sh") for x in argv):
                a = pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]])
                assert (a.prefill_gpu, a.decode_gpu) == ("0", "0")  # one GPU by default
                assert a.expect_wire == "ipc" and a.push_concurrent
                seen.setdefault(part, []).append(a)
                outputs += 2  # its archive and its summary
            elif any(x.endswith("bench_transfer.py") for x in argv):
                a = bench_transfer.parse_args(_after(argv, "bench_transfer.py"))
                assert a.modes == ["vanilla", "staged-contiguous", "staged-nixl"]
                assert a.sizes == [4.0, 94.0, 1024.0] and a.staging_mb == 0
                assert (a.prefill_gpu, a.decode_gpu) == ("0", "0") and a.ttft_batch == 8
                seen[part] = [a]
                outputs += 2
            elif any(x.endswith("equivalence.sh") for x in argv):
                a = equivalence.parse_args(_after(argv, "equivalence.sh"))
                names = [m.name for m in pd_modes.resolve_modes(a.modes)]
                assert {"reference", "vanilla", "staged-contiguous", "push-contiguous",
                        "kvcached-pd-staged", "push", "mixed-p", "mixed-d", "blocksize",
                        "negative"} == set(names)
                assert a.expect_wire == "ipc" and a.push_concurrent and a.single_gpu == "0"
                assert "--enable-prefix-caching" in a.extra_serve_args
                seen[part] = [a]
                outputs += 2
            elif any(x.endswith("probe_cuda_ipc.py") for x in argv):
                a = probe_cuda_ipc.parse_args(_after(argv, "probe_cuda_ipc.py"))
                assert a.sizes_mib == [94, 1024]
                outputs += 1  # one archive with the probes' results
            elif any(x.endswith("ipc_selftest.py") for x in argv):
                pass  # kvcached-pd's own IPC self-test, where present: the same archive
            else:
                raise AssertionError(f"part {part}: unknown command {argv}")
        # commit.txt, PART.log, install.log at most: the host hands back 8 files
        assert outputs + 3 <= 8, part
    kvbig, tiny = seen["b"]
    assert (kvbig.requests, kvbig.concurrency, kvbig.ttft_batch) == (48, 8, 8)
    assert (tiny.requests, tiny.concurrency) == (64, 16)
    # one kvcached instance without PD beside the vanilla one: kvcached's own share of a gap
    assert kvbig.modes == tiny.modes == ["kvcached-single", "kvcached-single-sync",
                                         "vanilla-p-sync", "kvpd-staged-p-sync",
                                         "kvpd-push-p-sync", "kvpd-push"]
    assert kvbig.trace and tiny.trace  # the per-stage timeline of the TTFT gap
    assert not kvbig.freeze_others and not tiny.freeze_others
    # COLO_FREEZE_OTHERS=1: part b's loads run each mode with the others' servers stopped
    frozen = [pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]])
              for argv in _dry_run(tmp_path, "b", COLO_FREEZE_OTHERS="1", **models)
              if any(x.endswith("traffic.sh") for x in argv)]
    assert len(frozen) == 2 and all(a.freeze_others for a in frozen)
    (aborts,) = seen["d"]
    assert (aborts.abort_every, aborts.repeats) == (9, 5)
    killd, killp = seen["e"]
    assert (killd.kill, killp.kill) == ("decode", "prefill")
    # once 48 of the 128 requests completed, whatever their pace: "at +1 s" came after
    # the whole load with CUDA graphs (2026-11-29d)
    assert (killd.kill_after, killd.kill_at_s, killd.requests) == (48, None, 128)
    assert killd.modes == killp.modes == ["kvpd-staged", "kvpd-push"]
    (faults,) = seen["f"]
    assert (faults.ucx_fault_lib, faults.ucx_fault_on, faults.ucx_fault_every) == (
        "kvpd", "both", 8)
    assert faults.modes == ["vanilla", "kvpd-staged", "kvpd-push", "kvpd-staged-nixl"]


def test_part_e_kills_the_roles_asked_for_with_the_parts_whole_time(tmp_path, models):
    budgets = []
    for kills in ("decode", "prefill decode", "decode prefill"):
        cmds = [argv for argv in _dry_run(tmp_path, "e", COLO_KILLS=kills, **models)
                if any(x.endswith("traffic.sh") for x in argv)]
        roles = [pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]]).kill
                 for argv in cmds]
        assert roles == kills.split()
        budgets.append([int(x.split("=", 1)[1]) for argv in cmds for x in argv
                        if x.startswith("TRAFFIC_BUDGET_S=")])
    (alone,), (first, second), (kill_d, _) = budgets
    assert alone > 500 and second > 500  # dry runs take no time
    # the time goes by what each kill needs (2 x H200, 2026-11-27: the servers' start
    # ~130 s, a kill-D run 91 s, a kill-P run 31 s): an even split by runs gave kill D
    # 267 s of the default part and its push run never started
    assert 190 < first < 220 and 310 < kill_d < 345
    # 2 x H200, 2026-11-27g: kill D's servers took 152 s (lane T starting its own beside
    # them) and its pull run 91 s; with the 720 s session.sh gives part e, both its runs fit
    (argv, _) = [argv for argv in _dry_run(tmp_path, "e", COLO_BUDGET_S="720", **models)
                 if any(x.endswith("traffic.sh") for x in argv)]
    share = int(next(x.split("=", 1)[1] for x in argv if x.startswith("TRAFFIC_BUDGET_S=")))
    assert share > 152 + 2 * 91 + 45
    # ROLE:MODES kills that role under those modes only (2026-11-26, twice: kill D under
    # push never fitted after pull's run in the same part)
    cmds = [argv for argv in _dry_run(tmp_path, "e", COLO_KILLS="decode:kvpd-push prefill",
                                      **models) if any(x.endswith("traffic.sh") for x in argv)]
    runs = [pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]]) for argv in cmds]
    assert [(a.kill, a.modes) for a in runs] == [("decode", ["kvpd-push"]),
                                                 ("prefill", ["kvpd-staged", "kvpd-push"])]
    # kill D's one run and kill P's two (2026-11-26, eighth session: an even split by
    # kills gave kill P one run's time and its push run never ran)
    shares = [int(x.split("=", 1)[1]) for argv in cmds for x in argv
              if x.startswith("TRAFFIC_BUDGET_S=")]
    assert len(shares) == 2 and 265 < shares[0] < 300 and shares[1] > 500


def test_part_c_runs_the_modes_asked_for_and_part_e_can_skip_its_probes(tmp_path, models):
    """COLO_EQ_MODES runs what an earlier run's deadline cut (2026-11-26: P16/D32 and the
    negative control on vLLM 0.30.0); COLO_PROBES=0 leaves part e the kills alone."""
    (argv,) = _dry_run(tmp_path, "c", COLO_EQ_MODES="reference blocksize negative", **models)
    a = equivalence.parse_args(_after(argv, "equivalence.sh"))
    assert [m.name for m in pd_modes.resolve_modes(a.modes)] == ["reference", "blocksize",
                                                                  "negative"]
    for probes, want in (("1", 2), ("0", 0)):
        cmds = _dry_run(tmp_path, "e", COLO_PROBES=probes, **models)
        assert len([argv for argv in cmds if any(x.endswith(("probe_cuda_ipc.py",
                    "ipc_selftest.py")) for x in argv)]) == want
        assert len([argv for argv in cmds if any(x.endswith("traffic.sh") for x in argv)]) == 2


def test_part_d_traces_only_when_asked_and_takes_its_modes(tmp_path, models):
    """COLO_TRACE=1 gives the aborts run kvcached-pd's trace lines (the eighth session's
    differing output came from an untraced part d: nothing said what D did at the time)."""
    for env, want in (({}, False), ({"COLO_TRACE": "1"}, True)):
        (argv,) = [argv for argv in _dry_run(tmp_path, "d", **env, **models)
                   if any(x.endswith("traffic.sh") for x in argv)]
        a = pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]])
        assert a.trace is want and a.issue_aborts
        assert a.modes == ["kvpd-staged", "kvpd-push"]
    # COLO_D_LOAD_MODES: the aborts under other load modes
    (argv,) = [argv for argv in _dry_run(tmp_path, "d", COLO_D_LOAD_MODES="kvpd-push-p-sync",
                                         **models)
               if any(x.endswith("traffic.sh") for x in argv)]
    assert pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]]).modes == \
        ["kvpd-push-p-sync"]
    # COLO_CUDA_GRAPHS=1: the aborts with vLLM's CUDA graphs (eager unless asked), where
    # vLLM 0.30's graph dispatch, which prompt_tail_graph changes, decides D's steps
    for graphs, want in (("0", False), ("1", True)):
        (argv,) = [argv for argv in _dry_run(tmp_path, "d", COLO_CUDA_GRAPHS=graphs, **models)
                   if any(x.endswith("traffic.sh") for x in argv)]
        assert pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]]).cuda_graphs \
            is want


def test_parts_c_and_e_take_cuda_graphs_when_asked(tmp_path, models):
    """COLO_CUDA_GRAPHS=1 reaches the equivalence (c) and every kill run (e): eager, vLLM
    0.30's prompt_tail_graph decides nothing, so neither part said anything of it."""
    for graphs, want in (("0", False), ("1", True)):
        (argv,) = _dry_run(tmp_path, "c", COLO_CUDA_GRAPHS=graphs, **models)
        assert equivalence.parse_args(_after(argv, "equivalence.sh")).cuda_graphs is want
        runs = [pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]])
                for argv in _dry_run(tmp_path, "e", COLO_CUDA_GRAPHS=graphs, COLO_PROBES="0",
                                     **models)]
        assert [a.kill for a in runs] == ["decode", "prefill"]
        assert all(a.cuda_graphs is want for a in runs)


def test_part_e_prints_a_status_only_for_the_probes_it_ran(tmp_path, models):
    """2026-11-26 (eighth session): with COLO_PROBES=selftest part e printed "rc probe=1"
    for the probe it skipped, which reads as a failed probe."""
    for probes, want in (("1", {"probe", "selftest"}), ("selftest", {"selftest"}),
                         ("0", set())):
        res = subprocess.run(["bash", os.path.join(EXP, "run_colocated_on_host.sh"),
                              str(tmp_path / "out"), "e"], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ, COLO_DRY_RUN="1",
                                                  COLO_PROBES=probes, **models))
        printed = {line.split("=")[0][3:] for line in res.stdout.splitlines()
                   if line.startswith("rc ")}
        assert printed & {"probe", "selftest"} == want


def test_cuda_graphs_and_the_loads_of_part_b_when_asked(tmp_path, models):
    """COLO_CUDA_GRAPHS=1 reaches parts a and b's harnesses (eager otherwise: every result
    before 2026-11-27d); COLO_B_MODELS=kvbig gives the kvbig load the whole part."""
    def loads(**env):
        return [(pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]]),
                 int(next(x.split("=", 1)[1] for x in argv
                          if x.startswith("TRAFFIC_BUDGET_S="))))
                for argv in _dry_run(tmp_path, "b", **env, **models)
                if any(x.endswith("traffic.sh") for x in argv)]

    (kvbig, k_budget), (tiny, _) = loads()
    assert not kvbig.cuda_graphs and not tiny.cuda_graphs
    assert kvbig.model.endswith("kvbig") and tiny.model.endswith("tiny")
    ((alone, a_budget),) = loads(COLO_CUDA_GRAPHS="1", COLO_B_MODELS="kvbig")
    assert alone.cuda_graphs and alone.model.endswith("kvbig") and alone.ttft_batch == 8
    assert a_budget > k_budget + 200  # the whole part, less the packing margin
    # kvbig's TTFT batch three times a mode unless COLO_TTFT_REPEATS says otherwise (one
    # batch is one sample: 1.35x in one run, 1.57x / 1.63x in the next two, 2026-11-29d/e)
    assert kvbig.ttft_batch_repeats == 3 and tiny.ttft_batch == 0
    ((once, _),) = loads(COLO_TTFT_REPEATS="1", COLO_B_MODELS="kvbig")
    assert once.ttft_batch_repeats == 1
    ((t, _),) = loads(COLO_B_MODELS="tiny")
    assert t.model.endswith("tiny") and not t.cuda_graphs
    # COLO_STAGING_MB reaches both loads (the harness strips the caller's KVCACHED_*)
    assert kvbig.staging_mb is None and tiny.staging_mb is None
    assert [a.staging_mb for a, _ in loads(COLO_STAGING_MB="6144")] == [6144, 6144]
    # COLO_SERVE_ARGS reaches both loads' servers (--cudagraph-metrics for D's first
    # forwards on vLLM 0.30.0, 2026-11-29b), nothing when unset
    assert kvbig.extra_serve_args == tiny.extra_serve_args == ""
    assert [a.extra_serve_args for a, _ in loads(COLO_SERVE_ARGS="--cudagraph-metrics")] == \
        ["--cudagraph-metrics"] * 2
    # COLO_B_LOAD_MODES: the modes of both loads (every PD mode unless asked)
    assert kvbig.modes == tiny.modes == ["kvcached-single", "kvcached-single-sync",
                                         "vanilla-p-sync", "kvpd-staged-p-sync",
                                         "kvpd-push-p-sync", "kvpd-push"]
    assert [a.modes for a, _ in loads(COLO_B_LOAD_MODES="kvcached-single,kvpd-push")] == \
        [["kvcached-single", "kvpd-push"]] * 2
    for graphs, want in (("0", False), ("1", True)):
        (argv,) = _dry_run(tmp_path, "a", COLO_CUDA_GRAPHS=graphs, **models)
        assert bench_transfer.parse_args(_after(argv, "bench_transfer.py")).cuda_graphs is want
    res = subprocess.run(["bash", os.path.join(EXP, "run_colocated_on_host.sh"),
                          str(tmp_path / "out"), "b"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, COLO_DRY_RUN="1",
                                              COLO_B_MODELS="kvbig huge", **models))
    assert res.returncode == 2 and "unknown model 'huge'" in res.stderr


def _serving_harnesses(tmp_path, parts, **env):
    """(part, parsed arguments) of every load and equivalence harness the parts run."""
    for part in parts:
        for argv in _dry_run(tmp_path, part, **env):
            if any(x.endswith("traffic.sh") for x in argv):
                yield part, pd_load.parse_args(["--out", "x", *_after(argv, "traffic.sh")[1:]])
            elif any(x.endswith("equivalence.sh") for x in argv):
                yield part, equivalence.parse_args(_after(argv, "equivalence.sh"))


def test_a_port_base_reaches_every_harness_of_a_part(tmp_path, models):
    seen = set()
    for part, a in _serving_harnesses(tmp_path, "bcdef", COLO_PORT_BASE="23000", **models):
        seen.add(part)
        assert (a.port_base, a.side_channel_port_base, a.proxy_port_base) == (
            23000, 23200, 23400), part
    assert seen == set("bcdef")


def test_other_gpus_and_unknown_parts(tmp_path, models):
    # two GPUs: D sees its own first and P's second (the IPC wire needs P's GPU visible)
    (cmd,) = _dry_run(tmp_path, "a", KVPD_GPUS="0 1", **models)
    a = bench_transfer.parse_args(_after(cmd, "bench_transfer.py"))
    assert (a.prefill_gpu, a.decode_gpu) == ("0", "1,0")
    (cmd,) = _dry_run(tmp_path, "a", KVPD_GPUS="0 1", KVPD_D_SEES_P="0", **models)
    a = bench_transfer.parse_args(_after(cmd, "bench_transfer.py"))
    assert (a.prefill_gpu, a.decode_gpu) == ("0", "1")
    (cmd,) = _dry_run(tmp_path, "a", KVPD_GPUS="1 1", **models)
    a = bench_transfer.parse_args(_after(cmd, "bench_transfer.py"))
    assert (a.prefill_gpu, a.decode_gpu) == ("1", "1")
    res = subprocess.run(["bash", os.path.join(EXP, "run_colocated_on_host.sh"),
                          str(tmp_path), "z"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "unknown part 'z'" in res.stderr


# ---- the CUDA IPC probe ------------------------------------------------------------------


def test_probe_arguments_and_its_no_cuda_answer(capsys):
    with pytest.raises(SystemExit):
        probe_cuda_ipc.parse_args(["--sizes-mib", "0"])
    assert "at least 1 MiB" in capsys.readouterr().err
    a = probe_cuda_ipc.parse_args(["--sizes-mib", "1", "--role", "exporter"])
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would run for real")
    assert probe_cuda_ipc.exporter(a) == 1
    kind, payload = capsys.readouterr().out.split(" ", 2)[1:]
    assert kind == "ERROR" and "no CUDA device" in json.loads(payload)["error"]


def test_probe_conclusions_from_its_steps():
    res = {"importer_status_after_kill": "alive",
           "gpu_used_mib": {"both_mapped": 10000.0, "exporter_killed": 9000.0,
                            "importer_released": 7800.0},
           "after_exporter_killed": {
               "sizes": {"94": {"copy_ok": True, "old_bytes": True},
                         "1024": {"copy_ok": True, "old_bytes": False}},
               "event_wait_ok": True, "fresh_alloc_kernel_ok": True}}
    c = probe_cuda_ipc.conclusions(res)
    assert c["importer_survived_exporter_death"] is True
    assert c["copy_from_mapping_after_death_ok"] is True
    assert c["reads_old_bytes_after_death"] is False
    assert c["freed_by_exporter_death_mib"] == 1000 and c["freed_by_importer_release_mib"] == 1200
    dead = probe_cuda_ipc.conclusions({"importer_status_after_kill": "EOF", "gpu_used_mib": {}})
    assert dead["importer_survived_exporter_death"] is False
    assert dead["reads_old_bytes_after_death"] is None


def test_part_e_runs_the_ipc_self_test_on_ps_and_ds_gpus(tmp_path, models):
    """Across two GPUs the self-test must read P's GPU at P's death and at D's unmap
    (2 x H100, 2026-11-26: D's unmap line said 0 MiB for P's GPU, and nothing read P's
    GPU in between); COLO_PROBES=selftest runs it without the slower probe."""
    import ipc_selftest

    for gpus, probes, want in (("0 1", "selftest", (0, 1)), ("0 0", "1", (0, 0))):
        cmds = _dry_run(tmp_path, "e", COLO_PROBES=probes, KVPD_GPUS=gpus, **models)
        tests = [argv for argv in cmds if any(x.endswith("ipc_selftest.py") for x in argv)]
        probe = [argv for argv in cmds if any(x.endswith("probe_cuda_ipc.py") for x in argv)]
        assert len(tests) == 1 and len(probe) == (1 if probes == "1" else 0)
        a = ipc_selftest.parse_args(_after(tests[0], "ipc_selftest.py"))
        assert (a.peer_device, a.device) == want


def test_the_self_test_says_whether_ps_death_or_ds_unmap_freed_ps_gpu():
    import ipc_selftest

    held = {"both_alive": 5000.0, "peer_killed": 4476.0, "unmapped": 3452.0}
    assert ipc_selftest.freed_on_peer_gpu(held) == {"by_death": 524.0, "by_unmap": 1024.0}
    at_death = {"both_alive": 5000.0, "peer_killed": 3452.0, "unmapped": 3452.0}
    assert ipc_selftest.freed_on_peer_gpu(at_death) == {"by_death": 1548.0, "by_unmap": 0.0}
    assert ipc_selftest.freed_on_peer_gpu({"both_alive": 1.0}) == {"by_death": None,
                                                                   "by_unmap": None}


def test_the_wire_every_load_expects_follows_what_d_can_map(tmp_path, models):
    """ipc on one GPU and across two with P's GPU visible to D; nixl across two with D
    seeing its own alone (KVPD_D_SEES_P=0: `auto` falls back, D's staging allocated at
    its first READ), so part d can run the issue's aborts on that wire."""
    def wires(**env):
        found = {(part, a.expect_wire) for part, a in
                 _serving_harnesses(tmp_path, "bcdef", **env, **models)}
        assert {part for part, _ in found} == set("bcdef")
        return {wire for _, wire in found}

    assert wires() == {"ipc"}
    assert wires(KVPD_GPUS="0 1") == {"ipc"}
    assert wires(KVPD_GPUS="0 1", KVPD_D_SEES_P="0") == {"nixl"}
    assert wires(KVPD_GPUS="1 1", KVPD_D_SEES_P="0") == {"ipc"}  # one GPU: D sees P's


def test_two_parts_started_in_the_same_second_work_in_folders_of_their_own(tmp_path, models):
    """2026-11-27g: lane T's colo-g and lane C's colo-h (both part b) started in the same
    second, shared /tmp/kvpd-colo-b-HHMMSS, and each packed the other's load as its own."""
    env = dict(os.environ, COLO_DRY_RUN="1", **models)
    procs = [subprocess.Popen(["bash", os.path.join(EXP, "run_colocated_on_host.sh"),
                               str(tmp_path / f"out{i}"), "b"], stdout=subprocess.PIPE,
                              text=True, env=env) for i in range(2)]
    folders = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        argv = next(shlex.split(line[len("DRY:"):]) for line in out.splitlines()
                    if line.startswith("DRY:") and "traffic.sh" in line)
        folders.append(os.path.dirname(_after(argv, "traffic.sh")[0]))
    assert folders[0] != folders[1]


def test_two_traffic_runs_started_in_the_same_second_get_work_trees_of_their_own(tmp_path):
    """traffic.sh's default WORK: on 2026-11-27 two session lanes started in the same
    second and shared /tmp/kvpd-load/<time>; their servers appended to each other's logs
    (the traces, the step periods) and their results were packed from one tree."""
    for name in ("tiny", "kvbig"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    stub = tmp_path / "stub.py"  # stands for pd_load.py: says where it writes
    stub.write_text("import sys; print('OUT', sys.argv[sys.argv.index('--out') + 1])\n")
    py = tmp_path / "py"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {stub} \"$@\"\n")
    py.chmod(0o755)
    env = dict(os.environ, PYTHON=str(py), TINY_MODEL=str(tmp_path / "tiny"),
               KVBIG_MODEL=str(tmp_path / "kvbig"), PATH="/usr/bin:/bin")
    env.pop("TRAFFIC_WORK", None)
    procs = [subprocess.Popen(["bash", os.path.join(EXP, "traffic.sh"), str(tmp_path / f"o{i}")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    works = []
    for out in outs:
        line = next(x for x in out.splitlines() if x.startswith("OUT "))
        works.append(os.path.dirname(line.split()[1]))
    assert works[0] != works[1], outs
    for w in works:
        assert w.startswith("/tmp/kvpd-load/") and os.path.isfile(os.path.join(w, "traffic.log"))
    for w in works:
        subprocess.run(["rm", "-rf", w], check=False)
