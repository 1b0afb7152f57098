#!/usr/bin/env python3
"""What a NIXL agent's progress thread costs idle, and what waiting for UCX's events
instead of spinning costs a notification and a READ: two agents in one process, on host
memory (no GPU needed).

usage: bench_nixl_progress.py {spin,wait,none} [--reads 5] [--mib 64]
       bench_nixl_progress.py {spin,wait} --two-processes [--device cuda] [--mib 256]

  spin  NIXL's Python default: the progress thread polls with no delay
  wait  the thread sleeps in poll() on UCX's event descriptors, up to
        ``PROGRESS_WAIT_US`` (NIXL's pthrDelay)
  none  no progress thread: progress only inside NIXL calls

Prints the two agents' idle CPU (CPUs busy over 3 s of doing nothing), a notification's
latency D -> P with P polling (p50, max over 50), and each READ's time by D of P's buffer
while P makes no NIXL call (an idle prefill engine), stopped at 10 s. Run each mode in a
process of its own (UCX_TLS=tcp,self makes the target's progress necessary for the READ).

--two-processes: P in a process of its own, as a prefill instance is: it builds its agent
and registers its buffer (``--device cuda``: on GPU 0, where D's lands too: one GPU, two
processes, the colocated deployment's NIXL wire), then makes no NIXL call until D's READs
are done; D (this process) READs P's whole buffer ``--reads`` times, its READ's
notification tells P, and each process's idle CPU is read from /proc over 3 s.
2026-11-28, this repository's machine (2 CPUs), NIXL 1.5.1, two runs of each
(experiments/results/2026-11-28f-h200x2-session/nixl-progress-local.txt): spin 1.99 CPUs,
notification 7-11 us, READ 3.5-10.8 ms (TCP 56-114); wait 0.03-0.04 CPUs, 19-30 us,
3.7-4.2 ms (TCP 60-80); none: still waiting when a 60 s timeout ended it. One H200, two
processes, --device cuda --mib 256 (nixl-progress-gpu.txt): spin 1.00 CPUs a process,
READ 430-460 ms (median 448); wait 0.01-0.02, 473-612 ms (median 566): on one GPU P's
side of UCX's pipeline moves when its thread wakes, and a READ takes 1.27x as long.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from host_cpu import tree_cpu_s  # experiments/ is this script's folder

PROGRESS_WAIT_US = 1000



def build(name: str, mode: str):
    from nixl import _api

    if mode == "wait":
        # NIXL's Python API has no parameter for the thread's delay (it sets the C++
        # config's pthrDelay to 0 itself): its bindings' constructor is wrapped for this
        # one construction
        bindings = _api.nixlBind
        make = bindings.nixlAgent

        def waiting(agent_name, config):
            config.pthrDelay = PROGRESS_WAIT_US
            return make(agent_name, config)

        bindings.nixlAgent = waiting
        try:
            return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"]))
        finally:
            bindings.nixlAgent = make
    return _api.nixl_agent(name, _api.nixl_agent_config(
        enable_prog_thread=(mode == "spin"), backends=["UCX"]))


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def timed_read(d, local, remote, peer: str, notif: bytes, limit_s: float) -> str:
    """One READ by agent ``d`` of ``remote`` into ``local`` (NIXL descriptor lists),
    polled until it ends or ``limit_s`` passes: "12.3 ms DONE"."""
    handle = d.initialize_xfer("READ", local, remote, peer, notif)
    t0 = time.perf_counter()
    state = d.transfer(handle)
    while state not in ("DONE", "ERR") and time.perf_counter() - t0 < limit_s:
        state = d.check_xfer_state(handle)
    d.release_xfer_handle(handle)
    return f"{(time.perf_counter() - t0) * 1e3:.1f} ms {state}"


def buffer(nbytes: int, device: str, fill: int):
    """(address, nbytes, NIXL memory type, device id, keep-alive object)."""
    if device == "cuda":
        import torch
        t = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        return t.data_ptr(), nbytes, "VRAM", 0, t
    import numpy as np
    arr = np.full(nbytes, fill, dtype=np.uint8)
    return arr.ctypes.data, nbytes, "DRAM", 0, arr


def prefill_side(a) -> None:
    """P: agent, buffer, metadata to a file; then no NIXL call until D says it is done."""
    import pickle
    agent = build("P", a.mode)
    addr, n, mem, dev, keep = buffer(a.mib << 20, a.device, 7)
    agent.register_memory(agent.get_reg_descs([(addr, n, dev, "")], mem))
    with open(os.path.join(a.dir, "p.tmp"), "wb") as f:
        pickle.dump({"md": agent.get_agent_metadata(), "addr": addr, "n": n, "mem": mem,
                     "dev": dev}, f)
    os.rename(os.path.join(a.dir, "p.tmp"), os.path.join(a.dir, "p.meta"))
    while not os.path.exists(os.path.join(a.dir, "done")):
        time.sleep(0.05)
    got = 0
    deadline = time.monotonic() + 10
    while got < a.reads and time.monotonic() < deadline:
        got += sum(len(v) for v in agent.get_new_notifs().values())
        time.sleep(0.01)
    print(f"P: {got} of {a.reads} READ notifications", flush=True)
    del keep
    os._exit(0)


def two_processes(a) -> None:
    import pickle
    import subprocess
    import tempfile
    a.dir = tempfile.mkdtemp()
    child = subprocess.Popen([sys.executable, __file__, a.mode, "--role", "p", "--dir", a.dir,
                              "--device", a.device, "--mib", str(a.mib),
                              "--reads", str(a.reads)])
    meta = os.path.join(a.dir, "p.meta")
    deadline = time.monotonic() + 120
    while not os.path.exists(meta):
        if time.monotonic() > deadline or child.poll() is not None:
            raise SystemExit("P did not start")
        time.sleep(0.05)
    with open(meta, "rb") as f:
        p = pickle.load(f)
    d = build("D", a.mode)
    addr, n, mem, dev, keep = buffer(a.mib << 20, a.device, 0)
    d.register_memory(d.get_reg_descs([(addr, n, dev, "")], mem))
    peer = d.add_remote_agent(p["md"])
    peer = peer.decode() if isinstance(peer, bytes) else peer
    time.sleep(0.5)
    c0 = (cpu_s(), tree_cpu_s(child.pid))
    w0 = time.monotonic()
    time.sleep(3)
    wall = time.monotonic() - w0
    idle = [(cpu_s() - c0[0]) / wall, (tree_cpu_s(child.pid) - c0[1]) / wall]
    local = d.get_xfer_descs([(addr, n, dev)], mem)
    remote = d.get_xfer_descs([(p["addr"], p["n"], p["dev"])], p["mem"])
    reads = [timed_read(d, local, remote, peer, b"r%d" % i, 30) for i in range(a.reads)]
    if a.device == "cuda":
        import torch
        ok = bool((keep == 7).all().item())
        torch.cuda.synchronize()
    else:
        ok = bool((keep == 7).all())
    open(os.path.join(a.dir, "done"), "w").close()
    child.wait(timeout=60)
    print(f"{a.mode} ({a.device}, two processes): idle CPUs D {idle[0]:.2f}, P {idle[1]:.2f}; "
          f"READ {a.mib} MiB, P making no NIXL call: {', '.join(reads)}; bytes "
          f"{'equal' if ok else 'DIFFER'}", flush=True)
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("spin", "wait", "none"))
    ap.add_argument("--reads", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--two-processes", action="store_true")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--role", choices=("d", "p"), default="d", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "p":
        return prefill_side(a)
    if a.two_processes:
        return two_processes(a)
    import numpy as np

    p, d = build("P", a.mode), build("D", a.mode)
    src = np.ones(a.mib << 20, dtype=np.uint8)
    dst = np.zeros(a.mib << 20, dtype=np.uint8)
    p.register_memory(p.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    d.register_memory(d.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    d.add_remote_agent(p.get_agent_metadata())
    p.add_remote_agent(d.get_agent_metadata())
    time.sleep(0.5)
    c0, w0 = cpu_s(), time.monotonic()
    time.sleep(3)
    idle = (cpu_s() - c0) / (time.monotonic() - w0)
    lat = []
    for i in range(50):
        t0 = time.perf_counter()
        d.send_notif("P", b"n%d" % i)
        while not p.get_new_notifs().get("D"):
            pass
        lat.append((time.perf_counter() - t0) * 1e6)
    local = d.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    remote = p.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM")
    reads = [timed_read(d, local, remote, "P", b"r", 10) for _ in range(a.reads)]
    print(f"{a.mode}: idle {idle:.2f} CPUs (2 agents); notification p50 "
          f"{statistics.median(lat):.0f} us, max {max(lat):.0f} us; READ {a.mib} MiB, "
          f"P making no NIXL call: {', '.join(reads)}", flush=True)
    os._exit(0)  # NIXL/UCX teardown may abort a process whose threads still run


if __name__ == "__main__":
    main()
