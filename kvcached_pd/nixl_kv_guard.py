"""NIXL registers none of a worker's KV when kvcached's contiguous layout backs it.

kvcached's contiguous layout (its default on CUDA) puts every layer's block ``b`` side by
side in one compound page, so one layer's consecutive blocks lie ``layers x block``
bytes apart. vLLM's NIXL worker describes block ``b`` of a layer as
``base + b * block_len`` (per layer; or, for views sharing one storage, vLLM 0.26's
packed path with a block stride of the storage's bytes / ``num_blocks``, which over
kvcached's virtual reservation is wrong too): a per-block READ or WRITE would move
other layers' bytes. The staged transport reads and writes that memory only locally,
through strided views, and moves just its staging region over NIXL. So nothing of the
KV is registered, and the direct path fails in NIXL instead of moving wrong bytes:

- vLLM's ``register_kv_caches`` is handed *stand-ins*: per layer, one block of ordinary
  memory viewed with the cache's shape and a block stride of 0, each its own storage
  (so vLLM takes its per-layer path and advertises the per-layer block lengths a
  non-contiguous peer expects). vLLM only reads their address, shape and device.
- while it registers, the registration it asks for is replaced by one 4 KiB *guard*
  buffer, and every local descriptor list it prepares by one 1-byte descriptor there;
- its handshake advertises ``num_blocks = 0`` and the guard as every region's base;
  afterwards ``device_kv_caches`` holds the real caches again for everything else.

A peer without kvcached-pd then prepares an empty descriptor list for our blocks and
its handshake fails (NIXL refuses an empty list). A kvcached-pd peer prepares the
guard's one byte instead (:func:`preparing_peer`), so its handshake (and the staged
transport's) succeeds, and NIXL rejects every per-block request before moving a byte
(``NIXL_ERR_INVALID_PARAM``: block index out of range, or a length mismatch), which
vLLM handles as a failed transfer. Checked against real NIXL, through kvcached-pd's
connector, in tests/test_connector_kvcached_layouts.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Iterator

from kvcached_pd.errors import UnsupportedConfiguration

logger = logging.getLogger("kvcached_pd")

GUARD_BYTES = 4096
LOCAL_AGENT = "NIXL_INIT_AGENT"  # the name NIXL's prep_xfer_dlist takes for local lists
LOCAL_AGENT_NAMES = (LOCAL_AGENT, "")  # NIXL reads "" as NIXL_INIT_AGENT too
STATE_ATTR = "_kvcached_pd_kv_guard"

# Why the staged path does not move the KV being registered; None while kvcached-pd's
# connector registers the caches of an engine it stages (its inner NIXL connector's
# registration, which the registration patch sees).
NOT_THE_CONNECTOR = ("vLLM's own NIXL connector registers it, not kvcached-pd's connector "
                     "(the connector_routing patch builds KvcachedPDConnector for vLLM's NIXL "
                     "connector names; is it named in KVCACHED_PD_DISABLE?)")
_why_not_staged: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvcached_pd_why_not_staged", default=NOT_THE_CONNECTOR)


@contextlib.contextmanager
def registering_for_the_connector(why_not_staged: str | None) -> Iterator[None]:
    """Around the inner connector's ``register_kv_caches``, by kvcached-pd's connector:
    ``why_not_staged`` is None when its staged path moves this engine's KV, else the
    reason it does not (TP > 1, another KV-cache group, ...)."""
    token = _why_not_staged.set(why_not_staged)
    try:
        yield
    finally:
        _why_not_staged.reset(token)


def why_not_staged() -> str | None:
    """None when the caches being registered are moved by the staged path only."""
    return _why_not_staged.get()


def _is_plain(descs: Any) -> bool:
    """Descriptor rows from vLLM (list or numpy array), not the NIXL list objects that
    NIXL's own register_memory/prep calls pass back through the same methods."""
    return isinstance(descs, (list, tuple)) or type(descs).__module__ == "numpy"


@dataclass
class KVGuard:
    """What stands in for a worker's unregistered KV (kept alive with the worker)."""

    tensor: Any  # GUARD_BYTES of ordinary memory, registered with NIXL instead of the KV
    device_id: int
    stand_ins: dict[str, Any]
    # local descriptor lists vLLM prepared that were replaced by the guard's byte: the
    # proof that the substitution ran (registering_without_kv refuses 0)
    local_preps_replaced: int = 0

    @property
    def ptr(self) -> int:
        return int(self.tensor.data_ptr())


