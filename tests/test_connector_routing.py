"""Routing: with the staged transport chosen, vLLM's own connector names build
kvcached-pd's connector, so an operator's ``"kv_connector":"NixlConnector"`` does not
change; the data path that serves each name is what startup and the doctor report."""

from __future__ import annotations

import pytest

from kvcached_pd import checks, config, serving, vllm_api
from kvcached_pd.connector.wire import PARAMS_KEY
from kvcached_pd.versions import installed_version
from tests.conftest import vllm_release
from tests.support import connector_pd as pd


def _transfer_config(name: str):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=name, kv_role="kv_both")


@pytest.fixture
def routing(monkeypatch):
    from kvcached_pd.patches import get_patch

    monkeypatch.setenv("KVCACHED_PD", "1")
    monkeypatch.setenv("KVCACHED_PD_TRANSPORT", "staged")
    config.reset_settings_for_tests()
    patch = get_patch("connector_routing")
    yield patch
    patch.unpatch()
    config.reset_settings_for_tests()


def test_nixl_names_build_kvcached_pd_connector_and_unpatch_restores(routing):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcached_pd.connector import KvcachedPDConnector

    inner = vllm_api.inner_connector_class()
    api = vllm_api.current()
    names = api.nixl_names
    assert routing.applies()[0]
    assert routing.patch()
    if vllm_release() >= (0, 24):  # push mode is routed too, spelled out here
        assert "NixlPushConnector" in names
    for name in names:
        assert KVConnectorFactory.get_connector_class(_transfer_config(name)) is KvcachedPDConnector
        # the routed name decides which of vLLM's connectors it composes
        assert vllm_api.inner_connector_name(_transfer_config(name)) == name
    assert routing.unpatch()
    for name in names:
        assert KVConnectorFactory.get_connector_class(_transfer_config(name)).__name__ != \
            KvcachedPDConnector.__name__
    assert KVConnectorFactory.get_connector_class(_transfer_config("NixlConnector")) is inner


def test_routing_stays_off_with_the_direct_transport_or_when_disabled(monkeypatch):
    from kvcached_pd.patches import get_patch

    monkeypatch.setenv("KVCACHED_PD", "1")
    patch = get_patch("connector_routing")
    for env, word in ((dict(KVCACHED_PD_TRANSPORT="direct"), "staged"),
                      (dict(KVCACHED_PD_TRANSPORT="staged",
                            KVCACHED_PD_DISABLE="connector_routing"), "disabled")):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        config.reset_settings_for_tests()
        ok, why = patch.applies()
        assert not ok and word in why
    config.reset_settings_for_tests()


def test_routed_nixl_connector_stages_the_handoff(routing):
    """The operator's plain ``kv_connector="NixlConnector"`` on both instances: the
    handoff takes the staged path end to end and moves every token exactly."""
    from tests.test_connector_pd import handoff, saw_done, settle, torch_equal

    routing.patch()
    with pd.cpu_vllm():
        import os

        os.environ["VLLM_KV_CACHE_LAYOUT"] = "NHD"
        try:
            p = pd.make_engine("p", "kv_producer", seed=1, staged=False)
            d = pd.make_engine("d", "kv_consumer", seed=2, staged=False)
            assert type(p.worker).__name__ == "KvcachedPDConnector"
            prompt = list(range(1, 60))
            params, p_blocks, d_blocks = handoff(p, d, "r1", prompt)
            assert PARAMS_KEY in params, "the routed connector did not stage"
            n = len(prompt)
            for layer, (a, b) in enumerate(zip(p.tokens(p_blocks, n), d.tokens(d_blocks, n))):
                assert torch_equal(a, b), f"layer {layer} differs"
            assert settle(p, d)
            assert saw_done(p, d, "r1"), "D's DONE never reached P's own NIXL agent"
        finally:
            os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)


def _settings(**env):
    base = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_PD="1")
    return config.read_settings({**base, **env})


ROUTING_OFF = dict(KVCACHED_PD_TRANSPORT="staged", KVCACHED_PD_DISABLE="connector_routing")


