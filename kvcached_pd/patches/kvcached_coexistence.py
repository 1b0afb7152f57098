"""Exactly one layer owns vLLM's NIXL integration: kvcached-pd.

kvcached 0.1.6's autopatch applies its own ``NixlConnectorPatch`` when vLLM is first
imported: it raises the NIXL worker's ``num_blocks`` to kvcached's virtual count and
overrides the layout classmethod. Left in place it would stack under kvcached-pd's
hooks (double wrapping) and register the virtual reservation again.

This patch targets ``kvcached.integration.vllm.nixl_compat``:
- if kvcached has not applied its NIXL patch yet, ``patch_connector`` becomes a no-op
  (logged), so it never will;
- if it already has (vLLM imported before kvcached-pd's plugin loaded, the usual order
  under the entry point), its changes to vLLM's classes are reverted to vLLM's originals.
kvcached's ``TransferTopology.__init__`` wrapper stays installed but inert: it acts
only on a flag set by kvcached's register wrapper, which is gone.

Fail-closed: if kvcached's patch cannot be neutralised, startup stops.
"""

from __future__ import annotations

import importlib
import logging
import sys

from kvcached_pd import vllm_nixl
from kvcached_pd.patches.base import Patch

logger = logging.getLogger("kvcached_pd")

TARGET = "kvcached.integration.vllm.nixl_compat"

_LAYOUT_BACKUP = "_original_get_layout"
_REGISTER_BACKUP = "_kvcached_original_register_kv_caches"
_REGISTER_MARK = "_kvcached_register_patched"


def revert_kvcached_nixl_changes() -> list[str]:
    """Undo what kvcached's NixlConnectorPatch did to vLLM's classes; returns what."""
    if vllm_nixl.NIXL_PACKAGE not in sys.modules:
        return []
    reverted = []
    for cls in vllm_nixl.connector_classes():
        if _LAYOUT_BACKUP not in vars(cls):
            continue
        installed = vars(cls).get("get_required_kvcache_layout")
        backup = vars(cls)[_LAYOUT_BACKUP]  # a method bound to cls, saved by getattr
        original_func = getattr(backup, "__func__", backup)
        inherited = any(
            "get_required_kvcache_layout" in vars(k) for k in cls.__mro__[1:]
        )
        if installed is not None and getattr(installed, "__func__", None) is not original_func:
            if inherited and _defined_by_parent(cls, original_func):
                delattr(cls, "get_required_kvcache_layout")  # kvcached shadowed the base
            else:
                cls.get_required_kvcache_layout = classmethod(original_func)
        delattr(cls, _LAYOUT_BACKUP)
        reverted.append(f"{cls.__qualname__}.get_required_kvcache_layout")
    for cls in vllm_nixl.worker_classes():
        for klass in cls.__mro__:
            if _REGISTER_BACKUP in vars(klass):
                klass.register_kv_caches = vars(klass)[_REGISTER_BACKUP]
                delattr(klass, _REGISTER_BACKUP)
                if _REGISTER_MARK in vars(klass):
                    delattr(klass, _REGISTER_MARK)
                reverted.append(f"{klass.__qualname__}.register_kv_caches")
    return reverted


def _defined_by_parent(cls: type, func) -> bool:
    for klass in cls.__mro__[1:]:
        raw = vars(klass).get("get_required_kvcache_layout")
        if raw is not None and getattr(raw, "__func__", raw) is func:
            return True
    return False


def _skipped_patch_connector(self, *args, **kwargs) -> bool:
    logger.info(
        "kvcached-pd: kvcached's NixlConnector patch skipped; kvcached-pd owns the NIXL "
        "integration (layout, registration)"
    )
    return True


class KvcachedCoexistencePatch(Patch):
    name = "kvcached_coexistence"
    summary = "disarm/revert kvcached 0.1.6's own NixlConnectorPatch so kvcached-pd alone owns NIXL"
    target_module = TARGET
    vllm_range = None
    fail_closed = True

    def _apply(self) -> None:
        module = importlib.import_module(TARGET)
        patch_cls = module.NixlConnectorPatch
        self._replace(patch_cls, "patch_connector", _skipped_patch_connector)
        reverted = revert_kvcached_nixl_changes()
        if reverted:
            logger.info("kvcached-pd: reverted kvcached's NIXL changes to %s", reverted)
