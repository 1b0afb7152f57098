#!/usr/bin/env bash
# One GPU session's experiments, run in the background on the host so that the GPU never
# waits for the next host command (each command may last 10 minutes, the whole lease 30,
# and the start, uploads and install take about 5 of them).
#
#   bash experiments/gpu_host/session.sh start COMMIT   # after install_on_host.sh: returns at once
#   bash experiments/gpu_host/session.sh wait SECONDS OUT   # returns when every lane is done
#                                                         # or after SECONDS; packs into OUT
#   bash experiments/gpu_host/session.sh dry COMMIT    # print the steps and their commands
#
# `start` copies this checkout to /tmp/kvpd-session/repo (a later host command replaces
# the uploaded checkout; the running scripts must not see it change) and starts, in a new
# process session (the host ends a command's other processes when it returns):
#
#   with two GPUs (SESSION_GPUS=2, the default when nvidia-smi lists two):
#     lane T, GPU 0 alone, timings (P and D on GPU 0):
#       handoff  bench_handoff.py with --baseline (the tree before format 3 and the host
#                overhead cuts, .gpu/trees/462527c)
#       ab21     bench_transfer.py staged-contiguous 4/94/1024 MiB of the tree before the
#                untrusted-input hardening (211e4d9) and after (462527c), one after the other
#       serve    bench_serve.py: vllm bench serve, round 1, round 2, shared prefixes:
#                reference, vanilla, kvcached-pd pull and push (IPC wire)
#       colo-a   run_colocated_on_host.sh part a (handoff 4/94/1024 MiB + TTFT batch)
#       serve-cap  serve again with KVCACHED_MAX_CACHED_TOKENS=200000: round 1 stays in
#                kvcached's prefix cache (its default 16000 tokens held none of it, 2026-11-25)
#     lane C, GPU 1 alone (P and D on GPU 1; a colo-* step in any other lane runs on GPU 0:
#       on 2026-11-26 colo-e named in lane T still ran on GPU 1, beside lane C's colo-c):
#       colo-c and colo-d side by side: equivalence (prefix caching on D, negative control)
#                and the issue's client aborts x3
#       colo-b   the loads (timings: GPU 1 is alone, the host's CPUs are shared with lane T)
#     lane X, once T and C are done, P on GPU 0 and D on GPU 1:
#       cross-a  run_colocated_on_host.sh part a across the two GPUs (cross-b .. cross-f:
#                parts b to e across them, in a SESSION_PLAN)
#   with one GPU: one lane, in the order handoff, ab21, serve, colo-c, colo-d, colo-a,
#     colo-b, serve-cap (every step alone on the GPU).
#   colo-g, colo-h (not by default) colo-b's kvbig load and TTFT batch (g), its tiny load
#     (h), each with the whole part and vLLM's CUDA graphs in every instance
#     (COLO_CUDA_GRAPHS=1; the harnesses run eager by default)
#   cross-n (not by default) part a across the two GPUs with D seeing its own GPU alone
#     (KVPD_D_SEES_P=0): the auto wire falls back to NIXL, so D allocates its staging range
#     at its first READ (region.DecodeStaging) while vanilla and the forced NIXL wire run
#     beside it: that allocation on a GPU, and what it costs the first READ; cross-dn: part
#     d (the issue's aborts) the same way, so that lazy D staging runs on the NIXL wire
#     under concurrent load with client aborts on either leg
#   STEP.mps (not by default; colo-* steps) STEP with every CUDA process it starts (one
#     instance, vanilla PD, kvcached-pd) a client of one MPS server of its own
#     (gpu_host/with_mps.sh; the step's instances stay on the lane's GPU): P's and D's
#     kernels may share the GPU instead of taking turns, e.g. colo-g.mps colo-d.mps;
#     COLO_B_LOAD_MODES_MPS, where set, replaces COLO_B_LOAD_MODES in these steps alone
#     (e.g. kvpd-push-p-sync-lowprio, which the load harness refuses without MPS)
#   STEP.spy (not by default; colo-* steps) STEP with py-spy sampling every vLLM engine
#     process it starts (gpu_host/with_pyspy.sh: WORKDIR/pyspy/PID.txt, collapsed stacks;
#     experiments/pyspy_summary.py compares them), e.g. colo-h.spy
#   colo-gs (not by default) colo-g with COLO_STAGING_MB=${SESSION_STAGING_MB:-6144} on the
#     kvcached-pd instances: P's staging holding all eight 752 MiB extents of the TTFT
#     batch (the default 4 GiB holds five; the rest wait for D's DONEs)
#   colo-e (either plan: not by default) run_colocated_on_host.sh part e: kill D, then P,
#     mid-load; colo-f, cross-f: part f, UCX faults.
#   chunks (not by default) chunk_split.py on the lane's GPU: greedy tokens per prefill cut
#     of the prompts that differed once (CHUNKS_KNOWN below).
#   launch (not by default) bench_launch_paths.py on the lane's GPU: one pack's and one
#     unpack's span per launch path (no vLLM; ~20 s).
#   STEP.rN (not by default) STEP again, into a folder of its own (work/STEP.rN), e.g. the
#     same load on both GPUs at once ("T colo-h;C colo-h.r2"): a second run of one tree
#     with servers of its own (2026-11-28d: one run of each load, and runs of one tree
#     had spread 1.34-1.57x). Written last (colo-d.mps.r2, colo-h.t-polled.r2).
#   STEP.t-TREE (not by default) STEP run from the tree .gpu/trees/TREE (its package, its
#     harnesses; carried to the host like the uploads), e.g. main's colo-h beside
#     colo-h.t-polled for a package change measured on the same install. The trees are
#     plain copies (no .git); `git archive BRANCH | tar -x -C .gpu/trees/NAME` makes one.
# SESSION_PLAN replaces the plan: lanes separated by ';', each "NAME STEP..." (a lane named X
# runs once the others are done), e.g. "T ab21 serve;C colo-b;X cross-a@033". A step named
# STEP@TAG runs with the venv ${SESSION_VENV_ROOT:-/tmp}/vTAG first on PATH (another vLLM,
# installed while the first steps run: PYTHON=/tmp/vTAG/bin/python3 install_on_host.sh),
# once that venv holds a file .ready; a step whose venv is not ready before its estimate
# stops fitting is recorded as not run. SESSION_AB21_TREES (default "211e4d9 462527c"):
# the trees of ab21 in their order, .gpu/trees/NAME or HEAD (the session's own copy), a
# tree named twice run twice (interleave them: "211e4d9 HEAD 211e4d9 HEAD"), each into
# ab21/N-NAME;
# SESSION_AB21_REPEATS (default 4); SESSION_SERVE_MODES (default vanilla,kvpd-staged,kvpd-push);
# SESSION_ABORT_REPEATS (colo-d, default 3).
# (bench_serve gets ports of its own, 22000+: the load harness's defaults serve lane C.)
# Every step starts only if its estimate fits before the session's deadline
# (SESSION_MINUTES after `start`, default 20; or SESSION_SECONDS) and is cut off there; steps.txt records each
# step's rc, seconds and, for a step not run, why.
#
# `wait` packs lane by lane into OUT (the host hands back at most 8 files of <= 16 MiB):
# session.txt (steps.txt + each lane's log tail), T.tar.gz, C.tar.gz, X.tar.gz (the
# finished steps' trees), and each step's summary-*.txt. Safe to call more than once: each
# call packs everything finished so far.
set -uo pipefail
S=${SESSION_DIR:-/tmp/kvpd-session}
ACTION=${1:?usage: session.sh start COMMIT | wait SECONDS OUT | dry COMMIT}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

