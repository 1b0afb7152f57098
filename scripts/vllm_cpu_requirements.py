#!/usr/bin/env python3
"""Print vLLM's own Requires-Dist minus the GPU-only packages, for a CPU test venv.

vLLM is installed with ``--no-deps`` (its wheel pins a CUDA torch); this lists what
it declares, so pip can install the rest against the CPU build of torch. Read from
the installed distribution's metadata; nothing of vLLM is imported.
"""

import re
from importlib.metadata import distribution

GPU_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "triton",
    "flashinfer-python", "flashinfer-cubin", "tilelang", "nvidia-cudnn-frontend", "nvtx",
    "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl", "quack-kernels",
    "tokenspeed-mla", "humming-kernels", "numba",
    "xgrammar",  # its declared deps pull triton; installed separately with --no-deps
}

for requirement in distribution("vllm").requires or []:
    if "extra ==" in requirement:
        continue
    name = re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
    if name not in GPU_ONLY:
        print(requirement)
