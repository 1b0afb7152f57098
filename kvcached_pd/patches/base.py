"""What every patch has: a target, a version range, patch/unpatch/is_patched.

Restoring exactly matters: ``patch()`` records the raw object found in the owning
class's ``__dict__`` (a ``classmethod`` object stays a ``classmethod``) and
``unpatch()`` puts that very object back, but only where the installed object is still
ours, so a later patcher's work is never clobbered.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvcached_pd import config
from kvcached_pd.versions import VersionRange, installed_version

logger = logging.getLogger("kvcached_pd")

_MISSING = object()
MARK = "__kvcached_pd_patch__"


@dataclass
class _Replacement:
    owner: Any
    attr: str
    original: Any  # raw object from vars(owner), or _MISSING
    installed: Any


def wrap_hook(hook, original):
    """``original`` with ``hook(original, self, *args, **kwargs)`` called instead."""

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return hook(original, self, *args, **kwargs)

    return method


class Patch:
    """One patched target. Subclasses set the class attributes and ``_apply``."""

    name: str = ""
    summary: str = ""
    target_module: str = ""
    vllm_range: VersionRange | None = None  # None: not tied to vLLM's version
    # fail_closed: a failure to apply stops startup (the KV would move wrongly without
    # it); otherwise a failure logs one warning and vLLM runs unpatched.
    fail_closed: bool = True

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._replacements: list[_Replacement] = []
        self._settings: "config.Settings | None" = None

    @property
    def settings(self) -> "config.Settings":
        """The settings this patch was applied with (activation hands over the process's
        one parsed object); the process's own when patched without any."""
        return self._settings if self._settings is not None else config.settings()

    # -- public API -------------------------------------------------------------
    def applies(self, vllm_version: str | None = None) -> tuple[bool, str]:
        """Whether this patch is meant for the installed vLLM, and why (not)."""
        if self.vllm_range is None:
            return True, "not tied to a vLLM version"
        version = vllm_version or installed_version("vllm")
        if version is None:
            return False, "vLLM is not installed"
        if self.vllm_range.contains(version):
            return True, f"vLLM {version} is in {self.vllm_range}"
        return False, f"vLLM {version} is outside {self.vllm_range}"

    def patch(self, settings: "config.Settings | None" = None) -> bool:
        """Apply with ``settings``; idempotent. Returns True if this call changed anything."""
        with self._lock:
            if settings is not None:
                self._settings = settings
            if self._replacements:
                logger.debug("kvcached-pd: %s already patched", self.name)
                return False
            try:
                self._apply()
            except BaseException:
                self._undo()
                raise
            logger.debug("kvcached-pd: patched %s", self.name)
            return True

    def unpatch(self) -> bool:
        """Restore exactly what was there; idempotent."""
        with self._lock:
            if not self._replacements:
                return False
            self._undo()
            logger.debug("kvcached-pd: unpatched %s", self.name)
            return True

    def is_patched(self) -> bool:
        """True while every replacement is in effect: installed, or wrapped (through
        ``__wrapped__``) by a later patch stacked on the same method."""
        with self._lock:
            return bool(self._replacements) and all(
                _reaches(vars(r.owner).get(r.attr, _MISSING), r.installed)
                for r in self._replacements
            )

    # -- for subclasses ---------------------------------------------------------
    def _apply(self) -> None:
        raise NotImplementedError

    def _replace(self, owner: Any, attr: str, new: Any) -> None:
        """Install ``new`` as ``owner.attr``, remembering the raw original."""
        original = vars(owner).get(attr, _MISSING)
        target = new.__func__ if isinstance(new, (classmethod, staticmethod)) else new
        try:
            setattr(target, MARK, self.name)
        except (AttributeError, TypeError):
            pass
        setattr(owner, attr, new)
        self._replacements.append(_Replacement(owner, attr, original, new))

    def _wrap_classmethod(self, owner: Any, attr: str, make_hook) -> None:
        """Replace the classmethod ``owner.attr`` with ``make_hook(original_classmethod)``."""
        original = vars(owner)[attr]
        if not isinstance(original, classmethod):
            raise TypeError(f"{owner.__qualname__}.{attr} is not a classmethod")
        self._replace(owner, attr, make_hook(original))

    def _undo(self) -> None:
        for rep in reversed(self._replacements):
            current = vars(rep.owner).get(rep.attr, _MISSING)
            if current is not rep.installed:
                logger.warning(
                    "kvcached-pd: %s.%s was replaced by someone else after %s patched it;"
                    " leaving it alone",
                    getattr(rep.owner, "__qualname__", rep.owner),
                    rep.attr,
                    self.name,
                )
                continue
            if rep.original is _MISSING:
                delattr(rep.owner, rep.attr)
            else:
                setattr(rep.owner, rep.attr, rep.original)
        self._replacements.clear()


class ModuleFunctionPatch(Patch):
    """A patch that wraps one module-level function (``target_module.target_attr``)."""

    target_attr: str = ""

    def wrap(self, original: Any) -> Any:
        raise NotImplementedError

    def _apply(self) -> None:
        import importlib

        module = importlib.import_module(self.target_module)
        self._replace(module, self.target_attr, self.wrap(getattr(module, self.target_attr)))


def _unwrap_descriptor(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj


def _reaches(current: Any, target: Any) -> bool:
    if current is target:
        return True
    fn, target_fn = _unwrap_descriptor(current), _unwrap_descriptor(target)
    for _ in range(16):  # a short chain of wrappers; never loop forever
        if fn is target_fn:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


def defining_class(cls: type, attr: str) -> type:
    """The class in ``cls``'s MRO whose own ``__dict__`` holds ``attr``."""
    for klass in cls.__mro__:
        if attr in vars(klass):
            return klass
    raise AttributeError(f"{cls.__qualname__} has no attribute {attr!r}")


def is_ours(obj: Any) -> bool:
    target = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
    return getattr(target, MARK, None) is not None
