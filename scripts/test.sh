#!/usr/bin/env bash
# The test command (README, .ci/run): install everything, then run the suite against the
# real classes of every vLLM release of the supported matrix.
#
# usage: scripts/test.sh [VLLM_VERSION ...]     (default: the matrix below)
# env:   KVCACHED_PD_VENVS  where the per-version venvs live (default .venv-test/)
#        REUSE_VENVS=1      keep an existing venv instead of rebuilding it
#        FRESH_VENVS=1      build every venv from nothing instead of from the previous one
#        KEEP_VENVS=1       keep each release's venv after its tests (default: removed
#                           once the next release's venv was built from it; REUSE_VENVS=1
#                           keeps them too)
# Needs: python3 (3.11 or newer: vLLM 0.32+ requires it), network access to the package
# index only (PyPI or the index pip is configured with); torch is installed once and
# shared. Times: README, "Test it".
#
# Three kinds of pytest process (each one's output printed whole once it ends):
# 1. once, the release-independent tests (RELEASE_INDEPENDENT below) with vLLM hidden, in
#    two processes
#    (-p tests.support.no_vllm: `import vllm` fails there, so a test that passes cannot
#    depend on the release; one that needs vLLM fails and is moved out of the list);
# 2. per release, the tests that build NIXL agents inside the pytest process
#    (tests/test_connector_*.py, tests/test_nixl_registration*.py), in two processes;
# 3. per release, everything else, in two processes.
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
  tests/transport/test_pack_kernels.py tests/transport/test_pack_graph.py
  tests/transport/test_sizing.py
  tests/transport/test_staging.py tests/transport/test_cuda_ipc.py
  tests/test_side_channel_fuzz.py tests/test_wire_fuzz.py tests/test_settings.py
  tests/test_operator_docs.py tests/test_config_and_versions.py tests/test_descriptor_bounds.py
  experiments/tests/test_bench_handoff.py experiments/tests/test_colocated.py
  experiments/tests/test_gpu_memory.py
  experiments/tests/test_load_harness.py experiments/tests/test_model_runner_env.py
  experiments/tests/test_offline_harness.py experiments/tests/test_trace_timeline.py
  experiments/tests/test_ttft_batch_timeline.py
  experiments/tests/test_ucx_fault_injector.py experiments/tests/test_session_driver.py
  experiments/tests/test_bench_pack_latency.py experiments/tests/test_chunk_split.py
  experiments/tests/test_bench_remote_unpack.py experiments/tests/test_compare_loads.py
  experiments/tests/test_critical_path.py experiments/tests/test_bench_claim_latency.py
  experiments/tests/test_host_cpu.py experiments/tests/test_cudagraph_modes.py
  experiments/tests/test_pyspy_summary.py
  tests/test_test_command.py tests/test_test_ports.py
)
# Group 1 runs as two processes side by side, beside the last release's groups: these
# files (the session driver's and the colocated harness's scripts run for real, with
# sleeps) took 106 of its 193 s alone (2026-11-27); as one process it was the longest
# group of the whole run (251 s beside 0.20.2's, whose longest took 196 s).
INDEPENDENT_SCRIPTS=(experiments/tests/test_session_driver.py experiments/tests/test_colocated.py
                     experiments/tests/test_ucx_fault_injector.py tests/test_test_command.py)
INDEPENDENT_OTHERS=()
for path in "${RELEASE_INDEPENDENT[@]}"; do
  [[ " ${INDEPENDENT_SCRIPTS[*]} " == *" $path "* ]] || INDEPENDENT_OTHERS+=("$path")
done
for path in "${INDEPENDENT_SCRIPTS[@]}"; do  # each must stay in RELEASE_INDEPENDENT
  [[ " ${RELEASE_INDEPENDENT[*]} " == *" $path "* ]] \
    || { echo "scripts/test.sh: INDEPENDENT_SCRIPTS names $path, not in RELEASE_INDEPENDENT" >&2; exit 1; }
done
# The test files whose tests build NIXL agents in the pytest process (group 2).
NIXL_IN_PROCESS=(tests/test_connector_*.py tests/test_nixl_registration*.py)
# Group 2 runs as two processes side by side: NIXL_WAITS (the files whose tests run past
# KV leases: most of their time is waiting) and the others. As one process it was the
# longest group of every release with push mode (231-275 s, the rest 194-214 s, 2 cores,
# 2026-11-27); split, on vLLM 0.26.0 beside the rest: 132 s and 104 s (the rest 149 s),
# against 201 s (the rest 138 s) as one. Every file of NIXL_IN_PROCESS not named here
# runs in the other half, so a new file is never left out. The waiting half as two
# processes (test_connector_pd.py apart, 2026-11-29) was slower: with a fifth process
# every group ran longer on the 2 cores (vLLM 0.33.0's longest 209 -> 287 s, 0.32.0's
# 206 -> 252 s, the next venv's install beside them 107-162 -> 171-198 s, fresh clones):
# a release is CPU-bound once its groups run side by side, though its waiting group
# alone takes 202 s of wall for 107 s of CPU (0.30.0).
NIXL_WAITS=(tests/test_connector_pd.py tests/test_connector_push.py
            tests/test_connector_push_ipc.py tests/test_connector_push_concurrent.py
            tests/test_connector_mixed.py tests/test_connector_metrics.py)
