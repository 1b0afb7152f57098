#!/usr/bin/env bash
# Everything the GPU host should run in one command, after install_on_host.sh:
# the equivalence harness over all modes (5 at a time by default), then the transfer
# benchmark. Installs nothing; makes the test models only if they are missing.
# Designed for one ~10-minute command: both parts run under deadlines that share
# RUN_ALL_BUDGET_S (default 540 s), so results are written even when time runs short.
#
# usage: bash experiments/run_all_on_host.sh OUT [WORK]
#   WORK (default /tmp/kvpd-results/<time>) gets the full tree:
#     equivalence/  summary.txt, summary.json, modes/*.json, logs/, environment.json
#     bench/        summary.txt, bench.csv, bench.json, bench_gbps.png, ttft.csv, logs/
#     run_all.log   everything printed
#   OUT gets it packed (pack_results.sh), since the host hands back at most 8 files:
#     results.tar.gz (all of WORK), equivalence-summary.txt, bench-summary.txt,
#     bench_gbps.png, bench.csv, run_all.log
#
# Environment knobs (all optional):
#   RUN_ALL_BUDGET_S=540   whole budget; EQ_DEADLINE_S=240 caps the equivalence part,
#                          the benchmark gets what is left (at most BENCH_DEADLINE_S=300)
#   EQ_MODES="all"         e.g. "vanilla kvcached-pd-staged negative"
#   EQ_PARALLEL=5          modes started at once (0 = all; 8 kvcached instances
#                          starting at once ran out of device memory on the host)
#   BENCH_MODES=...        e.g. "vanilla,kvcached-pd-staged"
#   BENCH_SIZES=...        KV MiB per request, e.g. "1,16,256,1024"
#   EQ_ARGS=... BENCH_ARGS=...  extra options (split on spaces), e.g. EQ_ARGS="--kv-both"
#   TINY_MODEL=/tmp/tiny KVBIG_MODEL=/tmp/kvbig   the test models (made if missing)
#   KVCACHED_PD_FROM=checkout  put this checkout first on PYTHONPATH (its sitecustomize.py
#                          activates kvcached-pd); "installed" uses the pip-installed copy
# Exit status: 0 all good, 1 equivalence failed, 2 only the benchmark failed.
set -uo pipefail
OUT=${1:?usage: run_all_on_host.sh OUT [WORK]}
WORK=${2:-/tmp/kvpd-results/$(date +%Y%m%d-%H%M%S)}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
PY=${PYTHON:-python3}
BUDGET=${RUN_ALL_BUDGET_S:-540}
EQ_DEADLINE_S=${EQ_DEADLINE_S:-240}
BENCH_DEADLINE_S=${BENCH_DEADLINE_S:-300}
mkdir -p "$OUT" "$WORK/bench"
exec > >(tee -a "$WORK/run_all.log") 2>&1
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }

if [ "${KVCACHED_PD_FROM:-checkout}" = checkout ]; then
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "run_all_on_host: $(date '+%F %T') WORK=$WORK OUT=$OUT PYTHONPATH=${PYTHONPATH:-} budget=${BUDGET}s"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader || true
nvidia-smi topo -m > "$WORK/nvidia-smi-topo.txt" 2>&1 || true

TINY_MODEL=${TINY_MODEL:-/tmp/tiny}
KVBIG_MODEL=${KVBIG_MODEL:-/tmp/kvbig}
for spec in "$TINY_MODEL tiny" "$KVBIG_MODEL kvbig"; do
  set -- $spec
  if [ ! -f "$1/config.json" ]; then
    echo "making test model $1 ($2)"
    "$PY" "$HERE/gpu_host/make_test_model.py" "$1" --preset "$2" 2>&1 | tail -1
  fi
done

EQ_BUDGET=$(( BUDGET - $(elapsed) ))
[ "$EQ_BUDGET" -gt "$EQ_DEADLINE_S" ] && EQ_BUDGET=$EQ_DEADLINE_S
echo "=== equivalence (deadline ${EQ_BUDGET}s) at +$(elapsed)s"
# shellcheck disable=SC2086  # EQ_MODES and EQ_ARGS are lists of words
bash "$HERE/equivalence.sh" "$WORK/equivalence" ${EQ_MODES:-all} --model "$TINY_MODEL" \
  --parallel "${EQ_PARALLEL:-5}" --deadline-s "$EQ_BUDGET" ${EQ_ARGS:-}
EQ_RC=$?
echo "equivalence exit status $EQ_RC at +$(elapsed)s"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader || true

BENCH_BUDGET=$(( BUDGET - $(elapsed) - 5 ))
[ "$BENCH_BUDGET" -gt "$BENCH_DEADLINE_S" ] && BENCH_BUDGET=$BENCH_DEADLINE_S
BENCH_RC=0
if [ "$BENCH_BUDGET" -lt 90 ]; then
  echo "=== transfer benchmark skipped: only ${BENCH_BUDGET}s left"
  BENCH_RC=3
else
  echo "=== transfer benchmark (deadline ${BENCH_BUDGET}s) at +$(elapsed)s"
  args=(--out "$WORK/bench" --model "$KVBIG_MODEL" --deadline-s "$BENCH_BUDGET")
  [ -n "${BENCH_MODES:-}" ] && args+=(--modes "$BENCH_MODES")
  [ -n "${BENCH_SIZES:-}" ] && args+=(--sizes "$BENCH_SIZES")
  # shellcheck disable=SC2086
  "$PY" "$HERE/bench_transfer.py" "${args[@]}" ${BENCH_ARGS:-} 2>&1 | tee -a "$WORK/bench/harness.log"
  BENCH_RC=${PIPESTATUS[0]}
fi

echo
echo "=== run_all_on_host finished in $(elapsed)s: equivalence rc=$EQ_RC, benchmark rc=$BENCH_RC"
[ -f "$WORK/equivalence/summary.txt" ] && head -1 "$WORK/equivalence/summary.txt"
echo "full results: $WORK; packed into $OUT:"
bash "$HERE/pack_results.sh" "$WORK" "$OUT"
if [ "$EQ_RC" -ne 0 ]; then exit 1; fi
if [ "$BENCH_RC" -ne 0 ]; then exit 2; fi
exit 0