def test_the_decision_names_the_path_per_connector():
    """With the routing, vLLM's NIXL names are staged; without it they are vLLM's own
    connectors (the direct path), on every release; kvcached-pd's connector named
    directly stages either way."""
    version = installed_version("vllm")
    api = vllm_api.current()
    s = _settings(KVCACHED_PD_TRANSPORT="staged")
    assert serving.decide(s, version, "NixlConnector").transport == "staged"
    assert serving.decide(s, version, None).transport == "staged"
    assert serving.decide(s, "0.19.0", "NixlConnector").transport == "direct"
    if api.push_name:  # the connector serves push wherever vLLM has it
        decision = serving.decide(s, version, api.push_name)
        assert decision.transport == "staged", decision.reason
    off = _settings(**ROUTING_OFF)
    assert off.disabled_patches == frozenset({"connector_routing"})
    for name in api.nixl_names + (None,):
        decision = serving.decide(off, version, name)
        assert decision.transport == "direct" and "connector_routing is disabled" in decision.reason
    assert serving.decide(off, version, vllm_api.CONNECTOR_CLASS).transport == "staged"


def test_explicit_staged_without_the_routing_is_refused_with_both_ways_out():
    """``KVCACHED_PD_DISABLE=connector_routing`` leaves vLLM's NIXL names to vLLM's own
    connectors: the staged transport asked for by name cannot serve there (pull and
    push, every release), and kvcached's contiguous layout, which those connectors
    would address wrongly, is refused even by default. Both say how to get out."""
    version = installed_version("vllm")
    api = vllm_api.current()
    ways_out = ("Remove connector_routing from KVCACHED_PD_DISABLE (kvcached-pd's connector "
                "then serves), or use the direct transport (KVCACHED_PD_TRANSPORT=direct) "
                "with KVCACHED_CONTIGUOUS_LAYOUT=false.")
    staged = _settings(KVCACHED_PD_TRANSPORT="staged")
    assert checks.transport_problems(serving.decide(staged, version, "NixlConnector")) == []
    off = _settings(**ROUTING_OFF)
    assert off.transport_explicit
    for name in api.nixl_names:
        problems = checks.transport_problems(serving.decide(off, version, name))
        assert problems == [
            "KVCACHED_PD_TRANSPORT=staged was asked for but cannot serve: connector_routing "
            "is disabled by KVCACHED_PD_DISABLE, so vLLM's NIXL connector names build vLLM's "
            "own connectors, which move KV by per-block descriptors. " + ways_out]
    assert checks.transport_problems(serving.decide(off, version, vllm_api.CONNECTOR_CLASS)) == []
    default = _settings()
    assert checks.contiguous_layout_problem(serving.decide(default, version, "NixlConnector")) \
        is None
    routing_off = _settings(KVCACHED_PD_DISABLE="connector_routing")
    for name in api.nixl_names:
        problem = checks.contiguous_layout_problem(serving.decide(routing_off, version, name))
        assert problem is not None and problem.endswith(ways_out)


def test_class_level_answers_are_the_inner_connectors_own(routing):
    """vLLM asks the connector class, before any instance exists, whether it follows
    sleep mode (0.33's ``supports_sleep_mode(kv_transfer_config)``): vLLM's pull
    connector does, its push connector does not (P keeps D's registration across D's
    sleep). kvcached-pd's connector answers as the connector it composes for that
    config, routed or named directly, not always as the pull one."""
    from vllm.config import KVTransferConfig

    from kvcached_pd.connector import KvcachedPDConnector

    inner = vllm_api.inner_connector_class()
    if "supports_sleep_mode" not in dir(inner):
        pytest.skip(f"vLLM {installed_version('vllm')} asks connectors nothing about sleep")
    answers = {}
    for name in vllm_api.current().nixl_names:
        for cfg in (_transfer_config(name), KVTransferConfig(
                kv_connector=vllm_api.CONNECTOR_CLASS, kv_role="kv_both",
                kv_connector_module_path=vllm_api.CONNECTOR_MODULE,
                kv_connector_extra_config={vllm_api.INNER_KEY: name})):
            expected = vllm_api.inner_connector_class(name).supports_sleep_mode(cfg)
            assert KvcachedPDConnector.supports_sleep_mode(cfg) is expected, (name, cfg)
            answers[name] = expected
    assert answers["NixlConnector"] is True and answers.get("NixlPushConnector") is False
