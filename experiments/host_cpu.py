"""The host's CPUs during a load, read from /proc around it, for the load harness.

Why: the colocated loads' ratios to one instance moved with what else the host ran.
2026-11-28d (three modes a lane) and 2026-11-28e (six, both lanes at once) on the same
2 x H200 kind: one kvcached instance's tiny load took 97 ms e2e p50 in the first and
115-133 ms in the second, push PD's way to P (the proxy, P's API server) 3.8 against
7-14 ms, and push's ratio 1.33x against 1.28-1.68x. Nothing in a summary said how busy
the host was. So each load repeat now records

* ``busy_pct``: the share of all the host's CPU time (``/proc/stat``'s first line) that
  was not idle (nor waiting on I/O) while the repeat's requests ran: the host, not only
  this run (the other lane's servers and loads count too);
* ``cpu_s``: the CPU seconds (user + system, ``/proc/PID/stat``) each of the mode's
  processes spent over the repeat, over its whole process tree (vLLM's API server, its
  engine core, their workers): per completed request this is what a mode costs the host.
"""

from __future__ import annotations

import os

from gpu_memory import process_tree, stat_fields

PROC = "/proc"


def host_jiffies(proc_dir: str = PROC) -> tuple[int, int] | None:
    """(busy, total) clock ticks over all CPUs since boot; None where unreadable.
    ``/proc/stat``'s "cpu" line: user nice system idle iowait irq softirq steal (then
    guest and guest_nice, already counted in user and nice)."""
    try:
        with open(os.path.join(proc_dir, "stat"), encoding="utf-8") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 9:
        return None
    ticks = [int(x) for x in first[1:9]]
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


def tree_cpu_s(root: int | None, proc_dir: str = PROC) -> float | None:
    """User + system CPU seconds of ``root`` and every process under it (threads
    included; children that already exited are not); None without a root."""
    if root is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total, seen = 0, False
    for pid in process_tree(root, proc_dir):
        fields = stat_fields(pid, proc_dir)  # utime and stime: /proc/PID/stat's 14th, 15th
        if fields and len(fields) > 12:
            total += int(fields[11]) + int(fields[12])
            seen = True
    return total / tick if seen else None


class CpuWindow:
    """CPU use between :meth:`start` and :meth:`stop`: the host's busy share and each
    named process tree's CPU seconds."""

    def __init__(self, roots: dict[str, int | None], proc_dir: str = PROC):
        self.roots = roots
        self.proc_dir = proc_dir
        self._host: tuple[int, int] | None = None
        self._trees: dict[str, float | None] = {}

    def start(self) -> CpuWindow:
        self._host = host_jiffies(self.proc_dir)
        self._trees = {k: tree_cpu_s(pid, self.proc_dir) for k, pid in self.roots.items()}
        return self

    def stop(self) -> dict:
        host = host_jiffies(self.proc_dir)
        busy = None
        if host is not None and self._host is not None and host[1] > self._host[1]:
            busy = round(100.0 * (host[0] - self._host[0]) / (host[1] - self._host[1]), 1)
        cpu_s = {}
        for k, pid in self.roots.items():
            now, then = tree_cpu_s(pid, self.proc_dir), self._trees.get(k)
            # a tree's CPU seconds only grow while its processes live; less at the stop
            # than at the start means some of them ended (an instance killed mid-load,
            # 2026-11-29e: -2280.8 ms a request), and what they used is no longer readable
            cpu_s[k] = None if now is None or then is None or now < then \
                else round(now - then, 3)
        return {"busy_pct": busy, "cpus": os.cpu_count(), "cpu_s": cpu_s}
