"""Configuration checks shared by the startup guard and ``kvcached-pd doctor``.

Each check returns a list of problems written as what is wrong and what to do. A
problem here is *blocking* for kvcached + NIXL: the combination would crash or move
KV wrongly, so startup stops instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys

from kvcached_pd import config, serving
from kvcached_pd.serving import ROUTING, STAGED, Serving
from kvcached_pd.versions import installed_version, parse_release
from kvcached_pd.vllm_api import SUPPORTED_VLLM, api_for

REQUIRED_FOR_NIXL = ("kvcached_coexistence", "nixl_layout", "nixl_registration")
HEAD_MAJOR_LAYOUTS = ("HND", "LBHNC")
GUARD = "connector_guard"  # armed whenever the gate is open, even if named in KVCACHED_PD_DISABLE


def setting_problems(settings: config.Settings, known_patches: frozenset[str] | None
                     ) -> list[str]:
    """The settings' own problems, and the names in ``KVCACHED_PD_DISABLE`` that no patch
    of ``known_patches`` (the patch table's names, from whoever holds the table:
    activation, the doctor) has; None: names are not checked."""
    problems = list(settings.problems)
    if known_patches is not None:
        unknown = sorted(settings.disabled_patches - known_patches)
        if unknown:
            problems.append(f"{config.KVCACHED_PD_DISABLE} names unknown patch(es) {unknown}; "
                            f"known patches: {sorted(known_patches)}")
    return problems


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
    return nixl_version_problems(version)


def nixl_version_problems(vllm_version: str, nixl_version: str | None = None) -> list[str]:
    """The NIXL this vLLM release's connector needs (``VllmApi.min_nixl``): setup.cfg
    can ask only for the oldest NIXL of the whole range, so a venv that keeps an older
    NIXL under a newer vLLM is refused here, with the fix, instead of inside vLLM."""
    record = api_for(vllm_version)
    nixl_version = nixl_version if nixl_version is not None else (
        installed_version("nixl") or installed_version("nixl-cu13")
        or installed_version("nixl-cu12"))
    if record is None or nixl_version is None:
        return []  # no NIXL at all: vLLM's NIXL connector says so itself
    if parse_release(nixl_version) < parse_release(record.min_nixl):
        return [f"vLLM {vllm_version} needs NIXL >= {record.min_nixl} (its NIXL connector "
                f"prepares strided descriptor lists); NIXL {nixl_version} is installed. "
                f"Run: pip install 'nixl>={record.min_nixl}'"]
    return []


def kvcached_runner_window() -> tuple[str, str] | None:
    """(kvcached's version, the vLLM releases its Model Runner V2 adapter covers, as
    kvcached declares them), or None when the installed kvcached declares none.

    kvcached 0.1.6 refuses, inside vLLM's EngineCore start, every vLLM from 0.29 on
    outside ``VLLM_MRV2_RANGE`` (">=0.29.0,<0.31.0"): "kvcached has no runner adapter
    for vLLM 0.33.0" (seen on 2 x H200, 2026-11-26). Read from kvcached itself, so a
    kvcached that widens its window is followed without a change here."""
    try:
        patches = importlib.import_module("kvcached.integration.vllm.patches")
    except Exception:  # noqa: BLE001 - not importable here: kvcached_problems says so
        return None
    window = getattr(patches, "VLLM_MRV2_RANGE", None)
    if not isinstance(window, str):
        return None
    return installed_version("kvcached") or "?", window


def kvcached_runner_problem(vllm_version: str | None,
                            window: tuple[str, str] | None) -> str | None:
    """Why the installed kvcached will refuse this vLLM at engine start, or None.

    Only a vLLM at or above the window's upper bound is named (kvcached 0.1.6: vLLM
    0.31+); below its lower bound kvcached serves vLLM through its first runner
    (0.26-0.28). kvcached refuses by itself, before the model loads, so this is not one
    of :func:`startup_problems` (kvcached-pd's own refusals): activation logs it (a
    WARNING, in the API server before the engine starts) and the doctor prints it."""
    if vllm_version is None or window is None:
        return None
    kvcached_version, spec = window
    below = re.search(r"<\s*v?(\d+(?:\.\d+)*)", spec)
    if below is None or parse_release(vllm_version) < parse_release(below.group(1)):
        return None
    return (f"kvcached {kvcached_version} has no runner adapter for vLLM {vllm_version}: "
            f"its adapter covers vLLM {spec}, and kvcached refuses any other release "
            f"when vLLM's engine starts. Install a vLLM below {below.group(1)} (or a "
            f"kvcached release that supports vLLM {vllm_version}), or unset ENABLE_KVCACHED.")


def kvcached_problems(decision: Serving, env=None) -> list[str]:
    env = os.environ if env is None else env
    problems = []
    if importlib.util.find_spec("kvcached") is None:
        problems.append(
            "ENABLE_KVCACHED is on but kvcached is not importable; install it "
            "(`pip install 'kvcached-pd[kvcached]'`, built against a CUDA torch) or unset "
            "ENABLE_KVCACHED."
        )
    if config.kvcached_contiguous_layout(env):
        problem = contiguous_layout_problem(decision)
        if problem:
            problems.append(problem)
    return problems


def contiguous_layout_problem(decision: Serving) -> str | None:
    """Why kvcached's contiguous layout cannot serve this instance, or None if it can.

    Its compound pages put every layer's block ``b`` side by side, so one layer's
    blocks sit ``layers x block`` bytes apart: vLLM's per-block NIXL descriptors
    (``base + b * block_len``) would address other layers' bytes. The staged transport
    reads and writes kvcached memory only locally, through strided views, so it serves
    that layout (and its page mapping is ~4x faster: 81-90 ms against 361-365 ms TTFT
    for 8 x 3000-token prompts, measured); the direct path never does. The staged
    transport must be chosen and must serve this vLLM and ``kv_connector``
    (``decision``).
    """
    variable = config.KVCACHED_CONTIGUOUS_LAYOUT
    layout = (f"{variable} is true (kvcached's default): its pages interleave every "
              "layer's blocks, which vLLM's per-block NIXL descriptors cannot address")
    if decision.requested != STAGED:
        return (f"{layout}, and {config.KVCACHED_PD_TRANSPORT}={decision.requested} moves KV by "
                f"those descriptors. Set {variable}=false or use the staged transport "
                f"({config.KVCACHED_PD_TRANSPORT}=staged).")
    if decision.staged:
        return None
    remedy = routing_remedy(decision) or f"Set {variable}=false."
    return f"{layout}, and the direct path would move it: {decision.reason}. {remedy}"


def layout_problems(env=None) -> list[str]:
    """An explicit head-major layout wins over every connector in vLLM's resolution."""
    env = os.environ if env is None else env
    requested = env.get(config.VLLM_KV_CACHE_LAYOUT, "").strip().upper()
    if requested in HEAD_MAJOR_LAYOUTS:
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


