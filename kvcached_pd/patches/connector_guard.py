"""Stop startup before a NIXL connector is built in a configuration that moves KV wrongly.

Hooked on ``KVConnectorFactory.create_connector`` (the same classmethod from vLLM 0.20
to 0.33), which every process calls before a connector exists: the scheduler and
each worker. For a NIXL connector it raises
:class:`~kvcached_pd.errors.UnsupportedConfiguration` for every problem
:func:`kvcached_pd.checks.startup_problems` finds (unsupported vLLM, kvcached's
contiguous layout, kvcached missing, a bad kvcached-pd setting, a staged transport
asked for that cannot serve, a patch that failed to apply, a hybrid/mamba model under kvcached: every check that needs no KV tensor) and,
in a worker, for a staging region larger than the device's free memory. vLLM's plugin loader swallows
exceptions, so this is where activation problems become a startup failure.

``kvcached-pd doctor`` runs the same ``startup_problems`` on the same settings, so it
exits 1 exactly when this refuses (the device check aside: the doctor has no worker).

Armed whenever the gate is open, even when ``KVCACHED_PD_DISABLE`` names it: with a
blocking problem present, disabling the guard would serve wrong text, so the refusal
says the guard cannot waive it. Not tied to vLLM's version: it is what refuses
versions outside the supported range.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

from kvcached_pd import checks, serving, vllm_nixl
from kvcached_pd.errors import UnsupportedConfiguration
from kvcached_pd.patches.base import Patch
from kvcached_pd.versions import installed_version

logger = logging.getLogger("kvcached_pd")

ATTR = "create_connector"


def _is_worker(role) -> bool:
    return getattr(role, "name", str(role)).upper().endswith("WORKER")


class ConnectorGuardPatch(Patch):
    name = checks.GUARD
    summary = "refuse to build a NIXL connector in a configuration that would move KV wrongly"
    target_module = vllm_nixl.FACTORY_MODULE
    vllm_range = None
    fail_closed = True

    def __init__(self) -> None:
        super().__init__()
        # Handed over by activation: the patches that failed to apply in this process,
        # and the patch table's names (KVCACHED_PD_DISABLE's are checked against them).
        self.activation_failures: Callable[[], dict[str, str]] = dict
        self.known_patches: frozenset[str] | None = None
        self._warned = False

    def problems(self, role=None, kv_cache_config=None, connector: str | None = None) -> list[str]:
        settings = self.settings
        problems = checks.startup_problems(settings, known_patches=self.known_patches, nixl=True,
                                           failed=self.activation_failures(), connector=connector)
        problems += checks.kv_cache_config_problems(settings, kv_cache_config)
        if _is_worker(role):
            problems += checks.staging_memory_problems(
                settings, self.decision(connector), checks.device_free_bytes())
        return problems

    def decision(self, connector: str | None) -> serving.Serving:
        """What serves ``connector``: the decision the connector itself acts on."""
        return serving.decide(self.settings, installed_version("vllm"), connector)

    def warn_if_not_staged(self, connector: str | None) -> None:
        """The staged transport was chosen (by default) but will not move this
        connector's KV: say so once per process, at WARNING, with the reason."""
        if self._warned:
            return
        decision = self.decision(connector)
        if decision.falls_short:
            self._warned = True
            logger.warning("kvcached-pd: the staged transport does not serve kv_connector %s "
                           "here; KV moves by vLLM's per-block path (%s)", connector,
                           decision.reason)

    def _make_guard(self, original: classmethod) -> classmethod:
        original_func = original.__func__
        guard = self

        @functools.wraps(original_func)
        def create_connector(cls, config, role, *args, **kwargs):
            kv_transfer_config = getattr(config, "kv_transfer_config", None)
            if kv_transfer_config is not None:
                connector_cls = cls.get_connector_class(kv_transfer_config) if hasattr(
                    cls, "get_connector_class"
                ) else None
                name = getattr(kv_transfer_config, "kv_connector", "") or ""
                is_nixl = (
                    vllm_nixl.is_nixl_connector(connector_cls)
                    if connector_cls is not None
                    else "nixl" in name.lower()
                )
                kv_cache_config = args[0] if args else kwargs.get("kv_cache_config")
                problems = guard.problems(role, kv_cache_config, name or None) if is_nixl else []
                if problems:
                    raise UnsupportedConfiguration(
                        "kvcached-pd refuses to start NIXL:\n  - "
                        + "\n  - ".join(problems)
                        + "\nRun `kvcached-pd doctor` for the full picture."
                    )
                if is_nixl:
                    guard.warn_if_not_staged(name or None)
            return original_func(cls, config, role, *args, **kwargs)

        return classmethod(create_connector)

    def _apply(self) -> None:
        module = importlib.import_module(vllm_nixl.FACTORY_MODULE)
        self._wrap_classmethod(module.KVConnectorFactory, ATTR, self._make_guard)
