#!/usr/bin/env bash
# Colocated PD (P and D on one GPU) measured side by side: one instance without PD, vanilla
# vLLM PD, and kvcached-pd's staged transport on its default wire (KVCACHED_PD_WIRE unset:
# auto, CUDA IPC when D can open P's staging, which on one GPU it must) and on the NIXL
# READ (KVCACHED_PD_WIRE=nixl); kvcached's default settings, vLLM as installed on the host.
# One part per host command (< 10 minutes each; the host hands back at most 8 files).
#
# usage: bash experiments/run_colocated_on_host.sh OUT PART
#   PART a (~4 min): transfer benchmark on kvbig (256 KiB KV/token) at 4, 94 and 1024 MiB
#          per request: vanilla, staged-contiguous (default wire), staged-nixl; effective
#          handoff = P's pack + D's copy/unpack (device times; the NIXL READ between them on
#          the nixl wire); plus the TTFT batch 8 x 3000 tokens through each pair.
#   PART b (~8.5 min): load, kvbig 48 requests 8 at a time (2 repeats) with the TTFT batch
#          8 x 3000 tokens, then tiny 64 requests 16 at a time (3 repeats): the no-PD
#          reference, one kvcached instance without PD (kvcached-single: what of a gap to
#          one instance is kvcached's own), vanilla PD, kvcached-pd pull and push (push
#          legs sent at once), each
#          instance's GPU memory before, under (sampled peak) and after the load, and idle;
#          KVCACHED_PD_TRACE=1 (--trace): the per-stage timeline of where the TTFT goes
#          (results/2026-11-25-h100-colocated/where-the-time-goes.md had no trace of the load).
#          COLO_B_MODELS (default "kvbig tiny"): the loads to run, in order (one alone gets
#          the whole part); COLO_B_LOAD_MODES: their modes (default
#          kvcached-single,kvcached-single-sync,vanilla-p-sync,kvpd-staged-p-sync,
#          kvpd-push-p-sync,kvpd-push: the deployment the README advises, P with
#          --no-async-scheduling, one instance with and without it, and push as vLLM
#          defaults it, for the change; e.g. kvcached-single,kvpd-push for an A/B of one
#          mode against one instance);
#          COLO_TTFT_REPEATS (default 3): kvbig's TTFT batch that many times a mode.
#          COLO_CUDA_GRAPHS=1 (parts a to e): vLLM's CUDA graphs in every
#          instance instead of --enforce-eager (below). COLO_SERVE_ARGS: `vllm serve`
#          flags for every instance of the loads (e.g. --cudagraph-metrics).
#   PART c (~6 min): equivalence with D's prefix cache on, push legs sent at once: reference,
#          vanilla, staged pull and push on kvcached's default (contiguous) layout and on
#          the split layout, mixed fleets both ways, P16/D32, the negative control (must
#          DIFFER). COLO_EQ_MODES: the modes to run instead (e.g. "reference blocksize
#          negative": what an earlier run's deadline cut).
#   PART d (~5 min): the issue's client aborts x5 (tiny 64/16, every 9th client drops its P
#          leg after 50 ms and its D leg after 10 ms): kvcached-pd pull and push
#          (COLO_D_LOAD_MODES: other load modes, e.g. kvpd-push-p-sync; COLO_CUDA_GRAPHS=1:
#          with vLLM's CUDA graphs, the dispatch prompt_tail_graph changes on vLLM 0.30).
#   PART e (~8 min): probe_cuda_ipc.py (does a process mapping another's memory through
#          CUDA IPC survive its death?) and, where present, ipc_selftest.py (the same of
#          kvcached-pd's own IPC layer), then D killed once COLO_KILL_AFTER (default 48)
#          of a 128-request load's requests completed, then P killed likewise (tiny; pull
#          and push): the survivor serves, its memory returns, and pd_load.py checks that
#          requests were in flight at the kill (until 2026-11-29d the kill came 1 s in,
#          after the whole load once CUDA graphs made it a one-second load).
#          COLO_KILLS (default "decode prefill"): the roles killed, in order, the part's
#          time split among them by load runs (2026-11-26: half of 560 s held kill D in pull
#          mode only, twice; COLO_KILLS=decode gives it the whole part), each ROLE or
#          ROLE:MODES (e.g. "decode:kvpd-push": that role killed under those load modes
#          only; default kvpd-staged,kvpd-push). COLO_PROBES=0: the kills alone (the
#          probes' answers are known by now and take a minute of the part);
#          COLO_PROBES=selftest: ipc_selftest.py alone (~30 s), on P's and D's GPUs.
#   PART f (~6 min): UCX faults (tiny 64/16, one repeat): experiments/ucx_fault's
#          injector preloaded into P and D fails every 8th UCX operation it hooks, on both
#          sides: vanilla PD, kvcached-pd pull and push on the default wire (CUDA IPC: the
#          faults reach only the NIXL notifications) and pull with KVCACHED_PD_WIRE=nixl
#          (the faults reach the READs too); D must stay alive and every completed output
#          equal the reference.
# Every staged pair must name its wire in D's log ("kvcached-pd: staged peer ... wire ipc";
# --expect-wire ipc; nixl across two GPUs with KVPD_D_SEES_P=0, where D cannot map P's
# staging), with no IPC->NIXL fallback, except staged-nixl (forced nixl). A mode
# whose servers do not start is reported by its harness with the reason (the other modes
# go on); every run's exit status is printed as "rc NAME=N" and in OUT/PART.log.
# Minutes are estimated from the one-GPU sessions of 2026-11-24 (instances start in
# 45-120 s when 5-7 start at once on one GPU; the vanilla and NIXL-wire pairs move KV at
# ~0.4 GB/s there, so their kvbig runs dominate parts a and b).
#
# Environment: KVPD_GPUS="P D" (default "0 0": both on GPU 0; on two GPUs D sees "D,P"
#   unless KVPD_D_SEES_P=0), COLO_BUDGET_S (a part's
#   seconds, default 560), COLO_STAGING_MB (part b: KVCACHED_PD_STAGING_MB on the
#   kvcached-pd instances), COLO_ABORT_REPEATS (part d, default 5), COLO_TRACE=1 (part d with
#   kvcached-pd's trace lines: the timeline of a differing output), TINY_MODEL=/tmp/tiny,
#   KVBIG_MODEL=/tmp/kvbig, COLO_PORT_BASE (the harnesses' ports: below), KVCACHED_PD_FROM=checkout (this checkout first on PYTHONPATH)
#   | installed, COLO_DRY_RUN=1 (print each harness command instead of running it: the
#   offline tests check every part's arguments with the harnesses' own parsers).
# OUT gets: commit.txt, PART.log, install.log (when the install ran), and per run
# PART-RUN.tar.gz (its whole tree, logs included) with RUN-summary.txt (part e's probes:
# e-probe.tar.gz, their JSON also printed to e.log). At most 8 files.
set -uo pipefail
USAGE="usage: run_colocated_on_host.sh OUT a|b|c|d|e|f"
OUT=${1:?$USAGE}
PART=${2:?$USAGE}
case "$PART" in a|b|c|d|e|f) ;; *) echo "unknown part '$PART'; $USAGE" >&2; exit 2 ;; esac
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
DRY=${COLO_DRY_RUN:-0}
TINY=${TINY_MODEL:-/tmp/tiny}
KVBIG=${KVBIG_MODEL:-/tmp/kvbig}
export PYTHONUNBUFFERED=1
if [ "${KVCACHED_PD_FROM:-checkout}" = checkout ]; then
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT"
# the PID too: two lanes that start the same part in the same second (colo-g beside colo-h,
# 2026-11-27g) shared one folder, and each packed the other's run into its own results
W=/tmp/kvpd-colo-$PART-$(date +%H%M%S)-$$
[ "$DRY" = 1 ] || mkdir -p "$W"
[ "$DRY" = 1 ] || exec > >(tee -a "$OUT/$PART.log") 2>&1
T0=$(date +%s)
BUDGET=${COLO_BUDGET_S:-560}  # the part's seconds: the host kills a command at 600
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
read -r P_GPU D_GPU <<< "${KVPD_GPUS:-0 0}"
# P and D on two GPUs: D also sees P's GPU, second in its list (its own stays device 0),
# so that the IPC wire can map P's staging through peer access; with only its own GPU
# visible D falls back to NIXL ("the peer's GPU ... is not visible", 2 x H100, 2026-11-25).
# Every mode gets it, vanilla included. KVPD_D_SEES_P=0: D sees its own GPU alone.
D_VISIBLE=$D_GPU
if [ "$P_GPU" != "$D_GPU" ] && [ "${KVPD_D_SEES_P:-1}" = 1 ]; then D_VISIBLE="$D_GPU,$P_GPU"; fi
GPU_ARGS=(--prefill-gpu "$P_GPU" --decode-gpu "$D_VISIBLE")
# the wire every kvcached-pd mode must report: ipc, except across two GPUs with D seeing its
# own alone, where `auto` falls back to NIXL (D's staging then allocated at its first READ)
WIRE=ipc
[ "$P_GPU" != "$D_GPU" ] && [ "${KVPD_D_SEES_P:-1}" = 0 ] && WIRE=nixl
# COLO_PORT_BASE: the harnesses' HTTP ports from there, side channels from +200, proxies
# from +400 (unset: their defaults). Two parts started at once on one host with the same
# defaults pick the same free ports, and a harness then takes the other's servers for its
# own (2026-11-26: lane C's aborts run sent its requests to lane T's kvbig servers).
# COLO_CUDA_GRAPHS=1: parts a to e run every instance with vLLM's CUDA graphs (its
# default) instead of --enforce-eager (the harnesses' default: eager decode steps of the
# test models cost 22-38 ms of host launches, and D runs one step more than one instance
# before its first token). Eager, vLLM 0.30's prompt_tail_graph changes nothing: the
# equivalence (c) and the kills (e) ran eager until 2026-11-29d.
GRAPH_ARGS=()
[ "${COLO_CUDA_GRAPHS:-0}" = 1 ] && GRAPH_ARGS=(--cuda-graphs)
# part b's kvcached-pd instances with KVCACHED_PD_STAGING_MB (the harness hands its
# servers none of the caller's KVCACHED_* variables): what a larger staging does to the
# TTFT batch's waits for room, and what it costs an idle P
STAGING_ARGS=()
[ -n "${COLO_STAGING_MB:-}" ] && STAGING_ARGS=(--staging-mb "$COLO_STAGING_MB")
# COLO_SERVE_ARGS: `vllm serve` flags for every instance of part b's loads, e.g.
# --cudagraph-metrics (vLLM 0.26+ logs the CUDA graph modes its steps ran at each stats
# interval, read by cudagraph_modes.py): on vLLM 0.30.0 a quarter of D's steps, those that
# run a loaded request's first forward, left the FULL decode graph without kvcached-pd's
# prompt_tail_graph patch (2026-11-29c)
SERVE_ARGS=()
[ -n "${COLO_SERVE_ARGS:-}" ] && SERVE_ARGS=("--extra-serve-args=$COLO_SERVE_ARGS")
# COLO_TTFT_REPEATS (default 3): part b's kvbig TTFT batch (8 x 3000 tokens) this many
# times a mode, the modes in turn (pd_load.py --ttft-batch-repeats): one batch is one
# sample, and the same tree's push P-sync measured 1.35x one instance in one run and
# 1.57x / 1.63x in the next two (2026-11-29d/e); the repeats cost vanilla PD ~14 s each
TTFT_REPEATS=${COLO_TTFT_REPEATS:-3}
# COLO_FREEZE_OTHERS=1: part b's loads stop every other mode's servers while one mode is
# measured (pd_load.py --freeze-others): an idle PD instance's NIXL agents spin a CPU each,
# and the other modes' instances held 6-16 of a lane's CPUs, by count (2026-11-28f)
FREEZE_ARGS=()
[ "${COLO_FREEZE_OTHERS:-0}" = 1 ] && FREEZE_ARGS=(--freeze-others)
PORT_ARGS=()
if [ -n "${COLO_PORT_BASE:-}" ]; then
  PORT_ARGS=(--port-base "$COLO_PORT_BASE" --side-channel-port-base $((COLO_PORT_BASE + 200))
             --proxy-port-base $((COLO_PORT_BASE + 400)))
