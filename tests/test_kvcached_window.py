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
from tests.support import subproc

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


def _kvcached_on_path() -> dict[str, str]:
    from tests.support.kvcached_cpu import available, kvcached_src

    if not available():
        pytest.skip("kvcached source not fetched")
    return {"PYTHONPATH": kvcached_src()}


def test_the_doctor_says_kvcached_will_refuse_this_vllm_exactly_above_its_window():
    env = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1",
               KVCACHED_CONTIGUOUS_LAYOUT="false", **_kvcached_on_path())
    report = subproc.run_forked(
        "from kvcached_pd.cli import main; raise SystemExit(main(['doctor']))",
        env=subproc.clean_env(**env))
    version = installed_version("vllm")
    above = parse_release(version) >= (0, 31, 0)
    assert ("WILL FAIL: kvcached" in report.stdout) == above, report.stdout[-3000:]
    if above:
        assert f"no runner adapter for vLLM {version}" in report.stdout
    # kvcached's window, read from kvcached itself: its check runs, it is not assumed
    window = subproc.run_forked(
        "from kvcached_pd import checks; print(checks.kvcached_runner_window())",
        env=subproc.clean_env(**env))
    assert "'>=0.29.0,<0.31.0')" in window.stdout, window.stdout + window.stderr
