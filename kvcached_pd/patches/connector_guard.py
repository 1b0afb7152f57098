"""Stop startup before a NIXL connector is built in a configuration that moves KV wrongly.

Hooked on ``KVConnectorFactory.create_connector`` (the same classmethod from vLLM 0.20
to 0.33), which every process calls before a connector exists: the scheduler and
each worker. With kvcached enabled and a NIXL connector requested it raises
:class:`~kvcached_pd.errors.UnsupportedConfiguration` for every blocking problem
:func:`kvcached_pd.checks.blocking_problems` finds (unsupported vLLM, kvcached's
contiguous layout, kvcached missing, a bad kvcached-pd setting, a patch that failed to
apply). vLLM's plugin loader swallows exceptions, so this is where activation
problems become a startup failure.

Not tied to vLLM's version: it is what refuses versions outside the supported range.
"""

from __future__ import annotations

import functools
import importlib

from kvcached_pd import vllm_nixl
from kvcached_pd.config import kvcached_enabled
from kvcached_pd.errors import UnsupportedConfiguration
from kvcached_pd.patches.base import Patch

ATTR = "create_connector"


def _make_guard(original: classmethod) -> classmethod:
    original_func = original.__func__

    @functools.wraps(original_func)
    def create_connector(cls, config, *args, **kwargs):
        kv_transfer_config = getattr(config, "kv_transfer_config", None)
        if kvcached_enabled() and kv_transfer_config is not None:
            connector_cls = cls.get_connector_class(kv_transfer_config) if hasattr(
                cls, "get_connector_class"
            ) else None
            name = getattr(kv_transfer_config, "kv_connector", "") or ""
            is_nixl = (
                vllm_nixl.is_nixl_connector(connector_cls)
                if connector_cls is not None
                else "nixl" in name.lower()
            )
            if is_nixl:
                from kvcached_pd.checks import blocking_problems

                problems = blocking_problems(nixl=True)
                if problems:
                    raise UnsupportedConfiguration(
                        "kvcached-pd refuses to start NIXL with kvcached:\n  - "
                        + "\n  - ".join(problems)
                        + "\nRun `kvcached-pd doctor` for the full picture."
                    )
        return original_func(cls, config, *args, **kwargs)

    return classmethod(create_connector)


class ConnectorGuardPatch(Patch):
    name = "connector_guard"
    summary = "refuse to build a NIXL connector with kvcached in a configuration that would move KV wrongly"
    target_module = vllm_nixl.FACTORY_MODULE
    vllm_range = None
    fail_closed = True

    def _apply(self) -> None:
        module = importlib.import_module(vllm_nixl.FACTORY_MODULE)
        self._wrap_classmethod(module.KVConnectorFactory, ATTR, _make_guard)
