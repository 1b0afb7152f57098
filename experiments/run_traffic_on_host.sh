#!/usr/bin/env bash
# The real-traffic measurements of one host session, in three calls of < 10 minutes each
# (the host takes commands of at most 10 minutes and hands back at most 8 files).
#
# usage: bash experiments/run_traffic_on_host.sh OUT PART
#   PART a: install (if not yet), then on the tiny model (32 KiB KV/token): the load run
#           without aborts (3 repeats) and the issue's abort run (every 9th client drops
#           its P leg after 50 ms and its D leg after 10 ms; 5 repeats); vanilla PD,
#           kvcached-pd staged pull and staged push side by side, kvcached's defaults.
#   PART b: kvbig (256 KiB KV/token): 48 requests 8 at a time (3 repeats) plus the TTFT
#           batch of 8 x 3000-token prompts; then tiny with D killed mid-run.
#   PART c: equivalence (reference, staged split and contiguous, push contiguous, the
#           negative control) and the single-request benchmark at 94 MiB (vanilla, staged
#           split, staged contiguous).
#   PART d: UCX faults (tiny, 2 repeats): experiments/ucx_fault's injector, built on the
#           host (or its prebuilt copy), preloaded into P and D, fails every 8th NIXL
#           transfer (D's READs in pull modes, P's WRITEs in push); D must stay alive and
#           every completed output equal the reference.
#   PART e: kvcached-pd's connector (pull routed to it): equivalence with D's prefix cache
#           on (reference, vanilla, staged split and contiguous, mixed fleets both ways,
#           staged push contiguous, P16/D32, the negative control).
#   PART f: the single-request benchmark at 94 MiB (vanilla, the connector on kvcached's
#           contiguous layout; the run of 2026-11-23 also had the older pull hooks, since
#           deleted), then the issue's aborts x3 (tiny: vanilla, connector pull, staged push).
#   PART h: equivalence again for the modes part e found broken (mixed fleets, P16/D32).
#   PART g: UCX faults (every 8th transfer fails, both sides), D killed 1 s into a
#           128-request load, the kvbig TTFT batch (8 x 3000 tokens) with one load run.
#   PART j/k/l (2026-11-24, push mode served by kvcached-pd's connector): j: equivalence
#           with D's prefix cache (reference, vanilla, staged and push on kvcached's
#           default layout, vLLM's push without kvcached, the negative control) and the
#           94 MiB single-request benchmark; k: the issue's aborts x5 (vanilla, connector
#           pull, connector push); l: D killed 1 s into a 128-request load (pull and
#           push), UCX faults on both sides (every 8th transfer), the kvbig TTFT batch.
#   PART m/n: what l and j found no time for: the kill run alone; vLLM's push without
#           kvcached and the negative control.
#   PART p/q (2026-11-24, second session): p: equivalence with D's prefix cache and push
#           legs sent at once (--push-concurrent: D claims the staged params from P's
#           listener), then the issue's aborts x3 with concurrent push legs beside vanilla;
#           q: GPU memory per instance before a load, after it and idle (tiny, 2 repeats:
#           vanilla, connector pull and push; kvbig, 1 repeat: vanilla and pull).
#   PART r/s (vLLM 0.30.0, torch 2.13 carried): r: equivalence with D's prefix cache
#           (reference, staged pull and push with concurrent legs on kvcached's default
#           layout, the negative control, vanilla); s: the issue's aborts x2 (vanilla,
#           connector pull, connector push with concurrent legs).
#   KVPD_GPUS="P D" picks the GPUs (default "0 1"); "0 0" runs P and D on one GPU (the
#   single-GPU machines; kvcached lets the instances share it).
# Each part leaves in OUT: PART-RUN.tar.gz per run (its tree, logs included), each run's
# summary as RUN-summary.txt, commit.txt (<= 8 files, as the host hands back).
set -uo pipefail
OUT=${1:?usage: run_traffic_on_host.sh OUT a|b|c|d|e|f|g}
PART=${2:?usage: run_traffic_on_host.sh OUT a|b|c|d|e|f|g}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
W=/tmp/kvpd-traffic-$PART-$(date +%H%M%S)
mkdir -p "$W"
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
read -r P_GPU D_GPU <<< "${KVPD_GPUS:-0 1}"
GPU_ARGS=(--prefill-gpu "$P_GPU" --decode-gpu "$D_GPU")

if ! python3 -c "import vllm, kvcached.integration.vllm.interfaces, kvcached_pd" 2>/dev/null; then
  bash "$HERE/gpu_host/install_on_host.sh" > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
  tail -3 "$OUT/install.log"
