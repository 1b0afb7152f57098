"""NIXL registers and describes only the physical budget of kvcached's KV tensors.

kvcached's tensors span a virtual reservation sized for the whole GPU (e.g. 286 272
blocks on an H200) while vLLM's scheduler only hands out ids below
``kv_cache_config.num_blocks`` (84 330 there). vLLM's NIXL worker checks the tensors'
block dimension against that budget (``!=`` up to 0.28, ``<`` from 0.30) and, from
0.30, registers the tensors' whole storage. kvcached 0.1.6 answered the check by
raising ``num_blocks`` to the virtual count, which registers and describes the whole
reservation (3.4x the descriptors, and memory that may never be mapped).

Here, instead, ``register_kv_caches`` is handed each kvcached tensor *narrowed* to
the budget along its block dimension (same address, same strides, fewer blocks), so
every version's check passes with vLLM's own ``num_blocks``; and while vLLM registers,
its NIXL wrapper is watched: registered ranges over kvcached memory are clipped to
the bytes those narrowed views cover, and every local descriptor must fall inside
them, or registration stops with an error. Local lists reach NIXL through
``get_xfer_descs`` up to vLLM 0.32 and, from 0.33, as Nx5 strided arrays straight
through ``prep_xfer_dlist``; both are watched, and a strided row is checked over all
the blocks it names. Each check counts what it inspected: a registration of kvcached
memory where the clip or the descriptor check saw nothing (vLLM no longer calling what
they hook, as 0.33 stopped calling ``get_xfer_descs``) stops too.

Refused loudly (never mis-strided): tensors kvcached-pd has no geometry for, a budget
that disagrees with the geometry kvcached created, hybrid/mamba models, head-major
layouts, and kvcached's split-half memory behind blocks-first shapes (vLLM would
read K and V as interleaved within a block): Triton/FlashInfer up to vLLM 0.25 and,
on vLLM 0.23-0.25, FlashAttention too. vLLM describes a peer's blocks from its base
address and page length alone (V = K + page/2), so no narrowing or clipping here can
point its descriptors at a V block kept in the other half.

kvcached's contiguous layout (every layer's block ``b`` in one compound page) cannot be
described by per-block descriptors at all: there NIXL registers none of the KV
(:mod:`kvcached_pd.nixl_kv_guard`), only the staged transport moves it, and startup
stops unless the staged transport serves this worker. ``add_remote_agent`` is hooked
too, so that a kvcached-pd worker can handshake with such a peer.

Fail-closed. Hooked on the deepest NIXL class that defines ``register_kv_caches``
(``NixlConnectorWorker`` up to 0.23, ``NixlBaseConnectorWorker`` from 0.24, which the
push worker reaches through ``super()``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from kvcached_pd import config, nixl_kv_guard, serving, vllm_nixl
from kvcached_pd.errors import LayoutMismatch, UnsupportedConfiguration
from kvcached_pd.kv_spans import (Span, clip_to, descriptor_extents, merge_spans, overlaps,
                                  physical_spans, within)
from kvcached_pd.patches.base import Patch
from kvcached_pd.patches.nixl_layout import HEAD_MAJOR_LAYOUTS
from kvcached_pd.registry import REGISTRY
from kvcached_pd.versions import installed_version
from kvcached_pd.vllm_api import SUPPORTED_VLLM

logger = logging.getLogger("kvcached_pd")

ATTR = "register_kv_caches"


@dataclass
class RegistrationPlan:
    """What vLLM will be asked to register, and which bytes it may cover."""

    kv_caches: dict[str, Any]
    budget_blocks: int
    allowed: list[Span] = field(default_factory=list)  # physical bytes of kvcached tensors
    virtual: list[Span] = field(default_factory=list)  # the whole kvcached reservations
    virtual_blocks: int = 0
    registered: list[Span] = field(default_factory=list)
    num_descs_checked: int = 0  # local descriptor blocks over kvcached memory, checked
    num_reg_rows_clipped: int = 0  # registration rows over kvcached memory, clipped
    interleaved: bool = False  # kvcached's contiguous layout: no per-block descriptor fits
    blocks_dims: dict[str, int] = field(default_factory=dict)


def physical_budget(worker: Any) -> int:
    """Blocks (at kernel granularity) vLLM's scheduler may address in each tensor."""
    ratio = int(getattr(worker, "_physical_blocks_per_logical_kv_block", 1) or 1)
    budget = int(worker.kv_cache_config.num_blocks) * ratio
    if int(worker.num_blocks) != budget:
        raise UnsupportedConfiguration(
            f"NIXL worker num_blocks={worker.num_blocks} differs from the physical budget "
            f"kv_cache_config.num_blocks x {ratio} = {budget}: another patch changed it "
            "(kvcached's own nixl_connector_compat?). kvcached-pd must be the only layer "
            "patching NixlConnector; see `kvcached-pd doctor`."
        )
    return budget


