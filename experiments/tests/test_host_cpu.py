"""host_cpu reads the host's busy share and a process tree's CPU time from /proc, and the
load harness turns a mode's repeats into one line of its summary."""

from __future__ import annotations

import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import host_cpu  # noqa: E402
from pd_load import cpu_summary, render_cpu  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _stat(proc, user, nice, system, idle, iowait, irq=0, softirq=0, steal=0, guest=7):
    (proc / "stat").write_text(f"cpu  {user} {nice} {system} {idle} {iowait} {irq} {softirq} "
                               f"{steal} {guest} 0\ncpu0 1 2 3 4 5 6 7 8 9 0\n")


def _proc(proc, pid, ppid, utime, stime, comm="python3"):
    (proc / str(pid)).mkdir(exist_ok=True)
    # fields after the command: state ppid pgrp session tty tpgid flags minflt cminflt
    # majflt cmajflt utime stime ...
    (proc / str(pid) / "stat").write_text(
        f"{pid} ({comm}) S {ppid} 1 1 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n")


def test_the_hosts_busy_share_leaves_out_idle_and_io_wait_and_counts_guest_once(tmp_path):
    _stat(tmp_path, 100, 10, 50, 800, 40, 5, 5, 0)
    assert host_cpu.host_jiffies(str(tmp_path)) == (170, 1010)
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert host_cpu.host_jiffies(str(tmp_path)) is None
    assert host_cpu.host_jiffies(str(tmp_path / "nowhere")) is None


def test_a_trees_cpu_is_its_processes_user_and_system_time(tmp_path):
    _proc(tmp_path, 10, 1, 3 * TICK, 1 * TICK, comm="vllm (api) server")  # the root
    _proc(tmp_path, 11, 10, 2 * TICK, 0)  # its engine core
    _proc(tmp_path, 12, 11, 0, 1 * TICK)  # a worker under it
    _proc(tmp_path, 20, 1, 50 * TICK, 50 * TICK)  # not in the tree
    assert host_cpu.tree_cpu_s(10, str(tmp_path)) == pytest.approx(7.0)
    assert host_cpu.tree_cpu_s(11, str(tmp_path)) == pytest.approx(3.0)
    assert host_cpu.tree_cpu_s(None, str(tmp_path)) is None
    assert host_cpu.tree_cpu_s(99, str(tmp_path)) is None  # gone


def test_a_window_reports_what_happened_between_start_and_stop(tmp_path):
    _stat(tmp_path, 100, 0, 100, 800, 0)
    _proc(tmp_path, 10, 1, 1 * TICK, 0)
    _proc(tmp_path, 30, 1, 0, 0)
    window = host_cpu.CpuWindow({"prefill": 10, "proxy": 30, "gone": None},
                                str(tmp_path)).start()
    _stat(tmp_path, 160, 0, 140, 900, 0)  # 100 of 200 ticks busy
    _proc(tmp_path, 10, 1, 3 * TICK, 1 * TICK)
    got = window.stop()
    assert got["busy_pct"] == 50.0 and got["cpus"] == os.cpu_count()
    assert got["cpu_s"] == {"prefill": 3.0, "proxy": 0.0, "gone": None}


def test_a_tree_that_lost_processes_in_the_window_reports_no_cpu(tmp_path):
    """An instance killed mid-load: its engine process is gone at the stop, and the
    root's own seconds alone are less than the tree's at the start; no CPU is reported
    for it, not a negative one (2026-11-29e's kill runs printed -2280.8 ms a request)."""
    _stat(tmp_path, 100, 0, 100, 800, 0)
    _proc(tmp_path, 10, 1, 1 * TICK, 0)  # the server
    _proc(tmp_path, 11, 10, 5 * TICK, 0)  # its engine core
    window = host_cpu.CpuWindow({"decode": 10}, str(tmp_path)).start()
    _stat(tmp_path, 160, 0, 140, 900, 0)
    _proc(tmp_path, 10, 1, 2 * TICK, 0)
    for name in os.listdir(tmp_path / "11"):
        os.remove(tmp_path / "11" / name)
    os.rmdir(tmp_path / "11")
    assert window.stop()["cpu_s"] == {"decode": None}


def test_a_window_on_this_process_sees_its_own_work():
    """The real /proc: a busy loop of this process shows in its tree and in the host."""
    window = host_cpu.CpuWindow({"me": os.getpid()}).start()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    got = window.stop()
    assert got["cpu_s"]["me"] >= 0.2
    assert 0 < got["busy_pct"] <= 100


def test_a_modes_repeats_become_one_line_per_request():
    reps = [{"n_completed": 10, "cpu": {"busy_pct": 40.0, "cpus": 32,
                                         "cpu_s": {"prefill": 1.0, "decode": 0.5}}},
            {"n_completed": 30, "cpu": {"busy_pct": 60.0, "cpus": 32,
                                         "cpu_s": {"prefill": 3.0, "decode": 1.5}}}]
    got = cpu_summary(reps)
    assert got == {"busy_pct": 50.0, "busy_range": [40.0, 60.0], "cpus": 32,
                   "ms_per_request": {"decode": 50.0, "prefill": 100.0}}
    # a tree unread in any repeat is unknown, not a smaller number
    reps[1]["cpu"]["cpu_s"]["decode"] = None
    assert cpu_summary(reps)["ms_per_request"]["decode"] is None
    assert cpu_summary([{"n_completed": 3}]) is None
    lines = render_cpu({"modes": {"kvpd-push": {"cpu": got}, "vanilla": {"cpu": None}}})
    assert lines[0].startswith("Host CPU during the load") and "32 CPUs" in lines[0]
    assert lines[1].split() == ["kvpd-push", "50", "(40-60)", "decode", "50.0,", "prefill",
                                "100.0"]
    assert render_cpu({"modes": {"vanilla": {}}}) == []
