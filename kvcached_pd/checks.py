"""Configuration checks shared by the startup guard and ``kvcached-pd doctor``.

Each check returns a list of problems written as what is wrong and what to do. A
problem here is *blocking* for kvcached + NIXL: the combination would crash or move
KV wrongly, so startup stops instead.
"""

from __future__ import annotations

import importlib.util
import os

from kvcached_pd import config
from kvcached_pd.versions import SUPPORTED_VLLM, installed_version

REQUIRED_FOR_NIXL = ("kvcached_coexistence", "nixl_layout", "nixl_registration")


def vllm_version_problems() -> list[str]:
    version = installed_version("vllm")
    if version is None:
        return ["vLLM is not installed"]
    try:
        supported = SUPPORTED_VLLM.contains(version)
    except ValueError as exc:
        return [f"cannot read vLLM's version: {exc}"]
    if not supported:
        return [
            f"vLLM {version} is outside the range kvcached-pd supports with NIXL "
            f"({SUPPORTED_VLLM}); its NixlConnector hooks are unknown. Install a vLLM in "
            "that range, or run without ENABLE_KVCACHED or without a NIXL connector."
        ]
    return []


def kvcached_problems(env=None) -> list[str]:
    env = os.environ if env is None else env
    problems = []
    if importlib.util.find_spec("kvcached") is None:
        problems.append(
            "ENABLE_KVCACHED is on but kvcached is not importable; install it "
            "(`pip install 'kvcached-pd[kvcached]'`, built against a CUDA torch) or unset "
            "ENABLE_KVCACHED."
        )
    if config.kvcached_contiguous_layout(env):
        problems.append(
            f"{config.KVCACHED_CONTIGUOUS_LAYOUT} is true (kvcached's default): its pages "
            "interleave layers and K/V, which NIXL's per-layer regions cannot describe. "
            f"Set {config.KVCACHED_CONTIGUOUS_LAYOUT}=false for PD disaggregation."
        )
    return problems


def layout_problems(env=None) -> list[str]:
    """An explicit head-major layout wins over every connector in vLLM's resolution."""
    env = os.environ if env is None else env
    requested = env.get("VLLM_KV_CACHE_LAYOUT", "").strip().upper()
    if requested in ("HND", "LBHNC"):
        return [
            f"VLLM_KV_CACHE_LAYOUT={requested} forces a head-major KV layout, which "
            "kvcached cannot provide (its tensors are NHD only). Unset it or set NHD."
        ]
    return []


def patch_set_problems(disabled: frozenset[str]) -> list[str]:
    """Disabling only part of the NIXL patches leaves nobody handling layout/blocks."""
    off = [n for n in REQUIRED_FOR_NIXL if n in disabled]
    if not off or len(off) == len(REQUIRED_FOR_NIXL):
        return []  # all on, or all off (kvcached's own patch then owns NIXL)
    return [
        f"{config.KVCACHED_PD_DISABLE} turns off {off} but not "
        f"{[n for n in REQUIRED_FOR_NIXL if n not in off]}: with kvcached's own NIXL patch "
        "disarmed and kvcached-pd's partly off, nothing handles the layout or the block "
        f"count. Disable all of {list(REQUIRED_FOR_NIXL)} (kvcached 0.1.6's behaviour) or none."
    ]


def blocking_problems(nixl: bool = True, env=None) -> list[str]:
    """Everything that must stop a kvcached + NIXL startup in this process."""
    from kvcached_pd.activation import state

    problems: list[str] = []
    if nixl:
        problems += vllm_version_problems()
        problems += kvcached_problems(env)
        problems += layout_problems(env)
    st = state()
    if st is not None and st.active:
        problems += st.problems()
        if st.settings is not None:
            problems += patch_set_problems(st.settings.disabled_patches)
    return problems