est() {  # est STEP: estimated minutes (2026-11-24/25 sessions, one H100, instances started at once;
  # across two GPUs no NIXL pair moves KV at 0.5 GB/s: 2 x H100, 2026-11-26, cross-a took
  # 100-123 s and cross-b 216-253 s, and cross-b's 9 minutes kept cross-c from starting;
  # cross-d started with 300 s left ran 4 of its 5 abort repeats: 6 minutes; cross-f took
  # 133 s on 2 x H100, 2026-11-27; 2 x H200, 2026-11-27e: colo-g took 150-192 s and colo-h
  # 157 s with vLLM's CUDA graphs (its 8 minutes kept colo-h out of a 620 s session), cross-b
  # 293 s)
  [ -n "${SESSION_FAKE_STEPS:-}" ] && { echo 0; return; }
  local step=${1%@*}
  step=${step%.r[0-9]*}
  step=${step%.t-*}
  step=${step%.spy}
  case ${step%.mps} in
    handoff) echo 3 ;; ab21) echo 4 ;; serve|serve-cap) echo 6 ;; colo-a) echo 5 ;;
    cross-a|cross-n) echo 3 ;; colo-c|cross-c) echo 7 ;; colo-d) echo 5 ;; cross-d) echo 6 ;; colo-b) echo 9 ;;
    cross-b) echo 6 ;; colo-g|colo-h|colo-gs) echo 4 ;; cross-dn) echo 6 ;; colo-e|cross-e) echo 12 ;; colo-f) echo 6 ;; cross-f) echo 3 ;; chunks) echo 3 ;;
    launch) echo 1 ;;
    *) echo 5 ;;
  esac
}

