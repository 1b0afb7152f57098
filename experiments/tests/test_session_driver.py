"""experiments/gpu_host/session.sh: the lanes run their steps in the background, in
order, side by side where the plan says so; a step that does not fit before the deadline
is recorded as not run; `wait` packs what finished. Steps are stand-ins
(SESSION_FAKE_STEPS): the real ones need a GPU.

run: python3 -m pytest experiments/tests/test_session_driver.py -q
"""

from __future__ import annotations

import os
import subprocess
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
SESSION = os.path.join(os.path.dirname(HERE), "gpu_host", "session.sh")


def run(tmp_path, *args, **env):
    full = dict(os.environ, SESSION_DIR=str(tmp_path / "s"), **env)
    return subprocess.run(["bash", SESSION, *args], env=full, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def steps(tmp_path) -> dict[str, str]:
    lines = (tmp_path / "s" / "steps.txt").read_text().splitlines()
    return {line.split()[0]: line for line in lines}


def test_two_gpus_run_both_lanes_then_the_cross_gpu_step(tmp_path):
    r = run(tmp_path, "start", "abc123", SESSION_FAKE_STEPS="1", SESSION_GPUS="2",
            SESSION_SECONDS="60")
    assert r.returncode == 0 and "session started" in r.stdout, r.stderr
    out = tmp_path / "out"
    r = run(tmp_path, "wait", "60", str(out))
    assert r.returncode == 0, r.stderr
    done = steps(tmp_path)
    assert set(done) == {"handoff", "ab21", "serve", "colo-a", "serve-cap", "colo-c",
                         "colo-d", "colo-b", "cross-a"}
    assert "rc=1" in done["colo-d"] and "rc=0" in done["serve"]  # a failing step is recorded
    assert "(all lanes done)" in (out / "session.txt").read_text()
    with tarfile.open(out / "T.tar.gz") as t:
        assert {"handoff/summary.txt", "serve/summary.txt"} <= set(t.getnames())
    with tarfile.open(out / "X.tar.gz") as t:
        assert "cross-a/summary.txt" in t.getnames()
    assert len(os.listdir(out)) <= 8  # the host hands back at most 8 files
    # the lanes' order: T's steps one after the other, C's first two side by side
    t_log = (tmp_path / "s" / "lane-T.log").read_text()
    assert t_log.index("handoff done") < t_log.index("ab21:") < t_log.index("serve:")
    c_log = (tmp_path / "s" / "lane-C.log").read_text()
    assert c_log.index("colo-d:") < c_log.index("colo-c done")
    assert c_log.index("colo-c done") < c_log.index("colo-b:")


def test_wait_on_a_machine_without_the_session_returns_at_once(tmp_path):
    """A machine lost between two calls comes back bare: `wait` there says so and returns
    at once instead of sleeping its seconds (2026-11-29c: 585 s of device time slept for
    nothing)."""
    import time

    t0 = time.monotonic()
    r = run(tmp_path, "wait", "60", str(tmp_path / "out"))
    assert r.returncode == 3 and "no session on this machine" in r.stderr
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "out").exists()


def test_a_step_that_does_not_fit_before_the_deadline_is_not_run(tmp_path):
    # the real estimates (minutes) against a 30-second session: nothing fits
    r = run(tmp_path, "start", "abc123", SESSION_GPUS="1", SESSION_SECONDS="30")
    assert r.returncode == 0, r.stderr
    run(tmp_path, "wait", "30", str(tmp_path / "out"))
    done = steps(tmp_path)
    assert done and all("not run" in line for line in done.values())
    assert "cross-a" not in done  # one GPU: no cross-GPU lane


def test_dry_run_names_each_steps_command(tmp_path):
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert any(line.startswith("T serve: python3 experiments/bench_serve.py") for line in lines)
    assert any(line.startswith("T serve-cap: ") and "KVCACHED_MAX_CACHED_TOKENS=200000" in line
               for line in lines)
    assert any("KVPD_GPUS='0 1'" in line and line.startswith("X cross-a") for line in lines)
    assert any("KVPD_GPUS='1 1'" in line and line.startswith("C colo-b") for line in lines)