def _is_split_half_blocks_first(t: Any) -> bool:
    """(N, 2, bs, H, D) whose V block does not follow its K block in memory."""
    if t.dim() != 5 or t.shape[1] != 2:
        return False
    return t.stride(1) != math.prod(t.shape[2:])


def plan_registration(worker: Any, kv_caches: dict[str, Any]) -> RegistrationPlan:
    if getattr(worker, "_has_mamba", False):
        raise UnsupportedConfiguration(
            "kvcached-pd cannot describe hybrid/mamba KV caches to NIXL (state tensors "
            "share kvcached pages with attention blocks). Run this model without "
            "ENABLE_KVCACHED, or without a NIXL connector."
        )
    layout = str(getattr(worker, "kv_cache_layout", "NHD") or "NHD").upper()
    if layout in HEAD_MAJOR_LAYOUTS:
        raise UnsupportedConfiguration(
            f"the KV cache layout resolved to {layout}; kvcached tensors are NHD only. "
            "Unset VLLM_KV_CACHE_LAYOUT, or pick an attention backend that runs NHD "
            "(--attention-backend FLASH_ATTN)."
        )
    budget = physical_budget(worker)
    plan = RegistrationPlan(kv_caches={}, budget_blocks=budget)
    for name, cache in kv_caches.items():
        if not hasattr(cache, "data_ptr"):
            raise LayoutMismatch(
                f"layer {name}: KV cache entry of type {type(cache).__name__} is not a "
                "tensor; kvcached-pd registers attention tensors only"
            )
        geometry = REGISTRY.lookup(cache)
        if geometry is None:
            raise LayoutMismatch(
                f"layer {name}: tensor shape={tuple(cache.shape)} stride={tuple(cache.stride())}"
                f" at 0x{cache.data_ptr():x} was not created by kvcached's alloc_kv_cache "
                "as far as kvcached-pd knows, so its physical budget is unknown. Is the "
                "kvcached_alloc patch disabled (KVCACHED_PD_DISABLE)?"
            )
        if geometry.physical_blocks != budget:
            raise LayoutMismatch(
                f"layer {name}: kvcached created it for {geometry.physical_blocks} blocks "
                f"but the NIXL worker's budget is {budget}; refusing to guess which is right"
            )
        if _is_split_half_blocks_first(cache):
            raise LayoutMismatch(
                f"layer {name}: blocks-first shape {tuple(cache.shape)} over kvcached's "
                f"split-half memory (stride {tuple(cache.stride())}), attention backend "
                f"{getattr(worker, 'backend_name', '?')} on vLLM {installed_version('vllm')}: "
                "vLLM's NIXL worker describes each block as K and V halves of one page, "
                "which here would move other blocks' K as V and corrupt them. The direct "
                "transport serves kvcached's split-half memory only behind a K/V-first "
                "shape (FLASH_ATTN up to vLLM 0.22; tested on 0.20) or a packed one "
                "(vLLM >= 0.26); on vLLM 0.23-0.25 every CUDA attention backend, "
                "FLASH_ATTN included, is blocks-first. Use vLLM 0.20-0.22 with FLASH_ATTN, "
                "vLLM >= 0.26, or kvcached's contiguous layout with the staged transport "
                "(kvcached-pd's connector)."
            )
        narrowed = cache.narrow(geometry.blocks_dim, 0, budget)
        plan.kv_caches[name] = narrowed
        plan.blocks_dims[name] = geometry.blocks_dim
        plan.interleaved = plan.interleaved or geometry.interleaves_layers
        plan.allowed.extend(physical_spans(narrowed))
        plan.virtual.extend(physical_spans(cache))
        plan.virtual_blocks = max(plan.virtual_blocks, geometry.virtual_blocks)
    plan.allowed = merge_spans(plan.allowed)
    plan.virtual = merge_spans(plan.virtual)
    return plan


