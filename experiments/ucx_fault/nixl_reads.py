#!/usr/bin/env python3
"""Real NIXL READs on host memory, one per chunk, reporting each one's outcome: the
proof that the UCX fault injector (ucx_fault_injector.c) fails the transfers it should
and no others. Run it with the injector preloaded, e.g.

    LD_PRELOAD=libkvpd_ucx_fault.so KVPD_UCX_FAULT_EVERY=3 python nixl_reads.py --reads 10

Two NIXL agents (UCX backend) in this process: "src" registers a DRAM tensor whose chunk
i holds the byte pattern of i, "dst" registers a zeroed one and READs chunk i from src,
one transfer per chunk, each waited for before the next (with one descriptor per READ,
UCX get i is READ i; --descs K splits each READ into K descriptors).
Prints one JSON object: per READ, the state ("DONE", "ERR", or "RAISED: ..." when NIXL
raised) and whether dst's chunk then equals src's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def run(reads: int, chunk_bytes: int, timeout_s: float, descs: int = 1,
        num_threads: int = 0) -> dict:
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=True, backends=["UCX"], num_threads=num_threads)
    src_agent, dst_agent = nixl_agent("src", cfg), nixl_agent("dst", cfg)
    src = torch.empty((reads, chunk_bytes), dtype=torch.uint8)
    for i in range(reads):  # distinct, nonzero content per chunk
        src[i] = (torch.arange(chunk_bytes, dtype=torch.int64) * 7 + i + 1) % 251 + 1
    dst = torch.zeros_like(src)
    src_agent.register_memory(src)
    dst_agent.register_memory(dst)
    remote = dst_agent.add_remote_agent(src_agent.get_agent_metadata())
    results = []
    for i in range(reads):
        local_descs = dst_agent.get_xfer_descs(list(dst[i].chunk(descs)))
        remote_descs = src_agent.get_xfer_descs(list(src[i].chunk(descs)))
        handle = dst_agent.initialize_xfer("READ", local_descs, remote_descs, remote)
        try:
            state = dst_agent.transfer(handle)
            t_end = time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < t_end:
                state = dst_agent.check_xfer_state(handle)
        except Exception as exc:  # NIXL raises on some backend errors
            state = f"RAISED: {type(exc).__name__}: {exc}"
        results.append({"read": i + 1, "state": state,
                        "bytes_match": bool(torch.equal(dst[i], src[i]))})
        try:
            dst_agent.release_xfer_handle(handle)
        except Exception:
            pass  # a failed transfer's handle may refuse release; it dies with the agent
    return {"reads": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=10)
    ap.add_argument("--chunk-bytes", type=int, default=4096)
    ap.add_argument("--descs", type=int, default=1,
                    help="descriptors per READ (each chunk split in this many pieces)")
    ap.add_argument("--num-threads", type=int, default=0,
                    help="the UCX backend's threads (vLLM's NIXL connector sets 4)")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="per READ")
    a = ap.parse_args()
    print(json.dumps(run(a.reads, a.chunk_bytes, a.timeout_s, a.descs, a.num_threads)),
          flush=True)


if __name__ == "__main__":
    main()