def test_a_plan_of_lanes_runs_steps_in_another_venv_once_it_is_ready(tmp_path):
    # SESSION_PLAN: lane X after the others; STEP@TAG waits for /ROOT/vTAG/.ready and runs
    # with that venv's bin first on PATH (a second vLLM installed while the first steps run)
    root = tmp_path / "venvs"
    (root / "v033" / "bin").mkdir(parents=True)
    (root / "v033" / "bin" / "python3").symlink_to("/bin/true")
    (root / "v099" / "bin").mkdir(parents=True)  # never made ready
    r = run(tmp_path, "start", "abc123", SESSION_FAKE_STEPS="1", SESSION_GPUS="2",
            SESSION_SECONDS="40", SESSION_VENV_ROOT=str(root),
            SESSION_PLAN="T ab21 colo-a@033; C colo-c@033+colo-d@033 ;X cross-a@099")
    assert r.returncode == 0, r.stderr
    subprocess.run(["sleep", "3"])
    assert not (tmp_path / "s" / "work" / "colo-a@033").exists()  # still waiting
    (root / "v033" / ".ready").touch()
    run(tmp_path, "wait", "60", str(tmp_path / "out"))
    done = steps(tmp_path)
    assert set(done) == {"ab21", "colo-a@033", "colo-c@033", "colo-d@033", "cross-a@099"}
    assert "rc=0" in done["colo-a@033"] and "rc=0" in done["colo-c@033"]
    assert "never appeared" in done["cross-a@099"]
    ran_with = (tmp_path / "s" / "work" / "colo-a@033" / "summary.txt").read_text().split()
    assert ran_with == ["colo-a@033", str(root / "v033" / "bin" / "python3")]
    ab21 = (tmp_path / "s" / "work" / "ab21" / "summary.txt").read_text().split()
    assert ab21[1] != ran_with[1]  # a step without a tag keeps the host's python3


def test_dry_run_of_a_plan_names_the_ab21_trees_and_serve_modes(tmp_path):
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2", SESSION_PLAN="T ab21 serve colo-e",
            SESSION_AB21_TREES="211e4d9 HEAD", SESSION_AB21_REPEATS="7",
            SESSION_SERVE_MODES="vanilla,kvpd-push")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "for c in 211e4d9 HEAD;" in out and "--repeats 7" in out
    assert "/work/ab21/$n-$c " in out  # a tree named twice: two dirs
    assert "--modes vanilla,kvpd-push " in out
    assert "run_colocated_on_host.sh /tmp" in out and out.rstrip().endswith(" e")
    assert "cross-a" not in out  # the plan replaced the default one


def test_the_chunks_step_runs_on_its_lanes_gpu_with_arguments_its_script_parses(tmp_path):
    import shlex
    import sys

    sys.path.insert(0, os.path.dirname(HERE))
    import chunk_split

    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2", SESSION_PLAN="T colo-d;C chunks")
    assert r.returncode == 0, r.stderr
    (line,) = [line for line in r.stdout.splitlines() if line.startswith("C chunks:")]
    argv = shlex.split(line.split(":", 1)[1])
    assert argv[0] == "CUDA_VISIBLE_DEVICES=1" and argv[2].endswith("chunk_split.py")
    known = chunk_split.parse_known([argv[i + 1] for i, x in enumerate(argv) if x == "--known"])
    assert sorted(known) == ["load-034-1167", "load-063-704"]
    assert len(known["load-034-1167"]["pd-push-differing"]) == 8


def test_a_cross_gpu_step_in_lane_c_gets_lane_cs_ports(tmp_path):
    """Two lanes of correctness runs across both GPUs at once (2026-11-27's plan): lane
    C's harnesses must not take lane T's free ports."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2",
            SESSION_PLAN="T cross-c cross-d;C cross-f cross-d")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    for step in ("C cross-f", "C cross-d"):
        assert "COLO_PORT_BASE=23000 KVPD_GPUS='0 1'" in lines[step], lines[step]
    for step in ("T cross-c", "T cross-d"):
        assert "COLO_PORT_BASE" not in lines[step] and "KVPD_GPUS='0 1'" in lines[step]


def test_the_launch_step_runs_its_script_on_its_lanes_gpu(tmp_path):
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2", SESSION_PLAN="T launch;C launch")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert "CUDA_VISIBLE_DEVICES=0 " in lines["T launch"]
    assert "CUDA_VISIBLE_DEVICES=1 " in lines["C launch"]
    assert "experiments/bench_launch_paths.py --out /" in lines["T launch"]
    assert os.path.exists(os.path.join(os.path.dirname(HERE), "bench_launch_paths.py"))


def test_a_colocated_step_runs_on_its_own_lanes_gpu(tmp_path):
    """colo-b..colo-e take the GPU of the lane they are in: lane C's with two GPUs, GPU 0
    in lane T (2026-11-26: colo-e named in lane T ran on lane C's GPU 1, beside colo-c)."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2",
            SESSION_PLAN="T ab21 colo-e colo-d;C colo-b colo-c+colo-e")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert "KVPD_GPUS='0 0'" in lines["T colo-e"] and "KVPD_GPUS='0 0'" in lines["T colo-d"]
    assert "KVPD_GPUS='1 1'" in lines["C colo-e"] and "KVPD_GPUS='1 1'" in lines["C colo-b"]
    # lane C's harnesses get ports of their own (2026-11-26: lane C's aborts run, started
    # with lane T's kvbig load, picked the same free ports and sent its requests there)
    assert "COLO_PORT_BASE=23000" in lines["C colo-b"] and "COLO_PORT_BASE" not in lines["T colo-d"]


