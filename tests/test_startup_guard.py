"""Bad input stops startup before a NIXL connector exists, with one clear message, and
``kvcached-pd doctor`` predicts it: for the same environment it exits 1 exactly when
startup refuses.

Each case is a process where kvcached-pd never ran, activated through vLLM's own plugin
loader (forked from a server that imported vLLM once: ``tests.support.subproc``); the
connector is requested through vLLM's real ``KVConnectorFactory.create_connector``,
the call every scheduler and worker makes before anything is served.
"""

from __future__ import annotations

import pytest

from tests.support import subproc

CREATE = r"""
import json, tempfile
from vllm.plugins import load_general_plugins
load_general_plugins()
from tests.support import vllm_nixl_worker as vw
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
kv_cache_config = vw.kv_cache_config(["model.layers.0.self_attn.attn"], 8, 16, 2, 64)
# a connector name this vLLM lacks is refused when the config is built
try:
    config = vw.make_vllm_config(vw.write_tiny_llama(tempfile.mkdtemp()))
    KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    print(json.dumps({"error": None}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""

GOOD = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_CONTIGUOUS_LAYOUT="false")


def create(connector: str = "NixlConnector", **env) -> str | None:
    code = CREATE.replace("write_tiny_llama(tempfile.mkdtemp()))",
                          f"write_tiny_llama(tempfile.mkdtemp()), connector={connector!r})")
    return subproc.run_forked_json(code, env=subproc.clean_env(**env))["error"]


def doctor(**env):
    return subproc.run_forked("from kvcached_pd.cli import main; raise SystemExit(main(['doctor']))",
                              env=subproc.clean_env(**env))


def kvcached_on_path() -> dict[str, str]:
    from tests.support.kvcached_cpu import on_path

    return on_path()


DIRECT = dict(GOOD, KVCACHED_PD_TRANSPORT="direct")
CONTIGUOUS_DIRECT = "KVCACHED_CONTIGUOUS_LAYOUT=false or use the staged transport"
# KVCACHED_PD_DISABLE=connector_routing: vLLM's NIXL names build vLLM's own connectors
ROUTING_OFF = dict(GOOD, KVCACHED_PD_DISABLE="connector_routing")
ROUTING_WAYS_OUT = ("Remove connector_routing from KVCACHED_PD_DISABLE (kvcached-pd's "
                    "connector then serves), or use the direct transport "
                    "(KVCACHED_PD_TRANSPORT=direct) with KVCACHED_CONTIGUOUS_LAYOUT=false.")


@pytest.mark.parametrize("env,message", [
    (dict(DIRECT, KVCACHED_CONTIGUOUS_LAYOUT="true"), CONTIGUOUS_DIRECT),
    ({k: v for k, v in DIRECT.items() if k != "KVCACHED_CONTIGUOUS_LAYOUT"}, CONTIGUOUS_DIRECT),
    (dict(GOOD, VLLM_KV_CACHE_LAYOUT="HND"), "VLLM_KV_CACHE_LAYOUT=HND"),
    (dict(GOOD, KVCACHED_PD_DISABLE="nixl_layot"), "unknown patch(es) ['nixl_layot']"),
    (dict(GOOD, KVCACHED_PD_TRANSPORT="carrier-pigeon"), "is not one of"),
    (dict(GOOD, KVCACHED_PD_DISABLE="nixl_registration"), "nothing handles the layout"),
    (dict(GOOD, KVCACHED_PD="maybe"), "KVCACHED_PD='maybe' is not a recognised value"),
    (dict(GOOD, VLLM_KV_CACHE_LAYOUT="HND", KVCACHED_PD_DISABLE="connector_guard"),
     "names connector_guard, which cannot waive these"),
    (dict(ROUTING_OFF, KVCACHED_PD_TRANSPORT="staged"),
     "KVCACHED_PD_TRANSPORT=staged was asked for but cannot serve: connector_routing is "
     "disabled by KVCACHED_PD_DISABLE, so vLLM's NIXL connector names build vLLM's own "
     "connectors, which move KV by per-block descriptors. " + ROUTING_WAYS_OUT),
    ({k: v for k, v in ROUTING_OFF.items() if k != "KVCACHED_CONTIGUOUS_LAYOUT"},
     "and the direct path would move it: connector_routing is disabled by "
     "KVCACHED_PD_DISABLE"),
])
def test_bad_configuration_stops_nixl_startup(env, message):
    error = create(**env, **kvcached_on_path())
    assert error is not None and error.startswith("UnsupportedConfiguration")
    assert message.lower() in error.lower()
    assert "kvcached-pd doctor" in error
    report = doctor(**env, **kvcached_on_path())
    assert report.returncode == 1 and f"BLOCKING: " in report.stdout
    assert message in report.stdout


def push_name() -> str | None:
    """vLLM's push connector name on this release, from the version table (0.24+);
    None before push mode existed."""
    from kvcached_pd import vllm_api

    return vllm_api.current().push_name


def test_explicit_staged_transport_serves_pull_on_every_release():
    """Pull mode (vLLM's NixlConnector name) is kvcached-pd's connector's on every
    release it knows, so asking for the staged transport by name serves."""
    env = dict(GOOD, KVCACHED_PD_TRANSPORT="staged", **kvcached_on_path())
    error, report = create(**env), doctor(**env)
    assert error is None and report.returncode == 0
    assert "transport that will serve: staged" in report.stdout


def test_explicit_staged_transport_for_push_serves_everywhere_vllm_has_push():
    """Push mode is kvcached-pd's connector's (inner NixlPushConnector) on every release
    with a push connector (0.24-0.33). Before 0.24 vLLM has no push connector and
    refuses the name itself."""
    env = dict(GOOD, KVCACHED_PD_TRANSPORT="staged", **kvcached_on_path())
    if push_name() is None:
        error = create("NixlPushConnector", **env)
        assert error is not None and "NixlPushConnector" in error
        return
    assert create(push_name(), **env) is None


def test_push_without_the_routing_stops_startup_on_every_release_with_push():
    """With connector_routing disabled, vLLM's own push connector would serve: asked for
    by name, the staged transport stops startup there too, naming both ways out."""
    if push_name() is None:
        pytest.skip("vLLM has push mode (NixlPushConnector) from 0.24 on")
    error = create(push_name(), **ROUTING_OFF, KVCACHED_PD_TRANSPORT="staged",
                   **kvcached_on_path())
    assert error is not None and error.startswith("UnsupportedConfiguration")
    assert "connector_routing is disabled" in error and ROUTING_WAYS_OUT in error


def test_hybrid_model_is_refused_when_the_connector_is_created():
    """Known from vLLM's KV-cache config, so refused before the KV cache exists."""
    code = CREATE.replace(
        "kv_cache_config = vw.kv_cache_config(",
        "import torch\n"
        "from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec\n"
        "kv_cache_config = vw.kv_cache_config(",
    ).replace(
        "try:\n",
        "kv_cache_config.kv_cache_groups.append(KVCacheGroupSpec(['model.layers.1.mixer'],"
        " MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float16,))))\ntry:\n",
        1,
    )
    env = subproc.clean_env(**GOOD, **kvcached_on_path())
    error = subproc.run_forked_json(code, env=env)["error"]
    assert error is not None and error.startswith("UnsupportedConfiguration")
    assert "cannot describe hybrid/mamba KV caches" in error


def test_staging_larger_than_the_device_stops_the_worker_connector():
    """In a worker the staging size is checked against the device's free memory when
    the connector is created, before the KV cache is allocated. The CPU has no device:
    torch.cuda reports one with 512 MiB free."""
    code = CREATE.replace("KVConnectorRole.SCHEDULER", "KVConnectorRole.WORKER").replace(
        "load_general_plugins()",
        "load_general_plugins()\n"
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.mem_get_info = lambda *a: (512 << 20, 80 << 30)",
    )
    env = subproc.clean_env(**GOOD, KVCACHED_PD_STAGING_MB="99999999", **kvcached_on_path())
    error = subproc.run_forked_json(code, env=env)["error"]
    assert error is not None and error.startswith("UnsupportedConfiguration")
    assert "KVCACHED_PD_STAGING_MB=99999999 MiB of staging does not fit: 512 MiB free" in error


@pytest.mark.parametrize("layout", ["true", None])
@pytest.mark.parametrize("transport", ["staged", None])  # None: the default with kvcached
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_contiguous_layout_is_allowed_only_where_the_staged_transport_serves(
        layout, transport, mode):
    """kvcached's default layout (unset = contiguous) with the staged transport: pull
    and push are kvcached-pd's connector's on every release that has them (push: 0.24+;
    before, vLLM refuses the push name itself)."""
    env = {k: v for k, v in GOOD.items() if k != "KVCACHED_CONTIGUOUS_LAYOUT"}
    if layout is not None:
        env["KVCACHED_CONTIGUOUS_LAYOUT"] = layout
    if transport is not None:
        env["KVCACHED_PD_TRANSPORT"] = transport
    if mode == "pull":
        assert create(**env, **kvcached_on_path()) is None
        return
    if push_name() is None:
        error = create("NixlPushConnector", **env, **kvcached_on_path())
        assert error is not None and "NixlPushConnector" in error  # vLLM's own refusal
        return
    assert create(push_name(), **env, **kvcached_on_path()) is None


def test_kvcached_not_importable_stops_nixl_startup():
    error = create(**GOOD)  # kvcached's source is not on the path here
    assert error is not None and "kvcached is not importable" in error


def test_good_configuration_builds_the_connector():
    assert create(**GOOD, **kvcached_on_path()) is None
    report = doctor(**GOOD, **kvcached_on_path())
    assert report.returncode == 0 and "problems: none" in report.stdout
    assert "kvcached-pd: ON" in report.stdout


def test_unsupported_vllm_version_stops_nixl_startup():
    code = CREATE.replace(
        "load_general_plugins()",
        "import importlib.metadata as md\n"
        "_real = md.version\n"
        "md.version = lambda d: '0.19.1' if d == 'vllm' else _real(d)\n"
        "load_general_plugins()",
    )
    env = subproc.clean_env(**GOOD, **kvcached_on_path())
    error = subproc.run_forked_json(code, env=env)["error"]
    assert error is not None and "vLLM 0.19.1 is outside the range" in error


def test_without_kvcached_nothing_is_checked():
    """Gate closed: nothing is patched, so a bad kvcached-pd value changes nothing and
    the doctor says so without an alarm."""
    env = dict(ENABLE_KVCACHED="false", KVCACHED_CONTIGUOUS_LAYOUT="true",
               KVCACHED_PD_TRANSPORT="carrier-pigeon")
    assert create(**env) is None
    report = doctor(**env)
    assert report.returncode == 0, report.stdout
    assert "kvcached-pd: OFF" in report.stdout and "nothing is patched" in report.stdout
    assert "ignored while kvcached-pd is off" in report.stdout and "BLOCKING" not in report.stdout
