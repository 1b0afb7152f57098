"""Which model runner the harness gives vLLM instances: kvcached 0.1.6 refuses Model
Runner V2 before vLLM 0.28 and requires it from 0.29, so VLLM_USE_V2_MODEL_RUNNER=0 is set
up to 0.28 only. No GPU, no vLLM needed.

run: python -m pytest experiments/tests/test_model_runner_env.py -q
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pd_modes  # noqa: E402
import pd_servers  # noqa: E402


@pytest.mark.parametrize("version", ["0.20.0", "0.26.0", "0.28.1", "", "unknown"])
def test_v1_runner_pinned_up_to_028(version):
    assert pd_servers.model_runner_env(version) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0", "0.30.1.dev3+g0123abc", "1.0.0"])
def test_vllm_chooses_the_runner_from_029(version):
    assert pd_servers.model_runner_env(version) == {}


@pytest.mark.parametrize("chosen", [{}, {"VLLM_USE_V2_MODEL_RUNNER": "0"}])
def test_every_instance_gets_it(monkeypatch, chosen):
    monkeypatch.setattr(pd_servers, "model_runner_env", lambda: dict(chosen))
    cfg = pd_modes.InstanceConfig(flavor="vanilla", env=dict(pd_modes.KVCACHED_OFF))
    env = pd_servers.instance_env(cfg, "0", 25600, "ipc-x", None, base={"PATH": "/usr/bin"})
    assert env.get("VLLM_USE_V2_MODEL_RUNNER") == chosen.get("VLLM_USE_V2_MODEL_RUNNER")
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
