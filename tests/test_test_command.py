"""scripts/test.sh's group runner: a group that hangs or dies is run again, and says so.

The runner's two functions are taken from the script's own text and run in bash with a
fake venv whose ``python -m pytest`` hangs, dies or passes, so what CI does with such a
group is what is tested, without installing vLLM.
"""

from __future__ import annotations

import os
import subprocess
import textwrap

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "scripts", "test.sh")


def runner_functions() -> str:
    src = open(SCRIPT, encoding="utf-8").read()
    start = src.index("start_group() {")
    end = src.index("\ninstall() {", start)
    return src[start:end]


def run_group(tmp_path, behaviours: list[str], timeout_s: int = 2) -> subprocess.CompletedProcess:
    """One group whose pytest behaves as ``behaviours`` says, call after call: ``hang``
    (sleeps past the group timeout), ``die`` (killed by SIGKILL), ``pass``."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    calls = tmp_path / "calls"
    plan = " ".join(behaviours)
    (venv / "bin" / "python").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        n=$(cat {calls} 2>/dev/null || echo 0); echo $((n + 1)) > {calls}
        plan=({plan}); what=${{plan[$n]:-pass}}
        echo "fake pytest call $((n + 1)): $what"
        case $what in
          hang) sleep 120 ;;
          die) kill -KILL $$ ;;
          pass) exit 0 ;;
        esac
        """))
    (venv / "bin" / "python").chmod(0o755)
    script = textwrap.dedent(f"""\
        set -uo pipefail
        GROUP_TIMEOUT_S={timeout_s}
        LOGS=$(mktemp -d)
        VENVS={tmp_path}
        status=0; summary=(); groups=()
        """) + runner_functions() + textwrap.dedent(f"""
        start_group "a group" {venv} tests/whatever.py
        finish_groups
        printf 'SUMMARY %s\\n' "${{summary[@]}}"
        echo "STATUS $status"
        """)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          timeout=90)


def test_a_group_that_hangs_is_stopped_and_run_again(tmp_path):
    r = run_group(tmp_path, ["hang", "pass"])
    assert "STATUS 0" in r.stdout, r.stdout + r.stderr
    assert "its run 1 hung: stopped after GROUP_TIMEOUT_S=2 s" in r.stdout
    assert "SUMMARY a group: pytest exit 0" in r.stdout
    assert "(run 2 times: 1 hung past 2 s)" in r.stdout
    assert (tmp_path / "calls").read_text().strip() == "2"


def test_a_group_that_keeps_hanging_fails_after_its_reruns(tmp_path):
    # 3 s, not 1: with 1 s this test failed once on 2 busy cores (a test command and
    # other tests beside it, 2026-11-27; which assertion was not kept), and passed alone
    r = run_group(tmp_path, ["hang"] * 4, timeout_s=3)
    assert "STATUS 1" in r.stdout, r.stdout + r.stderr
    assert "SUMMARY a group: pytest exit 124" in r.stdout
    assert (tmp_path / "calls").read_text().strip() == "4"


def test_a_group_that_dies_is_run_again_and_one_that_passes_once_runs_once(tmp_path):
    r = run_group(tmp_path, ["die", "pass"])
    assert "STATUS 0" in r.stdout, r.stdout + r.stderr
    assert "its run 1 died with exit 137 (signal 9)" in r.stdout
    assert (tmp_path / "calls").read_text().strip() == "2"
    (tmp_path / "calls").unlink()
    r = run_group(tmp_path, ["pass"])
    assert "STATUS 0" in r.stdout and "run 2 times" not in r.stdout
    assert (tmp_path / "calls").read_text().strip() == "1"
