"""The UCX fault injector (experiments/ucx_fault) against real NIXL on host memory.

The shim is built from source here, then preloaded into a process that runs two real NIXL
agents (UCX backend, DRAM) doing one READ per chunk (ucx_fault/nixl_reads.py). The reads
it is told to fail must fail (NIXL raises or reports ERR) and every other read must
complete with the source's bytes; without the preload every read completes. What the
harness relies on is checked too: the load line, one numbered line per fault, the
environment names the harness sets, and a prebuilt copy that matches the source.

run: python -m pytest experiments/tests/test_ucx_fault_injector.py -q
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
UCX_FAULT = os.path.join(os.path.dirname(HERE), "ucx_fault")
READS = os.path.join(UCX_FAULT, "nixl_reads.py")
FAULT_LINE = re.compile(r"ucx_fault_injector\[\d+\]: \[FAULT\] INJECTED #(\d+): (\w+) call #(\d+)")


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("ucx_fault")
    res = subprocess.run(["bash", os.path.join(UCX_FAULT, "build.sh"), "--no-prebuilt", str(out)],
                         capture_output=True, text=True, timeout=120)
    if res.returncode == 3:
        pytest.skip(f"no C compiler to build the injector from source: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    path = res.stdout.strip().splitlines()[-1]
    assert os.path.isfile(path)
    return path


@pytest.fixture(scope="module")
def nixl_available() -> None:
    res = subprocess.run([sys.executable, "-c", "import nixl._api, torch"],
                         capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        pytest.skip(f"this Python has no NIXL/torch: {res.stderr.strip()[-200:]}")


def _reads(preload: str | None, reads: int, descs: int = 1, threads: int = 0,
           **env_extra: str):
    env = {k: v for k, v in os.environ.items()
           if k != "LD_PRELOAD" and not k.startswith(("UCX_FAULT_", "KVPD_UCX_FAULT_",
                                                      "NIXL_UCX_DEEPBIND"))}
    if preload:
        env["LD_PRELOAD"] = preload
    env.update(env_extra)
    res = subprocess.run([sys.executable, READS, "--reads", str(reads), "--descs", str(descs),
                          "--num-threads", str(threads)],
                         capture_output=True, text=True, env=env, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])["reads"]
    return result, res.stderr


def _failed(result) -> list[int]:
    return [r["read"] for r in result if r["state"] != "DONE"]


def _assert_others_complete(result, failed: list[int]) -> None:
    for r in result:
        if r["read"] not in failed:
            assert r["state"] == "DONE" and r["bytes_match"], r


def test_without_the_preload_every_read_completes(nixl_available):
    result, stderr = _reads(None, 10)
    assert _failed(result) == []
    _assert_others_complete(result, [])
    assert "ucx_fault_injector" not in stderr


def test_every_third_get_fails_the_third_sixth_and_ninth_read(shim, nixl_available):
    result, stderr = _reads(shim, 10, KVPD_UCX_FAULT_EVERY="3", UCX_FAULT_HOOKS="get")
    assert _failed(result) == [3, 6, 9], result
    for r in result:
        if r["read"] in (3, 6, 9):  # NIXL refuses the transfer: raises, or reports ERR
            assert r["state"] == "ERR" or r["state"].startswith("RAISED"), r
            assert not r["bytes_match"]  # the failed get never ran: dst is still zero
    _assert_others_complete(result, [3, 6, 9])
    assert "UCX fault injector loaded: 1 of every 3 calls fail" in stderr
    faults = FAULT_LINE.findall(stderr)  # one numbered line per fault
    assert faults == [("1", "ucp_get_nbx", "3"), ("2", "ucp_get_nbx", "6"),
                      ("3", "ucp_get_nbx", "9")]


def test_the_harness_environment_fails_every_nth_transfer_of_many_descriptors(shim,
                                                                               nixl_available):
    """pd_load.py's settings: the pattern names of vLLM's injector, hooks=flush. NIXL posts
    one get per descriptor and one flush per transfer, so counting flushes fails every
    third transfer however many descriptors it has (gets would fail nearly each one);
    with 4 UCX threads, as vLLM's NIXL connector configures the agent."""
    result, stderr = _reads(shim, 7, descs=4, threads=4, UCX_FAULT_ENABLED="1",
                            UCX_FAULT_STRATEGY="pattern", UCX_FAULT_PATTERN="OOX",
                            UCX_FAULT_HOOKS="flush", UCX_FAULT_ERROR_CODES="-6")
    assert _failed(result) == [3, 6], result
    _assert_others_complete(result, [3, 6])
    assert [(k, fn, i) for k, fn, i in FAULT_LINE.findall(stderr)] == \
        [("1", "ucp_ep_flush_nbx", "3"), ("2", "ucp_ep_flush_nbx", "6")]
    assert "-> status -6" in stderr


def test_not_armed_it_passes_everything_through_and_says_so(shim, nixl_available):
    result, stderr = _reads(shim, 4)
    assert _failed(result) == []
    _assert_others_complete(result, [])
    assert "UCX fault injector inactive" in stderr
    assert "UCX fault injector loaded" not in stderr  # the harness's evidence: armed only


def test_the_prebuilt_copy_is_of_this_source():
    """The GPU host may have no compiler: build.sh then uses prebuilt/, which must be this
    source's build (refresh it with `bash experiments/ucx_fault/build.sh prebuilt`)."""
    with open(os.path.join(UCX_FAULT, "ucx_fault_injector.c"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(UCX_FAULT, "prebuilt", "SOURCE.sha256"), encoding="utf-8") as f:
        recorded = f.read().split()[0]
    assert recorded == digest
    assert os.path.isfile(os.path.join(UCX_FAULT, "prebuilt", "libkvpd_ucx_fault.so"))