fi

run() {  # run a harness, or with COLO_DRY_RUN=1 print it
  if [ "$DRY" = 1 ]; then printf 'DRY:'; printf ' %q' "$@"; echo; return 0; fi
  "$@"
}
traffic() {  # traffic NAME BUDGET_S pd_load-options...: one pd_load run, packed into $W/NAME
  local name=$1 budget=$2
  shift 2
  run env TRAFFIC_BUDGET_S="$budget" bash "$HERE/traffic.sh" "$W/$name" "$@" "${PORT_ARGS[@]}"
  echo "rc $name=$?"
}

if [ "$DRY" != 1 ]; then
  echo "run_colocated_on_host part $PART: $(date '+%F %T') P on GPU $P_GPU, D on GPU $D_GPU," \
    "PYTHONPATH=${PYTHONPATH:-}"
  if ! python3 -c "import vllm, kvcached.integration.vllm.interfaces, kvcached_pd" 2>/dev/null; then
    bash "$HERE/gpu_host/install_on_host.sh" > "$OUT/install.log" 2>&1 || {
      tail -20 "$OUT/install.log"; exit 1; }
    tail -3 "$OUT/install.log"
  fi
  git -C "$REPO" log -1 --format='commit %H %s' 2>/dev/null | tee "$OUT/commit.txt"
  git -C "$REPO" status --short 2>/dev/null | head -20 >> "$OUT/commit.txt"
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader || true
  for spec in "$TINY tiny" "$KVBIG kvbig"; do
    read -r path preset <<< "$spec"
    [ -f "$path/config.json" ] || python3 "$HERE/gpu_host/make_test_model.py" "$path" \
      --preset "$preset" 2>&1 | tail -1
  done
