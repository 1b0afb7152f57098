"""Test-only negative control: the decode side damages KV it just received.

With ``KVCACHED_PD_TEST_CORRUPT=1`` (and only then), each time the decode side's pull
worker reports a request's KV as received, the first received block of every layer is
negated in place; on kvcached-pd's connector, every KV byte of a staged extent is
inverted after its READ and before it is scattered into the KV blocks (its tag is left
as it came, so the load goes on with wrong KV rather than failing the tag check). The
equivalence harness runs a mode with this switch and must
report a difference; if it does not, the harness cannot tell a broken transfer from
a good one and its other verdicts mean nothing.

Never enabled by default; it lives outside the product's patch table and activation
arms it only when the switch is set (``kvcached_pd.testing.armed``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from kvcached_pd import vllm_nixl
from kvcached_pd.patches.base import Patch
from kvcached_pd.vllm_api import SUPPORTED_VLLM

logger = logging.getLogger("kvcached_pd")

ATTR = "get_finished"


def _first_block_id(local_block_ids: Any) -> int | None:
    ids = local_block_ids
    while isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]  # one list per KV-cache group: take the first group's
    return int(ids[0]) if ids else None


def corrupt_block(worker: Any, block_id: int) -> int:
    """Negate kernel block ``block_id`` in every registered layer; returns layers hit."""
    ratio = int(getattr(worker, "_physical_blocks_per_logical_kv_block", 1) or 1)
    kernel_block = block_id * ratio
    hit = 0
    for cache in getattr(worker, "device_kv_caches", {}).values():
        dims = [d for d in range(cache.dim()) if cache.shape[d] == worker.num_blocks]
        if not dims:
            continue
        cache.narrow(dims[0], kernel_block, 1).neg_()
        hit += 1
    return hit


def _make_hook(original):
    @functools.wraps(original)
    def get_finished(self, *args, **kwargs):
        pending = dict(getattr(self, "_recving_metadata", {}) or {})
        done_sending, done_recving = original(self, *args, **kwargs)
        for req_id in done_recving or ():
            meta = pending.get(req_id)
            block = _first_block_id(getattr(meta, "local_block_ids", None)) if meta else None
            if block is not None:
                layers = corrupt_block(self, block)
                logger.warning(
                    "kvcached-pd TEST: corrupted block %d of %d layers for request %s "
                    "(KVCACHED_PD_TEST_CORRUPT=1)", block, layers, req_id,
                )
        return done_sending, done_recving

    return get_finished


def _make_unpack_hook(original):
    @functools.wraps(original)
    def _unpack(self, req_id, read, *args, **kwargs):
        # the KV bytes the unpack reads, on either wire (D's staging or P's), less the tag;
        # with a prefix hit on D the source is the extent's tail only (read.window), and
        # slicing it by the whole extent's size would invert the tag: a refused load,
        # not the wrong text the harness must detect
        from kvcached_pd.transport.format import TAG_BYTES  # torch: only once armed

        source = self._source(read)
        view = source[: source.numel() - TAG_BYTES]
        view.bitwise_not_()
        logger.warning("kvcached-pd TEST: inverted the %d bytes of request %s's staged extent "
                       "(KVCACHED_PD_TEST_CORRUPT=1)", view.numel(), req_id)
        return original(self, req_id, read, *args, **kwargs)

    return _unpack


class CorruptReceivedKVPatch(Patch):
    name = "corrupt_received_kv"
    summary = "TEST ONLY (KVCACHED_PD_TEST_CORRUPT=1): negate the first received KV block"
    target_module = vllm_nixl.NIXL_PACKAGE
    vllm_range = SUPPORTED_VLLM
    fail_closed = True

    def _apply(self) -> None:
        package = vllm_nixl.nixl_package()
        owners = vllm_nixl.nixl_owners([package.NixlConnectorWorker], ATTR)
        if not owners:
            raise AttributeError("NixlConnectorWorker has no get_finished")
        for owner in owners:
            self._replace(owner, ATTR, _make_hook(vars(owner)[ATTR]))
        from kvcached_pd.connector.decode_worker import DecodeWorker

        self._replace(DecodeWorker, "_unpack", _make_unpack_hook(vars(DecodeWorker)["_unpack"]))