fi
git -C "$HERE/.." log -1 --format='commit %H %s' 2>/dev/null | tee "$OUT/commit.txt"

case "$PART" in
a)
  TRAFFIC_BUDGET_S=$(( $(left 560) / 2 - 10 )) bash "$HERE/traffic.sh" "$W/load" \
    --model /tmp/tiny --repeats 3
  echo "rc load=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/aborts" \
    --model /tmp/tiny --issue-aborts --repeats 5
  echo "rc aborts=$?"
  ;;
b)
  TRAFFIC_BUDGET_S=$(( $(left 560) * 3 / 5 )) bash "$HERE/traffic.sh" "$W/kvbig" \
    --model /tmp/kvbig --repeats 3 --ttft-batch 8 --ttft-prompt-tokens 3000 --trace
  echo "rc kvbig=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/kill" \
    --model /tmp/tiny --modes kvpd-staged --kill decode --kill-at-s 2
  echo "rc kill=$?"
  ;;
c)
  timeout $(( $(left 560) - 170 )) bash "$HERE/equivalence.sh" "$W/eq" reference \
    kvcached-pd-staged staged-contiguous push-contiguous negative \
    --model /tmp/tiny --parallel 5 --deadline-s $(( $(left 560) - 190 ))
  echo "rc equivalence=$?"
  python3 "$HERE/bench_transfer.py" --out "$W/bench" --model /tmp/tiny --max-model-len 4096 \
    --sizes 94 --ttft-batch 0 --modes vanilla,kvcached-pd-staged,staged-contiguous \
    --deadline-s $(( $(left 560) - 15 ))
  echo "rc bench=$?"
  ;;
d)
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/ucxfault" \
    --model /tmp/tiny --repeats 2 --ucx-fault-lib kvpd --ucx-fault-on both --ucx-fault-every 8
  echo "rc ucxfault=$?"
  ;;
e)
  timeout $(( $(left 560) - 10 )) bash "$HERE/equivalence.sh" "$W/eq" reference vanilla \
    kvcached-pd-staged staged-contiguous mixed-p mixed-d push-contiguous blocksize negative \
    --model /tmp/tiny --parallel 5 --deadline-s $(( $(left 560) - 30 )) \
    --extra-serve-args=--enable-prefix-caching
  echo "rc equivalence=$?"
  ;;
f)
  python3 "$HERE/bench_transfer.py" --out "$W/bench" --model /tmp/tiny --max-model-len 4096 \
    --sizes 94 --ttft-batch 0 --modes vanilla,staged-contiguous \
    --deadline-s $(( $(left 560) * 2 / 5 ))
  echo "rc bench=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/aborts" \
    --model /tmp/tiny --issue-aborts --repeats 3
  echo "rc aborts=$?"
  ;;
g)
  TRAFFIC_BUDGET_S=$(( $(left 560) * 2 / 5 )) bash "$HERE/traffic.sh" "$W/ucxfault" \
    --model /tmp/tiny --repeats 1 --ucx-fault-lib kvpd --ucx-fault-on both --ucx-fault-every 8
  echo "rc ucxfault=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) / 3 )) bash "$HERE/traffic.sh" "$W/kill" \
    --model /tmp/tiny --modes kvpd-staged --requests 128 --kill decode --kill-at-s 1
  echo "rc kill=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/kvbig" \
    --model /tmp/kvbig --modes vanilla,kvpd-staged --repeats 1 --ttft-batch 8 \
    --ttft-prompt-tokens 3000 --trace
  echo "rc kvbig=$?"
  ;;
h)  # the modes part e failed before SupportsHMA and P's block size (commit 946c540)
  timeout $(( $(left 560) - 10 )) bash "$HERE/equivalence.sh" "$W/eq" reference \
    kvcached-pd-staged mixed-p mixed-d blocksize --model /tmp/tiny --parallel 5 \
    --deadline-s $(( $(left 560) - 30 )) --extra-serve-args=--enable-prefix-caching
  echo "rc equivalence=$?"
  ;;
j)
  timeout $(( $(left 560) - 150 )) bash "$HERE/equivalence.sh" "$W/eq" reference vanilla \
    staged-contiguous push-contiguous push-vanilla negative --model /tmp/tiny --parallel 2 \
    --deadline-s $(( $(left 560) - 170 )) --extra-serve-args=--enable-prefix-caching \
    "${GPU_ARGS[@]}" --single-gpu "$P_GPU"
  echo "rc equivalence=$?"
  python3 "$HERE/bench_transfer.py" --out "$W/bench" --model /tmp/tiny --max-model-len 4096 \
    --sizes 94 --ttft-batch 0 --modes vanilla,staged-contiguous,push-contiguous \
    --deadline-s $(( $(left 560) - 15 )) "${GPU_ARGS[@]}"
  echo "rc bench=$?"
  ;;