fi

case "$PART" in
a)
  run timeout --signal=TERM --kill-after=20 $(( $(left) - 5 )) \
    python3 "$HERE/bench_transfer.py" --out "$W/bench" --model "$KVBIG" \
    --modes vanilla,staged-contiguous,staged-nixl --sizes 4,94,1024 --staging-mb 0 \
    --ttft-batch 8 --ttft-prompt-tokens 3000 --deadline-s $(( $(left) - 20 )) \
    "${GRAPH_ARGS[@]}" "${GPU_ARGS[@]}"
  echo "rc bench=$?"
  ;;
b)
  read -r -a b_models <<< "${COLO_B_MODELS:-kvbig tiny}"
  B_MODES=${COLO_B_LOAD_MODES:-kvcached-single,kvcached-single-sync,vanilla-p-sync,kvpd-staged-p-sync,kvpd-push-p-sync,kvpd-push}
  for m in "${b_models[@]}"; do
    case "$m" in
      kvbig)  # 11/20 of the part when tiny follows, all of it alone
        share=20; [ "${#b_models[@]}" -gt 1 ] && share=11
        traffic kvbig $(( $(left) * share / 20 - (share == 20 ? 25 : 0) )) --model "$KVBIG" \
          --modes "$B_MODES" \
          --push-concurrent --repeats 2 --ttft-batch 8 --ttft-prompt-tokens 3000 \
          --ttft-batch-repeats "$TTFT_REPEATS" --settle-s 20 \
          --expect-wire "$WIRE" --trace "${GRAPH_ARGS[@]}" "${STAGING_ARGS[@]}" "${FREEZE_ARGS[@]}" "${GPU_ARGS[@]}" \
          "${SERVE_ARGS[@]}" ;;
      tiny)
        traffic tiny $(( $(left) - 25 )) --model "$TINY" \
          --modes "$B_MODES" \
          --push-concurrent --repeats 3 --settle-s 20 --expect-wire "$WIRE" --trace \
          "${GRAPH_ARGS[@]}" "${STAGING_ARGS[@]}" "${FREEZE_ARGS[@]}" "${GPU_ARGS[@]}" \
          "${SERVE_ARGS[@]}" ;;
      *) echo "COLO_B_MODELS: unknown model '$m' (kvbig, tiny)" >&2; exit 2 ;;
    esac
  done
  ;;
