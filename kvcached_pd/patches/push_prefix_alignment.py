"""Push mode: P's blocks go to D's new blocks end-aligned, as pull mode reads them.

When D finds a prompt's first blocks in its own prefix cache, its push registration
lists only the blocks it still needs: the prompt's *last* ones. vLLM's pull path READs
P's last blocks for them (``_apply_prefix_caching`` end-trims); vLLM's push path
(``NixlPushConnectorWorker._xfer_blocks``, 0.26-0.28) instead keeps P's *first*
blocks ("Align per-group block counts for push"), so D gets the prefix's KV where the
rest of the prompt belongs and decodes wrong text. Measured on the 2 x H200 host with
prefix caching on: vanilla vLLM push differed from the reference at the first token
of the shared-prefix prompt, every other mode byte-identical
(``experiments/results/2026-11-22-h200x2/``).

The hook trims P's list to its last blocks before vLLM's alignment sees it, for
full-attention groups (Mamba state is not per token; those groups are left as vLLM
has them). With kvcached-pd's staged push the extent carries every token and D
unpacks from the right one, so this only matters for vLLM's per-block WRITE.

Fail-closed: without it, prefix caching on D would serve wrong text in push mode.
"""

from __future__ import annotations

import functools
import logging

from kvcached_pd import vllm_nixl
from kvcached_pd.patches.base import Patch, defining_class
from kvcached_pd.versions import VersionRange

logger = logging.getLogger("kvcached_pd")

ATTR = "_xfer_blocks_for_req"


def end_aligned(local: list, remote: list) -> list:
    """P's block list per group, cut to its last ``len(remote[g])`` blocks where D
    registered fewer (D holds the prompt's first blocks already)."""
    out = []
    for g, ids in enumerate(local):
        want = len(remote[g]) if g < len(remote) else len(ids)
        out.append(list(ids)[len(ids) - want:] if 0 < want < len(ids) else list(ids))
    return out


def _make_hook(original):
    @functools.wraps(original)
    def _xfer_blocks_for_req(self, req_id, meta):
        remote = getattr(meta.remote, "block_ids", None)
        if remote and not getattr(self, "_has_mamba", False):
            local = end_aligned(list(meta.local_block_ids), list(remote))
            if [len(g) for g in local] != [len(g) for g in meta.local_block_ids]:
                logger.debug("kvcached-pd: push %s: D holds %s prefix blocks already; "
                             "writing P's last blocks", req_id,
                             [len(a) - len(b) for a, b in zip(meta.local_block_ids, local)])
                meta.local_block_ids = local
                meta.local_physical_block_ids = self._logical_to_kernel_block_ids(
                    local, self._physical_blocks_per_logical_kv_block)
        return original(self, req_id, meta)

    return _xfer_blocks_for_req


class PushPrefixAlignmentPatch(Patch):
    name = "push_prefix_alignment"
    summary = "push mode writes P's last blocks into D's new blocks (D prefix-cache hits)"
    target_module = vllm_nixl.NIXL_PACKAGE
    vllm_range = VersionRange("0.26", "0.29")  # the push worker this was read against
    fail_closed = True

    def _apply(self) -> None:
        package = vllm_nixl.nixl_package()
        worker_cls = getattr(package, "NixlPushConnectorWorker", None)
        if worker_cls is None or not hasattr(worker_cls, ATTR):
            raise AttributeError(f"no NixlPushConnectorWorker.{ATTR} in {vllm_nixl.NIXL_PACKAGE}")
        owner = defining_class(worker_cls, ATTR)
        self._replace(owner, ATTR, _make_hook(vars(owner)[ATTR]))
