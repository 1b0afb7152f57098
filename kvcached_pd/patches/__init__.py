"""The patch table: every runtime change kvcached-pd makes, in the order applied.

Each entry is one module with ``patch()``, ``unpatch()``, ``is_patched()`` and its
vLLM range; activation only walks this table. Order matters where two hooks fire on
the same import: kvcached's own NIXL patch is neutralised before kvcached-pd's NIXL
hooks go in. Test-only patches live in ``kvcached_pd.testing``, not here.
"""

from __future__ import annotations

from kvcached_pd.patches.base import Patch
from kvcached_pd.patches.connector_guard import ConnectorGuardPatch
from kvcached_pd.patches.connector_metrics import ConnectorMetricsPatch
from kvcached_pd.patches.connector_routing import ConnectorRoutingPatch
from kvcached_pd.patches.kvcached_alloc import KvcachedAllocPatch, KvcachedMrv2AllocPatch
from kvcached_pd.patches.kvcached_coexistence import KvcachedCoexistencePatch
from kvcached_pd.patches.nixl_handshake_join import NixlHandshakeJoinPatch
from kvcached_pd.patches.nixl_layout import NixlLayoutPatch
from kvcached_pd.patches.nixl_registration import NixlRegistrationPatch
from kvcached_pd.patches.prompt_tail_graph import PromptTailGraphPatch
from kvcached_pd.patches.push_prefix_alignment import PushPrefixAlignmentPatch

PATCHES: tuple[Patch, ...] = (
    KvcachedCoexistencePatch(),
    ConnectorGuardPatch(),
    ConnectorRoutingPatch(),  # pull and push: vLLM's factory builds kvcached-pd's connector
    KvcachedAllocPatch(),
    KvcachedMrv2AllocPatch(),
    NixlLayoutPatch(),
    NixlRegistrationPatch(),
    NixlHandshakeJoinPatch(),  # vLLM 0.20-0.30 pull reads (plain, and inside kvcached-pd's)
    PushPrefixAlignmentPatch(),  # vLLM's own per-block push (plain peers, direct transport)
    ConnectorMetricsPatch(),
    PromptTailGraphPatch(),  # vLLM 0.30 Model Runner V2: D's first forwards in the decode graph
)

PATCH_NAMES = frozenset(p.name for p in PATCHES)


def get_patch(name: str) -> Patch:
    for patch in PATCHES:
        if patch.name == name:
            return patch
    raise KeyError(f"unknown patch {name!r}; known: {sorted(PATCH_NAMES)}")