# chunks: the greedy tokens the load harness saw for two prompts that differed once
# (2026-11-26g-h200x2-session): load-034-1167's reference and the push output that
# differed from token 1, load-063-704's two references (the session's, the traced rerun's)
CHUNKS_KNOWN="--known load-034-1167=reference:30958,17698,6849,16431,10944,18374,8933,31150 \
--known load-034-1167=pd-push-differing:30958,24499,6716,692,21434,12906,7669,407 \
--known load-063-704=reference-a:30952,24493,26373,18773,449,29445,30044,5974 \
--known load-063-704=reference-b:30952,24493,26373,31781,7942,3015,8267,7377"

lane_gpu() {  # lane_gpu LANE: the GPU a lane's colocated steps use (C: GPU 1 with two GPUs)
  if [ "$1" = C ]; then echo "$LANE_C_GPU"; else echo 0; fi
}

lane_ports() {  # lane_ports LANE [SLOT]: the port base of a lane's harnesses (C: its own, so
  # that two lanes' harnesses started at once never pick the same free ports; cross-* steps
  # too, since two lanes of correctness runs may share both GPUs). SLOT: the place of a step
  # among those an "a+b" item runs side by side; each gets its own base (2026-11-27, 2 x
  # H100: lane C's colo-c and colo-d both got 23000, their first kvcached-pd servers met
  # "Address already in use" and both modes were lost). Slot 0 of lane T keeps the
  # harnesses' defaults, which differ from one harness to the next.
  local slot=${2:-0}
  if [ "$1" = C ]; then echo "COLO_PORT_BASE=$(( 23000 + 1000 * slot )) "
  elif [ "$slot" -gt 0 ]; then echo "COLO_PORT_BASE=$(( 26000 + 1000 * slot )) "; fi
}