def make_guard(kv_caches: dict[str, Any], blocks_dims: dict[str, int]) -> KVGuard:
    """The guard buffer and one stand-in per cache (``blocks_dims``: each cache's
    block dimension).

    A stand-in has the cache's shape and dtype over one block's memory: the block axis
    has stride 0. Except where the block axis comes first (kvcached's contiguous layout
    under vLLM 0.29+'s Model Runner V2: blocks-first views, every layer's page in each
    block): vLLM 0.30's registration takes a view's ``stride(0)`` as its block stride
    and divides by it, so a zero there stopped every EngineCore at start-up on the GPU
    host (ZeroDivisionError). There the block axis gets a one-element stride over a
    buffer of one element per block, and the other axes stride 0: vLLM reads that as
    block-major storage of one-element blocks (a few hundred KiB, never the KV)."""
    import torch

    first = next(iter(kv_caches.values()))
    guard = torch.zeros(GUARD_BYTES, dtype=torch.uint8, device=first.device)
    stand_ins = {}
    for name, cache in kv_caches.items():
        dim = blocks_dims[name]
        if dim == 0:
            strides = [1] + [0] * (cache.dim() - 1)
        else:
            strides = list(cache.stride())
            strides[dim] = 0
        span = 1 + sum((n - 1) * s for n, s in zip(cache.shape, strides))
        memory = torch.zeros(span, dtype=cache.dtype, device=cache.device)
        stand_ins[name] = torch.as_strided(memory, tuple(cache.shape), tuple(strides))
    return KVGuard(tensor=guard, device_id=max(first.get_device(), 0), stand_ins=stand_ins)


@contextlib.contextmanager
def replace_wrapper_methods(wrapper: Any, **methods: Any) -> Iterator[None]:
    originals = {name: getattr(wrapper, name) for name in methods}
    for name, method in methods.items():
        setattr(wrapper, name, method)
    try:
        yield
    finally:
        for name, real in originals.items():
            try:
                del wrapper.__dict__[name]
            except (KeyError, AttributeError, TypeError):
                setattr(wrapper, name, real)


def _guard_local_preps(worker: Any, guard: KVGuard, wrapper: Any) -> dict[str, Any]:
    real_prep, real_xfer = wrapper.prep_xfer_dlist, wrapper.get_xfer_descs

    def prep_xfer_dlist(agent_name, descs, *args, **kwargs):
        if agent_name in LOCAL_AGENT_NAMES:  # a list over this worker's KV: the guard's byte
            descs = real_xfer([(guard.ptr, 1, guard.device_id)], worker.nixl_memory_type)
            kwargs.pop("mem_type", None)  # an Nx5 list brought its own; the list has one
            guard.local_preps_replaced += 1
        return real_prep(agent_name, descs, *args, **kwargs)

    return {"prep_xfer_dlist": prep_xfer_dlist}


@contextlib.contextmanager
def registering_without_kv(worker: Any, guard: KVGuard) -> Iterator[None]:
    """While vLLM registers the stand-ins: NIXL registers the guard, local lists are the
    guard's byte."""
    wrapper = worker.nixl_wrapper
    real_reg = wrapper.get_reg_descs

    def get_reg_descs(descs, *args, **kwargs):
        if _is_plain(descs):  # vLLM's KV regions: the guard instead
            descs = [(guard.ptr, GUARD_BYTES, guard.device_id, "")]
        return real_reg(descs, *args, **kwargs)

    before = guard.local_preps_replaced
    with _refused_unless(lambda: guard.local_preps_replaced > before, (
            "kvcached-pd: vLLM registered kvcached's contiguous layout but prepared no local "
            "descriptor list through NIXL's prep_xfer_dlist, so the guard that keeps its "
            "per-block lists off the KV never ran; refusing to start unguarded")), \
            replace_wrapper_methods(wrapper, get_reg_descs=get_reg_descs,
                                    **_guard_local_preps(worker, guard, wrapper)):
        yield


@contextlib.contextmanager
def _refused_unless(ran, message: str) -> Iterator[None]:
    """Fail closed when an armed guard inspected nothing (``ran()`` false afterwards):
    a vLLM release that stops calling the NIXL method a guard hooks. NIXL usually fails
    too then (NIXL_ERR_NOT_FOUND over unregistered or empty lists, as vLLM 0.33's
    handshake did before its strided lists were guarded): that error becomes the cause
    of this one, which says which guard did not run."""
    try:
        yield
    except Exception as exc:
        # NIXL's own refusal of the unguarded list; anything else vLLM raised before
        # reaching the list (a layout it refuses, ...) is its own, more precise, error
        if not ran() and _raised_by_nixl(exc):
            raise UnsupportedConfiguration(message) from exc
        raise
    if not ran():
        raise UnsupportedConfiguration(message)


def _raised_by_nixl(exc: BaseException) -> bool:
    """An error of NIXL's (its bindings' types), or one raised inside NIXL's Python API
    (NIXL 1.5's ``get_xfer_descs`` indexes an empty list: IndexError)."""
    if type(exc).__module__.split(".")[0].startswith("nixl"):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return module.split(".")[0].startswith("nixl")


