"""Activation paths, each in a fresh interpreter: the gate, the sitecustomize of a
checkout (chaining to the one it shadows), ``python -S``, spawned children, and
vLLM's plugin entry point."""

from __future__ import annotations

import os
import textwrap

from tests.support import subproc

ON = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_CONTIGUOUS_LAYOUT="false")

REPORT = r"""
import json, sys
from kvcached_pd.activation import state
st = state()
print(json.dumps({
    "active": bool(st and st.active),
    "registered": list(st.registered) if st else [],
    "heavy": sorted(m for m in ("vllm", "torch", "wrapt") if m in sys.modules),
    "shadowed_ran": "_shadowed_sitecustomize" in sys.modules
                    and getattr(sys.modules["_shadowed_sitecustomize"], "RAN", False),
}))
"""


def checkout_env(tmp_path, **env) -> dict[str, str]:
    """PYTHONPATH=<repo>, the documented way to run from a checkout."""
    return subproc.clean_env(PYTHONPATH=subproc.REPO, **env)


def test_gate_closed_imports_nothing_heavy(tmp_path):
    state = subproc.run_json(REPORT, env=checkout_env(tmp_path), cwd=str(tmp_path))
    assert state == {"active": False, "registered": [], "heavy": [], "shadowed_ran": False}


def test_gate_open_arms_the_patch_table_without_importing_vllm(tmp_path):
    state = subproc.run_json(REPORT, env=checkout_env(tmp_path, **ON), cwd=str(tmp_path))
    assert state["active"]
    assert {"nixl_layout", "nixl_registration", "connector_guard"} <= set(state["registered"])
    assert "vllm" not in state["heavy"] and "torch" not in state["heavy"]


def test_kvcached_pd_zero_overrides_kvcached_gate(tmp_path):
    state = subproc.run_json(REPORT, env=checkout_env(tmp_path, KVCACHED_PD="0", **ON),
                             cwd=str(tmp_path))
    assert not state["active"]


def test_shadowed_sitecustomize_still_runs(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("RAN = True\n")
    env = subproc.clean_env(PYTHONPATH=os.pathsep.join([subproc.REPO, str(other)]), **ON)
    state = subproc.run_json(REPORT, env=env, cwd=str(tmp_path))
    assert state["shadowed_ran"] and state["active"]


def test_python_dash_S_skips_site_and_sitecustomize(tmp_path):
    """-S disables site (and so sitecustomize): nothing activates, nothing breaks."""
    code = "import sys; sys.path.insert(0, %r)\n" % subproc.REPO + REPORT
    state = subproc.run_json(code, env=checkout_env(tmp_path, **ON), args=("-S",),
                             cwd=str(tmp_path))
    assert not state["active"] and state["heavy"] == []


def test_spawned_children_activate_too(tmp_path):
    code = textwrap.dedent(r"""
    import json, multiprocessing as mp
    def child(q):
        from kvcached_pd.activation import state
        st = state()
        q.put(bool(st and st.active))
    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start(); active = q.get(timeout=120); p.join()
        print(json.dumps({"child_active": active}))
    """)
    script = tmp_path / "spawn_child.py"
    script.write_text(code)
    proc = subproc.run(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                       env=checkout_env(tmp_path, **ON), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert '"child_active": true' in proc.stdout


def test_vllm_loads_the_entry_point_in_every_process():
    """Installed (no PYTHONPATH): vLLM's own plugin loader activates kvcached-pd."""
    code = r"""
import json
from importlib.metadata import entry_points
names = [e.name for e in entry_points(group="vllm.general_plugins")]
from vllm.plugins import load_general_plugins
load_general_plugins()
from kvcached_pd.activation import state
print(json.dumps({"entry_point": "kvcached_pd" in names, "active": state().active}))
"""
    state = subproc.run_json(code, env=subproc.clean_env(**ON), cwd="/")
    assert state == {"entry_point": True, "active": True}


def test_activate_twice_is_one_activation():
    code = r"""
import json
import kvcached_pd
first = kvcached_pd.activate(); second = kvcached_pd.activate()
print(json.dumps({"same": first is second, "n": len(first.registered)}))
"""
    state = subproc.run_json(code, env=subproc.clean_env(**ON))
    assert state["same"] and state["n"] >= 3
