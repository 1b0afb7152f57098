#!/usr/bin/env python3
"""Shrink a vLLM wheel for the Hopper-only GPU host, which takes uploads of <= 64 MiB.

Drops FlashAttention-2's kernels (Hopper runs FA3) and deep_gemm builds for other
CPython versions, and rewrites RECORD so pip still verifies the wheel.

usage: slim_vllm_wheel.py IN.whl OUT_DIR [--python cp312]
"""

from __future__ import annotations

import argparse
import os
import re
import zipfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("out_dir")
    ap.add_argument("--python", default="cp312", help="the host's CPython tag")
    a = ap.parse_args()
    pyver = a.python[2:]
    drop = [re.compile(r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"),
            re.compile(r"^vllm/third_party/deep_gemm/_C\.cpython-(?!%s)\d+-x86_64-linux-gnu\.so$"
                       % pyver)]
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
