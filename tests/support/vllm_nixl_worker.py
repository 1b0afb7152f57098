"""Build vLLM's real NIXL connector worker on the CPU.

Everything here is vLLM's own: ``VllmConfig`` from a tiny local Llama config (no
weights, no hub), a one-process gloo group, the real ``NixlConnectorWorker`` with a
real NIXL agent (UCX) registering host memory (``kv_buffer_device="cpu"``, memory type
DRAM). The one thing replaced is vLLM's attention-backend lookup, which on a CPU
machine would answer the CPU backend: tests pick the GPU backend whose KV shape they
want to check, as vLLM's own NIXL unit tests do.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator
from unittest import mock

import torch

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def write_tiny_llama(path: str, num_layers: int = 3, num_kv_heads: int = 2, head_dim: int = 64) -> str:
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": num_kv_heads * 2 * head_dim, "intermediate_size": 256,
        "num_attention_heads": num_kv_heads * 2, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "num_hidden_layers": num_layers, "vocab_size": 512,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
        "tie_word_embeddings": True,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def make_vllm_config(model_dir: str, block_size: int = 16, kv_role: str = "kv_both",
                     connector: str = "NixlConnector"):
    from vllm.config import (
        CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig,
    )

    model_config = ModelConfig(model=model_dir, dtype="float16", skip_tokenizer_init=True)
    kv_transfer_config = KVTransferConfig(
        kv_connector=connector, kv_role=kv_role, kv_buffer_device="cpu",
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


_DIST_READY = False


def ensure_distributed(vllm_config) -> None:
    """One-process gloo group, once per test process (vLLM keeps it global)."""
    global _DIST_READY
    if _DIST_READY:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    store = tempfile.mktemp(prefix="kvcached-pd-dist-")
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"file://{store}",
            local_rank=0, backend="gloo",
        )
        initialize_model_parallel(1, 1)
    _DIST_READY = True


def attention_backend(name: str):
    if name == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as cls
    elif name == "TRITON_ATTN":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend as cls
    elif name == "FLASHINFER":
        from vllm.v1.attention.backends.flashinfer import FlashInferBackend as cls
    else:
        raise ValueError(name)
    return cls


def kv_cache_config(layer_names: list[str], num_blocks: int, block_size: int,
                    num_kv_heads: int, head_dim: int, dtype=torch.float16):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_dim, dtype=dtype)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)])


def vllm_kv_shape(backend, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    """The shape vLLM asks kvcached for, as its GPU model runner would."""
    return tuple(backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim))


def backend_kv_caches(backend, vllm_config, num_layers: int, num_blocks: int, block_size: int,
                      num_kv_heads: int, head_dim: int, generator: torch.Generator | None = None,
                      dtype=torch.float16) -> list[torch.Tensor]:
    """One KV cache per layer, shaped and laid out as this release's GPU model runner
    would give ``backend`` (and so vLLM's NixlConnector, whose per-block registration
    reads the rank and order of that shape), filled with random values.

    Up to 0.28 that is ``backend.get_kv_cache_shape`` allocated in the backend's
    ``get_kv_cache_stride_order`` and permuted back: (2, N, bs, H, D) for FlashAttention
    up to 0.22, (N, 2, bs, H, D) on 0.23-0.25, (N, H, bs, 2D) over NHD memory on
    0.26-0.28. From 0.29 a layer is a logical (N, H, bs, 2D) view in the order of the
    layout the engine resolved (``cache_config.get_resolved_kv_cache_layout()``, call
    ``resolve_kv_cache_layout`` first). A cache of another rank would make 0.26-0.28's
    NIXL registration take it for a cross-layer cache and register 0-byte blocks."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        if hasattr(backend, "get_kv_cache_shape"):
            shape = tuple(backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                     head_dim))
            try:
                order = tuple(backend.get_kv_cache_stride_order())
            except (AttributeError, NotImplementedError):
                order = tuple(range(len(shape)))
        else:
            layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
            shape = (num_blocks, num_kv_heads, block_size, 2 * head_dim)
            order = tuple(layout.layer_view_order)
    inverse = tuple(order.index(i) for i in range(len(order)))
    caches = []
    for _ in range(num_layers):
        physical = torch.empty(tuple(shape[i] for i in order), dtype=dtype)
        cache = physical.permute(*inverse)
        assert tuple(cache.shape) == shape
        cache.copy_(torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype))
        caches.append(cache)
    return caches


@contextlib.contextmanager
def backend_lookup(backend) -> Iterator[None]:
    """Answer vLLM's attention-backend lookups with ``backend`` (the CPU has none),
    and its platform lookups with vLLM's CPU platform."""
    import importlib

    patches = []
    for module_name in (f"{NIXL}.connector", f"{NIXL}.worker", f"{NIXL}.base_worker",
                        "vllm.distributed.kv_transfer.kv_connector.utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr, value in (("get_current_attn_backends", [backend]),
                            ("get_current_attn_backend", backend)):
            if hasattr(module, attr):
                patches.append(mock.patch.object(module, attr, return_value=value))
        if "current_platform" in vars(module):
            # vLLM's CUDA wheel on a machine without a GPU detects no platform; the
            # worker then refuses its device type. Use vLLM's own CPU platform.
            from vllm.platforms.cpu import CpuPlatform

            patches.append(mock.patch.object(module, "current_platform", CpuPlatform()))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@dataclass
