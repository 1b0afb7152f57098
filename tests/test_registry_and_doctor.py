"""The geometry registry keeps engines and groups apart; its state dir is this user's own
and its files are written without following links; the doctor reports and exits."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from kvcached_pd import registry
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


def _snapshot_files(directory):
    return sorted(p.name for p in directory.iterdir())


def test_the_state_file_is_written_without_following_a_planted_link(tmp_path, monkeypatch):
    """The snapshot went through ``<pid>.json.tmp``, a name another local user could
    plant as a link to a file of ours (which was then overwritten)."""
    state = tmp_path / "state"
    monkeypatch.setenv("KVCACHED_PD_STATE_DIR", str(state))
    state.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    pid = os.getpid()
    (state / f"{pid}.json.tmp").symlink_to(victim)
    (state / f"{pid}.json").symlink_to(victim)
    registry._publish({"pid": pid, "geometries": [], "registrations": []})
    assert victim.read_text() == "precious"
    written = state / f"{pid}.json"
    assert not written.is_symlink() and json.loads(written.read_text())["pid"] == pid
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


@pytest.mark.parametrize("how", ["another owner", "writable by all", "a link"])
def test_a_state_dir_that_is_not_this_users_own_is_neither_written_nor_read(
        tmp_path, monkeypatch, caplog, how):
    """The default state dir has a predictable name in the shared temp dir: another local
    user could create it first and read, or plant, the snapshots the doctor shows."""
    state = tmp_path / "state"
    monkeypatch.setenv("KVCACHED_PD_STATE_DIR", str(state))
    monkeypatch.setattr(registry, "_warned", False)
    if how == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        state.symlink_to(tmp_path / "elsewhere")
    else:
        state.mkdir(mode=0o700)
        if how == "writable by all":
            state.chmod(0o777)
        elif os.getuid() == 0:
            os.chown(state, 65534, 65534)
        else:
            monkeypatch.setattr(os, "getuid", lambda: os.stat(state).st_uid + 1)
    planted = {"pid": os.getpid(), "geometries": [], "registrations": ["planted"]}
    (state / f"{os.getpid()}.json").write_text(json.dumps(planted))
    registry._publish({"pid": os.getpid(), "geometries": [], "registrations": []})
    assert json.loads((state / f"{os.getpid()}.json").read_text()) == planted  # not written
    assert list(registry.live_snapshots()) == []  # nor read
    assert "not this user's own" in caplog.text


def test_a_missing_state_dir_is_created_private(tmp_path, monkeypatch):
    state = tmp_path / "deeper" / "state"
    monkeypatch.setenv("KVCACHED_PD_STATE_DIR", str(state))
    registry._publish({"pid": os.getpid(), "geometries": [], "registrations": []})
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert [s["pid"] for s in registry.live_snapshots()] == [os.getpid()]