def test_the_cuda_graph_loads_run_part_b_with_graphs_one_model_each(tmp_path):
    """colo-g / colo-h: the kvbig / tiny load of part b with vLLM's CUDA graphs (the
    harnesses' instances run eager otherwise), on the lane's GPU."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2", SESSION_PLAN="T colo-g;C colo-h")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    for name, gpu, model in (("T colo-g", 0, "kvbig"), ("C colo-h", 1, "tiny")):
        assert f"KVPD_GPUS='{gpu} {gpu}'" in lines[name] and "COLO_CUDA_GRAPHS=1" in lines[name]
        assert f"COLO_B_MODELS={model} " in lines[name]
        assert lines[name].endswith(f"/work/{name.split()[1]} b")  # part b


def test_a_step_named_for_a_tree_runs_from_that_tree(tmp_path):
    """STEP.t-TREE: STEP's own command, run from .gpu/trees/TREE (a package change beside
    the session's own tree on one install); the estimate is STEP's."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2",
            SESSION_PLAN="T colo-h colo-h.t-polled;C colo-d.mps.t-polled")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line.split(": ", 1)[1] for line in r.stdout.splitlines()}
    own = lines["T colo-h"]
    assert not own.startswith("cd ")
    assert lines["T colo-h.t-polled"] == "cd .gpu/trees/polled && " + own.replace(
        "/work/colo-h", "/work/colo-h.t-polled")
    c = lines["C colo-d.mps.t-polled"]
    assert c.startswith("cd .gpu/trees/polled && bash experiments/gpu_host/with_mps.sh ")
    assert "KVPD_GPUS=\\'1\\ 1\\'" in c  # inside with_mps.sh's quoted command
    # its estimate is its step's: a 30-second session runs neither
    r = run(tmp_path, "start", "abc123", SESSION_GPUS="1", SESSION_SECONDS="30",
            SESSION_PLAN="T colo-h.t-polled")
    run(tmp_path, "wait", "30", str(tmp_path / "out"))
    assert "estimate 240s" in steps(tmp_path)["colo-h.t-polled"]


def test_cross_n_runs_part_a_across_the_gpus_with_d_seeing_its_own_gpu_alone(tmp_path):
    """cross-n: D cannot map P's staging, so the auto wire falls back to NIXL and D
    allocates its staging range at its first READ (the GPU run of that allocation)."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2", SESSION_PLAN="X cross-n cross-a")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert "KVPD_GPUS='0 1' KVPD_D_SEES_P=0 " in lines["X cross-n"]
    assert lines["X cross-n"].endswith("/work/cross-n a")
    assert "KVPD_D_SEES_P" not in lines["X cross-a"]


def test_colo_gs_and_cross_dn(tmp_path):
    """colo-gs: colo-g with P's staging holding the TTFT batch (SESSION_STAGING_MB, 6144
    unless set); cross-dn: the aborts across the GPUs with D on the NIXL fallback."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2", SESSION_PLAN="T colo-gs;X cross-dn")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert "COLO_CUDA_GRAPHS=1 COLO_B_MODELS=kvbig COLO_STAGING_MB=6144 " in lines["T colo-gs"]
    assert lines["T colo-gs"].endswith("/work/colo-gs b")
    assert "KVPD_GPUS='0 1' KVPD_D_SEES_P=0 COLO_ABORT_REPEATS=3 " in lines["X cross-dn"]
    assert lines["X cross-dn"].endswith("/work/cross-dn d")
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2", SESSION_PLAN="T colo-gs",
            SESSION_STAGING_MB="8192")
    assert "COLO_STAGING_MB=8192 " in r.stdout


