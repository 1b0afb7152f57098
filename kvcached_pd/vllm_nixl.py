"""Where vLLM's NIXL connector classes live, per release (DESIGN.md's hook table).

From 0.20 to 0.33 the ``...kv_connector.v1.nixl`` package's ``__init__`` imports every
connector and worker class, so a post-import hook on the package sees them all. The
classes that *define* the hooked methods moved in 0.24 (pull and push now share
``NixlBaseConnector`` / ``NixlBaseConnectorWorker``), which is why hooks are placed on
the defining class, found through the MRO, never on an alias such as ``NixlConnector``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"

CONNECTOR_NAMES = ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "NixlBaseConnector")
WORKER_NAMES = (
    "NixlConnectorWorker",
    "NixlPullConnectorWorker",
    "NixlPushConnectorWorker",
    "NixlBaseConnectorWorker",
)


def nixl_package() -> ModuleType:
    return importlib.import_module(NIXL_PACKAGE)


def _classes(names: tuple[str, ...]) -> list[type]:
    package = nixl_package()
    found = []
    for name in names:
        cls = getattr(package, name, None)
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return found


def connector_classes() -> list[type]:
    return _classes(CONNECTOR_NAMES)


def worker_classes() -> list[type]:
    return _classes(WORKER_NAMES)


def is_nixl_class(cls: type) -> bool:
    return cls.__module__.startswith(NIXL_PACKAGE)


def nixl_owners(classes: list[type], attr: str, base_most: bool = False) -> list[type]:
    """NIXL classes that define ``attr`` for the given classes.

    ``base_most=False``: the nearest definition in each MRO (what a call resolves to).
    ``base_most=True``: the deepest NIXL definition in each MRO, i.e. the implementation
    that subclasses reach through ``super()``.
    """
    owners: list[type] = []
    for cls in classes:
        defining = [k for k in cls.__mro__ if attr in vars(k) and is_nixl_class(k)]
        if not defining:
            continue
        owner = defining[-1] if base_most else defining[0]
        if owner not in owners:
            owners.append(owner)
    return owners


def is_nixl_connector(connector_cls: type) -> bool:
    """True for vLLM's NIXL connectors, subclasses of them, and kvcached-pd's connector
    (which composes vLLM's NixlConnector)."""
    return (any(is_nixl_class(k) for k in connector_cls.__mro__)
            or connector_cls.__module__.startswith("kvcached_pd.connector"))
