"""What each instance holds in GPU memory, read from outside it, for the load harness.

kvcached's point is that an idle instance gives its KV memory back; kvcached-pd adds a
staging region (ordinary device memory, registered with NIXL once, never given back)
and asks nothing of kvcached's page reserve. So the harness reads, per instance:

* ``nvidia-smi --query-compute-apps``: the device memory of the instance's processes
  (its process tree), the number an operator sees; None where the driver reports no
  per-process figures (some containers hide other processes' ids);
* kvcached's own account (the shared-memory segment named by the instance's
  ``KVCACHED_IPC_NAME``: three int64 ``total, used, prealloc`` in bytes, all layers and
  K/V together, written by kvcached's page allocator on every map and unmap): KV pages
  mapped for blocks in use, and pages mapped ahead (``KVCACHED_MIN/MAX_RESERVED_PAGES``).
"""

from __future__ import annotations

import os
import struct
import subprocess

SHM_DIR = "/dev/shm"


def kvcached_mapped(ipc_name: str, shm_dir: str = SHM_DIR) -> dict[str, int] | None:
    """kvcached's ``total, used, prealloc`` bytes for the instance, None without them."""
    try:
        with open(os.path.join(shm_dir, ipc_name), "rb") as f:
            data = f.read(24)
    except OSError:
        return None
    if len(data) < 24:
        return None
    total, used, prealloc = struct.unpack("<qqq", data)
    return {"total": total, "used": used, "prealloc": prealloc}


def process_tree(root: int, proc_dir: str = "/proc") -> set[int]:
    """``root`` and every process descending from it."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir(proc_dir)
    except OSError:
        return {root}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc_dir, name, "stat"), encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def compute_apps_mib() -> dict[int, float] | None:
    """Device memory (MiB) per process id, as the driver reports it; None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return parse_compute_apps(out.stdout)


def parse_compute_apps(text: str) -> dict[int, float]:
    usage: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                usage[int(parts[0])] = usage.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return usage


def instance_memory(root_pid: int | None, ipc_name: str | None,
                    apps: dict[int, float] | None) -> dict:
    """One instance's reading: ``device_mib`` (its process tree's, None when the driver
    names none of its processes) and ``kvcached`` (mapped bytes, None without kvcached)."""
    device = None
    if root_pid is not None and apps:
        mine = [mib for pid, mib in apps.items() if pid in process_tree(root_pid)]
        device = sum(mine) if mine else None
    return {"device_mib": device,
            "kvcached": kvcached_mapped(ipc_name) if ipc_name else None}
