"""Routing: with the staged transport chosen, vLLM's own connector names build
kvcached-pd's connector, so an operator's ``"kv_connector":"NixlConnector"`` does not
change; the data path that serves each name is what startup and the doctor report."""

from __future__ import annotations

import pytest

from kvcached_pd import checks, config, vllm_api
from kvcached_pd.connector.wire import PARAMS_KEY
from kvcached_pd.versions import installed_version
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
    names = api.pull_names + ((api.push_name,) if api.push_name else ())
    assert routing.applies()[0]
    assert routing.patch()
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
    from tests.test_connector_pd import handoff, settle, torch_equal

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
            assert ("r1", 0) in p.done_seen, "D's DONE never reached P's own NIXL agent"
        finally:
            os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)


def _settings(**env):
    base = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_PD="1")
    return config.read_settings(frozenset({"connector_routing", "staged_transport"}),
                                {**base, **env})


def test_serving_transport_names_the_path_per_connector():
    version = installed_version("vllm")
    api = vllm_api.current()
    s = _settings(KVCACHED_PD_TRANSPORT="staged")
    assert checks.serving_transport(s, version, "NixlConnector")[0] == "staged"
    assert checks.serving_transport(s, version, None)[0] == "staged"
    assert checks.serving_transport(s, "0.19.0", "NixlConnector")[0] == "direct"
    if api.push_name:
        transport, why = checks.serving_transport(s, version, api.push_name)
        in_hooks = (0, 24) <= tuple(int(x) for x in version.split(".")[:2]) < (0, 29)
        assert transport == ("staged" if in_hooks else "direct"), why
    off = _settings(KVCACHED_PD_TRANSPORT="staged", KVCACHED_PD_DISABLE="connector_routing")
    assert off.disabled_patches == frozenset({"connector_routing"})
    hooks_pull = (0, 24) <= tuple(int(x) for x in version.split(".")[:2]) < (0, 29)
    assert checks.serving_transport(off, version, "NixlConnector")[0] == (
        "staged" if hooks_pull else "direct")


def test_explicit_staged_push_where_only_pull_is_staged_is_refused():
    """On a release whose push classes the hooks do not know (0.29+), an operator who
    asked for the staged transport by name and runs NixlPushConnector is refused;
    with kvcached's contiguous layout even the default refuses, since the direct path
    would address the wrong bytes."""
    version = installed_version("vllm")
    api = vllm_api.current()
    explicit = _settings(KVCACHED_PD_TRANSPORT="staged")
    assert explicit.transport_explicit
    assert checks.transport_problems(explicit, version, "NixlConnector") == []
    if not api.push_name or (0, 24) <= tuple(int(x) for x in version.split(".")[:2]) < (0, 29):
        pytest.skip(f"vLLM {version}: push is staged here, or there is no push mode")
    problems = checks.transport_problems(explicit, version, api.push_name)
    assert problems and "push mode is staged on vLLM" in problems[0]
    env = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_PD="1")
    assert checks.contiguous_layout_problem(env, api.push_name)
    assert checks.contiguous_layout_problem(env, "NixlConnector") is None