def _is_plain(descs: Any) -> bool:
    """Python-side descriptor data (list of tuples, numpy array), not a NIXL list object.

    NIXL's own ``register_memory``/``initialize_xfer`` call ``get_*_descs`` again with
    the already-built ``nixlRegDList``/``nixlXferDList``; those pass through untouched.
    """
    return isinstance(descs, (list, tuple)) or type(descs).__module__ == "numpy"


def _rows(descs: Any) -> list[tuple]:
    """NIXL descriptor lists come as lists of tuples or N x 3/4 numpy arrays."""
    if hasattr(descs, "tolist"):
        return [tuple(r) for r in descs.tolist()]
    return [tuple(r) for r in descs]


def _clip_registration(descs: Any, plan: RegistrationPlan) -> Any:
    """Rewrite (addr, len, dev, name) rows over kvcached memory to its physical bytes."""
    if not _is_plain(descs):
        return descs
    rows = _rows(descs)
    out = []
    for row in rows:
        addr, length = int(row[0]), int(row[1])
        span = (addr, addr + length)
        if not overlaps(span, plan.virtual):
            out.append(row)
            continue
        pieces = clip_to(span, plan.allowed)
        if not pieces:
            raise LayoutMismatch(
                f"NIXL registration 0x{addr:x}+{length} covers kvcached memory but none "
                "of its physical budget"
            )
        plan.num_reg_rows_clipped += 1
        for s, e in pieces:
            out.append((s, e - s, *row[2:]))
            plan.registered.append((s, e))
    if hasattr(descs, "tolist") and not isinstance(descs, list):
        import numpy as np

        return np.array(out, dtype=descs.dtype) if out else descs[:0]
    return out


def _check_descs(descs: Any, plan: RegistrationPlan) -> None:
    """Every local descriptor into kvcached memory must lie in the physical budget
    (per-block rows, and vLLM 0.33's strided rows over their whole extent)."""
    import numpy as np

    if not _is_plain(descs):
        return
    starts, ends, blocks = descriptor_extents(descs)
    if len(starts) == 0:
        return
    described = ends > starts
    in_virtual = np.zeros(len(starts), dtype=bool)
    for a, b in plan.virtual:
        in_virtual |= (starts < b) & (ends > a)
    in_virtual &= described
    ok = np.zeros(len(starts), dtype=bool)
    for a, b in plan.allowed:
        ok |= (starts >= a) & (ends <= b)
    bad = in_virtual & ~ok
    plan.num_descs_checked += int(blocks[in_virtual].sum())
    if bad.any():
        i = int(np.argmax(bad))
        raise LayoutMismatch(
            f"NIXL descriptor 0x{int(starts[i]):x}..0x{int(ends[i]):x} ({int(blocks[i])} "
            f"block(s)) reaches kvcached memory outside the physical budget of "
            f"{plan.budget_blocks} blocks; refusing to register a layout that would move "
            "the wrong bytes"
        )


