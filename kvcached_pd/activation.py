"""``activate()``: the one entry every activation path calls.

Paths: the ``vllm.general_plugins`` entry point (every vLLM process: API server,
EngineCore, workers, spawned children), the top-level ``sitecustomize.py`` when running
from a checkout, and tests. It is idempotent under a lock. The environment gate is
read first; when it is closed nothing else of kvcached-pd, and nothing of vLLM, torch
or wrapt, is imported.

With the gate open it registers one wrapt post-import hook per patch of the table
(``kvcached_pd.patches.PATCHES``), so patch code runs only when vLLM (or kvcached)
imports the target, in either order, and hands each patch the process's one parsed
``config.settings()``. Test-only patches (``kvcached_pd.testing``) are armed only by
their own variable. A hook that raises would break the user's
``import vllm``; errors are caught and logged, recorded as blocking problems (the
connector guard turns them into a startup failure when NIXL is used), and re-raised
only in strict mode (``KVCACHED_PD_STRICT=1``, for tests).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvcached_pd import config

from kvcached_pd.log import logger

_lock = threading.Lock()
_state: "ActivationState | None" = None


@dataclass
class ActivationState:
    active: bool
    vllm_version: str | None = None
    settings: "config.Settings | None" = None
    registered: list[str] = field(default_factory=list)  # hooks waiting for imports
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why
    failed: dict[str, str] = field(default_factory=dict)  # name -> error


def state() -> ActivationState | None:
    return _state


def activate() -> ActivationState:
    """Activate kvcached-pd in this process if its gate is open; idempotent."""
    global _state
    with _lock:
        if _state is not None:
            logger.debug("kvcached-pd: activate() called again; already done")
            return _state
        if not config.gate_open():  # cheap: no settings parsed, nothing imported
            _state = ActivationState(active=False)
            return _state
        _state = _activate()
        return _state


def _activate() -> ActivationState:
    import wrapt

    from kvcached_pd import log, testing
    from kvcached_pd.checks import GUARD, setting_problems
    from kvcached_pd.patches import PATCH_NAMES, PATCHES
    from kvcached_pd.versions import installed_version

    # First, so that every line below (and those of hooks firing at once because vLLM
    # is already imported, as under the plugin entry point) reaches vLLM's handler.
    wrapt.register_post_import_hook(log.follow_vllm_logging, "vllm.logger")

    settings = config.settings()
    st = ActivationState(active=True, vllm_version=installed_version("vllm"), settings=settings)
    for problem in setting_problems(settings, PATCH_NAMES):
        logger.error("kvcached-pd: %s", problem)
    for patch in PATCHES + testing.armed(settings):
        if patch.name in settings.disabled_patches and patch.name != GUARD:
            st.skipped[patch.name] = f"disabled by {config.KVCACHED_PD_DISABLE}"
            continue
        ok, why = patch.applies(st.vllm_version)
        if not ok:
            st.skipped[patch.name] = why
            continue
        if patch.name == GUARD:
            patch.activation_failures = lambda: dict(st.failed)
            patch.known_patches = PATCH_NAMES
        st.registered.append(patch.name)
        wrapt.register_post_import_hook(_hook_for(patch, st), patch.target_module)
    # Logged once vLLM's logging is in place (at once if it already is).
    wrapt.register_post_import_hook(lambda _m: _log_summary(st), "vllm.logger")
    return st


def _log_summary(st: ActivationState) -> None:
    from kvcached_pd import checks, serving

    decision = serving.decide(st.settings, st.vllm_version)
    if st.settings.kvcached_enabled:  # kvcached refuses this vLLM itself, later: say it first
        refusal = checks.kvcached_runner_problem(st.vllm_version, checks.kvcached_runner_window())
        if refusal:
            logger.warning("kvcached-pd: %s", refusal)
    logger.info(
        "kvcached-pd: active (vLLM %s, transport %s: %s; wire %s: %s); patches waiting for "
        "their imports: %s; skipped: %s",
        st.vllm_version,
        decision.transport,
        decision.reason,
        decision.wire,
        decision.wire_reason,
        ", ".join(st.registered) or "none",
        ", ".join(f"{n} ({w})" for n, w in st.skipped.items()) or "none",
    )


def _hook_for(patch, st: ActivationState):
    def hook(module) -> None:
        try:
            changed = patch.patch(st.settings)
        except Exception as exc:  # noqa: BLE001 - a hook must not break `import vllm`
            st.failed[patch.name] = f"{type(exc).__name__}: {exc}"
            level = logging.ERROR if patch.fail_closed else logging.WARNING
            logger.log(
                level,
                "kvcached-pd: patch %s failed on import of %s: %s%s",
                patch.name,
                module.__name__,
                exc,
                " (startup will stop if NIXL is used with kvcached)" if patch.fail_closed else "",
            )
            if st.settings is not None and st.settings.strict:
                raise
            return
        if changed:
            st.applied.append(patch.name)
            logger.info("kvcached-pd: applied %s (%s)", patch.name, patch.summary)

    hook.__name__ = f"kvcached_pd_hook_{patch.name}"
    return hook


def _reset_for_tests() -> None:
    """Forget activation and the parsed settings (hooks stay registered with wrapt);
    tests only."""
    global _state
    with _lock:
        _state = None
    config.reset_settings_for_tests()
