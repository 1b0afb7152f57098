"""What moves this engine's KV, and why: one decision, made once from the settings.

Three data paths can serve a NIXL ``kv_connector`` (the *transport*):

* ``staged``: kvcached-pd's connector packs a request's KV into a staging extent on P
  and D takes it from there (``kvcached_pd.connector``);
* ``direct``: vLLM's own NIXL connector moves KV by its per-block descriptors, over the
  physical budget the registration patch leaves it;
* ``vLLM's own``: kvcached-pd is off, or the connector is not a NIXL one it serves.

Which one serves follows from the settings (the gate, ``KVCACHED_PD_TRANSPORT``,
``connector_routing`` in ``KVCACHED_PD_DISABLE``), vLLM's release
(:data:`kvcached_pd.vllm_api.RELEASES`) and the ``kv_connector`` name. :func:`decide`
is the only code that works it out; the connector, the startup guard and its checks,
the doctor, the routing, metrics and registration patches and the start-up log line
read its :class:`Serving`, so none of them can tell the operator one path while another
serves. The connector may still decline an engine the decision stages, for what only
the engine's configs say (TP > 1, a host buffer, its KV-cache groups): it says why.

The *wire* is the same answer's second half, at engine level: ``KVCACHED_PD_WIRE``'s
policy for how D takes a staged extent from a P. The choice for one P (CUDA IPC or a
NIXL READ) is made at that P's handshake, under this policy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvcached_pd import config, vllm_api

STAGED = "staged"
DIRECT = "direct"
VLLM_OWN = "vLLM's own"
# The patch that makes vLLM's NIXL connector names build kvcached-pd's connector; named
# here because whether it is disabled decides what those names serve.
ROUTING = "connector_routing"

_WIRE_REASONS = {
    "auto": "per peer at its handshake: CUDA IPC for a P on this host whose staging this "
            "process can open (same GPU, or one it can peer with), a NIXL READ otherwise",
    "nixl": f"{config.KVCACHED_PD_WIRE}=nixl: every staged extent by a NIXL READ into D's "
            "staging",
    "ipc": f"{config.KVCACHED_PD_WIRE}=ipc: CUDA IPC only; a peer this process cannot open "
           "fails its requests' loads, never takes NIXL",
}


@dataclass(frozen=True)
class Serving:
    """The transport that serves one ``kv_connector`` name in this process, the wire
    policy under it, and why, each reason one clause an operator can act on."""

    transport: str  # STAGED, DIRECT or VLLM_OWN
    reason: str
    requested: str  # KVCACHED_PD_TRANSPORT as parsed (defaulted: staged with kvcached)
    requested_by_name: bool  # KVCACHED_PD_TRANSPORT was set, not defaulted
    active: bool  # kvcached-pd's gate
    routed: bool  # vLLM's NIXL connector names build kvcached-pd's connector
    routing_reason: str
    wire: str  # KVCACHED_PD_WIRE: auto, nixl or ipc
    wire_reason: str
    connector: str | None  # the kv_connector decided for; None: vLLM's NIXL names

    @property
    def staged(self) -> bool:
        return self.transport == STAGED

    @property
    def staged_requested(self) -> bool:
        """kvcached-pd is on with the staged transport chosen, by default or by name."""
        return self.active and self.requested == STAGED

    @property
    def falls_short(self) -> bool:
        """The staged transport was chosen but another path moves this connector's KV."""
        return self.staged_requested and not self.staged

    def summary(self) -> str:
        """``transport X (why); wire Y (why)``: the doctor's and the start-up log's words."""
        return f"{self.transport} ({self.reason}); wire {self.wire} ({self.wire_reason})"


@functools.lru_cache(maxsize=64)
def decide(settings: config.Settings, vllm_version: str | None,
           connector: str | None = None) -> Serving:
    """What serves ``connector`` (None: vLLM's NIXL names, as an operator writes them)
    under ``settings`` on vLLM ``vllm_version``, and why.

    A pure function of its arguments, kept per process: every consumer asking about
    the same settings, release and name gets the same object.

    The NIXL names of each release (pull on 0.20-0.33, push on 0.24-0.33) build
    kvcached-pd's connector while ``connector_routing`` is on, and it can be named
    itself; with the routing disabled those names build vLLM's own connectors (the
    direct path). Elsewhere a requested ``staged`` means vLLM's own per-block path too.
    """
    routed, routing_reason = _routing(settings)
    transport, reason = _transport(settings, vllm_version, connector)
    wire_reason = (_WIRE_REASONS[settings.wire] if transport == STAGED
                   else "unused: no staged extent moves here")
    return Serving(transport=transport, reason=reason, requested=settings.transport,
                   requested_by_name=settings.transport_explicit, active=settings.active,
                   routed=routed, routing_reason=routing_reason, wire=settings.wire,
                   wire_reason=wire_reason, connector=connector)


def _routing(settings: config.Settings) -> tuple[bool, str]:
    if not settings.active:
        return False, "kvcached-pd is not active"
    if settings.transport != STAGED:
        return False, f"{config.KVCACHED_PD_TRANSPORT} is not 'staged'"
    if ROUTING in settings.disabled_patches:
        return False, f"{ROUTING} is disabled by {config.KVCACHED_PD_DISABLE}"
    return True, "the staged transport is chosen"


def _transport(settings: config.Settings, vllm_version: str | None,
               connector: str | None) -> tuple[str, str]:
    if not settings.active:
        return VLLM_OWN, f"kvcached-pd is not active ({settings.gate_reason})"
    if settings.transport != STAGED:
        return DIRECT, f"{config.KVCACHED_PD_TRANSPORT}={settings.transport}"
    try:
        api = vllm_api.api_for(vllm_version) if vllm_version else None
    except ValueError:
        api = None
    if api is None:
        return DIRECT, (f"kvcached-pd's connector knows vLLM {vllm_api.SUPPORTED} only; "
                        f"vLLM here: {vllm_version or 'not installed'}")
    if connector is not None and connector not in api.nixl_names + (vllm_api.CONNECTOR_CLASS,):
        return VLLM_OWN, f"kv_connector {connector} is not a NIXL connector kvcached-pd serves"
    if connector != vllm_api.CONNECTOR_CLASS and ROUTING in settings.disabled_patches:
        return DIRECT, (f"{ROUTING} is disabled by {config.KVCACHED_PD_DISABLE}, so vLLM's "
                        "NIXL connector names build vLLM's own connectors, which move KV by "
                        "per-block descriptors")
    push = f"{api.push_name} (push) too" if api.push_name else "this vLLM has no push mode"
    return STAGED, (f"vLLM {vllm_version}: {', '.join(api.pull_names)} (pull) build "
                    f"kvcached-pd's {vllm_api.CONNECTOR_CLASS}; {push}; TP>1 and peers "
                    "without kvcached-pd take vLLM's own connector inside it, and it says so")
