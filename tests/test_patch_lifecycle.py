"""patch / unpatch / patch twice / import orders, on vLLM's real classes, each in a
fresh interpreter; unpatch must restore the exact raw objects (classmethods too)."""

from __future__ import annotations

import pytest

from tests.support import subproc

LIFECYCLE = r"""
import json
from kvcached_pd.patches import PATCHES
from kvcached_pd import vllm_nixl
import importlib
importlib.import_module(vllm_nixl.NIXL_PACKAGE)
importlib.import_module(vllm_nixl.FACTORY_MODULE)

def raw_state():
    out = {}
    for cls in vllm_nixl.connector_classes() + vllm_nixl.worker_classes():
        for attr in ("get_required_kvcache_layout", "register_kv_caches", "get_finished"):
            if attr in vars(cls):
                out[f"{cls.__qualname__}.{attr}"] = id(vars(cls)[attr])
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    out["factory.create_connector"] = id(vars(KVConnectorFactory)["create_connector"])
    return out

names = ["connector_guard", "nixl_layout", "nixl_registration"]
patches = [p for p in PATCHES if p.name in names]
before = raw_state()
first = [p.patch() for p in patches]
during = raw_state()
twice = [p.patch() for p in patches]
during_again = raw_state()
types_ok = all(isinstance(vars(o)[a], classmethod)
               for o in vllm_nixl.nixl_owners(vllm_nixl.connector_classes(), "get_required_kvcache_layout")
               for a in ["get_required_kvcache_layout"])
undo = [p.unpatch() for p in reversed(patches)]
after = raw_state()
again = [p.patch() for p in patches]
print(json.dumps({
    "first": first, "twice": twice, "undo": undo, "again": again,
    "changed": sorted(k for k in before if before[k] != during.get(k)),
    "stable": during == during_again, "restored": before == after,
    "classmethod_kept": types_ok, "patched": [p.is_patched() for p in patches],
}))
"""


def test_patch_twice_unpatch_restores_exactly_and_patch_again():
    state = subproc.run_json(LIFECYCLE)
    assert state["first"] == [True, True, True]
    assert state["twice"] == [False, False, False]
    assert state["stable"] and state["restored"] and state["classmethod_kept"]
    assert state["undo"] == [True, True, True]
    assert state["again"] == [True, True, True] and all(state["patched"])
    assert any("register_kv_caches" in k for k in state["changed"])
    assert any("get_required_kvcache_layout" in k for k in state["changed"])
    assert "factory.create_connector" in state["changed"]


ORDER = r"""
import json
IMPORT_FIRST
import kvcached_pd
kvcached_pd.activate()
import vllm.distributed.kv_transfer.kv_connector.v1.nixl
from kvcached_pd.patches import get_patch
from kvcached_pd.activation import state
print(json.dumps({n: get_patch(n).is_patched() for n in ("nixl_layout", "nixl_registration", "connector_guard")}
                 | {"failed": state().failed}))
"""

ON = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_CONTIGUOUS_LAYOUT="false")


@pytest.mark.parametrize("first", ["", "import vllm.distributed.kv_transfer.kv_connector.v1.nixl"])
def test_import_then_patch_and_patch_then_import(first):
    state = subproc.run_json(ORDER.replace("IMPORT_FIRST", first), env=subproc.clean_env(**ON))
    assert state == {"nixl_layout": True, "nixl_registration": True, "connector_guard": True,
                     "failed": {}}


def test_unpatch_leaves_a_later_patcher_alone():
    code = r"""
import json
from kvcached_pd.patches import get_patch
from kvcached_pd import vllm_nixl
p = get_patch("nixl_registration"); p.patch()
owner = vllm_nixl.nixl_owners(vllm_nixl.worker_classes(), "register_kv_caches", base_most=True)[0]
def someone_elses(self, kv_caches): pass
owner.register_kv_caches = someone_elses
p.unpatch()
print(json.dumps({"kept": vars(owner)["register_kv_caches"] is someone_elses}))
"""
    assert subproc.run_json(code)["kept"]