@contextlib.contextmanager
def _watch_nixl_wrapper(worker: Any, plan: RegistrationPlan) -> Iterator[None]:
    """While vLLM registers: clip its registration, check its local descriptor lists.

    Local lists reach NIXL two ways: ``get_xfer_descs`` (vLLM up to 0.32 builds the list
    first) and ``prep_xfer_dlist`` given plain rows (vLLM 0.33's Nx5 strided arrays,
    which never pass ``get_xfer_descs``); both are watched, each list checked once
    (NIXL's ``prep_xfer_dlist`` calls ``get_xfer_descs`` itself for plain Nx3 rows)."""
    wrapper = worker.nixl_wrapper
    real_reg = wrapper.get_reg_descs
    real_xfer = wrapper.get_xfer_descs
    real_prep = wrapper.prep_xfer_dlist
    checked_by_prep = []

    def get_reg_descs(descs, *args, **kwargs):
        return real_reg(_clip_registration(descs, plan), *args, **kwargs)

    def get_xfer_descs(descs, *args, **kwargs):
        if not checked_by_prep:
            _check_descs(descs, plan)
        return real_xfer(descs, *args, **kwargs)

    def prep_xfer_dlist(agent_name, descs, *args, **kwargs):
        if agent_name not in nixl_kv_guard.LOCAL_AGENT_NAMES:
            return real_prep(agent_name, descs, *args, **kwargs)
        _check_descs(descs, plan)
        checked_by_prep.append(True)
        try:
            return real_prep(agent_name, descs, *args, **kwargs)
        finally:
            checked_by_prep.pop()

    methods = {"get_reg_descs": get_reg_descs, "get_xfer_descs": get_xfer_descs,
               "prep_xfer_dlist": prep_xfer_dlist}
    with nixl_kv_guard.replace_wrapper_methods(wrapper, **methods):
        yield


def _refuse_if_unchecked(worker: Any, plan: RegistrationPlan) -> None:
    """Fail closed when an armed check inspected nothing: vLLM registered kvcached
    memory but no registration row passed the clip, or no local descriptor passed the
    bounds check. That happens when a vLLM release stops calling the NIXL method a
    check hooks (vLLM 0.33 stopped calling ``get_xfer_descs``: the bounds check saw 0
    descriptors and said nothing); the engine stops here rather than run unchecked.
    Not armed with a host buffer (``kv_buffer_device="cpu"`` on a GPU): NIXL then
    registers and describes vLLM's own host copy, never kvcached memory."""
    if getattr(worker, "use_host_buffer", False):
        return
    unchecked = []
    if plan.num_reg_rows_clipped == 0:
        unchecked.append("the registration clip saw no registration over kvcached memory")
    if plan.num_descs_checked == 0:
        unchecked.append("the descriptor bounds check saw no local descriptor over "
                         "kvcached memory")
    if unchecked:
        raise UnsupportedConfiguration(
            f"kvcached-pd: {'; '.join(unchecked)} while vLLM {installed_version('vllm')} "
            f"registered {len(plan.kv_caches)} kvcached KV tensor(s) (engine "
            f"{getattr(worker, 'engine_id', '?')}): this vLLM's NIXL worker no longer "
            "reaches the NIXL calls kvcached-pd checks, so nothing proves its descriptors "
            "stay inside kvcached's physical budget. Use a vLLM release of the supported "
            "matrix (README), or set KVCACHED_CONTIGUOUS_LAYOUT/ENABLE_KVCACHED off."
        )


def staged_refusal(worker: Any) -> str | None:
    """Why the staged transport will not move this worker's KV, or None if it will.

    It will when kvcached-pd's connector registers the caches of an engine it stages
    (this worker is then its inner NixlConnector or NixlPushConnector, which must never
    move kvcached KV itself): the connector says so around the registration
    (:func:`kvcached_pd.nixl_kv_guard.registering_for_the_connector`)."""
    decision = serving.decide(config.settings(), installed_version("vllm"))
    if not decision.staged_requested:
        return decision.reason
    reason = nixl_kv_guard.why_not_staged()
    if reason is not None:
        return reason
    if getattr(worker, "use_host_buffer", False):
        return "the staged transport does not serve a host buffer"
    return None


