"""pyspy_summary.py reads py-spy's raw stacks of engine processes (with_pyspy.sh) and
names them by the instance logs; with_pyspy.sh starts one recorder per engine process.

run: python -m pytest experiments/tests/test_pyspy_summary.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import pyspy_summary  # noqa: E402

WITH_PYSPY = os.path.join(os.path.dirname(HERE), "gpu_host", "with_pyspy.sh")
LOOP = "run_busy_loop (vllm/v1/engine/core.py:1410)"
STEP = "step_with_batch_queue (vllm/v1/engine/core.py:660)"
SCHED = "schedule (vllm/v1/core/sched/scheduler.py:300)"


def raw(*rows: tuple[str, list[str], int]) -> str:
    return "".join(f"thread (0x{i}): {t};{';'.join(fr)} {n}\n" for i, (t, fr, n) in
                   enumerate(rows))


def test_only_the_serving_loop_counts_and_a_function_once_per_stack():
    stacks = pyspy_summary.parse_raw(raw(
        ("MainThread", ["<module> (x.py:1)", LOOP, STEP, SCHED], 30),
        # recursion: ``f`` twice on one stack is one sample of f
        ("MainThread", ["<module> (x.py:1)", LOOP, "f (a.py:1)", "f (a.py:9)"], 10),
        ("MainThread", ["<module> (x.py:1)", "capture (cuda_graph.py:5)"], 500),  # start-up
        ("Thread-1", ["run (threading.py:1)", "wait (threading.py:2)"], 900),  # not serving
        # the loop waiting for a request (or stopped by the harness while it waited)
        ("MainThread", ["<module> (x.py:1)", LOOP, "_process_input_queue (core.py:1440)",
                        "get (queue.py:180)", "wait (threading.py:359)"], 700),
        # ... but taking one off the queue is work
        ("MainThread", ["<module> (x.py:1)", LOOP, "_process_input_queue (core.py:1456)",
                        "add_request (core.py:400)"], 5),
    ).splitlines())
    total, inclusive = pyspy_summary.serving_profile(stacks)
    assert total == 45
    assert inclusive["run_busy_loop (core.py)"] == 45
    assert inclusive["_process_input_queue (core.py)"] == 5
    assert inclusive["schedule (scheduler.py)"] == 30
    assert inclusive["f (a.py)"] == 10
    assert "capture (cuda_graph.py)" not in inclusive


def test_processes_are_named_by_the_log_that_names_their_pid(tmp_path):
    spy, logs = tmp_path / "pyspy", tmp_path / "run" / "load" / "logs"
    spy.mkdir()
    logs.mkdir(parents=True)
    (logs / "kvcached-single-single.log").write_text(
        "1.0 (APIServer pid=100) INFO hello\n1.1 (EngineCore pid=101) INFO [core.py:1] up\n")
    (logs / "kvpd-push-p-sync-decode.log").write_text("1.2 (EngineCore pid=202) INFO up\n")
    (spy / "101.txt").write_text(raw(("MainThread", [LOOP, SCHED], 400)))
    (spy / "202.txt").write_text(raw(("MainThread", [LOOP, SCHED], 600),
                                     ("MainThread", [LOOP, "start_load_kv (c.py:3)"], 200)))
    (spy / "303.txt").write_text(raw(("MainThread", [LOOP], 2)))  # no log names it
    summary = pyspy_summary.summarize(str(spy), [str(tmp_path / "run")], rate=200)
    assert set(summary) == {"kvcached-single-single", "kvpd-push-p-sync-decode", "pid 303"}
    d = summary["kvpd-push-p-sync-decode"]
    assert d["serving_s"] == 4.0 and d["functions"]["start_load_kv (c.py)"] == 1.0
    text = pyspy_summary.render(summary, top=5, against="kvcached-single-single")
    assert "kvpd-push-p-sync-decode against kvcached-single-single" in text
    section = text.split("== kvpd-push-p-sync-decode against")[1].split("==")[0]
    diffs = {line.split(None, 3)[3]: line.split()[0] for line in section.splitlines()[1:]}
    # D: 3 s in schedule against 2, 1 s in start_load_kv against none
    assert diffs["schedule (scheduler.py)"] == "+1.00"
    assert diffs["start_load_kv (c.py)"] == "+1.00"
    assert diffs["run_busy_loop (core.py)"] == "+2.00"


def test_with_pyspy_records_each_matching_process_once_and_keeps_the_rc(tmp_path):
    """A fake py-spy writes its arguments where the real one writes stacks; the command
    starts two matching processes (and one that does not match) and fails with 7."""
    fake = tmp_path / "py-spy"
    fake.write_text(textwrap.dedent("""\
        #!/usr/bin/env bash
        [ "$1" = --version ] && { echo "py-spy 0.0.fake"; exit 0; }
        out=""; pid=""; flags=""
        while [ $# -gt 0 ]; do
          case $1 in --output) out=$2; shift ;; --pid) pid=$2; shift ;;
            --rate|--format) shift ;; *) flags="$flags $1" ;; esac; shift
        done
        echo "$flags" >> "$out.starts"
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
        echo "thread (0x1): MainThread;run_busy_loop (core.py:1) 5" > "$out"
        """))
    fake.chmod(0o755)
    # the marker is assembled inside each shell, so that no command line but the
    # renamed processes' holds it (the watcher matches whole command lines)
    marker = f"kvpdspy{os.getpid()}"
    cmd = (f"bash -c 'x=kvpd; exec -a ${{x}}spy{os.getpid()}-a sleep 1.5' & "
           f"bash -c 'x=kvpd; exec -a ${{x}}spy{os.getpid()}-b sleep 1.5' & "
           f"bash -c 'exec -a other sleep 1.5' & wait; exit 7")
    env = dict(os.environ, PYSPY=str(fake), PYSPY_PATTERN=marker, PYSPY_FLAGS="--gil")
    done = subprocess.run(["bash", WITH_PYSPY, str(tmp_path / "w"), "bash", "-c", cmd],
                          env=env, timeout=60)
    assert done.returncode == 7
    spy = tmp_path / "w" / "pyspy"
    records = sorted(p.name for p in spy.glob("*.txt") if p.name != "README.txt")
    assert len(records) == 2, records
    assert [(spy / f"{r}.starts").read_text() for r in records] == [" record --gil\n"] * 2
    cmds = [p.read_text() for p in spy.glob("*.cmd")]
    assert sorted(c.split()[0] for c in cmds) == [f"{marker}-a", f"{marker}-b"]
    readme = (spy / "README.txt").read_text()
    assert "py-spy 0.0.fake" in readme and "flags --gil" in readme
    assert "2 engine process(es) recorded" in readme


def test_with_pyspy_without_py_spy_runs_nothing(tmp_path):
    flag = tmp_path / "ran"
    done = subprocess.run(["bash", WITH_PYSPY, str(tmp_path / "w"), "touch", str(flag)],
                          env=dict(os.environ, PYSPY=str(tmp_path / "missing")),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 3 and "no py-spy" in done.stderr
    assert not flag.exists()
