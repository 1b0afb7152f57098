#!/usr/bin/env python3
"""The CUDA IPC wire's layer (kvcached_pd.transport.cuda_ipc) between two real processes.

A "prefill" process allocates a staging buffer the way the connector does, packs a
pattern into an extent, records a slot of its pack-event ring after it and exports
both; a "decode" process maps the staging (open_staging), makes its stream wait on that
event, copies the extent out and checks every byte; then it times copies out of the
mapping against a local device copy (94 MiB and 1 GiB), and finally the prefill process
is SIGKILLed while the decode process still holds the mapping: does the decode process
survive, read the old bytes, and run a fresh allocation and kernel afterwards? Last,
the decode process uses the dead peer's mapping as kvcached-pd's decode side does (the
extent's tag read on a side stream, ``tokens.read_tags``; a copy out of the extent on
the compute stream after the pack event), then drops every reference to it and reports
how much of the GPU's memory came back (``freed_mib_on_unmap``; the peer's 1 GiB staging
should): on 2 x H200 (2026-11-26) a killed P's staging stayed held after a pull-mode D
dropped its mapping.

With the two processes on two GPUs (``--peer-device 0 --device 1``) the staging lives on
the peer's GPU, which the decode side's own free memory does not show: the driver's
memory in use on the peer's GPU (nvidia-smi) is read with both alive, after the peer's
death and after the decode side dropped the mapping (``peer_gpu_used_mib``), and
``freed_on_peer_gpu_mib`` says which of the two returned the staging. On 2 x H100
(2026-11-26, seventh session) nothing read P's GPU after a kill (the load harness and
D's unmap line both read D's GPU then; both fixed after): this answers it in a minute,
without vLLM.

usage: python experiments/ipc_selftest.py [--device 0] [--peer-device 0] [--out result.json]
Prints one JSON object (and writes it with --out). Needs a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 1 << 20


def prefill(device: int, nbytes: int, conn) -> None:
    import torch

    from kvcached_pd.transport import cuda_ipc

    torch.cuda.set_device(device)
    staging = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    stream = torch.cuda.current_stream()
    # a slow kernel ahead of the pack: the decode side must wait for it via the event
    a = torch.randn(4096, 4096, device=f"cuda:{device}")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    staging[: 94 * MIB].copy_(torch.arange(94 * MIB, device=f"cuda:{device}") % 251)
    export, events = cuda_ipc.export_staging(staging)
    events.record(3, stream)
    conn.send(export.to_dict())
    conn.recv()  # wait to be killed


def decode(device: int, export_raw: dict, conn) -> None:
    import torch

    from kvcached_pd.transport import cuda_ipc

    result: dict = {}
    torch.cuda.set_device(device)
    dev = torch.device("cuda", device)
    try:
        export = cuda_ipc.StagingExport.from_dict(export_raw)
        mapped, how = cuda_ipc.open_staging(export, dev)
        result["opened"] = how
        stream = torch.cuda.current_stream()
        mapped.wait_packed(3, stream)
        got = mapped.extent(0, 94 * MIB).clone()
        want = (torch.arange(94 * MIB, device=dev) % 251).to(torch.uint8)
        result["bytes_equal_after_event_wait"] = bool(torch.equal(got, want))
        for size_mib in (94, 1024):
            src = mapped.extent(0, size_mib * MIB)
            local = torch.empty(size_mib * MIB, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(local)
            for name, source in (("ipc", src), ("local", local)):
                dst.copy_(source)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    dst.copy_(source)
                torch.cuda.synchronize()
                seconds = (time.perf_counter() - t0) / 10
                result[f"copy_{size_mib}MiB_{name}_ms"] = round(1e3 * seconds, 4)
                result[f"copy_{size_mib}MiB_{name}_GBps"] = round(size_mib * MIB / seconds / 1e9, 1)
        conn.send(("ready", result))
        conn.recv()  # the prefill process is dead now
        try:
            again = mapped.extent(0, 94 * MIB).clone()
            torch.cuda.synchronize()
            result["read_after_peer_killed"] = "same bytes" if torch.equal(again, want) else "other bytes"
        except Exception as exc:  # noqa: BLE001
            result["read_after_peer_killed"] = f"error: {exc}"
        try:
            fresh = torch.randn(1024, 1024, device=dev) @ torch.randn(1024, 1024, device=dev)
            torch.cuda.synchronize()
            result["healthy_after_peer_killed"] = bool(torch.isfinite(fresh).all())
        except Exception as exc:  # noqa: BLE001
            result["healthy_after_peer_killed"] = f"error: {exc}"
        try:
            result.update(use_mapping_as_decode_does(torch, mapped, dev))
        except Exception as exc:  # noqa: BLE001
            result["freed_mib_on_unmap"] = f"error: {exc}"
        del mapped, src, got, again, local, dst, source  # every view of the mapping
        gc.collect()
        torch.cuda.synchronize()
        if isinstance(result.get("free_mib_held"), int):
            freed = round(torch.cuda.mem_get_info(dev)[0] / MIB) - result["free_mib_held"]
            result["freed_mib_on_unmap"] = freed
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
    conn.send(("final", result))


def use_mapping_as_decode_does(torch, mapped, dev) -> dict:
    """Read the (dead peer's) mapping as kvcached-pd's decode side does, drop the views
    made here, and return the GPU's free memory while the caller still holds the
    mapping (``free_mib_held``; the caller drops it and reports what came back)."""
    from kvcached_pd.connector import tokens

    side = torch.cuda.Stream(dev)
    window = mapped.extent(0, 94 * MIB)
    mapped.wait_packed(3, side)
    tokens.read_tags([window, mapped.extent(94 * MIB, 4 * MIB)], side)
    mapped.wait_packed(3, torch.cuda.current_stream(dev))
    out = torch.empty(94 * MIB, dtype=torch.uint8, device=dev)
    out.copy_(window)
    torch.cuda.synchronize()
    del window, out
    gc.collect()
    torch.cuda.synchronize()
    return {"free_mib_held": round(torch.cuda.mem_get_info(dev)[0] / MIB)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, default=0, help="the decode process's GPU")
    ap.add_argument("--peer-device", type=int, default=0, help="the prefill process's GPU")
    ap.add_argument("--settle-s", type=float, default=3.0,
                    help="seconds between the peer's death and reading its GPU")
    ap.add_argument("--out")
    return ap.parse_args(argv)


def freed_on_peer_gpu(used: dict) -> dict:
    """What the peer's death and the decode side's unmap each gave back to the peer's
    GPU, from ``peer_gpu_used_mib``'s three readings (None where one is missing)."""
    alive, dead, unmapped = (used.get(k) for k in ("both_alive", "peer_killed", "unmapped"))
    return {"by_death": None if alive is None or dead is None else alive - dead,
            "by_unmap": None if dead is None or unmapped is None else dead - unmapped}


def main() -> int:
    from gpu_memory import gpu_used_on  # beside this file; nvidia-smi, no CUDA context

    a = parse_args()
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    p = ctx.Process(target=prefill, args=(a.peer_device, 1024 * MIB, p_child))
    p.start()
    export = p_conn.recv()
    d = ctx.Process(target=decode, args=(a.device, export, d_child))
    d.start()
    result: dict = {"prefill_gpu": a.peer_device, "decode_gpu": a.device}
    kind, part = d_conn.recv()
    result.update(part)
    used: dict = {}
    if kind == "ready":
        used["both_alive"] = gpu_used_on(str(a.peer_device))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        time.sleep(a.settle_s)  # the driver tears the dead context down
        used["peer_killed"] = gpu_used_on(str(a.peer_device))
        d_conn.send("killed")
        kind, part = d_conn.recv()  # the decode side has dropped the mapping
        result.update(part)
        time.sleep(a.settle_s)
        used["unmapped"] = gpu_used_on(str(a.peer_device))
        result["peer_gpu_used_mib"] = used
        result["freed_on_peer_gpu_mib"] = freed_on_peer_gpu(used)
    d.join(60)
    result["decode_exitcode"] = d.exitcode
    text = json.dumps(result, indent=1, sort_keys=True)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if result.get("bytes_equal_after_event_wait") else 1


if __name__ == "__main__":
    sys.exit(main())