c)
  read -r -a eq_modes <<< "${COLO_EQ_MODES:-reference vanilla staged-contiguous \
push-contiguous kvcached-pd-staged push mixed-p mixed-d blocksize negative}"
  run timeout $(( $(left) - 15 )) bash "$HERE/equivalence.sh" "$W/eq" "${eq_modes[@]}" \
    --model "$TINY" --parallel 2 --push-concurrent --expect-wire "$WIRE" \
    --deadline-s $(( $(left) - 35 )) --extra-serve-args=--enable-prefix-caching \
    "${GPU_ARGS[@]}" --single-gpu "$P_GPU" "${PORT_ARGS[@]}" "${GRAPH_ARGS[@]}"
  echo "rc equivalence=$?"
  ;;
d)
  traffic aborts $(( $(left) - 25 )) --model "$TINY" \
    --modes "${COLO_D_LOAD_MODES:-kvpd-staged,kvpd-push}" \
    --push-concurrent --issue-aborts --repeats "${COLO_ABORT_REPEATS:-5}" --expect-wire "$WIRE" "${GPU_ARGS[@]}" \
    "${GRAPH_ARGS[@]}" ${COLO_TRACE:+--trace}
  ;;
e)
  [ "$DRY" = 1 ] || mkdir -p "$W/probe"
  if [ "${COLO_PROBES:-1}" = 1 ]; then  # (COLO_PROBES=selftest printed "rc probe=1" for a probe not run)
    run timeout 150 python3 "$HERE/probe_cuda_ipc.py" --out "$W/probe/probe.json" --sizes-mib 94,1024
    echo "rc probe=$?"
  fi
  if [ "${COLO_PROBES:-1}" != 0 ] && [ -f "$HERE/ipc_selftest.py" ]; then  # the same question asked of kvcached-pd's own layer
    # on P's and D's GPUs (physical indices: no CUDA_VISIBLE_DEVICES here): across two
    # GPUs it reads P's GPU at P's death and at D's unmap
    run timeout 150 python3 "$HERE/ipc_selftest.py" --peer-device "$P_GPU" --device "$D_GPU" \
      --out "$W/probe/selftest.json"
    echo "rc selftest=$?"
  fi
  read -r -a kills <<< "${COLO_KILLS:-decode prefill}"
  kill_modes() {  # kill_modes ROLE[:MODES]: the load modes that kill runs under
    if [ "$1" = "${1%%:*}" ]; then echo kvpd-staged,kvpd-push; else echo "${1#*:}"; fi
  }
  count() { tr ',' '\n' <<< "$1" | wc -l; }  # count A,B,...: how many
  need() {  # need ROLE[:MODES]: the seconds one kill's load run takes, its servers' start
    # included. 2 x H200, 2026-11-27 (lane C beside lane T): every server ready after
    # 118-140 s; a kill-D run 91 s (P holds the extents of D's dead requests for vLLM's KV
    # lease, 30 s, and the harness waits that out plus 15 s), a kill-P run 30-32 s. An
    # even split by runs gave kill D 267 s, and its push run never started (twice); this
    # split gave it 322 s on 2026-11-27g, where its servers took 152 s (lane T starting
    # its own beside them) and push, again, did not start: hence 160 s, and session.sh
    # gives colo-e 720 s instead of the 560 a part gets in one host command.
    local n
    n=$(count "$(kill_modes "$1")")
    if [ "${1%%:*}" = decode ]; then echo $(( 160 + 95 * n )); else echo $(( 160 + 35 * n )); fi
  }
  needs=0  # what the kills still to come need: the time left is split by that
  for kill in "${kills[@]}"; do needs=$(( needs + $(need "$kill") )); done
  for kill in "${kills[@]}"; do
    # (2026-11-26, eighth session: "decode:kvpd-push prefill" split evenly by kills gave
    # kill P's two runs 280 s, one run's time, so kill P in push mode never ran)
    role=${kill%%:*}
    modes=$(kill_modes "$kill")
    mine=$(need "$kill")
    traffic "kill${role:0:1}" $(( ($(left) - 25) * mine / needs )) --model "$TINY" \
      --modes "$modes" --push-concurrent --requests 128 --kill "$role" \
      --kill-after "${COLO_KILL_AFTER:-48}" --expect-wire "$WIRE" "${GPU_ARGS[@]}" \
      "${GRAPH_ARGS[@]}"
    needs=$(( needs - mine ))
  done
  ;;
f)
  traffic ucxfault $(( $(left) - 25 )) --model "$TINY" \
    --modes vanilla,kvpd-staged,kvpd-push,kvpd-staged-nixl --push-concurrent --repeats 1 \
    --ucx-fault-lib kvpd --ucx-fault-on both --ucx-fault-every 8 --expect-wire "$WIRE" \
    "${GPU_ARGS[@]}"
  ;;
esac
[ "$DRY" = 1 ] && exit 0
for f in "$W"/probe/*.json; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
for f in "$W"/*/load-summary.txt "$W"/eq/summary.txt "$W"/bench/summary.txt; do
  [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")-summary.txt"
done
for d in "$W"/*/; do  # one archive per run: each stays under the 16 MiB hand-back limit
  tar czf "$OUT/$PART-$(basename "$d").tar.gz" -C "$W" "$(basename "$d")"
done
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader || true
ls -la "$OUT"
echo "part $PART done in $(( $(date +%s) - T0 ))s"
