"""kvcached's own vLLM window: kvcached 0.1.6 refuses every vLLM from 0.31 on when vLLM's
engine starts ("kvcached has no runner adapter for vLLM 0.33.0", 2 x H200, 2026-11-26),
whatever kvcached-pd supports. kvcached-pd reads that window from kvcached itself and
says so first: a WARNING when it activates, and a WILL FAIL line in the doctor.

Runs in every release's group: the verdict depends on the installed vLLM, and the
doctor runs against the real kvcached source (tests.support.kvcached_cpu).
"""

from __future__ import annotations

import pytest

from kvcached_pd import checks
from kvcached_pd.versions import installed_version, parse_release
from tests.support import kvcached_cpu, subproc

WINDOW = ("0.1.6", ">=0.29.0,<0.31.0")  # kvcached 0.1.6's VLLM_MRV2_RANGE


@pytest.mark.parametrize("vllm,refused", [
    ("0.20.2", False), ("0.26.0", False), ("0.28.0", False), ("0.29.0", False),
    ("0.30.0", False), ("0.30.1rc1", False), ("0.31.0", True), ("0.33.0", True),
    ("1.0.0", True),
])
def test_a_vllm_above_kvcacheds_window_is_named_with_the_way_out(vllm, refused):
    problem = checks.kvcached_runner_problem(vllm, WINDOW)
    if not refused:
        assert problem is None
        return
    assert problem is not None
    assert f"kvcached 0.1.6 has no runner adapter for vLLM {vllm}" in problem
    assert "below 0.31.0" in problem and "unset ENABLE_KVCACHED" in problem


def test_no_window_declared_or_no_vllm_names_nothing():
    assert checks.kvcached_runner_problem("0.33.0", None) is None
    assert checks.kvcached_runner_problem(None, WINDOW) is None
    assert checks.kvcached_runner_problem("0.33.0", ("0.2.0", ">=0.29.0")) is None  # no bound


def _on(**env) -> dict[str, str]:
    return subproc.clean_env(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1",
                             KVCACHED_CONTIGUOUS_LAYOUT="false", **kvcached_cpu.on_path(), **env)


def _above_window() -> bool:
    return parse_release(installed_version("vllm")) >= (0, 31, 0)


def test_the_doctor_says_kvcached_will_refuse_this_vllm_exactly_above_its_window():
    report = subproc.run_forked(
        "from kvcached_pd.cli import main; raise SystemExit(main(['doctor']))", env=_on())
    version = installed_version("vllm")
    assert ("WILL FAIL: kvcached" in report.stdout) == _above_window(), report.stdout[-3000:]
    if _above_window():
        assert f"no runner adapter for vLLM {version}" in report.stdout
    # kvcached's window, read from kvcached itself: its check runs, it is not assumed
    window = subproc.run_forked(
        "from kvcached_pd import checks; print(checks.kvcached_runner_window())", env=_on())
    assert "'>=0.29.0,<0.31.0')" in window.stdout, window.stdout + window.stderr


def test_activation_warns_before_kvcached_refuses_exactly_above_its_window():
    """What an operator's `vllm serve` shows first (vLLM's plugin loader, as its API
    server runs it): the WARNING, whatever vLLM's logging has configured yet."""
    proc = subproc.run_forked(
        "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
        "import vllm.logger\n", env=_on())
    assert proc.returncode == 0, proc.stderr
    said = [line for line in (proc.stdout + proc.stderr).splitlines()
            if "kvcached-pd:" in line and "no runner adapter" in line]
    assert bool(said) == _above_window(), proc.stdout[-2000:] + proc.stderr[-2000:]
    if said:
        assert f"vLLM {installed_version('vllm')}" in said[0]
