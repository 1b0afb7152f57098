"""The geometry registry keeps engines and groups apart; the doctor reports and exits."""

from __future__ import annotations

import torch

from kvcached_pd.patches.kvcached_alloc import record_allocation
from kvcached_pd.registry import REGISTRY, GeometryRegistry
from tests.support import subproc


def test_several_allocations_and_groups_in_one_process():
    REGISTRY.clear()
    a = [torch.zeros(64, 2, 16, 2, 8) for _ in range(2)]  # engine A, group 0: (N, 2, ...)
    b = [torch.zeros(2, 32, 16, 2, 8) for _ in range(3)]  # engine B, group 1: (2, N, ...)
    ga = record_allocation(a, (8, 2, 16, 2, 8), 16, torch.float32, group_id=0)
    gb = record_allocation(b, (2, 4, 16, 2, 8), 16, torch.float32, group_id=1)
    assert {g.allocation for g in ga}.isdisjoint({g.allocation for g in gb})
    assert REGISTRY.lookup(a[1]).physical_blocks == 8 and REGISTRY.lookup(a[1]).blocks_dim == 0
    assert REGISTRY.lookup(b[2]).physical_blocks == 4 and REGISTRY.lookup(b[2]).blocks_dim == 1
    assert REGISTRY.lookup(b[2]).layer_index == 2 and REGISTRY.lookup(b[2]).group_id == 1
    assert REGISTRY.lookup(a[0][:, :1]) is None  # another view at the same address
    REGISTRY.forget_allocation(ga[0].allocation)
    assert REGISTRY.lookup(a[0]) is None and REGISTRY.lookup(b[0]) is not None
    REGISTRY.clear()


def test_kernel_block_split_counts_kernel_blocks():
    reg = GeometryRegistry()
    t = torch.zeros(2, 40, 8, 2, 8)
    import kvcached_pd.patches.kvcached_alloc as ka
    real, ka.REGISTRY = ka.REGISTRY, reg
    try:
        (g,) = record_allocation([t], (2, 5, 32, 2, 8), 32, torch.float32, kernel_block_size=8)
    finally:
        ka.REGISTRY = real
    assert g.physical_blocks == 20 and g.virtual_blocks == 40


def doctor(**env):
    return subproc.run("from kvcached_pd.cli import main; raise SystemExit(main(['doctor']))",
                       env=subproc.clean_env(**env))


def test_doctor_clean_environment_exits_zero():
    proc = doctor()
    assert proc.returncode == 0, proc.stdout
    assert "problems: none" in proc.stdout and "nixl_registration" in proc.stdout


def test_doctor_blocking_problem_exits_nonzero():
    proc = doctor(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_PD_DISABLE="nixl_layot",
                  KVCACHED_PD_TRANSPORT="direct")
    assert proc.returncode == 1
    assert "BLOCKING" in proc.stdout and "KVCACHED_CONTIGUOUS_LAYOUT is true" in proc.stdout
    assert "unknown patch(es) ['nixl_layot']" in proc.stdout


def test_doctor_deep_dry_runs_the_hooks():
    proc = subproc.run("from kvcached_pd.cli import main; raise SystemExit(main(['doctor', '--deep']))",
                       env=subproc.clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("hook points found") >= 3