def routing_remedy(decision: Serving) -> str | None:
    """With ``connector_routing`` disabled, the two ways to a configuration that serves
    (the staged transport needs kvcached-pd's connector; the direct one cannot move
    kvcached's contiguous layout); None unless the staged transport was chosen and the
    routing is what keeps it from vLLM's NIXL names."""
    if not decision.staged_requested or decision.routed:
        return None
    return (f"Remove {ROUTING} from {config.KVCACHED_PD_DISABLE} "
            "(kvcached-pd's connector then serves), or use the direct transport "
            f"({config.KVCACHED_PD_TRANSPORT}=direct) with "
            f"{config.KVCACHED_CONTIGUOUS_LAYOUT}=false.")


def transport_problems(decision: Serving) -> list[str]:
    """``KVCACHED_PD_TRANSPORT=staged`` asked for by name must be what serves: an operator
    who asked for it would otherwise get vLLM's per-block path (0.5 GB/s with kvcached
    peers on the 2xH200 host) without a word."""
    if not (decision.falls_short and decision.requested_by_name):
        return []
    remedy = routing_remedy(decision) or (
        f"Unset {config.KVCACHED_PD_TRANSPORT} (the direct path then serves) or install a "
        "vLLM the staged transport supports.")
    return [f"{config.KVCACHED_PD_TRANSPORT}=staged was asked for but cannot serve: "
            f"{decision.reason}. " + remedy]


