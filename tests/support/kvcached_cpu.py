"""Run kvcached's real ``alloc_kv_cache`` on the CPU.

kvcached's Python view-building code (split-half strides, packed K|V views, kernel
blocks, the cross-layer "contiguous" layout) is what decides the layout NIXL must
describe and the staged transport must address, so tests use it as is. Only what a CPU
cannot run is replaced: the compiled ``kvcached.vmm_ops`` (CUDA virtual memory) becomes
a stand-in whose ``create_kv_tensors`` returns what kvcached's C++ allocator returns as
the "virtual reservation", zeroed host memory instead of mapped pages: one buffer per
layer, or with the contiguous layout one buffer for all layers
(``FTensorAllocator::create_kv_tensors_contiguous_``: per-layer size x layers), and
``torch.cuda`` reports a small device. ``posix_ipc`` (kvcached's cross-process IPC)
is stubbed likewise.

kvcached is not pip-installable without a CUDA torch; the tests read its source
archive, unpacked by ``tests/support/fetch_kvcached.py`` into ``KVCACHED_SRC``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from unittest import mock

import torch

DEFAULT_SRC = os.path.join(os.path.dirname(__file__), "..", "..", ".cache", "kvcached-0.1.6")


def kvcached_src() -> str:
    return os.path.abspath(os.environ.get("KVCACHED_SRC", DEFAULT_SRC))


def available() -> bool:
    return os.path.isfile(os.path.join(kvcached_src(), "kvcached", "__init__.py"))


def on_path() -> dict[str, str]:
    """The environment that puts kvcached's source first on a child's ``PYTHONPATH``
    (the test's skip when the test command did not fetch it)."""
    import pytest

    if not available():
        pytest.skip("kvcached source not fetched")
    return {"PYTHONPATH": kvcached_src()}


def _host_create_kv_tensors(size, dtype_size, device, num_layers, num_kv_buffers=2,
                            group_id=0, unified_pool=False):
    # The C++ allocator follows the layout init_kvcached gave it; kvcached's Python
    # passes the same flag (interfaces._contiguous_layout), which fake_device sets.
    interfaces = sys.modules.get("kvcached.integration.vllm.interfaces")
    if interfaces is not None and interfaces._contiguous_layout:
        return [torch.zeros(size * num_layers, dtype=torch.uint8)]
    return [torch.zeros(size, dtype=torch.uint8) for _ in range(num_layers)]


def install_stand_ins() -> None:
    """Make kvcached's pure-Python modules importable on a CPU machine."""
    src = kvcached_src()
    if src not in sys.path:
        sys.path.insert(0, src)
    if not isinstance(sys.modules.get("kvcached.vmm_ops"), mock.MagicMock):
        vmm = mock.MagicMock(name="kvcached.vmm_ops (CPU stand-in)")
        vmm.create_kv_tensors = _host_create_kv_tensors
        sys.modules["kvcached.vmm_ops"] = vmm
    sys.modules.setdefault("posix_ipc", mock.MagicMock(name="posix_ipc (stand-in)"))


@contextlib.contextmanager
def fake_device(total_memory: int = 64 << 20, contiguous: bool = False):
    """kvcached sizes its virtual reservation from the device's total memory.

    ``contiguous`` selects kvcached's layout, as ``KVCACHED_CONTIGUOUS_LAYOUT`` does
    (kvcached's default on CUDA is ``True``: one compound page maps every layer).
    """
    import kvcached.integration.vllm.interfaces as kvi

    props = types.SimpleNamespace(total_memory=total_memory)
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
         mock.patch.object(torch.cuda, "get_device_properties", return_value=props), \
         mock.patch.object(kvi, "normalize_gpu_device", side_effect=lambda d: d), \
         mock.patch.object(kvi, "_kvcached_initialized", True), \
         mock.patch.object(kvi, "_contiguous_layout", contiguous):
        try:
            import kvcached.integration.vllm.model_runner_v2 as mrv2
        except ImportError:  # needs vLLM 0.29+
            yield kvi
            return
        with mock.patch.object(mrv2, "CONTIGUOUS_LAYOUT", contiguous):
            yield kvi


@contextlib.contextmanager
def patches_applied(*names: str):
    """kvcached's CPU stand-ins, then the named kvcached-pd patches applied and the
    registry empty, for the body; undone in reverse after it (fixtures of the
    registration tests)."""
    from kvcached_pd.patches import get_patch
    from kvcached_pd.registry import REGISTRY

    install_stand_ins()
    for name in names:
        get_patch(name).patch()
    REGISTRY.clear()
    try:
        yield
    finally:
        for name in reversed(names):
            get_patch(name).unpatch()
        REGISTRY.clear()
