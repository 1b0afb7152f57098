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
        problem = contiguous_layout_problem(env)
        if problem:
            problems.append(problem)
    return problems


def contiguous_layout_problem(env=None) -> str | None:
    """Why kvcached's contiguous layout cannot serve this instance, or None if it can.

    Its compound pages put every layer's block ``b`` side by side, so one layer's
    blocks sit ``layers x block`` bytes apart: vLLM's per-block NIXL descriptors
    (``base + b * block_len``) would address other layers' bytes. The staged transport
    reads and writes kvcached memory only locally, through strided views, so it serves
    that layout (and its page mapping is ~4x faster: 81-90 ms against 361-365 ms TTFT
    for 8 x 3000-token prompts, measured); the direct path never does. Staged must be
    chosen and this vLLM must be one the staged transport hooks.
    """
    from kvcached_pd.patches.staged_transport import StagedTransportPatch

    variable = config.KVCACHED_CONTIGUOUS_LAYOUT
    layout = (f"{variable} is true (kvcached's default): its pages interleave every "
              "layer's blocks, which vLLM's per-block NIXL descriptors cannot address")
    transport = config.read_settings(frozenset(), env).transport
    if transport != "staged":
        return (f"{layout}, and {config.KVCACHED_PD_TRANSPORT}={transport} moves KV by "
                f"those descriptors. Set {variable}=false or use the staged transport "
                f"({config.KVCACHED_PD_TRANSPORT}=staged).")
    staged_range = StagedTransportPatch.vllm_range
    version = installed_version("vllm")
    try:
        served = version is not None and staged_range.contains(version)
    except ValueError:
        served = False
    if not served:
        return (f"{layout}, and the staged transport serves vLLM {staged_range} only "
                f"(this is vLLM {version}), so the direct path would move it. "
                f"Set {variable}=false.")
    return None


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