def test_steps_run_side_by_side_get_ports_of_their_own(tmp_path):
    """2 x H100, 2026-11-27: "C colo-c+colo-d" gave both steps COLO_PORT_BASE=23000; their
    first kvcached-pd servers met "Address already in use" and both modes were lost."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2",
            SESSION_PLAN="T colo-a colo-e+colo-d;C colo-c+colo-d colo-b")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith(("T ", "C "))]
    bases = [line.split("COLO_PORT_BASE=")[1].split()[0] if "COLO_PORT_BASE=" in line
             else None for line in lines]
    assert bases == [None, None, "27000", "23000", "24000", "23000"], lines
    started = run(tmp_path, "start", "abc123", SESSION_FAKE_STEPS="1", SESSION_GPUS="2",
                  SESSION_SECONDS="40", SESSION_PLAN="T colo-a;C colo-c+colo-d")
    assert started.returncode == 0, started.stderr
    run(tmp_path, "wait", "60", str(tmp_path / "out"))
    work = tmp_path / "s" / "work"
    ports = {step: (work / step / "lane.txt").read_text().split()[0] for step in ("colo-c",
                                                                             "colo-d")}
    assert sorted(ports.values()) == ["COLO_PORT_BASE=23000", "COLO_PORT_BASE=24000"]


def test_a_started_session_gives_each_lane_its_gpu_and_ports(tmp_path):
    """What the dry run prints must also reach the background lanes (2026-11-26: the
    port helper was not exported to them; lane C's aborts and lane T's kills took the same
    ports and talked to each other's servers, both runs lost)."""
    r = run(tmp_path, "start", "abc123", SESSION_FAKE_STEPS="1", SESSION_GPUS="2",
            SESSION_SECONDS="40", SESSION_PLAN="T colo-e;C colo-d")
    assert r.returncode == 0, r.stderr
    run(tmp_path, "wait", "60", str(tmp_path / "out"))
    work = tmp_path / "s" / "work"
    assert (work / "colo-e" / "lane.txt").read_text().split() == ["gpu", "0"]
    assert (work / "colo-d" / "lane.txt").read_text().split() == [
        "COLO_PORT_BASE=23000", "gpu", "1"]
    assert "command not found" not in (tmp_path / "s" / "lane-C.log").read_text()


def test_cross_gpu_steps_are_gated_by_their_own_times_not_the_one_gpu_ones():
    # 2 x H100, 2026-11-26: cross-b took 216-253 s but was gated by colo-b's 9 minutes
    # (one GPU, NIXL pairs at 0.5 GB/s), which left cross-d no room in a 1 080 s session
    src = open(SESSION).read()
    est = src[src.index("est() {"):src.index("\n}\n", src.index("est() {")) + 3]

    def minutes(step):
        out = subprocess.run(["bash", "-c", est + f"est {step}"], capture_output=True,
                             text=True, timeout=30, env={"PATH": os.environ["PATH"]})
        return int(out.stdout)

    assert minutes("cross-b") * 60 >= 253 and minutes("cross-b") < minutes("colo-b")
    assert minutes("cross-a") * 60 >= 123 and minutes("cross-a") < minutes("colo-a")
    assert minutes("cross-b@030") == minutes("cross-b")
    # started with its 5 minutes left, cross-d had 280 s and ran 4 of the 5 abort repeats
    assert minutes("cross-d") * 60 - 20 > 280
    # 2 x H200, 2026-11-27e: cross-b 293 s; colo-g 150-192 s and colo-h 157 s on CUDA
    # graphs, whose 8 minutes kept colo-h out of a session with 470 s left
    assert minutes("cross-b") * 60 >= 293 + 20
    for step in ("colo-g", "colo-h"):
        assert 192 + 20 <= minutes(step) * 60 < 470


def test_check_uploads_refuses_a_folder_the_checkout_leaves_no_room_for(tmp_path):
    """2026-11-27: 28 upload folders of 40 MiB built for a smaller checkout were refused
    mid-lease. check_uploads.sh says so before a lease (sizes are apparent sizes: the
    sparse files below take no disk)."""
    script = os.path.join(os.path.dirname(SESSION), "check_uploads.sh")
    small, big = tmp_path / "small" / "up1", tmp_path / "big" / "up2"
    for folder, mib in ((small, 1), (big, 63)):
        folder.mkdir(parents=True)
        with open(folder / "part", "wb") as f:
            f.truncate(mib * 1024 * 1024)
    ok = subprocess.run(["bash", script, str(tmp_path / "small")], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and "fits" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run(["bash", script, str(tmp_path / "small"), str(tmp_path / "big")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "does NOT fit" in bad.stdout
    assert "rebuild with FOLDER_MIB=" in bad.stdout and str(big) in bad.stdout


def test_check_uploads_counts_a_checkout_with_a_file_deleted_but_still_indexed(tmp_path):
    """2026-11-27: a results file moved with ``git mv`` and the move unstaged left its old
    path indexed but gone; stat failed on it and the script died silently (xargs 123
    under pipefail) instead of answering. Such a file does not travel: skip it."""
    repo = tmp_path / "repo"
    (repo / "experiments" / "gpu_host").mkdir(parents=True)
    script = repo / "experiments" / "gpu_host" / "check_uploads.sh"
    script.write_text(open(os.path.join(os.path.dirname(SESSION), "check_uploads.sh")).read())
    (repo / "kept.bin").write_bytes(b"x" * 4096)
    (repo / "gone.bin").write_bytes(b"y" * 4096)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "t"], check=True)
    (repo / "gone.bin").unlink()
    folder = tmp_path / "set" / "up1"
    folder.mkdir(parents=True)
    (folder / "part").write_bytes(b"z")
    r = subprocess.run(["bash", str(script), str(tmp_path / "set")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "fits" in r.stdout, r.stdout + r.stderr
    assert "checkout: " in r.stdout


def test_the_kills_get_more_than_one_host_commands_seconds(tmp_path):
    """colo-e's kill D push never started within the 560 s a part gets in one host
    command (2026-11-27f and g: its servers alone took 118-152 s); in a session a step is
    no host command, so part e gets 720 s and every other part 560."""
    r = run(tmp_path, "start", "abc123", SESSION_FAKE_STEPS="1", SESSION_GPUS="2",
            SESSION_SECONDS="1000", SESSION_PLAN="T colo-e;C colo-d")
    assert r.returncode == 0, r.stderr
    run(tmp_path, "wait", "60", str(tmp_path / "out"))
    work = tmp_path / "s" / "work"
    assert int((work / "colo-e" / "budget.txt").read_text()) == 720
    assert int((work / "colo-d" / "budget.txt").read_text()) == 560


def _assert_wraps_the_plain_step(tmp_path, lines: dict, lane: str, step: str, suffix: str,
                                 wrapper: str, gpus: str) -> None:
    """STEP.SUFFIX's dry-run command is ``gpu_host/WRAPPER`` over the plain step's own
    command (the same lane, so the same GPU), quoted, in the STEP.SUFFIX step's folder."""
    w = f"{tmp_path}/s/work/{step}.{suffix}"
    prefix = f"bash experiments/gpu_host/{wrapper} {w} bash -c "
    cmd = lines[f"{lane} {step}.{suffix}"]
    assert cmd.startswith(prefix), cmd
    inner = subprocess.run(["bash", "-c", "printf %s " + cmd[len(prefix):]],
                           capture_output=True, text=True).stdout
    plain = run(tmp_path, "dry", "abc123", SESSION_GPUS=gpus,
                SESSION_PLAN=f"{lane} {step}").stdout.split(": ", 1)[1].strip()
    assert inner == plain.replace(f"/work/{step} ", f"/work/{step}.{suffix} "), (inner, plain)


def test_a_colocated_step_named_mps_runs_under_the_lanes_own_mps_server(tmp_path):
    """STEP.mps: the colocated step's own command (its instances on the lane's GPU), every
    instance a client of one MPS server (with_mps.sh, its pipes in the step's folder)."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2",
            SESSION_PLAN="T colo-g colo-g.mps;C colo-h.mps colo-d.mps")
    assert r.returncode == 0, r.stderr
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in r.stdout.splitlines()}
    for lane, step in (("T", "colo-g"), ("C", "colo-h"), ("C", "colo-d")):
        _assert_wraps_the_plain_step(tmp_path, lines, lane, step, "mps", "with_mps.sh", "2")
    # COLO_B_LOAD_MODES_MPS: the .mps steps' own load modes, the plain steps keep theirs
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2", COLO_B_LOAD_MODES_MPS="a,b-lowprio",
            SESSION_PLAN="T colo-h.mps;C colo-g")
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in r.stdout.splitlines()}
    inner = subprocess.run(["bash", "-c", "printf %s " + lines["T colo-h.mps"].split(
        " bash -c ", 1)[1]], capture_output=True, text=True).stdout
    assert inner.startswith("COLO_B_LOAD_MODES=a,b-lowprio KVPD_GPUS="), inner
    assert "COLO_B_LOAD_MODES" not in lines["C colo-g"]


def test_a_colocated_step_named_spy_runs_with_py_spy_on_its_engines(tmp_path):
    """STEP.spy: the colocated step's own command, inside with_pyspy.sh (py-spy on every
    engine process it starts, the stacks in the .spy step's folder); the tiny model
    stays colo-h's and the kvbig colo-g's."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="1",
            SESSION_PLAN="T colo-h.spy colo-g.spy colo-d.spy")
    assert r.returncode == 0, r.stderr
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in r.stdout.splitlines()}
    for step in ("colo-h", "colo-g", "colo-d"):
        _assert_wraps_the_plain_step(tmp_path, lines, "T", step, "spy", "with_pyspy.sh", "1")
    assert "COLO_B_MODELS=tiny" in lines["T colo-h.spy"]
    assert "COLO_B_MODELS=kvbig" in lines["T colo-g.spy"]


WITH_MPS = os.path.join(os.path.dirname(HERE), "gpu_host", "with_mps.sh")


def test_with_mps_serves_the_command_its_own_daemon_and_stops_it_however_it_ends(tmp_path):
    """The command's CUDA processes find the daemon through the pipe folder under WORKDIR;
    the daemon is started with every GPU visible (a CUDA_VISIBLE_DEVICES at its start
    renumbers the GPUs its clients name) and told to quit when the command ends, also
    when it fails (its exit status is kept); without a control daemon nothing runs."""
    ctl = tmp_path / "fake-ctl"
    calls = tmp_path / "calls.txt"
    ctl.write_text(f"#!/bin/bash\necho \"$* gpu=$CUDA_VISIBLE_DEVICES stdin=$([ \"$1\" = -d ] "
                   f"|| cat)\" >> {calls}\n")
    ctl.chmod(0o755)
    w = tmp_path / "w"
    cmd = "echo pipe=$CUDA_MPS_PIPE_DIRECTORY > $0.seen; exit 7"
    r = subprocess.run(["bash", WITH_MPS, str(w), "bash", "-c", cmd, str(w / "cmd")],
                       env=dict(os.environ, MPS_CONTROL=str(ctl), CUDA_VISIBLE_DEVICES="1"),
                       capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 7, r.stderr
    assert (w / "cmd.seen").read_text().strip() == f"pipe={w}/mps-pipe"
    started, stopped = calls.read_text().splitlines()
    assert started == "-d gpu= stdin=" and stopped.endswith(" stdin=quit")
    assert "command rc=7" in (w / "mps.txt").read_text()

    r = subprocess.run(["bash", WITH_MPS, str(tmp_path / "w2"), "touch",
                        str(tmp_path / "ran")],
                       env=dict(os.environ, MPS_CONTROL=str(tmp_path / "absent")),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 3 and not (tmp_path / "ran").exists()
    assert "no MPS" in (tmp_path / "w2" / "mps.txt").read_text()


def test_a_step_named_as_a_repeat_runs_its_steps_command_into_a_folder_of_its_own(tmp_path):
    """STEP.rN: the same load on both GPUs at once, or twice in one lane, each run into its
    own folder (two lanes' colo-h shared work/colo-h; the second run's summary replaced the
    first's); its command and its estimate are STEP's."""
    r = run(tmp_path, "dry", "abc123", SESSION_GPUS="2",
            SESSION_PLAN="T colo-h colo-e.r3;C colo-h.r2 colo-h.t-polled.r2")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line.split(": ", 1)[1] for line in r.stdout.splitlines()}
    assert "KVPD_GPUS='0 0'" in lines["T colo-h"]
    assert lines["C colo-h.r2"] == "COLO_PORT_BASE=23000 " + lines["T colo-h"].replace(
        "'0 0'", "'1 1'").replace("/work/colo-h ", "/work/colo-h.r2 ")
    assert "run_colocated_on_host.sh" in lines["T colo-e.r3"] and lines["T colo-e.r3"].endswith(
        "/work/colo-e.r3 e")
    assert lines["C colo-h.t-polled.r2"].startswith("cd .gpu/trees/polled && ")
    # started: each run writes its own folder, and both are packed with their lane
    r = run(tmp_path, "start", "abc123", SESSION_FAKE_STEPS="1", SESSION_GPUS="2",
            SESSION_SECONDS="40", SESSION_PLAN="T colo-h colo-h.r3;C colo-h.r2")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    run(tmp_path, "wait", "60", str(out))
    assert {"colo-h", "colo-h.r2", "colo-h.r3"} <= set(steps(tmp_path))
    work = tmp_path / "s" / "work"
    assert (work / "colo-h.r2" / "lane.txt").read_text().split()[-1] == "1"
    with tarfile.open(out / "T.tar.gz") as t:
        assert {"colo-h/summary.txt", "colo-h.r3/summary.txt"} <= set(t.getnames())
    # the estimate (and the kills' longer cap) are the step's
    r = run(tmp_path, "start", "abc123", SESSION_GPUS="1", SESSION_SECONDS="30",
            SESSION_PLAN="T colo-h.r2 colo-e.r2")
    run(tmp_path, "wait", "30", str(tmp_path / "out2"))
    assert "estimate 240s" in steps(tmp_path)["colo-h.r2"]
    assert "estimate 720s" in steps(tmp_path)["colo-e.r2"]


def _repo_with_results(tmp_path):
    repo = tmp_path / "repo"
    (repo / "experiments" / "gpu_host").mkdir(parents=True)
    (repo / "experiments" / "results" / "s1").mkdir(parents=True)
    script = repo / "experiments" / "gpu_host" / "lease_tree.sh"
    script.write_text(open(os.path.join(os.path.dirname(SESSION), "lease_tree.sh")).read())
    (repo / "experiments" / "results" / "s1" / "summary.txt").write_bytes(b"r" * 200_000)
    (repo / "kept.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "t"], check=True)
    return repo, script, git


def _travels(git) -> set[str]:
    out = subprocess.run(git + ["ls-files", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_lease_tree_takes_the_results_out_of_what_travels_and_puts_them_back(tmp_path):
    """2026-11-29b: experiments/results/ was 30 of the checkout's 32 MiB, sent with every
    device call; slim leaves it on disk but out of what travels (the index and the
    untracked, not ignored files), restore gives back the index as it was, an unstaged
    edit elsewhere untouched."""
    repo, script, git = _repo_with_results(tmp_path)
    results = "experiments/results/s1/summary.txt"
    assert results in _travels(git)
    (repo / "kept.py").write_text("x = 2\n")  # unstaged work survives both ways
    r = subprocess.run(["bash", str(script), "slim"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "slim:" in r.stdout, r.stdout + r.stderr
    assert results not in _travels(git) and "kept.py" in _travels(git)
    assert (repo / results).stat().st_size == 200_000
    status = subprocess.run(["bash", str(script), "status"], capture_output=True, text=True,
                            timeout=60).stdout
    assert status.startswith("slim:")
    r = subprocess.run(["bash", str(script), "restore"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "restored" in r.stdout, r.stdout + r.stderr
    assert results in _travels(git)
    porcelain = subprocess.run(git + ["status", "--porcelain"], capture_output=True,
                               text=True, check=True).stdout
    assert porcelain.splitlines() == [" M kept.py"]


def test_lease_tree_refuses_to_slim_over_staged_changes(tmp_path):
    """restore is a reset of experiments/results/ in the index: with other changes staged
    before slim it could not tell them apart, so slim refuses and changes nothing."""
    repo, script, git = _repo_with_results(tmp_path)
    (repo / "kept.py").write_text("x = 3\n")
    subprocess.run(git + ["add", "kept.py"], check=True)
    r = subprocess.run(["bash", str(script), "slim"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "staged" in r.stderr
    assert "experiments/results/s1/summary.txt" in _travels(git)
    porcelain = subprocess.run(git + ["status", "--porcelain"], capture_output=True,
                               text=True, check=True).stdout
    assert porcelain.splitlines() == ["M  kept.py"]
