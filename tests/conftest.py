"""Shared fixtures: the installed vLLM's version, a clean environment per test."""

from __future__ import annotations

import os

import pytest

from kvcached_pd import config
from kvcached_pd.versions import installed_version, parse_release

from tests.support import nixl_quiet
from tests.support.thread_stacks import thread_stacks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
nixl_quiet.arm()  # NIXL's progress threads poll every 1 ms, not in a busy loop
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")

try:  # the fuzz tests' health check on input generation speed measures the machine:
    # on a fresh 2-core CI machine (2026-11-27) one draw of a small dictionary of text
    # took 31 s (three test groups and a vLLM install beside it, and Hypothesis building
    # its character tables on first use) and failed a run whose every check passed.
    # What the fuzz tests check is unchanged; they only no longer fail on being slow.
    from hypothesis import HealthCheck
    from hypothesis import settings as hypothesis_settings

    hypothesis_settings.register_profile(
        "kvcached-pd", suppress_health_check=[HealthCheck.too_slow])
    hypothesis_settings.load_profile("kvcached-pd")
except ImportError:  # a venv without Hypothesis runs no fuzz test
    pass

# Every variable kvcached-pd reads (the declared list), so a developer's shell never
# leaks into a test.
GATE_VARS = config.VARIABLE_NAMES


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the report and the JUnit file: a process that built NIXL agents ends here
    (``nixl_quiet.exit_without_teardown`` says why)."""
    if _EXIT_STATUS:
        nixl_quiet.exit_without_teardown(_EXIT_STATUS[-1])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report shows every live thread's stack at the failure
    (``thread_stacks`` says why)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        report.sections.append(("live threads at the failure", thread_stacks()))


@pytest.fixture(autouse=True)
def fresh_settings():
    """Settings are parsed once per process; each test parses its own environment."""
    config.reset_settings_for_tests()
    yield
    config.reset_settings_for_tests()


def vllm_release() -> tuple[int, ...]:
    version = installed_version("vllm")
    return parse_release(version) if version else (0, 0, 0)


@pytest.fixture
def kvcached_env(monkeypatch, tmp_path):
    """The environment of a kvcached + NIXL instance as an operator would set it."""
    for name in GATE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "1")
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "false")
    monkeypatch.setenv("KVCACHED_PD_STATE_DIR", str(tmp_path / "state"))
    config.reset_settings_for_tests()
    return monkeypatch
