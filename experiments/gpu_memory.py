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


def stat_fields(pid: int | str, proc_dir: str = "/proc") -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (state, ppid, ...: ``[1]`` is
    the parent, ``[11]`` and ``[12]`` user and system ticks); None for a process gone."""
    try:
        with open(os.path.join(proc_dir, str(pid), "stat"), encoding="utf-8") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    return stat[stat.rfind(")") + 2:].split()


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
        fields = stat_fields(name, proc_dir)
        if fields and len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def _nvidia_smi(query: str) -> str | None:
    """nvidia-smi's CSV answer to one query (no header, no units); None without it."""
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def compute_apps_mib() -> dict[int, float] | None:
    """Device memory (MiB) per process id, as the driver reports it; None without it."""
    text = _nvidia_smi("--query-compute-apps=pid,used_memory")
    return None if text is None else parse_compute_apps(text)


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


def gpu_used_mib() -> dict[str, float] | None:
    """Device memory in use per GPU (MiB, nvidia-smi's index -> memory.used): what every
    process holds together, including memory one process exported and another mapped,
    which no per-process figure shows."""
    text = _nvidia_smi("--query-gpu=index,memory.used")
    return None if text is None else parse_gpu_used(text)


def gpu_used_on(index: str) -> float | None:
    """:func:`gpu_used_mib` of one GPU (nvidia-smi's index), or None."""
    used = gpu_used_mib()
    return None if used is None else used.get(index)


def parse_gpu_used(text: str) -> dict[str, float]:
    used: dict[str, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                used[parts[0]] = float(parts[1])
            except ValueError:
                continue
    return used


def _kv_mapped(reading: dict | None) -> int:
    kv = (reading or {}).get("kvcached") or {}
    return (kv.get("used") or 0) + (kv.get("prealloc") or 0)


def merge_peak(peak: dict[str, dict], sample: dict[str, dict]) -> dict[str, dict]:
    """Fold one sample (name -> {"device_mib", "kvcached"}) into ``peak``: per name the
    highest device_mib and the kvcached account with the most bytes mapped (in use +
    ahead), each from whichever sample had it; ``samples`` counts the readings."""
    out = {k: dict(v) for k, v in peak.items()}
    for name, reading in sample.items():
        if reading is None:
            continue
        cur = out.setdefault(name, {"device_mib": None, "kvcached": None, "samples": 0})
        cur["samples"] += 1
        dev = reading.get("device_mib")
        if dev is not None and (cur["device_mib"] is None or dev > cur["device_mib"]):
            cur["device_mib"] = dev
        if reading.get("kvcached") is not None and (
                cur["kvcached"] is None or _kv_mapped(reading) > _kv_mapped(cur)):
            cur["kvcached"] = dict(reading["kvcached"])
    return out


class PeakSampler:
    """Reads ``read()`` (name -> reading) every ``interval_s`` on a thread while a load
    runs, so "under load" is the highest reading seen, not one taken after the requests
    finished (kvcached unmaps a finished request's pages within a second or two)."""

    def __init__(self, read, interval_s: float = 0.5):
        import threading

        self._read, self._interval = read, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.peak: dict[str, dict] = {}
        self.errors = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = merge_peak(self.peak, self._read())
            except Exception:  # noqa: BLE001 - a failed reading must not stop the load
                self.errors += 1
            self._stop.wait(self._interval)

    def start(self) -> "PeakSampler":
        self._thread.start()
        return self

    def stop(self) -> dict[str, dict]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.peak

