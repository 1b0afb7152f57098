"""One decision of what serves (``kvcached_pd.serving.decide``), read by every part that
acts on it or reports it; and ``config``, the lowest layer, imports nothing above it."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvcached_pd import config, serving, vllm_api
from kvcached_pd.versions import installed_version
from tests.support import subproc

STAGED_BY_NAME = dict(KVCACHED_PD="1", KVCACHED_PD_TRANSPORT="staged")


def test_config_imports_nothing_of_kvcached_pd():
    """Parsing the settings (the unknown patch name included) loads ``config`` alone:
    every module of the package may import it without closing a circle."""
    code = (
        "import json, sys\n"
        "from kvcached_pd import config\n"
        "s = config.settings()\n"
        "ours = sorted(m for m in sys.modules if m.startswith('kvcached_pd'))\n"
        "print(json.dumps({'modules': ours, 'disabled': sorted(s.disabled_patches)}))\n"
    )
    out = subproc.run_json(code, env=subproc.clean_env(**STAGED_BY_NAME,
                                                       KVCACHED_PD_DISABLE="bogus"))
    assert out == {"modules": ["kvcached_pd", "kvcached_pd.config"], "disabled": ["bogus"]}


def test_unknown_patch_names_are_found_where_the_table_is_known(monkeypatch, tmp_path, capsys):
    """config knows no patch table, so ``KVCACHED_PD_DISABLE``'s names are checked where
    it is known: the doctor reports an unknown one even while kvcached-pd is off (the
    guard's refusal with it on: tests/test_startup_guard.py)."""
    from kvcached_pd import cli

    monkeypatch.setenv("KVCACHED_PD", "0")
    monkeypatch.setenv("KVCACHED_PD_DISABLE", "nixl_layot")
    monkeypatch.setenv("KVCACHED_PD_STATE_DIR", str(tmp_path))
    config.reset_settings_for_tests()
    assert config.settings().problems == ()
    assert cli.main(["doctor"]) == 0
    ignored = capsys.readouterr().out.split("ignored while kvcached-pd is off")[1]
    assert "KVCACHED_PD_DISABLE names unknown patch(es) ['nixl_layot']" in ignored


def test_the_decision_is_made_once_per_process():
    settings = config.read_settings(STAGED_BY_NAME)
    version = installed_version("vllm")
    first = serving.decide(settings, version, "NixlConnector")
    assert serving.decide(config.read_settings(STAGED_BY_NAME), version, "NixlConnector") is first
    assert first.staged and first.requested_by_name and first.routed


@pytest.mark.parametrize("wire,words", [
    ("auto", "per peer at its handshake: CUDA IPC"),
    ("nixl", "KVCACHED_PD_WIRE=nixl: every staged extent by a NIXL READ"),
    ("ipc", "KVCACHED_PD_WIRE=ipc: CUDA IPC only"),
])
def test_the_wire_policy_is_part_of_the_decision(wire, words):
    version = installed_version("vllm")
    staged = serving.decide(config.read_settings(dict(STAGED_BY_NAME, KVCACHED_PD_WIRE=wire)),
                            version)
    assert (staged.wire, staged.staged) == (wire, True) and words in staged.wire_reason
    direct = serving.decide(config.read_settings(
        dict(STAGED_BY_NAME, KVCACHED_PD_WIRE=wire, KVCACHED_PD_TRANSPORT="direct")), version)
    assert direct.wire_reason.startswith("unused")


REASON = "the decision this test made"


@pytest.fixture
def one_decision(monkeypatch, tmp_path):
    """The settings ask for the staged transport by name, which the real decision
    grants; ``decide`` is replaced by one that says the direct path serves, so whoever
    follows it says the test's reason and whoever decides for itself says "staged"."""
    # loaded first, as in a process: none of them may keep a decide of its own
    from kvcached_pd import activation, checks, cli  # noqa: F401
    from kvcached_pd.connector import connector  # noqa: F401
    from kvcached_pd.patches import PATCHES

    for name, value in dict(STAGED_BY_NAME, KVCACHED_PD_STATE_DIR=str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    config.reset_settings_for_tests()
    real = serving.decide(config.settings(), installed_version("vllm"))
    assert real.staged
    asked = []

    def decide(settings, vllm_version, connector=None):
        asked.append(connector)
        return dataclasses.replace(real, transport=serving.DIRECT, reason=REASON,
                                   routed=False, routing_reason=REASON, wire="nixl",
                                   wire_reason="the wire this test chose", connector=connector)

    monkeypatch.setattr(serving, "decide", decide)
    for patch in PATCHES:  # each reads this test's settings, whatever applied it before
        monkeypatch.setattr(patch, "_settings", None)
    return asked


def test_guard_doctor_log_and_patches_follow_the_one_decision(one_decision, monkeypatch,
                                                              capsys, caplog):
    from kvcached_pd import activation, cli
    from kvcached_pd.patches import get_patch

    guard = get_patch("connector_guard")
    problems = guard.problems(connector="NixlConnector")
    assert any(f"KVCACHED_PD_TRANSPORT=staged was asked for but cannot serve: {REASON}." in p
               for p in problems), problems
    monkeypatch.setattr(guard, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="kvcached_pd"):
        guard.warn_if_not_staged("NixlConnector")
    assert REASON in caplog.text

    assert cli.main(["doctor"]) == 1  # the guard's refusal, predicted
    report = capsys.readouterr().out
    assert f"transport that will serve: direct ({REASON})" in report
    assert "wire: nixl (the wire this test chose)" in report

    st = activation.ActivationState(active=True, vllm_version=installed_version("vllm"),
                                    settings=config.settings())
    with caplog.at_level(logging.INFO, logger="kvcached_pd"):
        activation._log_summary(st)
    assert f"transport direct: {REASON}; wire nixl: the wire this test chose" in caplog.text

    assert "NixlConnector" in one_decision and None in one_decision
    assert get_patch("connector_routing").applies() == (False, REASON)
    one_decision.clear()
    ok, why = get_patch("connector_metrics").applies()
    assert not ok and REASON in why
    assert one_decision == [vllm_api.CONNECTOR_CLASS]  # the series are our connector's


def test_the_registration_follows_the_one_decision(one_decision, monkeypatch):
    """kvcached's contiguous layout is registered only for the staged transport; the
    registration patch asks the decision whether it was chosen."""
    from kvcached_pd.patches.nixl_registration import staged_refusal

    decided = serving.decide(config.settings(), installed_version("vllm"))
    monkeypatch.setattr(serving, "decide", lambda *args: dataclasses.replace(
        decided, requested=serving.DIRECT))
    assert staged_refusal(object()) == REASON


def test_the_connector_follows_the_one_decision(one_decision):
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcached_pd.connector import KvcachedPDConnector
    from tests.support import connector_pd as pd
    from tests.support import vllm_nixl_worker as vw

    with pd.cpu_vllm():
        vllm_config = pd.connector_config("kv_both", block_size=16, num_blocks=8)
        kv_cache_config = vw.kv_cache_config(pd.LAYER_NAMES, 8, 16, pd.HEADS, pd.HEAD_DIM)
        with set_current_vllm_config(vllm_config):
            connector = KvcachedPDConnector(vllm_config, KVConnectorRole.SCHEDULER,
                                            kv_cache_config)
    assert one_decision == [vllm_api.CONNECTOR_CLASS]  # ours, whichever name built it
    assert connector._fmt is None and connector._why_not_staged == REASON
    assert connector._prefill is None and connector._decode is None
