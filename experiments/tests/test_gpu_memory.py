"""The load harness's memory readings, from files shaped as the host writes them."""

from __future__ import annotations

import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_memory import (  # noqa: E402
    instance_memory,
    kvcached_mapped,
    parse_compute_apps,
    process_tree,
)
from pd_load import render_memory, staging_mib  # noqa: E402


def test_kvcached_segment_is_total_used_prealloc_bytes(tmp_path):
    (tmp_path / "kvpd_x").write_bytes(struct.pack("<qqq", 80 << 30, 3 << 30, 320 << 20))
    assert kvcached_mapped("kvpd_x", str(tmp_path)) == {
        "total": 80 << 30, "used": 3 << 30, "prealloc": 320 << 20}
    assert kvcached_mapped("absent", str(tmp_path)) is None
    (tmp_path / "short").write_bytes(b"\0" * 8)
    assert kvcached_mapped("short", str(tmp_path)) is None


def test_process_tree_follows_parents_and_reads_odd_names(tmp_path):
    def proc(pid, ppid, comm="python3"):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    proc(10, 1)
    proc(11, 10, "VLLM::EngineCore")
    proc(12, 11, "a) b (c")  # a comm with parentheses and spaces
    proc(20, 1)
    assert process_tree(10, str(tmp_path)) == {10, 11, 12}
    assert process_tree(20, str(tmp_path)) == {20}


def test_device_memory_sums_the_instance_tree_only():
    apps = parse_compute_apps("4242, 1500\n4243, 70000\nbad line\n99, 12\n")
    assert apps == {4242: 1500.0, 4243: 70000.0, 99: 12.0}
    me = os.getpid()
    reading = instance_memory(me, None, {me: 100.0, 1: 5.0})
    assert reading == {"device_mib": 100.0, "kvcached": None}
    assert instance_memory(me, None, {1: 5.0})["device_mib"] is None


def test_summary_table_and_staging_line(tmp_path):
    log = tmp_path / "p.log"
    log.write_text("INFO kvcached-pd: staged transport ready (pull mode, inner NixlConnector): "
                   "4096 MiB staging (VRAM; prefill 4096 MiB, decode 0 MiB, rule) ...\n")
    assert staging_mib(str(log)) == 4096
    assert staging_mib(str(tmp_path / "none.log")) is None
    kv = {"total": 1, "used": 3 << 20, "prealloc": 160 << 20}
    point = {"device_mib": 9000.0, "kvcached": kv, "staging_mib": 4096}
    doc = {"modes": {"kvpd-staged": {"memory": {
        "before": {"prefill": point}, "peak_load": {"prefill": dict(point, device_mib=9500.0)},
        "after_load": {"prefill": point},
        "idle": {"prefill": dict(point, device_mib=None)}}}, "vanilla": {"memory": None}}}
    lines = render_memory(doc)
    assert "9000 / 9500 / 9000 / -" in lines[2]
    assert "3+160 / 3+160 / 3+160 / 3+160" in lines[2]
    assert lines[2].rstrip().endswith("4096")
    assert render_memory({"modes": {"vanilla": {}}}) == []


def test_staging_counts_a_lazy_decode_range_only_once_allocated(tmp_path):
    ready = ("INFO kvcached-pd: staged transport ready (pull mode, inner NixlPullConnector): "
             "4096 MiB staging (VRAM; prefill 0 MiB, decode 4096 MiB allocated at the first "
             "READ over NIXL, never on the CUDA IPC wire, default: ...) registered ...\n")
    log = tmp_path / "d.log"
    log.write_text(ready)
    assert staging_mib(str(log)) == 0  # the IPC wire: D never allocates its range
    log.write_text(ready + "INFO kvcached-pd: decode staging allocated and registered: 4096 MiB "
                   "on cuda:0 (the first request READ over NIXL)\n")
    assert staging_mib(str(log)) == 4096
    both = ("INFO kvcached-pd: staged transport ready (pull mode, inner NixlConnector): "
            "6144 MiB staging (VRAM; prefill 2048 MiB, decode 4096 MiB allocated at the first "
            "READ over NIXL, never on the CUDA IPC wire, rule) ...\n")
    log.write_text(both)
    assert staging_mib(str(log)) == 2048
    point = {"device_mib": 2582.0, "kvcached": None}
    doc = {"modes": {"kvpd-staged": {"memory": {
        "before": {"decode": dict(point, staging_mib=0)},
        "peak_load": {"decode": dict(point, staging_mib=4096)},
        "after_load": {"decode": dict(point, staging_mib=4096)},
        "idle": {"decode": dict(point, staging_mib=4096)}}}}}
    assert render_memory(doc)[2].rstrip().endswith(" 4096")
    doc["modes"]["kvpd-staged"]["memory"] = {
        p: {"decode": dict(point, staging_mib=0)} for p in ("before", "peak_load", "idle")}
    assert render_memory(doc)[2].rstrip().endswith(" 0")


def test_summary_prints_the_killed_instances_gpu_beside_ds():
    # across two GPUs a killed P's memory is on P's GPU; D's column alone hid it (2026-11-26)
    gpu = {"before": 7691.0, "peak_load": 8559.0, "after_load": 7775.0, "idle": 7775.0,
           "killed_before": 7676.0, "killed_after_load": 5628.0, "killed_idle": 3838.0}
    lines = render_memory({"modes": {"kvpd-staged": {"gpu_used_mib": gpu}}})
    assert any("7691 / 8559 / 7775 / 7775" in line for line in lines)
    killed = [line for line in lines if "killed instance's GPU" in line]
    assert len(killed) == 1 and "7676 / - / 5628 / 3838" in killed[0]
    no_kill = render_memory({"modes": {"vanilla": {"gpu_used_mib": {"before": 1.0}}}})
    assert not any("killed" in line for line in no_kill)