class RecordedNixlCalls:
    """What the real NIXL agent was asked to register and describe (``xfer``: every
    local and remote list, each as per-block (addr, len, dev) rows)."""

    reg: list[tuple]
    xfer: list[Any]


def per_block_rows(descs):
    """(addr, len, dev) per block: vLLM 0.33's Nx5 strided rows (addr, len, dev, stride,
    count) expanded, per-block rows as they are."""
    import numpy as np

    rows = descs.tolist() if hasattr(descs, "tolist") else list(descs)
    out = []
    for r in rows:
        if len(r) == 5:
            addr, length, dev, stride, count = (int(x) for x in r)
            out.extend((addr + i * stride, length, dev) for i in range(count))
        else:
            out.append((int(r[0]), int(r[1]), int(r[2])))
    return np.array(out, dtype=np.uint64).reshape(-1, 3)


@contextlib.contextmanager
def record_nixl_calls(worker) -> Iterator[RecordedNixlCalls]:
    """Spy (not fake) on the worker's real NIXL agent: lists reach it through
    ``get_xfer_descs`` (vLLM up to 0.32) or straight through ``prep_xfer_dlist``
    (0.33's strided arrays); each list is recorded once."""
    rec = RecordedNixlCalls(reg=[], xfer=[])
    agent = worker.nixl_wrapper
    real_reg, real_xfer, real_prep = (agent.get_reg_descs, agent.get_xfer_descs,
                                      agent.prep_xfer_dlist)
    in_prep = []

    def plain(descs) -> bool:  # NIXL re-enters with its own list objects: skip those
        return isinstance(descs, (list, tuple)) or type(descs).__module__ == "numpy"

    def get_reg_descs(descs, *a, **k):
        if plain(descs):
            rows = descs.tolist() if hasattr(descs, "tolist") else descs
            rec.reg.extend((int(r[0]), int(r[1]), int(r[2])) for r in rows)
        return real_reg(descs, *a, **k)

    def get_xfer_descs(descs, *a, **k):
        if plain(descs) and not in_prep:
            rec.xfer.append(per_block_rows(descs))
        return real_xfer(descs, *a, **k)

    def prep_xfer_dlist(agent_name, descs, *a, **k):
        if plain(descs):
            rec.xfer.append(per_block_rows(descs))
        in_prep.append(True)
        try:
            return real_prep(agent_name, descs, *a, **k)
        finally:
            in_prep.pop()

    names = ("get_reg_descs", "get_xfer_descs", "prep_xfer_dlist")
    before = {n: agent.__dict__[n] for n in names if n in agent.__dict__}
    agent.get_reg_descs, agent.get_xfer_descs, agent.prep_xfer_dlist = (
        get_reg_descs, get_xfer_descs, prep_xfer_dlist)
    try:
        yield rec
    finally:
        for name in names:
            agent.__dict__.pop(name, None)
            if name in before:
                agent.__dict__[name] = before[name]


def forget_resolved_layout() -> None:
    """vLLM <= 0.28 caches the KV layout per process (``get_kv_cache_layout``)."""
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
    except ImportError:
        return
    if hasattr(get_kv_cache_layout, "cache_clear"):
        get_kv_cache_layout.cache_clear()


def make_worker(vllm_config, kv_cache_config, push: bool = False, engine_id: str | None = None):
    """The real NIXL connector worker vLLM would build (pull, or push from 0.24)."""
    import importlib

    from vllm.config import set_current_vllm_config

    package = importlib.import_module(NIXL)
    cls = getattr(package, "NixlPushConnectorWorker") if push else package.NixlConnectorWorker
    affinity = os.sched_getaffinity(0)
    try:
        with set_current_vllm_config(vllm_config):
            return cls(vllm_config, engine_id or f"engine-{os.getpid()}",
                       kv_cache_config=kv_cache_config)
    finally:
        os.sched_setaffinity(0, affinity)  # the CPU platform pins a core for NIXL


class _AgentNotCalling:
    """The worker's real NIXL agent, as a vLLM release that no longer calls ``names``
    would use it: kvcached-pd's hooks on those methods install (and uninstall) as
    usual, but vLLM's calls reach the real methods, as vLLM 0.33's strided lists
    reached ``prep_xfer_dlist`` without ever passing the hooked ``get_xfer_descs``."""

    def __init__(self, agent, names: tuple[str, ...]) -> None:
        object.__setattr__(self, "_agent", agent)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "installed", {})  # the hooks, never called by vLLM

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def __setattr__(self, name, value) -> None:
        if name in self._names:
            self.installed[name] = value
        else:
            setattr(self._agent, name, value)


@contextlib.contextmanager
def vllm_not_calling(worker, *names: str):
    """While inside: ``worker``'s vLLM code calls NIXL's ``names`` past any hook."""
    agent = worker.nixl_wrapper
    worker.nixl_wrapper = _AgentNotCalling(agent, names)
    try:
        yield
    finally:
        worker.nixl_wrapper = agent