def _register_without_kv(worker: Any, original, plan: RegistrationPlan, args, kwargs):
    """kvcached's contiguous layout: vLLM registers stand-ins, NIXL none of the KV."""
    reason = staged_refusal(worker)
    if reason is not None:
        raise UnsupportedConfiguration(
            f"kvcached's contiguous layout ({config.KVCACHED_CONTIGUOUS_LAYOUT} true or "
            "unset) interleaves every layer's blocks, which vLLM's per-block NIXL "
            f"descriptors would read as other layers' bytes; only the staged transport "
            f"can move it, and here {reason}. Set {config.KVCACHED_CONTIGUOUS_LAYOUT}=false."
        )
    guard = nixl_kv_guard.make_guard(plan.kv_caches, plan.blocks_dims)
    setattr(worker, nixl_kv_guard.STATE_ATTR, guard)
    with nixl_kv_guard.registering_without_kv(worker, guard):
        result = original(worker, guard.stand_ins, *args, **kwargs)
    worker.device_kv_caches = plan.kv_caches  # the real caches for all that follows
    nixl_kv_guard.advertise_no_blocks(worker, guard, original.__globals__["NixlAgentMetadata"])
    REGISTRY.note_registration({
        "engine_id": str(getattr(worker, "engine_id", "")),
        "tp_rank": int(getattr(worker, "tp_rank", 0)),
        "budget_blocks": plan.budget_blocks,
        "virtual_blocks": plan.virtual_blocks,
        "registered_bytes": 0,
        "virtual_bytes": sum(e - s for s, e in plan.virtual),
        "num_layers": len(plan.kv_caches),
        "num_descs_checked": 0,
        "kv_registered": False,
    })
    logger.info(
        "kvcached-pd: kvcached's contiguous layout: NIXL registered none of the KV (%d "
        "layers x %d blocks); only the staged transport moves it, direct transfers fail",
        len(plan.kv_caches), plan.budget_blocks,
    )
    return result


def _make_add_remote_agent_hook(original):
    @functools.wraps(original)
    def add_remote_agent(self, nixl_agent_meta, *args, **kwargs):
        with nixl_kv_guard.preparing_peer(self, nixl_agent_meta):
            return original(self, nixl_agent_meta, *args, **kwargs)

    return add_remote_agent


def _make_register_hook(original):
    @functools.wraps(original)
    def register_kv_caches(self, kv_caches, *args, **kwargs):
        if not config.settings().kvcached_enabled:
            return original(self, kv_caches, *args, **kwargs)
        plan = plan_registration(self, kv_caches)
        if plan.interleaved:
            return _register_without_kv(self, original, plan, args, kwargs)
        with _watch_nixl_wrapper(self, plan):
            result = original(self, plan.kv_caches, *args, **kwargs)
        _refuse_if_unchecked(self, plan)
        registered = merge_spans(plan.registered)
        record = {
            "engine_id": str(getattr(self, "engine_id", "")),
            "tp_rank": int(getattr(self, "tp_rank", 0)),
            "budget_blocks": plan.budget_blocks,
            "virtual_blocks": plan.virtual_blocks,
            "registered_bytes": sum(e - s for s, e in registered),
            "virtual_bytes": sum(e - s for s, e in plan.virtual),
            "num_layers": len(plan.kv_caches),
            "num_descs_checked": plan.num_descs_checked,
        }
        REGISTRY.note_registration(record)
        logger.info(
            "kvcached-pd: NIXL registered the physical budget: %d of %d virtual blocks, "
            "%.1f of %.1f MiB, %d local descriptors checked",
            plan.budget_blocks,
            plan.virtual_blocks,
            record["registered_bytes"] / 2**20,
            record["virtual_bytes"] / 2**20,
            plan.num_descs_checked,
        )
        return result

    return register_kv_caches


class NixlRegistrationPatch(Patch):
    name = "nixl_registration"
    summary = "NIXL registers kvcached tensors' physical budget (kv_cache_config.num_blocks), not the virtual reservation"
    target_module = vllm_nixl.NIXL_PACKAGE
    vllm_range = SUPPORTED_VLLM
    fail_closed = True

    def _apply(self) -> None:
        owners = vllm_nixl.nixl_owners(vllm_nixl.worker_classes(), ATTR, base_most=True)
        if not owners:
            raise AttributeError(f"no NIXL worker class in {vllm_nixl.NIXL_PACKAGE} defines {ATTR}")
        for owner in owners:
            self._replace(owner, ATTR, _make_register_hook(vars(owner)[ATTR]))
        for owner in vllm_nixl.nixl_owners(vllm_nixl.worker_classes(), "add_remote_agent",
                                           base_most=True):
            self._replace(owner, "add_remote_agent",
                          _make_add_remote_agent_hook(vars(owner)["add_remote_agent"]))
