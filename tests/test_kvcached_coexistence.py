"""Exactly one layer owns the NIXL integration, whichever of kvcached's and
kvcached-pd's hooks runs first, and nothing is wrapped twice.

Uses kvcached 0.1.6's real ``NixlConnectorPatch`` (its pure-Python module) on vLLM's
real classes, in a process of its own per import order: forked from the test suite's
server (``subproc.run_forked``), which imported torch and vLLM's core once but neither
vLLM's NIXL connector nor kvcached(-pd), so each order below is the order those modules
are imported in (the child checks that the NIXL module is new to it). A fresh
interpreter per case cost 12 s of CPU each, 115-129 s of each release's test group on
CI's 2 cores.
"""

from __future__ import annotations

import pytest

from tests.support import kvcached_cpu, subproc

pytestmark = pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched")

PRELUDE = r"""
import inspect, json, sys
assert not any(m.startswith("vllm.distributed.kv_transfer.kv_connector.v1.nixl")
               for m in sys.modules), "vLLM's NIXL connector was imported before the case"
from tests.support import kvcached_cpu
kvcached_cpu.install_stand_ins()
"""

KVCACHED_PATCHES = r"""
from kvcached.integration.vllm.nixl_compat import NixlConnectorPatch
kvcached_result = NixlConnectorPatch().patch_connector()
"""

OURS = r"""
from vllm.plugins import load_general_plugins
load_general_plugins()
"""

INSPECT = r"""
import vllm.distributed.kv_transfer.kv_connector.v1.nixl as nixl
from kvcached_pd.patches.base import is_ours
from kvcached_pd import vllm_nixl
workers = vllm_nixl.worker_classes()
connectors = vllm_nixl.connector_classes()
reg_owners = [k for c in workers for k in c.__mro__ if "register_kv_caches" in vars(k)]
layout_owners = [k for c in connectors for k in c.__mro__ if "get_required_kvcache_layout" in vars(k)
                 and k.__module__.startswith(vllm_nixl.NIXL_PACKAGE)]
base_reg = vllm_nixl.nixl_owners(workers, "register_kv_caches", base_most=True)[0]
ours_reg = vars(base_reg)["register_kv_caches"]
chain = []  # kvcached-pd's wrappers (registration, staged transport), outermost first
fn = ours_reg
while hasattr(fn, "__wrapped__"):
    chain.append(fn)
    fn = fn.__wrapped__
layout_fns = {vars(k)["get_required_kvcache_layout"] for k in layout_owners}
leftovers = [f"{k.__name__}.{a}" for c in workers + connectors for k in c.__mro__
             for a in ("_kvcached_original_register_kv_caches", "_original_get_layout",
                       "_kvcached_register_patched") if a in vars(k)]
print(json.dumps({
    "register_is_ours": bool(chain) and all(is_ours(f) for f in chain),
    "register_wraps_vllm": inspect.getsourcefile(fn).endswith(("base_worker.py", "nixl/worker.py")),
    "register_wraps_once": len(chain) == len({getattr(f, "__kvcached_pd_patch__") for f in chain}),
    "layout_hooks": len(layout_fns),
    "layout_all_ours": all(is_ours(f) for f in layout_fns),
    "layout_wraps_vllm": all(f.__func__.__wrapped__.__module__.startswith("vllm.") for f in layout_fns),
    "leftovers": leftovers,
}))
"""

ENV = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_CONTIGUOUS_LAYOUT="false")


def check(state: dict) -> None:
    assert state["register_is_ours"] and state["register_wraps_vllm"] and state["register_wraps_once"]
    assert state["layout_hooks"] >= 1 and state["layout_all_ours"] and state["layout_wraps_vllm"]
    assert state["leftovers"] == []


def test_kvcached_patch_first_is_reverted():
    """The entry-point order: `import vllm` runs kvcached's patch before plugins load."""
    code = PRELUDE + "import vllm.distributed.kv_transfer.kv_connector.v1.nixl\n" + KVCACHED_PATCHES + OURS + INSPECT
    check(subproc.run_forked_json(code, env=subproc.clean_env(**ENV)))


def test_kvcached_patch_after_ours_is_a_no_op():
    """The sitecustomize order: kvcached-pd is armed before kvcached's hook fires."""
    code = PRELUDE + OURS + "import vllm.distributed.kv_transfer.kv_connector.v1.nixl\n" + KVCACHED_PATCHES + INSPECT
    check(subproc.run_forked_json(code, env=subproc.clean_env(**ENV)))


def test_kvcached_pd_off_leaves_kvcached_in_charge():
    """KVCACHED_PD=0: kvcached 0.1.6's own patch is the only one (its own mode)."""
    code = PRELUDE + OURS + "import vllm.distributed.kv_transfer.kv_connector.v1.nixl\n" + KVCACHED_PATCHES + r"""
from kvcached_pd import vllm_nixl
workers = vllm_nixl.worker_classes()
print(json.dumps({"kvcached_owns": any("_kvcached_register_patched" in vars(k)
                                        for c in workers for k in c.__mro__)}))
"""
    state = subproc.run_forked_json(code, env=subproc.clean_env(KVCACHED_PD="0", **ENV))
    assert state["kvcached_owns"]