step_cmd() {  # step_cmd STEP WORKDIR: the command of one step, run from the session's repo
  # (LANE_GPU: the GPU of the lane that runs it, lane_gpu)
  local step=${1%@*} w=$2
  step=${step%.r[0-9]*}
  if [ -n "${SESSION_FAKE_STEPS:-}" ]; then  # the offline test: each step sleeps and writes
    echo "sleep $SESSION_FAKE_STEPS; echo $1 \$(command -v python3) > $w/summary.txt;" \
         "echo '${LANE_PORTS}gpu $LANE_GPU' > $w/lane.txt; echo \$COLO_BUDGET_S > $w/budget.txt;" \
         "[ $step != colo-d ]"
    return
  fi
  if [[ "$step" == *.t-* ]]; then  # the step from another tree (.gpu/trees/TREE)
    echo "cd .gpu/trees/${step##*.t-} && $(step_cmd "${step%.t-*}" "$w")"
    return
  fi
  if [[ "$step" == colo-*.spy ]]; then  # the step with py-spy on every engine process
    echo "bash experiments/gpu_host/with_pyspy.sh $w bash -c" \
         "$(printf %q "$(step_cmd "${step%.spy}" "$w")")"
    return
  fi
  if [[ "$step" == colo-*.mps ]]; then  # the step under an MPS server of its own
    # COLO_B_LOAD_MODES_MPS: the loads' modes of .mps steps alone (modes whose P is an MPS
    # client of a lower priority or SM share are refused without a server)
    local modes=""
    [ -n "${COLO_B_LOAD_MODES_MPS:-}" ] && modes="COLO_B_LOAD_MODES=$COLO_B_LOAD_MODES_MPS "
    echo "bash experiments/gpu_host/with_mps.sh $w bash -c" \
         "$(printf %q "$modes$(step_cmd "${step%.mps}" "$w")")"
    return
  fi
  case $step in
    handoff) echo "CUDA_VISIBLE_DEVICES=0 python3 experiments/bench_handoff.py --out $w" \
                  "--baseline .gpu/trees/462527c" ;;
    ab21) echo "n=0; for c in ${SESSION_AB21_TREES:-211e4d9 462527c}; do n=\$((n + 1));" \
               "(if [ \$c = HEAD ]; then cd .; else cd .gpu/trees/\$c; fi && PYTHONPATH=\$PWD" \
               "timeout 200 python3 experiments/bench_transfer.py --out $w/\$n-\$c" \
               "--model /tmp/kvbig --modes staged-contiguous --sizes 4,94,1024" \
               "--repeats ${SESSION_AB21_REPEATS:-4}" \
               "--staging-mb 0 --ttft-batch 0 --deadline-s 185 --prefill-gpu 0" \
               "--decode-gpu 0; echo \"rc \$c=\$?\"); done" ;;
    serve) echo "python3 experiments/bench_serve.py --out $w --model /tmp/tiny" \
                "--modes ${SESSION_SERVE_MODES:-vanilla,kvpd-staged,kvpd-push}" \
                "--push-concurrent --expect-wire ipc" \
                "--prefill-gpu 0 --decode-gpu 0 --deadline-s 420 --port-base 22000" ;;
    serve-cap) echo "python3 experiments/bench_serve.py --out $w --model /tmp/tiny" \
                "--modes vanilla,kvpd-staged,kvpd-push --push-concurrent --expect-wire ipc" \
                "--kvcached-env KVCACHED_MAX_CACHED_TOKENS=200000" \
                "--prefill-gpu 0 --decode-gpu 0 --deadline-s 420 --port-base 22000" ;;
    chunks) echo "CUDA_VISIBLE_DEVICES=$LANE_GPU python3 experiments/chunk_split.py --out $w" \
                 "--model /tmp/tiny --step 4 $CHUNKS_KNOWN" ;;
    launch) echo "CUDA_VISIBLE_DEVICES=$LANE_GPU python3 experiments/bench_launch_paths.py" \
                 "--out $w/launch-paths.json > $w/launch-paths.log 2>&1" ;;
    colo-a) echo "KVPD_GPUS='0 0' bash experiments/run_colocated_on_host.sh $w a" ;;
    colo-b) echo "${LANE_PORTS}KVPD_GPUS='$LANE_GPU $LANE_GPU' bash experiments/run_colocated_on_host.sh $w b" ;;
    colo-[gh]) echo "${LANE_PORTS}KVPD_GPUS='$LANE_GPU $LANE_GPU' COLO_CUDA_GRAPHS=1" \
                    "COLO_B_MODELS=$([ "$step" = colo-g ] && echo kvbig || echo tiny)" \
                    "bash experiments/run_colocated_on_host.sh $w b" ;;
    colo-gs) echo "${LANE_PORTS}KVPD_GPUS='$LANE_GPU $LANE_GPU' COLO_CUDA_GRAPHS=1" \
                  "COLO_B_MODELS=kvbig COLO_STAGING_MB=${SESSION_STAGING_MB:-6144}" \
                  "bash experiments/run_colocated_on_host.sh $w b" ;;
    colo-c) echo "${LANE_PORTS}KVPD_GPUS='$LANE_GPU $LANE_GPU' bash experiments/run_colocated_on_host.sh $w c" ;;
    colo-d) echo "${LANE_PORTS}KVPD_GPUS='$LANE_GPU $LANE_GPU'" \
                 "COLO_ABORT_REPEATS=${SESSION_ABORT_REPEATS:-3}" \
                 "bash experiments/run_colocated_on_host.sh $w d" ;;
    colo-[ef]) echo "${LANE_PORTS}KVPD_GPUS='$LANE_GPU $LANE_GPU' bash experiments/run_colocated_on_host.sh $w ${step#colo-}" ;;
    cross-d) echo "${LANE_PORTS}KVPD_GPUS='0 1' COLO_ABORT_REPEATS=${SESSION_ABORT_REPEATS:-3}" \
                  "bash experiments/run_colocated_on_host.sh $w d" ;;
    cross-[abcef]) echo "${LANE_PORTS}KVPD_GPUS='0 1' bash experiments/run_colocated_on_host.sh $w ${step#cross-}" ;;
    cross-n) echo "${LANE_PORTS}KVPD_GPUS='0 1' KVPD_D_SEES_P=0 bash experiments/run_colocated_on_host.sh $w a" ;;
    cross-dn) echo "${LANE_PORTS}KVPD_GPUS='0 1' KVPD_D_SEES_P=0" \
                   "COLO_ABORT_REPEATS=${SESSION_ABORT_REPEATS:-3}" \
                   "bash experiments/run_colocated_on_host.sh $w d" ;;
  esac
}