NIXL_OTHERS=()
for path in "${NIXL_IN_PROCESS[@]}"; do
  [[ " ${NIXL_WAITS[*]} " == *" $path "* ]] || NIXL_OTHERS+=("$path")
done
for path in "${NIXL_WAITS[@]}"; do  # a renamed file must not drop out of both halves
  [ -f "$path" ] || { echo "scripts/test.sh: NIXL_WAITS names $path, which is gone" >&2; exit 1; }
done
# Group 3 runs as two processes side by side too: REST_CHILDREN (files whose tests start
# Python processes that import vLLM, so CPU-bound) and the others. As one process it was
# every release's longest group (195-250 s beside the two NIXL halves, 2 cores, fresh
# clone 2026-11-27; on vLLM 0.30.0 alone 139 s, 133 s of CPU), these files about half of it.
REST_CHILDREN=(tests/test_kvcached_coexistence.py tests/test_patch_lifecycle.py
               tests/test_forked_children.py)
for path in "${REST_CHILDREN[@]}"; do
  [ -f "$path" ] || { echo "scripts/test.sh: REST_CHILDREN names $path, which is gone" >&2; exit 1; }
done

# kvcached only ships a source archive that builds against a CUDA torch; the tests
# use its pure-Python modules (tests/support/kvcached_cpu.py).
python3 tests/support/fetch_kvcached.py 0.1.6 "$REPO/.cache" 2>&1 | grep -v "Location" || true
export KVCACHED_SRC="$REPO/.cache/kvcached-0.1.6"
[ -f "$KVCACHED_SRC/kvcached/__init__.py" ] || { echo "kvcached source not fetched" >&2; exit 1; }

# The disk this needs, for a message that says so instead of pip's or cp's "No space left
# on device" mid-run (how one CI run ended, 107 s in, on a machine whose disk other work
# had filled): torch ~0.9 GB once, the first venv ~1.9 GB, each later one ~0.9 GB of its
# own (hard links to the one before), at most three venvs at a time.
free_mib=$(df -Pm "$VENVS" | awk 'NR == 2 {print $4}')
echo "disk: ${free_mib} MiB free where the venvs go ($VENVS)"
if [ "${free_mib:-0}" -lt 6144 ]; then
  echo "the test command needs about 6 GiB free under $VENVS (torch, three venvs at a" \
       "time); ${free_mib} MiB are: free some, or point KVCACHED_PD_VENVS elsewhere" >&2
  exit 1
fi
keep_venvs=${KEEP_VENVS:-${REUSE_VENVS:-0}}
drop_venv() {  # the venv of one release, once its tests ended and nothing copies from it
  [ "$keep_venvs" = 1 ] || rm -rf "$VENVS/vllm-$1"
}

