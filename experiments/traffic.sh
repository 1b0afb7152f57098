#!/usr/bin/env bash
# The load run (pd_load.py) in one command on the GPU host, packed for hand-back.
# Installs nothing; makes the test models only if they are missing. One run stays inside
# TRAFFIC_BUDGET_S (default 540 s): pd_load.py's own deadline reports what no longer fits
# as not run, and an outer `timeout` sends SIGTERM 40 s later if anything hangs (pd_load
# then stops every server and still writes its summary).
#
# usage: bash experiments/traffic.sh OUT [pd_load.py options]
#   e.g. the issue's abort case, 5 times:  traffic.sh OUT --issue-aborts --repeats 5
#        TTFT batch on kvbig:              traffic.sh OUT --model /tmp/kvbig --ttft-batch 8
#        peer killed:                      traffic.sh OUT --kill decode --kill-at-s 1
#        UCX faults on D:                  traffic.sh OUT --ucx-fault-lib kvpd --ucx-fault-every 8
#          (kvpd: experiments/ucx_fault's injector, built here or prebuilt; or a path to
#          vLLM's libucx_fault_injector.so)
#   WORK (TRAFFIC_WORK, default /tmp/kvpd-load/<time>-<pid>: two session lanes starting
#     in the same second shared /tmp/kvpd-load/<time> on 2026-11-27, and their servers
#     appended to each other's logs) gets the full tree:
#     load/  summary.txt, summary.json, latency.csv, modes/*.json, logs/, environment.json
#     traffic.log  everything printed
#   OUT gets it packed (pack_results.sh: at most 8 files): results.tar.gz (all of WORK),
#     load-summary.txt, load-latency.csv, load-timeline.txt (with --trace), traffic.log
#
# Environment knobs: TRAFFIC_BUDGET_S=540, TRAFFIC_WORK=..., PYTHON=python3,
#   TINY_MODEL=/tmp/tiny KVBIG_MODEL=/tmp/kvbig (made if missing),
#   KVCACHED_PD_FROM=checkout (this checkout first on PYTHONPATH) | installed
# Exit status: pd_load.py's (0 every mode passed, 1 a mode failed, 2 a check could not be made).
set -uo pipefail
OUT=${1:?usage: traffic.sh OUT [pd_load.py options]}
shift
WORK=${TRAFFIC_WORK:-/tmp/kvpd-load/$(date +%Y%m%d-%H%M%S)-$$}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
PY=${PYTHON:-python3}
BUDGET=${TRAFFIC_BUDGET_S:-540}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$WORK/traffic.log") 2>&1
T0=$(date +%s)

if [ "${KVCACHED_PD_FROM:-checkout}" = checkout ]; then
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "traffic: $(date '+%F %T') WORK=$WORK OUT=$OUT PYTHONPATH=${PYTHONPATH:-} budget=${BUDGET}s args: $*"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader || true

TINY_MODEL=${TINY_MODEL:-/tmp/tiny}
KVBIG_MODEL=${KVBIG_MODEL:-/tmp/kvbig}
for spec in "$TINY_MODEL tiny" "$KVBIG_MODEL kvbig"; do
  read -r path preset <<< "$spec"
  if [ ! -f "$path/config.json" ]; then
    echo "making test model $path ($preset)"
    "$PY" "$HERE/gpu_host/make_test_model.py" "$path" --preset "$preset" 2>&1 | tail -1
  fi
done

LEFT=$(( BUDGET - ($(date +%s) - T0) ))
timeout --signal=TERM --kill-after=20 $(( LEFT + 40 )) \
  "$PY" "$HERE/pd_load.py" --out "$WORK/load" --model "$TINY_MODEL" --deadline-s "$LEFT" "$@"
RC=$?
echo
echo "=== traffic finished in $(( $(date +%s) - T0 ))s: pd_load rc=$RC"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader || true
bash "$HERE/pack_results.sh" "$WORK" "$OUT"
exit "$RC"