k)
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/aborts" \
    --model /tmp/tiny --issue-aborts --repeats 5 "${GPU_ARGS[@]}"
  echo "rc aborts=$?"
  ;;
l)
  TRAFFIC_BUDGET_S=$(( $(left 560) / 3 )) bash "$HERE/traffic.sh" "$W/kill" \
    --model /tmp/tiny --modes kvpd-staged,kvpd-push --requests 128 --kill decode \
    --kill-at-s 1 "${GPU_ARGS[@]}"
  echo "rc kill=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) / 2 )) bash "$HERE/traffic.sh" "$W/ucxfault" \
    --model /tmp/tiny --repeats 1 --ucx-fault-lib kvpd --ucx-fault-on both \
    --ucx-fault-every 8 "${GPU_ARGS[@]}"
  echo "rc ucxfault=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/kvbig" \
    --model /tmp/kvbig --repeats 1 --ttft-batch 8 --ttft-prompt-tokens 3000 --trace \
    "${GPU_ARGS[@]}"
  echo "rc kvbig=$?"
  ;;
m)  # part l's kill run found no time left after the reference (one GPU: slow starts)
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/kill" \
    --model /tmp/tiny --modes kvpd-staged,kvpd-push --requests 64 --kill decode \
    --kill-at-s 1 "${GPU_ARGS[@]}"
  echo "rc kill=$?"
  ;;
n)  # part j's modes that found no time left
  timeout $(( $(left 560) - 10 )) bash "$HERE/equivalence.sh" "$W/eq" reference push-vanilla \
    negative --model /tmp/tiny --parallel 2 --deadline-s $(( $(left 560) - 30 )) \
    --extra-serve-args=--enable-prefix-caching "${GPU_ARGS[@]}" --single-gpu "$P_GPU"
  echo "rc equivalence=$?"
  ;;
p)
  timeout $(( $(left 560) * 9 / 20 )) bash "$HERE/equivalence.sh" "$W/eq" reference \
    push-contiguous push-vanilla negative --model /tmp/tiny --parallel 2 --push-concurrent \
    --deadline-s $(( $(left 560) * 9 / 20 - 20 )) --extra-serve-args=--enable-prefix-caching \
    "${GPU_ARGS[@]}" --single-gpu "$P_GPU"
  echo "rc equivalence=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/aborts" \
    --model /tmp/tiny --modes vanilla,kvpd-push --push-concurrent --issue-aborts \
    --repeats 3 "${GPU_ARGS[@]}"
  echo "rc aborts=$?"
  ;;
q)
  TRAFFIC_BUDGET_S=$(( $(left 560) / 2 )) bash "$HERE/traffic.sh" "$W/memtiny" \
    --model /tmp/tiny --modes vanilla,kvpd-staged,kvpd-push --repeats 2 --settle-s 20 \
    "${GPU_ARGS[@]}"
  echo "rc memtiny=$?"
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/memkvbig" \
    --model /tmp/kvbig --modes vanilla,kvpd-staged --repeats 1 --settle-s 20 \
    "${GPU_ARGS[@]}"
  echo "rc memkvbig=$?"
  ;;
r)
  timeout $(( $(left 560) - 10 )) bash "$HERE/equivalence.sh" "$W/eq" reference \
    staged-contiguous push-contiguous negative vanilla --model /tmp/tiny --parallel 2 \
    --push-concurrent --deadline-s $(( $(left 560) - 30 )) \
    --extra-serve-args=--enable-prefix-caching "${GPU_ARGS[@]}" --single-gpu "$P_GPU"
  echo "rc equivalence=$?"
  ;;
s)
  TRAFFIC_BUDGET_S=$(( $(left 560) - 20 )) bash "$HERE/traffic.sh" "$W/aborts" \
    --model /tmp/tiny --modes vanilla,kvpd-staged,kvpd-push --push-concurrent \
    --issue-aborts --repeats 2 "${GPU_ARGS[@]}"
  echo "rc aborts=$?"
  ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
for f in "$W"/*/load-summary.txt "$W"/eq/summary.txt "$W"/bench/summary.txt; do
  [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")-summary.txt"
done
for d in "$W"/*/; do  # one archive per run: each stays under the 16 MiB hand-back limit
  tar czf "$OUT/$PART-$(basename "$d").tar.gz" -C "$W" "$(basename "$d")"
done
ls -la "$OUT"
echo "part $PART done in $(( $(date +%s) - T0 ))s"