def staging_memory_problems(settings: config.Settings, decision: Serving, free_bytes: int | None,
                            what: str = "free on this worker's device") -> list[str]:
    """A staging region larger than the device memory left cannot be allocated.

    Checked when the worker's connector is created: vLLM then has not yet allocated its
    KV cache, so this is a necessary condition only (vLLM's KV cache still takes its
    share of what is free afterwards), but it turns a typo such as 99999999 MiB into a
    refusal before the KV cache is allocated instead of an error inside
    ``register_kv_caches``.
    """
    if not decision.staged or free_bytes is None or settings.staging_bytes is None:
        return []  # no staging here; the engine-derived default never exceeds the KV budget
    if settings.staging_bytes <= free_bytes:
        return []
    return [f"{config.KVCACHED_PD_STAGING_MB}={settings.staging_mb} MiB of staging does not fit: "
            f"{free_bytes >> 20} MiB {what}. Lower {config.KVCACHED_PD_STAGING_MB} (the staging "
            "region holds the KV of requests in flight between prefill and decode)."]


def kv_cache_config_problems(settings: config.Settings, kv_cache_config) -> list[str]:
    """Refusals that need vLLM's KV-cache config but not the KV tensors, so they are made
    when the connector is created (before the KV cache is allocated) instead of in
    ``register_kv_caches`` (which keeps the same check as a backstop)."""
    if not settings.active or not settings.kvcached_enabled or kv_cache_config is None:
        return []
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if any(type(g.kv_cache_spec).__name__.startswith("Mamba") for g in groups):
        return ["kvcached-pd cannot describe hybrid/mamba KV caches to NIXL (state tensors "
                "share kvcached pages with attention blocks). Run this model without "
                f"{config.ENABLE_KVCACHED}, or without a NIXL connector."]
    return []


def device_free_bytes() -> int | None:
    """Free memory of this process's current CUDA device, or None without one.

    Only called from a worker's connector creation, where vLLM has already selected
    the device; never initialises CUDA anywhere else.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def startup_problems(settings: config.Settings, *, known_patches: frozenset[str] | None,
                     nixl: bool = True, failed: dict | None = None,
                     vllm_version: str | None = None, env=None,
                     connector: str | None = None) -> list[str]:
    """Everything that makes startup refuse a NIXL connector with these settings.

    The connector guard raises on these and ``kvcached-pd doctor`` exits 1 on the same
    list, so the doctor predicts startup. Nothing is refused while the gate is closed:
    nothing is patched then, the guard included. What serves ``connector`` is
    :func:`kvcached_pd.serving.decide`'s answer, the one the connector acts on.
    ``known_patches``: the patch table's names (:func:`setting_problems`).
    """
    if not settings.active:
        return []
    decision = serving.decide(settings, vllm_version or installed_version("vllm"), connector)
    problems = setting_problems(settings, known_patches)
    if nixl and settings.kvcached_enabled:
        problems += vllm_version_problems()
        problems += kvcached_problems(decision, env)
        problems += layout_problems(env)
    problems += patch_set_problems(settings.disabled_patches)
    if nixl:
        problems += transport_problems(decision)
    problems += [f"patch {n} failed to apply: {e}" for n, e in (failed or {}).items()]
    if problems and GUARD in settings.disabled_patches:
        problems.append(
            f"{config.KVCACHED_PD_DISABLE} names {GUARD}, which cannot waive these: they "
            "would move KV wrongly or not as asked. Fix them; the guard stays armed."
        )
    return problems
