"""Every patch's lifecycle, on vLLM's (and kvcached's) real code, in processes of their own.

Modelled on dd-trace-py's ``PatchTestCase``: a patch's test class declares its name and
inherits every check: patch then patch again (idempotent, nothing wrapped twice),
unpatch (the exact raw objects back: a classmethod stays that very classmethod), patch
again after unpatch, target imported before the patch, and the patch armed before the
target is imported. To keep CI cheap the orderings run in two processes shared by all
patches (one imports every target first and cycles each patch in turn, forked from the
test suite's server; one arms every patch through ``activate()`` before any import, a new
interpreter), not one process per check.
"""

from __future__ import annotations

import functools
import os

import pytest

from kvcached_pd.patches import PATCH_NAMES
from kvcached_pd.testing import TEST_PATCHES
from tests.support import kvcached_cpu, subproc

# The environment that makes every patch apply: kvcached on, the staged transport (the
# default with kvcached), the test-only corruption patch armed.
ENV = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_CONTIGUOUS_LAYOUT="false",
           KVCACHED_PD_TEST_CORRUPT="1")

PRELUDE = r"""
import importlib, json
from tests.support import kvcached_cpu
kvcached_cpu.install_stand_ins()
from kvcached_pd.patches import PATCHES
from kvcached_pd import config, testing
ALL = PATCHES + testing.armed(config.settings())

def target_importable(patch):
    try:
        importlib.import_module(patch.target_module)
        return None
    except ImportError as exc:
        return f"{patch.target_module} not importable with this vLLM: {exc}"
"""

IMPORT_THEN_PATCH = PRELUDE + r"""
MISSING = object()
out = {}
for patch in ALL:
    ok, why = patch.applies()
    why = None if ok else why
    why = why or target_importable(patch)
    if why:
        out[patch.name] = {"skip": why}
        continue
    first = patch.patch()
    reps = [(r.owner, r.attr, r.original, r.installed) for r in patch._replacements]
    twice = patch.patch()
    installed = all(vars(o).get(a, MISSING) is new for o, a, _, new in reps)
    patched = patch.is_patched()
    undo = patch.unpatch()
    restored = all(vars(o).get(a, MISSING) is orig for o, a, orig, _ in reps)
    undo_twice = patch.unpatch()
    after_undo = patch.is_patched()
    again = patch.patch()
    again_patched = patch.is_patched()
    patch.unpatch()
    out[patch.name] = {"first": first, "twice": twice, "replaced": len(reps),
                       "installed_once": installed, "patched": patched, "undo": undo,
                       "restored": restored, "undo_twice": undo_twice,
                       "after_undo": after_undo, "again": again, "again_patched": again_patched}
print(json.dumps(out))
"""

PATCH_THEN_IMPORT = PRELUDE + r"""
import kvcached_pd
st = kvcached_pd.activate()
skips = {}
for patch in ALL:
    why = None if patch.name in st.registered else st.skipped.get(patch.name, "not registered")
    skips[patch.name] = why or target_importable(patch)  # the import fires the hooks
out = {p.name: ({"skip": skips[p.name]} if skips[p.name] else
                {"patched": p.is_patched(), "failed": st.failed.get(p.name)}) for p in ALL}
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    return subproc.clean_env(PYTHONPATH=kvcached_cpu.kvcached_src(),
                             KVCACHED_SRC=kvcached_cpu.kvcached_src(), **ENV)


@functools.lru_cache(maxsize=None)
def _run_once(code: str, forked: bool) -> dict | AssertionError:
    try:
        run = subproc.run_forked_json if forked else subproc.run_json
        return run(code, env=_env())
    except AssertionError as exc:  # a crashed child fails every test of it, once
        return exc


def import_then_patch() -> dict:
    # every target is imported before any patch, so a process forked from the test
    # suite's server (torch and vLLM's core imported once, kvcached-pd never) serves as
    # well as a new interpreter, without its 12 s of CPU
    result = _run_once(IMPORT_THEN_PATCH, forked=True)
    if isinstance(result, AssertionError):
        raise result
    return result


def patch_then_import() -> dict:
    # a new interpreter: the fork server has imported two patches' target (vLLM's
    # connector factory), which this ordering must import after activate()
    result = _run_once(PATCH_THEN_IMPORT, forked=False)
    if isinstance(result, AssertionError):
        raise result
    return result


class PatchLifecycle:
    """Inherit with ``patch_name`` set; every ordering comes with it."""

    patch_name: str = ""

    def result(self, run) -> dict:
        if not kvcached_cpu.available():
            pytest.skip("kvcached source not fetched")
        state = run()[self.patch_name]
        if "skip" in state:
            pytest.skip(state["skip"])
        return state

    def test_patch_twice_changes_things_once(self):
        s = self.result(import_then_patch)
        assert (s["first"], s["twice"]) == (True, False)
        assert s["replaced"] >= 1 and s["installed_once"] and s["patched"]

    def test_unpatch_restores_the_exact_raw_objects(self):
        s = self.result(import_then_patch)
        assert (s["undo"], s["restored"], s["undo_twice"], s["after_undo"]) == (True, True, False, False)

    def test_patch_again_after_unpatch(self):
        s = self.result(import_then_patch)
        assert s["again"] and s["again_patched"]

    def test_armed_before_its_target_is_imported(self):
        s = self.result(patch_then_import)
        assert s == {"patched": True, "failed": None}


class TestKvcachedCoexistence(PatchLifecycle):
    patch_name = "kvcached_coexistence"


class TestConnectorGuard(PatchLifecycle):
    patch_name = "connector_guard"


class TestKvcachedAlloc(PatchLifecycle):
    patch_name = "kvcached_alloc"


class TestKvcachedAllocMrv2(PatchLifecycle):
    patch_name = "kvcached_alloc_mrv2"


class TestNixlLayout(PatchLifecycle):
    patch_name = "nixl_layout"


class TestNixlRegistration(PatchLifecycle):
    patch_name = "nixl_registration"


class TestNixlHandshakeJoin(PatchLifecycle):
    patch_name = "nixl_handshake_join"


class TestPushPrefixAlignment(PatchLifecycle):
    patch_name = "push_prefix_alignment"


class TestConnectorRouting(PatchLifecycle):
    patch_name = "connector_routing"


class TestConnectorMetrics(PatchLifecycle):
    patch_name = "connector_metrics"


class TestPromptTailGraph(PatchLifecycle):
    patch_name = "prompt_tail_graph"


class TestCorruptReceivedKV(PatchLifecycle):
    patch_name = "corrupt_received_kv"


def test_every_patch_has_a_lifecycle_class():
    covered = {cls.patch_name for cls in PatchLifecycle.__subclasses__()}
    assert covered == set(PATCH_NAMES) | {p.name for p in TEST_PATCHES}


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
    assert subproc.run_forked_json(code)["kept"]


def test_test_only_patch_is_not_in_the_product_table():
    assert "corrupt_received_kv" not in PATCH_NAMES
    from kvcached_pd import config, testing

    assert testing.armed(config.read_settings({})) == ()
    armed = testing.armed(config.read_settings({"KVCACHED_PD_TEST_CORRUPT": "1"}))
    assert [p.name for p in armed] == ["corrupt_received_kv"]
