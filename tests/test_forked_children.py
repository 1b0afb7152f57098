"""The fork server of ``tests.support.subproc`` gives each case a process as new as a
fresh interpreter for what kvcached-pd reads: its environment, working directory and
``PYTHONPATH``, no kvcached-pd module and vLLM's plugins not loaded yet, and the exit
status and output of the case's code."""

from __future__ import annotations

import os

from tests.support import subproc

STATE = r"""
import json, os, sys
import vllm.plugins
print("noise before the answer")
print(json.dumps({
    "env": os.environ.get("KVPD_FORK_PROBE"), "cwd": os.getcwd(), "path1": sys.path[1],
    "kvcached_pd_loaded": [m for m in sys.modules if m.startswith(("kvcached_pd", "kvcached."))],
    "plugins_loaded": vllm.plugins.plugins_loaded,
}))
"""


def test_a_forked_case_sees_its_own_environment_and_nothing_activated(tmp_path):
    env = subproc.clean_env(KVPD_FORK_PROBE="one", PYTHONPATH=str(tmp_path))
    state = subproc.run_forked_json(STATE, env=env, cwd=str(tmp_path))
    assert state == {"env": "one", "cwd": str(tmp_path), "path1": str(tmp_path),
                     "kvcached_pd_loaded": [], "plugins_loaded": False}


def test_what_one_case_changes_does_not_reach_the_next():
    first = subproc.run_forked(
        "import os; from vllm.plugins import load_general_plugins; load_general_plugins();"
        " os.environ['KVPD_FORK_PROBE'] = 'leaked'",
        env=subproc.clean_env(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1"))
    assert first.returncode == 0, first.stderr
    state = subproc.run_forked_json(STATE, env=subproc.clean_env())
    assert state["env"] is None and state["kvcached_pd_loaded"] == []
    assert state["plugins_loaded"] is False


def test_exit_status_and_output_come_back():
    proc = subproc.run_forked("import sys; print('out'); print('err', file=sys.stderr); "
                              "raise SystemExit(3)")
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
    proc = subproc.run_forked("raise ValueError('boom')")
    assert proc.returncode == 1 and "ValueError: boom" in proc.stderr
