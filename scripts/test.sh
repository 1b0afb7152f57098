#!/usr/bin/env bash
# The test command (README, .ci/run): install everything, then run the suite once per
# vLLM release of the supported matrix, against that release's real classes.
#
# usage: scripts/test.sh [VLLM_VERSION ...]     (default: the matrix below)
# env:   KVCACHED_PD_VENVS  where the per-version venvs live (default .venv-test/)
#        REUSE_VENVS=1      keep an existing venv instead of rebuilding it
# Needs: python3 (3.10 or newer), network access to the package
# index only (PyPI or the index pip is configured with), about 40 min and 10 GB for the
# five releases on a fresh 2-core machine (README: what was measured); torch is
# installed once and shared.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
MATRIX=("$@")
# 0.20 (split nixl package), 0.23 (kv_lease and the pp-aware handshake before the
# pull/push split; FlashAttention blocks-first, refused over kvcached's split-half
# memory), 0.26 (GPU-validated; pull/push share a base), 0.28 (last release of that code
# layout), 0.30 (layout resolved in the EngineCore, kvcached's model-runner-V2
# allocation, storage-wide registration)
[ ${#MATRIX[@]} -gt 0 ] || MATRIX=(0.20.2 0.23.0 0.26.0 0.28.0 0.30.0)
VENVS=${KVCACHED_PD_VENVS:-$REPO/.venv-test}
export HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1

# kvcached only ships a source archive that builds against a CUDA torch; the tests
# use its pure-Python modules (tests/support/kvcached_cpu.py).
python3 tests/support/fetch_kvcached.py 0.1.6 "$REPO/.cache" 2>&1 | grep -v "Location" || true
export KVCACHED_SRC="$REPO/.cache/kvcached-0.1.6"
[ -f "$KVCACHED_SRC/kvcached/__init__.py" ] || { echo "kvcached source not fetched" >&2; exit 1; }

# the test files whose tests build NIXL agents in the pytest process (run apart)
NIXL_IN_PROCESS=(tests/test_connector_*.py tests/test_nixl_registration*.py)

status=0
summary=()
for version in "${MATRIX[@]}"; do
  venv="$VENVS/vllm-$version"
  if [ "${REUSE_VENVS:-0}" != 1 ] || [ ! -x "$venv/bin/python" ]; then
    rm -rf "$venv"
    echo "=== installing vLLM $version into $venv"
    start=$SECONDS
    bash scripts/install_test_env.sh "$venv" "$version" "$VENVS/shared-torch-2.13.0"
    echo "    (installed in $((SECONDS - start)) s)"
  fi
  # Two processes: the tests that build NIXL agents in the test process itself, then
  # everything else. A NIXL agent a test leaves behind keeps UCX progress threads
  # polling until its process ends (seen: three of them, most of a core, through the
  # rest of a 25-minute suite on 2 cores), which starved the subprocess tests
  # (tests/test_startup_guard.py starts vLLM per case) and took CI past 90 minutes.
  start=$SECONDS
  for group in nixl rest; do
    echo "=== tests against vLLM $version ($group)"
    if [ "$group" = nixl ]; then
      selection=("${NIXL_IN_PROCESS[@]}")
    else
      selection=(tests experiments/tests)
      for path in "${NIXL_IN_PROCESS[@]}"; do selection+=(--ignore="$path"); done
    fi
    rc=0
    "$venv/bin/python" -m pytest "${selection[@]}" -q -p no:cacheprovider \
        -o junit_family=xunit2 --junitxml="$VENVS/results-vllm-$version-$group.xml" || rc=$?
    if [ "$rc" = 5 ]; then
      echo "vLLM $version ($group): pytest collected no tests; that is a failure here" >&2
    fi
    summary+=("vLLM $version ($group): pytest exit $rc")
    [ "$rc" = 0 ] || status=1
  done
  echo "    (tests of vLLM $version: $((SECONDS - start)) s)"
done
printf '%s\n' "${summary[@]}"
exit $status
