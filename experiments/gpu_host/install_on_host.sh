#!/usr/bin/env bash
# Run ON the offline GPU host, from the uploaded checkout, once every folder made by
# make_upload.sh has been copied into /tmp/wh (WH=... to use another place).
#
#   bash experiments/gpu_host/install_on_host.sh [--force-models]
#
# 1. checks the uploads against MANIFEST.sha256 (names a missing upload folder at once);
# 2. reassembles and verifies the slim vLLM wheel, installs every wheel with
#    pip --no-index --no-deps into the host's python (torch 2.11.0+cu130 is already there);
# 3. builds kvcached 0.1.6 from source against the host's torch (about 20 s);
# 4. installs kvcached-pd from this checkout (--no-deps --no-build-isolation);
# 5. writes the test models: /tmp/tiny (equivalence) and /tmp/kvbig (transfer benchmark).
# Safe to run again (e.g. after uploading a newer checkout: only step 4 changes).
set -euo pipefail
WH=${WH:-/tmp/wh}
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
FORCE_MODELS=0
[ "${1:-}" = "--force-models" ] && FORCE_MODELS=1
t0=$(date +%s)
cd "$WH"

if [ -f MANIFEST.sha256 ]; then
  missing=0
  while read -r sum name; do
    if [ -f "$name" ]; then continue; fi
    # the vLLM parts are consumed once the wheel is reassembled
    if [[ "$name" == vllm.whl.* ]] && [ -f vllm.name ] && [ -f "$(cat vllm.name)" ]; then continue; fi
    echo "missing from $WH: $name" >&2; missing=1
  done < MANIFEST.sha256
  [ $missing = 0 ] || { echo "some uploads did not arrive: upload every upN folder again" >&2; exit 1; }
  grep -v ' vllm\.whl\.' MANIFEST.sha256 | grep -v ' MANIFEST.sha256$' | sha256sum --quiet -c -
else
  echo "warning: no MANIFEST.sha256 in $WH (made by an older script?): not checking uploads" >&2
fi

if ls vllm.whl.* >/dev/null 2>&1; then
  cat vllm.whl.* > "$(cat vllm.name)"
  rm -f vllm.whl.*
fi
echo "$(cat vllm.sha256)  $(cat vllm.name)" | sha256sum -c -
"$PY" -m pip install -q --no-index --no-deps --no-cache-dir ./*.whl

# kvcached ships as a source archive: build it against the host's CUDA torch, offline.
if ! "$PY" -c "import kvcached.integration.vllm.interfaces" 2>/dev/null; then
  # One of the two paths is always missing, so ls fails: under pipefail that ended this
  # script silently on the host (2026-11-21), before kvcached was built.
  libcuda=$( (ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null || true) | head -1)
  [ -n "$libcuda" ] || { echo "no libcuda.so.1 found: cannot build kvcached" >&2; exit 1; }
  ln -sf "$libcuda" /tmp/libcuda.so
  LIBRARY_PATH=/tmp:/usr/local/cuda/lib64/stubs:${LIBRARY_PATH:-} \
    "$PY" -m pip install -q --no-build-isolation --no-index --no-deps --no-cache-dir ./kvcached-*.tar.gz
fi

# kvcached-pd from this checkout. --no-build-isolation: build with the host's setuptools
# (installed above), as there is no index to fetch a build environment from.
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir "$REPO"

"$PY" - <<'PYEOF'
import importlib
for mod in ("torch", "vllm", "nixl", "kvcached.integration.vllm.interfaces", "wrapt", "kvcached_pd"):
    m = importlib.import_module(mod)
    print(f"{mod:<40} {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
PYEOF

make_model() {  # OUT PRESET
  if [ $FORCE_MODELS = 1 ] || [ ! -f "$1/config.json" ] || [ ! -f "$1/kvpd_model_info.json" ]; then
    rm -rf "$1"
    "$PY" "$REPO/experiments/gpu_host/make_test_model.py" "$1" --preset "$2" 2>&1 | grep -v "Writing model shards" | tail -1
  else
    echo "$1 exists (--force-models to rebuild)"
  fi
}
make_model /tmp/tiny tiny
make_model /tmp/kvbig kvbig
echo "install_on_host.sh: done in $(( $(date +%s) - t0 ))s"