run_step() {  # run_step LANE STEP [SLOT]: one step inside the session's deadline (SLOT: lane_ports)
  local lane=$1 step=$2 w=$S/work/$2 left need t0 rc venv="" path=$PATH
  local LANE_GPU LANE_PORTS
  LANE_GPU=$(lane_gpu "$lane")
  LANE_PORTS=$(lane_ports "$lane" "${3:-0}")
  need=$(( $(est "$step") * 60 ))
  if [[ "$step" == *@* ]]; then  # another vLLM's venv: wait until its install is done
    venv=${SESSION_VENV_ROOT:-/tmp}/v${step#*@}
    while [ ! -f "$venv/.ready" ] \
          && [ $(( $(cat $S/deadline) - $(date +%s) )) -ge "$need" ]; do sleep 5; done
    if [ ! -f "$venv/.ready" ]; then
      echo "$step lane=$lane rc=- s=0 not run: $venv/.ready never appeared" >> $S/steps.txt
      return
    fi
    path=$venv/bin:$PATH
  fi
  left=$(( $(cat $S/deadline) - $(date +%s) ))
  if [ "$left" -lt "$need" ]; then
    echo "$step lane=$lane rc=- s=0 not run: ${left}s left, estimate ${need}s" >> $S/steps.txt
    return
  fi
  mkdir -p "$w"
  t0=$(date +%s)
  echo "[$(date +%T)] $lane: $step${venv:+ (PATH from $venv)}: $(step_cmd "$step" "$w")"
  # a part's seconds: 560 fits one host command (killed at 600); the kills of part e need
  # more (two server starts and three load runs: colo-e's kill D push never started
  # within 560, 2026-11-27f and g), and a session's step is not one host command
  local cap=560
  local base=${step%@*}
  case ${base%.r[0-9]*} in colo-e|cross-e) cap=720 ;; esac
  (cd $S/repo && PATH=$path COLO_BUDGET_S=$(( left - 20 < cap ? left - 20 : cap )) \
     timeout --signal=TERM --kill-after=20 "$left" bash -c "$(step_cmd "$step" "$w")") \
     > "$w/step.log" 2>&1
  rc=$?
  echo "$step lane=$lane rc=$rc s=$(( $(date +%s) - t0 ))" >> $S/steps.txt
  echo "[$(date +%T)] $lane: $step done rc=$rc in $(( $(date +%s) - t0 ))s"
  touch "$w/.done"
}

