#!/usr/bin/env python3
"""Shrink a wheel for the Hopper-only GPU host, which takes uploads of <= 64 MiB per command.

Only files that the host never loads are dropped, and RECORD is rewritten so pip still
verifies the wheel:

- vllm: FlashAttention-2's kernels (Hopper runs FA3, which stays), deep_gemm builds for
  other CPython versions, and the Rust frontend binary ``vllm-rs`` (run only with
  VLLM_USE_RUST_FRONTEND=1 or VLLM_USE_RUST_BENCH=1).
- triton: static archives (only linked, never loaded), ``ptxas-blackwell`` (Triton calls it
  for sm_100 and newer only: backends/nvidia/compiler.py get_ptxas), the CUPTI copy in
  ``lib/cupti-blackwell`` (Triton 3.8+; its profiler points CUPTI there for sm_100 and newer
  only: profiler/profile.py) and two test libraries.
- nixl_cu13 / nixl_cu12: the NIXL-EP extensions built for other torch releases than the
  host's (``--torch``): nixl_ep imports only ``nixl_ep_cpp_torch<major><minor>`` of the
  running torch, so the others can never load there.

A wheel of any other distribution is refused. Dropping is by name, so a pattern that no
longer matches anything is reported (``removed 0 files``) rather than silently ignored.

usage: slim_wheel.py IN.whl OUT_DIR [--python cp312] [--torch 2.14]
"""

from __future__ import annotations

import argparse
import os
import re
import zipfile


def drop_rules(dist: str, pyver: str, torch_mm: str) -> list[re.Pattern[str]]:
    if dist == "vllm":
        return [re.compile(r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"),
                re.compile(r"^vllm/third_party/deep_gemm/_C\.cpython-(?!%s-)\d+-x86_64-linux-gnu\.so$"
                           % pyver),
                re.compile(r"^vllm/vllm-rs$")]
    if dist == "triton":
        return [re.compile(r"^triton/backends/nvidia/lib/cupti/[^/]+\.a$"),
                re.compile(r"^triton/backends/nvidia/bin/ptxas-blackwell$"),
                re.compile(r"^triton/backends/nvidia/lib/cupti-blackwell/"),
                re.compile(r"^triton/instrumentation/libGPUInstrumentationTestLib\.so$"),
                re.compile(r"^triton/plugins/libTritonPluginsTestLib\.so$")]
    if dist in ("nixl_cu13", "nixl_cu12"):
        return [re.compile(r"^nixl_ep_cu1\d/nixl_ep_cpp_torch(?!%s\.)\d+\.cpython-[^/]+\.so$"
                           % torch_mm)]
    raise SystemExit(f"slim_wheel.py: no rules for {dist!r} (only vllm, triton, nixl_cu1x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("out_dir")
    ap.add_argument("--python", default="cp312", help="the host's CPython tag")
    ap.add_argument("--torch", default="2.11", help="the torch release the host will run")
    a = ap.parse_args()
    dist = os.path.basename(a.wheel).split("-")[0].lower()
    drop = drop_rules(dist, a.python[2:], "".join(a.torch.split(".")[:2]))
    os.makedirs(a.out_dir, exist_ok=True)
    dst = os.path.join(a.out_dir, os.path.basename(a.wheel))
    with zipfile.ZipFile(a.wheel) as zin:
        removed = {n for n in zin.namelist() if any(p.match(n) for p in drop)}
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for info in zin.infolist():
                if info.filename in removed:
                    continue
                data = zin.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    kept = [line for line in data.decode().splitlines()
                            if line.split(",")[0] not in removed]
                    data = ("\n".join(kept) + "\n").encode()
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    print(f"removed {len(removed)} files: {sorted(removed)}")
    print(f"{a.wheel}: {os.path.getsize(a.wheel) / 2**20:.1f} MiB -> "
          f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
