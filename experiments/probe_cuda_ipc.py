#!/usr/bin/env python3
"""Does a process that maps another's GPU memory through CUDA IPC survive that process's
death, and what does it read then? The colocated-PD question: D maps P's staging region
and unpacks straight from it; P may be killed while D holds the mapping.

Two processes on one GPU, started by this script (which itself never touches CUDA, so it
holds no context and no memory on the device):

- the exporter (P's part) allocates torch CUDA tensors of --sizes-mib (int32 0, 1, 2, ...),
  exports them with torch.multiprocessing.reductions.reduce_tensor (the storage's
  cudaIpcMemHandle, as ``untyped_storage()._share_cuda_()`` gives it) and an interprocess
  CUDA event it recorded after filling them, then waits;
- the importer (D's part) opens them (rebuild_cuda_tensor), checks the bytes, times
  copies from the mapped tensor against a copy of its own local tensor (device time,
  CUDA events, median of --repeats; GB/s = bytes copied / time / 1e9), waits on the
  exporter's event, and reports "mapped";
- the exporter is SIGKILLed while the importer holds the mapping; the importer then
  copies from the mapping again (does it survive, does it read the old bytes?), waits on
  the dead exporter's event, allocates fresh memory and runs a kernel (is its CUDA
  context still healthy?), releases the mapping and exits.

The GPU's memory in use (nvidia-smi, all processes) is read at every step, which shows
whether the dead exporter's memory stays allocated while the importer maps it and when it
returns. Prints one JSON document and writes it to --out. Exit status 0 when the probe ran
to its end (whatever it found), 1 when it could not (no CUDA device, a step timed out).

usage: probe_cuda_ipc.py --out probe.json [--sizes-mib 94,1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TAG = "PROBE "  # prefix of every protocol line on the children's stdout


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    ap.add_argument("--sizes-mib", default="94,1024", help="tensor sizes, MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed copies per size and source")
    ap.add_argument("--step-timeout-s", type=float, default=90.0,
                    help="longest wait for one step of a child before the probe gives up")
    ap.add_argument("--role", choices=("main", "exporter", "importer"), default="main",
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        a.sizes_mib = [int(s) for s in a.sizes_mib.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes-mib {a.sizes_mib!r}: whole MiB, comma-separated")
    if not a.sizes_mib or min(a.sizes_mib) < 1:
        ap.error("--sizes-mib: at least one size of at least 1 MiB")
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    return a


def say(kind: str, payload) -> None:
    print(f"{TAG}{kind} {json.dumps(payload)}", flush=True)


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else round(nbytes / seconds / 1e9, 1)


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


# ---- the children ----------------------------------------------------------------------


def _no_cuda() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    return None


def exporter(a: argparse.Namespace) -> int:
    why = _no_cuda()
    if why:
        say("ERROR", {"error": why})
        return 1
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(0)
    tensors, shared = {}, {}
    for mib in a.sizes_mib:
        t = torch.arange(mib * (1 << 20) // 4, dtype=torch.int32, device="cuda")
        tensors[mib] = t
        _fn, args = reduce_tensor(t)
        shared[mib] = args
    event = torch.cuda.Event(interprocess=True)
    event.record()
    torch.cuda.synchronize()
    blob = base64.b64encode(pickle.dumps({"tensors": shared, "event": event.ipc_handle(),
                                          "pid": os.getpid()})).decode()
    say("EXPORTED", {"pid": os.getpid(), "blob": blob,
                     "device": torch.cuda.get_device_name(0), "torch": torch.__version__})
    sys.stdin.read()  # hold the tensors until killed (or until main closes stdin)
    return 0


def _timed_copy(torch, dst, src, repeats: int) -> float:
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def _attempt(result: dict, key: str, fn) -> None:
    """Run one step; record its value or its exception, never stop the probe."""
    try:
        result[key] = fn()
    except Exception as exc:  # noqa: BLE001 - the exception is the finding
        result[key] = None
        result[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"


def importer(a: argparse.Namespace) -> int:
    why = _no_cuda()
    if why:
        say("ERROR", {"error": why})
        return 1
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda.set_device(0)
    doc = pickle.loads(base64.b64decode(sys.stdin.readline().strip()))
    remote, expected, dst, sizes = {}, {}, {}, {}
    for mib, args in doc["tensors"].items():
        remote[mib] = rebuild_cuda_tensor(*args)
        expected[mib] = torch.arange(remote[mib].numel(), dtype=torch.int32, device="cuda")
        dst[mib] = torch.empty_like(expected[mib])
        nbytes = remote[mib].numel() * 4
        r = sizes[str(mib)] = {"bytes": nbytes}
        _attempt(r, "bytes_ok", lambda m=mib: bool(torch.equal(remote[m], expected[m])))
        _attempt(r, "ipc_copy_s", lambda m=mib: _timed_copy(torch, dst[m], remote[m], a.repeats))
        _attempt(r, "local_copy_s",
                 lambda m=mib: _timed_copy(torch, dst[m], expected[m], a.repeats))
        r["ipc_copy_gbps"] = gbps(nbytes, r.get("ipc_copy_s"))
        r["local_copy_gbps"] = gbps(nbytes, r.get("local_copy_s"))
    before: dict = {"sizes": sizes}

    def wait_event():
        ev = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), doc["event"])
        torch.cuda.current_stream().wait_event(ev)
        torch.cuda.synchronize()
        return True

    _attempt(before, "event_wait_ok", wait_event)
    say("MAPPED", before)
    sys.stdin.readline()  # main: the exporter is dead now

    after: dict = {"sizes": {}}
    for mib in remote:
        r = after["sizes"][str(mib)] = {}

        def copy_again(m=mib):
            dst[m].zero_()
            dst[m].copy_(remote[m])
            torch.cuda.synchronize()
            return True

        _attempt(r, "copy_ok", copy_again)
        if r.get("copy_ok"):
            _attempt(r, "old_bytes", lambda m=mib: bool(torch.equal(dst[m], expected[m])))
    _attempt(after, "event_wait_ok", wait_event)

    def fresh_kernel():
        x = torch.ones(1 << 24, device="cuda")
        return float((x * 2).sum().item()) == float(2 << 24)

    _attempt(after, "fresh_alloc_kernel_ok", fresh_kernel)

    def release():
        remote.clear()
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        return True

    _attempt(after, "release_ok", release)
    say("RELEASED", after)
    sys.stdin.readline()  # main: GPU memory read after the release
    _attempt(after, "after_release_kernel_ok", fresh_kernel)
    say("DONE", {"after_release_kernel_ok": after.get("after_release_kernel_ok"),
                 "after_release_kernel_ok_error": after.get("after_release_kernel_ok_error")})
    return 0


# ---- the orchestrating process (no CUDA here) -------------------------------------------


class Child:
    """A child whose protocol lines arrive on a queue, so every wait has a timeout."""

    def __init__(self, role: str, a: argparse.Namespace):
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role,
               "--sizes-mib", ",".join(map(str, a.sizes_mib)), "--repeats", str(a.repeats)]
        self.role = role
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True).start()

    def _pump(self, stream, protocol: bool) -> None:
        for line in stream:
            if protocol and line.startswith(TAG):
                kind, _, payload = line[len(TAG):].partition(" ")
                self.lines.put((kind, json.loads(payload)))
            else:
                self.stderr.append(line.rstrip("\n"))
                del self.stderr[:-40]
        if protocol:
            self.lines.put(("EOF", None))

    def expect(self, kinds: tuple[str, ...], timeout_s: float) -> tuple[str, dict | None]:
        try:
            kind, payload = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return "TIMEOUT", None
        return (kind, payload) if kind in kinds or kind in ("ERROR", "EOF") else \
            ("UNEXPECTED " + kind, payload)

    def send(self, text: str) -> bool:
        try:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    def exit_status(self, timeout_s: float = 10.0) -> dict:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"alive": True, "returncode": None}
        return {"alive": False, "returncode": rc,
                "signal": signal.Signals(-rc).name if rc < 0 else None}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _gpu_used() -> float | None:
    sys.path.insert(0, HERE)
    from gpu_memory import gpu_used_mib

    used = gpu_used_mib()
    return None if not used else used.get("0")


def conclusions(res: dict) -> dict:
    """The answers, from the raw steps (None where the probe did not get that far)."""
    after = res.get("after_exporter_killed") or {}
    sizes = after.get("sizes") or {}
    gpu = res.get("gpu_used_mib") or {}

    def diff(a, b):
        return None if gpu.get(a) is None or gpu.get(b) is None else round(gpu[a] - gpu[b])

    copies = [s.get("copy_ok") for s in sizes.values()]
    olds = [s.get("old_bytes") for s in sizes.values()]
    return {
        "importer_survived_exporter_death": res.get("importer_status_after_kill") == "alive"
        if "importer_status_after_kill" in res else None,
        "copy_from_mapping_after_death_ok": all(copies) if copies else None,
        "reads_old_bytes_after_death": all(olds) if olds and None not in olds else None,
        "event_wait_after_death_ok": after.get("event_wait_ok"),
        "fresh_alloc_and_kernel_after_death_ok": after.get("fresh_alloc_kernel_ok"),
        # what the exporter's death gave back at once, and what the importer's release did
        "freed_by_exporter_death_mib": diff("both_mapped", "exporter_killed"),
        "freed_by_importer_release_mib": diff("exporter_killed", "importer_released"),
    }


def main_role(a: argparse.Namespace) -> dict:
    res: dict = {"sizes_mib": a.sizes_mib, "repeats": a.repeats, "gpu_used_mib": {}}
    gpu = res["gpu_used_mib"]
    gpu["start"] = _gpu_used()
    exp = Child("exporter", a)
    imp = None
    try:
        kind, payload = exp.expect(("EXPORTED",), a.step_timeout_s)
        if kind != "EXPORTED":
            res["error"] = f"exporter: {kind}: {(payload or {}).get('error') or ''}".strip()
            res["exporter_stderr"] = exp.stderr
            return res
        res.update(device=payload["device"], torch=payload["torch"],
                   export="torch.multiprocessing.reductions.reduce_tensor (cudaIpcMemHandle)")
        gpu["exporter_allocated"] = _gpu_used()
        imp = Child("importer", a)
        imp.send(payload["blob"])
        kind, mapped = imp.expect(("MAPPED",), a.step_timeout_s)
        if kind != "MAPPED":
            res["error"] = f"importer before the kill: {kind}: {(mapped or {}).get('error', '')}"
            res["importer_stderr"] = imp.stderr
            return res
        res["mapped"] = mapped
        gpu["both_mapped"] = _gpu_used()
        t0 = time.monotonic()
        exp.proc.send_signal(signal.SIGKILL)
        res["exporter_exit"] = exp.exit_status()
        res["exporter_reaped_s"] = round(time.monotonic() - t0, 3)
        time.sleep(1.0)  # let the driver tear the dead context down
        gpu["exporter_killed"] = _gpu_used()
        imp.send("GO")
        kind, after = imp.expect(("RELEASED",), a.step_timeout_s)
        res["importer_status_after_kill"] = "alive" if kind == "RELEASED" else kind
        if kind != "RELEASED":
            res["importer_exit"] = imp.exit_status(5)
            res["importer_stderr"] = imp.stderr
            return res
        res["after_exporter_killed"] = after
        time.sleep(0.5)
        gpu["importer_released"] = _gpu_used()
        imp.send("GO")
        kind, done = imp.expect(("DONE",), a.step_timeout_s)
        if done:
            res["after_exporter_killed"].update(done)
        imp.proc.stdin.close()
        res["importer_exit"] = imp.exit_status()
        res["importer_stderr"] = imp.stderr[-10:]
        time.sleep(0.5)
        gpu["importer_exited"] = _gpu_used()
        return res
    finally:
        for child in (exp, imp):
            if child is not None:
                child.kill()
        res["conclusions"] = conclusions(res)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.role == "exporter":
        return exporter(a)
    if a.role == "importer":
        return importer(a)
    res = main_role(a)
    text = json.dumps(res, indent=1)
    print(text, flush=True)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 1 if res.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