lane() {  # lane NAME STEP...: steps one after the other; "a+b" runs a and b side by side
  local name=$1; shift
  for item in "$@"; do
    if [[ "$item" == *+* ]]; then
      local slot=0
      for s in ${item//+/ }; do run_step "$name" "$s" "$slot" & slot=$((slot + 1)); done
      wait
    else
      run_step "$name" "$item"
    fi
  done
  touch $S/lane-$name.done
}

plan() {  # the lanes, one per line: NAME STEP... (lane X: after the others)
  if [ -n "${SESSION_PLAN:-}" ]; then
    echo "$SESSION_PLAN" | tr ';' '\n' | sed 's/^ *//; /^$/d'
  elif [ "$SESSION_GPUS" -ge 2 ]; then
    echo "T handoff ab21 serve colo-a serve-cap"
    echo "C colo-c+colo-d colo-b"
    echo "X cross-a"
  else
    echo "T handoff ab21 serve colo-c colo-d colo-a colo-b serve-cap"
  fi
}

case $ACTION in
start|dry)
  COMMIT=${2:?usage: session.sh start COMMIT}
  # (grep -c prints 0 and fails where nvidia-smi lists nothing: "|| echo 1" gave "0 1")
  listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  SESSION_GPUS=${SESSION_GPUS:-$([ "${listed:-0}" -ge 1 ] && echo "$listed" || echo 1)}
  LANE_C_GPU=$([ "$SESSION_GPUS" -ge 2 ] && echo 1 || echo 0)
  if [ "$ACTION" = dry ]; then
    plan | while read -r name steps; do
      LANE_GPU=$(lane_gpu "$name")
      for item in $steps; do
        slot=0
        for s in ${item//+/ }; do
          LANE_PORTS=$(lane_ports "$name" "$slot")
          echo "$name $s: $(step_cmd "$s" "$S/work/$s")"
          slot=$((slot + 1))
        done
      done
    done
    exit 0
  fi
  rm -rf $S && mkdir -p $S/work
  mkdir -p $S/repo  # the checkout and the carried trees, not the wheel uploads or venvs
  tar -C "$HERE" --exclude=./.gpu/up\* --exclude=./.gpu/v\* --exclude=./.venv\* --exclude=./.cache -cf - . \
    | tar -C $S/repo -xf -
  echo "commit $COMMIT (tree copied from $HERE at $(date '+%F %T'))" > $S/commit.txt
  nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv,noheader \
    >> $S/commit.txt 2>&1
  echo $(( $(date +%s) + ${SESSION_SECONDS:-$(( ${SESSION_MINUTES:-20} * 60 ))} )) > $S/deadline
  export SESSION_GPUS LANE_C_GPU PYTHONUNBUFFERED=1
  plan > $S/plan.txt
  export -f est lane_gpu lane_ports step_cmd run_step lane
  export S SESSION_VENV_ROOT SESSION_AB21_TREES SESSION_AB21_REPEATS SESSION_SERVE_MODES \
    SESSION_ABORT_REPEATS
  setsid nohup bash -c '
    lanes=()
    while read -r name steps; do
      [ "$name" = X ] && continue
      lane "$name" $steps > $S/lane-$name.log 2>&1 &
      lanes+=($!)
    done < $S/plan.txt
    wait "${lanes[@]}"
    x=$(awk '\''$1 == "X" {$1 = ""; print}'\'' $S/plan.txt)
    if [ -n "$x" ]; then lane X $x > $S/lane-X.log 2>&1; fi
    touch $S/all.done
  ' > $S/session.log 2>&1 < /dev/null &
  echo "session started: $(cat $S/plan.txt | tr '\n' ';') deadline $(date -d @$(cat $S/deadline) +%T)"
  ;;
wait)
  SECS=${2:?usage: session.sh wait SECONDS OUT}
  OUT=${3:?usage: session.sh wait SECONDS OUT}
  # No session here: the machine this call runs on is not the one `start` ran on (a
  # machine lost between two calls comes back bare). Say so at once: on 2026-11-29c a
  # wait on such a machine slept its whole 585 s of device time for nothing.
  if [ ! -f $S/commit.txt ]; then
    echo "session.sh wait: no session on this machine ($S/commit.txt missing): it is not" \
      "the machine \`start\` ran on (lost between calls?); nothing to wait for" >&2
    exit 3
  fi
  end=$(( $(date +%s) + SECS ))
  while [ ! -f $S/all.done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  mkdir -p "$OUT"
  { cat $S/commit.txt; echo; echo "== steps"; cat $S/steps.txt 2>/dev/null
    [ -f $S/all.done ] && echo "(all lanes done)" || echo "(still running at $(date +%T))"
    for f in $S/lane-*.log $S/session.log; do echo "== $f"; tail -30 "$f"; done
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader; } > "$OUT/session.txt" 2>&1
  for lanef in $S/lane-*.log; do
    l=$(basename "$lanef" .log); l=${l#lane-}
    steps=$(awk -v l="$l" '$2 == "lane=" l {print $1}' $S/steps.txt 2>/dev/null | sort -u)
    [ -n "$steps" ] || continue
    tar czf "$OUT/$l.tar.gz" -C $S/work $steps 2>/dev/null
  done
  # the summaries, readable without unpacking (at most 8 files in all)
  n=$(ls "$OUT" | wc -l)
  for f in $(ls $S/work/*/*summary*.txt $S/work/*/*/summary.txt 2>/dev/null | head -$(( 8 - n ))); do
    rel=${f#$S/work/}; cp "$f" "$OUT/$(echo "$rel" | tr '/' '-')"
  done
  cat "$OUT/session.txt"
  ls -la "$OUT"
  ;;
*) echo "unknown action $ACTION" >&2; exit 2 ;;
esac