def advertise_no_blocks(worker: Any, guard: KVGuard, meta_cls: type) -> None:
    """Rewrite the handshake vLLM built: 0 blocks, the guard as every region's base.

    vLLM 0.30 also advertises each region's block count (``region_num_blocks``) and a
    peer builds its remote list from those when present: left at the budget, every
    peer's handshake failed (NIXL_ERR_NOT_FOUND: descriptors beyond the guard) on the
    GPU host, so they are 0 too."""
    import dataclasses

    import msgspec

    payload = worker.xfer_handshake_metadata
    meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=meta_cls)
    changes = {"num_blocks": 0, "kv_caches_base_addr": [guard.ptr] * len(meta.kv_caches_base_addr)}
    if getattr(meta, "region_num_blocks", None):
        changes["region_num_blocks"] = [0] * len(meta.region_num_blocks)
    if dataclasses.is_dataclass(meta):
        meta = dataclasses.replace(meta, **changes)
    else:
        meta = msgspec.structs.replace(meta, **changes)
    worker.xfer_handshake_metadata = type(payload)(
        compatibility_hash=payload.compatibility_hash,
        agent_metadata_bytes=msgspec.msgpack.Encoder().encode(meta),
    )


def peer_has_no_blocks(nixl_agent_meta: Any) -> bool:
    """A peer whose KV is not registered (advertised by :func:`advertise_no_blocks`)."""
    return int(getattr(nixl_agent_meta, "num_blocks", 1)) == 0


@contextlib.contextmanager
def preparing_peer(worker: Any, nixl_agent_meta: Any) -> Iterator[None]:
    """Around vLLM's ``add_remote_agent``: a peer with no registered KV gets its guard
    byte as the (one-descriptor) remote list; if this worker's own KV is unregistered,
    the local lists vLLM prepares here (other block sizes, TP splits) are its guard."""
    wrapper = getattr(worker, "nixl_wrapper", None)
    own = vars(worker).get(STATE_ATTR) if hasattr(worker, "__dict__") else None
    peer_empty = peer_has_no_blocks(nixl_agent_meta)
    if wrapper is None or (own is None and not peer_empty):
        yield
        return
    methods: dict[str, Any] = {}
    replaced: list[int] = []
    if peer_empty:
        real_xfer, real_prep = wrapper.get_xfer_descs, wrapper.prep_xfer_dlist
        remote = (int(nixl_agent_meta.kv_caches_base_addr[0]), 1, int(nixl_agent_meta.device_id))

        def get_xfer_descs(descs, *args, **kwargs):
            if _is_plain(descs) and len(descs) == 0:  # the peer's 0 blocks: its guard byte
                descs = [remote]
                replaced.append(1)
            return real_xfer(descs, *args, **kwargs)

        def prep_xfer_dlist(agent_name, descs, *args, **kwargs):
            # vLLM 0.33 hands the peer's list to prep_xfer_dlist as Nx5 strided rows,
            # (base, len, dev, stride, count 0) per region: the guard byte instead
            if agent_name not in LOCAL_AGENT_NAMES and _describes_no_block(descs):
                descs = _like(descs, remote)
                replaced.append(1)
            return real_prep(agent_name, descs, *args, **kwargs)

        methods.update(get_xfer_descs=get_xfer_descs, prep_xfer_dlist=prep_xfer_dlist)
        logger.info("kvcached-pd: peer %s registered no KV blocks (kvcached's contiguous "
                    "layout): only its staging can be read; direct transfers fail",
                    getattr(nixl_agent_meta, "engine_id", "?"))
    if own is not None:
        local = _guard_local_preps(worker, own, wrapper)
        if "prep_xfer_dlist" in methods:  # both: the local guard first, then the peer's
            remote_prep, local_prep = methods["prep_xfer_dlist"], local["prep_xfer_dlist"]

            def both(agent_name, descs, *args, **kwargs):
                if agent_name in LOCAL_AGENT_NAMES:
                    return local_prep(agent_name, descs, *args, **kwargs)
                return remote_prep(agent_name, descs, *args, **kwargs)

            local = {"prep_xfer_dlist": both}
        methods.update(local)
    with _refused_unless(lambda: not peer_empty or bool(replaced), (
            f"kvcached-pd: peer {getattr(nixl_agent_meta, 'engine_id', '?')} registered no "
            "KV blocks (kvcached's contiguous layout), but vLLM prepared its remote "
            "descriptor list without a call kvcached-pd guards (get_xfer_descs, "
            "prep_xfer_dlist), so that list was never pointed at the peer's guard byte; "
            "refusing the handshake")), replace_wrapper_methods(wrapper, **methods):
        yield


def _describes_no_block(descs: Any) -> bool:
    """A plain list with no rows, or Nx5 strided rows whose counts are all 0."""
    if not _is_plain(descs):
        return False
    if len(descs) == 0:
        return True
    shape = getattr(descs, "shape", None)
    return bool(shape is not None and len(shape) == 2 and shape[1] == 5
                and int(descs[:, 4].sum()) == 0)


def _like(descs: Any, row: tuple[int, int, int]) -> Any:
    """One descriptor ``row`` in the form of ``descs`` (Nx5 strided: count 1)."""
    shape = getattr(descs, "shape", None)
    if shape is not None and len(shape) == 2 and shape[1] == 5:
        import numpy as np

        return np.array([[row[0], row[1], row[2], row[1], 1]], dtype=descs.dtype)
    return [row]
