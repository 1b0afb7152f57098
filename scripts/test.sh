#!/usr/bin/env bash
# The test command (README, .ci/run): install everything, then run the suite against the
# real classes of every vLLM release of the supported matrix.
#
# usage: scripts/test.sh [VLLM_VERSION ...]     (default: the matrix below)
# env:   KVCACHED_PD_VENVS  where the per-version venvs live (default .venv-test/)
#        REUSE_VENVS=1      keep an existing venv instead of rebuilding it
#        FRESH_VENVS=1      build every venv from nothing instead of from the previous one
# Needs: python3 (3.11 or newer: vLLM 0.32+ requires it), network access to the package
# index only (PyPI or the index pip is configured with); torch is installed once and
# shared. Times: README, "Test it".
#
# Three kinds of pytest process:
# 1. once, the release-independent tests (RELEASE_INDEPENDENT below) with vLLM hidden
#    (-p tests.support.no_vllm: `import vllm` fails there, so a test that passes cannot
#    depend on the release; one that needs vLLM fails and is moved out of the list);
# 2. per release, the tests that build NIXL agents inside the pytest process
#    (tests/test_connector_*.py, tests/test_nixl_registration*.py);
# 3. per release, everything else.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
MATRIX=("$@")
# Newest first: each venv is copied from the one before and pip then changes only what
# this release requires differently (about 10-30 s instead of 60-130 s a release).
# 0.20 (split nixl package), 0.23 (kv_lease, FlashAttention blocks-first), 0.26 (GPU-
# validated; pull/push share a base), 0.28 (last release of that code layout), 0.30
# (layout resolved in the EngineCore, model-runner-V2 allocation), 0.31-0.33 (handshake
# counter, logging configured late, 0.33's strided descriptors and torch 2.14 pin).
[ ${#MATRIX[@]} -gt 0 ] || MATRIX=(0.33.0 0.32.0 0.31.0 0.30.0 0.28.0 0.26.0 0.23.0 0.20.2)
VENVS=${KVCACHED_PD_VENVS:-$REPO/.venv-test}
mkdir -p "$VENVS"
VENVS=$(cd "$VENVS" && pwd)
export HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1

# Tests that never import vLLM: run once (group 1 above).
RELEASE_INDEPENDENT=(
  tests/transport/test_extent_tag.py tests/transport/test_format.py
  tests/transport/test_layout.py tests/transport/test_pack.py
  tests/transport/test_pack_kernels.py tests/transport/test_sizing.py
  tests/transport/test_staging.py
  tests/test_side_channel_fuzz.py tests/test_wire_fuzz.py tests/test_settings.py
  tests/test_operator_docs.py tests/test_config_and_versions.py tests/test_descriptor_bounds.py
  experiments/tests/test_bench_handoff.py experiments/tests/test_colocated.py
  experiments/tests/test_gpu_memory.py
  experiments/tests/test_load_harness.py experiments/tests/test_model_runner_env.py
  experiments/tests/test_offline_harness.py experiments/tests/test_trace_timeline.py
  experiments/tests/test_ucx_fault_injector.py
)
# The test files whose tests build NIXL agents in the pytest process (group 2).
NIXL_IN_PROCESS=(tests/test_connector_*.py tests/test_nixl_registration*.py)

# kvcached only ships a source archive that builds against a CUDA torch; the tests
# use its pure-Python modules (tests/support/kvcached_cpu.py).
python3 tests/support/fetch_kvcached.py 0.1.6 "$REPO/.cache" 2>&1 | grep -v "Location" || true
export KVCACHED_SRC="$REPO/.cache/kvcached-0.1.6"
[ -f "$KVCACHED_SRC/kvcached/__init__.py" ] || { echo "kvcached source not fetched" >&2; exit 1; }

status=0
summary=()
run_pytest() {  # label, venv, pytest arguments...
  local label=$1 venv=$2 rc=0 start=$SECONDS
  shift 2
  echo "=== $label"
  "$venv/bin/python" -m pytest "$@" -q -p no:cacheprovider -o junit_family=xunit2 \
      --junitxml="$VENVS/results-${label//[^A-Za-z0-9.]/_}.xml" || rc=$?
  if [ "$rc" = 5 ]; then
    echo "$label: pytest collected no tests; that is a failure here" >&2
  fi
  summary+=("$label: pytest exit $rc, $((SECONDS - start)) s")
  [ "$rc" = 0 ] || status=1
}

previous=
for version in "${MATRIX[@]}"; do
  venv="$VENVS/vllm-$version"
  if [ "${REUSE_VENVS:-0}" != 1 ] || [ ! -x "$venv/bin/python" ]; then
    rm -rf "$venv"
    echo "=== installing vLLM $version into $venv${previous:+ (from $(basename "$previous"))}"
    start=$SECONDS
    base=()
    [ -z "$previous" ] || [ "${FRESH_VENVS:-0}" = 1 ] || base=("$previous")
    bash scripts/install_test_env.sh "$venv" "$version" "$VENVS/shared-torch-2.13.0" "${base[@]}"
    echo "    (installed in $((SECONDS - start)) s)"
  fi
  previous=$venv
  if [ "$version" = "${MATRIX[0]}" ]; then
    run_pytest "release-independent (vLLM hidden)" "$venv" -p tests.support.no_vllm \
        "${RELEASE_INDEPENDENT[@]}"
  fi
  run_pytest "vLLM $version (nixl)" "$venv" "${NIXL_IN_PROCESS[@]}"
  ignore=()
  for path in "${NIXL_IN_PROCESS[@]}" "${RELEASE_INDEPENDENT[@]}"; do ignore+=(--ignore="$path"); done
  run_pytest "vLLM $version (rest)" "$venv" tests experiments/tests "${ignore[@]}"
done
printf '%s\n' "${summary[@]}"
echo "test command: $SECONDS s in all"
exit $status
