"""NIXL connectors must not ask for HND (or LBHNC) when kvcached backs the KV cache.

vLLM's NIXL connectors request HND (0.20-0.28) or LBHNC (0.29+) for faster transfers;
vLLM then permutes the freshly allocated cache with ``set_stride``, which kvcached's
``from_blob`` tensors refuse, and kvcached lays tensors out NHD only. With kvcached
active the connectors' ``get_required_kvcache_layout`` answers "NHD" instead.

Where the layout is decided: in each worker's ``get_kv_cache_layout()`` (0.20-0.28)
or once in the EngineCore's ``resolve_kv_cache_layout`` (0.29+). Both run after
``load_general_plugins()`` in that process, so the plugin entry point reaches them.

An explicit ``VLLM_KV_CACHE_LAYOUT=HND``/``LBHNC`` still wins over any connector in
vLLM; with kvcached that would crash or mis-stride, so it stops startup here.

Fail-closed: if the classes cannot be found the import hook raises.
"""

from __future__ import annotations

import logging

from kvcached_pd import config
from kvcached_pd.errors import UnsupportedConfiguration
from kvcached_pd.checks import HEAD_MAJOR_LAYOUTS, layout_problems  # noqa: F401 (re-export)
from kvcached_pd.patches.base import Patch
from kvcached_pd.vllm_api import SUPPORTED_VLLM
from kvcached_pd import vllm_nixl

logger = logging.getLogger("kvcached_pd")

ATTR = "get_required_kvcache_layout"


def check_layout_env() -> None:
    """The same check the connector guard runs (one definition, in ``checks``), raised
    here too because vLLM resolves the layout before any connector exists."""
    problems = layout_problems()
    if problems:
        raise UnsupportedConfiguration(problems[0])


def _make_layout_hook(original: classmethod) -> classmethod:
    original_func = original.__func__

    def get_required_kvcache_layout(cls, vllm_config):
        wanted = original_func(cls, vllm_config)
        if not config.settings().kvcached_enabled or wanted is None:
            return wanted
        check_layout_env()
        logger.info(
            "kvcached-pd: %s asks for %s KV layout; kvcached tensors are NHD only, "
            "using NHD",
            cls.__name__,
            wanted,
        )
        return "NHD"

    get_required_kvcache_layout.__doc__ = original_func.__doc__
    get_required_kvcache_layout.__wrapped__ = original_func  # type: ignore[attr-defined]
    return classmethod(get_required_kvcache_layout)


class NixlLayoutPatch(Patch):
    name = "nixl_layout"
    summary = "NIXL connectors (pull and push) request NHD instead of HND/LBHNC under kvcached"
    target_module = vllm_nixl.NIXL_PACKAGE
    vllm_range = SUPPORTED_VLLM
    fail_closed = True

    def _apply(self) -> None:
        owners = vllm_nixl.nixl_owners(vllm_nixl.connector_classes(), ATTR)
        if not owners:
            raise AttributeError(
                f"no NIXL connector class in {vllm_nixl.NIXL_PACKAGE} defines {ATTR}"
            )
        for owner in owners:
            self._wrap_classmethod(owner, ATTR, _make_layout_hook)
