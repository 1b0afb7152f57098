"""Route ``"kv_connector": "NixlConnector"`` (and ``NixlPushConnector``) to kvcached-pd's connector.

With kvcached-pd active and the staged transport chosen, the operator's command line
does not change: vLLM's connector factory resolves the NIXL names of this release
(``vllm_api.VllmApi.pull_names``: ``NixlConnector``, and ``NixlPullConnector`` where
vLLM has it; ``push_name``: ``NixlPushConnector`` on 0.24+) to
:class:`kvcached_pd.connector.KvcachedPDConnector`, which composes vLLM's connector of
that name for every peer it cannot stage. The connector can
also be named directly (``kv_connector_module_path="kvcached_pd.connector"``,
``kv_connector="KvcachedPDConnector"``); routing is then a no-op.

The factory keeps one loader per registered name (``KVConnectorFactory._registry``,
the same dict on every release of ``vllm_api.RELEASES``; ``register_connector`` refuses names already
there): the patch installs a copy whose pull names load kvcached-pd's connector, and
``unpatch`` puts vLLM's dict back (keeping names registered meanwhile). The inner connector is imported from
vLLM's NIXL package directly, never through the factory, so routing cannot recurse.

Fail-closed: P and D must agree on the data path; a half-applied routing would leave
one side staging for a peer that never reads, so a failure stops startup.
"""

from __future__ import annotations

import importlib

from kvcached_pd import serving, vllm_api
from kvcached_pd.patches.base import Patch
from kvcached_pd.versions import installed_version

ROUTED_RANGE = vllm_api.SUPPORTED_VLLM  # every release of vllm_api.RELEASES


def _loader():
    from kvcached_pd.connector import KvcachedPDConnector

    return KvcachedPDConnector


class ConnectorRoutingPatch(Patch):
    name = serving.ROUTING
    summary = ("KVCACHED_PD_TRANSPORT=staged: vLLM's factory builds KvcachedPDConnector for "
               "the NIXL names, pull and push (it composes vLLM's connector of that name "
               "for plain peers)")
    target_module = vllm_api.FACTORY_MODULE
    vllm_range = ROUTED_RANGE
    fail_closed = True

    def applies(self, vllm_version: str | None = None) -> tuple[bool, str]:
        """Whether the factory should build kvcached-pd's connector for the NIXL names:
        the decision's ``routed``, then this vLLM's range."""
        decision = serving.decide(self.settings, vllm_version or installed_version("vllm"))
        if not decision.routed:
            return False, decision.routing_reason
        return super().applies(vllm_version)

    def _apply(self) -> None:
        factory = importlib.import_module(vllm_api.FACTORY_MODULE).KVConnectorFactory
        registry = vars(factory)["_registry"]
        names = vllm_api.current().nixl_names
        missing = [n for n in names if n not in registry]
        if missing:
            raise KeyError(f"vLLM's connector factory has no {missing}; known: "
                           f"{sorted(registry)}")
        routed = dict(registry)
        routed.update({name: _loader for name in names})
        self._replace(factory, "_registry", routed)

    def _undo(self) -> None:
        # Connectors registered while routed (plugins) stay registered.
        for rep in self._replacements:
            if rep.attr == "_registry" and vars(rep.owner).get("_registry") is rep.installed:
                for name, loader in rep.installed.items():
                    if loader is not _loader:
                        rep.original.setdefault(name, loader)
        super()._undo()