# One group's longest run on 2 cores has been 275 s; a run past this hung (below).
GROUP_TIMEOUT_S=${GROUP_TIMEOUT_S:-900}
status=0
summary=()
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
groups=()
start_group() {  # label, venv, pytest arguments...: run in the background
  local label=$1 venv=$2 key
  shift 2
  key=${label//[^A-Za-z0-9.]/_}
  groups+=("$label")
  (
    start=$SECONDS rc=0 first=-
    run() {
      rc=0
      timeout --signal=TERM --kill-after=30 "$GROUP_TIMEOUT_S" \
        "$venv/bin/python" -m pytest "$@" -q -p no:cacheprovider -o junit_family=xunit2 \
          --junitxml="$VENVS/results-$key.xml" > "$LOGS/$key.log" 2>&1 || rc=$?
    }
    run "$@"
    # pytest never exits with a signal's status: the process died inside native code
    # (NIXL's add_remote_agent aborting in vLLM's own handshake thread, mid-test: twice in
    # ~10 full runs until 2026-11-26, then three times in one run, 0.20.2's group twice in
    # a row; 2026-11-27, eleventh session: 0.20.2's "nixl, others" twice in a row again,
    # at different tests, after seven clean fresh-clone runs, its third run passing). Up
    # to three times more, saying so; each died run's output is kept.
    # A group that outlives GROUP_TIMEOUT_S hung (exit 124 from timeout): vLLM's own
    # handshake listener thread dies when its port was taken between the test's choice
    # and its bind, and vLLM's set_xfer_handshake_metadata then waits for it forever
    # (2026-11-27, thirteenth session: 0.26.0's "nixl, waits" at 1 min of CPU for 25
    # minutes, in test_connector_pd.py's make_engine; the test engines' ports are reserved
    # across processes since, tests/support/connector_pd.py). It is run again like a died one.
    died=0
    while { [ "$rc" -ge 128 ] || [ "$rc" = 124 ]; } && [ "$died" -lt 3 ]; do
      died=$((died + 1))
      first=$rc
      mv "$LOGS/$key.log" "$LOGS/$key.died$died.log"
      run "$@"
    done
    echo "$rc $((SECONDS - start)) $first $died" > "$LOGS/$key.rc"
  ) &
}
finish_groups() {  # wait for the groups started, print each one's output in order
  wait
  local label key rc secs
  for label in "${groups[@]}"; do
    key=${label//[^A-Za-z0-9.]/_}
    echo "=== $label"
    read -r rc secs first died < "$LOGS/$key.rc" || { rc=missing; secs=?; first=-; died=0; }
    local n
    for ((n = 1; n <= ${died:-0}; n++)); do
      if [ "$first" = 124 ]; then
        echo "--- its run $n hung: stopped after GROUP_TIMEOUT_S=$GROUP_TIMEOUT_S s; its output:"
      else
        echo "--- its run $n died with exit $first (signal $((first - 128))); its output:"
      fi
      cat "$LOGS/$key.died$n.log"
      echo "--- the run again:"
    done
    cat "$LOGS/$key.log"
    if [ "$rc" = 5 ]; then
      echo "$label: pytest collected no tests; that is a failure here" >&2
    fi
    local note=""
    [ "$first" = - ] || note=" (run $((died + 1)) times: $died died with exit $first)"
    [ "$first" != 124 ] || note=" (run $((died + 1)) times: $died hung past ${GROUP_TIMEOUT_S} s)"
    [[ "$first" = - || ! "$rc" =~ ^[0-9]+$ || "$rc" -lt 128 ]] \
      || note=" (run $((died + 1)) times: each died, the last with exit $rc)"
    summary+=("$label: pytest exit $rc, $secs s$note")
    [ "$rc" = 0 ] || status=1
  done
  groups=()
}
install() {  # version, base venv or "": build (or keep) the venv of one release
  local version=$1 base=() venv="$VENVS/vllm-$1" start=$SECONDS
  if [ "${REUSE_VENVS:-0}" = 1 ] && [ -x "$venv/bin/python" ]; then
    return 0
  fi
  rm -rf "$venv"
  [ -z "$2" ] || [ "${FRESH_VENVS:-0}" = 1 ] || base=("$2")
  echo "=== installing vLLM $version into $venv${base:+ (from $(basename "$base"))}"
  bash scripts/install_test_env.sh "$venv" "$version" "$VENVS/shared-torch-2.13.0" "${base[@]}" || return 1
  echo "    (installed in $((SECONDS - start)) s)"
}

# A release's four groups run side by side, and the next release's venv is built beside
# them: the groups wait on leases, timeouts and child processes for much of their time
# (one full run in sequence kept 2 cores 40% busy: 31 CPU-minutes in 38 minutes). The
# release-independent group runs beside the last release's (the shortest).
ignore=()
for path in "${NIXL_IN_PROCESS[@]}" "${RELEASE_INDEPENDENT[@]}" "${REST_CHILDREN[@]}"; do
  ignore+=(--ignore="$path")
done
install "${MATRIX[0]}" ""
for i in "${!MATRIX[@]}"; do
  version=${MATRIX[$i]}
  venv="$VENVS/vllm-$version"
  start_group "vLLM $version (nixl, waits)" "$venv" "${NIXL_WAITS[@]}"
  start_group "vLLM $version (nixl, others)" "$venv" "${NIXL_OTHERS[@]}"
  start_group "vLLM $version (rest, children)" "$venv" "${REST_CHILDREN[@]}"
  start_group "vLLM $version (rest)" "$venv" tests experiments/tests "${ignore[@]}"
  next=$((i + 1))
  if [ "$next" -lt "${#MATRIX[@]}" ]; then
    install "${MATRIX[$next]}" "$venv" || { echo "installing vLLM ${MATRIX[$next]} failed" >&2; status=1; }
  else
    start_group "release-independent, scripts (vLLM hidden)" "$VENVS/vllm-${MATRIX[0]}" \
        -p tests.support.no_vllm "${INDEPENDENT_SCRIPTS[@]}"
    start_group "release-independent, others (vLLM hidden)" "$VENVS/vllm-${MATRIX[0]}" \
        -p tests.support.no_vllm "${INDEPENDENT_OTHERS[@]}"
  fi
  finish_groups
  # The first release's venv runs the release-independent group at the end.
  [ "$i" = 0 ] || drop_venv "$version"
done
drop_venv "${MATRIX[0]}"
printf '%s\n' "${summary[@]}"
echo "test command: $SECONDS s in all"
exit $status
